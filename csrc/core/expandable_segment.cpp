#include "expandable_segment.h"

#include <algorithm>
#include <iterator>

namespace membudget {

namespace {

// `wanted` when it is a whole number of the backend's pages (0: the backend's
// page); 0, which leaves the segment unreserved, otherwise.
size_t checked_page(const Backend& backend, size_t wanted) {
  const size_t unit = backend.page_bytes();
  if (unit == 0) return 0;
  if (wanted == 0) return unit;
  return wanted % unit == 0 ? wanted : 0;
}

}  // namespace

ExpandableSegment::ExpandableSegment(Backend& backend, size_t bytes, size_t page_bytes)
    : backend_(backend), page_(checked_page(backend, page_bytes)) {
  if (page_ == 0) return;
  size_ = (bytes + page_ - 1) / page_ * page_;
  base_ = static_cast<char*>(backend_.reserve_address_range(size_));
}

ExpandableSegment::~ExpandableSegment() {
  if (base_ == nullptr) return;
  for (const auto& run : runs_) backend_.unmap_pages(base_ + run.first * page_, (run.second - run.first) * page_);
  backend_.release_address_range(base_, size_);
}

std::pair<size_t, size_t> ExpandableSegment::pages_touching(const char* ptr, size_t bytes) const {
  const size_t offset = static_cast<size_t>(ptr - base_);
  return {offset / page_, (offset + bytes + page_ - 1) / page_};
}

std::pair<size_t, size_t> ExpandableSegment::pages_inside(const char* ptr, size_t bytes) const {
  const size_t offset = static_cast<size_t>(ptr - base_);
  return {(offset + page_ - 1) / page_, (offset + bytes) / page_};
}

template <typename Run>
void ExpandableSegment::for_each_run(size_t first, size_t last, bool mapped, Run run) const {
  if (first >= last) return;
  auto it = runs_.upper_bound(first);
  if (it != runs_.begin() && std::prev(it)->second > first) --it;
  size_t cursor = first;  // unmapped from here, up to the next run
  for (; it != runs_.end() && it->first < last; ++it) {
    const size_t start = std::max(it->first, first);
    const size_t end = std::min(it->second, last);
    if (mapped) {
      run(start, end - start);
    } else if (start > cursor) {
      run(cursor, start - cursor);
    }
    cursor = std::max(cursor, end);
  }
  if (!mapped && cursor < last) run(cursor, last - cursor);
}

void ExpandableSegment::set_mapped(size_t first, size_t last, bool mapped) {
  if (first >= last) return;
  auto it = runs_.upper_bound(first);
  if (it != runs_.begin() && std::prev(it)->second >= first) --it;
  size_t low = first;
  size_t high = last;
  std::vector<std::pair<size_t, size_t>> kept;  // pieces of runs outside [first, last) when unmapping
  while (it != runs_.end() && it->first <= last) {
    const bool overlaps = it->first < last && it->second > first;
    if (!mapped && !overlaps) {  // a neighbour that only touches: untouched
      ++it;
      continue;
    }
    if (mapped) {
      low = std::min(low, it->first);
      high = std::max(high, it->second);
    } else {
      if (it->first < first) kept.emplace_back(it->first, first);
      if (it->second > last) kept.emplace_back(last, it->second);
    }
    it = runs_.erase(it);
  }
  if (mapped) {
    runs_.emplace(low, high);
  } else {
    for (const auto& piece : kept) runs_.emplace(piece);
  }
}

size_t ExpandableSegment::unmapped_bytes_touching(const char* ptr, size_t bytes) const {
  const auto pages = pages_touching(ptr, bytes);
  size_t count = 0;
  for_each_run(pages.first, pages.second, false, [&count](size_t, size_t n) { count += n; });
  return count * page_;
}

bool ExpandableSegment::fully_mapped(const char* ptr, size_t bytes) const {
  const auto pages = pages_touching(ptr, bytes);
  auto it = runs_.upper_bound(pages.first);
  if (it == runs_.begin()) return false;
  --it;  // the run starting at or before the first page
  return it->first <= pages.first && it->second >= pages.second;
}

bool ExpandableSegment::map_range(const char* ptr, size_t bytes) {
  const auto pages = pages_touching(ptr, bytes);
  PageRuns runs;
  for_each_run(pages.first, pages.second, false, [&runs](size_t start, size_t n) { runs.emplace_back(start, n); });
  for (size_t i = 0; i < runs.size(); ++i) {
    if (backend_.map_pages(base_ + runs[i].first * page_, runs[i].second * page_)) continue;
    for (size_t undo = 0; undo < i; ++undo) {
      backend_.unmap_pages(base_ + runs[undo].first * page_, runs[undo].second * page_);
    }
    return false;
  }
  for (const auto& run : runs) {
    set_mapped(run.first, run.first + run.second, true);
    mapped_pages_ += run.second;
  }
  return true;
}

size_t ExpandableSegment::mapped_bytes_inside(const char* ptr, size_t bytes) const {
  const auto pages = pages_inside(ptr, bytes);
  size_t count = 0;
  for_each_run(pages.first, pages.second, true, [&count](size_t, size_t n) { count += n; });
  return count * page_;
}

size_t ExpandableSegment::unmap_inside(const char* ptr, size_t bytes) {
  const PageRuns runs = mapped_runs_inside(ptr, bytes);
  size_t released = 0;
  for (const auto& run : runs) {
    backend_.unmap_pages(base_ + run.first * page_, run.second * page_);
    set_mapped(run.first, run.first + run.second, false);
    mapped_pages_ -= run.second;
    released += run.second * page_;
  }
  return released;
}

ExpandableSegment::PageRuns ExpandableSegment::unmapped_runs_touching(const char* ptr, size_t bytes) const {
  const auto pages = pages_touching(ptr, bytes);
  PageRuns runs;
  for_each_run(pages.first, pages.second, false, [&runs](size_t start, size_t n) { runs.emplace_back(start, n); });
  return runs;
}

ExpandableSegment::PageRuns ExpandableSegment::mapped_runs_inside(const char* ptr, size_t bytes) const {
  const auto pages = pages_inside(ptr, bytes);
  PageRuns runs;
  for_each_run(pages.first, pages.second, true, [&runs](size_t start, size_t n) { runs.emplace_back(start, n); });
  return runs;
}

bool ExpandableSegment::move(ExpandableSegment& from, size_t from_page, ExpandableSegment& to, size_t to_page,
                             size_t count) {
  const size_t page = from.page_;
  if (page != to.page_) return false;  // pages of different sizes do not pair up
  if (!from.backend_.move_pages(from.base_ + from_page * page, to.base_ + to_page * page, count * page)) return false;
  from.set_mapped(from_page, from_page + count, false);
  from.mapped_pages_ -= count;
  to.set_mapped(to_page, to_page + count, true);
  to.mapped_pages_ += count;
  return true;
}

}  // namespace membudget
