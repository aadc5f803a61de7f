// ExpandableSegment: one reserved address range whose pages are mapped on
// demand, the allocator's side of Note [Expandable segments] (backend.h).
//
// The CachingAllocator cuts it into Blocks like any segment, but only pages
// under a live block must be backed: the pages wholly inside a free block can
// be unmapped and their bytes given back to the budget, and a request can be
// backed anywhere in the range, typically in its never-mapped tail. This is
// what removes the "free in cache exceeds the request, but no free range is
// large enough" failure of fixed segments. Not thread-safe: the allocator's
// mutex guards it (Note [Locking]).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "backend.h"

namespace membudget {

class ExpandableSegment {
 public:
  // Reserves `bytes` (rounded up to whole pages) from `backend`; check
  // base() for nullptr (the backend refused).
  ExpandableSegment(Backend& backend, size_t bytes);
  // Unmaps every mapped page and gives the range back.
  ~ExpandableSegment();
  ExpandableSegment(const ExpandableSegment&) = delete;
  ExpandableSegment& operator=(const ExpandableSegment&) = delete;

  char* base() const { return base_; }
  size_t size() const { return size_; }
  size_t page_bytes() const { return page_; }
  size_t mapped_bytes() const { return mapped_pages_ * page_; }

  // Bytes of the pages touching [ptr, ptr + bytes) that are not mapped: what
  // map_range would add to reserved memory.
  size_t unmapped_bytes_touching(const char* ptr, size_t bytes) const;
  // Whether every page touching [ptr, ptr + bytes) is mapped; stops at the
  // first that is not.
  bool fully_mapped(const char* ptr, size_t bytes) const;
  // Maps the unmapped pages touching [ptr, ptr + bytes). False when the
  // backend refuses; then nothing new stays mapped.
  bool map_range(const char* ptr, size_t bytes);
  // Bytes of mapped pages lying wholly inside [ptr, ptr + bytes): what
  // unmap_inside would release. Pages shared with a neighbouring block are
  // not wholly inside.
  size_t mapped_bytes_inside(const char* ptr, size_t bytes) const;
  // Unmaps them; returns the bytes released.
  size_t unmap_inside(const char* ptr, size_t bytes);

  // Page indices, ascending: the unmapped pages touching a range, and the
  // mapped pages wholly inside one (the two sides of a move).
  std::vector<size_t> unmapped_pages_touching(const char* ptr, size_t bytes) const;
  std::vector<size_t> mapped_pages_inside(const char* ptr, size_t bytes) const;
  // Moves the memory of `count` mapped pages from `from` (from_page on) to
  // unmapped pages of `to` (to_page on) through Backend::move_pages; reserved
  // memory does not change. False when the backend cannot; nothing changed.
  static bool move(ExpandableSegment& from, size_t from_page, ExpandableSegment& to, size_t to_page, size_t count);

 private:
  // Calls `run(first_page, page_count)` for each maximal run of pages in
  // [first, last) whose mapped state equals `mapped`.
  template <typename Run>
  void for_each_run(size_t first, size_t last, bool mapped, Run run) const;
  size_t page_index(const char* ptr) const { return static_cast<size_t>(ptr - base_) / page_; }

  Backend& backend_;
  const size_t page_;
  size_t size_ = 0;
  char* base_ = nullptr;
  // Mapped state per page, grown on demand: pages past its end were never
  // mapped, so the scans never walk the whole (device-sized) range.
  std::vector<bool> mapped_;
  size_t mapped_pages_ = 0;
};

}  // namespace membudget
