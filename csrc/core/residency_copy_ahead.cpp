// ResidencyManager, part four: copies to host started ahead of need during
// forward, and backward's copy-in backlog that prices them (Note [Copies
// ahead], Note [Copy-in backlog] in policy/copy_in_backlog.h). Every private
// method here assumes mutex_ is held.
#include <algorithm>
#include <cstdio>

#include "core/residency_manager.h"
#include "core/units.h"

namespace membudget {
namespace {

// Copies ahead in flight at once: two keep the D2H link busy between packs
// (a pack comes every few copies' time at most) while an eviction that
// must copy synchronously waits behind at most two of them.
constexpr size_t kMaxCopiesAhead = 2;
// A copy ahead must add no more than this to backward's stall (rounding).
constexpr double kHiddenSeconds = 1e-9;
// Entries whose eviction without a host copy cost less than this share of
// their copy are not copied ahead: the link time goes further elsewhere
// (a 688 MiB elementwise output replays in 0.3 ms, its copy takes 12.5 ms).
constexpr double kMinLossShare = 0.25;

}  // namespace

double ResidencyManager::seconds_available_for_copy_in(int64_t distance) const {
  // The prefetcher issues copy-ins from backward's first unpack on, so a
  // use `distance` unpacks into backward leaves that many unpacks of time
  // (the rest of forward hides nothing: the device is full then).
  // Note [Copy-in pace]: at the faster of two measured paces. The moving
  // average of the gap between unpacks follows backward's ops, which differ
  // (0.07-0.24 ms per unpack within ResNet-50's backward on h200), so a
  // copy-in it finds hidden with little slack may end after its use: at
  // ResNet-50 at 40% (simulated, after Note [Replay inputs]) a host-backed
  // 6 MiB activation was released as free with 0.05 ms of slack, the pace
  // then fell, and its copy-in came 0.59 ms late, where dropping another
  // cost 0.016 ms. A copy-in priced late that would have hidden costs at
  // most the cheaper choice the director then makes; one priced hidden
  // that comes late costs its lateness. So the time available is counted at
  // the smaller of the average and the last backward's mean pace (its
  // length over its unpacks): 1.0801 -> 1.0632 of the floor there (dtr
  // 1.0708), no other cell's verdict moved (bench/RESULTS.md, "r50 on
  // main after `sched`").
  const double pace = mean_unpack_interval_s_ > 0.0 ? std::min(unpack_interval_s_, mean_unpack_interval_s_)
                                                    : unpack_interval_s_;
  return static_cast<double>(std::max<int64_t>(distance, 0)) * pace;
}

size_t ResidencyManager::queued_copy_bytes(Residency state) const {
  size_t bytes = 0;
  for (const ResidencyEntry* busy : in_flight_) {
    if (busy->state_ == state) bytes += busy->bytes();
  }
  return bytes;
}

CopyInBacklog ResidencyManager::copy_in_backlog(bool with_planned) const {
  const size_t queued = queued_copy_bytes(Residency::swapping_in);
  CopyInBacklog backlog(queued, link_bytes_per_s_);
  if (order_.has_prediction() && unpack_interval_s_ > 0.0) {
    const int64_t now = order_.current_position();
    for (const ResidencyEntry* entry : entries_) {
      if (entry->iteration_ != iteration_) continue;
      const bool on_host = entry->state_ == Residency::host;
      const bool planned = entry->state_ == Residency::swapping_out ||
                           (entry->state_ == Residency::resident && entry->host_valid_);
      if (!on_host && !(with_planned && planned)) continue;
      const int64_t next = order_.next_position(entry->pack_seq_, now);
      if (next < 0) continue;  // not needed again
      backlog.add(seconds_available_for_copy_in(next - now), entry->bytes());
    }
  }
  backlog.seal();
  return backlog;
}

double ResidencyManager::loss_without_host_copy(const ResidencyEntry* entry) const {
  double loss = static_cast<double>(entry->bytes()) / link_bytes_per_s_;
  if (allowed_.recompute && replayable_now(entry)) {
    std::vector<uint64_t> visited;
    loss = std::min(loss, recompute_total(entry, visited));
  }
  return loss;
}

void ResidencyManager::start_copies_ahead() {
  // Note [Copies ahead]: the director prices a swap by its copy-out on the
  // allocation path, so once forward reaches the budget a large tensor
  // (Llama-7B's 688 MiB MLP outputs: 12.5 ms over the h200's link, 3.7 ms
  // to replay) is dropped and replayed, while the D2H link had sat idle for
  // most of forward before (simulated: 300-474 ms of replays per step
  // against a floor overhead of 13-50 ms). Copying ahead, while the link is
  // idle, the entries eviction is likely to pick makes their later eviction
  // free (the director then prices them by their copy-in alone). Which ones:
  // only in forward and only when the previous iteration evicted (at most
  // as many bytes as it did: the same forward will likely need as much);
  // first those whose eviction without a host copy would cost the most per
  // byte of link time (a replay, capped by the copy it replaces; none that
  // costs less than kMinLossShare of its copy), then the farthest use; and
  // only entries whose copy-in backward can hide behind everything already
  // bound for host (Note [Copy-in backlog], counted as if all of it were
  // evicted), so that the host link in backward is not oversubscribed.
  // Measured in the simulator on h200 (bench/RESULTS.md, "Simulated policies, run 5"):
  // Llama-7B at 40% 1.112 -> 1.094 of the floor. Without kMinLossShare,
  // ResNet-50 at 40% lost 9% to evictions waiting for copies ahead of cheap
  // tensors; choosing from the previous iteration's evictions instead of
  // the current estimate missed Llama at 40% (the first iteration, without
  // a measured pace, evicts differently).
  if (!config_.copies_ahead || !allowed_.swap || unpacked_since_pack_ || !order_.has_prediction() || unpack_interval_s_ <= 0.0) return;
  if (evicted_last_iteration_ == 0) return;
  size_t in_flight_out = 0;
  size_t planned = evicted_this_iteration_;
  for (const ResidencyEntry* entry : entries_) {
    if (entry->state_ == Residency::swapping_out) {
      ++in_flight_out;
      planned += entry->bytes();
    } else if (entry->state_ == Residency::resident && entry->host_valid_) {
      planned += entry->bytes();
    }
  }
  if (in_flight_out >= kMaxCopiesAhead || planned >= evicted_last_iteration_) return;

  struct Choice {
    ResidencyEntry* entry;
    double loss_per_byte;  // seconds lost per byte if evicted without a host copy
    int64_t next;          // predicted position of its next use
  };
  const int64_t now = order_.current_position();
  std::vector<Choice> choices;
  for (ResidencyEntry* entry : entries_) {
    if (!is_evictable(entry) || entry->state_ != Residency::resident || entry->host_valid_) continue;
    if (entry->iteration_ != iteration_) continue;
    const int64_t next = order_.next_position(entry->pack_seq_, now);
    if (next < 0) continue;  // never used again: nothing to bring back
    const double loss = loss_without_host_copy(entry);
    const double copy_s = static_cast<double>(entry->bytes()) / link_bytes_per_s_;
    if (loss <= 0.0 || loss < kMinLossShare * copy_s) continue;
    choices.push_back(Choice{entry, loss / static_cast<double>(entry->bytes()), next});
  }
  std::sort(choices.begin(), choices.end(), [](const Choice& a, const Choice& b) {
    if (a.loss_per_byte != b.loss_per_byte) return a.loss_per_byte > b.loss_per_byte;
    if (a.next != b.next) return a.next > b.next;
    return a.entry->pack_seq_ < b.entry->pack_seq_;
  });
  CopyInBacklog backlog = copy_in_backlog(/*with_planned=*/true);
  size_t d2h_queued = queued_copy_bytes(Residency::swapping_out);
  for (const Choice& choice : choices) {
    if (in_flight_out >= kMaxCopiesAhead || planned >= evicted_last_iteration_) break;
    ResidencyEntry* entry = choice.entry;
    const double available = seconds_available_for_copy_in(choice.next - now);
    if (backlog.added_stall_seconds(available, entry->bytes()) > kHiddenSeconds) continue;
    EvictionCandidate c;
    c.bytes = entry->bytes();
    c.next_use_distance = choice.next - now;
    c.pack_seq = entry->pack_seq_;
    c.seconds_until_next_use = seconds_until_next_use(c);
    if (copy_ends_after_next_use(c, d2h_queued)) continue;
    if (!ensure_host_slot(entry)) break;
    if (config_.log_decisions) {
      std::fprintf(stderr, "membudget: copy ahead %s id=%llu seq=%llu next_use=%lld loss=%.3fms\n",
                   format_bytes(entry->bytes()).c_str(), (unsigned long long)entry->id(),
                   (unsigned long long)entry->pack_seq_, (long long)c.next_use_distance,
                   choice.loss_per_byte * static_cast<double>(entry->bytes()) * 1e3);
    }
    entry->copy_event_ = copy_out(entry);
    entry->state_ = Residency::swapping_out;
    in_flight_.push_back(entry);
    ++counters_.background_swap_count;
    ++in_flight_out;
    planned += entry->bytes();
    d2h_queued += entry->bytes();
    backlog.add(available, entry->bytes());
    backlog.seal();
  }
}

}  // namespace membudget
