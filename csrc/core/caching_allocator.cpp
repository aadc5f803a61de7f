#include "caching_allocator.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <unordered_map>
#include <utility>

#include "block_pool.h"
#include "expandable_segment.h"
#include "out_of_memory.h"
#include "units.h"

namespace membudget {

namespace {

// Requests above this can never be served (and would overflow the size
// arithmetic); they go straight to the OutOfMemory rung.
constexpr size_t kMaxRequestBytes = std::numeric_limits<size_t>::max() / 4;

size_t round_size(size_t bytes) {
  return (bytes + kMinBlockSize - 1) / kMinBlockSize * kMinBlockSize;
}

// The segment a request of `size` (already rounded) normally gets; see
// Note [Budget] for when it is shrunk.
size_t standard_segment_size(size_t size) {
  if (size <= kSmallSize) return kSmallBuffer;
  if (size < kMinLargeAlloc) return kLargeBuffer;
  return (size + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
}

constexpr const char* kOomHint =
    "Hint: raise MEMBUDGET_BUDGET, lower the batch size, or let more activations "
    "be evicted (MEMBUDGET_MIN_TENSOR_BYTES).";

}  // namespace

// All members are guarded by `mutex`; every method of Impl assumes it is held
// (Note [Locking]).
struct CachingAllocator::Impl {
  Impl(Backend& backend_, MemoryKind kind_, size_t budget_bytes, std::string name_, bool expandable_segments)
      : backend(backend_), kind(kind_), name(std::move(name_)),
        expandable(expandable_segments && kind_ == MemoryKind::device && backend_.page_bytes() > 0),
        budget(budget_bytes) {
    stats.budget = budget_bytes;
  }

  void* climb_ladder(size_t bytes, Stream stream, std::unique_lock<std::mutex>& lock);

  struct Segment {
    Block* head;
    size_t size;
    std::unique_ptr<ExpandableSegment> expandable;  // null for a fixed segment
    // An expandable segment whose page the budget no longer wants (Note
    // [Host pages]): no tail to grow into, released once nothing in it lives.
    bool retired = false;
  };

  Backend& backend;
  const MemoryKind kind;
  const std::string name;
  // Note [Expandable segments]: one growing segment per pool and stream
  // instead of fixed segments.
  const bool expandable;
  mutable std::mutex mutex;
  size_t budget;
  // The page of the expandable segments (Note [Host pages]), chosen for the
  // budget when the first of them is reserved: pages move between segments,
  // so the current ones share one size; a budget that wants another page
  // retires them (change_segment_page), and retired ones keep theirs.
  size_t segment_page = 0;
  size_t fixed_segment_page = 0;  // the constructor's segment_page_bytes
  // Bytes in segments. Atomic so that the budget check reads as RMM's:
  // reserve with fetch_add, undo on failure.
  std::atomic<size_t> reserved_bytes{0};
  Evictor* evictor = nullptr;
  BlockPool small_pool{true};
  BlockPool large_pool{false};
  std::unordered_map<const void*, Block*> live_blocks;
  std::map<uintptr_t, Segment> segments;  // by address, for snapshot and teardown
  // The (pool, stream) pairs whose expandable segment exists.
  std::set<std::pair<const BlockPool*, Stream>> expandable_segments;
  // Blocks in the "awaiting" state (Note [Block states]), one entry per event.
  std::vector<std::pair<EventPtr, Block*>> awaiting;
  AllocatorStats stats;
  // What the last failed back_with_pages lacked (Note [Partial release]).
  size_t shortfall_bytes = 0;
  const Block* shortfall_block = nullptr;

  void* upstream_alloc(size_t bytes) {
    return kind == MemoryKind::device ? backend.device_alloc(bytes)
                                      : backend.host_alloc(bytes);
  }
  void upstream_free(void* ptr, size_t bytes) {
    if (kind == MemoryKind::device) {
      backend.device_free(ptr, bytes);
    } else {
      backend.host_free(ptr, bytes);
    }
  }

  bool try_reserve(size_t bytes) {
    size_t before = reserved_bytes.fetch_add(bytes);
    if (before + bytes > budget) {
      reserved_bytes.fetch_sub(bytes);
      return false;
    }
    return true;
  }

