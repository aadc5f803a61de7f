// UnpackOrder: what the prefetcher and the delta filter know of the future.
// Backward unpacks saved tensors in the same order every iteration, so the
// order recorded in the previous iteration predicts the next use of each
// tensor (identified by its pack sequence number within the iteration).
#pragma once
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace membudget {

class UnpackOrder {
 public:
  // Starts a new iteration: the order recorded so far becomes the prediction
  // (kept as it was when the new iteration recorded nothing yet).
  void begin_iteration();
  void record_unpack(uint64_t pack_seq);

  bool has_prediction() const { return !previous_.empty(); }
  // Unpacks recorded so far in this iteration.
  int64_t current_position() const { return static_cast<int64_t>(current_.size()); }
  // Predicted position of the next unpack of `pack_seq` at or after `from`;
  // -1 when the previous iteration never unpacked it after that point.
  int64_t next_position(uint64_t pack_seq, int64_t from) const;
  // Length of the previous iteration's order.
  int64_t predicted_length() const { return static_cast<int64_t>(previous_.size()); }
  // Pack sequence number at a predicted position (0 <= position < length).
  uint64_t predicted_at(int64_t position) const { return previous_[static_cast<size_t>(position)]; }

  // Note [Eviction pressure]: backward evicted to make room at the current
  // position. Marks are kept across iterations (a position once short of
  // memory stays marked until the prediction is reset), so that a choice
  // made because a range looked free cannot, by filling it, hide the
  // pressure it caused from the next iteration and oscillate.
  void note_pressure();
  // Only moves where pressure ends (last_pressure_position), for an
  // eviction that leaves no mark for replays ahead (Note [Pressure end
  // without a mark] in residency_evict.cpp).
  void note_pressure_end();
  // Whether any position in [from, to] was ever marked.
  bool pressure_between(int64_t from, int64_t to) const;
  // The last position ever marked (-1: none): where backward's pressure
  // ends (Note [Pressure horizon] in policy/filters.h).
  int64_t last_pressure_position() const { return last_pressure_; }

 private:
  std::vector<uint64_t> previous_;
  std::unordered_map<uint64_t, std::vector<int64_t>> previous_positions_;
  std::vector<uint64_t> current_;
  std::vector<int64_t> pressure_prefix_;  // pressure_prefix_[i]: marked positions before i (+1 sentinel)
  std::vector<bool> pressure_;            // marks of every iteration so far, by position
  int64_t last_pressure_ = -1;            // the last true index of pressure_
};

}  // namespace membudget
