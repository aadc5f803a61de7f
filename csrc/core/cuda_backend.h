// CudaBackend: the Backend of one CUDA device. cudaMalloc for device memory,
// pinned host memory for the swap tier, two dedicated copy streams and pooled
// completion events. See DESIGN.md "The core", step 1.
//
// This header has no CUDA includes, so torch-side files can name the class
// whether or not the toolkit was found; cuda_backend.cpp is compiled only with
// MEMBUDGET_WITH_CUDA (CMake's MEMBUDGET_CUDA_SOURCES).
//
// Note [CUDA device per call]: every entry point that creates or uses CUDA
// objects first makes the backend's device current on the calling thread and
// restores the previous device on return. Allocations arrive from autograd's
// per-device worker threads and from user threads whose current device may be
// another one; restoring keeps torch's idea of the current device intact.
//
// Note [Copy ordering]: a copy is queued on its copy stream behind an event
// recorded on `after`, so it reads (D2H) or overwrites (H2D) device memory only
// once the compute work queued before the call is done, while later compute
// work runs concurrently with it. The returned event marks its completion.
#pragma once
#include <cstddef>
#include <memory>
#include <string>

#include "backend.h"

namespace membudget {

class CudaBackend final : public Backend {
 public:
  // Creates the copy streams on `device`. Throws std::runtime_error naming the
  // failing CUDA call when the device does not exist or has no usable driver.
  explicit CudaBackend(int device);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  // The CUDA device index this backend allocates on.
  int device() const;

  std::string name() const override;
  // Total memory of the device (cudaMemGetInfo), queried once.
  size_t device_capacity() const override;
  // cudaMalloc; nullptr when the device is out of memory (the error is cleared
  // so that torch's next launch check does not see it).
  void* device_alloc(size_t bytes) override;
  void device_free(void* ptr, size_t bytes) override;
  // Pinned memory (cudaHostAlloc); called once per host-tier chunk, the
  // pooling is done by the host CachingAllocator above.
  void* host_alloc(size_t bytes) override;
  void host_free(void* ptr, size_t bytes) override;
  EventPtr record(Stream stream) override;
  // cudaStreamWaitEvent for CUDA events; any other event is waited for on the
  // calling host thread.
  void stream_wait(Stream stream, const EventPtr& event) override;
  EventPtr copy_to_host(void* host_dst, const void* device_src, size_t bytes,
                        Stream after) override;
  EventPtr copy_to_device(void* device_dst, const void* host_src, size_t bytes,
                          Stream after) override;
  size_t pending_copies(CopyDirection direction) const override;
  // Note [Expandable segments] over the driver's virtual memory API
  // (cuda_virtual_memory.h); page_bytes() is 0 where the device lacks it.
  size_t page_bytes() const override;
  void* reserve_address_range(size_t bytes) override;
  void release_address_range(void* base, size_t bytes) override;
  bool map_pages(void* ptr, size_t bytes) override;
  void unmap_pages(void* ptr, size_t bytes) override;
  bool move_pages(void* from, void* to, size_t bytes) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A CudaBackend for `device`, as a Backend. Throws like the constructor.
std::unique_ptr<Backend> make_cuda_backend(int device);

// Number of CUDA devices; 0 (never an exception) when there is no driver or
// no device. (Without the toolkit this is not defined; the binding reports 0.)
int cuda_device_count();

// The CUDA runtime's current device of this thread (0 unless something set
// it), setting it, and a device's total memory, through the runtime alone: asking
// torch.cuda instead initialises it, after which its allocator can no longer
// be replaced. Both throw std::runtime_error naming the failed call.
int cuda_current_device();
void cuda_set_current_device(int device);
size_t cuda_total_memory(int device);

}  // namespace membudget