  void note_reserved_peak() { stats.reserved_peak = std::max(stats.reserved_peak, reserved_bytes.load()); }

  // Rung 1: best fit among cached blocks of this stream, split if worth it.
  // With expandable segments the best fit may need new pages while a larger
  // free block is already mapped: that one is taken instead, so reserved
  // bytes do not grow (and, near the budget, nothing is unmapped only to be
  // mapped again elsewhere).
  Block* take_cached(BlockPool& pool, Stream stream, size_t size) {
    Block* block = pool.take_best_fit(stream, size);
    if (block == nullptr) return nullptr;
    if (block->expandable != nullptr && !block->expandable->fully_mapped(block->ptr, size)) {
      pool.insert(block);
      if (Block* mapped = take_mapped_fit(pool, stream, size)) {
        block = mapped;
      } else {
        pool.erase(block);
        if (!back_with_pages(block, size)) {
          pool.insert(block);
          return nullptr;
        }
      }
    }
    if (pool.should_split(block, size)) pool.insert(pool.split(block, size));
    return block;
  }

  // Bounds the search of take_mapped_fit: it runs only when the best fit
  // needs new pages, but must stay cheap with thousands of free blocks.
  static constexpr int kMappedFitSearch = 64;

  // The smallest free block among the next kMappedFitSearch in best-fit
  // order whose pages under the first `size` bytes are all mapped. Removed
  // from the pool, or nullptr.
  Block* take_mapped_fit(BlockPool& pool, Stream stream, size_t size) {
    Block key(nullptr, size, stream, &pool);
    auto it = pool.free_blocks().lower_bound(&key);
    for (int looked = 0; it != pool.free_blocks().end() && looked < kMappedFitSearch; ++it, ++looked) {
      Block* candidate = *it;
      if (candidate->stream != stream) break;
      if (candidate->expandable == nullptr || !candidate->expandable->fully_mapped(candidate->ptr, size)) continue;
      pool.erase(candidate);
      return candidate;
    }
    return nullptr;
  }

  // Maps the unmapped pages under the first `size` bytes of a free block of an
  // expandable segment, within the budget. True when they are all mapped
  // (always, in a fixed segment).
  // On failure it records what rung 3 must release (Note [Partial release]).
  bool back_with_pages(Block* block, size_t size) {
    if (block->expandable == nullptr) return true;
    ExpandableSegment& segment = *block->expandable;
    const size_t needed = segment.unmapped_bytes_touching(block->ptr, size);
    if (needed == 0) return true;
    if (!try_reserve(needed)) {
      // What must go for `needed` to fit, including what a budget lowered
      // below the reserved bytes left over (set_budget with blocks live).
      const size_t reserved = reserved_bytes.load();
      shortfall_bytes = reserved + needed > budget ? reserved + needed - budget : needed;
      shortfall_block = block;
      return false;
    }
    if (!segment.map_range(block->ptr, size)) {
      reserved_bytes.fetch_sub(needed);
      shortfall_bytes = std::numeric_limits<size_t>::max();  // the device refused: give back all
      shortfall_block = nullptr;
      return false;
    }
    stats.mapped_bytes_total += needed;
    note_reserved_peak();
    return true;
  }

  // Free blocks of expandable segments other than `except` with mapped pages
  // wholly inside them, most mapped bytes first: the donors of Note [Page
  // recycling] and the victims of Note [Partial release].
  std::vector<std::pair<size_t, Block*>> free_blocks_by_mapped_bytes(const Block* except) const {
    std::vector<std::pair<size_t, Block*>> found;
    for (const BlockPool* pool : {&small_pool, &large_pool}) {
      for (Block* block : pool->free_blocks()) {
        if (block == except || block->expandable == nullptr) continue;
        const size_t bytes = block->expandable->mapped_bytes_inside(block->ptr, block->size);
        if (bytes > 0) found.emplace_back(bytes, block);
      }
    }
    std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    return found;
  }

