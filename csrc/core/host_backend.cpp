#include "host_backend.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <vector>

namespace membudget {

namespace {

// Page alignment for every "device" and host buffer: like cudaMalloc, more
// than any block alignment the allocator relies on (kMinBlockSize).
constexpr size_t kHostAlignmentBytes = 4096;

// Wall-clock origin and the Note [Copy timeline] of one backend, shared with
// the copy events it returns (which may outlive it).
struct CopyClock {
  std::chrono::steady_clock::time_point origin = std::chrono::steady_clock::now();
  CopyTimeline timeline;
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - origin).count();
  }
};

// Note [Waiter runs the copy]: a copy's event can hand its copy to the
// thread that waits for it. A synchronous copy (the allocation path's swap-out,
// an unpack's missed swap-in) is issued and waited for at once; going through
// the worker costs two thread wake-ups (the worker's, then the waiter's), which
// bench_simulate.py's calibration measured at 12-55 us per copy on this
// machine's idle cores, and a scheduler tick (about 4 ms) when the machine is
// loaded (bench/RESULTS.md, "Validation, run 2", point 4). So when the waiter
// finds its copy still queued at the head of an idle stream, it takes the job
// and runs the memcpy itself: the same bytes move in the same order, with no
// hand-off. The simulator models the same rule (Note [Modelled link]).
class CopyQueue;

// An event completed by another thread. ready() reads an atomic flag so that
// it never blocks; wait() sleeps on the condition variable. A copy's event
// carries its backend's CopyClock: a wait that blocks is recorded there.
class HostEvent final : public Event {
 public:
  HostEvent() = default;
  HostEvent(std::shared_ptr<CopyClock> clock, std::weak_ptr<CopyQueue> queue)
      : clock_(std::move(clock)), queue_(std::move(queue)) {}

  bool ready() override { return done_.load(std::memory_order_acquire); }

  void wait() override;

  // `copy_index`: the copy's record in the timeline (-1: none).
  void complete(int64_t copy_index = -1) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      copy_index_ = copy_index;
      done_.store(true, std::memory_order_release);
    }
    done_changed_.notify_all();
  }

 private:
  std::shared_ptr<CopyClock> clock_;
  std::weak_ptr<CopyQueue> queue_;  // the stream of this event's copy, if any
  std::atomic<bool> done_{false};
  std::mutex mutex_;
  std::condition_variable done_changed_;
  int64_t copy_index_ = -1;
};

void* aligned_or_null(size_t bytes) {
  void* ptr = nullptr;
  if (posix_memalign(&ptr, kHostAlignmentBytes, bytes == 0 ? 1 : bytes) != 0) {
    return nullptr;
  }
  return ptr;
}

// The queue of one copy stream, shared by its worker thread and by the events
// of its copies (which may outlive the stream: they hold it weakly).
class CopyQueue {
 public:
  CopyQueue(CopyDirection direction, std::shared_ptr<CopyClock> clock)
      : direction_(direction), clock_(std::move(clock)) {}

