#include "torch/saved_activation.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <unordered_map>

#include "core/copy_timeline.h"
#include "core/residency_manager.h"
#include "torch/lineage_recorder.h"
#include "torch/runtime.h"

namespace py = pybind11;

namespace membudget {
namespace {

// Storage -> residency, so views of one storage packed separately share an
// entry. Weak: the entry dies with its last SavedActivation.
std::mutex g_registry_mutex;
std::unordered_map<const c10::StorageImpl*, std::weak_ptr<StorageResidency>> g_registry;
// Storages a selective checkpoint region will plan to drop (plan_drop_later).
thread_local std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> t_drop_later;
// Entry id -> residency, for the lineage's replays (entry_storage_tensor).
std::unordered_map<uint64_t, std::weak_ptr<StorageResidency>> g_by_id;
// The lineage's replay function: (entry id, ahead) -> a tensor whose storage
// is the rebuilt entry, or for a replay ahead on a side stream (tensor,
// cudaStream_t as int). Leaked: it may be called until interpreter exit.
py::object* g_recompute_fn = nullptr;
// Note [Recompute ahead timing]: when the binding replays the entries the
// prefetcher queued. On CUDA at once, on a side stream: the compute stream
// only waits for the replay's event at the unpack. On the CPU the replay runs
// on the calling thread, the same core backward computes on, so replaying
// early gains nothing by itself; it is done only when this thread would
// otherwise sit waiting for a swap-in still being copied by the host
// backend's copy thread. `immediate` on the CPU is for benchmarks and tests.
enum class AheadTiming { immediate, during_copy_waits };
AheadTiming g_cpu_ahead_timing = AheadTiming::during_copy_waits;

void registry_erase(const c10::StorageImpl* impl, const StorageResidency* owner) {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  auto it = g_registry.find(impl);
  if (it == g_registry.end()) return;
  auto current = it->second.lock();
  if (current == nullptr || current.get() == owner) g_registry.erase(it);
}

void delete_managed_storage_memory(void* ptr) { free_device_for_torch(ptr); }

std::shared_ptr<StorageResidency> find_residency(uint64_t entry_id) {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  auto it = g_by_id.find(entry_id);
  return it == g_by_id.end() ? nullptr : it->second.lock();
}

bool is_managed_candidate(const at::Tensor& t, Runtime& runtime) {
  if (!t.defined() || t.layout() != c10::kStrided || t.is_nested() || !t.has_storage()) return false;
  if (t.key_set().has(c10::DispatchKey::Python) || t.is_conj() || t.is_neg()) return false;
  // Parameters (and other leaves that require grad) stay where they are, and
  // so do views of them (mm saves weight.t()): their storage is never free to go.
  if (t.is_leaf() && t.requires_grad()) return false;
  if (t.is_view()) {
    const at::TensorBase& base = t._base();
    if (base.defined() && base.is_leaf() && base.requires_grad()) return false;
  }
  const c10::Storage& storage = t.storage();
  if (storage.nbytes() < runtime.config().min_tensor_bytes || storage.nbytes() == 0) return false;
  const void* data = storage.data_ptr().get();
  // Only memory from our own allocator is worth releasing (a storage made
  // before install, from numpy, or a copy-on-write one is left alone).
  // allocation_size is 0 for pointers that are not a live block of ours.
  return data != nullptr && runtime.device_allocator().allocation_size(data) >= storage.nbytes();
}

}  // namespace

StorageResidency::StorageResidency(c10::Storage storage)
    : ResidencyEntry(storage.nbytes()), storage_(std::move(storage)), device_(storage_.device()) {}

StorageResidency::~StorageResidency() {
  if (Runtime* runtime = Runtime::get()) runtime->manager().unregister_entry(this);
  if (storage_) registry_erase(storage_.unsafeGetStorageImpl(), this);
  {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    g_by_id.erase(id());
  }
  storage_ = c10::Storage();
}

bool StorageResidency::externally_referenced() const {
  return storage_ && storage_.use_count() > 1;
}

void* StorageResidency::device_data() const {
  return storage_ ? const_cast<void*>(storage_.data_ptr().get()) : nullptr;
}

void StorageResidency::drop_device_copy() {
  registry_erase(storage_.unsafeGetStorageImpl(), this);
  storage_ = c10::Storage();  // last reference: the DataPtr's deleter frees the block
}

void StorageResidency::attach_device_copy(void* ptr) {
  c10::DataPtr data(ptr, ptr, &delete_managed_storage_memory, device_);
  storage_ = c10::Storage(c10::Storage::use_byte_size_t(), bytes(), std::move(data),
                          /*allocator=*/nullptr, /*resizable=*/false);
}

void StorageResidency::adopt_recomputed(c10::Storage storage) {
  Runtime* runtime = Runtime::get();
  const void* data = storage.data_ptr().get();
  TORCH_CHECK(storage.nbytes() == bytes() && storage.device() == device_,
              "membudget: a replay rebuilt ", storage.nbytes(), " bytes on ", storage.device(), " for an entry of ",
              bytes(), " bytes on ", device_, "; the recorded ops do not reproduce this saved tensor");
  TORCH_CHECK(data != nullptr && runtime->device_allocator().allocation_size(data) >= bytes(),
              "membudget: a replayed storage did not come from membudget's allocator");
  storage_ = std::move(storage);
}

namespace {

// A tensor viewing `storage`, made without the dispatcher: no op runs, so no
// Python dispatch mode (the lineage's) sees it. A tensor that passes through
// a Python mode and back to C++ stays referenced (measured, torch 2.13),
// which would keep the storage from ever being evicted again.
at::Tensor tensor_on_storage(c10::Storage storage, int64_t offset, c10::IntArrayRef sizes,
                             c10::IntArrayRef strides, at::ScalarType dtype) {
  const c10::Device device = storage.device();
  c10::DispatchKeySet keys(c10::computeDispatchKey(std::nullopt, c10::kStrided, device));
  at::Tensor tensor = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), keys,
                                                               c10::scalarTypeToTypeMeta(dtype));
  tensor.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
  return tensor;
}

