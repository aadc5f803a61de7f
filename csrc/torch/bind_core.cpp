// membudget._C.core: the torch-free core objects (HostBackend,
// CachingAllocator, a test Evictor) bound standalone, so that the allocator's
// property, behaviour and concurrency tests drive the real C++ code from
// Python. Addresses and streams cross the boundary as ints.
//
// Note [GIL in core bindings]: allocate, deallocate, record_stream and the
// blocking waits release the GIL, so that Python threads really contend on the
// allocator's mutex, and so that the evictor (called by allocate with the
// allocator lock released) never needs the GIL: nothing below calls Python.
#include <pybind11/stl.h>

#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>

#include "core/caching_allocator.h"
#include "core/host_backend.h"
#include "core/out_of_memory.h"
#include "core/policy/copy_in_backlog.h"
#include "core/policy/director.h"
#include "core/policy/filters.h"
#include "core/policy/neighbourhood.h"
#include "core/units.h"
#include "torch/bindings.h"

namespace py = pybind11;

namespace membudget {

namespace {

Stream to_stream(uintptr_t stream) { return reinterpret_cast<Stream>(stream); }
void* to_pointer(uintptr_t address) { return reinterpret_cast<void*>(address); }
uintptr_t to_address(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr); }

// A test Evictor over explicitly registered allocations: evict() deallocates
// them oldest first until enough bytes are freed. It stands in for the
// residency manager in the allocator's OOM-ladder and thread tests.
class ListEvictor final : public Evictor {
 public:
  explicit ListEvictor(CachingAllocator& allocator) : allocator_(allocator) {}

  // Uninstalls itself so the allocator never calls a destroyed evictor.
  ~ListEvictor() override {
    if (allocator_.evictor() == this) allocator_.set_evictor(nullptr);
  }

  // Registers a live allocation; from now on the evictor owns it.
  void add(uintptr_t address) {
    size_t size = allocator_.allocation_size(to_pointer(address));
    if (size == 0) {
      throw std::invalid_argument("ListEvictor.add: not a live allocation of this allocator");
    }
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.push_back(Entry{address, size});
    registered_bytes_ += size;
  }

  // Unregisters an allocation, handing ownership back to the caller. Returns
  // false when it is not registered (e.g. already evicted).
  bool remove(uintptr_t address) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->address == address) {
        registered_bytes_ -= it->size;
        entries_.erase(it);
        return true;
      }
    }
    return false;
  }

  size_t evict(size_t bytes_needed, Stream /*stream*/) override {
    size_t freed = 0;
    while (freed < bytes_needed) {
      Entry victim;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (entries_.empty()) break;
        victim = entries_.front();
        entries_.pop_front();
        registered_bytes_ -= victim.size;
        evicted_count_ += 1;
      }
      allocator_.deallocate(to_pointer(victim.address));  // outside our lock
      freed += victim.size;
    }
    return freed;
  }

  std::string describe_evictable() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return "evictable " + format_bytes(registered_bytes_) + " in " +
           std::to_string(entries_.size()) + " registered allocations";
  }

  size_t registered_bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return registered_bytes_;
  }

  size_t evicted_count() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return evicted_count_;
  }

 private:
  struct Entry {
    uintptr_t address = 0;
    size_t size = 0;
  };

  CachingAllocator& allocator_;
  mutable std::mutex mutex_;
  std::deque<Entry> entries_;
  size_t registered_bytes_ = 0;
  size_t evicted_count_ = 0;
};

py::dict stats_dict(const AllocatorStats& stats) {
  py::dict result;
  result["allocated_current"] = stats.allocated_current;
  result["allocated_peak"] = stats.allocated_peak;
  result["reserved_current"] = stats.reserved_current;
  result["reserved_peak"] = stats.reserved_peak;
  result["requested_current"] = stats.requested_current;
  result["budget"] = stats.budget;
  result["num_alloc_retries"] = stats.num_alloc_retries;
  result["num_ooms"] = stats.num_ooms;
  result["num_segments"] = stats.num_segments;
  result["num_live_blocks"] = stats.num_live_blocks;
  result["num_evictor_calls"] = stats.num_evictor_calls;
  result["mapped_bytes_total"] = stats.mapped_bytes_total;
  result["unmapped_bytes_total"] = stats.unmapped_bytes_total;
  result["moved_bytes_total"] = stats.moved_bytes_total;
  return result;
}