  // Note [Page recycling]: at rung 3 with expandable segments, the pages the
  // wanted block lacks are first taken from free blocks by moving them
  // (Backend::move_pages), not unmapped there and mapped anew: reserved bytes
  // do not change and no memory is cleared or created (on the CPU 35-120x
  // faster than unmap + map: bench/bench_page_moves.py). Donors: the free
  // blocks with the most mapped pages first, the wanted block's own pages
  // past `size` last. Returns the bytes moved; pages that could not move are
  // left to Note [Partial release].
  size_t recycle_pages_into(const Block* target, size_t size) {
    ExpandableSegment& to = *target->expandable;
    ExpandableSegment::PageRuns wanted = to.unmapped_runs_touching(target->ptr, size);
    size_t wanted_pages = 0;
    for (const auto& run : wanted) wanted_pages += run.second;
    if (wanted_pages == 0) return 0;
    struct SourceRun {
      ExpandableSegment* segment;
      size_t page;
      size_t count;
    };
    std::vector<SourceRun> sources;  // as many pages as wanted, at most
    size_t found = 0;
    auto take_from = [&](ExpandableSegment* segment, const char* ptr, size_t bytes) {
      for (const auto& run : segment->mapped_runs_inside(ptr, bytes)) {
        if (found == wanted_pages) return;
        const size_t count = std::min(run.second, wanted_pages - found);
        sources.push_back({segment, run.first, count});
        found += count;
      }
    };
    for (const auto& donor : free_blocks_by_mapped_bytes(target)) {
      take_from(donor.second->expandable, donor.second->ptr, donor.second->size);
    }
    if (target->size > size) take_from(&to, target->ptr + size, target->size - size);
    // Pair source runs with wanted runs, moving the overlap of the two heads.
    size_t moved_pages = 0;
    size_t w = 0;
    for (SourceRun& source : sources) {
      while (source.count > 0 && w < wanted.size()) {
        const size_t count = std::min(source.count, wanted[w].second);
        if (ExpandableSegment::move(*source.segment, source.page, to, wanted[w].first, count)) moved_pages += count;
        source.page += count;
        source.count -= count;
        wanted[w].first += count;
        wanted[w].second -= count;
        if (wanted[w].second == 0) ++w;
      }
    }
    const size_t moved = moved_pages * to.page_bytes();
    stats.moved_bytes_total += moved;
    return moved;
  }

  // Note [Partial release]: rung 3 with expandable segments unmaps only the
  // shortfall of the block rung 1 wanted, from the free blocks with the most
  // mapped pages first (fewest calls), and from that block itself last and
  // only past the bytes it was wanted for (those would only be mapped
  // again). Releasing every free page instead, as PyTorch's empty_cache does,
  // makes each allocation near the budget unmap memory that the next ones map
  // and fault in again.
  size_t release_free_pages(size_t wanted, const Block* keep, size_t keep_bytes) {
    size_t released = 0;
    for (const auto& entry : free_blocks_by_mapped_bytes(keep)) {
      if (released >= wanted) break;
      released += entry.second->expandable->unmap_inside(entry.second->ptr, entry.second->size);
    }
    if (released < wanted && keep != nullptr && keep->size > keep_bytes) {
      released += keep->expandable->unmap_inside(keep->ptr + keep_bytes, keep->size - keep_bytes);
    }
    reserved_bytes.fetch_sub(released);
    stats.unmapped_bytes_total += released;
    return released;
  }

  // Bytes a free block gives back to the budget when released: its whole
  // segment when it spans one, the mapped pages wholly inside it in an
  // expandable segment, otherwise nothing.
  static size_t releasable_bytes(const Block* block) {
    if (block->expandable != nullptr) return block->expandable->mapped_bytes_inside(block->ptr, block->size);
    return block->spans_segment() ? block->size : 0;
  }

  // Note [Address headroom]: an expandable segment reserves addresses, not
  // memory, and a request needs one contiguous free range of them. Reserved
  // only as large as the device, a range near the budget is as fragmented as
  // a fixed segment (live blocks scattered over all of it), and a large
  // request is satisfied only once eviction happens to free a contiguous
  // run: measured in the simulator, Llama-7B's 2-4 GB loss tensors on h200
  // at a 126 GiB budget (5 GiB short of the device) evicted 73 GiB of
  // activations for a few GiB of requests. A range kAddressHeadroom times
  // the device always has a never-mapped tail to back a request in, which
  // is what Note [Expandable segments] promises; addresses cost nothing
  // (CUDA's cuMemAddressReserve, the host's PROT_NONE mmap, the simulator's
  // counter). The budget and the device's memory still bound what is mapped.
  static constexpr size_t kAddressHeadroom = 4;

