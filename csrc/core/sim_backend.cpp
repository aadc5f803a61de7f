#include "sim_backend.h"

#include <algorithm>

namespace membudget {

namespace {

// Virtual address ranges: device and host never overlap, and both are far
// from anything a real allocation could return. Addresses advance by whole
// pages and are never reused, so a stale pointer can never alias a live one.
constexpr uintptr_t kDeviceBase = uintptr_t{1} << 44;
constexpr uintptr_t kHostBase = uintptr_t{1} << 46;
constexpr size_t kPageBytes = 4096;

size_t round_to_page(size_t bytes) { return (bytes + kPageBytes - 1) / kPageBytes * kPageBytes; }

// The compute stream's work so far: done by now (it is the caller).
class SimDoneEvent final : public Event {
 public:
  bool ready() override { return true; }
  void wait() override {}
};

// A copy's completion (Note [Modelled time]): ready once the link has moved
// its last byte by the clock's now; waiting runs the link until then.
class SimCopyEvent final : public Event {
 public:
  SimCopyEvent(std::shared_ptr<SimClock> clock, std::shared_ptr<SimLink> link, std::shared_ptr<SimCopy> copy)
      : clock_(std::move(clock)), link_(std::move(link)), copy_(std::move(copy)) {}
  bool ready() override { return copy_->done_at <= clock_->now; }
  void wait() override { link_->wait_for(*copy_); }

 private:
  std::shared_ptr<SimClock> clock_;
  std::shared_ptr<SimLink> link_;
  std::shared_ptr<SimCopy> copy_;
};

// The end of a replay on the side stream (Note [Side stream contention]):
// waiting for it idles the compute stream (stall) while copies go on.
class SimSideEvent final : public Event {
 public:
  SimSideEvent(std::shared_ptr<SimClock> clock, std::shared_ptr<SimLink> link, double done_at)
      : clock_(std::move(clock)), link_(std::move(link)), done_at_(done_at) {}
  bool ready() override { return done_at_ <= clock_->now; }
  void wait() override { link_->wait_until(done_at_); }

 private:
  std::shared_ptr<SimClock> clock_;
  std::shared_ptr<SimLink> link_;
  double done_at_;
};

}  // namespace

SimBackend::SimBackend(size_t capacity_bytes, double link_bytes_per_s)
    : SimBackend(capacity_bytes, LinkModel{link_bytes_per_s, 1.0, 1.0, 0.0}) {}

SimBackend::SimBackend(size_t capacity_bytes, const LinkModel& link, size_t page_bytes)
    : capacity_bytes_(capacity_bytes), page_bytes_(page_bytes == 0 ? kGpuPageBytes : page_bytes),
      clock_(std::make_shared<SimClock>()),
      link_(std::make_shared<SimLink>(clock_, link)), next_device_address_(kDeviceBase),
      next_host_address_(kHostBase) {}

SimBackend::~SimBackend() = default;

void* SimBackend::device_alloc(size_t bytes) {
  if (device_in_use_ + bytes > capacity_bytes_) return nullptr;
  device_in_use_ += bytes;
  void* ptr = reinterpret_cast<void*>(next_device_address_);
  next_device_address_ += round_to_page(std::max<size_t>(bytes, 1));
  return ptr;
}

void SimBackend::device_free(void*, size_t bytes) { device_in_use_ -= std::min(bytes, device_in_use_); }

size_t SimBackend::page_bytes() const { return page_bytes_; }

void* SimBackend::reserve_address_range(size_t bytes) {
  next_device_address_ = (next_device_address_ + page_bytes_ - 1) / page_bytes_ * page_bytes_;
  void* base = reinterpret_cast<void*>(next_device_address_);
  next_device_address_ += bytes;
  return base;
}

bool SimBackend::map_pages(void*, size_t bytes) {
  if (device_in_use_ + bytes > capacity_bytes_) return false;
  device_in_use_ += bytes;
  return true;
}

void SimBackend::unmap_pages(void*, size_t bytes) { device_in_use_ -= std::min(bytes, device_in_use_); }

void* SimBackend::host_alloc(size_t bytes) {
  void* ptr = reinterpret_cast<void*>(next_host_address_);
  next_host_address_ += round_to_page(std::max<size_t>(bytes, 1));
  return ptr;
}

void SimBackend::host_free(void*, size_t) {}

EventPtr SimBackend::run_side_compute(double seconds, double overlap) {
  const double start = std::max(clock_->now, side_stream_free_at_);
  side_stream_free_at_ = start + seconds;
  run_compute((1.0 - std::clamp(overlap, 0.0, 1.0)) * seconds);
  return std::make_shared<SimSideEvent>(clock_, link_, side_stream_free_at_);
}

EventPtr SimBackend::record(Stream) { return std::make_shared<SimDoneEvent>(); }

void SimBackend::stream_wait(Stream, const EventPtr& event) { event->wait(); }

double SimBackend::copy_seconds(size_t bytes) const { return link_->copy_seconds(bytes); }

EventPtr SimBackend::enqueue_copy(CopyDirection direction, size_t bytes) {
  copied_bytes_[static_cast<int>(direction)] += bytes;
  return std::make_shared<SimCopyEvent>(clock_, link_, link_->enqueue(direction, bytes));
}

EventPtr SimBackend::copy_to_host(void*, const void*, size_t bytes, Stream) {
  return enqueue_copy(CopyDirection::device_to_host, bytes);
}

EventPtr SimBackend::copy_to_device(void*, const void*, size_t bytes, Stream) {
  return enqueue_copy(CopyDirection::host_to_device, bytes);
}

size_t SimBackend::pending_copies(CopyDirection direction) const { return link_->pending(direction); }

std::chrono::steady_clock::time_point SimBackend::clock_now() const {
  using std::chrono::steady_clock;
  return steady_clock::time_point(std::chrono::hours(1)) +
         std::chrono::duration_cast<steady_clock::duration>(std::chrono::duration<double>(clock_->now));
}

void SimBackend::run_compute(double seconds) { link_->run_compute(seconds); }

size_t SimBackend::copied_bytes(CopyDirection direction) const { return copied_bytes_[static_cast<int>(direction)]; }

}  // namespace membudget
