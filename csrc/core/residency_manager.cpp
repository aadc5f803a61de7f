#include "core/residency_manager.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <limits>
#include <map>
#include <string>
#include <utility>

#include "core/units.h"

namespace membudget {
namespace {

// Background swap-outs in flight at once: enough to keep a copy stream busy
// without flooding the host tier ahead of need.
constexpr size_t kMaxBackgroundCopies = 8;
// The prefetch window never exceeds this fraction of the device budget.
constexpr double kMaxPrefetchBudgetFraction = 0.25;
// How many unpacks of slack backward's copy-ins may have left before the
// prefetcher keeps the H2D link busy past its window (Note [Link behind]).
constexpr int64_t kLinkBehindUnpacks = 32;

uint64_t next_entry_id() {
  static std::atomic<uint64_t> counter{0};
  return ++counter;
}

double seconds_since(const Backend& backend, std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(backend.clock_now() - start).count();
}

}  // namespace

const char* residency_name(Residency state) {
  switch (state) {
    case Residency::resident: return "resident";
    case Residency::swapping_out: return "swapping_out";
    case Residency::host: return "host";
    case Residency::swapping_in: return "swapping_in";
    case Residency::dropped: return "dropped";
    case Residency::recomputing: return "recomputing";
  }
  return "?";
}

ResidencyEntry::ResidencyEntry(size_t bytes) : bytes_(bytes), id_(next_entry_id()) {}

ResidencyManager::ResidencyManager(Backend& backend, CachingAllocator& device,
                                   CachingAllocator& host_tier, ManagerConfig config)
    : backend_(backend), device_(device), host_tier_(host_tier), config_(std::move(config)),
      filter_(make_filter(config_.policy)), allowed_(AllowedActions::parse(config_.actions)),
      link_bytes_per_s_(config_.link_bytes_per_s) {}

ResidencyManager::~ResidencyManager() { synchronize(); }

void ResidencyManager::set_config(const ManagerConfig& config) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  filter_ = make_filter(config.policy);
  allowed_ = AllowedActions::parse(config.actions);
  if (config.link_bytes_per_s != config_.link_bytes_per_s) link_bytes_per_s_ = config.link_bytes_per_s;
  config_ = config;
}

void ResidencyManager::start_iteration() {
  packs_last_iteration_ = packs_this_iteration_;
  evicted_last_iteration_ = evicted_this_iteration_;
  evicted_this_iteration_ = 0;
  largest_forward_request_last_iteration_ = largest_forward_request_;
  largest_forward_request_ = 0;
  // Note [Requests to come]: every completed iteration's record is used,
  // the first one's (run without a prediction) too.
  requests_to_come_known_ = true;
  // Note [Evictions still to come]: evictions at packs close together draw
  // on the bytes releasable without a copy one after another, faster than
  // background copies issued in between refill them: GPT-2 at 50% on the
  // CPU evicts at packs 40, 41, 41 and 50, and each victim's copy had been
  // issued a pack before its request (a 16 MiB activation packed at 41; 2.8
  // and 1.7 ms of waits a step, CPU model). So the target is what all the
  // evictions from this pack to the step's end released (the last index,
  // the end of forward, holds backward's largest request or what forward's
  // last evictions released, whichever is more), not the largest of them.
  // Copies stay bounded by kMaxBackgroundCopies, the host tier and Note
  // [Late background copies]. Measured on the CPU model
  // (sim_cpu_targets.py --iterations 3), delta / dtr over plain PyTorch,
  // summing over a window of 1, 2, 4, 8, 16 packs or the rest of the step:
  // GPT-2 50% 1.0166 / 1.0158, 1.0158 / 1.0167, 1.0155 / 1.0172, 1.0155 /
  // 1.0155, 1.0089 / 1.0091, 1.0089 / 1.0091; GPT-2 40% 1.0186 / 1.0258
  // (1, 2 packs), 1.0178 / 1.0178 (4, 8), 1.0175 / 1.0175 (16, the rest);
  // GPT-2 70% 1.0069 / 1.0138 up to 8 packs, 1.0068 / 1.0067 from 16. CNN,
  // LSTM and the h200 table (sim_targets.py) are the same at every window.
  requests_to_come_.assign(requests_by_pack_.size(), 0);
  size_t to_come = 0;
  for (size_t s = requests_by_pack_.size(); s-- > 0;) {
    to_come += requests_by_pack_[s];
    requests_to_come_[s] = to_come;
  }
  requests_by_pack_.clear();
  last_pack_ = {};
  // Note [Unpack pace]: the first unpack of a backward follows a whole
  // forward, not an op: measured from the previous backward's last unpack,
  // the gap (0.7 s for Llama-7B on h200, under kMaxIntervalSeconds) entered
  // the pace as one sample, a quarter of it at once (kEmaWeight): a pace
  // of about 1 ms became about 0.18 s (by the EMA's arithmetic), and with
  // it every horizon the prefetcher and the director derive from it.
  if (unpacks_this_backward_ > 1) {  // Note [Copy-in pace]
    const double own_work = std::chrono::duration<double>(last_unpack_ - first_unpack_).count() -
                            (paused_at_last_unpack_s_ - paused_at_first_unpack_s_);
    mean_unpack_interval_s_ = std::max(own_work, 0.0) / static_cast<double>(unpacks_this_backward_ - 1);
  }
  unpacks_this_backward_ = 0;
  last_unpack_ = {};
  ++iteration_;
  order_.begin_iteration();
  by_seq_.clear();
  packs_this_iteration_ = 0;
  prefetch_cursor_ = 0;
  unpacked_since_pack_ = false;
  // Unwatched until a held input is found freed: only the entries gone leave.
  watched_resident_.erase(std::remove_if(watched_resident_.begin(), watched_resident_.end(),
                                         [this](uint64_t id) { return find(id) == nullptr; }),
                          watched_resident_.end());
}

