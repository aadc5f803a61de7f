// Blocks and free-block pools of CachingAllocator (DESIGN.md "The core", step
// 2). A segment is one buffer from the backend; it is cut into Blocks that form
// a doubly linked list in address order. Free blocks wait in a BlockPool,
// ordered for best-fit search. Nothing here locks: the allocator's mutex
// guards every Block and BlockPool (Note [Locking] in caching_allocator.h).
#pragma once
#include <cstddef>
#include <set>
#include <vector>

#include "event.h"

namespace membudget {

class BlockPool;
class ExpandableSegment;

// One contiguous piece of a segment, allocated to a caller or free.
//
// Note [Block states]: a Block is in exactly one of three states.
//   allocated:  handed out by allocate(); allocated == true.
//   awaiting:   deallocated, but events on the extra streams that used it
//               (record_stream) are not complete; pending_events > 0. It is in
//               no pool and never merges, so its memory is not reused early.
//   free:       in its pool; may be split, merged, or returned to the backend
//               when it spans its whole segment.
struct Block {
  Block(char* ptr_, size_t size_, Stream stream_, BlockPool* pool_)
      : ptr(ptr_), size(size_), stream(stream_), pool(pool_) {}

  char* ptr;
  size_t size;            // a multiple of kMinBlockSize
  size_t requested = 0;   // what the caller asked for, while allocated
  Stream stream;          // the stream it was allocated on; reused only there
  BlockPool* pool;
  bool allocated = false;
  int pending_events = 0;
  // The segment, when it is an expandable one (Note [Expandable segments]);
  // nullptr in a fixed segment.
  ExpandableSegment* expandable = nullptr;
  Block* prev = nullptr;  // neighbours within the segment
  Block* next = nullptr;
  std::vector<Stream> stream_uses;  // extra streams from record_stream

  bool is_free() const { return !allocated && pending_events == 0; }
  // The first block of a segment is never deleted by split or merge, so it
  // names its segment for the segment's whole life.
  bool is_segment_head() const { return prev == nullptr; }
  bool spans_segment() const { return prev == nullptr && next == nullptr; }
};

// Best-fit order: by stream, then size, then address, so that lower_bound on
// (stream, size) finds the smallest block of that stream that fits.
struct BlockOrder {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->size != b->size) return a->size < b->size;
    return a->ptr < b->ptr;
  }
};

// The free blocks of one size class (small or large), with the split and merge
// rules of that class.
class BlockPool {
 public:
  using FreeBlocks = std::set<Block*, BlockOrder>;

  explicit BlockPool(bool small) : small_(small) {}

  // Whether this pool serves requests of at most kSmallSize.
  bool is_small() const { return small_; }

  // Removes and returns the smallest free block on `stream` of at least
  // `size` bytes, or nullptr. O(log n).
  Block* take_best_fit(Stream stream, size_t size);

  // Adds a free block; the caller has merged it with its neighbours.
  void insert(Block* block) { free_blocks_.insert(block); }
  void erase(Block* block) { free_blocks_.erase(block); }

  // Whether what remains after cutting `size` bytes from `block` is worth a
  // block of its own: any remainder of at least kMinBlockSize in the small
  // pool, more than kSmallSize in the large pool (a smaller remainder of a
  // large block would only fragment it; PyTorch's rule). In an expandable
  // segment any remainder is split off: its pages can be unmapped, so it
  // costs nothing, while leaving it in the block would hold up to 1 MiB
  // mapped for nothing.
  bool should_split(const Block* block, size_t size) const;

  // Cuts `block` to `size` bytes and returns the new free remainder that
  // follows it in the segment; the remainder is not yet in the pool.
  Block* split(Block* block, size_t size);

  // Merges the free block `block` with its free neighbours, removing them from
  // this pool and deleting their Block objects. Returns the merged block,
  // which is `block` or its former predecessor; it is not yet in the pool.
  Block* merge_free_neighbours(Block* block);

  const FreeBlocks& free_blocks() const { return free_blocks_; }

 private:
  FreeBlocks free_blocks_;
  bool small_;
};

}  // namespace membudget