MemoryKind parse_kind(const std::string& kind) {
  if (kind == "device") return MemoryKind::device;
  if (kind == "host") return MemoryKind::host;
  throw std::invalid_argument("CachingAllocator: kind must be 'device' or 'host', got '" +
                              kind + "'");
}

CopyDirection parse_direction(const std::string& direction) {
  if (direction == "device_to_host") return CopyDirection::device_to_host;
  if (direction == "host_to_device") return CopyDirection::host_to_device;
  throw std::invalid_argument(
      "pending_copies: direction must be 'device_to_host' or 'host_to_device', got '" +
      direction + "'");
}

// OutOfMemory surfaces as torch.OutOfMemoryError, what PyTorch users already
// catch around a batch to retry smaller.
void register_out_of_memory_translator() {
  static py::object* torch_oom =
      new py::object(py::module_::import("torch").attr("OutOfMemoryError"));
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const OutOfMemory& oom) {
      PyErr_SetString(torch_oom->ptr(), oom.what());
    }
  });
}

void bind_events_and_backends(py::module_& core) {
  py::class_<Event, EventPtr>(core, "Event", "Completion of work queued on a stream.")
      .def("ready", &Event::ready, "True once the work before the event is done; never blocks.")
      .def("wait", &Event::wait, py::call_guard<py::gil_scoped_release>(),
           "Blocks until ready().");

  py::class_<Backend>(core, "Backend", "A device: raw memory, streams, events, copies.")
      .def_property_readonly("name", &Backend::name)
      .def("device_capacity", &Backend::device_capacity);

  py::class_<HostBackend, Backend>(core, "HostBackend",
                                   "The simulated device: CPU memory and copy threads.")
      .def(py::init<size_t>(), py::arg("capacity_bytes") = 0)
      .def("device_alloc", [](HostBackend& b, size_t n) { return to_address(b.device_alloc(n)); })
      .def("device_free", [](HostBackend& b, uintptr_t p, size_t n) { b.device_free(to_pointer(p), n); })
      .def("host_alloc", [](HostBackend& b, size_t n) { return to_address(b.host_alloc(n)); })
      .def("host_free", [](HostBackend& b, uintptr_t p, size_t n) { b.host_free(to_pointer(p), n); })
      .def("device_bytes_in_use", &HostBackend::device_bytes_in_use)
      .def("page_bytes", &HostBackend::page_bytes)
      .def("segment_page_bytes", &HostBackend::segment_page_bytes, py::arg("budget_bytes"))
      .def_static("segment_page_for", &HostBackend::segment_page_for, py::arg("budget_bytes"),
                  py::arg("capacity_bytes") = 0,
                  "The page of expandable segments under a budget (Note [Host pages]).")
      // Note [Expandable segments] calls, for bench/bench_page_moves.py.
      .def("reserve_address_range", [](HostBackend& b, size_t n) { return to_address(b.reserve_address_range(n)); })
      .def("release_address_range",
           [](HostBackend& b, uintptr_t p, size_t n) { b.release_address_range(to_pointer(p), n); })
      .def("map_pages", [](HostBackend& b, uintptr_t p, size_t n) { return b.map_pages(to_pointer(p), n); })
      .def("unmap_pages", [](HostBackend& b, uintptr_t p, size_t n) { b.unmap_pages(to_pointer(p), n); })
      .def("move_pages", [](HostBackend& b, uintptr_t from, uintptr_t to, size_t n) {
        return b.move_pages(to_pointer(from), to_pointer(to), n);
      })
      .def("record", [](HostBackend& b, uintptr_t s) { return b.record(to_stream(s)); },
           py::arg("stream") = 0)
      .def("stream_wait",
           [](HostBackend& b, uintptr_t s, const EventPtr& e) { b.stream_wait(to_stream(s), e); },
           py::call_guard<py::gil_scoped_release>())
      // `for_waiter`: the caller waits for the event at once (Note [Waiter runs the copy]).
      .def("copy_to_host",
           [](HostBackend& b, uintptr_t dst, uintptr_t src, size_t n, uintptr_t after, bool for_waiter) {
             return for_waiter ? b.copy_to_host_for_waiter(to_pointer(dst), to_pointer(src), n, to_stream(after))
                               : b.copy_to_host(to_pointer(dst), to_pointer(src), n, to_stream(after));
           },
           py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("after") = 0, py::arg("for_waiter") = false)
      .def("copy_to_device",
           [](HostBackend& b, uintptr_t dst, uintptr_t src, size_t n, uintptr_t after, bool for_waiter) {
             return for_waiter ? b.copy_to_device_for_waiter(to_pointer(dst), to_pointer(src), n, to_stream(after))
                               : b.copy_to_device(to_pointer(dst), to_pointer(src), n, to_stream(after));
           },
           py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("after") = 0, py::arg("for_waiter") = false)
      .def("pending_copies",
           [](HostBackend& b, const std::string& d) { return b.pending_copies(parse_direction(d)); })
      .def("copy_timeline", [](HostBackend& b) { return timeline_dict(b.copy_timeline()); },
           "Note [Copy timeline]: totals, and the records kept since set_copy_timeline(True).")
      .def("set_copy_timeline",
           [](HostBackend& b, bool record, bool clear) {
             if (clear) b.copy_timeline().clear();
             b.copy_timeline().set_enabled(record);
           },
           py::arg("record"), py::arg("clear") = true)
      .def("set_waiter_runs_copies", &HostBackend::set_waiter_runs_copies, py::arg("on"),
           "Note [Waiter runs the copy] on (default) or off.")
      .def("hold_stream", [](HostBackend& b, uintptr_t s) { b.hold_stream(to_stream(s)); })
      .def("release_stream", [](HostBackend& b, uintptr_t s) { b.release_stream(to_stream(s)); })
      // Test helpers: raw access to memory this backend handed out.
      .def("write_bytes",
           [](HostBackend&, uintptr_t address, const py::bytes& data) {
             std::string_view view(data);
             std::memcpy(to_pointer(address), view.data(), view.size());
           })
      .def("read_bytes", [](HostBackend&, uintptr_t address, size_t n) {
        return py::bytes(static_cast<const char*>(to_pointer(address)), n);
      });
}

