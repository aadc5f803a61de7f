#include "core/prefetcher.h"

#include <algorithm>

namespace membudget {

void UnpackOrder::begin_iteration() {
  if (current_.empty()) return;
  previous_.swap(current_);
  current_.clear();
  previous_positions_.clear();
  for (size_t i = 0; i < previous_.size(); ++i) {
    previous_positions_[previous_[i]].push_back(static_cast<int64_t>(i));
  }
}

void UnpackOrder::record_unpack(uint64_t pack_seq) { current_.push_back(pack_seq); }

int64_t UnpackOrder::next_position(uint64_t pack_seq, int64_t from) const {
  auto it = previous_positions_.find(pack_seq);
  if (it == previous_positions_.end()) return -1;
  const auto& positions = it->second;  // ascending
  auto pos = std::lower_bound(positions.begin(), positions.end(), from);
  return pos == positions.end() ? -1 : *pos;
}

}  // namespace membudget