c10::Storage materialize_storage(const std::shared_ptr<StorageResidency>& residency);

// Note [Rebuilt inputs let go once read]: the dropped ancestors rebuilt for
// an entry's replay (Note [Dropped ancestors rebuilt in order]) that its own
// replay reads were held until that whole replay had run. A replay is often
// several ops (a dropout's output is its mask times the activation before it,
// which is replayed too), and an ancestor read by the first one stayed
// resident, unevictable, through the rest, beside their temporaries: an MLP
// whose every activation was dropped needed 22 MiB recompute-only (89% of
// its peak) where 17 do. Now the replay's first read of such an ancestor
// (entry_storage) takes it from the held set: from then on the read's own
// tensor holds it, for as long as the op that reads it, and after that it can
// be evicted again, but only after every other candidate until the replay
// ends (ResidencyManager::set_replay_input): it is often read again soon,
// by the same replay or by the backward op that needs it. A later read of it
// in the same replay finds it resident or materializes it again (without
// nesting: Note [Dropped ancestors rebuilt in order]).
struct ReplayInputsHeld;
thread_local ReplayInputsHeld* t_replay_held = nullptr;

// The held set of the replay running on this thread, and the entries it has
// let go of, marked as replay inputs until it ends.
struct ReplayInputsHeld {
  explicit ReplayInputsHeld(std::unordered_map<uint64_t, c10::Storage>& held)
      : held(held), previous(t_replay_held) {
    t_replay_held = this;
  }
  ~ReplayInputsHeld() {
    t_replay_held = previous;
    Runtime* runtime = Runtime::get();
    if (runtime == nullptr || read.empty()) return;
    for (uint64_t id : read) {
      if (std::shared_ptr<StorageResidency> residency = find_residency(id)) {
        runtime->manager().set_replay_input(residency.get(), false);
      }
    }
  }
  ReplayInputsHeld(const ReplayInputsHeld&) = delete;
  ReplayInputsHeld& operator=(const ReplayInputsHeld&) = delete;

  // A read of `id` by this replay: let go of it if held (see the Note).
  void on_read(ResidencyManager& manager, const std::shared_ptr<StorageResidency>& residency) {
    if (held.erase(residency->id()) == 0) return;
    manager.set_replay_input(residency.get(), true);
    read.push_back(residency->id());
  }

  std::unordered_map<uint64_t, c10::Storage>& held;
  std::vector<uint64_t> read;
  ReplayInputsHeld* previous;
};

// Note [Dropped ancestors rebuilt in order]: a replay reads its managed
// inputs through materialize_storage, so a dropped input was rebuilt inside
// the replay that read it, its own dropped input inside that one, and so on:
// a Python and C++ stack several frames deep per entry of the chain. An
// nn.RNNCell unrolled 100 steps with every activation dropped raised
// RecursionError under the Python recorder (600 under the C++ one), where
// plain PyTorch runs any length. So before the entry's own replay, its
// dropped ancestors are rebuilt one after another, each after its inputs
// (ResidencyManager::replay_order), and each replay finds its inputs
// resident. A rebuilt ancestor is held (its storage referenced, so it cannot
// be evicted) until the last replay of the order that reads it has run:
// what the nested replays held, without their unfinished replays' own
// temporaries. Like the nested ones, these replays run inside the entry's
// (its replay is begun), so their reads are replay inputs, not unpacks, and
// their time is counted once, in the entry's (Note [Nested replays are timed
// once]). An ancestor the order missed (rebuilt some other way, or declared
// after) is still rebuilt nested, as before. Returns the ancestors the
// entry's own replay reads, held until it has run.
std::unordered_map<uint64_t, c10::Storage> rebuild_dropped_ancestors(ResidencyManager& manager,
                                                                     const ResidencyEntry* entry) {
  std::unordered_map<uint64_t, c10::Storage> held;
  std::vector<ResidencyManager::ReplayStep> order;
  {
    py::gil_scoped_release no_gil;
    order = manager.replay_order(entry);
  }
  if (order.size() < 2) return held;
  // Replays still to run that read each ancestor, the entry's own included.
  std::unordered_map<uint64_t, size_t> readers;
  for (const auto& step : order) {
    for (uint64_t input : step.inputs) ++readers[input];
  }
  for (size_t i = 0; i + 1 < order.size(); ++i) {
    const auto& step = order[i];
    if (std::shared_ptr<StorageResidency> ancestor = find_residency(step.id)) {
      held[step.id] = materialize_storage(ancestor);
    }
    for (uint64_t input : step.inputs) {
      auto it = readers.find(input);
      if (it != readers.end() && --it->second == 0) held.erase(input);
    }
  }
  return held;
}

