// The only code that touches a device. The allocator and the residency manager
// are written once against this interface; see DESIGN.md "The core".
#pragma once
#include <chrono>
#include <cstddef>
#include <string>

#include "event.h"

namespace membudget {

enum class CopyDirection { device_to_host, host_to_device };

class Backend {
 public:
  virtual ~Backend() = default;

  // "cuda:0", "host": for stats and error messages.
  virtual std::string name() const = 0;
  // Total device memory in bytes; what a budget of "60%" is a fraction of.
  virtual size_t device_capacity() const = 0;

  // Raw device memory. Returns nullptr when the device itself refuses; the
  // budget is enforced above this, in CachingAllocator.
  virtual void* device_alloc(size_t bytes) = 0;
  virtual void device_free(void* ptr, size_t bytes) = 0;
  // Host memory for the swap tier: pinned (page-locked) where the device has
  // such memory, so copies run asynchronously on the copy streams.
  virtual void* host_alloc(size_t bytes) = 0;
  virtual void host_free(void* ptr, size_t bytes) = 0;

  // Note [Expandable segments]: virtual address ranges backed page by page,
  // so the allocator can return the pages of free fragments to the budget and
  // back a request anywhere in one growing range (PyTorch's
  // expandable_segments). A backend without virtual memory returns 0 from
  // page_bytes() and the allocator uses fixed segments only.
  //
  // The granularity of map_pages/unmap_pages; 0 when not supported.
  virtual size_t page_bytes() const { return 0; }
  // The page an allocator with `budget_bytes` cuts its expandable segments
  // into: a multiple of page_bytes() (Note [Host pages] in host_backend.h).
  virtual size_t segment_page_bytes(size_t /*budget_bytes*/) const { return page_bytes(); }
  // Reserves `bytes` (a multiple of page_bytes()) of address space with no
  // memory behind it; nullptr when refused.
  virtual void* reserve_address_range(size_t /*bytes*/) { return nullptr; }
  // Gives back a range from reserve_address_range; its pages are unmapped.
  virtual void release_address_range(void* /*base*/, size_t /*bytes*/) {}
  // Backs [ptr, ptr + bytes) (page aligned, inside a reserved range, not
  // mapped yet) with device memory. False when the device refuses; then
  // nothing was mapped.
  virtual bool map_pages(void* /*ptr*/, size_t /*bytes*/) { return false; }
  // Returns the memory behind [ptr, ptr + bytes) (page aligned, mapped).
  virtual void unmap_pages(void* /*ptr*/, size_t /*bytes*/) {}
  // Moves the memory behind mapped [from, from + bytes) to unmapped
  // [to, to + bytes), leaving `from` unmapped; contents move with it. Much
  // cheaper than unmap + map where the device can (no new memory to clear or
  // create). False when it cannot; then nothing changed.
  virtual bool move_pages(void* /*from*/, void* /*to*/, size_t /*bytes*/) { return false; }

  // An event that completes when the work queued on `stream` so far is done.
  virtual EventPtr record(Stream stream) = 0;
  // Work queued on `stream` after this call waits for `event`. On the host
  // backend the compute stream is the calling thread, so this blocks it.
  virtual void stream_wait(Stream stream, const EventPtr& event) = 0;

  // Asynchronous copies on the dedicated copy streams. Each copy starts only
  // after the work queued so far on `after` (the stream that produced or last
  // used the device memory) and returns its completion event.
  virtual EventPtr copy_to_host(void* host_dst, const void* device_src,
                                size_t bytes, Stream after) = 0;
  virtual EventPtr copy_to_device(void* device_dst, const void* host_src,
                                  size_t bytes, Stream after) = 0;
  // The same copies, for a caller that waits for the returned event at once
  // (the allocation path's synchronous swap-out, an unpack's missed
  // swap-in). A backend whose copy streams are host threads leaves such a
  // copy for the waiting thread to run when its stream is idle (Note [Waiter
  // runs the copy] in host_backend.cpp); by default they are the copies above.
  virtual EventPtr copy_to_host_for_waiter(void* host_dst, const void* device_src, size_t bytes, Stream after) {
    return copy_to_host(host_dst, device_src, bytes, after);
  }
  virtual EventPtr copy_to_device_for_waiter(void* device_dst, const void* host_src, size_t bytes, Stream after) {
    return copy_to_device(device_dst, host_src, bytes, after);
  }
  // Copies queued on a copy stream and not yet finished: the director's view
  // of how long a new copy would wait.
  virtual size_t pending_copies(CopyDirection direction) const = 0;

  // The clock the residency manager times copies, stalls and pack/unpack
  // intervals by: the steady clock, except on SimBackend, whose modelled time
  // is what the manager must see there (its decisions depend on it).
  virtual std::chrono::steady_clock::time_point clock_now() const { return std::chrono::steady_clock::now(); }
};

}  // namespace membudget
