// CudaBackend over the CUDA runtime API (linked statically, see CMakeLists.txt).
// See cuda_backend.h for Note [CUDA device per call] and Note [Copy ordering].
//
// Note [Runtime handles across cudart copies]: torch links its own libcudart,
// this library links cudart_static. Both use the driver's primary context, so
// device pointers, streams (cudaStream_t is a CUstream) and events pass freely
// between them; the legacy default stream (nullptr) is the same stream in both.
#include "core/cuda_backend.h"
#include "core/cuda_virtual_memory.h"

#include <cuda_runtime_api.h>

#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace membudget {
namespace {

// Idle events kept for reuse. A training step records a few events per swapped
// tensor; beyond this many idle ones, returned events are destroyed instead.
constexpr size_t kMaxPooledEvents = 256;

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* call, int device) {
  throw std::runtime_error(std::string("membudget: ") + call + " failed on cuda:" +
                           std::to_string(device) + ": " + cudaGetErrorString(err) +
                           " (" + cudaGetErrorName(err) + ")");
}

void check(cudaError_t err, const char* call, int device) {
  if (err != cudaSuccess) throw_cuda_error(err, call, device);
}

// Makes `device` current for the scope; see Note [CUDA device per call].
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice", device);
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice", device);
    else previous_ = -1;
  }
  ~DeviceScope() {
    // Best effort: a destructor must not throw, and a failure here would have
    // shown up in the calls made under the scope.
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = -1;
};

// Reusable cudaEvent_t objects of one device, created with timing disabled
// (cheaper to record and query). Shared by the backend and every live event,
// so an event outliving the backend still has somewhere to go back to.
class EventPool {
 public:
  explicit EventPool(int device) : device_(device) {}
  ~EventPool() {
    for (cudaEvent_t event : idle_) (void)cudaEventDestroy(event);
  }

  // An idle event; the caller has the pool's device current.
  cudaEvent_t acquire() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!idle_.empty()) {
        cudaEvent_t event = idle_.back();
        idle_.pop_back();
        return event;
      }
    }
    cudaEvent_t event = nullptr;
    check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
          "cudaEventCreateWithFlags", device_);
    return event;
  }

  // Returns an event. Safe right after cudaStreamWaitEvent: a wait captures the
  // event's state when it is issued, re-recording the event later does not
  // change what the waiting stream waits for.
  void release(cudaEvent_t event) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (idle_.size() < kMaxPooledEvents) {
        idle_.push_back(event);
        return;
      }
    }
    (void)cudaEventDestroy(event);
  }

  int device() const { return device_; }

 private:
  int device_;
  std::mutex mutex_;
  std::vector<cudaEvent_t> idle_;
};

// A recorded CUDA event handed out as an Event; returns to its pool when the
// last owner drops it.
class CudaEvent final : public Event {
 public:
  CudaEvent(std::shared_ptr<EventPool> pool, cudaEvent_t event)
      : pool_(std::move(pool)), event_(event) {}
  ~CudaEvent() override { pool_->release(event_); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  bool ready() override {
    cudaError_t err = cudaEventQuery(event_);
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) {
      // Not an error, but it is left as the thread's last error; clear it so
      // torch's next kernel-launch check does not report it (torch's own
      // CUDAEvent::query does the same).
      (void)cudaGetLastError();
      return false;
    }
    throw_cuda_error(err, "cudaEventQuery", pool_->device());
  }

  void wait() override {
    check(cudaEventSynchronize(event_), "cudaEventSynchronize", pool_->device());
  }

  cudaEvent_t handle() const { return event_; }

 private:
  std::shared_ptr<EventPool> pool_;
  cudaEvent_t event_;
};

// Completion events of the copies queued on one copy stream, oldest first.
// Work on a stream completes in order, so reaping stops at the first event
// that is not ready and the rest are pending.
class CopyQueue {
 public:
  void push(std::shared_ptr<CudaEvent> event) {
    std::lock_guard<std::mutex> lock(mutex_);
    reap_locked();
    events_.push_back(std::move(event));
  }
  size_t pending() {
    std::lock_guard<std::mutex> lock(mutex_);
    reap_locked();
    return events_.size();
  }

 private:
  void reap_locked() {
    while (!events_.empty() && events_.front()->ready()) events_.pop_front();
  }
  std::mutex mutex_;
  std::deque<std::shared_ptr<CudaEvent>> events_;
};

}  // namespace

