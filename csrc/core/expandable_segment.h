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
#include <map>
#include <utility>
#include <vector>

#include "backend.h"

namespace membudget {

class ExpandableSegment {
 public:
  // Reserves `bytes` (rounded up to whole pages of `page_bytes`, a multiple
  // of backend.page_bytes(); 0: that) from `backend`; check base() for
  // nullptr (the backend refused).
  ExpandableSegment(Backend& backend, size_t bytes, size_t page_bytes = 0);
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

  // Runs of pages (first page, count), ascending: the unmapped runs touching
  // a range, and the mapped runs wholly inside one (the two sides of a move).
  using PageRuns = std::vector<std::pair<size_t, size_t>>;
  PageRuns unmapped_runs_touching(const char* ptr, size_t bytes) const;
  PageRuns mapped_runs_inside(const char* ptr, size_t bytes) const;
  // Moves the memory of `count` mapped pages from `from` (from_page on) to
  // unmapped pages of `to` (to_page on) through Backend::move_pages; reserved
  // memory does not change. False when the backend cannot; nothing changed.
  static bool move(ExpandableSegment& from, size_t from_page, ExpandableSegment& to, size_t to_page, size_t count);

 private:
  // Calls `run(first_page, page_count)` for each maximal run of pages in
  // [first, last) whose mapped state equals `mapped`.
  template <typename Run>
  void for_each_run(size_t first, size_t last, bool mapped, Run run) const;
  // Records [first, last) as mapped or unmapped, merging runs.
  void set_mapped(size_t first, size_t last, bool mapped);
  size_t page_index(const char* ptr) const { return static_cast<size_t>(ptr - base_) / page_; }
  // [first, last) pages touching the byte range, and those wholly inside it.
  std::pair<size_t, size_t> pages_touching(const char* ptr, size_t bytes) const;
  std::pair<size_t, size_t> pages_inside(const char* ptr, size_t bytes) const;

  Backend& backend_;
  const size_t page_;
  size_t size_ = 0;
  char* base_ = nullptr;
  // The mapped pages as maximal runs, first page -> one past the last:
  // every query and update costs O(log runs + runs it overlaps), not a walk
  // over the pages of a block (a 256 MiB block is 65536 host pages).
  std::map<size_t, size_t> runs_;
  size_t mapped_pages_ = 0;
};

}  // namespace membudget
