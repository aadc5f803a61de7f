#include "sim/replay.h"

#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/caching_allocator.h"
#include "core/out_of_memory.h"
#include "core/sim_backend.h"

namespace membudget {
namespace {

// A simulated saved activation as the residency manager sees it: its device
// memory is a virtual block of the real allocator, and "referenced" follows
// the trace's liveness (true while forward ops or a running backward op use
// the storage, Note [Replay programs]).
class SimulatedActivation final : public ResidencyEntry {
 public:
  SimulatedActivation(size_t bytes, CachingAllocator& device, void* ptr)
      : ResidencyEntry(bytes), device_(device), ptr_(ptr) {}

  bool externally_referenced() const override { return referenced_; }
  void* device_data() const override { return ptr_; }
  void drop_device_copy() override {
    device_.deallocate(ptr_);
    ptr_ = nullptr;
  }
  void attach_device_copy(void* ptr) override { ptr_ = ptr; }

  void set_referenced(bool referenced) { referenced_ = referenced; }
  // Frees the device copy, if any, when the storage dies.
  void free_device_copy() {
    if (ptr_ != nullptr) drop_device_copy();
  }

 private:
  CachingAllocator& device_;
  void* ptr_;
  bool referenced_ = true;
};

// One storage of the program.
struct SimTensor {
  void* device = nullptr;                        // unmanaged device memory
  std::unique_ptr<SimulatedActivation> entry;    // set once packed (manager path)
  void* host = nullptr;                          // offload baselines: host copy
  EventPtr offload_done;                         // the D2H copy of an offload
  EventPtr restore_done;                         // a prefetched H2D copy
};

// Device copies of offloaded tensors whose D2H copy is still running: freed
// once it completes. As the allocator's Evictor it waits for them, which is
// what a caching allocator that syncs the copy stream on OOM would do.
class PendingFrees final : public Evictor {
 public:
  explicit PendingFrees(CachingAllocator& device) : device_(device) {}
  void add(EventPtr done, void* ptr) { pending_.emplace_back(std::move(done), ptr); }
  void reap() {
    for (size_t i = 0; i < pending_.size();) {
      if (pending_[i].first->ready()) {
        device_.deallocate(pending_[i].second);
        pending_[i] = pending_.back();
        pending_.pop_back();
      } else {
        ++i;
      }
    }
  }
  size_t evict(size_t, Stream) override {
    size_t freed = 0;
    for (auto& p : pending_) {
      p.first->wait();
      freed += device_.allocation_size(p.second);
      device_.deallocate(p.second);
    }
    pending_.clear();
    return freed;
  }
  std::string describe_evictable() const override { return "offloaded copies in flight"; }

 private:
  CachingAllocator& device_;
  std::vector<std::pair<EventPtr, void*>> pending_;
};

// Recompute chains deeper than this are a malformed program (a cycle).
constexpr int kMaxReplayDepth = 1000;

class Replayer {
 public:
  Replayer(const ReplayProgram& program, const ReplayConfig& config)
      : program_(program), config_(config),
        backend_(config.capacity_bytes,
                 LinkModel{config.link_bytes_per_s, config.link_duplex_share, config.link_compute_share,
                           config.link_latency_s, config.link_rate_by_size, config.compute_copy_share},
                 config.page_bytes),
        device_(backend_, MemoryKind::device, config.budget_bytes, "device", config.expandable_segments),
        host_tier_(backend_, MemoryKind::host, config.host_budget_bytes, "host tier"),
        manager_(backend_, device_, host_tier_, config.manager), pending_frees_(device_),
        tensors_(program.tensor_bytes.size()) {
    device_.set_evictor(config.use_manager ? static_cast<Evictor*>(&manager_) : &pending_frees_);
  }

  ~Replayer() { release_everything(); }

  ReplayResult run() {
    ReplayResult result;
    const size_t n = program_.codes.size();
    size_t i = 0;
    try {
      for (; i < program_.prologue_length; ++i) step(i);
      for (int iteration = 0; iteration < config_.iterations; ++iteration) {
        if (iteration == config_.iterations - 1) start_measuring();
        for (i = program_.prologue_length; i < n; ++i) step(i);
      }
      manager_.synchronize();
    } catch (const OutOfMemory& error) {
      result.feasible = false;
      result.error = error.what();
      result.failed_instruction = static_cast<int64_t>(i);
    } catch (const std::runtime_error& error) {  // e.g. a recompute chain that cannot end
      result.feasible = false;
      result.error = std::string("replay failed: ") + error.what();
      result.failed_instruction = static_cast<int64_t>(i);
    }
    finish(result);
    return result;
  }