struct CudaBackend::Impl {
  int device = 0;
  std::shared_ptr<EventPool> events;
  cudaStream_t d2h_stream = nullptr;
  cudaStream_t h2d_stream = nullptr;
  mutable CopyQueue d2h_queue;
  mutable CopyQueue h2d_queue;
  mutable std::once_flag capacity_once;
  mutable size_t capacity_bytes = 0;
  std::unique_ptr<CudaVirtualMemory> virtual_memory;

  // Records a pooled event on `stream`; the caller has the device current.
  std::shared_ptr<CudaEvent> record_on(cudaStream_t stream) {
    cudaEvent_t event = events->acquire();
    cudaError_t err = cudaEventRecord(event, stream);
    if (err != cudaSuccess) {
      events->release(event);
      throw_cuda_error(err, "cudaEventRecord", device);
    }
    return std::make_shared<CudaEvent>(events, event);
  }

  // See Note [Copy ordering].
  EventPtr copy(void* dst, const void* src, size_t bytes, Stream after,
                cudaMemcpyKind kind) {
    cudaStream_t copy_stream = kind == cudaMemcpyDeviceToHost ? d2h_stream : h2d_stream;
    CopyQueue& queue = kind == cudaMemcpyDeviceToHost ? d2h_queue : h2d_queue;
    if (bytes == 0) return std::make_shared<CompletedEvent>();
    DeviceScope scope(device);
    {
      std::shared_ptr<CudaEvent> after_done = record_on(static_cast<cudaStream_t>(after));
      check(cudaStreamWaitEvent(copy_stream, after_done->handle(), 0),
            "cudaStreamWaitEvent", device);
    }  // after_done returns to the pool; see EventPool::release.
    check(cudaMemcpyAsync(dst, src, bytes, kind, copy_stream), "cudaMemcpyAsync", device);
    std::shared_ptr<CudaEvent> done = record_on(copy_stream);
    queue.push(done);
    return done;
  }
};

CudaBackend::CudaBackend(int device) : impl_(std::make_unique<Impl>()) {
  int count = cuda_device_count();
  if (device < 0 || device >= count) {
    throw std::runtime_error("membudget: no CUDA device cuda:" + std::to_string(device) +
                             " (this process sees " + std::to_string(count) +
                             " CUDA devices)");
  }
  impl_->device = device;
  impl_->events = std::make_shared<EventPool>(device);
  DeviceScope scope(device);
  impl_->virtual_memory = std::make_unique<CudaVirtualMemory>(device);
  // Copies get the highest priority so that a swap-in the next op waits for is
  // not queued behind a long run of compute kernels on the SMs' scheduler.
  int least_priority = 0;
  int greatest_priority = 0;
  check(cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority),
        "cudaDeviceGetStreamPriorityRange", device);
  // Non-blocking: the copy streams must not synchronize with the legacy default
  // stream, which is torch's default compute stream.
  check(cudaStreamCreateWithPriority(&impl_->d2h_stream, cudaStreamNonBlocking,
                                     greatest_priority),
        "cudaStreamCreateWithPriority", device);
  cudaError_t err = cudaStreamCreateWithPriority(&impl_->h2d_stream, cudaStreamNonBlocking,
                                                 greatest_priority);
  if (err != cudaSuccess) {
    (void)cudaStreamDestroy(impl_->d2h_stream);
    throw_cuda_error(err, "cudaStreamCreateWithPriority", device);
  }
}

CudaBackend::~CudaBackend() {
  // Best effort and silent: at process exit the CUDA runtime may already be
  // unloading (cudaErrorCudartUnloading), which is harmless here.
  int previous = -1;
  if (cudaGetDevice(&previous) == cudaSuccess && previous != impl_->device) {
    (void)cudaSetDevice(impl_->device);
  }
  (void)cudaStreamSynchronize(impl_->d2h_stream);
  (void)cudaStreamSynchronize(impl_->h2d_stream);
  (void)cudaStreamDestroy(impl_->d2h_stream);
  (void)cudaStreamDestroy(impl_->h2d_stream);
  if (previous >= 0 && previous != impl_->device) (void)cudaSetDevice(previous);
  (void)cudaGetLastError();
}

int CudaBackend::device() const { return impl_->device; }

std::string CudaBackend::name() const { return "cuda:" + std::to_string(impl_->device); }

size_t CudaBackend::device_capacity() const {
  std::call_once(impl_->capacity_once, [this] {
    DeviceScope scope(impl_->device);
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo", impl_->device);
    impl_->capacity_bytes = total_bytes;
  });
  return impl_->capacity_bytes;
}