void ResidencyManager::register_entry(ResidencyEntry* entry, Stream stream) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  reap_completed_copies();
  if (unpacked_since_pack_) start_iteration();  // Note [Iterations]
  entry->registered_ = true;
  entry->stream_ = stream;
  entry->state_ = Residency::resident;
  entry->iteration_ = iteration_;
  entry->pack_seq_ = packs_this_iteration_++;
  entry->last_access_ = ++clock_;
  entries_.insert(entry);
  by_id_[entry->id()] = entry;
  by_seq_.push_back(entry);
  watch_held_inputs();  // Note [Writes that refill a freed input]
  note_interval(pack_interval_s_, last_pack_);
  drop_planned();
  maybe_start_background_swaps();
  start_copies_ahead();
}

void ResidencyManager::touch(ResidencyEntry* entry) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  entry->last_access_ = ++clock_;
}

void ResidencyManager::unregister_entry(ResidencyEntry* entry) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!entry->registered_) return;
  if (entry->copy_event_) {
    entry->copy_event_->wait();
    finish_copy(entry);
  }
  clear_prefetch(entry);
  unqueue_recompute_ahead(entry);
  if (entry->host_copy_ != nullptr) {
    host_tier_.deallocate(entry->host_copy_);
    entry->host_copy_ = nullptr;
    entry->host_valid_ = false;
  }
  if (entry->iteration_ == iteration_ && entry->pack_seq_ < by_seq_.size()) {
    by_seq_[entry->pack_seq_] = nullptr;
  }
  if (entry->state_ == Residency::dropped || entry->state_ == Residency::recomputing) {
    neighbourhoods_.remove(entry->id(), entry->replay_seconds_);
    --dropped_entries_;
  }
  planned_.erase(std::remove(planned_.begin(), planned_.end(), entry), planned_.end());
  by_id_.erase(entry->id());
  entries_.erase(entry);
  entry->registered_ = false;
}

void ResidencyManager::finish_copy(ResidencyEntry* entry) {
  if (entry->state_ == Residency::swapping_out) {
    entry->host_valid_ = true;  // Note [Host copies]
  }
  entry->state_ = Residency::resident;
  entry->copy_event_.reset();
  in_flight_.erase(std::remove(in_flight_.begin(), in_flight_.end(), entry), in_flight_.end());
}

void ResidencyManager::reap_completed_copies() {
  for (size_t i = 0; i < in_flight_.size();) {
    ResidencyEntry* entry = in_flight_[i];
    if (entry->copy_event_ && entry->copy_event_->ready()) {
      finish_copy(entry);  // erases entry from in_flight_
    } else {
      ++i;
    }
  }
}

bool ResidencyManager::swap_in(ResidencyEntry* entry, Stream stream, bool wait) {
  ++entry->pins_;
  entry->state_ = Residency::swapping_in;
  void* device_ptr = nullptr;
  try {
    // A prefetch (not waited for) is speculative: it must not end in an OOM.
    device_ptr = wait ? device_.allocate(entry->bytes(), stream) : device_.try_allocate(entry->bytes(), stream);
  } catch (...) {
    entry->state_ = Residency::host;
    --entry->pins_;
    throw;
  }
  if (device_ptr == nullptr) {
    entry->state_ = Residency::host;
    --entry->pins_;
    return false;
  }
  entry->attach_device_copy(device_ptr);
  EventPtr done = wait ? backend_.copy_to_device_for_waiter(device_ptr, entry->host_copy_, entry->bytes(), stream)
                      : backend_.copy_to_device(device_ptr, entry->host_copy_, entry->bytes(), stream);
  counters_.swap_in_bytes += entry->bytes();
  ++counters_.swap_in_count;
  if (wait) {
    auto start = backend_.clock_now();
    backend_.stream_wait(stream, done);
    note_copy_time(entry->bytes(), seconds_since(backend_, start));
    entry->state_ = Residency::resident;
  } else {
    entry->copy_event_ = std::move(done);
    in_flight_.push_back(entry);
  }
  --entry->pins_;
  return true;
}