  // `for_waiter`: the caller waits for the copy at once; on an idle stream
  // the worker is not woken for it (Note [Waiter runs the copy]).
  EventPtr enqueue(std::weak_ptr<CopyQueue> self, void* dst, const void* src, size_t bytes, EventPtr after,
                   bool for_waiter) {
    auto done = std::make_shared<HostEvent>(clock_, std::move(self));
    bool wake = true;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      wake = !(for_waiter && waiter_runs_copies_ && jobs_.empty() && !running_);
      jobs_.push_back(Job{dst, src, bytes, std::move(after), done, clock_->seconds()});
      pending_.fetch_add(1, std::memory_order_relaxed);
    }
    if (wake) work_arrived_.notify_one();
    return done;
  }

  size_t pending() const { return pending_.load(std::memory_order_relaxed); }

  // The worker's loop: drains the queue one job at a time; on shutdown it
  // finishes the jobs already queued so that no waiter of a returned event is
  // left blocked forever.
  void drain() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        // Not while a waiter runs a job itself: one job at a time, in order.
        work_arrived_.wait(lock, [this] { return (stopping_ || !jobs_.empty()) && !running_; });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
        running_ = true;
      }
      if (job.after) job.after->wait();
      run(job, /*by_waiter=*/false);
    }
  }

  // Note [Waiter runs the copy]: runs the copy of `event` on the calling
  // thread if it is next in the queue, nothing is running, and what it was
  // ordered after is done. Returns whether it did (the event is then complete).
  bool run_if_next(const HostEvent* event) {
    Job job;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!waiter_runs_copies_ || running_ || jobs_.empty() || jobs_.front().done.get() != event) return false;
      if (jobs_.front().after && !jobs_.front().after->ready()) return false;
      job = std::move(jobs_.front());
      jobs_.pop_front();
      running_ = true;
    }
    run(job, /*by_waiter=*/true);
    return true;
  }

  void set_waiter_runs_copies(bool on) {
    std::lock_guard<std::mutex> lock(mutex_);
    waiter_runs_copies_ = on;
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    work_arrived_.notify_all();
  }

 private:
  struct Job {
    void* dst;
    const void* src;
    size_t bytes;
    EventPtr after;
    std::shared_ptr<HostEvent> done;
    double enqueued_s;
  };

  // One job's memcpy, recorded; then the next job may start.
  void run(Job& job, bool by_waiter) {
    const double started = clock_->seconds();
    if (job.bytes > 0) std::memcpy(job.dst, job.src, job.bytes);
    const int64_t index = clock_->timeline.add_copy(
        CopyRecord{-1, direction_, job.bytes, job.enqueued_s, started, clock_->seconds(), by_waiter});
    bool worker_has_work = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      running_ = false;
      worker_has_work = stopping_ || !jobs_.empty();
    }
    pending_.fetch_sub(1, std::memory_order_relaxed);
    // Only when the worker has something to do: woken after every copy a
    // waiter ran, it was awake at the next enqueue and took the next copy
    // meant for its waiter (1 in 10 of them in
    // test_a_copy_for_its_waiter_runs_on_the_waiting_thread).
    if (worker_has_work) work_arrived_.notify_one();
    job.done->complete(index);
  }

  std::mutex mutex_;
  std::condition_variable work_arrived_;
  std::deque<Job> jobs_;
  bool running_ = false;  // a job has been taken and its memcpy is not done
  bool waiter_runs_copies_ = true;
  std::atomic<size_t> pending_{0};  // queued + running
  bool stopping_ = false;
  const CopyDirection direction_;
  std::shared_ptr<CopyClock> clock_;
};

void HostEvent::wait() {
  if (ready()) return;
  const double started = clock_ ? clock_->seconds() : 0.0;
  std::shared_ptr<CopyQueue> queue = queue_.lock();
  if (!(queue && queue->run_if_next(this))) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_changed_.wait(lock, [this] { return ready(); });
  }
  if (clock_) clock_->timeline.add_wait(WaitRecord{copy_index_, started, clock_->seconds()});
}

// One copy stream: a worker thread draining a CopyQueue of memcpy jobs. Each
// job first waits for the event of the stream it was ordered after, so copies
// on one copy stream stay in issue order, as on a CUDA stream.
class CopyStream {
 public:
  CopyStream(CopyDirection direction, std::shared_ptr<CopyClock> clock)
      : queue_(std::make_shared<CopyQueue>(direction, std::move(clock))), worker_([this] { queue_->drain(); }) {}

  ~CopyStream() {
    queue_->stop();
    worker_.join();
  }

  EventPtr enqueue(void* dst, const void* src, size_t bytes, EventPtr after, bool for_waiter) {
    return queue_->enqueue(queue_, dst, src, bytes, std::move(after), for_waiter);
  }

  size_t pending() const { return queue_->pending(); }
  void set_waiter_runs_copies(bool on) { queue_->set_waiter_runs_copies(on); }

 private:
  std::shared_ptr<CopyQueue> queue_;
  std::thread worker_;  // last: starts after the queue it drains exists
};

}  // namespace

struct HostBackend::Impl {
  explicit Impl(size_t capacity)
      : capacity_bytes(capacity == 0 ? physical_memory_bytes() : capacity) {}

  const size_t capacity_bytes;
  std::atomic<size_t> device_used_bytes{0};

  // Counts `bytes` against the capacity; false (nothing counted) beyond it.
  // Reserve first, undo on failure: concurrent callers never overshoot.
  bool claim_device_bytes(size_t bytes) {
    size_t before = device_used_bytes.fetch_add(bytes);
    if (before + bytes > capacity_bytes) {
      device_used_bytes.fetch_sub(bytes);
      return false;
    }
    return true;
  }

  // Note [Virtual streams]: the held streams and their pending events.
  std::mutex streams_mutex;
  std::unordered_map<Stream, std::vector<std::shared_ptr<HostEvent>>> held_streams;

