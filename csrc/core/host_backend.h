// HostBackend: the simulated device. "Device" memory is ordinary CPU memory
// (so on a CPU-only machine it is what torch's CPU tensors live in), the
// compute stream is the calling thread, and each copy stream is one worker
// thread running memcpy, with completion events. Every mechanism of the
// allocator and manager runs on it, so all of them are tested without a GPU.
//
// Note [Virtual streams]: the compute stream is nullptr (the calling thread,
// whose work is always done by the time it asks). Any other Stream value is a
// "virtual stream" that exists only for tests of stream-ordered reuse: it has
// no work of its own, so record() on it returns a completed event, unless a
// test has called hold_stream(s), in which case events recorded on s stay
// pending until release_stream(s). This is how a test stands in for a kernel
// still running on a side stream.
#pragma once
#include <memory>

#include "backend.h"
#include "copy_timeline.h"

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
  EventPtr copy_to_host_for_waiter(void* host_dst, const void* device_src, size_t bytes, Stream after) override;
  EventPtr copy_to_device_for_waiter(void* device_dst, const void* host_src, size_t bytes, Stream after) override;
  size_t pending_copies(CopyDirection direction) const override;
  // Note [Expandable segments] over mmap: PROT_NONE reservations whose pages
  // are replaced by anonymous read-write memory when mapped, and by a fresh
  // PROT_NONE mapping (which returns the memory to the OS) when unmapped.
  // Mapped pages count against the capacity like device_alloc.
  //
  // Note [Host pages]: the allocator's expandable segments use pages of
  // about budget / kSegmentPagesPerBudget (a power of two from the kernel's
  // 4 KiB up to 2 MiB, CUDA's granularity), not the kernel's page. A page
  // moved by mremap (Note [Page recycling]) stays one kernel mapping that
  // never merges with its neighbours (its anonymous-memory links and page
  // offset come from where it was), so with 4 KiB pages the mappings only
  // multiplied as moves shuffled the pages: at the CNN at 70% of its peak
  // (37 MiB budget, 50 MiB of pages moved per step) 492 mappings grew to
  // 4480 in 110 steps while the step went from 130 to 180 ms in growing
  // kernel time (mremap, anon_vma trees, TLB shootdowns), and a longer or
  // larger run would reach vm.max_map_count (65530), where mmap fails. With
  // 64 KiB pages there the count stays near 766 and the step between 128
  // and 140 ms over 120 steps, no trend (bench/RESULTS.md, "Host pages"; fixed
  // segments, which move nothing, 126-131 ms). The cost is up to a page
  // of straddle at a block's ends, as on a GPU; a 512th of the budget keeps
  // that small where budgets are a few MiB (the demo's). Without a budget
  // rung 3 does not run (short of the machine's memory): the kernel's page.
  // The allocator chooses the page when it reserves its first expandable
  // segment, and again when set_budget changes it (a process that installs
  // again with another budget, as the tests do): the old segments are
  // released, or retired where blocks still live in them.
  size_t page_bytes() const override;
  // The page for a budget (Note [Host pages]): a power of two from the
  // kernel's page up to kMaxSegmentPageBytes, about budget /
  // kSegmentPagesPerBudget; the kernel's page without a budget below the
  // device's memory.
  size_t segment_page_bytes(size_t budget_bytes) const override;
  // The same for a budget on a device of `capacity_bytes` (0: this
  // machine's memory), for the simulator's model of this backend.
  static size_t segment_page_for(size_t budget_bytes, size_t capacity_bytes);
  static constexpr size_t kMaxSegmentPageBytes = size_t{2} << 20;
  static constexpr size_t kSegmentPagesPerBudget = 512;
  void* reserve_address_range(size_t bytes) override;
  void release_address_range(void* base, size_t bytes) override;
  bool map_pages(void* ptr, size_t bytes) override;
  void unmap_pages(void* ptr, size_t bytes) override;
  bool move_pages(void* from, void* to, size_t bytes) override;

  // Note [Copy timeline] on the wall clock (seconds since this backend was made).
  CopyTimeline& copy_timeline();

  // Note [Waiter runs the copy] on (the default) or off: off, every copy
  // goes through its stream's worker thread (bench/bench_copy_handoff.py
  // compares the two).
  void set_waiter_runs_copies(bool on);

  // Bytes currently handed out by device_alloc or mapped by map_pages.
  size_t device_bytes_in_use() const;

  // Test hook (Note [Virtual streams]): from now on, events recorded on the
  // virtual stream `stream` stay pending until release_stream(stream).
  // Holding nullptr (the calling thread) is refused with invalid_argument.
  void hold_stream(Stream stream);
  // Test hook: completes every event recorded on `stream` while it was held,
  // and makes later record(stream) calls complete at once again.
  void release_stream(Stream stream);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Physical memory of this machine in bytes.
size_t physical_memory_bytes();

}  // namespace membudget
