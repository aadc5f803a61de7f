// The C++ CUDA install path: a torch CUDAPluggableAllocator over membudget's
// symbols, with the hooks Python's CUDAPluggableAllocator cannot set and the
// memory queries torch's class refuses. Compiled only when torch has CUDA
// (MEMBUDGET_TORCH_CUDA), linked with torch_cuda.
//
// Note [Why install from C++]: the Python wrapper
// torch.cuda.memory.CUDAPluggableAllocator(path, alloc, free) sets alloc and
// free only. Without a record_stream function torch's recordStream is silently
// a no-op, so a tensor used on a side stream (NCCL, a data-loading stream)
// could have its block reused while that stream still reads it; without a
// reset function torch.cuda.empty_cache() does nothing. Here both are set
// before the allocator is published.
//
// Note [Torch memory queries]: torch's CUDAPluggableAllocator implements
// cacheInfo, getDeviceStats, resetPeakStats and resetAccumulatedStats as
// TORCH_CHECK(false). Unchanged user scripts call them: cuDNN with
// torch.backends.cudnn.benchmark asks cacheInfo for the largest block before
// benchmarking a new convolution shape, and torch.cuda.memory_allocated(),
// max_memory_reserved(), memory_stats() and reset_peak_memory_stats() go
// through the other three. BudgetedPluggableAllocator answers them from the
// runtime's device allocator, so torch reports membudget's own numbers (the
// same as membudget.memory_stats()); the allocation path is torch's class,
// unchanged.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "core/caching_allocator.h"
#include "core/cuda_backend.h"
#include "torch/cuda_symbols.h"
#include "torch/runtime.h"

namespace membudget {

namespace {

namespace pluggable = torch::cuda::CUDAPluggableAllocator;
using PluggableBase = pluggable::CUDAPluggableAllocator;

// The return and device-index types of a torch allocator method, read from
// the method itself: DeviceStats moved from c10::cuda::CUDACachingAllocator
// (torch 2.4) to c10::CachingDeviceAllocator (2.13), and the device parameter
// was `int` before c10::DeviceIndex (torch 2.2 and older). Spelling either out would tie this file to
// one range of torch versions; `override` still checks the signatures.
template <typename Method>
struct AllocatorMethod;
template <typename Result, typename Class, typename Device, typename... Rest>
struct AllocatorMethod<Result (Class::*)(Device, Rest...)> {
  using result = Result;
  using device_index = Device;
};

using DeviceStats = AllocatorMethod<decltype(&PluggableBase::getDeviceStats)>::result;
using StatsDevice = AllocatorMethod<decltype(&PluggableBase::getDeviceStats)>::device_index;
using CacheInfoDevice = AllocatorMethod<decltype(&PluggableBase::cacheInfo)>::device_index;
using PeakDevice = AllocatorMethod<decltype(&PluggableBase::resetPeakStats)>::device_index;
using AccumulatedDevice = AllocatorMethod<decltype(&PluggableBase::resetAccumulatedStats)>::device_index;
using PoolDevice = AllocatorMethod<decltype(&PluggableBase::beginAllocateToPool)>::device_index;

// StatType::AGGREGATE ("all" in torch.cuda.memory_stats keys). The enum moved
// namespaces with DeviceStats; its value has been 0 in every version. The
// small_pool/large_pool entries stay 0: membudget's pools do not match torch's.
constexpr size_t kAggregateStat = 0;

// The device allocator serving `device`, or nullptr: before install, or for a
// device this runtime does not manage (membudget budgets one device per
// process, and allocations on any other fail in membudget_cuda_malloc).
CachingAllocator* device_allocator_for(int device) {
  Runtime* runtime = Runtime::get();
  if (runtime == nullptr) return nullptr;
  auto* cuda = dynamic_cast<CudaBackend*>(&runtime->backend());
  if (cuda == nullptr || cuda->device() != device) return nullptr;
  return &runtime->device_allocator();
}

// membudget tracks no peak for counts and requested bytes, and no cumulative
// allocated/freed bytes: those peaks are reported as the current value (a
// lower bound), the cumulative fields stay 0.
template <typename StatArray>
void set_aggregate(StatArray& stats, size_t current, size_t peak) {
  auto& aggregate = stats[kAggregateStat];
  aggregate.current = static_cast<int64_t>(current);
  aggregate.peak = static_cast<int64_t>(std::max(current, peak));
}

// See Note [Torch memory queries].
class BudgetedPluggableAllocator final : public PluggableBase {
 public:
  using PluggableBase::PluggableBase;

  // The largest block an allocation could get now without evicting anything
  // (CachingAllocator::largest_free_or_reservable), capped by what the device
  // can still give. cuDNN only uses it to bound the workspaces it tries; a
  // larger request is still served, or raises torch.OutOfMemoryError, which
  // cuDNN's benchmark catches. Overstating it costs more: a workspace above
  // what is free makes the allocator evict saved activations for a trial.
  void cacheInfo(CacheInfoDevice device, size_t* largest_block) override {
    *largest_block = 0;
    CachingAllocator* allocator = device_allocator_for(static_cast<int>(device));
    if (allocator == nullptr) return;
    const size_t largest = allocator->largest_free_or_reservable();
    // Without a budget (or one above the device's memory) the budget's
    // headroom is unbounded; the device's free memory plus what membudget
    // holds unallocated bounds what a new segment could get.
    const AllocatorStats stats = allocator->stats();
    const size_t cached_free = stats.reserved_current - std::min(stats.allocated_current, stats.reserved_current);
    size_t device_free = 0;
    size_t device_total = 0;
    {
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
      if (cudaMemGetInfo(&device_free, &device_total) != cudaSuccess) {
        // Cleared so that torch's next launch check does not report it;
        // counting only the cached memory keeps the answer conservative.
        (void)cudaGetLastError();
        device_free = 0;
      }
    }
    *largest_block = std::min(largest, device_free + cached_free);
  }