void ResidencyManager::wait_for_arrival(ResidencyEntry* entry, Stream stream, bool was_prefetched) {
  // The compute stream waits for the swap-in or side-stream replay; on the
  // host backend this blocks.
  auto start = backend_.clock_now();
  backend_.stream_wait(stream, entry->copy_event_);
  note_stall_since(start);
  finish_copy(entry);
  if (was_prefetched) ++counters_.prefetch_hits;
}

void* ResidencyManager::materialize(ResidencyEntry* entry, Stream stream) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  reap_completed_copies();
  entry->last_access_ = ++clock_;
  // Note [Replay inputs]: an input a replay reads is no unpack of backward's.
  const bool replay_input = replays_in_progress_ > 0;
  if (!replay_input) {
    // Note [Pace of backward's own ops]: the pace between unpacks turns
    // every predicted distance into time (the director's copy-in slack, the
    // delta score's horizon, due prefetches), so it should measure what
    // separates the unpacks in every iteration: backward's own ops. Waits
    // for copies and on-demand replays in between are left out: they are
    // what this iteration's evictions cost, and counted in, they fed those
    // evictions back into the next iteration's choices. Measured in the
    // simulator on a100-40gb, ResNet-50 batch 32 at 30%: a backward that
    // stalled and replayed much measured a slow pace, so the next one found
    // copy-ins hidden that were not, released host-backed activations it
    // then waited for, and the two alternated (delta 80.6 / 88.6 / 88.6 ms
    // at 2 / 3 / 4 steps; with the prefetcher also bringing back a dropped
    // entry's host inputs, 107 / 69 / 108 ms); counted without them the pace
    // is the same in every step and delta takes 71.8 ms from the second
    // step on (dtr 70.0). A slower pace than the true one prices copy-ins
    // hidden that come late; a faster one at most makes the director pick
    // the other action (Note [Copy-in pace]). bench/RESULTS.md, "Lead,
    // session 19".
    note_interval(unpack_interval_s_, last_unpack_, paused_seconds() - paused_at_last_unpack_s_);
    paused_at_last_unpack_s_ = paused_seconds();
    if (unpacks_this_backward_++ == 0) {  // Note [Copy-in pace]
      first_unpack_ = last_unpack_;
      paused_at_first_unpack_s_ = paused_at_last_unpack_s_;
    }
  }
  last_pack_ = {};
  if (!unpacked_since_pack_) backward_start_clock_ = clock_ - 1;  // the first unpack of a backward
  unpacked_since_pack_ = true;
  if (entry->iteration_ == iteration_ && !replay_input) order_.record_unpack(entry->pack_seq_);
  watch_held_inputs();  // Note [Writes that refill a freed input]
  const bool was_prefetched = clear_prefetch(entry);
  entry->recomputed_ahead_ = false;
  switch (entry->state_) {
    case Residency::resident:
    case Residency::swapping_out:
      if (was_prefetched) ++counters_.prefetch_hits;
      break;
    case Residency::swapping_in:
      wait_for_arrival(entry, stream, was_prefetched);
      break;
    case Residency::host: {
      ++counters_.prefetch_misses;
      auto start = backend_.clock_now();
      swap_in(entry, stream, /*wait=*/true);
      note_stall_since(start);
      break;
    }
    case Residency::recomputing:
      if (entry->copy_event_) {  // replayed ahead on a side stream (Note [Recompute ahead])
        wait_for_arrival(entry, stream, was_prefetched);
        break;
      }
      if (entry->ahead_queued_) {
        // Queued ahead but not begun: replayed on demand now, under the pin
        // the queue took (released by unpin() after complete_recompute()).
        unqueue_recompute_ahead(entry);
        ++replays_in_progress_;
        begin_replay_estimate(entry);
        issue_prefetches(stream);
        return nullptr;
      }
      [[fallthrough]];  // another thread replays it too: both replay (rare)
    case Residency::dropped:
      entry->state_ = Residency::recomputing;
      ++entry->pins_;  // released by unpin() after complete_recompute()
      ++replays_in_progress_;
      begin_replay_estimate(entry);
      issue_prefetches(stream);
      return nullptr;
  }
  ++entry->pins_;  // released by unpin() once the caller references the storage
  issue_prefetches(stream);
  return entry->device_data();
}