// Makes the entry resident and returns its storage: swapped in by the
// manager, or replayed through the lineage's callback (Note [Recompute]).
// Called with the GIL held; released while the manager may block.
c10::Storage materialize_storage(const std::shared_ptr<StorageResidency>& residency) {
  Runtime* runtime = Runtime::get();
  TORCH_CHECK(runtime != nullptr, "membudget: a saved activation outlived the runtime");
  ResidencyManager& manager = runtime->manager();
  c10::Storage storage;
  void* data = nullptr;
  {
    py::gil_scoped_release no_gil;  // a swap-in may block on a copy
    // Note [Copies ordered after the entry's stream]: the swap-in (and the
    // prefetches it issues) follows the stream that unpacks, where the
    // tensor is read next.
    data = manager.materialize(residency.get(), torch_current_stream(residency->device()));
    if (data != nullptr) {
      storage = residency->storage();
      manager.unpin(residency.get());
    }
  }
  if (data != nullptr) return storage;
  auto start = std::chrono::steady_clock::now();
  // Note [Copy timeline]: waits for copies inside the replay (its inputs'
  // swap-ins, its allocation's evictions) are part of its recompute seconds.
  struct ReplaySection {
    ReplaySection() { CopyTimeline::enter_section(); }
    ~ReplaySection() { CopyTimeline::leave_section(); }
  } section;
  try {
    TORCH_CHECK(g_recompute_fn != nullptr && !g_recompute_fn->is_none(),
                "membudget: a dropped activation needs recomputation but no lineage is installed");
    std::unordered_map<uint64_t, c10::Storage> inputs = rebuild_dropped_ancestors(manager, residency.get());
    ReplayInputsHeld hand_over(inputs);  // Note [Rebuilt inputs let go once read]
    py::object rebuilt = (*g_recompute_fn)(residency->id(), false);
    inputs.clear();
    // Take the storage and let the C++ tensor go before the Python one: a
    // Python tensor released while C++ still holds its TensorImpl is
    // resurrected (PyObject preservation) and keeps the storage referenced,
    // so the entry would never be evictable again.
    c10::Storage replayed = rebuilt.cast<at::Tensor>().storage();
    rebuilt = py::none();
    residency->adopt_recomputed(std::move(replayed));
  } catch (...) {
    manager.complete_recompute(residency.get(), false, 0.0);
    throw;
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  manager.complete_recompute(residency.get(), true, seconds);
  storage = residency->storage();
  {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    g_registry[storage.unsafeGetStorageImpl()] = residency;
  }
  py::gil_scoped_release no_gil;
  manager.unpin(residency.get());
  return storage;
}

// Replays the entries queued for recomputation ahead of use (Note
// [Recompute ahead]). Called with the GIL held, only from unpack (never from
// inside a replay: those materialize inputs, which may queue more, and the
// next unpack takes them).
void run_recompute_ahead(Runtime& runtime) {
  static thread_local bool running = false;
  if (running || g_recompute_fn == nullptr || g_recompute_fn->is_none()) return;
  running = true;
  struct Reset {
    ~Reset() { running = false; }
  } reset;
  ResidencyManager& manager = runtime.manager();
  // Each round takes what the previous one's input unpacks queued; the
  // queue only ever holds entries ahead in the predicted order, so this ends.
  for (int round = 0; round < 8 && manager.recompute_ahead_pending(); ++round) {
    std::vector<uint64_t> ids;
    {
      py::gil_scoped_release no_gil;
      ids = manager.take_recompute_ahead();
    }
    for (uint64_t id : ids) {
      std::shared_ptr<StorageResidency> residency = find_residency(id);
      if (residency == nullptr) continue;
      bool begun = false;
      {
        py::gil_scoped_release no_gil;
        begun = manager.begin_recompute_ahead(residency.get());
      }
      if (!begun) continue;
      auto start = std::chrono::steady_clock::now();
      bool succeeded = false;
      EventPtr ready;
      c10::Storage storage;
      try {
        SpeculativeAllocations speculative;  // no room: given up, not an OOM
        py::object result = (*g_recompute_fn)(id, true);
        int64_t stream_handle = 0;
        if (py::isinstance<py::tuple>(result)) {
          py::tuple pair = result.cast<py::tuple>();
          stream_handle = pair[1].cast<int64_t>();
          result = pair[0];
        }
        // As in materialize_storage: the C++ tensor goes before the Python one.
        storage = result.cast<at::Tensor>().storage();
        result = py::none();
        residency->adopt_recomputed(storage);
        if (stream_handle != 0) ready = runtime.backend().record(reinterpret_cast<Stream>(stream_handle));
        succeeded = true;
      } catch (const py::error_already_set&) {
        // Speculative: a replay that found no room (or failed) is dropped
        // again and replayed on demand at its unpack, which reports errors.
      } catch (const std::exception&) {
      }
      if (!succeeded && residency->device_data() != nullptr) {
        residency->drop_device_copy();  // adopted, then its event failed: not usable
      }
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (succeeded) {
        std::lock_guard<std::mutex> lock(g_registry_mutex);
        g_registry[storage.unsafeGetStorageImpl()] = residency;
      }
      storage = c10::Storage();
      py::gil_scoped_release no_gil;
      manager.complete_recompute_ahead(residency.get(), succeeded, seconds, std::move(ready));
    }
  }
}

}  // namespace