  // Rung 2 with expandable segments: the first request of a (pool, stream)
  // reserves its segment (Note [Address headroom]); later ones find it in
  // rung 1, so there is never a second one.
  Block* new_expandable_segment(BlockPool& pool, Stream stream, size_t size) {
    const auto key = std::make_pair(static_cast<const BlockPool*>(&pool), stream);
    if (expandable_segments.count(key) != 0) return nullptr;
    if (expandable_segments.empty()) {
      segment_page = fixed_segment_page != 0 ? fixed_segment_page : backend.segment_page_bytes(budget);
    }
    auto segment = std::make_unique<ExpandableSegment>(backend, kAddressHeadroom * std::max(backend.device_capacity(), size),
                                                       segment_page);
    if (segment->base() == nullptr) return nullptr;
    auto* block = new Block(segment->base(), segment->size(), stream, &pool);
    block->expandable = segment.get();
    expandable_segments.insert(key);
    const size_t virtual_size = segment->size();
    segments.emplace(reinterpret_cast<uintptr_t>(block->ptr), Segment{block, virtual_size, std::move(segment)});
    ++stats.num_segments;
    pool.insert(block);
    return take_cached(pool, stream, size);
  }

  // Rung 2: a new segment within the budget (Note [Budget]).
  Block* new_segment(BlockPool& pool, Stream stream, size_t size) {
    if (expandable) return new_expandable_segment(pool, stream, size);
    size_t segment_size = standard_segment_size(size);
    if (!try_reserve(segment_size)) {
      if (segment_size == size || !try_reserve(size)) return nullptr;
      segment_size = size;
    }
    void* ptr = upstream_alloc(segment_size);
    if (ptr == nullptr) {
      reserved_bytes.fetch_sub(segment_size);
      return nullptr;
    }
    auto* block = new Block(static_cast<char*>(ptr), segment_size, stream, &pool);
    segments.emplace(reinterpret_cast<uintptr_t>(ptr), Segment{block, segment_size, nullptr});
    ++stats.num_segments;
    stats.mapped_bytes_total += segment_size;
    note_reserved_peak();
    if (pool.should_split(block, size)) pool.insert(pool.split(block, size));
    return block;
  }

  void* hand_out(Block* block, size_t requested) {
    block->allocated = true;
    block->requested = requested;
    live_blocks.emplace(block->ptr, block);
    stats.allocated_current += block->size;
    stats.allocated_peak = std::max(stats.allocated_peak, stats.allocated_current);
    stats.requested_current += requested;
    ++stats.num_live_blocks;
    return block->ptr;
  }

  // Returns a block whose events are all complete to its pool.
  void free_block(Block* block) {
    block->stream_uses.clear();
    BlockPool* pool = block->pool;
    pool->insert(pool->merge_free_neighbours(block));
  }

  // Moves awaiting blocks whose events have completed back to their pools.
  void process_awaiting() {
    if (awaiting.empty()) return;
    size_t kept = 0;
    for (auto& entry : awaiting) {
      if (entry.first->ready()) {
        Block* block = entry.second;
        if (--block->pending_events == 0) free_block(block);
      } else {
        awaiting[kept++] = std::move(entry);
      }
    }
    awaiting.resize(kept);
  }

