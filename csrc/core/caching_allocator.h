// CachingAllocator: PyTorch-style block pools over a Backend, bounded by a
// budget on *reserved* bytes. See DESIGN.md "The core", step 2.
//
// Note [Budget]: reserved bytes (all segments obtained from the backend) never
// exceed budget(). Segment sizes adapt near the budget: when a standard segment
// (2 MiB small / 20 MiB large) would break it, the segment is shrunk to the
// rounded request.
//
// With expandable segments (Note [Expandable segments] in backend.h;
// expandable_segment.h) each pool has one segment per stream, a reserved
// address range as large as the device whose pages are mapped on demand:
// reserved bytes are the mapped pages, rung 2 creates the range once, and
// rung 3 unmaps the free pages so a request can be backed in the tail. Used
// for device memory where the backend supports it and the caller asks.
//
// Note [OOM ladder]: allocate() tries, in order,
//   1. a cached free block (best fit, same stream, split if large enough);
//   2. a new segment within the budget;
//   3. release cached free segments, then a new segment; for a small
//      request, then a free piece of a large segment;
//   4. the Evictor (residency manager) frees memory, then retry 1-3
//      (repeated while it makes progress);
//   5. throw OutOfMemory with budget, reserved, allocated, evictable bytes and
//      a hint.
//
// Note [Locking]: public methods take mutex_; private ones assume it is held.
// The Evictor is called with mutex_ released, because eviction frees memory
// through deallocate() and may run Python-free code of the manager, which in
// turn may allocate. Nothing here ever calls Python.
//
// Note [Stream-ordered reuse]: a block is tagged with the stream it was
// allocated on and is reused only for that stream. record_stream(ptr, s) adds
// another user stream; when such a block is freed, an event is recorded on each
// extra stream and the block returns to its pool only once all are complete.
// Completion is checked (never waited for) at the start of allocate(), after
// each eviction, and in release_cached() and set_budget(); until then such a
// block shows in snapshot() with awaiting_events set.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend.h"

namespace membudget {

enum class MemoryKind { device, host };

struct AllocatorStats {
  size_t allocated_current = 0;  // bytes in live blocks (rounded sizes)
  size_t allocated_peak = 0;
  size_t reserved_current = 0;   // bytes in segments from the backend
  size_t reserved_peak = 0;
  size_t requested_current = 0;  // bytes callers asked for (unrounded)
  size_t budget = 0;
  size_t num_alloc_retries = 0;  // allocations that needed rung 3 or 4
  size_t num_ooms = 0;
  size_t num_segments = 0;
  size_t num_live_blocks = 0;
  size_t num_evictor_calls = 0;
  // Bytes obtained from and given back to the device so far: pages mapped and
  // unmapped in expandable segments, fixed segments allocated and freed.
  // Their growth per step is what releasing memory near the budget costs.
  size_t mapped_bytes_total = 0;
  size_t unmapped_bytes_total = 0;
  // Expandable segments: bytes of pages moved from free blocks to where a
  // request needed them (Note [Page recycling]).
  size_t moved_bytes_total = 0;
};

// One block as seen by snapshot(), for tests and debugging.
struct BlockInfo {
  uintptr_t address = 0;
  size_t size = 0;
  bool allocated = false;
  Stream stream = nullptr;
  // Deallocated, but not reusable until events on the streams given to
  // record_stream complete (Note [Stream-ordered reuse]).
  bool awaiting_events = false;
};

struct SegmentInfo {
  uintptr_t address = 0;
  size_t size = 0;          // address range; for an expandable segment, reserved
  size_t mapped_bytes = 0;  // backed by memory: size, except in expandable ones
  bool expandable = false;
  size_t page_bytes = 0;    // an expandable segment's page (Note [Host pages])
  bool retired = false;     // an expandable segment the budget's page replaced
  bool small_pool = false;
  std::vector<BlockInfo> blocks;  // in address order, covering the segment
  // The address ranges backed by memory (address, bytes), ascending: the
  // whole segment, except in expandable ones.
  std::vector<std::pair<uintptr_t, size_t>> mapped_ranges;
};

// The failure callback of the OOM ladder ("evict, then retry").
class Evictor {
 public:
  virtual ~Evictor() = default;
  // Releases memory held by evictable allocations so that a request of
  // `bytes_needed` on `stream` may fit. Returns the bytes it freed (0 when it
  // could free nothing). Called without the allocator lock held.
  virtual size_t evict(size_t bytes_needed, Stream stream) = 0;
  // One line for the OOM message: evictable bytes by state.
  virtual std::string describe_evictable() const = 0;
};

class CachingAllocator {
 public:
  // `kind` selects backend.device_alloc or backend.host_alloc as upstream.
  // `name` appears in error messages ("device", "host tier").
  // `expandable_segments` asks for expandable segments; it takes effect for
  // device memory on a backend with page_bytes() > 0 (expandable_segments()).
  // `segment_page_bytes` fixes their page (a multiple of backend.page_bytes(),
  // else invalid_argument); 0 lets the backend choose it for the budget
  // (Note [Host pages]).
  CachingAllocator(Backend& backend, MemoryKind kind, size_t budget_bytes,
                   std::string name, bool expandable_segments = false, size_t segment_page_bytes = 0);
  ~CachingAllocator();  // returns all segments to the backend
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // Returns memory for `bytes` (nullptr for 0 bytes) aligned to kMinBlockSize,
  // usable on `stream`. Throws OutOfMemory at the end of the ladder.
  void* allocate(size_t bytes, Stream stream = nullptr);
  // The same ladder without its last rung: returns nullptr instead of
  // throwing, and does not count an OOM. For speculative work (prefetch).
  void* try_allocate(size_t bytes, Stream stream = nullptr);
  // Frees a pointer returned by allocate(). Unknown pointers throw
  // std::invalid_argument; nullptr is ignored.
  void deallocate(void* ptr);
  // Marks ptr as used by `stream` too (see Note [Stream-ordered reuse]).
  void record_stream(void* ptr, Stream stream);