// Note [Saved versions checked]: autograd checks that a saved tensor was not
// modified in place between forward and backward ("one of the variables
// needed for gradient computation has been modified by an inplace
// operation") only when no saved-tensor hooks are set: it cannot follow a
// version through them (SavedVariable::unpack). With membudget's hooks on,
// y = w.exp(); y.mul_(2); y.sum().backward() ran and returned 2x the true
// gradient, silently, with or without a budget. So pack keeps the tensor's
// version counter (the shared counter, not the tensor) and its value, and
// unpack raises autograd's error when they differ, before materialising
// anything.
namespace {

c10::VariableVersion version_counter_of(const at::Tensor& tensor) {
  return tensor.unsafeGetTensorImpl()->version_counter();
}

uint32_t current_version(const c10::VariableVersion& counter) {
  return counter.enabled() ? counter.current_version() : 0;  // inference tensors keep none
}

[[noreturn]] void throw_modified(const std::string& what, uint32_t saved, uint32_t now) {
  throw std::runtime_error(
      "one of the variables needed for gradient computation has been modified by an inplace operation: " + what +
      " is at version " + std::to_string(now) + "; expected version " + std::to_string(saved) +
      " instead. Hint: enable anomaly detection to find the operation that failed to compute its gradient, "
      "with torch.autograd.set_detect_anomaly(True). (Checked by membudget: autograd skips this check while "
      "saved-tensor hooks are set.)");
}

// Raises autograd's error, naming the tensor as autograd does, unless the
// counter still reads the version it had when the tensor was packed.
void check_unmodified(const c10::VariableVersion& counter, uint32_t saved, at::ScalarType dtype,
                      c10::IntArrayRef sizes, c10::Device device) {
  const uint32_t now = current_version(counter);
  if (now == saved) return;
  std::string what = "[" + std::string(device.is_cuda() ? "torch.cuda." : "torch.") + c10::toString(dtype) +
                     "Tensor [";
  for (size_t i = 0; i < sizes.size(); ++i) what += (i ? ", " : "") + std::to_string(sizes[i]);
  throw_modified(what + "]]", saved, now);
}

}  // namespace

// Note [Entries only lineage holds]: the recorders hold an input that is a
// managed entry through the entry (Note [Held inputs reached through their
// entry] in lineage_recorder.cpp), and the entry counted as live: once
// backward had run, "no live entry" was never true while a compiled block's
// saved output was held so, and the recorder kept the last forward's inputs
// and those entries between steps (2 MB and 4 entries after every step of a
// per-block compiled model, either recorder). Only an entry autograd holds
// a handle on can be unpacked, and so ask for a replay: the release between
// steps asks whether any such entry is left (Note [Lineage released between
// steps] in lineage.py): whether any handle saved for backward is alive, as
// such a handle keeps its entry alive. A count, so that the question takes
// no lock and releases no entry.
static std::atomic<int64_t> g_saved_for_backward{0};

// Note [Lineage let go once nothing is saved]: uninstall() drops the replay
// callback (and with it the Python recorder's lineage) and the stopped C++
// recorder forgets what it recorded -- unless a handle saved for backward is
// still alive, which may yet ask for a replay. That is the case when
// uninstall() runs inside the `except` block of a step that ran out of
// memory in backward: the exception's frames hold the loss and its graph.
// The recorders then held the failed step's held inputs and RNG states (the
// biases and dropout states of tests/test_freed_inputs.py's model, 45 KiB;
// on a GPU, every parameter a replay reads) after the model was deleted,
// until the next install(). Now uninstall() asks for the release to happen
// once the last such handle goes: its destructor (on any thread, GIL or
// not) queues a pending call, which runs on the main thread with the GIL.
static std::atomic<bool> g_release_once_unsaved{false};

