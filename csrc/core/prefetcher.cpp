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
  pressure_prefix_.assign(pressure_.size() + 1, 0);
  for (size_t i = 0; i < pressure_.size(); ++i) pressure_prefix_[i + 1] = pressure_prefix_[i] + (pressure_[i] ? 1 : 0);
}

void UnpackOrder::note_pressure() {
  const size_t position = current_.size();
  if (pressure_.size() <= position) pressure_.resize(position + 1, false);
  pressure_[position] = true;
  last_pressure_ = std::max(last_pressure_, static_cast<int64_t>(position));
}

void UnpackOrder::note_pressure_end() {
  last_pressure_ = std::max(last_pressure_, static_cast<int64_t>(current_.size()));
}

bool UnpackOrder::pressure_between(int64_t from, int64_t to) const {
  if (pressure_prefix_.size() < 2 || to < from) return false;
  const int64_t last = static_cast<int64_t>(pressure_prefix_.size()) - 1;  // positions [0, last)
  from = std::clamp<int64_t>(from, 0, last);
  to = std::clamp<int64_t>(to + 1, 0, last);
  return pressure_prefix_[static_cast<size_t>(to)] > pressure_prefix_[static_cast<size_t>(from)];
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