  // Whether this allocator uses expandable segments.
  bool expandable_segments() const;
  // The page of its expandable segments (Note [Host pages]); 0 while it has
  // none (the next is reserved with the backend's page for the budget then).
  size_t segment_page_bytes() const;

  // Returns cached free segments to the backend (and unmaps the free pages of
  // expandable segments, or the whole of one that is all free); returns
  // bytes released.
  size_t release_cached();
  // Changing the budget below current reserved bytes releases cached segments
  // first; it does not fail, later allocations must evict to fit.
  void set_budget(size_t budget_bytes);
  size_t budget() const;
  // The evictor is not owned; nullptr removes it.
  void set_evictor(Evictor* evictor);
  // The installed evictor, or nullptr; lets an evictor uninstall itself when
  // it is destroyed.
  Evictor* evictor() const;

  // True when ptr is a live allocation returned by allocate() (its start
  // address), i.e. one that deallocate() accepts.
  bool owns(const void* ptr) const;
  // Rounded size of the live block at ptr; 0 when ptr is not live here.
  size_t allocation_size(const void* ptr) const;
  // The largest block that could be allocated now without evicting anything:
  // the largest cached free block (on its own stream) or what the budget
  // leaves once cached free segments are released, whichever is larger.
  size_t largest_free_or_reservable() const;
  // Note [Usable ranges]: what a request could use once memory is freed. For
  // a live block at ptr: the block plus its free neighbours, as one range if
  // it were deallocated now. For any other address: the free range that
  // contains it now, or 0 when it lies in an allocated block. A range that
  // spans its whole segment counts with the budget headroom added (the
  // segment could be released and one larger segment reserved); an address in
  // no segment (its segment was released) counts as the headroom alone.
  // Allocator-aware eviction uses this to prefer victims that make a large
  // request fit, and to count evictions that freed nothing usable.
  size_t usable_range_at(const void* ptr) const;

  AllocatorStats stats() const;
  void reset_peak_stats();
  // Zeroes the event counters (retries, OOMs, evictor calls).
  void reset_counters();
  std::vector<SegmentInfo> snapshot() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace membudget
