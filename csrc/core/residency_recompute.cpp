// ResidencyManager, part two: dropping entries for recomputation, the
// director's inputs, and the measurements they rest on (Note [Recompute] in
// residency_entry.h). Every private method here assumes mutex_ is held.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <unordered_set>
#include <utility>

#include "core/residency_manager.h"
#include "core/units.h"

namespace membudget {
namespace {

// Weight of the newest sample in the moving averages of link bandwidth and
// pack/unpack intervals.
constexpr double kEmaWeight = 0.25;
// Copies this short measure latency, not bandwidth.
constexpr double kMinTimedCopySeconds = 20e-6;
// A gap this long between two packs (or unpacks) is not an op interval.
constexpr double kMaxIntervalSeconds = 1.0;

void ema(double& average, double sample) {
  average = average == 0.0 ? sample : (1.0 - kEmaWeight) * average + kEmaWeight * sample;
}

}  // namespace

ResidencyEntry* ResidencyManager::find(uint64_t id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second;
}

void ResidencyManager::set_recompute_info(ResidencyEntry* entry, bool recomputable, double replay_seconds,
                                          const std::vector<uint64_t>& input_ids, std::string reason,
                                          HeldInputs held) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!entry->registered_) return;
  entry->recomputable_ = recomputable;
  entry->held_inputs_ = recomputable ? std::move(held) : HeldInputs{};
  entry->unrecomputable_reason_ = recomputable ? std::string() : std::move(reason);
  entry->replay_seconds_ = std::max(replay_seconds, 0.0);
  if (!entry->held_inputs_.empty() && !entry->held_watched_) {  // Note [Writes that refill a freed input]
    entry->held_watched_ = true;
    watched_resident_.push_back(entry->id());
  }
  entry->inputs_.clear();
  for (uint64_t id : input_ids) {
    ResidencyEntry* input = find(id);
    if (input == nullptr || input == entry) continue;
    entry->inputs_.push_back(id);
    input->dependents_.push_back(entry->id());
  }
}

bool ResidencyManager::any_in_rebuild(const ResidencyEntry* entry, bool (*test)(const ResidencyEntry*),
                                      bool every_ancestor) const {
  std::vector<const ResidencyEntry*> pending{entry};
  std::vector<uint64_t> visited{entry->id()};
  while (!pending.empty()) {
    const ResidencyEntry* at = pending.back();
    pending.pop_back();
    if (test(at)) return true;
    for (uint64_t id : at->inputs_) {
      if (std::find(visited.begin(), visited.end(), id) != visited.end()) continue;
      visited.push_back(id);
      const ResidencyEntry* input = find(id);
      if (input != nullptr && (every_ancestor || input->state_ == Residency::dropped)) pending.push_back(input);
    }
  }
  return false;
}

bool ResidencyManager::replayable_now(const ResidencyEntry* entry) const {
  // A dropped input is rebuilt by this replay: its own held inputs are read too.
  return !any_in_rebuild(entry, [](const ResidencyEntry* at) {
    return !at->recomputable_ || !held_inputs_present(at);
  });
}

bool ResidencyManager::held_inputs_present(const ResidencyEntry* entry) {
  for (const auto& held : entry->held_inputs_) {
    if (!held->present()) return false;
  }
  return true;
}

void ResidencyManager::note_held_freed(ResidencyEntry* entry) {
  entry->held_lost_ = true;
  held_freed_seen_ = true;
}

void ResidencyManager::watch(std::vector<uint64_t>& watched, bool (*watching)(const ResidencyEntry*)) {
  for (size_t i = 0; i < watched.size();) {
    ResidencyEntry* entry = find(watched[i]);
    const bool still = entry != nullptr && watching(entry);
    if (still && held_inputs_present(entry)) {
      ++i;
      continue;
    }
    if (still) note_held_freed(entry);
    watched[i] = watched.back();
    watched.pop_back();
  }
}

void ResidencyManager::watch_held_inputs() {
  watch(watched_drops_, [](const ResidencyEntry* entry) { return entry->state_ == Residency::dropped; });
  if (!held_freed_seen_) return;
  // Not dropped: a drop watches it in watched_drops_ from then on.
  watch(watched_resident_, [](const ResidencyEntry* entry) {
    return entry->recomputable_ && !entry->held_lost_ && entry->state_ != Residency::dropped &&
           entry->state_ != Residency::recomputing;
  });
}