  // Rung 3: returns every free block that spans its whole fixed segment to
  // the backend, and unmaps the free pages of expandable segments. Partly used
  // fixed segments stay: their free pieces cannot be returned.
  size_t release_free_segments() {
    std::vector<Block*> releasable;
    size_t released = 0;
    for (BlockPool* pool : {&small_pool, &large_pool}) {
      for (Block* block : pool->free_blocks()) {
        if (block->expandable != nullptr && !block->spans_segment()) {
          released += block->expandable->unmap_inside(block->ptr, block->size);
        } else if (block->spans_segment()) {
          releasable.push_back(block);
        }
      }
    }
    reserved_bytes.fetch_sub(released);
    stats.unmapped_bytes_total += released;
    for (Block* block : releasable) {
      block->pool->erase(block);
      // A wholly free expandable segment goes too (its destructor unmaps its
      // pages and gives its range back): the next one is reserved with the
      // page for the budget of then (Note [Host pages]).
      size_t freed = block->size;
      if (block->expandable != nullptr) {
        freed = block->expandable->mapped_bytes();
        if (!segments.at(reinterpret_cast<uintptr_t>(block->ptr)).retired) {
          expandable_segments.erase(std::make_pair(static_cast<const BlockPool*>(block->pool), block->stream));
        }
      } else {
        upstream_free(block->ptr, block->size);
      }
      segments.erase(reinterpret_cast<uintptr_t>(block->ptr));
      reserved_bytes.fetch_sub(freed);
      stats.unmapped_bytes_total += freed;
      --stats.num_segments;
      released += freed;
      delete block;
    }
    return released;
  }

  // Note [Host pages]: a new budget that wants another page releases the
  // expandable segments with nothing live in them, and retires the others:
  // their free tail (the never-mapped range new blocks would grow into) is
  // cut off once its pages are unmapped, so the next request that finds no free block
  // reserves a new segment with the new page, while their free fragments
  // still serve requests that fit. Without this, one small tensor kept alive
  // across install() calls in a process (the tests) pinned the page of a
  // 4 GiB budget (2 MiB) on later budgets of 9-27 MiB, which then ran out of
  // memory in straddled pages.
  void change_segment_page(size_t page) {
    release_free_segments();
    for (auto& entry : segments) {
      Segment& segment = entry.second;
      if (segment.expandable == nullptr || segment.retired) continue;
      segment.retired = true;
      Block* tail = segment.head;
      while (tail->next != nullptr) tail = tail->next;
      expandable_segments.erase(std::make_pair(static_cast<const BlockPool*>(tail->pool), tail->stream));
      if (tail == segment.head || !tail->is_free()) continue;
      // The tail's part of a page it shares with the block before stays, as
      // a free block: the segment's blocks then cover its mapped pages.
      ExpandableSegment& range = *segment.expandable;
      const size_t into_page = static_cast<size_t>(tail->ptr - range.base()) % range.page_bytes();
      const size_t kept = into_page == 0 ? 0 : std::min(tail->size, range.page_bytes() - into_page);
      BlockPool& pool = *tail->pool;
      pool.erase(tail);
      if (kept == tail->size) {
        pool.insert(tail);
        continue;
      }
      Block* cut = tail;
      if (kept > 0) {
        cut = pool.split(tail, kept);
        pool.insert(tail);
      }
      // Its pages are unmapped already: release_free_segments() above
      // unmapped every page wholly inside a free block.
      cut->prev->next = nullptr;
      segment.size = static_cast<size_t>(cut->ptr - segment.head->ptr);  // what its blocks cover
      delete cut;
    }
    segment_page = page;
  }

  // Bytes in free blocks that are backed by memory (an expandable segment's
  // never-mapped tail is free but costs nothing, so it does not count).
  size_t free_cached_bytes() const {
    size_t bytes = 0;
    for (const BlockPool* pool : {&small_pool, &large_pool}) {
      for (const Block* block : pool->free_blocks()) {
        bytes += block->expandable != nullptr ? block->expandable->mapped_bytes_inside(block->ptr, block->size)
                                              : block->size;
      }
    }
    return bytes;
  }

