// SimBackend: a modelled device for the simulator. Memory is virtual addresses
// only (nothing is ever dereferenced), time is a modelled clock. The real
// CachingAllocator and ResidencyManager run over it unchanged; see DESIGN.md
// "Traces and the simulator".
//
// Note [Modelled time]: the compute stream is the caller, as on HostBackend:
// run_compute(s) advances the clock by an op's modelled duration. Each copy
// stream (D2H, H2D) is a FIFO served by the link (sim_link.h): on a GPU's
// link a copy starts at max(now, when the stream's previous copy ends), runs
// at the link bandwidth, and its event is ready once the clock reaches its
// end; Note [Modelled link] gives the host's shared, contended link. Waiting
// for an event that is not ready (a synchronous swap, an unpack whose
// swap-in is still in flight) moves the clock to the copy's end and counts
// the difference as stall.
//
// Note [Side stream contention]: a replay ahead of use (Note [Recompute
// ahead]) runs on a side compute stream, concurrently with backward. A GPU
// running backward kernels is mostly busy, so concurrency does not make the
// replay free: of its `s` seconds (its duration on an idle device) only the
// fraction `overlap` fills resources backward leaves idle (launch gaps,
// memory-bound phases, tails of kernels); the rest, (1 - overlap) x s, delays
// the compute stream as the two streams' kernels share the SMs. The replay is
// done s seconds after it starts (the side stream is a queue: it starts once
// the previous side-stream replay is done). overlap = 0 is the pessimistic
// bound (no better than replaying at the unpack), 1 the optimistic one (a
// free side stream). No value is measured here (no GPU): the simulator takes
// it as a parameter and the bench reports a range.
#pragma once
#include <cstdint>
#include <memory>

#include "backend.h"
#include "copy_timeline.h"
#include "sim_link.h"

namespace membudget {

// The physical allocation granularity of current NVIDIA GPUs
// (cuMemGetAllocationGranularity), for expandable segments.
constexpr size_t kGpuPageBytes = size_t{2} << 20;

class SimBackend final : public Backend {
 public:
  // `capacity_bytes`: device memory size (device_alloc refuses beyond it).
  // `link_bytes_per_s`: one direction of the host link.
  SimBackend(size_t capacity_bytes, double link_bytes_per_s);
  // `link`: Note [Modelled link]. `page_bytes`: the granularity of
  // expandable segments (0: a GPU's, kGpuPageBytes; the host backend's is the
  // OS page).
  SimBackend(size_t capacity_bytes, const LinkModel& link, size_t page_bytes = 0);
  ~SimBackend() override;

  std::string name() const override { return "sim"; }
  size_t device_capacity() const override { return capacity_bytes_; }
  void* device_alloc(size_t bytes) override;
  void device_free(void* ptr, size_t bytes) override;
  void* host_alloc(size_t bytes) override;
  void host_free(void* ptr, size_t bytes) override;
  EventPtr record(Stream stream) override;
  void stream_wait(Stream stream, const EventPtr& event) override;
  EventPtr copy_to_host(void* host_dst, const void* device_src, size_t bytes, Stream after) override;
  EventPtr copy_to_device(void* device_dst, const void* host_src, size_t bytes, Stream after) override;
  size_t pending_copies(CopyDirection direction) const override;
  // Note [Expandable segments] at the modelled device's page granularity:
  // reservations are fresh address ranges, mapped pages count against the
  // capacity.
  size_t page_bytes() const override;
  void* reserve_address_range(size_t bytes) override;
  void release_address_range(void*, size_t) override {}
  bool map_pages(void* ptr, size_t bytes) override;
  void unmap_pages(void* ptr, size_t bytes) override;
  bool move_pages(void*, void*, size_t) override { return true; }

  // Modelled time, so that the manager's timings (copies, stalls, intervals)
  // are the simulated ones; offset so it is never the zero time_point.
  std::chrono::steady_clock::time_point clock_now() const override;
  // The compute stream runs for `seconds` (an op's modelled duration).
  void run_compute(double seconds);
  // Queues `seconds` of replay on the side compute stream and returns its
  // completion; the compute stream loses (1 - overlap) x seconds to it (Note
  // [Side stream contention]).
  EventPtr run_side_compute(double seconds, double overlap);
  double now() const { return clock_->now; }
  double stall_seconds() const { return clock_->stall_seconds; }
  // Seconds one copy of `bytes` occupies a copy stream.
  double copy_seconds(size_t bytes) const;
  size_t device_bytes_in_use() const { return device_in_use_; }
  // Note [Copy timeline] on modelled time.
  CopyTimeline& copy_timeline() { return clock_->timeline; }
  // Bytes copied so far, per direction.
  size_t copied_bytes(CopyDirection direction) const;

 private:
  EventPtr enqueue_copy(CopyDirection direction, size_t bytes);

  const size_t capacity_bytes_;
  const size_t page_bytes_;
  std::shared_ptr<SimClock> clock_;
  std::shared_ptr<SimLink> link_;
  uintptr_t next_device_address_;
  uintptr_t next_host_address_;
  size_t device_in_use_ = 0;
  size_t copied_bytes_[2] = {0, 0};  // indexed by CopyDirection
  double side_stream_free_at_ = 0.0;  // Note [Side stream contention]
};

}  // namespace membudget