bool ResidencyManager::reads_refilled_input(ResidencyEntry* entry) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!entry->registered_) return false;
  watch_held_inputs();
  // Note [Writes that refill a freed input]: the entry in any state, and
  // every managed ancestor: the recorders rescue an entry for a write its
  // replay reaches only through a resident input (which a later drop would
  // make it rebuild), and that input read the freed storage.
  return any_in_rebuild(entry, [](const ResidencyEntry* at) { return at->held_lost_; }, /*every_ancestor=*/true);
}

bool ResidencyManager::plan_drop(ResidencyEntry* entry) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!entry->registered_ || !entry->recomputable_ || !allowed_.recompute) return false;
  if (std::find(planned_.begin(), planned_.end(), entry) == planned_.end()) planned_.push_back(entry);
  return true;
}

void ResidencyManager::drop_planned_now() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  drop_planned();
}

void ResidencyManager::drop_planned() {
  for (size_t i = 0; i < planned_.size();) {
    ResidencyEntry* entry = planned_[i];
    if (!entry->recomputable_) {
      // Declared unrecomputable since it was planned (rescued, or a second
      // history found for its storage: Note [One history per storage]).
      planned_.erase(planned_.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (entry->state_ == Residency::resident && !entry->host_valid_ && is_evictable(entry) &&
               replayable_now(entry)) {
      planned_.erase(planned_.begin() + static_cast<std::ptrdiff_t>(i));
      drop_for_recompute(entry);
      ++counters_.planned_drops;
    } else if (entry->state_ != Residency::resident) {
      planned_.erase(planned_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
}

double ResidencyManager::recompute_total(const ResidencyEntry* entry, std::vector<uint64_t>& visited,
                                         int* replays) const {
  // Its own replay plus the replays of dropped inputs it would trigger, each
  // counted once (a diamond of dropped ancestors replays every node once).
  double total = entry->replay_seconds_ + std::max(replay_overhead_s_, 0.0);
  if (replays != nullptr) ++*replays;
  visited.push_back(entry->id());
  for (uint64_t id : entry->inputs_) {
    if (std::find(visited.begin(), visited.end(), id) != visited.end()) continue;
    const ResidencyEntry* input = find(id);
    if (input == nullptr) continue;
    if (input->state_ == Residency::dropped) {
      total += recompute_total(input, visited, replays);
    } else if (input->state_ == Residency::host) {
      total += static_cast<double>(input->bytes()) / link_bytes_per_s_;
      visited.push_back(id);
    }
  }
  return total;
}

std::vector<uint64_t> ResidencyManager::dropped_neighbours(const ResidencyEntry* entry) const {
  std::vector<uint64_t> result;
  for (const auto* ids : {&entry->inputs_, &entry->dependents_}) {
    for (uint64_t id : *ids) {
      const ResidencyEntry* other = find(id);
      if (other != nullptr && other->state_ == Residency::dropped) result.push_back(id);
    }
  }
  return result;
}

double ResidencyManager::seconds_until_next_use(const EvictionCandidate& c) const {
  // Unpacks until its use, at the measured pace of backward; during forward,
  // plus what remains of forward at the measured pace of packs.
  int64_t unpacks = c.next_use_distance >= 0
                        ? c.next_use_distance
                        : static_cast<int64_t>(packs_this_iteration_ - std::min(packs_this_iteration_, c.pack_seq));
  double seconds = static_cast<double>(unpacks) * unpack_interval_s_;
  if (!unpacked_since_pack_ && packs_last_iteration_ > packs_this_iteration_) {
    seconds += static_cast<double>(packs_last_iteration_ - packs_this_iteration_) * pack_interval_s_;
  }
  return seconds;
}

double ResidencyManager::seconds_of_pressure() const {
  // Note [Pressure horizon] (policy/filters.h): only backward knows where its
  // pressure ends; the marks are kept across iterations, so the end is the
  // latest any backward has needed so far.
  if (!order_.has_prediction() || !unpacked_since_pack_) return -1.0;
  const int64_t now = order_.current_position();
  return static_cast<double>(std::max<int64_t>(order_.last_pressure_position() - now, 0)) * unpack_interval_s_;
}

Decision ResidencyManager::decide_for(const ResidencyEntry* entry, const EvictionCandidate& c,
                                      const CopyInBacklog* backlog) const {
  VictimFacts facts;
  facts.bytes = entry->bytes();
  facts.host_valid = entry->host_valid_;
  facts.copy_out_in_flight = entry->state_ == Residency::swapping_out;
  facts.host_room = entry->host_copy_ != nullptr ||
                    host_tier_.stats().reserved_current + entry->bytes() <= host_tier_.budget() ||
                    host_tier_.largest_free_or_reservable() >= entry->bytes();
  facts.recomputable = c.recomputable;
  facts.recompute_seconds = c.recompute_seconds;
  facts.link_bytes_per_s = link_bytes_per_s_;
  bool own_copy_reached = false;
  for (const ResidencyEntry* busy : in_flight_) {
    // An entry whose own copy-out is under way waits only for the copies
    // queued before it and its own (counted as facts.bytes).
    if (busy == entry) own_copy_reached = true;
    if (busy->state_ == Residency::swapping_out && !own_copy_reached) facts.d2h_queued_bytes += busy->bytes();
    if (busy->state_ == Residency::swapping_in) facts.h2d_queued_bytes += busy->bytes();
    // (a replay ahead on a side stream, recomputing, is no copy)
  }
  facts.seconds_until_next_use = seconds_until_next_use(c);
  if (backlog != nullptr && c.next_use_distance >= 0 && unpack_interval_s_ > 0.0) {
    facts.copy_in_stall_seconds =
        backlog->added_stall_seconds(seconds_available_for_copy_in(c.next_use_distance), entry->bytes());
  }
  return decide(facts, allowed_);
}

size_t ResidencyManager::drop_for_recompute(ResidencyEntry* entry) {
  finish_copy_out_in_flight(entry);
  entry->drop_device_copy();
  entry->state_ = Residency::dropped;
  // Note [Writes that refill a freed input] (residency_entry.h): dropped
  // only with its held inputs there (replayable_now).
  entry->held_lost_ = false;
  if (!entry->held_inputs_.empty()) watched_drops_.push_back(entry->id());
  clear_prefetch(entry);
  note_evicted_before_use(entry);
  if (entry->host_copy_ != nullptr && !entry->host_valid_) {
    host_tier_.deallocate(entry->host_copy_);
    entry->host_copy_ = nullptr;
  }
  // Classes never split (DTR's approximation); starting afresh whenever
  // nothing is dropped keeps them from spanning iterations.
  if (dropped_entries_ == 0) neighbourhoods_.clear();
  ++dropped_entries_;
  neighbourhoods_.add(entry->id(), entry->replay_seconds_, dropped_neighbours(entry));
  counters_.evicted_bytes += entry->bytes();
  evicted_this_iteration_ += entry->bytes();
  ++counters_.eviction_count;
  ++counters_.drop_count;
  return entry->bytes();
}

void ResidencyManager::complete_recompute(ResidencyEntry* entry, bool succeeded, double seconds) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (replays_in_progress_ > 0) --replays_in_progress_;
  if (!succeeded) {
    entry->state_ = Residency::dropped;
    --entry->pins_;
    return;
  }
  entry->state_ = Residency::resident;
  note_rebuilt(entry, seconds);
  const double waits = blocked_seconds_ - entry->replay_blocked_start_s_;
  // The outermost replay of a chain times the inner ones too (Note [Pace of
  // backward's own ops], Note [Nested replays are timed once]).
  if (replays_in_progress_ == 0) replayed_seconds_ += std::max(seconds - waits, 0.0);
  if (entry->replay_chain_ > 0) {
    // Note [Replay overhead]: beyond the estimate and the waits for copies
    // in between (its inputs' swap-ins, its allocation's evictions: their
    // cost is priced where they are chosen), per replay of the chain.
    const double sample = (seconds - waits - entry->replay_estimate_s_) / entry->replay_chain_;
    replay_overhead_s_ = (1.0 - kEmaWeight) * replay_overhead_s_ + kEmaWeight * sample;
    entry->replay_chain_ = 0;
  }
}

std::vector<ResidencyManager::ReplayStep> ResidencyManager::replay_order(const ResidencyEntry* entry) const {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  // Depth-first, post-order, with an explicit stack: the chains this is for
  // are thousands of entries deep (Note [Dropped ancestors rebuilt in order]).
  std::vector<ReplayStep> order;
  std::unordered_set<uint64_t> seen{entry->id()};
  std::vector<std::pair<const ResidencyEntry*, size_t>> stack{{entry, 0}};
  while (!stack.empty()) {
    const ResidencyEntry* node = stack.back().first;
    const size_t next = stack.back().second;
    if (next < node->inputs_.size()) {
      ++stack.back().second;
      const uint64_t id = node->inputs_[next];
      const ResidencyEntry* input = find(id);
      if (input != nullptr && input->state_ == Residency::dropped && seen.insert(id).second) {
        stack.emplace_back(input, 0);
      }
      continue;
    }
    order.push_back({node->id(), node->inputs_});
    stack.pop_back();
  }
  return order;
}

void ResidencyManager::begin_replay_estimate(ResidencyEntry* entry) {
  std::vector<uint64_t> visited;
  int replays = 0;
  const double total = recompute_total(entry, visited, &replays);
  entry->replay_estimate_s_ = total - std::max(replay_overhead_s_, 0.0) * replays;
  entry->replay_chain_ = replays;
  entry->replay_blocked_start_s_ = blocked_seconds_;
}

void ResidencyManager::note_rebuilt(ResidencyEntry* entry, double seconds) {
  --dropped_entries_;
  neighbourhoods_.remove(entry->id(), entry->replay_seconds_);
  ++counters_.recompute_count;
  counters_.recompute_bytes += entry->bytes();
  // Note [Nested replays are timed once]: a replay that rebuilds a dropped
  // input first runs that input's replay inside its own (on demand or
  // ahead), so the outermost replay's wall time already holds every inner
  // one. Counting each replay's seconds added the inner ones again: on the
  // CPU GPT workload at 50%, recompute-only, recompute_seconds read about
  // 105 ms per step while the replayed ops took 55 ms and the step 66 ms
  // more than swap-only (bench/RESULTS.md, "Lead, session 21"). Only the
  // outermost adds its time (its callers have ended its replay already).
  if (replays_in_progress_ == 0) counters_.recompute_seconds += seconds;
}

void ResidencyManager::log_decision(const ResidencyEntry* entry, const EvictionCandidate& c,
                                    const Decision& d) const {
  std::fprintf(stderr,
               "membudget: evict %s id=%llu iteration=%llu phase=%s seq=%llu next_use=%lld policy=%s action=%s "
               "reason=\"%s\" swap_stall=%.3fms recompute=%.3fms\n",
               format_bytes(entry->bytes()).c_str(), (unsigned long long)entry->id(),
               (unsigned long long)entry->iteration_, unpacked_since_pack_ ? "backward" : "forward",
               (unsigned long long)entry->pack_seq_,
               (long long)c.next_use_distance, filter_->name(), action_name(d.action), d.reason,
               d.swap_stall_seconds * 1e3, d.recompute_stall_seconds * 1e3);
}

void ResidencyManager::log_copy_wait(const ResidencyEntry* entry, double seconds, const char* copy) const {
  // Where a step's allocation-path stall comes from: each eviction that
  // waited for a copy, with the copy it waited for (the queue ahead of it
  // included), or, without an entry, a wait for every copy in flight.
  // Waits shorter than a microsecond are not worth a line.
  if (!config_.log_decisions || seconds < 1e-6) return;
  if (entry == nullptr) {
    std::fprintf(stderr, "membudget: waited %.3fms for %s\n", seconds * 1e3, copy);
    return;
  }
  std::fprintf(stderr, "membudget: waited %.3fms id=%llu iteration=%llu phase=%s seq=%llu for %s (%s)\n",
               seconds * 1e3, (unsigned long long)entry->id(), (unsigned long long)entry->iteration_,
               unpacked_since_pack_ ? "backward" : "forward", (unsigned long long)entry->pack_seq_, copy,
               format_bytes(entry->bytes()).c_str());
}

void ResidencyManager::note_copy_time(size_t bytes, double seconds) {
  if (seconds < kMinTimedCopySeconds) return;
  ema(link_bytes_per_s_, static_cast<double>(bytes) / seconds);
}

void ResidencyManager::note_interval(double& average, std::chrono::steady_clock::time_point& last, double paused) {
  auto now = backend_.clock_now();
  if (last != std::chrono::steady_clock::time_point{}) {
    double gap = std::max(std::chrono::duration<double>(now - last).count() - paused, 0.0);
    if (gap < kMaxIntervalSeconds) ema(average, gap);
  }
  last = now;
}

std::vector<EntryInfo> ResidencyManager::snapshot() const {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  std::vector<EntryInfo> result;
  result.reserve(entries_.size());
  for (const ResidencyEntry* entry : entries_) {
    EntryInfo info;
    info.id = entry->id();
    info.bytes = entry->bytes();
    info.state = residency_name(entry->state_);
    info.pins = entry->pins_;
    info.externally_referenced = entry->externally_referenced();
    info.recomputable = entry->recomputable_;
    info.host_valid = entry->host_valid_;
    info.iteration = entry->iteration_;
    info.pack_seq = entry->pack_seq_;
    result.push_back(info);
  }
  std::sort(result.begin(), result.end(), [](const EntryInfo& a, const EntryInfo& b) { return a.id < b.id; });
  return result;
}

}  // namespace membudget
