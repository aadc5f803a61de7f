#include "expandable_segment.h"

#include <algorithm>

namespace membudget {

ExpandableSegment::ExpandableSegment(Backend& backend, size_t bytes)
    : backend_(backend), page_(backend.page_bytes()) {
  if (page_ == 0) return;
  size_ = (bytes + page_ - 1) / page_ * page_;
  base_ = static_cast<char*>(backend_.reserve_address_range(size_));
}

ExpandableSegment::~ExpandableSegment() {
  if (base_ == nullptr) return;
  for_each_run(0, mapped_.size(), true, [this](size_t first, size_t count) {
    backend_.unmap_pages(base_ + first * page_, count * page_);
  });
  backend_.release_address_range(base_, size_);
}

template <typename Run>
void ExpandableSegment::for_each_run(size_t first, size_t last, bool mapped, Run run) const {
  size_t page = first;
  while (page < last) {
    const bool state = page < mapped_.size() && mapped_[page];
    if (state != mapped) {
      ++page;
      continue;
    }
    size_t end = page + 1;
    while (end < last && (end < mapped_.size() && mapped_[end]) == mapped) ++end;
    run(page, end - page);
    page = end;
  }
}

size_t ExpandableSegment::unmapped_bytes_touching(const char* ptr, size_t bytes) const {
  const size_t first = page_index(ptr);
  const size_t last = (static_cast<size_t>(ptr - base_) + bytes + page_ - 1) / page_;
  size_t count = 0;
  for_each_run(first, last, false, [&count](size_t, size_t pages) { count += pages; });
  return count * page_;
}

bool ExpandableSegment::fully_mapped(const char* ptr, size_t bytes) const {
  const size_t first = page_index(ptr);
  const size_t last = (static_cast<size_t>(ptr - base_) + bytes + page_ - 1) / page_;
  if (last > mapped_.size()) return false;
  for (size_t page = first; page < last; ++page) {
    if (!mapped_[page]) return false;
  }
  return true;
}

bool ExpandableSegment::map_range(const char* ptr, size_t bytes) {
  const size_t first = page_index(ptr);
  const size_t last = (static_cast<size_t>(ptr - base_) + bytes + page_ - 1) / page_;
  std::vector<std::pair<size_t, size_t>> runs;
  for_each_run(first, last, false, [&runs](size_t start, size_t count) { runs.emplace_back(start, count); });
  for (size_t i = 0; i < runs.size(); ++i) {
    if (backend_.map_pages(base_ + runs[i].first * page_, runs[i].second * page_)) continue;
    for (size_t undo = 0; undo < i; ++undo) {
      backend_.unmap_pages(base_ + runs[undo].first * page_, runs[undo].second * page_);
    }
    return false;
  }
  if (mapped_.size() < last) mapped_.resize(last, false);
  for (const auto& run : runs) {
    std::fill_n(mapped_.begin() + static_cast<std::ptrdiff_t>(run.first), run.second, true);
    mapped_pages_ += run.second;
  }
  return true;
}

size_t ExpandableSegment::mapped_bytes_inside(const char* ptr, size_t bytes) const {
  const size_t offset = static_cast<size_t>(ptr - base_);
  const size_t first = (offset + page_ - 1) / page_;
  const size_t last = std::min((offset + bytes) / page_, mapped_.size());
  size_t count = 0;
  for_each_run(first, last, true, [&count](size_t, size_t pages) { count += pages; });
  return count * page_;
}

size_t ExpandableSegment::unmap_inside(const char* ptr, size_t bytes) {
  const size_t offset = static_cast<size_t>(ptr - base_);
  const size_t first = (offset + page_ - 1) / page_;
  const size_t last = std::min((offset + bytes) / page_, mapped_.size());
  size_t released = 0;
  for_each_run(first, last, true, [this, &released](size_t start, size_t count) {
    backend_.unmap_pages(base_ + start * page_, count * page_);
    std::fill_n(mapped_.begin() + static_cast<std::ptrdiff_t>(start), count, false);
    mapped_pages_ -= count;
    released += count * page_;
  });
  return released;
}

std::vector<size_t> ExpandableSegment::unmapped_pages_touching(const char* ptr, size_t bytes) const {
  const size_t first = page_index(ptr);
  const size_t last = (static_cast<size_t>(ptr - base_) + bytes + page_ - 1) / page_;
  std::vector<size_t> pages;
  for_each_run(first, last, false, [&pages](size_t start, size_t count) {
    for (size_t page = start; page < start + count; ++page) pages.push_back(page);
  });
  return pages;
}

std::vector<size_t> ExpandableSegment::mapped_pages_inside(const char* ptr, size_t bytes) const {
  const size_t offset = static_cast<size_t>(ptr - base_);
  const size_t first = (offset + page_ - 1) / page_;
  const size_t last = std::min((offset + bytes) / page_, mapped_.size());
  std::vector<size_t> pages;
  for_each_run(first, last, true, [&pages](size_t start, size_t count) {
    for (size_t page = start; page < start + count; ++page) pages.push_back(page);
  });
  return pages;
}

bool ExpandableSegment::move(ExpandableSegment& from, size_t from_page, ExpandableSegment& to, size_t to_page,
                             size_t count) {
  const size_t page = from.page_;
  if (!from.backend_.move_pages(from.base_ + from_page * page, to.base_ + to_page * page, count * page)) return false;
  std::fill_n(from.mapped_.begin() + static_cast<std::ptrdiff_t>(from_page), count, false);
  from.mapped_pages_ -= count;
  if (to.mapped_.size() < to_page + count) to.mapped_.resize(to_page + count, false);
  std::fill_n(to.mapped_.begin() + static_cast<std::ptrdiff_t>(to_page), count, true);
  to.mapped_pages_ += count;
  return true;
}

}  // namespace membudget