  [[noreturn]] void throw_not_live(const char* caller) const {
    throw std::invalid_argument(std::string("membudget: ") + caller +
                                " of a pointer that is not a live allocation of the " +
                                name + " allocator");
  }
};

CachingAllocator::CachingAllocator(Backend& backend, MemoryKind kind, size_t budget_bytes,
                                   std::string name, bool expandable_segments, size_t segment_page_bytes)
    : impl_(std::make_unique<Impl>(backend, kind, budget_bytes, std::move(name), expandable_segments)) {
  const size_t unit = backend.page_bytes();
  if (segment_page_bytes != 0 && (unit == 0 || segment_page_bytes % unit != 0)) {
    throw std::invalid_argument("membudget: segment_page_bytes " + std::to_string(segment_page_bytes) +
                                " is not a multiple of the backend's page (" + std::to_string(unit) + " bytes)");
  }
  impl_->fixed_segment_page = segment_page_bytes;
}

CachingAllocator::~CachingAllocator() {
  for (auto& entry : impl_->segments) {
    Block* block = entry.second.head;
    while (block != nullptr) {
      Block* next = block->next;
      delete block;
      block = next;
    }
    // An expandable segment unmaps its pages and releases its range itself.
    if (entry.second.expandable == nullptr) {
      impl_->upstream_free(reinterpret_cast<void*>(entry.first), entry.second.size);
    }
  }
}

// Note [OOM ladder] (in the header) is the outline; rungs 1-4 are here, and
// rung 5 (the error) is allocate()'s. Returns nullptr when every rung failed.
void* CachingAllocator::Impl::climb_ladder(size_t bytes, Stream stream, std::unique_lock<std::mutex>& lock) {
  Impl& self = *this;
  self.process_awaiting();
  const size_t size = bytes <= kMaxRequestBytes ? round_size(bytes) : 0;
  // A request larger than the budget can never fit: evicting for it would
  // only throw away work, so it skips to rung 5.
  if (size == 0 || size > self.budget) return nullptr;
  BlockPool& pool = size <= kSmallSize ? self.small_pool : self.large_pool;
  bool counted_retry = false;
  for (;;) {
    self.shortfall_bytes = std::numeric_limits<size_t>::max();
    self.shortfall_block = nullptr;
    Block* block = self.take_cached(pool, stream, size);                // rung 1
    if (block == nullptr) block = self.new_segment(pool, stream, size);  // rung 2
    if (block == nullptr) {                                              // rung 3
      if (!counted_retry) {
        ++self.stats.num_alloc_retries;
        counted_retry = true;
      }
      if (self.expandable) {
        if (self.shortfall_block != nullptr && self.recycle_pages_into(self.shortfall_block, size) > 0) {
          block = self.take_cached(pool, stream, size);
        }
        if (block == nullptr && self.release_free_pages(self.shortfall_bytes, self.shortfall_block, size) > 0) {
          block = self.take_cached(pool, stream, size);
        }
      } else if (self.release_free_segments() > 0) {
        block = self.new_segment(pool, stream, size);
      }
    }
    if (block == nullptr && &pool == &self.small_pool) {                // rung 3b
      // Near the budget a small request may find no small segment and no
      // room for one while large segments have free pieces: borrow one
      // rather than evict. The piece stays in the large pool (it merges back
      // there when freed); the remainder is split off at small granularity.
      block = self.large_pool.take_best_fit(stream, size);
      if (block != nullptr && !self.back_with_pages(block, size)) {
        self.large_pool.insert(block);
        block = nullptr;
      }
      if (block != nullptr && block->size - size >= kMinBlockSize) {
        self.large_pool.insert(self.large_pool.split(block, size));
      }
    }
    if (block != nullptr) return self.hand_out(block, bytes);

    Evictor* evictor = self.evictor;                                     // rung 4
    if (evictor == nullptr) return nullptr;
    ++self.stats.num_evictor_calls;
    lock.unlock();  // eviction deallocates through this allocator
    size_t freed = evictor->evict(size, stream);
    lock.lock();
    if (freed == 0) return nullptr;
    self.process_awaiting();
  }
}

void* CachingAllocator::try_allocate(size_t bytes, Stream stream) {
  if (bytes == 0) return nullptr;
  std::unique_lock<std::mutex> lock(impl_->mutex);
  return impl_->climb_ladder(bytes, stream, lock);
}

void* CachingAllocator::allocate(size_t bytes, Stream stream) {
  if (bytes == 0) return nullptr;
  Impl& self = *impl_;
  std::unique_lock<std::mutex> lock(self.mutex);
  if (void* ptr = self.climb_ladder(bytes, stream, lock)) return ptr;

  // Rung 5. The evictor is asked for its description without our lock held.
  ++self.stats.num_ooms;
  Evictor* evictor = self.evictor;
  std::string numbers = "membudget: out of memory on " + self.name + ": tried to allocate " +
                        format_bytes(bytes) + "; budget " + format_bytes(self.budget) +
                        ", reserved " + format_bytes(self.reserved_bytes.load()) +
                        ", allocated " + format_bytes(self.stats.allocated_current) +
                        ", free in cache " + format_bytes(self.free_cached_bytes()) + "; ";
  lock.unlock();
  std::string evictable = evictor != nullptr ? evictor->describe_evictable()
                                             : std::string("no evictor installed");
  throw OutOfMemory(numbers + evictable + ". " + kOomHint, bytes);
}

void CachingAllocator::deallocate(void* ptr) {
  if (ptr == nullptr) return;
  Impl& self = *impl_;
  std::lock_guard<std::mutex> lock(self.mutex);
  auto live = self.live_blocks.find(ptr);
  if (live == self.live_blocks.end()) self.throw_not_live("deallocate");
  Block* block = live->second;
  self.live_blocks.erase(live);
  block->allocated = false;
  self.stats.allocated_current -= block->size;
  self.stats.requested_current -= block->requested;
  --self.stats.num_live_blocks;
  // Note [Stream-ordered reuse]: one event per extra stream still using it.
  for (Stream user : block->stream_uses) {
    EventPtr event = self.backend.record(user);
    if (event->ready()) continue;
    ++block->pending_events;
    self.awaiting.emplace_back(std::move(event), block);
  }
  if (block->pending_events == 0) self.free_block(block);
}

void CachingAllocator::record_stream(void* ptr, Stream stream) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto live = impl_->live_blocks.find(ptr);
  if (live == impl_->live_blocks.end()) impl_->throw_not_live("record_stream");
  Block* block = live->second;
  if (stream == block->stream) return;
  auto& uses = block->stream_uses;
  if (std::find(uses.begin(), uses.end(), stream) == uses.end()) uses.push_back(stream);
}

size_t CachingAllocator::release_cached() {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->process_awaiting();
  return impl_->release_free_segments();
}

void CachingAllocator::set_budget(size_t budget_bytes) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->budget = budget_bytes;
  impl_->stats.budget = budget_bytes;
  impl_->process_awaiting();
  const size_t page = impl_->backend.segment_page_bytes(budget_bytes);
  if (!impl_->expandable_segments.empty() && impl_->fixed_segment_page == 0 && page != impl_->segment_page) {
    impl_->change_segment_page(page);  // Note [Host pages]
  } else if (impl_->reserved_bytes.load() > budget_bytes) {
    impl_->release_free_segments();
  }
}