void ResidencyManager::unpin(ResidencyEntry* entry) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  --entry->pins_;
}

void ResidencyManager::set_replay_input(ResidencyEntry* entry, bool reading) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  entry->replay_input_ = reading;
}

void ResidencyManager::issue_prefetches(Stream stream) {
  if (config_.prefetch_bytes == 0 || !order_.has_prediction()) return;
  // A window larger than a fraction of the budget only evicts what it just
  // brought in (measured: at 50% of GPT-2's peak a 256 MiB window over a
  // 97 MiB budget swapped in 1.6x what went out).
  const size_t budget = effective_budget();
  const size_t window = std::min(config_.prefetch_bytes,
                                 static_cast<size_t>(kMaxPrefetchBudgetFraction * static_cast<double>(budget)));
  const int64_t now = order_.current_position();
  // A prefetch issued from inside a replay ahead keeps that replay's horizon.
  const int64_t outer_horizon = eviction_horizon_;
  bool starved = false;  // a swap-in wanted memory it could not have
  // Note [Link behind]: the window holds prefetches back until they are
  // due one by one, but when everything still on host, in the order
  // backward needs it, leaves the H2D link less slack than
  // kLinkBehindUnpacks unpacks (Note [Copy-in backlog]), every moment it
  // idles is a stall later: then it is kept busy, past the window, with that
  // much queued. The slack is an estimate (predicted positions at the
  // average pace of backward), hence the wide margin. Measured in the
  // simulator (Llama-7B at 60% on h200 with copies ahead): without it 30-40%
  // of the link was used in the first half of backward, then 173 ms of
  // unpack stalls came in the second; with a margin of 2 unpacks 48 ms, of 32
  // unpacks 31 ms (bench/RESULTS.md, "Simulated policies, run 5").
  const double margin_s = static_cast<double>(kLinkBehindUnpacks) * unpack_interval_s_;
  const bool link_behind = config_.copies_ahead && unpack_interval_s_ > 0.0 &&
                           copy_in_backlog(/*with_planned=*/false).max_lateness_seconds() > -margin_s;
  auto keep_link_busy = [&]() {
    if (!link_behind) return false;
    const size_t h2d_queued = queued_copy_bytes(Residency::swapping_in);
    return static_cast<double>(h2d_queued) / link_bytes_per_s_ < margin_s;
  };
  // Tries the entry predicted at `position`: 1 issued, 0 nothing to do
  // there, -1 stop (window full, no room, no memory).
  auto try_prefetch = [&](int64_t position) -> int {
    const bool busy_link = keep_link_busy();
    if (prefetch_outstanding_bytes_ >= window && !busy_link) return -1;
    uint64_t seq = order_.predicted_at(position);
    ResidencyEntry* entry = seq < by_seq_.size() ? by_seq_[seq] : nullptr;
    if (entry == nullptr || entry->state_ != Residency::host) return 0;
    if (position < now && entry->last_access_ > backward_start_clock_) return 0;  // used already
    const int64_t distance = std::max<int64_t>(position - now, 0);
    if (prefetch_outstanding_bytes_ > 0 && prefetch_outstanding_bytes_ + entry->bytes() > window &&
        !prefetch_is_due(entry, distance) && !busy_link) {
      return -1;
    }
    // Room without evicting anything needed sooner than this entry? Until
    // the copy is due, only victims that cost nothing to release count
    // (Note [Prefetch waits to evict]).
    size_t room = device_.largest_free_or_reservable();
    if (room < entry->bytes()) {
      const bool due = prefetch_is_due(entry, distance);
      for (const EvictionCandidate& c : candidates(distance)) {
        if (!due && c.cost_seconds > 0.0) continue;
        room += c.bytes;
        if (room >= entry->bytes()) break;
      }
      if (room < entry->bytes()) {
        starved = true;
        return -1;
      }
    }
    eviction_horizon_ = distance;
    const bool issued = swap_in(entry, stream, /*wait=*/false);
    eviction_horizon_ = outer_horizon;
    if (!issued) {
      starved = true;
      return -1;
    }
    entry->prefetched_ = true;
    prefetch_outstanding_bytes_ += entry->bytes();
    ++counters_.prefetch_issued;
    return 1;
  };
  // The cursor starts at the current position: positions are backward's own
  // unpacks (Note [Replay inputs]), the same in every iteration, so nothing
  // predicted before `now` is still to come. (A lookback of 32 positions
  // behind `now` was needed while a replay's inputs counted as positions and
  // ran an iteration that replayed more ahead of its prediction; with them
  // left out it changed no number of bench/sim_targets.py or
  // sim_cpu_targets.py, and tests/test_replay_positions.py, written for it,
  // passes without it.)
  int64_t cursor = std::max(prefetch_cursor_, now);
  for (; cursor < order_.predicted_length(); ++cursor) {
    if (try_prefetch(cursor) < 0) break;
  }
  prefetch_cursor_ = cursor;
  // Copies come first: they overlap for free, a replay costs compute.
  if (config_.recompute_ahead && !starved) queue_replays_ahead(now, window);
}

