// The replay driver of the simulator: runs a training step, compiled from a
// trace into a flat program of memory and time events, through the real
// CachingAllocator and ResidencyManager (with the real filters) over a
// SimBackend. See DESIGN.md "Traces and the simulator".
//
// Note [Replay programs]: Python (membudget/simulate.py) compiles a trace into
// instructions; each names a tensor (a storage) or carries a duration. The
// manager path uses pack/release/unpack exactly as the torch binding calls the
// manager (register at pack, evictable once only autograd references the
// storage, materialize+unpin at unpack). The offload instructions model the
// baselines that do not use the manager (save_on_cpu, torchtune-style
// offloading with a prefetch window). The body runs `iterations` times; the
// manager predicts from the previous iteration, so only the last is measured.
// A packed tensor with a replay cost is declared recomputable to the manager
// (set_recompute_info, with its managed inputs); when an unpack finds it
// dropped, the driver does what the torch binding's lineage replay does:
// materialize its managed inputs (recursively rebuilding dropped ones),
// allocate it, run the compute stream for the replay cost (counted as
// recompute) and complete_recompute(). With the manager's recompute_ahead on,
// after each unpack the driver replays what the prefetcher queued as the CUDA
// binding does: at once, on a side stream (Note [Side stream contention] in
// sim_backend.h), the unpack waiting for its event.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/copy_timeline.h"
#include "core/residency_manager.h"

namespace membudget {

enum class ReplayCode : uint8_t {
  compute = 0,        // seconds: the compute stream runs an op
  recompute = 1,      // seconds: a forward op run again (counted as recompute)
  alloc = 2,          // tensor: allocate its device memory
  free = 3,           // tensor: its last reference is gone
  pack = 4,           // tensor: autograd saved it; the manager manages it
  release = 5,        // tensor: referenced only by autograd (or the host copy)
  unpack = 6,         // tensor: backward needs it (materialize; referenced again)
  offload_sync = 7,   // tensor: copy to host and wait (save_on_cpu)
  offload_async = 8,  // tensor: copy to host on the D2H stream
  restore = 9,        // tensor: an offloaded tensor is needed now
  prefetch = 10,      // tensor: start bringing an offloaded tensor back
};

struct ReplayProgram {
  std::vector<uint64_t> tensor_bytes;  // by tensor id
  std::vector<uint8_t> codes;          // ReplayCode per instruction
  std::vector<int64_t> tensors;        // tensor id per instruction (-1: none)
  std::vector<double> seconds;         // duration per instruction (compute, recompute)
  size_t prologue_length = 0;          // leading instructions run once (parameters)
  // Recompute (Note [Replay programs]): per tensor, the modelled seconds of
  // replaying what produced it (<= 0: not recomputable), and the managed
  // tensors that replay reads, as CSR rows (offsets has one entry per tensor
  // plus one; empty vectors: nothing is recomputable).
  std::vector<double> replay_seconds;
  std::vector<int64_t> replay_input_offsets;
  std::vector<int64_t> replay_inputs;
};

struct ReplayConfig {
  size_t budget_bytes = 0;
  size_t capacity_bytes = 0;           // device memory of the modelled device
  double link_bytes_per_s = 1e10;
  double link_duplex_share = 1.0;      // Note [Modelled link]
  double link_latency_s = 0.0;
  size_t page_bytes = 0;               // expandable segments' granularity (0: a GPU's 2 MiB)
  double link_compute_share = 1.0;
  std::vector<std::pair<double, double>> link_rate_by_size;  // Note [Rate by copy size]
  double compute_copy_share = 1.0;     // Note [Compute beside a copy]
  size_t host_budget_bytes = size_t{1} << 42;
  bool use_manager = true;             // false: no eviction (baselines)
  bool expandable_segments = true;     // as the runtime's default
  ManagerConfig manager;               // policy, actions, prefetch, watermark, link, recompute_ahead
  int iterations = 2;
  // Note [Side stream contention]: the share of a side-stream replay that
  // backward's kernels leave room for (0: none, 1: all).
  double side_stream_overlap = 0.25;
  // Note [Replay overhead]: modelled time a replay on demand takes beyond
  // its ops (the runtime's replay goes through Python); 0 by default.
  double replay_overhead_s = 0.0;
  bool record_timeline = false;        // keep the measured iteration's copies and waits
};

struct ReplayResult {
  bool feasible = true;
  std::string error;                   // the OOM message when infeasible
  int64_t failed_instruction = -1;
  size_t peak_reserved_bytes = 0;      // of the measured iteration
  size_t peak_allocated_bytes = 0;
  double compute_s = 0.0;
  double recompute_s = 0.0;
  double stall_s = 0.0;                // every wait of the compute stream for a copy
  double unpack_stall_s = 0.0;         // the manager's stall_seconds: unpacks waiting for swap-ins
  double total_s = 0.0;                // modelled wall time of the measured iteration
  size_t swap_out_bytes = 0;
  size_t swap_in_bytes = 0;
  size_t eviction_count = 0;
  size_t drop_count = 0;               // evictions that dropped (to recompute)
  size_t recompute_count = 0;
  size_t prefetch_hits = 0;
  size_t prefetch_misses = 0;
  size_t recomputed_ahead_count = 0;   // Note [Recompute ahead]
  size_t recompute_ahead_wasted = 0;
  size_t recompute_ahead_failed = 0;
  double recompute_ahead_s = 0.0;      // side-stream replay seconds (their compute-stream share is in recompute_s)
  // Note [Copy timeline] of the measured iteration, on modelled time (the
  // records only with ReplayConfig::record_timeline).
  CopyTotals copy_totals;
  std::vector<CopyRecord> copies;
  std::vector<WaitRecord> waits;
};

// Runs the program (Note [Replay programs]); never throws for an OOM, which
// makes the result infeasible. Throws std::invalid_argument for a malformed
// program.
ReplayResult replay(const ReplayProgram& program, const ReplayConfig& config);

}  // namespace membudget