bool CachingAllocator::expandable_segments() const { return impl_->expandable; }

size_t CachingAllocator::segment_page_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->expandable_segments.empty() ? 0 : impl_->segment_page;
}

size_t CachingAllocator::budget() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->budget;
}

void CachingAllocator::set_evictor(Evictor* evictor) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->evictor = evictor;
}

Evictor* CachingAllocator::evictor() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->evictor;
}

bool CachingAllocator::owns(const void* ptr) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->live_blocks.count(ptr) != 0;
}

size_t CachingAllocator::allocation_size(const void* ptr) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto it = impl_->live_blocks.find(ptr);
  return it == impl_->live_blocks.end() ? 0 : it->second->size;
}

size_t CachingAllocator::largest_free_or_reservable() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  size_t largest_free = 0;
  size_t releasable = 0;
  for (const BlockPool* pool : {&impl_->small_pool, &impl_->large_pool}) {
    for (const Block* block : pool->free_blocks()) {
      // An expandable segment's free blocks count only by what they give back
      // (Note [Expandable segments]); their unmapped pages need headroom.
      if (block->expandable == nullptr) largest_free = std::max(largest_free, block->size);
      releasable += Impl::releasable_bytes(block);
    }
  }
  size_t reserved = impl_->reserved_bytes.load();
  size_t unreserved = impl_->budget > reserved ? impl_->budget - reserved : 0;
  size_t reservable = (unreserved + releasable) / kMinBlockSize * kMinBlockSize;
  return std::max(largest_free, reservable);
}

