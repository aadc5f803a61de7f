// The process-wide runtime that install() creates: one backend, the budgeted
// device allocator, the pooled host tier and the residency manager. It lives
// until the process exits (never destroyed: tensors freed during interpreter
// shutdown still call into the allocator).
#pragma once
#include <c10/core/Device.h>

#include <memory>
#include <string>

#include "core/backend.h"
#include "core/caching_allocator.h"

namespace membudget {

class ResidencyManager;

struct RuntimeConfig {
  size_t budget_bytes = 0;        // device budget on reserved bytes
  size_t host_budget_bytes = 0;   // bound of the host swap tier
  std::string policy = "delta";   // filter name
  std::string actions = "both";   // swap | recompute | both
  size_t min_tensor_bytes = 1 << 20;
  size_t prefetch_bytes = 256u << 20;
  double high_watermark = 0.8;    // fraction of budget where background swap-out starts
  bool log_decisions = false;
  double link_bytes_per_s = 10e9; // host link until copies measure it
  // Note [Expandable segments]; fixed when the runtime is created.
  bool expandable_segments = true;
  // Note [Recompute ahead]: resolved by install() ("auto" per device).
  bool recompute_ahead = false;
  // Note [Copies ahead where copies are free] (residency_manager.h): set by install().
  bool copies_ahead = true;
};

class Runtime {
 public:
  // The runtime, or nullptr before install.
  static Runtime* get();
  // Creates the runtime once per process; a second call throws.
  static Runtime& create(std::unique_ptr<Backend> backend, const std::string& device_kind,
                         const RuntimeConfig& config);

  Backend& backend() { return *backend_; }
  CachingAllocator& device_allocator() { return *device_allocator_; }
  CachingAllocator& host_tier() { return *host_tier_; }
  ResidencyManager& manager() { return *manager_; }

  // What membudget.reset_peak_stats() and reset_counters() reset, and
  // torch.cuda.reset_peak_memory_stats() / reset_accumulated_memory_stats()
  // with them (Note [Torch memory queries]), so both views agree.
  void reset_peak_stats();
  void reset_counters();
  const RuntimeConfig& config() const { return config_; }
  void reconfigure(const RuntimeConfig& config);
  // "cpu" (HostBackend: torch CPU tensors are the managed memory) or "cuda".
  const std::string& device_kind() const { return device_kind_; }
  // Whether pack hands out SavedActivations (false after uninstall).
  bool managing() const { return managing_; }
  void set_managing(bool managing) { managing_ = managing; }

 private:
  Runtime(std::unique_ptr<Backend> backend, const std::string& device_kind, const RuntimeConfig& config);
  RuntimeConfig config_;
  std::string device_kind_;
  bool managing_ = true;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<CachingAllocator> device_allocator_;
  std::unique_ptr<CachingAllocator> host_tier_;
  std::unique_ptr<ResidencyManager> manager_;
};

// Allocates from the runtime's device allocator and rethrows
// membudget::OutOfMemory as c10::OutOfMemoryError, so Python sees
// torch.OutOfMemoryError. Every torch-facing allocation entry point (the CPU
// c10::Allocator, the CUDA pluggable symbols) goes through this.
void* allocate_device_for_torch(size_t bytes, Stream stream);
// Frees memory returned by allocate_device_for_torch.
void free_device_for_torch(void* ptr);

// Torch's current stream on `device`, which the manager orders its copies
// after (Note [Copies ordered after the entry's stream] in
// core/residency_entry.h). nullptr off CUDA, and on CUDA in a build without
// CUDA torch (whose extension cannot run a CUDA runtime anyway).
Stream torch_current_stream(const c10::Device& device);

// Note [Speculative allocations]: while one of these is alive on a thread,
// an allocation there that the budget cannot fit (after eviction) fails with
// c10::OutOfMemoryError without counting as an out-of-memory (num_ooms): it
// belongs to work that is given up on failure, a replay ahead of use (Note
// [Recompute ahead]), and is done again, on demand, when it is needed.
class SpeculativeAllocations {
 public:
  SpeculativeAllocations();
  ~SpeculativeAllocations();
  SpeculativeAllocations(const SpeculativeAllocations&) = delete;
  SpeculativeAllocations& operator=(const SpeculativeAllocations&) = delete;

 private:
  bool previous_;
};

}  // namespace membudget