void ResidencyManager::rewind_prefetch_cursor(const ResidencyEntry* entry) {
  // Note [Prefetch cursor]: the cursor only moves forward over the predicted
  // unpack order, so an entry swapped out after the cursor passed its next
  // use would never be prefetched: its whole copy-in would be a stall, behind
  // whatever the H2D stream holds (6 ms for a 24 MiB tensor behind a 384 MiB
  // one at GPT-2 40% on h200, simulated). Its next use brings the cursor back.
  if (!order_.has_prediction() || entry->iteration_ != iteration_) return;
  const int64_t next = order_.next_position(entry->pack_seq_, order_.current_position());
  if (next >= 0 && next < prefetch_cursor_) prefetch_cursor_ = next;
}

// Note [Prefetch waits to evict]: a prefetch that finds no free room may
// evict entries needed after it, but each victim that is not already on
// host costs now what it was evicted to avoid: a replay or a copy. In
// backward the room often comes for free a few unpacks later, as backward
// frees what it has used; so until the copy is due (Note [Due prefetches]:
// issued any later it would arrive late) a prefetch takes only room that
// costs nothing (free memory, device copies whose host copy is valid and
// whose copy-in hides before use) and otherwise waits for the next unpack.
// Measured in the simulator on h200: ResNet-50 at 80%, the prefetches at
// backward's first unpack dropped eight activations needed later (0.3 ms of
// replays) where the memory was free before the copies were due; delta
// 1.0176 -> 1.0126 of the floor, at 60% 1.0349 -> 1.0297 (bench/RESULTS.md,
// "h200gap"). Waiting for any victim, free ones included, shifted the CPU
// model's GPT-2 at 70% (later prefetches, other victims: +0.13 ms of replays).
bool ResidencyManager::prefetch_is_due(const ResidencyEntry* entry, int64_t distance) const {
  // Note [Due prefetches]: the window bounds the bytes brought in ahead of
  // use, but an entry larger than what the window has left waits behind
  // smaller ones until they are used, and a large one (a 384 MiB dropout
  // mask of GPT-2 against a 256 MiB window) then starts too late to arrive
  // in time: the whole copy became a stall (7.3 ms per step at GPT-2 and
  // BERT at 40% on h200, simulated). Once the copy, behind what the H2D
  // stream already holds, would not finish before the predicted use anyway,
  // waiting longer only adds stall: it is issued past the window. It still
  // needs room that evicts nothing needed sooner.
  if (unpack_interval_s_ <= 0.0) return false;
  const size_t h2d_queued = queued_copy_bytes(Residency::swapping_in);
  const double copy_s = static_cast<double>(h2d_queued + entry->bytes()) / link_bytes_per_s_;
  return copy_s >= static_cast<double>(distance) * unpack_interval_s_;
}

size_t ResidencyManager::effective_budget() const {
  // Note [Budget above the device]: a budget larger than the device (a
  // percentage of a model's peak that does not fit, MEMBUDGET_BUDGET set for
  // a bigger card) is never what runs out: the device is. A watermark taken
  // of the budget would then lie above the device, and every eviction would
  // be a synchronous copy on the allocation path (measured in the simulator:
  // Llama-7B on h200 at a 168 GiB budget, 68 ms of such copies per step).
  return std::min(device_.budget(), backend_.device_capacity());
}

bool ResidencyManager::copy_ends_after_next_use(const EvictionCandidate& c, size_t d2h_queued_bytes) const {
  // Note [Late background copies]: a copy-out queued behind others that
  // ends after the entry's predicted next use frees nothing before that use
  // (the entry is needed on the device), takes link time from copies that
  // would, and, when that use is the last, makes the entry's release wait
  // for a copy nobody needs (the device memory cannot be reused while the
  // copy reads it). Measured in the simulator on h200: GPT-2 at 80% and 60%
  // and BERT at 80% each stalled 11-18 ms per step on one such release.
  // Without a prediction (first iteration) every copy is allowed.
  if (c.next_use_distance < 0 || unpack_interval_s_ <= 0.0) return false;
  const double ends_in = static_cast<double>(d2h_queued_bytes + c.bytes) / link_bytes_per_s_;
  return ends_in > c.seconds_until_next_use;
}