void* CudaBackend::device_alloc(size_t bytes) {
  if (bytes == 0) return nullptr;
  DeviceScope scope(impl_->device);
  void* ptr = nullptr;
  cudaError_t err = cudaMalloc(&ptr, bytes);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // the refusal is an answer, not a sticky error
    return nullptr;
  }
  check(err, "cudaMalloc", impl_->device);
  return ptr;
}

void CudaBackend::device_free(void* ptr, size_t /*bytes*/) {
  if (ptr == nullptr) return;
  DeviceScope scope(impl_->device);
  check(cudaFree(ptr), "cudaFree", impl_->device);
}

void* CudaBackend::host_alloc(size_t bytes) {
  if (bytes == 0) return nullptr;
  DeviceScope scope(impl_->device);
  void* ptr = nullptr;
  // Portable: the chunk counts as pinned for every device's copies.
  cudaError_t err = cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return nullptr;
  }
  check(err, "cudaHostAlloc", impl_->device);
  return ptr;
}

void CudaBackend::host_free(void* ptr, size_t /*bytes*/) {
  if (ptr == nullptr) return;
  DeviceScope scope(impl_->device);
  check(cudaFreeHost(ptr), "cudaFreeHost", impl_->device);
}

EventPtr CudaBackend::record(Stream stream) {
  DeviceScope scope(impl_->device);
  return impl_->record_on(static_cast<cudaStream_t>(stream));
}

void CudaBackend::stream_wait(Stream stream, const EventPtr& event) {
  if (!event) return;
  if (auto* cuda_event = dynamic_cast<CudaEvent*>(event.get())) {
    DeviceScope scope(impl_->device);
    check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), cuda_event->handle(), 0),
          "cudaStreamWaitEvent", impl_->device);
    return;
  }
  // A host-side event (CompletedEvent, or one from another backend): the
  // stream cannot wait for it on the device, so the host waits before queuing
  // more work on the stream.
  event->wait();
}

EventPtr CudaBackend::copy_to_host(void* host_dst, const void* device_src, size_t bytes,
                                   Stream after) {
  return impl_->copy(host_dst, device_src, bytes, after, cudaMemcpyDeviceToHost);
}

EventPtr CudaBackend::copy_to_device(void* device_dst, const void* host_src, size_t bytes,
                                     Stream after) {
  return impl_->copy(device_dst, host_src, bytes, after, cudaMemcpyHostToDevice);
}

size_t CudaBackend::pending_copies(CopyDirection direction) const {
  return direction == CopyDirection::device_to_host ? impl_->d2h_queue.pending()
                                                    : impl_->h2d_queue.pending();
}

size_t CudaBackend::page_bytes() const { return impl_->virtual_memory->page_bytes(); }

void* CudaBackend::reserve_address_range(size_t bytes) {
  DeviceScope scope(impl_->device);
  return impl_->virtual_memory->reserve(bytes);
}

void CudaBackend::release_address_range(void* base, size_t bytes) {
  DeviceScope scope(impl_->device);
  impl_->virtual_memory->release(base, bytes);
}

bool CudaBackend::map_pages(void* ptr, size_t bytes) {
  DeviceScope scope(impl_->device);
  return impl_->virtual_memory->map(ptr, bytes);
}

void CudaBackend::unmap_pages(void* ptr, size_t bytes) {
  DeviceScope scope(impl_->device);
  impl_->virtual_memory->unmap(ptr, bytes);
}

bool CudaBackend::move_pages(void* from, void* to, size_t bytes) {
  DeviceScope scope(impl_->device);
  return impl_->virtual_memory->move(from, to, bytes);
}

std::unique_ptr<Backend> make_cuda_backend(int device) {
  return std::make_unique<CudaBackend>(device);
}

int cuda_device_count() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    // No driver (cudaErrorInsufficientDriver) or no device (cudaErrorNoDevice):
    // report none, and leave no error behind for the next CUDA call.
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

int cuda_current_device() {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice", -1);
  return device;
}

void cuda_set_current_device(int device) { check(cudaSetDevice(device), "cudaSetDevice", device); }

size_t cuda_total_memory(int device) {
  cudaDeviceProp properties{};
  check(cudaGetDeviceProperties(&properties, device), "cudaGetDeviceProperties", device);
  return properties.totalGlobalMem;
}

}  // namespace membudget
