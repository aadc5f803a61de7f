#include "torch/runtime.h"

#include <ATen/SavedTensorHooks.h>

#include <limits>
#include <mutex>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "core/host_backend.h"
#include "core/out_of_memory.h"
#include "core/residency_manager.h"
#include "torch/bindings.h"
#include "torch/cpu_allocator.h"
#include "torch/lineage_recorder.h"
#include "torch/saved_activation.h"

#include "torch/cuda_symbols.h"

namespace py = pybind11;

namespace membudget {
namespace {

Runtime* g_runtime = nullptr;
std::mutex g_create_mutex;

size_t budget_or_unbounded(size_t bytes) {
  return bytes == 0 ? std::numeric_limits<size_t>::max() : bytes;
}

ManagerConfig manager_config(const RuntimeConfig& config) {
  ManagerConfig m;
  m.policy = config.policy;
  m.prefetch_bytes = config.prefetch_bytes;
  m.high_watermark = config.high_watermark;
  m.log_decisions = config.log_decisions;
  m.actions = config.actions;
  m.link_bytes_per_s = config.link_bytes_per_s;
  m.recompute_ahead = config.recompute_ahead;
  m.copies_ahead = config.copies_ahead;
  return m;
}

RuntimeConfig config_from_dict(const py::dict& d) {
  RuntimeConfig c;
  if (d.contains("budget_bytes")) c.budget_bytes = d["budget_bytes"].cast<size_t>();
  if (d.contains("host_budget_bytes")) c.host_budget_bytes = d["host_budget_bytes"].cast<size_t>();
  if (d.contains("policy")) c.policy = d["policy"].cast<std::string>();
  if (d.contains("actions")) c.actions = d["actions"].cast<std::string>();
  if (d.contains("min_tensor_bytes")) c.min_tensor_bytes = d["min_tensor_bytes"].cast<size_t>();
  if (d.contains("prefetch_bytes")) c.prefetch_bytes = d["prefetch_bytes"].cast<size_t>();
  if (d.contains("high_watermark")) c.high_watermark = d["high_watermark"].cast<double>();
  if (d.contains("log_decisions")) c.log_decisions = d["log_decisions"].cast<bool>();
  if (d.contains("link_bytes_per_s")) c.link_bytes_per_s = d["link_bytes_per_s"].cast<double>();
  if (d.contains("expandable_segments")) c.expandable_segments = d["expandable_segments"].cast<bool>();
  if (d.contains("recompute_ahead")) c.recompute_ahead = d["recompute_ahead"].cast<bool>();
  if (d.contains("copies_ahead")) c.copies_ahead = d["copies_ahead"].cast<bool>();
  return c;
}

void install_runtime(const std::string& device_kind, int device_index, const py::dict& config_dict) {
  RuntimeConfig config = config_from_dict(config_dict);
  make_filter(config.policy);  // validate before touching anything
  AllowedActions::parse(config.actions);
  if (Runtime* runtime = Runtime::get()) {
    if (runtime->device_kind() != device_kind) {
      throw std::runtime_error("membudget: already installed for " + runtime->device_kind() +
                               "; one process has one managed device");
    }
    if (runtime->config().expandable_segments != config.expandable_segments) {
      throw std::runtime_error(std::string("membudget: the allocator was created with expandable segments ") +
                               (runtime->config().expandable_segments ? "on" : "off") +
                               "; MEMBUDGET_EXPANDABLE_SEGMENTS cannot change within a process");
    }
    runtime->reconfigure(config);
  } else if (device_kind == "cpu") {
    Runtime::create(std::make_unique<HostBackend>(), device_kind, config);
  } else if (device_kind == "cuda") {
    Runtime::create(make_cuda_backend_or_throw(device_index), device_kind, config);
  } else {
    throw std::invalid_argument("membudget: unknown device kind '" + device_kind + "'");
  }
  Runtime::get()->manager().reset_prediction();
  Runtime::get()->set_managing(true);
  if (device_kind == "cpu") install_cpu_allocator();
}

void uninstall_runtime() {
  Runtime* runtime = Runtime::get();
  if (runtime == nullptr) return;
  runtime->set_managing(false);
  if (runtime->device_kind() == "cpu") uninstall_cpu_allocator();
}

py::dict memory_stats() {
  py::dict d;
  Runtime* runtime = Runtime::get();
  if (runtime == nullptr) return d;
  AllocatorStats a = runtime->device_allocator().stats();
  AllocatorStats h = runtime->host_tier().stats();
  ManagerStats m = runtime->manager().stats();
  auto budget = [](size_t b) { return b == std::numeric_limits<size_t>::max() ? size_t{0} : b; };
  d["allocated_bytes.all.current"] = a.allocated_current;
  d["allocated_bytes.all.peak"] = a.allocated_peak;
  d["reserved_bytes.all.current"] = a.reserved_current;
  d["reserved_bytes.all.peak"] = a.reserved_peak;
  d["requested_bytes.all.current"] = a.requested_current;
  d["budget_bytes"] = budget(a.budget);
  d["num_alloc_retries"] = a.num_alloc_retries;
  d["num_ooms"] = a.num_ooms;
  d["num_segments"] = a.num_segments;
  d["expandable_segments"] = runtime->device_allocator().expandable_segments();
  d["segment_page_bytes"] = runtime->device_allocator().segment_page_bytes();
  d["mapped_bytes_total"] = a.mapped_bytes_total;
  d["unmapped_bytes_total"] = a.unmapped_bytes_total;
  d["moved_bytes_total"] = a.moved_bytes_total;
  d["host_tier_reserved_bytes"] = h.reserved_current;
  d["host_tier_peak_bytes"] = h.reserved_peak;
  d["host_budget_bytes"] = budget(h.budget);
  d["swap_out_bytes"] = m.swap_out_bytes;
  d["swap_in_bytes"] = m.swap_in_bytes;
  d["swap_out_count"] = m.swap_out_count;
  d["swap_in_count"] = m.swap_in_count;
  d["recompute_count"] = m.recompute_count;
  d["recompute_bytes"] = m.recompute_bytes;
  d["recompute_seconds"] = m.recompute_seconds;
  d["replay_overhead_seconds"] = m.replay_overhead_seconds;
  d["recomputed_ahead_count"] = m.recomputed_ahead_count;
  d["recompute_ahead_failed"] = m.recompute_ahead_failed;
  d["recompute_ahead_wasted"] = m.recompute_ahead_wasted;
  d["drop_count"] = m.drop_count;
  d["dropped_bytes"] = m.dropped_bytes;
  d["planned_drops"] = m.planned_drops;
  d["evictions_wasted"] = m.evictions_wasted;
  d["policy_seconds"] = m.policy_seconds;
  d["link_bytes_per_s"] = m.link_bytes_per_s;
  d["evicted_bytes"] = m.evicted_bytes;
  d["eviction_count"] = m.eviction_count;
  d["background_swap_count"] = m.background_swap_count;
  d["prefetch_issued"] = m.prefetch_issued;
  d["prefetch_hits"] = m.prefetch_hits;
  d["prefetch_misses"] = m.prefetch_misses;
  d["prefetch_window_used_bytes"] = m.prefetch_window_used_bytes;
  d["stall_seconds"] = m.stall_seconds;
  d["host_tier_full"] = m.host_tier_full;
  d["live_handles"] = m.live_entries;
  d["resident_bytes"] = m.resident_bytes;
  d["host_bytes"] = m.host_bytes;
  d["evictable_bytes"] = m.evictable_bytes;
  d["in_use_bytes"] = m.in_use_bytes;
  d["iteration"] = m.iteration;
  return d;
}

}  // namespace

void Runtime::reset_peak_stats() {
  device_allocator_->reset_peak_stats();
  host_tier_->reset_peak_stats();
}

void Runtime::reset_counters() {
  manager_->reset_counters();
  device_allocator_->reset_counters();
  host_tier_->reset_counters();
}

Runtime* Runtime::get() { return g_runtime; }

Runtime& Runtime::create(std::unique_ptr<Backend> backend, const std::string& device_kind,
                         const RuntimeConfig& config) {
  std::lock_guard<std::mutex> lock(g_create_mutex);
  if (g_runtime != nullptr) throw std::logic_error("membudget: the runtime exists already");
  // Leaked on purpose: memory it handed out is freed until interpreter exit.
  g_runtime = new Runtime(std::move(backend), device_kind, config);
  return *g_runtime;
}

Runtime::Runtime(std::unique_ptr<Backend> backend, const std::string& device_kind, const RuntimeConfig& config)
    : config_(config), device_kind_(device_kind), backend_(std::move(backend)) {
  device_allocator_ = std::make_unique<CachingAllocator>(*backend_, MemoryKind::device,
                                                         budget_or_unbounded(config.budget_bytes), "device",
                                                         config.expandable_segments);
  host_tier_ = std::make_unique<CachingAllocator>(*backend_, MemoryKind::host,
                                                  budget_or_unbounded(config.host_budget_bytes), "host tier");
  manager_ = std::make_unique<ResidencyManager>(*backend_, *device_allocator_, *host_tier_, manager_config(config));
  device_allocator_->set_evictor(manager_.get());
}

void Runtime::reconfigure(const RuntimeConfig& config) {
  manager_->set_config(manager_config(config));
  device_allocator_->set_budget(budget_or_unbounded(config.budget_bytes));
  host_tier_->set_budget(budget_or_unbounded(config.host_budget_bytes));
  config_ = config;
}

namespace {
thread_local bool t_speculative = false;  // Note [Speculative allocations]

// Saved-tensor hooks are per thread, and install() pushes membudget's on its
// own: a training step run on another thread (a threading.Thread, a
// framework's worker) allocates through membudget but saves its activations
// unmanaged, so at its out-of-memory error nothing was evictable and the
// message read "evictable 0 B" with no word of why. A thread without any
// saved-tensor hooks is said to be one. (The autograd engine's device
// threads inherit the hooks of the backward they run.) Inside a torch.func
// transform membudget's hooks are taken off and hooks are disabled (Note
// [torch.func transforms run unmanaged] in _func_transforms.py): that is said
// instead.
//
// Threads started after install() push membudget's hooks as they start, with
// no lineage recorder (Note [Threads started after install()] in _runtime.py):
// what they save is swap-only, so under MEMBUDGET_ACTIONS=recompute nothing
// of theirs is evictable. Daemon threads push none. Their errors say that.
enum class StartedThread { kNo, kManaged, kDaemon };
thread_local StartedThread t_started_after_install = StartedThread::kNo;
// Whether that thread records lineage (either recorder; Note [Recording on
// started threads] in lineage_recorder.cpp).
thread_local bool t_started_records_lineage = false;

// at::SavedTensorDefaultHooks::get_hooks() returned the hooks as a pair of
// PyObject pointers (null: none) in torch 2.4, an optional pair since 2.5.
template <typename Hooks, typename = void>
struct HasValue : std::false_type {};
template <typename Hooks>
struct HasValue<Hooks, std::void_t<decltype(std::declval<const Hooks&>().has_value())>> : std::true_type {};

template <typename Hooks>
bool saved_tensor_hooks_set(const Hooks& hooks) {
  if constexpr (HasValue<Hooks>::value) {
    return hooks.has_value();
  } else {
    return hooks.first != nullptr;
  }
}

std::string unmanaged_thread_note() {
  if (saved_tensor_hooks_set(at::SavedTensorDefaultHooks::get_hooks())) {
    Runtime* runtime = Runtime::get();
    if (t_started_after_install == StartedThread::kManaged && runtime != nullptr &&
        !AllowedActions::parse(runtime->config().actions).swap && !t_started_records_lineage) {
      return " This allocation came from a thread started after install() that records no lineage (it started "
             "while membudget recorded none: without a budget, or with MEMBUDGET_ACTIONS=swap): activations "
             "saved on it are managed but swap-only, and MEMBUDGET_ACTIONS=recompute cannot release them; "
             "allow swapping (MEMBUDGET_ACTIONS=both), start the thread after this install(), or run the "
             "training step on the thread that called install().";
    }
    return "";
  }
  if (!at::SavedTensorDefaultHooks::is_enabled()) {
    return " This allocation came from inside a torch.func transform (grad, vjp, jacrev, hessian), where "
           "saved-tensor hooks are disabled: what it saves is not managed; lower its batch or chunk it "
           "(vmap's chunk_size).";
  }
  if (t_started_after_install == StartedThread::kDaemon) {
    return " This allocation came from a daemon thread: activations saved on it are not managed, since "
           "membudget pushes no saved-tensor hooks on daemon threads (a daemon thread still running as the "
           "interpreter exits would abort it when torch let go of them); run the training step on a "
           "non-daemon thread or on the thread that called install().";
  }
  return " This allocation came from a thread without membudget's saved-tensor hooks: activations saved "
         "on it are not managed (hooks are per thread, and this thread was started before install() or "
         "outside the threading module); run the training step on the thread that called install(), or "
         "on a thread started after it.";
}
}  // namespace

SpeculativeAllocations::SpeculativeAllocations() : previous_(t_speculative) { t_speculative = true; }
SpeculativeAllocations::~SpeculativeAllocations() { t_speculative = previous_; }

Stream torch_current_stream(const c10::Device& device) {
#ifdef MEMBUDGET_TORCH_CUDA
  if (device.is_cuda()) return current_cuda_stream(device.index());
#endif
  (void)device;
  return nullptr;
}

void* allocate_device_for_torch(size_t bytes, Stream stream) {
  Runtime* runtime = Runtime::get();
  TORCH_CHECK(runtime != nullptr, "membudget: allocation through membudget before install() created the runtime");
  if (t_speculative && bytes > 0) {
    void* ptr = runtime->device_allocator().try_allocate(bytes, stream);
    TORCH_CHECK_WITH(OutOfMemoryError, ptr != nullptr, "membudget: no room for a speculative allocation of ",
                     bytes, " bytes (a replay ahead of use; it is replayed on demand instead)");
    return ptr;
  }
  try {
    return runtime->device_allocator().allocate(bytes, stream);
  } catch (const OutOfMemory& oom) {
    lineage::note_out_of_memory();  // Note [A forward that ran out of memory] (lineage_recorder.cpp)
    TORCH_CHECK_WITH(OutOfMemoryError, false, oom.what(), unmanaged_thread_note());
  }
}

void free_device_for_torch(void* ptr) {
  if (ptr == nullptr) return;
  Runtime* runtime = Runtime::get();
  TORCH_CHECK(runtime != nullptr, "membudget: free through membudget without a runtime");
  runtime->device_allocator().deallocate(ptr);
}

void bind_runtime(py::module_& m) {
  bind_saved_activation(m);
  m.def("install_runtime", &install_runtime, py::arg("device_kind"), py::arg("device_index"), py::arg("config"),
        "Create (or reconfigure) the runtime; on cpu also install the CPU allocator.");
  m.def("uninstall_runtime", &uninstall_runtime, "Stop managing; on cpu restore the previous CPU allocator.");
  m.def("set_budget_bytes", [](size_t budget_bytes) {
    Runtime* runtime = Runtime::get();
    if (runtime == nullptr) throw std::runtime_error("membudget: no runtime to set a budget on (install() first)");
    RuntimeConfig config = runtime->config();
    config.budget_bytes = budget_bytes;
    runtime->reconfigure(config);
  }, py::arg("budget_bytes"),
        "Change the device budget alone (0: none), leaving every other setting and whether it manages "
        "(Note [Memory fraction as a budget] in python/membudget/_runtime.py).");
  m.def("runtime_kind", []() -> std::string { return Runtime::get() ? Runtime::get()->device_kind() : "none"; });
  m.def("managing", []() { return Runtime::get() != nullptr && Runtime::get()->managing(); });
  m.def("note_thread_started_after_install", [](bool managed, bool records_lineage) {
    t_started_after_install = managed ? StartedThread::kManaged : StartedThread::kDaemon;
    t_started_records_lineage = records_lineage;
  }, py::arg("managed"), py::arg("records_lineage") = false,
        "This thread started after install(), and pushed membudget's hooks (managed) or, a daemon, did not "
        "(Note [Threads started after install()]), and records lineage or not: its out-of-memory errors say "
        "what that means.");
  m.def("memory_stats", &memory_stats, "Flat statistics dict (torch.cuda.memory_stats style keys).");
  m.def("device_snapshot", [] {
    Runtime* runtime = Runtime::get();
    return runtime == nullptr ? py::list() : snapshot_list(runtime->device_allocator().snapshot());
  }, "The device allocator's segments and blocks (bindings.h snapshot_list); empty before install.");
  m.def("set_out_of_memory_note", [](const std::string& note) {
    if (Runtime* r = Runtime::get()) r->manager().set_out_of_memory_note(note);
  }, py::arg("note"), "Text appended to every out-of-memory message from now on (empty: none).");
  m.def("reset_peak_stats", []() {
    if (Runtime* r = Runtime::get()) r->reset_peak_stats();
  });
  m.def("reset_counters", []() {
    if (Runtime* r = Runtime::get()) r->reset_counters();
  });
  m.def("release_cached", []() -> size_t {
    Runtime* r = Runtime::get();
    return r ? r->device_allocator().release_cached() : 0;
  }, py::call_guard<py::gil_scoped_release>());
  m.def("evict_all", []() -> size_t {
    Runtime* r = Runtime::get();
    return r ? r->manager().evict_all() : 0;
  }, py::call_guard<py::gil_scoped_release>());
  m.def("synchronize", []() {
    if (Runtime* r = Runtime::get()) r->manager().synchronize();
  }, py::call_guard<py::gil_scoped_release>());
  m.def("device_capacity", [](const std::string& kind) -> size_t {
    if (Runtime* r = Runtime::get()) return r->backend().device_capacity();
    if (kind == "cpu") return physical_memory_bytes();
    return 0;
  }, py::arg("device_kind") = "cpu");
  m.def("filter_names", &filter_names);
  m.def("entries", []() {
    py::list out;
    Runtime* r = Runtime::get();
    if (r == nullptr) return out;
    for (const EntryInfo& e : r->manager().snapshot()) {
      py::dict d;
      d["id"] = e.id;
      d["bytes"] = e.bytes;
      d["state"] = e.state;
      d["pins"] = e.pins;
      d["externally_referenced"] = e.externally_referenced;
      d["recomputable"] = e.recomputable;
      d["host_valid"] = e.host_valid;
      d["iteration"] = e.iteration;
      d["pack_seq"] = e.pack_seq;
      out.append(d);
    }
    return out;
  }, "Every managed entry (id, bytes, state, pins, referenced, recomputable, ...), for debugging");
}

}  // namespace membudget
