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
// The physical allocation granularity of current NVIDIA GPUs
// (cuMemGetAllocationGranularity), for expandable segments.
constexpr size_t kGpuPageBytes = size_t{2} << 20;

size_t round_to_page(size_t bytes) { return (bytes + kPageBytes - 1) / kPageBytes * kPageBytes; }

// An event at a point of modelled time (Note [Modelled time]).
class SimEvent final : public Event {
 public:
  SimEvent(std::shared_ptr<SimClock> clock, double done_at) : clock_(std::move(clock)), done_at_(done_at) {}
  bool ready() override { return done_at_ <= clock_->now; }
  void wait() override {
    if (done_at_ > clock_->now) {
      clock_->stall_seconds += done_at_ - clock_->now;
      clock_->now = done_at_;
    }
  }

 private:
  std::shared_ptr<SimClock> clock_;
  double done_at_;
};

}  // namespace

SimBackend::SimBackend(size_t capacity_bytes, double link_bytes_per_s)
    : capacity_bytes_(capacity_bytes), link_bytes_per_s_(link_bytes_per_s),
      clock_(std::make_shared<SimClock>()), next_device_address_(kDeviceBase), next_host_address_(kHostBase) {}

SimBackend::~SimBackend() = default;

void* SimBackend::device_alloc(size_t bytes) {
  if (device_in_use_ + bytes > capacity_bytes_) return nullptr;
  device_in_use_ += bytes;
  void* ptr = reinterpret_cast<void*>(next_device_address_);
  next_device_address_ += round_to_page(std::max<size_t>(bytes, 1));
  return ptr;
}

void SimBackend::device_free(void*, size_t bytes) { device_in_use_ -= std::min(bytes, device_in_use_); }

size_t SimBackend::page_bytes() const { return kGpuPageBytes; }

void* SimBackend::reserve_address_range(size_t bytes) {
  next_device_address_ = (next_device_address_ + kGpuPageBytes - 1) / kGpuPageBytes * kGpuPageBytes;
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
  return std::make_shared<SimEvent>(clock_, side_stream_free_at_);
}

EventPtr SimBackend::record(Stream) {
  // The compute stream is the caller: its work so far is done by now.
  return std::make_shared<SimEvent>(clock_, clock_->now);
}

void SimBackend::stream_wait(Stream, const EventPtr& event) { event->wait(); }

double SimBackend::copy_seconds(size_t bytes) const { return static_cast<double>(bytes) / link_bytes_per_s_; }

EventPtr SimBackend::enqueue_copy(CopyDirection direction, size_t bytes) {
  const int lane = static_cast<int>(direction);
  const double start = std::max(clock_->now, copy_stream_free_at_[lane]);
  const double end = start + copy_seconds(bytes);
  copy_stream_free_at_[lane] = end;
  copied_bytes_[lane] += bytes;
  pending_[lane].push_back(end);
  return std::make_shared<SimEvent>(clock_, end);
}

EventPtr SimBackend::copy_to_host(void*, const void*, size_t bytes, Stream) {
  return enqueue_copy(CopyDirection::device_to_host, bytes);
}

EventPtr SimBackend::copy_to_device(void*, const void*, size_t bytes, Stream) {
  return enqueue_copy(CopyDirection::host_to_device, bytes);
}

size_t SimBackend::pending_copies(CopyDirection direction) const {
  auto& queue = pending_[static_cast<int>(direction)];
  // Ends are increasing within one stream: drop the finished front.
  while (!queue.empty() && queue.front() <= clock_->now) queue.pop_front();
  return queue.size();
}

std::chrono::steady_clock::time_point SimBackend::clock_now() const {
  using std::chrono::steady_clock;
  return steady_clock::time_point(std::chrono::hours(1)) +
         std::chrono::duration_cast<steady_clock::duration>(std::chrono::duration<double>(clock_->now));
}

void SimBackend::run_compute(double seconds) { clock_->now += std::max(0.0, seconds); }

size_t SimBackend::copied_bytes(CopyDirection direction) const { return copied_bytes_[static_cast<int>(direction)]; }

}  // namespace membudget
