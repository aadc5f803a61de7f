// See cuda_virtual_memory.h. The caller (CudaBackend) has the device current
// (Note [CUDA device per call]).
#include "core/cuda_virtual_memory.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace membudget {

namespace {

// The driver ABI version the entry points are requested at: the VMM calls
// have had these signatures since CUDA 10.2.
constexpr unsigned int kDriverApiVersion = 12000;

template <typename Fn>
Fn driver_entry_point(const char* symbol) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(symbol, &fn, kDriverApiVersion, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

[[noreturn]] void throw_driver_error(CUresult result, const char* call, int device) {
  throw std::runtime_error(std::string("membudget: ") + call + " failed on cuda:" + std::to_string(device) +
                           " (CUresult " + std::to_string(static_cast<int>(result)) + ")");
}

}  // namespace

struct CudaVirtualMemory::Impl {
  int device = 0;
  size_t page = 0;
  CUmemAllocationProp prop{};
  CUmemAccessDesc access{};
  decltype(&cuMemAddressReserve) address_reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;

  std::mutex mutex;  // guards handles
  std::unordered_map<uintptr_t, CUmemGenericAllocationHandle> handles;  // by page address

  void check(CUresult result, const char* call) const {
    if (result != CUDA_SUCCESS) throw_driver_error(result, call, device);
  }

  // Unmaps and frees the page at `address`, if mapped. Caller holds mutex.
  void drop_page(uintptr_t address) {
    auto handle = handles.find(address);
    if (handle == handles.end()) return;
    check(unmap(static_cast<CUdeviceptr>(address), page), "cuMemUnmap");
    check(release(handle->second), "cuMemRelease");
    handles.erase(handle);
  }
};

CudaVirtualMemory::CudaVirtualMemory(int device) : impl_(std::make_unique<Impl>()) {
  Impl& self = *impl_;
  self.device = device;
  auto device_get = driver_entry_point<decltype(&cuDeviceGet)>("cuDeviceGet");
  auto get_attribute = driver_entry_point<decltype(&cuDeviceGetAttribute)>("cuDeviceGetAttribute");
  CUdevice handle = 0;
  int supported = 0;
  if (!device_get || !get_attribute || device_get(&handle, device) != CUDA_SUCCESS ||
      get_attribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, handle) != CUDA_SUCCESS ||
      supported == 0) {
    return;
  }
  self.address_reserve = driver_entry_point<decltype(&cuMemAddressReserve)>("cuMemAddressReserve");
  self.address_free = driver_entry_point<decltype(&cuMemAddressFree)>("cuMemAddressFree");
  self.create = driver_entry_point<decltype(&cuMemCreate)>("cuMemCreate");
  self.release = driver_entry_point<decltype(&cuMemRelease)>("cuMemRelease");
  self.map = driver_entry_point<decltype(&cuMemMap)>("cuMemMap");
  self.unmap = driver_entry_point<decltype(&cuMemUnmap)>("cuMemUnmap");
  self.set_access = driver_entry_point<decltype(&cuMemSetAccess)>("cuMemSetAccess");
  self.granularity = driver_entry_point<decltype(&cuMemGetAllocationGranularity)>("cuMemGetAllocationGranularity");
  if (!self.address_reserve || !self.address_free || !self.create || !self.release || !self.map || !self.unmap ||
      !self.set_access || !self.granularity) {
    return;
  }
  self.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  self.prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  self.prop.location.id = device;
  self.access.location = self.prop.location;
  self.access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  size_t page = 0;
  if (self.granularity(&page, &self.prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) != CUDA_SUCCESS) return;
  self.page = page;
}

CudaVirtualMemory::~CudaVirtualMemory() {
  // The allocator unmaps every page before releasing its ranges; anything left
  // is freed best effort (the driver may already be shutting down).
  for (auto& entry : impl_->handles) {
    (void)impl_->unmap(static_cast<CUdeviceptr>(entry.first), impl_->page);
    (void)impl_->release(entry.second);
  }
}

size_t CudaVirtualMemory::page_bytes() const { return impl_->page; }

