// HostBackend: the simulated device. "Device" memory is ordinary CPU memory
// (so on a CPU-only machine it is what torch's CPU tensors live in), the
// compute stream is the calling thread, and each copy stream is one worker
// thread running memcpy, with completion events. Every mechanism of the
// allocator and manager runs on it, so all of them are tested without a GPU.
#pragma once
#include <memory>

#include "backend.h"

namespace membudget {

class HostBackend final : public Backend {
 public:
  // `capacity_bytes` plays the role of device memory size; device_alloc
  // refuses beyond it. 0 means the machine's physical memory.
  explicit HostBackend(size_t capacity_bytes = 0);
  ~HostBackend() override;

  std::string name() const override { return "host"; }
  size_t device_capacity() const override;
  void* device_alloc(size_t bytes) override;
  void device_free(void* ptr, size_t bytes) override;
  void* host_alloc(size_t bytes) override;
  void host_free(void* ptr, size_t bytes) override;
  EventPtr record(Stream stream) override;
  void stream_wait(Stream stream, const EventPtr& event) override;
  EventPtr copy_to_host(void* host_dst, const void* device_src, size_t bytes,
                        Stream after) override;
  EventPtr copy_to_device(void* device_dst, const void* host_src, size_t bytes,
                          Stream after) override;
  size_t pending_copies(CopyDirection direction) const override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Physical memory of this machine in bytes.
size_t physical_memory_bytes();

}  // namespace membudget