size_t ResidencyManager::request_to_cover() const {
  // Note [Requests to come]: a background copy serves only an eviction that
  // comes after it. Covering the largest request of the whole forward from
  // every pack on, past the last point where the step evicted, copied out
  // what no eviction then released: at LSTM 70% on the CPU (real runs and
  // the simulation alike) the one eviction per step was a 30 MiB request at
  // the 8th pack, and the background copies issued after it to cover another
  // such request (36 MiB per step under delta, 6-36 MiB under dtr, whose
  // copies were cut short by kMaxBackgroundCopies) were never used; on the
  // host backend a copy nobody needs takes memory bandwidth from compute
  // (Note [Compute beside a copy] in sim_link.h). What lies above the
  // watermark is still covered (6 MiB of those 36).
  // A step repeats from one iteration to the next, so the previous one says
  // which requests are still to come from this pack on (backward's counted
  // at the end of forward: copies issued late in forward serve them). The
  // first iteration has no prediction, hence no prefetches, and its backward
  // evicts elsewhere than the next ones'; its record was once left unused
  // for that, and the second iteration covered the largest forward request
  // from every pack on. That cost more than the record's errors: on the CPU
  // model (sim_cpu_targets.py, second step, delta / dtr over plain PyTorch)
  // GPT-2 50% 1.0246 / 1.0313 with the fallback against 1.0089 / 1.0091
  // with the record, GPT-2 40% 1.0287 / 1.0359 against 1.0112 / 1.0175,
  // LSTM 70% 1.0886 / 1.0847 against 1.0803 / 1.0803: the second step is
  // then the steady one (bench/RESULTS.md, "Lead, session 22"). Where the
  // steady step is worse than the old second one was (a100-40gb, GPT-2 and
  // BERT at 40%: Note [Requests that will not fit], which needs a record,
  // now applies from the second step on), the second step shows it. Before
  // the first iteration has ended, and after reset_prediction, there is no
  // record: the largest forward request seen so far stands in.
  if (!requests_to_come_known_) {
    return std::max(largest_forward_request_, largest_forward_request_last_iteration_);
  }
  return packs_this_iteration_ < requests_to_come_.size() ? requests_to_come_[packs_this_iteration_] : 0;
}

void ResidencyManager::maybe_start_background_swaps() {
  const size_t budget = effective_budget();
  if (budget == 0 || budget == std::numeric_limits<size_t>::max() || config_.high_watermark >= 1.0) return;
  if (!allowed_.swap) return;  // actions=recompute: nothing may go to host
  const size_t threshold = static_cast<size_t>(config_.high_watermark * static_cast<double>(budget));
  const size_t allocated = device_.stats().allocated_current;
  const size_t to_cover = request_to_cover();
  // Note [Requests that will not fit]: below the watermark the evictions
  // still to come (Note [Evictions still to come]) may not fit beside what
  // is allocated. At LSTM 70% on the CPU a 30 MiB request at the 10th pack
  // found 50 MiB allocated of 76: it evicted the 30 MiB activation packed
  // two packs before, copied out on the allocation path (3-5 ms a step,
  // under every policy), while the link idled from that pack on. Only
  // predicted evictions count (the fallback's largest request so far may
  // lie behind).
  const bool request_will_not_fit = requests_to_come_known_ && allocated + to_cover > budget;
  if (allocated <= threshold && !request_will_not_fit) return;
  // Note [Background target]: eviction on the allocation path releases
  // a request's whole size in forward (Note [Request fits]), not just what
  // lies above the watermark. For it to be instant, the bytes releasable
  // without a copy must cover such a request too: the largest forward has
  // asked for, this iteration or the previous one. With the excess alone,
  // the CPU model's GPT-2 at 70% copied 1.6 ms per step synchronously in
  // forward (16 MiB requests against a few MiB above the watermark). Only
  // requests still to come count (Note [Requests to come]).
  const size_t excess = std::max(allocated > threshold ? allocated - threshold : 0, to_cover);
  size_t releasable = 0;  // device bytes that eviction could release without copying
  for (ResidencyEntry* entry : entries_) {
    if (entry->state_ == Residency::swapping_out ||
        (entry->state_ == Residency::resident && entry->host_valid_)) {
      releasable += entry->bytes();
    }
  }
  size_t d2h_queued = queued_copy_bytes(Residency::swapping_out);
  for (const EvictionCandidate& c : candidates(-1)) {
    if (releasable >= excess || in_flight_.size() >= kMaxBackgroundCopies) break;
    ResidencyEntry* entry = c.entry;
    if (entry->host_valid_ || entry->state_ != Residency::resident) continue;
    // Copying ahead is only worth it for entries the director would swap.
    if (!c.swap_chosen) continue;
    if (copy_ends_after_next_use(c, d2h_queued)) continue;
    if (!ensure_host_slot(entry)) break;
    if (config_.log_decisions) {
      std::fprintf(stderr, "membudget: background swap-out %s id=%llu seq=%llu next_use=%lld swap_stall=%.3fms target=%s\n",
                   format_bytes(entry->bytes()).c_str(), (unsigned long long)entry->id(),
                   (unsigned long long)entry->pack_seq_, (long long)c.next_use_distance, c.cost_seconds * 1e3,
                   format_bytes(excess).c_str());
    }
    entry->copy_event_ = copy_out(entry);
    entry->state_ = Residency::swapping_out;
    in_flight_.push_back(entry);
    ++counters_.background_swap_count;
    releasable += entry->bytes();
    d2h_queued += entry->bytes();
  }
}