// With the GIL: the release, if it is still asked for and nothing is saved.
static void release_lineage_if_unsaved() {
  if (!g_release_once_unsaved.load() || g_saved_for_backward.load() > 0) return;
  g_release_once_unsaved.store(false);
  if (g_recompute_fn != nullptr) *g_recompute_fn = py::none();
  lineage::release_stopped_recorder();
}

static int release_lineage_pending(void* /*unused*/) {
  release_lineage_if_unsaved();
  return 0;
}

SavedActivation::SavedActivation(std::shared_ptr<StorageResidency> residency, const at::Tensor& view,
                                 bool saved_for_backward)
    : residency_(std::move(residency)),
      sizes_(view.sizes().vec()),
      strides_(view.strides().vec()),
      storage_offset_(view.storage_offset()),
      dtype_(view.scalar_type()),
      device_(view.device()),
      version_counter_(version_counter_of(view)),
      saved_version_(current_version(version_counter_)),
      saved_for_backward_(saved_for_backward) {
  if (saved_for_backward_) g_saved_for_backward.fetch_add(1);
}

// Moves copy too (no move constructor): the moved-from handle still uncounts itself.
SavedActivation::SavedActivation(const SavedActivation& other)
    : residency_(other.residency_),
      sizes_(other.sizes_),
      strides_(other.strides_),
      storage_offset_(other.storage_offset_),
      dtype_(other.dtype_),
      device_(other.device_),
      version_counter_(other.version_counter_),
      saved_version_(other.saved_version_),
      saved_for_backward_(other.saved_for_backward_) {
  if (saved_for_backward_) g_saved_for_backward.fetch_add(1);
}

SavedActivation::~SavedActivation() {
  if (saved_for_backward_ && g_saved_for_backward.fetch_sub(1) == 1 && g_release_once_unsaved.load() &&
      Py_IsInitialized()) {
    // Note [Lineage let go once nothing is saved]; a full queue leaves the
    // release to the next install().
    (void)Py_AddPendingCall(&release_lineage_pending, nullptr);
  }
}

int64_t SavedActivation::current_tensor_version() const { return current_version(version_counter_); }

at::Tensor SavedActivation::unpack() const {
  check_unmodified(version_counter_, saved_version_, dtype_, sizes_, device_);
  Runtime* runtime = Runtime::get();
  const bool on_cpu = runtime != nullptr && runtime->device_kind() == "cpu";
  if (on_cpu && runtime->manager().recompute_ahead_pending()) {
    // Note [Recompute ahead timing]
    bool replay_now = g_cpu_ahead_timing == AheadTiming::immediate;
    if (!replay_now) {
      py::gil_scoped_release no_gil;
      replay_now = runtime->manager().copy_pending(residency_.get());
    }
    if (replay_now) run_recompute_ahead(*runtime);
  }
  c10::Storage storage = materialize_storage(residency_);
  if (runtime != nullptr && runtime->manager().recompute_ahead_pending() &&
      (!on_cpu || g_cpu_ahead_timing == AheadTiming::immediate)) {
    run_recompute_ahead(*runtime);
  }
  return tensor_on_storage(std::move(storage), storage_offset_, sizes_, strides_, dtype_);
}

std::string SavedActivation::state() const {
  // For reprs only; racy by nature.
  return residency_->device_data() != nullptr ? "device" : "host";
}

py::object pack_saved_tensor(const at::Tensor& tensor) {
  Runtime* runtime = Runtime::get();
  if (runtime == nullptr || !runtime->managing() || !is_managed_candidate(tensor, *runtime)) {
    // Note [Pack without a cycle]: an alias without autograd history, not
    // the tensor itself. An output saved by its own node and packed as
    // itself holds that node through its grad_fn, and the node holds what
    // was packed: a cycle outside Python's collector. A graph never backpropagated (a forward
    // for a logged loss, an evaluation with grad on) then kept every saved
    // activation alive, managed ones too (29 entries per CNN forward;
    // identity hooks leak the same way in plain PyTorch). tensor_data()
    // shares storage and version counter and, unlike detach(), is no op: the
    // lineage recorder and profilers do not see it. Autograd rebuilds the
    // variable on unpack. Its version goes with it (Note [Saved versions
    // checked]).
    return py::make_tuple(tensor.tensor_data(), current_version(version_counter_of(tensor)));
  }
  const c10::StorageImpl* impl = tensor.storage().unsafeGetStorageImpl();
  std::shared_ptr<StorageResidency> residency;
  bool is_new = false;
  {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    auto it = g_registry.find(impl);
    if (it != g_registry.end()) residency = it->second.lock();
    if (residency == nullptr) {
      residency = std::make_shared<StorageResidency>(tensor.storage());
      g_registry[impl] = residency;
      g_by_id[residency->id()] = residency;
      is_new = true;
    }
  }
  if (is_new) {
    runtime->manager().register_entry(residency.get(), torch_current_stream(residency->device()));
  } else {
    runtime->manager().touch(residency.get());
  }
  return py::cast(SavedActivation(std::move(residency), tensor));
}

