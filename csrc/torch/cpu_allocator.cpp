#include "torch/cpu_allocator.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include "torch/runtime.h"

namespace membudget {
namespace {

// SetCPUAllocator only replaces an allocator registered with a priority not
// above this one; putting the previous allocator back uses the same priority.
constexpr uint8_t kCpuAllocatorPriority = 1;

void delete_cpu_block(void* ptr) { free_device_for_torch(ptr); }

// Note [DataPtr context]: the context must be the data pointer itself
// ({ptr, ptr, deleter, device}); oneDNN convolution asserts
// get() == get_context(). The block size lives in the allocator's own map.
class BudgetedCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) override {
    void* ptr = allocate_device_for_torch(bytes, nullptr);
    return {ptr, ptr, &delete_cpu_block, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_cpu_block; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

// Leaked on purpose: blocks are freed (and the allocator may be asked for
// memory) until the very end of interpreter shutdown.
BudgetedCpuAllocator& g_allocator = *new BudgetedCpuAllocator();
c10::Allocator* g_previous = nullptr;

}  // namespace

void install_cpu_allocator() {
  if (c10::GetCPUAllocator() == &g_allocator) return;
  g_previous = c10::GetCPUAllocator();
  c10::SetCPUAllocator(&g_allocator, kCpuAllocatorPriority);
  TORCH_CHECK(c10::GetCPUAllocator() == &g_allocator,
              "membudget: could not install the CPU allocator (another allocator with a higher "
              "priority is registered)");
}

void uninstall_cpu_allocator() {
  if (c10::GetCPUAllocator() != &g_allocator || g_previous == nullptr) return;
  c10::SetCPUAllocator(g_previous, kCpuAllocatorPriority);
}

bool cpu_allocator_installed() { return c10::GetCPUAllocator() == &g_allocator; }

}  // namespace membudget
