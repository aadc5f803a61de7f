#include "block_pool.h"

#include "units.h"

namespace membudget {

Block* BlockPool::take_best_fit(Stream stream, size_t size) {
  Block key(nullptr, size, stream, this);
  auto it = free_blocks_.lower_bound(&key);
  if (it == free_blocks_.end() || (*it)->stream != stream) return nullptr;
  Block* block = *it;
  free_blocks_.erase(it);
  return block;
}

bool BlockPool::should_split(const Block* block, size_t size) const {
  size_t remaining = block->size - size;
  if (block->expandable != nullptr) return remaining >= kMinBlockSize;
  return small_ ? remaining >= kMinBlockSize : remaining > kSmallSize;
}

Block* BlockPool::split(Block* block, size_t size) {
  auto* remainder = new Block(block->ptr + size, block->size - size, block->stream, this);
  remainder->expandable = block->expandable;
  remainder->prev = block;
  remainder->next = block->next;
  if (remainder->next != nullptr) remainder->next->prev = remainder;
  block->next = remainder;
  block->size = size;
  return remainder;
}

// The lower-address block always survives a merge, so a segment's head Block
// is never deleted while the segment lives (see Block::is_segment_head).
Block* BlockPool::merge_free_neighbours(Block* block) {
  Block* next = block->next;
  if (next != nullptr && next->is_free()) {
    free_blocks_.erase(next);
    block->size += next->size;
    block->next = next->next;
    if (block->next != nullptr) block->next->prev = block;
    delete next;
  }
  Block* prev = block->prev;
  if (prev != nullptr && prev->is_free()) {
    free_blocks_.erase(prev);
    prev->size += block->size;
    prev->next = block->next;
    if (prev->next != nullptr) prev->next->prev = prev;
    delete block;
    block = prev;
  }
  return block;
}

}  // namespace membudget