void ResidencyManager::note_stall_since(std::chrono::steady_clock::time_point start) {
  const double waited = seconds_since(backend_, start);
  counters_.stall_seconds += waited;
  blocked_seconds_ += waited;
}

double ResidencyManager::wait_blocked(const EventPtr& event) {
  const auto start = backend_.clock_now();
  event->wait();
  const double waited = seconds_since(backend_, start);
  blocked_seconds_ += waited;
  return waited;
}

void ResidencyManager::synchronize() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  while (!in_flight_.empty()) {
    ResidencyEntry* entry = in_flight_.back();
    wait_blocked(entry->copy_event_);
    finish_copy(entry);
  }
}

ManagerStats ResidencyManager::stats() const {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  ManagerStats s = counters_;
  s.iteration = iteration_;
  s.dropped_bytes = 0;
  s.link_bytes_per_s = link_bytes_per_s_;
  s.replay_overhead_seconds = replay_overhead_s_;
  s.prefetch_window_used_bytes = prefetch_outstanding_bytes_;
  s.live_entries = entries_.size();
  for (const ResidencyEntry* entry : entries_) {
    if (entry->host_copy_ != nullptr) s.host_tier_bytes += entry->bytes();
    if (entry->state_ == Residency::host) {
      s.host_bytes += entry->bytes();
      continue;
    }
    if (entry->state_ == Residency::dropped || entry->state_ == Residency::recomputing) {
      s.dropped_bytes += entry->bytes();
      continue;
    }
    if (entry->state_ == Residency::swapping_in) continue;
    s.resident_bytes += entry->bytes();
    if (is_evictable(entry)) {
      s.evictable_bytes += entry->bytes();
      if (entry->host_valid_) s.evictable_host_backed_bytes += entry->bytes();
    } else {
      s.in_use_bytes += entry->bytes();
    }
  }
  return s;
}

void ResidencyManager::reset_counters() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  counters_ = ManagerStats{};
}

void ResidencyManager::reset_prediction() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  order_ = UnpackOrder();
  // A new run starts a new iteration, whatever the last run ended with: one
  // that ended after packs with no unpack (a forward without backward)
  // would otherwise number this run's packs after its own, and the order
  // its backward records would name pack sequence numbers no entry of the
  // next iteration has (measured: GPT-2 at half its peak on the CPU, no
  // prefetch at all in the second step).
  start_iteration();
  // What the last model did says nothing of the next (Note [Copies ahead]).
  packs_last_iteration_ = 0;
  evicted_last_iteration_ = 0;
  largest_forward_request_last_iteration_ = 0;
  requests_by_pack_.clear();
  requests_to_come_.clear();
  requests_to_come_known_ = false;
  mean_unpack_interval_s_ = 0.0;
}