  DeviceStats getDeviceStats(StatsDevice device) override {
    DeviceStats result;
    CachingAllocator* allocator = device_allocator_for(static_cast<int>(device));
    if (allocator == nullptr) return result;
    const AllocatorStats stats = allocator->stats();
    set_aggregate(result.allocated_bytes, stats.allocated_current, stats.allocated_peak);
    // Blocks awaiting stream events (Note [Stream-ordered reuse]) are not
    // counted apart, so active is allocated, torch's lower bound for it.
    set_aggregate(result.active_bytes, stats.allocated_current, stats.allocated_peak);
    set_aggregate(result.reserved_bytes, stats.reserved_current, stats.reserved_peak);
    set_aggregate(result.requested_bytes, stats.requested_current, stats.requested_current);
    set_aggregate(result.segment, stats.num_segments, stats.num_segments);
    set_aggregate(result.allocation, stats.num_live_blocks, stats.num_live_blocks);
    set_aggregate(result.active, stats.num_live_blocks, stats.num_live_blocks);
    result.num_alloc_retries = static_cast<int64_t>(stats.num_alloc_retries);
    result.num_ooms = static_cast<int64_t>(stats.num_ooms);
    return result;
  }

  // torch.cuda.reset_peak_memory_stats(): the same as
  // membudget.reset_peak_stats() (Runtime::reset_peak_stats), so both views agree.
  void resetPeakStats(PeakDevice device) override {
    if (device_allocator_for(static_cast<int>(device)) != nullptr) Runtime::get()->reset_peak_stats();
  }

  // torch.cuda.reset_accumulated_memory_stats(): the same as
  // membudget.reset_counters() (Runtime::reset_counters); torch's version zeroes
  // num_alloc_retries and num_ooms, which are membudget's counters here.
  void resetAccumulatedStats(AccumulatedDevice device) override {
    if (device_allocator_for(static_cast<int>(device)) != nullptr) Runtime::get()->reset_counters();
  }

  // Note [CUDA graphs refused]: a captured graph replays into the addresses
  // it was captured with, so torch gives capture a private pool that nothing
  // else may reuse until the graph goes. membudget has no such pools, and
  // its budget frees and reuses blocks at will: a replayed graph would write
  // into memory that other tensors hold by then, silently. torch calls this
  // as capture begins (torch.cuda.graph, torch.compile's
  // mode="reduce-overhead"), so the refusal comes before anything is
  // captured, with what to use instead.
  void beginAllocateToPool(PoolDevice /*device*/, c10::cuda::MempoolId_t /*mempool_id*/,
                           std::function<bool(cudaStream_t)> /*filter*/) override {
    // torch.cuda.use_mem_pool(pool) (a torch.cuda.MemPool) begins a private
    // pool here too, so the message names both.
    TORCH_CHECK(false,
                "membudget: private memory pools are not supported under a membudget allocator: CUDA "
                "graph capture (its budget reuses memory a captured graph would keep writing to) and "
                "torch.cuda.use_mem_pool. Compile with torch.compile(mode=\"default\") or "
                "mode=\"max-autotune-no-cudagraphs\", allocate outside the pool, or run without membudget.");
  }
};

}  // namespace

Stream current_cuda_stream(int device) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
}

void install_cuda_pluggable_with_hooks() {
  // changeCurrentAllocator refuses too, but with "Can't swap an already
  // initialized allocator", which does not tell the user what to change.
  c10::cuda::CUDACachingAllocator::CUDAAllocator* current =
      c10::cuda::CUDACachingAllocator::get();
  TORCH_CHECK(current == nullptr || !current->initialized(),
              "membudget: torch's CUDA allocator is already initialised (CUDA was "
              "used before membudget.install()); install before the first CUDA "
              "tensor, or run the script with `membudget run`");

  // Built directly rather than through createCustomAllocator so that no cast
  // of its CUDAAllocator result is needed to reach the hook setters, and so
  // that the allocator is the subclass of Note [Torch memory queries].
  auto allocator = std::make_shared<BudgetedPluggableAllocator>(
      [](size_t size, int device, cudaStream_t stream) {
        return membudget_cuda_malloc(size, device, static_cast<void*>(stream));
      },
      [](void* ptr, size_t size, int device, cudaStream_t stream) {
        membudget_cuda_free(ptr, size, device, static_cast<void*>(stream));
      });
  allocator->set_record_stream_fn([](void* ptr, cudaStream_t stream) {
    membudget_cuda_record_stream(ptr, static_cast<void*>(stream));
  });
  allocator->set_reset_fn([] { membudget_cuda_empty_cache(); });
  // What createCustomAllocator does before returning: marks it initialised
  // (there is no init function to call).
  allocator->init(cuda_device_count());
  pluggable::changeCurrentAllocator(allocator);
}

}  // namespace membudget