py::object unpack_saved_tensor(const py::object& packed) {
  if (py::isinstance<SavedActivation>(packed)) {
    return py::cast(packed.cast<const SavedActivation&>().unpack());
  }
  if (py::isinstance<py::tuple>(packed)) {  // unmanaged: (tensor, version when packed)
    py::tuple pair = packed.cast<py::tuple>();
    const at::Tensor tensor = pair[0].cast<at::Tensor>();
    check_unmodified(version_counter_of(tensor), pair[1].cast<uint32_t>(), tensor.scalar_type(), tensor.sizes(),
                     tensor.device());
    return pair[0];
  }
  return packed;
}

at::Tensor entry_storage(uint64_t entry_id) {
  std::shared_ptr<StorageResidency> residency = find_residency(entry_id);
  if (residency == nullptr) return at::Tensor();
  c10::Storage storage = materialize_storage(residency);
  if (t_replay_held != nullptr) {
    t_replay_held->on_read(Runtime::get()->manager(), residency);  // Note [Rebuilt inputs let go once read]
  }
  const auto nbytes = static_cast<int64_t>(storage.nbytes());
  return tensor_on_storage(std::move(storage), 0, {nbytes}, {1}, at::kByte);
}

// Note [Held inputs kept as a copy]: an op is about to write in place to a
// held input (a tensor no recorded op made) that replays of managed entries
// read. Those entries used to be rescued: the dropped ones rebuilt now, under
// the budget, and all of them made swap-only. For a small input that took
// recompute from everything downstream for the sake of a few bytes: a
// spectral_norm layer called twice in one forward (a GAN's D(real) and
// D(fake)) writes its power-iteration vector (256 B to 4 KiB) at the second
// call, and a recompute-only run ran out of memory even at 98% of the peak.
// Now an input of at most kHeldCopyBudgetShare of the budget is copied before
// the write, and the replays that read it read the copy (at the version they
// read, so their version checks hold), staying recomputable. A larger input,
// no budget, or a copy that does not fit: the rescue, as before. Both
// recorders (lineage_replay.cpp, replay.py) call this.
constexpr size_t kHeldCopyBudgetShare = 64;

at::Tensor copy_of_held_input(const at::Tensor& held) {
  if (!held.defined() || !held.has_storage() || held.is_inference() || held.layout() != c10::kStrided) {
    return at::Tensor();
  }
  Runtime* runtime = Runtime::get();
  const size_t budget = runtime != nullptr ? runtime->config().budget_bytes : 0;
  const c10::Storage& storage = held.storage();
  const size_t nbytes = storage.nbytes();
  if (budget == 0 || nbytes == 0 || nbytes > budget / kHeldCopyBudgetShare) return at::Tensor();
  try {
    at::Tensor bytes = tensor_on_storage(storage, 0, {static_cast<int64_t>(nbytes)}, {1}, at::kByte);
    at::Tensor copied;
    {
      at::NoGradGuard no_grad;
      copied = bytes.clone();
    }
    return held_input_on(copied.storage(), held);
  } catch (const std::exception&) {
    return at::Tensor();  // no room for the copy: the caller rescues instead
  }
}

at::Tensor held_input_on(const c10::Storage& storage, const at::Tensor& like) {
  at::Tensor moved = tensor_on_storage(storage, like.storage_offset(), like.sizes(), like.strides(), like.scalar_type());
  moved.unsafeGetTensorImpl()->set_version_counter(c10::VariableVersion(static_cast<uint32_t>(like._version())));
  return moved;
}

py::object entry_storage_tensor(uint64_t entry_id) {
  at::Tensor tensor = entry_storage(entry_id);
  return tensor.defined() ? py::cast(std::move(tensor)) : py::none();
}

std::shared_ptr<StorageResidency> entry_of_storage(const c10::Storage& storage) {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  auto it = g_registry.find(storage.unsafeGetStorageImpl());
  return it == g_registry.end() ? nullptr : it->second.lock();
}

bool any_entry_saved_for_backward() { return g_saved_for_backward.load() > 0; }

std::vector<uint64_t> live_entry_ids() {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  std::vector<uint64_t> ids;
  for (const auto& item : g_by_id) {
    if (!item.second.expired()) ids.push_back(item.first);
  }
  return ids;
}