  // Before the streams: their workers use it.
  std::shared_ptr<CopyClock> copy_clock = std::make_shared<CopyClock>();
  CopyStream device_to_host{CopyDirection::device_to_host, copy_clock};
  CopyStream host_to_device{CopyDirection::host_to_device, copy_clock};
};

HostBackend::HostBackend(size_t capacity_bytes)
    : impl_(std::make_unique<Impl>(capacity_bytes)) {}

// Destroying impl_ joins both copy workers after they drain their queues.
// Events still pending on held virtual streams are completed first, so that a
// copy ordered after one of them cannot block the join forever.
HostBackend::~HostBackend() {
  std::vector<Stream> held;
  {
    std::lock_guard<std::mutex> lock(impl_->streams_mutex);
    for (auto& entry : impl_->held_streams) held.push_back(entry.first);
  }
  for (Stream stream : held) release_stream(stream);
}

size_t HostBackend::device_capacity() const { return impl_->capacity_bytes; }

size_t HostBackend::device_bytes_in_use() const {
  return impl_->device_used_bytes.load(std::memory_order_relaxed);
}

void* HostBackend::device_alloc(size_t bytes) {
  if (!impl_->claim_device_bytes(bytes)) return nullptr;
  void* ptr = aligned_or_null(bytes);
  if (ptr == nullptr) impl_->device_used_bytes.fetch_sub(bytes);
  return ptr;
}

void HostBackend::device_free(void* ptr, size_t bytes) {
  if (ptr == nullptr) return;
  std::free(ptr);
  impl_->device_used_bytes.fetch_sub(bytes);
}

size_t HostBackend::page_bytes() const {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGE_SIZE));
  return page;
}

size_t HostBackend::segment_page_bytes(size_t budget_bytes) const {
  return segment_page_for(budget_bytes, device_capacity());
}

size_t HostBackend::segment_page_for(size_t budget_bytes, size_t capacity_bytes) {
  // Note [Host pages]. No budget (none below the device's memory): nothing
  // but the device's end makes rung 3 move pages, so the kernel's page, the
  // finest, as a budget of a few MiB gets.
  const size_t capacity = capacity_bytes == 0 ? physical_memory_bytes() : capacity_bytes;
  size_t page = static_cast<size_t>(sysconf(_SC_PAGE_SIZE));
  if (budget_bytes >= capacity) return page;
  while (page < kMaxSegmentPageBytes && page * 2 * kSegmentPagesPerBudget <= budget_bytes) page *= 2;
  return page;
}

