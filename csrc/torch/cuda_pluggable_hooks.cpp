// The C++ CUDA install path: a torch CUDAPluggableAllocator over membudget's
// symbols, with the hooks Python's CUDAPluggableAllocator cannot set. Compiled
// only when torch has CUDA (MEMBUDGET_TORCH_CUDA), linked with torch_cuda.
//
// Note [Why install from C++]: the Python wrapper
// torch.cuda.memory.CUDAPluggableAllocator(path, alloc, free) sets alloc and
// free only. Without a record_stream function torch's recordStream is silently
// a no-op, so a tensor used on a side stream (NCCL, a data-loading stream)
// could have its block reused while that stream still reads it; without a
// reset function torch.cuda.empty_cache() does nothing. Here both are set
// before the allocator is published.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <memory>

#include "core/cuda_backend.h"
#include "torch/cuda_symbols.h"

namespace membudget {

void install_cuda_pluggable_with_hooks() {
  namespace pluggable = torch::cuda::CUDAPluggableAllocator;
  // changeCurrentAllocator refuses too, but with "Can't swap an already
  // initialized allocator", which does not tell the user what to change.
  c10::cuda::CUDACachingAllocator::CUDAAllocator* current =
      c10::cuda::CUDACachingAllocator::get();
  TORCH_CHECK(current == nullptr || !current->initialized(),
              "membudget: torch's CUDA allocator is already initialised (CUDA was "
              "used before membudget.install()); install before the first CUDA "
              "tensor, or run the script with `membudget run`");

  // Built directly rather than through createCustomAllocator so that no cast
  // of its CUDAAllocator result is needed to reach the hook setters.
  auto allocator = std::make_shared<pluggable::CUDAPluggableAllocator>(
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