namespace {

class HeldStorage final : public HeldInput {
 public:
  // (Storage::getWeakStorageImpl is newer than the oldest torch supported.)
  explicit HeldStorage(const c10::Storage& storage)
      : impl_(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(storage.unsafeGetStorageImpl())) {}
  // Lock-free, and never the last reference (whose release would free
  // memory under the manager's lock): a weak reference keeps the StorageImpl
  // object, not its data, so its size is readable until the weak one goes.
  bool present() const override { return !impl_.expired() && impl_._unsafe_get_target()->nbytes() > 0; }

 private:
  c10::weak_intrusive_ptr<c10::StorageImpl> impl_;
};

}  // namespace

std::shared_ptr<const HeldInput> held_storage(const at::Tensor& tensor) {
  // Not the storage's size now: one freed already (a parameter FSDP2
  // resharded before this pack) is what the probe must report.
  if (!tensor.defined() || !tensor.has_storage() || tensor.numel() == 0) return nullptr;
  return std::make_shared<const HeldStorage>(tensor.storage());
}

void set_entry_recompute_info(uint64_t entry_id, bool recomputable, double replay_seconds,
                              const std::vector<uint64_t>& input_ids, std::string reason, HeldInputs held) {
  Runtime* runtime = Runtime::get();
  std::shared_ptr<StorageResidency> residency = find_residency(entry_id);
  if (runtime == nullptr || residency == nullptr) return;
  runtime->manager().set_recompute_info(residency.get(), recomputable, replay_seconds, input_ids, std::move(reason),
                                        std::move(held));
}

bool entry_reads_refilled_input(uint64_t entry_id) {
  Runtime* runtime = Runtime::get();
  std::shared_ptr<StorageResidency> residency = find_residency(entry_id);
  return runtime != nullptr && residency != nullptr && runtime->manager().reads_refilled_input(residency.get());
}

size_t live_storage_residencies() {
  Runtime* runtime = Runtime::get();
  return runtime != nullptr ? runtime->manager().stats().live_entries : 0;
}