 private:
  size_t bytes_of(int64_t t) const { return program_.tensor_bytes[static_cast<size_t>(t)]; }

  void start_measuring() {
    manager_.reset_counters();
    device_.reset_peak_stats();
    start_time_ = backend_.now();
    start_stall_ = backend_.stall_seconds();
    start_d2h_ = backend_.copied_bytes(CopyDirection::device_to_host);
    start_h2d_ = backend_.copied_bytes(CopyDirection::host_to_device);
    compute_s_ = recompute_s_ = recompute_ahead_s_ = 0.0;
    backend_.copy_timeline().clear();
    backend_.copy_timeline().set_enabled(config_.record_timeline);
  }

  void finish(ReplayResult& r) {
    AllocatorStats s = device_.stats();
    r.peak_reserved_bytes = s.reserved_peak;
    r.peak_allocated_bytes = s.allocated_peak;
    r.compute_s = compute_s_;
    r.recompute_s = recompute_s_;
    r.stall_s = backend_.stall_seconds() - start_stall_;
    r.total_s = backend_.now() - start_time_;
    r.swap_out_bytes = backend_.copied_bytes(CopyDirection::device_to_host) - start_d2h_;
    r.swap_in_bytes = backend_.copied_bytes(CopyDirection::host_to_device) - start_h2d_;
    ManagerStats m = manager_.stats();
    r.eviction_count = m.eviction_count;
    r.recompute_count = m.recompute_count;
    r.unpack_stall_s = m.stall_seconds;
    r.drop_count = m.drop_count;
    r.prefetch_hits = m.prefetch_hits;
    r.prefetch_misses = m.prefetch_misses;
    r.recomputed_ahead_count = m.recomputed_ahead_count;
    r.recompute_ahead_wasted = m.recompute_ahead_wasted;
    r.recompute_ahead_failed = m.recompute_ahead_failed;
    r.recompute_ahead_s = recompute_ahead_s_;
    const CopyTimeline& timeline = backend_.copy_timeline();
    r.copy_totals = timeline.totals();
    r.copies = timeline.copies();
    r.waits = timeline.waits();
  }

  void step(size_t i) {
    const auto code = static_cast<ReplayCode>(program_.codes[i]);
    const int64_t id = program_.tensors[i];
    if (code != ReplayCode::compute && code != ReplayCode::recompute &&
        (id < 0 || static_cast<size_t>(id) >= tensors_.size())) {
      throw std::invalid_argument("replay: instruction " + std::to_string(i) + " names no valid tensor");
    }
    pending_frees_.reap();
    switch (code) {
      case ReplayCode::compute:
        backend_.run_compute(program_.seconds[i]);
        compute_s_ += program_.seconds[i];
        break;
      case ReplayCode::recompute:
        backend_.run_compute(program_.seconds[i]);
        recompute_s_ += program_.seconds[i];
        break;
      case ReplayCode::alloc: alloc(id); break;
      case ReplayCode::free: free(id); break;
      case ReplayCode::pack: pack(id); break;
      case ReplayCode::release: release(id); break;
      case ReplayCode::unpack: unpack(id); break;
      case ReplayCode::offload_sync: offload(id, /*wait=*/true); break;
      case ReplayCode::offload_async: offload(id, /*wait=*/false); break;
      case ReplayCode::restore: restore(id); break;
      case ReplayCode::prefetch: prefetch(id); break;
      default: throw std::invalid_argument("replay: unknown instruction code " + std::to_string(program_.codes[i]));
    }
  }

  void alloc(int64_t id) {
    SimTensor& t = tensors_[id];
    if (t.device != nullptr || t.entry) return;  // already live (a prologue tensor)
    t.device = device_.allocate(bytes_of(id));
  }

  void free(int64_t id) {
    SimTensor& t = tensors_[id];
    if (t.entry) {
      by_entry_id_.erase(t.entry->id());
      manager_.unregister_entry(t.entry.get());
      t.entry->free_device_copy();
      t.entry.reset();
    }
    if (t.device != nullptr) device_.deallocate(t.device);
    t.device = nullptr;
    if (t.host != nullptr) host_tier_.deallocate(t.host);
    t.host = nullptr;
    t.restore_done.reset();
    if (t.offload_done) {
      t.offload_done->wait();  // a copy cannot outlive its source
      t.offload_done.reset();
    }
  }

