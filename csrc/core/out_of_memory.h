// The typed out-of-memory error that ends the allocator's OOM ladder. The torch
// binding rethrows it as c10::OutOfMemoryError (torch.OutOfMemoryError).
#pragma once
#include <stdexcept>
#include <string>

namespace membudget {

class OutOfMemory : public std::runtime_error {
 public:
  OutOfMemory(const std::string& message, size_t requested_bytes)
      : std::runtime_error(message), requested_bytes_(requested_bytes) {}
  size_t requested_bytes() const { return requested_bytes_; }

 private:
  size_t requested_bytes_;
};

}  // namespace membudget