void bind_saved_activation(py::module_& m) {
  py::class_<SavedActivation>(m, "SavedActivation",
                              "A saved activation under membudget's residency management.")
      .def_property_readonly("storage_bytes", &SavedActivation::storage_bytes)
      .def_property_readonly("entry_id", &SavedActivation::entry_id)
      .def_property_readonly("version", &SavedActivation::current_tensor_version,
                             "the saved tensor's version counter now (0 when it has none)")
      .def("__repr__", [](const SavedActivation& s) {
        return "<membudget.SavedActivation " + std::to_string(s.storage_bytes()) + " bytes on " + s.state() + ">";
      });
  m.def("pack", &pack_saved_tensor, "saved_tensors_hooks pack function");
  m.def("unpack", &unpack_saved_tensor, "saved_tensors_hooks unpack function");
  m.def("live_handles", &live_storage_residencies, "number of live managed storages");
  m.def("entry_storage", &entry_storage_tensor, py::arg("entry_id"),
        "The whole storage of a live entry, resident, as a 1-D uint8 tensor (None if not live)");
  m.def("live_entry_ids", &live_entry_ids, "ids of the live managed entries");
  m.def("copy_of_held_input", [](const at::Tensor& held) -> py::object {
    at::Tensor copy = copy_of_held_input(held);
    return copy.defined() ? py::cast(std::move(copy)) : py::none();
  }, py::arg("tensor"),
        "A held input on a copy of its storage at its version, or None where copying is not worth it or does "
        "not fit (Note [Held inputs kept as a copy])");
  m.def("held_input_on", [](const at::Tensor& copy, const at::Tensor& like) {
    return held_input_on(copy.storage(), like);
  }, py::arg("copy"), py::arg("like"),
        "A tensor on copy's storage with like's geometry, dtype and version (Note [Held inputs kept as a copy])");
  m.def("any_entry_saved_for_backward", &any_entry_saved_for_backward,
        "Whether a live entry has a handle autograd holds (Note [Entries only lineage holds])");
  m.def("entry_handle", [](const at::Tensor& tensor) -> py::object {
    if (!tensor.has_storage() || tensor.is_inference()) return py::none();
    std::shared_ptr<StorageResidency> entry = entry_of_storage(tensor.storage());
    if (entry == nullptr) return py::none();
    return py::cast(SavedActivation(std::move(entry), tensor, /*saved_for_backward=*/false));
  }, py::arg("tensor"),
        "A handle on the live managed entry holding tensor's storage, with tensor's geometry and version "
        "counter, or None (Note [Held inputs reached through their entry] in lineage_recorder.cpp)");
  m.def("set_recompute_callback", [](py::object fn) {
    if (g_recompute_fn == nullptr) g_recompute_fn = new py::object();
    *g_recompute_fn = std::move(fn);
    g_release_once_unsaved.store(false);  // a fresh install's callback stays
  }, py::arg("fn"),
        "fn(entry_id, ahead) -> tensor whose storage is the replayed entry (for a replay ahead on a CUDA "
        "side stream: (tensor, stream handle)); None removes it");
  m.def("release_lineage_once_unsaved", [] {
    g_release_once_unsaved.store(true);
    release_lineage_if_unsaved();  // at once when nothing is saved now
  }, "uninstall(): drop the replay callback and what the stopped C++ recorder kept, now or once the last "
     "handle saved for backward goes (Note [Lineage let go once nothing is saved])");
  m.def("set_cpu_recompute_ahead_timing", [](const std::string& timing) {
    if (timing == "immediate") {
      g_cpu_ahead_timing = AheadTiming::immediate;
    } else if (timing == "during_copy_waits") {
      g_cpu_ahead_timing = AheadTiming::during_copy_waits;
    } else {
      throw std::invalid_argument("membudget: recompute-ahead timing is 'immediate' or 'during_copy_waits', not '" +
                                  timing + "'");
    }
  }, py::arg("timing"), "When queued replays ahead run on the CPU (Note [Recompute ahead timing]); for benchmarks");
  m.def("set_recompute_info", [](uint64_t entry_id, bool recomputable, double replay_seconds,
                                 const std::vector<uint64_t>& input_ids, std::string reason,
                                 const std::vector<at::Tensor>& held) {
    HeldInputs probes;
    probes.reserve(held.size());
    for (const at::Tensor& tensor : held) {
      if (auto probe = held_storage(tensor)) probes.push_back(std::move(probe));
    }
    set_entry_recompute_info(entry_id, recomputable, replay_seconds, input_ids, std::move(reason), std::move(probes));
  }, py::arg("entry_id"), py::arg("recomputable"), py::arg("replay_seconds"), py::arg("input_ids"),
        py::arg("reason") = std::string(), py::arg("held") = std::vector<at::Tensor>(),
        "Declare whether and at what cost an entry's storage can be replayed, and which entries it reads; "
        "when it cannot, why (shown in out-of-memory messages: Note [Why not recomputable]); `held`: the "
        "tensors it reads that no entry manages, whose storage may be freed under it (Note [Held inputs freed "
        "under us])");
  m.def("entry_reads_refilled_input", &entry_reads_refilled_input, py::arg("entry_id"),
        "Whether a write to a held input should leave this entry as it is rather than rebuild it first: it, or "
        "a dropped ancestor, is dropped and had a held input's storage freed since (Note [Writes that refill a "
        "freed input])");
  m.def("plan_drop", [](uint64_t entry_id) {
    Runtime* runtime = Runtime::get();
    std::shared_ptr<StorageResidency> residency = find_residency(entry_id);
    return runtime != nullptr && residency != nullptr && runtime->manager().plan_drop(residency.get());
  }, py::arg("entry_id"), "Drop this entry as soon as nothing else holds it (static plan)");
  // Note [Selective checkpoints as a plan] (_checkpoint_regions.py): the
  // storages of outputs a selective checkpoint's policy would recompute, on
  // this thread, held weakly (a Python storage object per output kept each
  // one referenced, so never evictable) until the region returns.
  m.def("plan_drop_later", [](const at::Tensor& tensor, const std::vector<at::Tensor>& inputs) {
    if (!tensor.defined() || !tensor.has_storage()) return;
    for (const at::Tensor& input : inputs) {
      if (input.defined() && input.has_storage() && input.storage().is_alias_of(tensor.storage())) return;
    }
    t_drop_later.emplace_back(
        c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(tensor.storage().unsafeGetStorageImpl()));
  }, py::arg("tensor"), py::arg("inputs"),
        "Remember tensor's storage for plan_drop_remembered(), unless it is one of the inputs' storages (the "
        "op made no storage of its own; Note [Selective checkpoints as a plan])");
  m.def("plan_drop_remembered", [](bool plan) {
    std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> remembered;
    remembered.swap(t_drop_later);
    Runtime* runtime = Runtime::get();
    if (runtime == nullptr || !plan) return 0;
    // Held until the drops below are done, as the entries they name.
    std::vector<std::shared_ptr<StorageResidency>> entries;
    for (const auto& weak : remembered) {
      c10::intrusive_ptr<c10::StorageImpl> storage = weak.lock();
      if (!storage) continue;  // freed since: no entry
      if (std::shared_ptr<StorageResidency> entry = entry_of_storage(c10::Storage(std::move(storage)))) {
        entries.push_back(std::move(entry));
      }
    }
    int planned = 0;
    for (const std::shared_ptr<StorageResidency>& entry : entries) planned += runtime->manager().plan_drop(entry.get());
    // The region's temporaries are gone by now; its last region may see no
    // pack after it, where planned drops otherwise happen.
    if (planned > 0) runtime->manager().drop_planned_now();
    return planned;
  }, py::arg("plan"),
     "plan_drop (when `plan`) the live entries on the storages plan_drop_later() remembered on this thread, "
     "drop those nothing else references, and forget the storages; returns how many were planned (Note "
     "[Selective checkpoints as a plan])");
}

}  // namespace membudget