  void pack(int64_t id) {
    SimTensor& t = tensors_[id];
    if (t.entry) {
      manager_.touch(t.entry.get());
      return;
    }
    if (t.device == nullptr) return;  // not device-resident: nothing to manage
    t.entry = std::make_unique<SimulatedActivation>(bytes_of(id), device_, t.device);
    t.device = nullptr;
    by_entry_id_[t.entry->id()] = id;
    manager_.register_entry(t.entry.get());
    if (recomputable(id)) {
      std::vector<uint64_t> input_ids;
      for (int64_t input : replay_inputs(id)) input_ids.push_back(tensors_[input].entry->id());
      manager_.set_recompute_info(t.entry.get(), true, program_.replay_seconds[id], input_ids);
    }
  }

  void release(int64_t id) {
    SimTensor& t = tensors_[id];
    if (t.entry) {
      t.entry->set_referenced(false);
    } else if (t.host != nullptr && t.device != nullptr) {
      // An offloaded tensor: its device copy goes once the D2H copy is done.
      if (t.offload_done && !t.offload_done->ready()) {
        pending_frees_.add(t.offload_done, t.device);
      } else {
        device_.deallocate(t.device);
      }
      t.device = nullptr;
    }
  }

  void unpack(int64_t id) {
    SimTensor& t = tensors_[id];
    if (!t.entry) return;
    if (manager_.materialize(t.entry.get(), nullptr) == nullptr) rebuild(id, 0);
    t.entry->set_referenced(true);
    manager_.unpin(t.entry.get());
    if (manager_.recompute_ahead_pending()) recompute_ahead();
  }

  // Note [Recompute ahead]: replays what the prefetcher queued, each on the
  // side stream, as the CUDA binding does. A replay that finds no room (its
  // allocation may evict only entries needed later) is dropped again.
  void recompute_ahead() {
    for (int round = 0; round < 8 && manager_.recompute_ahead_pending(); ++round) {
      for (uint64_t entry_id : manager_.take_recompute_ahead()) {
        auto found = by_entry_id_.find(entry_id);
        if (found == by_entry_id_.end()) continue;
        const int64_t id = found->second;
        SimulatedActivation* entry = tensors_[id].entry.get();
        if (!manager_.begin_recompute_ahead(entry)) continue;
        std::vector<SimulatedActivation*> inputs;
        EventPtr ready;
        bool succeeded = false;
        const double seconds = program_.replay_seconds[id];
        try {
          for (int64_t input : replay_inputs(id)) {
            SimulatedActivation* e = tensors_[input].entry.get();
            if (manager_.materialize(e, nullptr) == nullptr) rebuild(input, 1);
            inputs.push_back(e);
          }
          // Speculative: no room is no OOM (Note [Speculative allocations]).
          void* ptr = device_.try_allocate(bytes_of(id));
          if (ptr == nullptr) throw OutOfMemory("no room for a replay ahead", bytes_of(id));
          entry->attach_device_copy(ptr);
          const double before = backend_.now();
          ready = backend_.run_side_compute(seconds, config_.side_stream_overlap);
          recompute_s_ += backend_.now() - before;  // the compute stream's share
          recompute_ahead_s_ += seconds;
          succeeded = true;
        } catch (const OutOfMemory&) {
          // Speculative: replayed on demand at its unpack instead.
        }
        manager_.complete_recompute_ahead(entry, succeeded, seconds, std::move(ready));
        for (SimulatedActivation* e : inputs) manager_.unpin(e);
      }
    }
  }

  bool recomputable(int64_t id) const {
    return static_cast<size_t>(id) < program_.replay_seconds.size() && program_.replay_seconds[id] > 0.0;
  }

  // Managed inputs of a tensor's replay that are still live, by tensor id.
  std::vector<int64_t> replay_inputs(int64_t id) const {
    std::vector<int64_t> out;
    if (static_cast<size_t>(id) + 1 >= program_.replay_input_offsets.size()) return out;
    for (int64_t k = program_.replay_input_offsets[id]; k < program_.replay_input_offsets[id + 1]; ++k) {
      const int64_t input = program_.replay_inputs[static_cast<size_t>(k)];
      if (input != id && tensors_[input].entry) out.push_back(input);
    }
    return out;
  }