void* HostBackend::reserve_address_range(size_t bytes) {
  // Aligned to the largest segment page, so that every page of a segment
  // (Note [Host pages]) starts at a multiple of its size: reserve one more
  // and give back the ends.
  const size_t align = kMaxSegmentPageBytes;
  void* raw = mmap(nullptr, bytes + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t base = (start + align - 1) / align * align;
  if (base > start) munmap(raw, base - start);
  if (start + align > base) munmap(reinterpret_cast<void*>(base + bytes), start + align - base);
  return reinterpret_cast<void*>(base);
}

void HostBackend::release_address_range(void* base, size_t bytes) {
  if (base != nullptr) munmap(base, bytes);
}

bool HostBackend::map_pages(void* ptr, size_t bytes) {
  if (!impl_->claim_device_bytes(bytes)) return false;
  // MAP_POPULATE faults the pages in here, in one call, as cudaMalloc'd
  // memory is backed at once: mapping happens only on the allocation path
  // (never to be touched later at a page fault per 4 KiB).
  void* mapped = mmap(ptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_POPULATE,
                      -1, 0);
  if (mapped == MAP_FAILED) {
    impl_->device_used_bytes.fetch_sub(bytes);
    return false;
  }
  return true;
}

void HostBackend::unmap_pages(void* ptr, size_t bytes) {
  // Replacing the pages (rather than mprotect) drops their contents and
  // memory at once; the range stays reserved.
  void* reserved = mmap(ptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  if (reserved == MAP_FAILED) throw std::runtime_error("membudget: HostBackend could not unmap pages");
  impl_->device_used_bytes.fetch_sub(bytes);
}

// Linux 5.7+; older headers lack the name (the kernel then refuses the flag
// and the caller unmaps and maps instead).
#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4
#endif

bool HostBackend::move_pages(void* from, void* to, size_t bytes) {
  // mremap moves the page-table entries: no page is allocated or cleared
  // (bench/bench_page_moves.py: 116 MiB in 1 MiB runs, 1.2-1.3 ms moved
  // against 44-149 ms unmapped and mapped again). MREMAP_DONTUNMAP leaves
  // `from` mapped (and empty) instead of unmapping it, so the reservation
  // never has a hole another thread's mmap could be given before the
  // PROT_NONE mapping below replaces it. It fails when `from` spans several
  // kernel mappings or the kernel lacks the flag; the caller then unmaps and
  // maps.
  if (mremap(from, bytes, bytes, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, to) == MAP_FAILED) return false;
  void* reserved = mmap(from, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  if (reserved == MAP_FAILED) throw std::runtime_error("membudget: HostBackend could not re-reserve moved pages");
  return true;
}

void* HostBackend::host_alloc(size_t bytes) { return aligned_or_null(bytes); }

void HostBackend::host_free(void* ptr, size_t /*bytes*/) { std::free(ptr); }

EventPtr HostBackend::record(Stream stream) {
  if (stream != nullptr) {
    std::lock_guard<std::mutex> lock(impl_->streams_mutex);
    auto held = impl_->held_streams.find(stream);
    if (held != impl_->held_streams.end()) {
      auto pending = std::make_shared<HostEvent>();
      held->second.push_back(pending);
      return pending;
    }
  }
  // The calling thread's work is done by the time it asks; a non-held virtual
  // stream has no work at all.
  return std::make_shared<CompletedEvent>();
}

// Every stream of this backend runs on the calling thread (Note [Virtual
// streams]), so "work after this waits" means the caller waits now.
void HostBackend::stream_wait(Stream /*stream*/, const EventPtr& event) {
  if (event) event->wait();
}

EventPtr HostBackend::copy_to_host(void* host_dst, const void* device_src,
                                   size_t bytes, Stream after) {
  return impl_->device_to_host.enqueue(host_dst, device_src, bytes, record(after), /*for_waiter=*/false);
}

EventPtr HostBackend::copy_to_device(void* device_dst, const void* host_src,
                                     size_t bytes, Stream after) {
  return impl_->host_to_device.enqueue(device_dst, host_src, bytes, record(after), /*for_waiter=*/false);
}

EventPtr HostBackend::copy_to_host_for_waiter(void* host_dst, const void* device_src, size_t bytes, Stream after) {
  return impl_->device_to_host.enqueue(host_dst, device_src, bytes, record(after), /*for_waiter=*/true);
}

EventPtr HostBackend::copy_to_device_for_waiter(void* device_dst, const void* host_src, size_t bytes, Stream after) {
  return impl_->host_to_device.enqueue(device_dst, host_src, bytes, record(after), /*for_waiter=*/true);
}

size_t HostBackend::pending_copies(CopyDirection direction) const {
  return direction == CopyDirection::device_to_host ? impl_->device_to_host.pending()
                                                    : impl_->host_to_device.pending();
}

CopyTimeline& HostBackend::copy_timeline() { return impl_->copy_clock->timeline; }

void HostBackend::set_waiter_runs_copies(bool on) {
  impl_->device_to_host.set_waiter_runs_copies(on);
  impl_->host_to_device.set_waiter_runs_copies(on);
}

void HostBackend::hold_stream(Stream stream) {
  if (stream == nullptr) {
    throw std::invalid_argument(
        "HostBackend::hold_stream: the compute stream (0) cannot be held");
  }
  std::lock_guard<std::mutex> lock(impl_->streams_mutex);
  impl_->held_streams.emplace(stream, std::vector<std::shared_ptr<HostEvent>>{});
}

void HostBackend::release_stream(Stream stream) {
  std::vector<std::shared_ptr<HostEvent>> pending;
  {
    std::lock_guard<std::mutex> lock(impl_->streams_mutex);
    auto held = impl_->held_streams.find(stream);
    if (held == impl_->held_streams.end()) return;
    pending = std::move(held->second);
    impl_->held_streams.erase(held);
  }
  // Completed outside the lock: waiters may record new events when woken.
  for (auto& event : pending) event->complete();
}

size_t physical_memory_bytes() {
  long pages = sysconf(_SC_PHYS_PAGES);
  long page_size = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return 0;
  return static_cast<size_t>(pages) * static_cast<size_t>(page_size);
}

}  // namespace membudget
