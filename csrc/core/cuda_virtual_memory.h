// CudaVirtualMemory: the CUDA side of Note [Expandable segments] (backend.h),
// over the driver's virtual memory management API (cuMemAddressReserve,
// cuMemCreate, cuMemMap). Compiled only with MEMBUDGET_WITH_CUDA.
//
// The driver API is reached through cudaGetDriverEntryPointByVersion, so the
// extension still links only cudart_static and loads where no driver exists.
// Each page (the device's allocation granularity, 2 MiB on current GPUs) is a
// physical allocation of its own, because cuMemUnmap must cover whole
// mappings: freeing a fragment then unmaps exactly its pages.
#pragma once
#include <cstddef>
#include <memory>

namespace membudget {

class CudaVirtualMemory {
 public:
  // Loads the driver entry points for `device`. page_bytes() is 0 when the
  // driver or device lacks virtual memory management; then every other call
  // refuses.
  explicit CudaVirtualMemory(int device);
  ~CudaVirtualMemory();
  CudaVirtualMemory(const CudaVirtualMemory&) = delete;
  CudaVirtualMemory& operator=(const CudaVirtualMemory&) = delete;

  size_t page_bytes() const;
  void* reserve(size_t bytes);
  void release(void* base, size_t bytes);
  // False when the device is out of memory; then nothing stays mapped.
  bool map(void* ptr, size_t bytes);
  void unmap(void* ptr, size_t bytes);
  // Remaps the physical pages behind [from, from + bytes) at `to` (no
  // cuMemCreate or cuMemRelease); waits for the device first, as unmap().
  bool move(void* from, void* to, size_t bytes);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace membudget
