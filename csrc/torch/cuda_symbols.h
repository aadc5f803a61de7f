// The CUDA side of the torch binding: the extern "C" symbols that torch's
// CUDAPluggableAllocator calls, and the C++ install path with hooks.
//
// Note [Pluggable allocator symbols]: torch calls
//   alloc(size_t size, int device, cudaStream_t stream)
//   free(void* ptr, size_t size, int device, cudaStream_t stream)
// (torch/csrc/cuda/CUDAPluggableAllocator.h; the Python docstring of
// CUDAPluggableAllocator omits free's device argument, the header is what
// counts). cudaStream_t is a pointer type, so the symbols take `void*` streams:
// the same ABI, and this file compiles without the CUDA toolkit. The extension
// is built with hidden visibility; these are exported explicitly so that
// ctypes.CDLL(extension_path()) finds them.
#pragma once
#include <cstddef>
#include <memory>

#include "core/backend.h"

#define MEMBUDGET_EXPORT __attribute__((visibility("default")))

extern "C" {
// Allocates `size` bytes usable on `stream` from the runtime's budgeted device
// allocator. Throws torch.OutOfMemoryError (c10::OutOfMemoryError) at the end
// of the OOM ladder, and c10::Error when `device` is not the runtime's device.
MEMBUDGET_EXPORT void* membudget_cuda_malloc(size_t size, int device, void* stream);
// Frees a pointer from membudget_cuda_malloc. Never throws: torch calls it from
// a DataPtr deleter, where an exception would terminate the process; errors
// are printed to stderr instead.
MEMBUDGET_EXPORT void membudget_cuda_free(void* ptr, size_t size, int device, void* stream);
// tensor.record_stream(stream): the block is not reused until the work queued
// so far on `stream` is done. See Note [Stream-ordered reuse].
MEMBUDGET_EXPORT void membudget_cuda_record_stream(void* ptr, void* stream);
// torch.cuda.empty_cache(): returns the allocator's cached free segments to
// the device.
MEMBUDGET_EXPORT void membudget_cuda_empty_cache();
}

namespace membudget {

// The CUDA backend for `device`, for Runtime::create. Throws
// std::runtime_error when the extension was built without the CUDA toolkit,
// so callers (runtime.cpp) need no #ifdef of their own.
std::unique_ptr<Backend> make_cuda_backend_or_throw(int device);

#ifdef MEMBUDGET_TORCH_CUDA
// cuda_pluggable_hooks.cpp: makes a torch CUDAPluggableAllocator over the
// symbols above, with record_stream and empty_cache hooks (which the Python
// CUDAPluggableAllocator cannot set), and makes it torch's CUDA allocator.
// Throws c10::Error when torch's CUDA allocator was already initialised.
void install_cuda_pluggable_with_hooks();
// torch's current CUDA stream on `device` (c10::cuda::getCurrentCUDAStream),
// as a cudaStream_t.
Stream current_cuda_stream(int device);
#endif

}  // namespace membudget