void bind_evictors(py::module_& core) {
  py::class_<Evictor>(core, "Evictor", "The failure callback of the OOM ladder.")
      .def("evict",
           [](Evictor& e, size_t bytes_needed, uintptr_t s) { return e.evict(bytes_needed, to_stream(s)); },
           py::arg("bytes_needed"), py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def("describe_evictable", &Evictor::describe_evictable);

  py::class_<ListEvictor, Evictor>(
      core, "ListEvictor",
      "Test evictor: deallocates registered allocations, oldest first. Keeps its "
      "allocator alive and uninstalls itself when collected.")
      .def(py::init<CachingAllocator&>(), py::arg("allocator"), py::keep_alive<1, 2>())
      .def("add", &ListEvictor::add)
      .def("remove", &ListEvictor::remove)
      .def_property_readonly("registered_bytes", &ListEvictor::registered_bytes)
      .def_property_readonly("evicted_count", &ListEvictor::evicted_count);
}

void bind_allocator(py::module_& core) {
  using Release = py::call_guard<py::gil_scoped_release>;
  py::class_<CachingAllocator>(core, "CachingAllocator",
                               "PyTorch-style caching allocator bounded by a budget on reserved bytes.")
      .def(py::init([](Backend& backend, size_t budget_bytes, const std::string& name,
                       const std::string& kind, bool expandable_segments, size_t segment_page_bytes) {
             return std::make_unique<CachingAllocator>(backend, parse_kind(kind), budget_bytes, name,
                                                       expandable_segments, segment_page_bytes);
           }),
           py::arg("backend"), py::arg("budget_bytes"), py::arg("name") = "device",
           py::arg("kind") = "device", py::arg("expandable_segments") = false,
           py::arg("segment_page_bytes") = 0, py::keep_alive<1, 2>())
      .def_property_readonly("expandable_segments", &CachingAllocator::expandable_segments)
      .def_property_readonly("segment_page_bytes", &CachingAllocator::segment_page_bytes)
      .def("allocate",
           [](CachingAllocator& a, size_t bytes, uintptr_t s) {
             return to_address(a.allocate(bytes, to_stream(s)));
           },
           py::arg("bytes"), py::arg("stream") = 0, Release())
      .def("deallocate", [](CachingAllocator& a, uintptr_t p) { a.deallocate(to_pointer(p)); },
           Release())
      .def("record_stream",
           [](CachingAllocator& a, uintptr_t p, uintptr_t s) { a.record_stream(to_pointer(p), to_stream(s)); },
           Release())
      .def("release_cached", &CachingAllocator::release_cached, Release())
      .def("set_budget", &CachingAllocator::set_budget, Release())
      .def("budget", &CachingAllocator::budget)
      .def("owns", [](const CachingAllocator& a, uintptr_t p) { return a.owns(to_pointer(p)); })
      .def("allocation_size",
           [](const CachingAllocator& a, uintptr_t p) { return a.allocation_size(to_pointer(p)); })
      .def("largest_free_or_reservable", &CachingAllocator::largest_free_or_reservable)
      .def("usable_range_at",
           [](const CachingAllocator& a, uintptr_t p) { return a.usable_range_at(to_pointer(p)); })
      .def("stats", [](const CachingAllocator& a) { return stats_dict(a.stats()); })
      .def("reset_peak_stats", &CachingAllocator::reset_peak_stats)
      .def("snapshot", [](const CachingAllocator& a) { return snapshot_list(a.snapshot()); })
      // Not owned (see ListEvictor, which uninstalls itself when collected).
      .def("set_evictor", [](CachingAllocator& a, Evictor* e) { a.set_evictor(e); },
           py::arg("evictor").none(true));
}

// The director and filters as pure functions, so tests can check each rule.
void bind_policy(py::module_& core) {
  core.def("decide", [](const py::dict& f, const std::string& actions) {
    VictimFacts facts;
    facts.bytes = f["bytes"].cast<size_t>();
    facts.host_valid = f.contains("host_valid") && f["host_valid"].cast<bool>();
    facts.copy_out_in_flight = f.contains("copy_out_in_flight") && f["copy_out_in_flight"].cast<bool>();
    facts.host_room = !f.contains("host_room") || f["host_room"].cast<bool>();
    facts.recomputable = f.contains("recomputable") && f["recomputable"].cast<bool>();
    if (f.contains("recompute_seconds")) facts.recompute_seconds = f["recompute_seconds"].cast<double>();
    if (f.contains("link_bytes_per_s")) facts.link_bytes_per_s = f["link_bytes_per_s"].cast<double>();
    if (f.contains("d2h_queued_bytes")) facts.d2h_queued_bytes = f["d2h_queued_bytes"].cast<size_t>();
    if (f.contains("h2d_queued_bytes")) facts.h2d_queued_bytes = f["h2d_queued_bytes"].cast<size_t>();
    if (f.contains("seconds_until_next_use")) facts.seconds_until_next_use = f["seconds_until_next_use"].cast<double>();
    if (f.contains("copy_in_stall_seconds")) facts.copy_in_stall_seconds = f["copy_in_stall_seconds"].cast<double>();
    Decision d = decide(facts, AllowedActions::parse(actions));
    py::dict out;
    out["action"] = action_name(d.action);
    out["reason"] = d.reason;
    out["swap_stall_seconds"] = d.swap_stall_seconds;
    out["recompute_stall_seconds"] = d.recompute_stall_seconds;
    return out;
  }, py::arg("facts"), py::arg("actions") = "both", "The director's choice for one victim (facts as a dict).");
  core.def("copy_in_added_stall", [](const std::vector<std::pair<double, size_t>>& on_host, size_t queued_bytes,
                                     double link_bytes_per_s, double seconds_available, size_t bytes) {
    CopyInBacklog backlog(queued_bytes, link_bytes_per_s);
    for (const auto& need : on_host) backlog.add(need.first, need.second);
    backlog.seal();
    return py::make_tuple(backlog.stall_seconds(), backlog.added_stall_seconds(seconds_available, bytes));
  }, py::arg("on_host"), py::arg("queued_bytes"), py::arg("link_bytes_per_s"), py::arg("seconds_available"),
     py::arg("bytes"),
     "Note [Copy-in backlog]: (stall of the entries on host, given as (seconds available, bytes), and what one "
     "more entry would add to it).");
  core.def("filter_score", [](const std::string& name, const py::dict& f, uint64_t clock) {
    EvictionCandidate c;
    c.bytes = f["bytes"].cast<size_t>();
    if (f.contains("host_valid")) c.host_valid = f["host_valid"].cast<bool>();
    if (f.contains("last_access")) c.last_access = f["last_access"].cast<uint64_t>();
    if (f.contains("next_use_distance")) c.next_use_distance = f["next_use_distance"].cast<int64_t>();
    if (f.contains("seconds_until_next_use")) c.seconds_until_next_use = f["seconds_until_next_use"].cast<double>();
    if (f.contains("cost_seconds")) c.cost_seconds = f["cost_seconds"].cast<double>();
    if (f.contains("neighbourhood_seconds")) c.neighbourhood_seconds = f["neighbourhood_seconds"].cast<double>();
    if (f.contains("copy_seconds")) c.copy_seconds = f["copy_seconds"].cast<double>();
    if (f.contains("swap_chosen")) c.swap_chosen = f["swap_chosen"].cast<bool>();
    FilterContext context{clock, 0};
    return make_filter(name)->score(c, context);
  }, py::arg("policy"), py::arg("candidate"), py::arg("clock"), "A filter's score (higher: evicted first).");
  py::class_<EvictedNeighbourhoods>(core, "EvictedNeighbourhoods", "DTR's union-find of dropped entries.")
      .def(py::init<>())
      .def("add", &EvictedNeighbourhoods::add)
      .def("remove", &EvictedNeighbourhoods::remove)
      .def("cost_of", &EvictedNeighbourhoods::cost_of);
}

}  // namespace