size_t CachingAllocator::usable_range_at(const void* ptr) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  const size_t reserved = impl_->reserved_bytes.load();
  const size_t headroom = impl_->budget > reserved ? impl_->budget - reserved : 0;
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  auto segment = impl_->segments.upper_bound(address);
  if (segment == impl_->segments.begin()) return headroom;
  --segment;
  if (address >= segment->first + segment->second.size) return headroom;
  const Block* block = segment->second.head;
  while (block != nullptr && reinterpret_cast<uintptr_t>(block->ptr) + block->size <= address) block = block->next;
  if (block == nullptr) return 0;
  const bool counts_as_free = block->is_free() || (block->allocated && block->ptr == ptr);
  if (!counts_as_free) return 0;
  if (block->expandable != nullptr) {
    // Every free page can be unmapped and a request backed anywhere in the
    // range's tail, so what is usable is the headroom plus all free pages,
    // and the pages deallocating this block would free.
    size_t usable = headroom + impl_->free_cached_bytes();
    if (block->allocated) {
      const Block* first = block->prev != nullptr && block->prev->is_free() ? block->prev : block;
      const Block* last = block->next != nullptr && block->next->is_free() ? block->next : block;
      const size_t merged = static_cast<size_t>(last->ptr + last->size - first->ptr);
      size_t gained = block->expandable->mapped_bytes_inside(first->ptr, merged);
      if (first != block) gained -= Impl::releasable_bytes(first);
      if (last != block) gained -= Impl::releasable_bytes(last);
      usable += gained;
    }
    return usable;
  }
  size_t range = block->size;
  bool spans = block->spans_segment();
  if (block->allocated) {  // as if deallocated: merge with free neighbours
    const Block* first = block;
    const Block* last = block;
    if (block->prev != nullptr && block->prev->is_free()) {
      range += block->prev->size;
      first = block->prev;
    }
    if (block->next != nullptr && block->next->is_free()) {
      range += block->next->size;
      last = block->next;
    }
    spans = first->prev == nullptr && last->next == nullptr;
  }
  return spans ? range + headroom : range;
}

AllocatorStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  AllocatorStats result = impl_->stats;
  result.reserved_current = impl_->reserved_bytes.load();
  return result;
}

void CachingAllocator::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->stats.allocated_peak = impl_->stats.allocated_current;
  impl_->stats.reserved_peak = impl_->reserved_bytes.load();
}

void CachingAllocator::reset_counters() {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->stats.num_alloc_retries = 0;
  impl_->stats.num_ooms = 0;
  impl_->stats.num_evictor_calls = 0;
  impl_->stats.mapped_bytes_total = 0;
  impl_->stats.unmapped_bytes_total = 0;
  impl_->stats.moved_bytes_total = 0;
}

std::vector<SegmentInfo> CachingAllocator::snapshot() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  std::vector<SegmentInfo> result;
  result.reserve(impl_->segments.size());
  for (const auto& entry : impl_->segments) {
    SegmentInfo segment;
    segment.address = entry.first;
    segment.size = entry.second.size;
    segment.expandable = entry.second.expandable != nullptr;
    segment.mapped_bytes = segment.expandable ? entry.second.expandable->mapped_bytes() : entry.second.size;
    segment.page_bytes = segment.expandable ? entry.second.expandable->page_bytes() : 0;
    segment.retired = entry.second.retired;
    segment.small_pool = entry.second.head->pool->is_small();
    if (const ExpandableSegment* expandable = entry.second.expandable.get()) {
      const auto base = reinterpret_cast<uintptr_t>(expandable->base());
      for (const auto& [first, count] : expandable->mapped_runs_inside(expandable->base(), expandable->size())) {
        segment.mapped_ranges.emplace_back(base + first * expandable->page_bytes(), count * expandable->page_bytes());
      }
    } else {
      segment.mapped_ranges.emplace_back(segment.address, segment.size);
    }
    for (const Block* block = entry.second.head; block != nullptr; block = block->next) {
      BlockInfo info;
      info.address = reinterpret_cast<uintptr_t>(block->ptr);
      info.size = block->size;
      info.allocated = block->allocated;
      info.stream = block->stream;
      info.awaiting_events = !block->allocated && block->pending_events > 0;
      segment.blocks.push_back(info);
    }
    result.push_back(std::move(segment));
  }
  return result;
}

}  // namespace membudget