void* CudaVirtualMemory::reserve(size_t bytes) {
  if (impl_->page == 0) return nullptr;
  CUdeviceptr base = 0;
  if (impl_->address_reserve(&base, bytes, impl_->page, 0, 0) != CUDA_SUCCESS) return nullptr;
  return reinterpret_cast<void*>(base);
}

void CudaVirtualMemory::release(void* base, size_t bytes) {
  if (base == nullptr) return;
  const auto first = reinterpret_cast<uintptr_t>(base);
  (void)cudaDeviceSynchronize();  // as in unmap(); at teardown, best effort
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    for (uintptr_t page = first; page < first + bytes; page += impl_->page) impl_->drop_page(page);
  }
  impl_->check(impl_->address_free(static_cast<CUdeviceptr>(first), bytes), "cuMemAddressFree");
}

bool CudaVirtualMemory::map(void* ptr, size_t bytes) {
  Impl& self = *impl_;
  if (self.page == 0) return false;
  const auto first = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(self.mutex);
  for (uintptr_t page = first; page < first + bytes; page += self.page) {
    CUmemGenericAllocationHandle handle = 0;
    CUresult created = self.create(&handle, self.page, &self.prop, 0);
    if (created == CUDA_ERROR_OUT_OF_MEMORY) {
      for (uintptr_t done = first; done < page; done += self.page) self.drop_page(done);
      return false;
    }
    self.check(created, "cuMemCreate");
    CUresult mapped = self.map(static_cast<CUdeviceptr>(page), self.page, 0, handle, 0);
    if (mapped != CUDA_SUCCESS) {
      (void)self.release(handle);
      throw_driver_error(mapped, "cuMemMap", self.device);
    }
    self.handles.emplace(page, handle);
  }
  self.check(self.set_access(static_cast<CUdeviceptr>(first), bytes, &self.access, 1), "cuMemSetAccess");
  return true;
}

bool CudaVirtualMemory::move(void* from, void* to, size_t bytes) {
  Impl& self = *impl_;
  if (self.page == 0) return false;
  if (cudaDeviceSynchronize() != cudaSuccess) {  // see unmap()
    (void)cudaGetLastError();
    return false;
  }
  const auto source = reinterpret_cast<uintptr_t>(from);
  const auto target = reinterpret_cast<uintptr_t>(to);
  std::lock_guard<std::mutex> lock(self.mutex);
  for (size_t offset = 0; offset < bytes; offset += self.page) {
    auto handle = self.handles.find(source + offset);
    if (handle == self.handles.end()) throw std::logic_error("membudget: moving a page that is not mapped");
    const CUmemGenericAllocationHandle physical = handle->second;
    self.check(self.unmap(static_cast<CUdeviceptr>(source + offset), self.page), "cuMemUnmap");
    self.handles.erase(handle);
    self.check(self.map(static_cast<CUdeviceptr>(target + offset), self.page, 0, physical, 0), "cuMemMap");
    self.handles.emplace(target + offset, physical);
  }
  self.check(self.set_access(static_cast<CUdeviceptr>(target), bytes, &self.access, 1), "cuMemSetAccess");
  return true;
}

void CudaVirtualMemory::unmap(void* ptr, size_t bytes) {
  const auto first = reinterpret_cast<uintptr_t>(ptr);
  // A free block's last kernels may still be running: the allocator hands
  // blocks back in stream order, not after completion. cudaFree waits for the
  // device implicitly, cuMemUnmap does not (PyTorch synchronizes before
  // unmapping too), so wait here; this runs only on rung 3, near the budget.
  if (cudaDeviceSynchronize() != cudaSuccess) {
    throw std::runtime_error("membudget: cudaDeviceSynchronize before unmapping pages failed on cuda:" +
                             std::to_string(impl_->device) + ": " + cudaGetErrorString(cudaGetLastError()));
  }
  std::lock_guard<std::mutex> lock(impl_->mutex);
  for (uintptr_t page = first; page < first + bytes; page += impl_->page) impl_->drop_page(page);
}

}  // namespace membudget
