// ResidencyManager, part three: replaying dropped entries ahead of their use
// (Note [Recompute ahead] in residency_entry.h). The prefetcher queues them;
// the binding (or the simulator) replays them, because only it can run the
// recorded ops. Private methods assume mutex_ is held; public ones take it.
#include <algorithm>
#include <limits>

#include "core/residency_manager.h"

namespace membudget {
namespace {

// An eviction horizon no entry's next use lies beyond: candidates() offers
// nothing, so the replay's allocations fit into free memory or fail.
constexpr int64_t kEvictNothing = std::numeric_limits<int64_t>::max();
// How far ahead, in predicted unpacks, a dropped entry may be rebuilt. Far
// enough for a replay to finish on a side stream before its use, near enough
// that what it holds is not what backward needs meanwhile. Measured in the
// simulator (h200, delta; bench/RESULTS.md "Recompute ahead"): at 2, ResNet-50
// at 40% replayed nothing ahead; at 32 or unlimited it took 1.017x / 1.029x
// the step time at overlap 0 (8: 1.003x). BERT at 40% with recompute only
// loses 7.8% at 8 and at 32 (not at 2): later evictions drop more.
constexpr int64_t kMaxAheadUnpacks = 8;

}  // namespace

void ResidencyManager::queue_replays_ahead(int64_t now, size_t window) {
  const int64_t end = std::min(order_.predicted_length(), now + 1 + kMaxAheadUnpacks);
  for (int64_t cursor = now; cursor < end; ++cursor) {
    if (prefetch_outstanding_bytes_ >= window) return;
    const uint64_t seq = order_.predicted_at(cursor);
    ResidencyEntry* entry = seq < by_seq_.size() ? by_seq_[seq] : nullptr;
    if (entry == nullptr || entry->state_ != Residency::dropped || !may_recompute_ahead(entry)) continue;
    // Note [Eviction pressure]: where backward had to evict before this use,
    // memory held from now until then displaces an entry that is dropped in
    // its place and replayed again: no saving at best, a second replay at
    // worst (simulated, h200, BERT at 40% with recompute only: 57 replays
    // ahead cost 42 more replays, 1.078x the step time at overlap 0).
    if (order_.pressure_between(now, cursor)) return;
    if (prefetch_outstanding_bytes_ > 0 && prefetch_outstanding_bytes_ + entry->bytes() > window) return;
    // Only into free memory: evicting for it (even entries needed later)
    // drops more than it rebuilds (measured in the simulator: GPT-2 at 70%
    // recomputed 34 tensors instead of 9).
    if (device_.largest_free_or_reservable() < entry->bytes()) return;
    queue_recompute_ahead(entry);
  }
}

bool ResidencyManager::may_recompute_ahead(const ResidencyEntry* entry) const {
  if (!config_.recompute_ahead || !allowed_.recompute || !entry->recomputable_) return false;
  if (!held_inputs_present(entry)) return false;  // Note [Held inputs freed under us]
  // Only a replay that reads resident inputs: rebuilding dropped ancestors or
  // swapping inputs in ahead would chain work (and memory) the window did not
  // count, and an input rebuilt on the way would count as an unpack.
  for (uint64_t id : entry->inputs_) {
    const ResidencyEntry* input = find(id);
    if (input == nullptr) continue;  // gone: the lineage reads it elsewhere
    if (input->state_ != Residency::resident && input->state_ != Residency::swapping_out) return false;
  }
  return true;
}

void ResidencyManager::queue_recompute_ahead(ResidencyEntry* entry) {
  entry->state_ = Residency::recomputing;
  ++entry->pins_;  // released by complete_recompute_ahead, or by unpin() after an on-demand replay
  entry->ahead_queued_ = true;
  entry->prefetched_ = true;
  prefetch_outstanding_bytes_ += entry->bytes();
  ahead_queue_.push_back(entry);
  ahead_pending_.store(true, std::memory_order_relaxed);
}

void ResidencyManager::unqueue_recompute_ahead(ResidencyEntry* entry) {
  if (!entry->ahead_queued_) return;
  entry->ahead_queued_ = false;
  ahead_queue_.erase(std::remove(ahead_queue_.begin(), ahead_queue_.end(), entry), ahead_queue_.end());
  ahead_pending_.store(!ahead_queue_.empty(), std::memory_order_relaxed);
}

void ResidencyManager::note_evicted_before_use(ResidencyEntry* entry) {
  if (!entry->recomputed_ahead_) return;
  entry->recomputed_ahead_ = false;
  ++counters_.recompute_ahead_wasted;
}

std::vector<uint64_t> ResidencyManager::take_recompute_ahead() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  std::vector<uint64_t> ids;
  ids.reserve(ahead_queue_.size());
  for (const ResidencyEntry* entry : ahead_queue_) ids.push_back(entry->id());
  // The entries stay queued (ahead_queued_) until begun or unpacked; only the
  // list is handed over.
  ahead_queue_.clear();
  ahead_pending_.store(false, std::memory_order_relaxed);
  return ids;
}

bool ResidencyManager::begin_recompute_ahead(ResidencyEntry* entry) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!entry->registered_ || !entry->ahead_queued_ || entry->state_ != Residency::recomputing) return false;
  entry->ahead_queued_ = false;
  ++replays_in_progress_;  // Note [Replay inputs]
  // Its replay may use free memory only: no entry is "needed later" than this.
  eviction_horizon_ = kEvictNothing;
  return true;
}

void ResidencyManager::complete_recompute_ahead(ResidencyEntry* entry, bool succeeded, double seconds,
                                                EventPtr ready) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (replays_in_progress_ > 0) --replays_in_progress_;
  eviction_horizon_ = -1;
  --entry->pins_;
  if (!succeeded) {
    entry->state_ = Residency::dropped;
    clear_prefetch(entry);
    ++counters_.recompute_ahead_failed;
    return;
  }
  note_rebuilt(entry, seconds);
  ++counters_.recomputed_ahead_count;
  entry->recomputed_ahead_ = true;
  if (ready && !ready->ready()) {
    entry->copy_event_ = std::move(ready);  // finish_copy() makes it resident
    in_flight_.push_back(entry);
  } else {
    entry->state_ = Residency::resident;
  }
}

bool ResidencyManager::copy_pending(ResidencyEntry* entry) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  return entry->registered_ && entry->state_ == Residency::swapping_in && entry->copy_event_ &&
         !entry->copy_event_->ready();
}

}  // namespace membudget