namespace {

// Note [Held inputs freed under us] (residency_entry.h), for an entry whose
// replay could run once the input is back.
constexpr const char* kInputFreedNow =
    "an input its replay reads has no storage now (FSDP2 frees each block's gathered parameters after its "
    "forward)";

// " [6.00 MiB: reason; 2.00 MiB: reason]", largest first, at most three
// (Note [Why not recomputable]).
std::string describe_reasons(const std::map<std::string, size_t>& by_reason) {
  std::vector<std::pair<size_t, std::string>> ranked;
  for (const auto& [reason, bytes] : by_reason) {
    ranked.emplace_back(bytes, reason.empty() ? "no lineage reached it (saved in backward, under no_grad, in a "
                                                "compiled region, on a thread that does not record, or written "
                                                "where nothing records)"
                                              : reason);
  }
  std::stable_sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  constexpr size_t kShown = 3;
  std::string text = " [";
  for (size_t i = 0; i < ranked.size() && i < kShown; ++i) {
    text += (i > 0 ? "; " : "") + format_bytes(ranked[i].first) + ": " + ranked[i].second;
  }
  if (ranked.size() > kShown) text += "; " + std::to_string(ranked.size() - kShown) + " more reasons";
  return text + "]";
}

}  // namespace

std::string ResidencyManager::describe_evictable() const {
  // May be called while the allocator builds an OOM message: never wait here.
  std::unique_lock<std::recursive_mutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock()) return "evictable bytes unknown (residency manager busy)";
  ManagerStats s = stats();
  // Under MEMBUDGET_ACTIONS=recompute an entry that cannot be replayed stays
  // resident (the director allows it no action): without saying so, an OOM
  // with "evictable 19 MiB" read as membudget failing to evict (GPT-2 with
  // a gradient penalty, whose double-backward graph is saved during
  // backward, where no lineage is recorded).
  //
  // Note [Why not recomputable]: "8.00 MiB of it not recomputable" left the
  // user to guess which op or which pattern made it so (an in-place write,
  // a part of a split storage, a step on a thread that does not record). The
  // binding gives a reason with each declaration that an entry cannot be
  // replayed, and the bytes are told apart by reason, largest first.
  //
  // The same bytes, with the same reasons, are named where the host tier
  // is full and recompute is allowed: what is left on the device can only
  // be dropped, and "raise MEMBUDGET_HOST_BUDGET" alone did not say that
  // the rest cannot be (a probe's GAN, spectral_norm called twice, under
  // MEMBUDGET_ACTIONS=both with a small host tier).
  const bool host_closed = allowed_.swap && allowed_.recompute && s.host_tier_full > 0;
  size_t unreleasable = 0;
  std::map<std::string, size_t> by_reason;
  if (!allowed_.swap || host_closed) {
    for (const ResidencyEntry* entry : entries_) {
      if (is_evictable(entry) && entry->state_ == Residency::resident && !replayable_now(entry)) {
        unreleasable += entry->bytes();
        by_reason[entry->recomputable_ ? kInputFreedNow : entry->unrecomputable_reason_] += entry->bytes();
      }
    }
  }
  std::string text = "evictable " + format_bytes(s.evictable_bytes) + " (" +
                     format_bytes(s.evictable_host_backed_bytes) + " already on host" +
                     (unreleasable > 0 ? "; " + format_bytes(unreleasable) + " of it not recomputable, " +
                                             (host_closed ? std::string("which only the host tier could take")
                                                          : std::string("which MEMBUDGET_ACTIONS=recompute cannot "
                                                                        "release: allow swap")) +
                                             describe_reasons(by_reason)
                                       : std::string()) +
                     "), in use by autograd/forward " +
                     format_bytes(s.in_use_bytes) + ", swapped to host " + format_bytes(s.host_bytes) +
                     ", dropped for recompute " + format_bytes(s.dropped_bytes) +
                     ", host tier " + format_bytes(host_tier_.stats().reserved_current) + " of " +
                     format_bytes(host_tier_.budget());
  if (s.host_tier_full > 0) {
    // "host tier 0 B of 1.00 MiB; the host tier is full" read as a
    // contradiction where every entry left was larger than the whole tier.
    size_t smallest = std::numeric_limits<size_t>::max();
    for (const ResidencyEntry* entry : entries_) {
      if (is_evictable(entry) && entry->state_ == Residency::resident) smallest = std::min(smallest, entry->bytes());
    }
    const size_t reserved = host_tier_.stats().reserved_current;
    const size_t room = host_tier_.budget() > reserved ? host_tier_.budget() - reserved : 0;
    if (smallest != std::numeric_limits<size_t>::max() && smallest > room) {
      text += "; the host tier cannot take what is left on the device: " + format_bytes(room) +
              " free, the smallest entry " + format_bytes(smallest) + " (raise MEMBUDGET_HOST_BUDGET)";
    } else {
      text += "; the host tier is full (raise MEMBUDGET_HOST_BUDGET)";
    }
  }
  if (!out_of_memory_note_.empty()) text += "; " + out_of_memory_note_;
  return text;
}

void ResidencyManager::set_out_of_memory_note(std::string note) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  out_of_memory_note_ = std::move(note);
}

}  // namespace membudget