py::list snapshot_list(const std::vector<SegmentInfo>& segments) {
  py::list result;
  for (const SegmentInfo& segment : segments) {
    py::list blocks;
    for (const BlockInfo& block : segment.blocks) {
      py::dict entry;
      entry["address"] = block.address;
      entry["size"] = block.size;
      entry["allocated"] = block.allocated;
      entry["stream"] = to_address(block.stream);
      entry["awaiting_events"] = block.awaiting_events;
      blocks.append(entry);
    }
    py::dict entry;
    entry["address"] = segment.address;
    entry["size"] = segment.size;
    entry["mapped_bytes"] = segment.mapped_bytes;
    entry["expandable"] = segment.expandable;
    entry["page_bytes"] = segment.page_bytes;
    entry["retired"] = segment.retired;
    entry["small_pool"] = segment.small_pool;
    entry["blocks"] = blocks;
    py::list mapped;
    for (const auto& [address, bytes] : segment.mapped_ranges) mapped.append(py::make_tuple(address, bytes));
    entry["mapped_ranges"] = mapped;
    result.append(entry);
  }
  return result;
}

void bind_core(py::module_& m) {
  py::module_ core = m.def_submodule(
      "core", "Torch-free core objects (HostBackend, CachingAllocator) for tests and tools.");
  register_out_of_memory_translator();
  bind_events_and_backends(core);
  bind_evictors(core);
  bind_allocator(core);
  bind_policy(core);
}

}  // namespace membudget