  // A dropped entry that materialize() marked recomputing (and pinned):
  // bring its managed inputs back (rebuilding dropped ones first), allocate
  // it, run its replay on the compute stream, hand it back to the manager.
  double rebuild(int64_t id, int depth) {
    if (depth > kMaxReplayDepth) throw std::runtime_error("replay: recompute chain too deep");
    SimulatedActivation* entry = tensors_[id].entry.get();
    // Timed as the runtime times a replay (Note [Replay overhead]): its
    // replays (its own, its dropped inputs') and its waits for copies (its
    // inputs' swap-ins, its allocation's evictions). Not the wall time in
    // between, which also runs side-stream replays ahead.
    const double stalled = backend_.stall_seconds();
    double replays = 0.0;
    std::vector<SimulatedActivation*> inputs;
    for (int64_t input : replay_inputs(id)) {
      SimulatedActivation* e = tensors_[input].entry.get();
      if (manager_.materialize(e, nullptr) == nullptr) replays += rebuild(input, depth + 1);
      inputs.push_back(e);  // pinned by materialize until unpin below
    }
    void* ptr = device_.allocate(bytes_of(id));
    const double seconds = program_.replay_seconds[id] + config_.replay_overhead_s;
    backend_.run_compute(seconds);
    recompute_s_ += seconds;
    replays += seconds;
    entry->attach_device_copy(ptr);
    manager_.complete_recompute(entry, true, replays + (backend_.stall_seconds() - stalled));
    for (SimulatedActivation* e : inputs) manager_.unpin(e);
    return replays;
  }

  void offload(int64_t id, bool wait) {
    SimTensor& t = tensors_[id];
    if (t.device == nullptr || t.host != nullptr) return;
    t.host = host_tier_.allocate(bytes_of(id));
    EventPtr done = backend_.copy_to_host(t.host, t.device, bytes_of(id), nullptr);
    if (wait) {
      backend_.stream_wait(nullptr, done);
    } else {
      t.offload_done = std::move(done);
    }
  }

  void prefetch(int64_t id) {
    SimTensor& t = tensors_[id];
    if (t.device != nullptr || t.host == nullptr) return;
    t.device = device_.allocate(bytes_of(id));
    t.restore_done = backend_.copy_to_device(t.device, t.host, bytes_of(id), nullptr);
  }

  void restore(int64_t id) {
    SimTensor& t = tensors_[id];
    if (t.host == nullptr) return;
    if (t.device == nullptr) prefetch(id);
    if (t.restore_done) {
      backend_.stream_wait(nullptr, t.restore_done);
      t.restore_done.reset();
    }
  }

  // Entries must leave the manager before it (and the allocator) go away.
  void release_everything() {
    for (size_t id = 0; id < tensors_.size(); ++id) {
      try {
        free(static_cast<int64_t>(id));
      } catch (...) {
        // Tearing down after a failed replay: nothing left to report to.
      }
    }
    pending_frees_.evict(0, nullptr);
    device_.set_evictor(nullptr);
  }

  const ReplayProgram& program_;
  const ReplayConfig& config_;
  SimBackend backend_;
  CachingAllocator device_;
  CachingAllocator host_tier_;
  ResidencyManager manager_;
  PendingFrees pending_frees_;
  std::vector<SimTensor> tensors_;
  std::unordered_map<uint64_t, int64_t> by_entry_id_;  // manager entry id -> tensor id
  double recompute_ahead_s_ = 0.0;
  double start_time_ = 0.0, start_stall_ = 0.0;
  size_t start_d2h_ = 0, start_h2d_ = 0;
  double compute_s_ = 0.0, recompute_s_ = 0.0;
};

}  // namespace

ReplayResult replay(const ReplayProgram& program, const ReplayConfig& config) {
  const size_t n = program.codes.size();
  if (program.tensors.size() != n || program.seconds.size() != n || program.prologue_length > n) {
    throw std::invalid_argument("replay: codes, tensors and seconds must have one entry per instruction");
  }
  const size_t tensors = program.tensor_bytes.size();
  if (!program.replay_seconds.empty() &&
      (program.replay_seconds.size() != tensors || program.replay_input_offsets.size() != tensors + 1 ||
       static_cast<size_t>(program.replay_input_offsets.back()) != program.replay_inputs.size())) {
    throw std::invalid_argument("replay: replay_seconds / replay_input_offsets do not match the tensors");
  }
  for (int64_t input : program.replay_inputs) {
    if (input < 0 || static_cast<size_t>(input) >= tensors) throw std::invalid_argument("replay: bad replay input");
  }
  Replayer replayer(program, config);
  return replayer.run();
}

}  // namespace membudget
