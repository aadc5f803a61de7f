// ResidencyManager: owns the residency of every managed storage (saved
// activations) and is the allocator's Evictor. See DESIGN.md "The core",
// steps 3-5.
//
// Note [Manager locking]: one recursive mutex guards all entries. It is
// recursive because a swap-in allocates device memory while holding it, and
// that allocation may call evict() on the same thread. Lock order is always
// manager -> allocator: the allocator releases its own lock before calling
// evict(), so no cycle exists. Nothing here calls Python; the torch binding
// calls in with the GIL released where it may block.
//
// Note [Iterations]: a pack that follows an unpack starts a new iteration.
// Pack sequence numbers restart at 0, and the unpack order of the iteration
// that just ended becomes the prediction for prefetch and the delta filter.
//
// Note [Replay inputs]: a position in that order is one of backward's own
// unpacks. The inputs a replay materializes (on demand, or ahead, Note
// [Recompute ahead]) between materialize() returning nullptr, or
// begin_recompute_ahead(), and the matching complete_recompute*() are
// neither recorded in the order nor samples of the unpack pace: how many
// there are depends on what this iteration happened to drop, so counting
// them shifted every later position of the next prediction by the replays
// of this one. Measured in the simulator (Llama-7B at 60% on h200): the
// first iteration, without a prediction, replayed more than the second and
// recorded 1105 positions against 995, so by backward's end the prefetcher
// placed each use about 100 unpacks (150 ms) later than it came, and the
// copy-ins of the first layers' activations (688 MiB each) were held by the
// window until they arrived late: 12-16 ms of unpack stall per step, none
// with the same evictions once positions count backward's own unpacks
// (bench/RESULTS.md, "sched"). Replays run on the thread that unpacks
// (autograd's backward thread), so one count serves.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/backend.h"
#include "core/caching_allocator.h"
#include "core/policy/copy_in_backlog.h"
#include "core/policy/director.h"
#include "core/policy/filters.h"
#include "core/policy/neighbourhood.h"
#include "core/prefetcher.h"
#include "core/residency_entry.h"

namespace membudget {

struct ManagerConfig {
  std::string policy = "delta";
  size_t prefetch_bytes = 256u << 20;  // 0 disables prefetch
  double high_watermark = 0.8;         // of the device budget
  std::string actions = "both";        // swap | recompute | both (the director's choices)
  double link_bytes_per_s = 10e9;      // host link until copies measure it
  bool log_decisions = false;          // one line per eviction on stderr, with its reason
  // Note [Recompute ahead]: the prefetcher also queues dropped entries for
  // replay ahead of use (within the same window).
  bool recompute_ahead = false;
  // Note [Copies ahead where copies are free]: copy to host during forward
  // ahead of need (Note [Copies ahead]), and keep a late H2D link busy past
  // the prefetch window in backward (Note [Link behind]), only where a copy does not take
  // compute's place: a GPU's copy engines, not the CPU backend's memcpy
  // threads, which share the cores' memory bandwidth with compute (a copy
  // beside compute slows it 15-30%, bench/RESULTS.md "Validation, run 2").
  // Measured on the CPU (delta/both, interleaved processes, main with and
  // without copies ahead): GPT-2 at 50% 1.032x -> 1.108x of plain PyTorch
  // (swap-out 628 -> 812 MiB per run), CNN at 70% 0.892x -> 1.003x, at 50%
  // 1.020x -> 1.073x. install() turns it on for CUDA only; the simulator
  // as the device model says (DeviceModel.copies_ahead: off for cpu-host,
  // whatever its calibrated link_compute_share; deriving it from that share
  // turned it on in the simulator on a quiet machine, where a lone copy
  // beside compute measured full rate, and the predictions of issue 4's
  // validation then swapped 111 MiB where the real CNN at 60% swapped 39).
  bool copies_ahead = true;
};

struct ManagerStats {
  size_t live_entries = 0;
  size_t resident_bytes = 0;
  size_t host_bytes = 0;             // entries whose only copy is on host
  size_t host_tier_bytes = 0;        // host copies held (incl. of resident entries)
  size_t evictable_bytes = 0;        // resident, referenced by nobody else
  size_t evictable_host_backed_bytes = 0;
  size_t in_use_bytes = 0;           // resident and referenced elsewhere
  size_t swap_out_bytes = 0;
  size_t swap_out_count = 0;
  size_t swap_in_bytes = 0;
  size_t swap_in_count = 0;
  size_t evicted_bytes = 0;          // device bytes released by eviction
  size_t eviction_count = 0;
  size_t background_swap_count = 0;
  size_t prefetch_issued = 0;
  size_t prefetch_hits = 0;
  size_t prefetch_misses = 0;
  size_t prefetch_window_used_bytes = 0;  // prefetches issued, not yet unpacked (a gauge)
  size_t host_tier_full = 0;         // evictions refused: host tier full
  double stall_seconds = 0.0;        // unpack waiting for a swap-in
  size_t drop_count = 0;             // evictions that dropped (to recompute)
  size_t dropped_bytes = 0;          // bytes now dropped (no copy anywhere)
  size_t planned_drops = 0;          // drops a static plan asked for
  size_t recompute_count = 0;        // dropped entries brought back by replay
  size_t recompute_bytes = 0;
  double recompute_seconds = 0.0;    // wall time spent replaying (Note [Nested replays are timed once])
  // Note [Replay overhead]: what a replay takes beyond its ops' recorded
  // time and its waits for copies, learned (moving average, per replay).
  double replay_overhead_seconds = 0.0;
  // Note [Recompute ahead]
  size_t recomputed_ahead_count = 0; // replays ahead of use completed (also in recompute_count)
  size_t recompute_ahead_failed = 0; // replays ahead that failed (no room): dropped again
  size_t recompute_ahead_wasted = 0; // rebuilt ahead, then evicted again before its use
  size_t evictions_wasted = 0;       // evictions that freed no usable range for their request
  // Host time spent scoring and ranking eviction candidates (wall clock,
  // also in the simulator): what the policy itself costs.
  double policy_seconds = 0.0;
  double link_bytes_per_s = 0.0;     // measured host link bandwidth (EMA)
  uint64_t iteration = 0;
};

// One entry as snapshot() reports it, for tests and debugging.
struct EntryInfo {
  uint64_t id = 0;
  size_t bytes = 0;
  const char* state = "";
  int pins = 0;
  bool externally_referenced = false;
  bool recomputable = false;
  bool host_valid = false;
  uint64_t iteration = 0;
  uint64_t pack_seq = 0;
};

class ResidencyManager final : public Evictor {
 public:
  ResidencyManager(Backend& backend, CachingAllocator& device, CachingAllocator& host_tier,
                   ManagerConfig config);
  ~ResidencyManager() override;

  // Called at pack time for a new entry (the storage's first pack), with the
  // stream its tensor was made on (Note [Copies ordered after the entry's
  // stream]).
  void register_entry(ResidencyEntry* entry, Stream stream = nullptr);
  // Called when another saved view of an already registered storage is packed.
  void touch(ResidencyEntry* entry);
  // Called from the entry's destructor path: waits for its copies, frees its
  // host copy. After this the manager never touches the entry.
  void unregister_entry(ResidencyEntry* entry);
  // Makes the entry resident (swap-in if needed) and returns its device
  // address; then issues prefetches for what the last iteration unpacked next.
  // The caller must reference the storage right after (so it stays resident).
  // The entry stays pinned (never evicted) until unpin().
  // Returns nullptr when the entry is dropped: it is then marked recomputing
  // and pinned, and the caller must replay it, attach the storage and call
  // complete_recompute() (Note [Recompute]).
  void* materialize(ResidencyEntry* entry, Stream stream);
  void unpin(ResidencyEntry* entry);
  // While `reading`, the entry is an input of a replay still running: it
  // may be evicted, but only after every other candidate (Note [Rebuilt
  // inputs let go once read] in csrc/torch/saved_activation.cpp).
  void set_replay_input(ResidencyEntry* entry, bool reading);

  // Declares how the binding could rebuild the entry: whether it can be
  // replayed at all, what its own replay costs, and which managed entries
  // (by id) the replay reads; when it cannot, `reason` says why for the
  // out-of-memory message (Note [Why not recomputable]). Until called, an
  // entry is swap-only. `held`: the unmanaged inputs the replay reads whose
  // data may go (Note [Held inputs freed under us] in residency_entry.h).
  void set_recompute_info(ResidencyEntry* entry, bool recomputable, double replay_seconds,
                          const std::vector<uint64_t>& input_ids, std::string reason = {},
                          HeldInputs held = {});
  // Whether a write about to change a held input the entry's replay reads
  // should leave the entry as it is rather than rebuild it first: it, or a
  // dropped ancestor its rebuild would replay, is dropped and had a held
  // input's storage freed since (Note [Writes that refill a freed input] in
  // residency_entry.h).
  bool reads_refilled_input(ResidencyEntry* entry);
  // A static plan wants this entry dropped (not stashed): it is dropped as
  // soon as nothing else references it. Returns false when it cannot be
  // (not recomputable, or recomputation not allowed by the actions).
  bool plan_drop(ResidencyEntry* entry);
  // Drops the planned entries nothing else references now, rather than at
  // the next pack (a plan made where no pack follows: the last selective
  // checkpoint region of a forward).
  void drop_planned_now();
  // Ends a recompute begun by materialize(): on success the caller has
  // attached the new device copy; `seconds` is the replay's duration.
  void complete_recompute(ResidencyEntry* entry, bool succeeded, double seconds);
  // Note [Dropped ancestors rebuilt in order]: the entry a replay begun by
  // materialize() rebuilds and its dropped ancestors (inputs that are
  // dropped, their dropped inputs, ...), each once, every one after all of
  // its inputs: the entry itself last. Each comes with the managed inputs
  // its replay reads.
  struct ReplayStep {
    uint64_t id;
    std::vector<uint64_t> inputs;
  };
  std::vector<ReplayStep> replay_order(const ResidencyEntry* entry) const;

  // Note [Recompute ahead]. The ids of the entries the prefetcher queued for
  // replay ahead of use since the last call (the queue is emptied); each is
  // recomputing and pinned until begun and completed, or unpacked.
  std::vector<uint64_t> take_recompute_ahead();
  // Whether anything is queued for replay ahead (cheap; no lock).
  bool recompute_ahead_pending() const { return ahead_pending_.load(std::memory_order_relaxed); }
  // Starts the replay of a queued entry: false when it is no longer queued
  // (unpacked meanwhile, or gone); then the caller must not replay it. Until
  // complete_recompute_ahead, evictions spare entries needed sooner than it.
  bool begin_recompute_ahead(ResidencyEntry* entry);
  // Ends it: on success the caller has attached the new device copy, and
  // `ready` (null: ready now) completes when the replay's work has run; the
  // unpack waits for it as for a swap-in. On failure the entry is dropped again.
  void complete_recompute_ahead(ResidencyEntry* entry, bool succeeded, double seconds, EventPtr ready);
  // Whether materialize() of this entry would wait for a copy still in
  // flight (a swap-in not complete): where the host backend's compute thread
  // has nothing to do but could replay ahead instead.
  bool copy_pending(ResidencyEntry* entry);

  // Evictor: releases evictable entries until `bytes_needed` are freed. The
  // requesting stream orders nothing: each copy follows its entry's stream,
  // and is waited for before its block is freed.
  size_t evict(size_t bytes_needed, Stream stream) override;
  std::string describe_evictable() const override;
  // Appended to describe_evictable(), and so to every out-of-memory message:
  // what the Python side knows that bears on the failure (how compiled
  // graphs were cut to fit the budget). Empty: nothing appended.
  void set_out_of_memory_note(std::string note);

  // Frees the device copies of all evictable entries (swapping those without
  // a host copy); returns bytes freed. For tests and explicit offload.
  size_t evict_all();
  // Blocks until all in-flight copies are complete.
  void synchronize();

  ManagerStats stats() const;
  std::vector<EntryInfo> snapshot() const;
  void reset_counters();
  // Forgets the recorded unpack order (a new model or a new install).
  void reset_prediction();
  void set_config(const ManagerConfig& config);
  const ManagerConfig& config() const { return config_; }

 private:
  // All private methods assume mutex_ is held.
  void reap_completed_copies();
  void finish_copy(ResidencyEntry* entry);
  // A dropped entry rebuilt, on demand or ahead (its replay already ended:
  // no longer in replays_in_progress_): out of the dropped set and its
  // neighbourhood, into the recompute counters (`seconds` only if no other
  // replay holds this one, Note [Nested replays are timed once]).
  void note_rebuilt(ResidencyEntry* entry, double seconds);
  // materialize(): waits on the entry's copy_event_ (a swap-in, or a replay
  // ahead on a side stream), counting the stall and the prefetch hit.
  void wait_for_arrival(ResidencyEntry* entry, Stream stream, bool was_prefetched);
  // Evictable entries the director may release, best victim first for a
  // request still missing `bytes_wanted` (0: unknown), sparing those needed
  // no later than `min_next_use` unpacks from now (-1: none spared).
  std::vector<EvictionCandidate> candidates(int64_t min_next_use, size_t bytes_wanted = 0);
  // Sorts [first, last) in the filter's order for a request still missing
  // `bytes_wanted` (Note [Bytes a request needs]).
  void rank_candidates(std::vector<EvictionCandidate>::iterator first,
                       std::vector<EvictionCandidate>::iterator last, size_t bytes_wanted) const;
  // The candidate's facts (the filter scores them) and the director's choice
  // for it (also returned through `decision` when given), its copy-in priced
  // against `backlog` when given (Note [Copy-in backlog]).
  EvictionCandidate make_candidate(ResidencyEntry* entry, Decision* decision = nullptr,
                                   const CopyInBacklog* backlog = nullptr);
  // Note [Iterations]: the order recorded so far becomes the prediction,
  // pack sequence numbers restart at 0.
  void start_iteration();
  // Backward's copy-ins as they stand: the entries on host with a predicted
  // use, and with `with_planned` also those with a host copy or one under
  // way, as if evicted (Note [Copies ahead]).
  CopyInBacklog copy_in_backlog(bool with_planned) const;
  // Bytes of the copies in flight in `state`: swapping_out is what the D2H
  // stream holds, swapping_in what the H2D stream holds.
  size_t queued_copy_bytes(Residency state) const;
  // Seconds between the start of copy-ins (now in backward, the end of
  // forward during it) and a use `distance` predicted unpacks away.
  double seconds_available_for_copy_in(int64_t distance) const;
  // Note [Copies ahead]: starts copy-outs during forward, below the
  // watermark, of entries likely to be evicted whose copy-in backward can hide.
  void start_copies_ahead();
  // Seconds the entry would cost to bring back without a host copy: its
  // copy over the link, or its replay when cheaper and allowed.
  double loss_without_host_copy(const ResidencyEntry* entry) const;
  bool ensure_host_slot(ResidencyEntry* entry);
  // Drops the entry's prefetch mark and its share of the window; returns
  // whether it was marked.
  bool clear_prefetch(ResidencyEntry* entry);
  // Queues the device->host copy into the entry's host slot, after the
  // entry's stream (Note [Copies ordered after the entry's stream]), and
  // counts it. `waited_at_once`: the caller waits for the copy right away
  // (Note [Waiter runs the copy]).
  EventPtr copy_out(ResidencyEntry* entry, bool waited_at_once = false);
  size_t release_device_copy(ResidencyEntry* entry);
  // Waits for a copy, counting the wait in blocked_seconds_ (Note [Replay
  // overhead]); returns its seconds.
  double wait_blocked(const EventPtr& event);
  // An unpack's wait since `start`: a stall, and blocked time too.
  void note_stall_since(std::chrono::steady_clock::time_point start);
  // False only for a prefetch (wait == false) that found no room.
  bool swap_in(ResidencyEntry* entry, Stream stream, bool wait);
  void maybe_start_background_swaps();
  // evict() without the lock and without recording the request.
  size_t evict_for(size_t bytes_needed);
  // What the first candidates in `ordered` cost that together hold `bytes`,
  // what a request misses beyond the memory free now (Note [One victim that
  // costs more]).
  static double cost_to_cover(const std::vector<EvictionCandidate>& ordered, size_t bytes);
  // Whether releasing c waits for a copy to host (Note [A copy on the allocation path]).
  static bool copies_before_release(const EvictionCandidate& c);
  // Re-prices *c, ranked as a drop, and re-ranks [c, last) if it would now
  // be copied out (Note [A drop that became a copy]).
  bool copy_now_chosen(std::vector<EvictionCandidate>::iterator c, std::vector<EvictionCandidate>::iterator last,
                       size_t bytes_wanted);
  // Records an eviction request for the next iteration's background target
  // (Note [Requests to come]).
  void note_request(size_t bytes_needed, size_t freed);
  // The bytes the background copies should cover from here on: what the
  // previous iteration's evictions from this pack on released (Note
  // [Requests to come], Note [Evictions still to come]).
  size_t request_to_cover() const;
  // The budget, or the device's memory when that is smaller: what the
  // watermark and the prefetch window are fractions of.
  size_t effective_budget() const;
  // Whether a prefetch `distance` unpacks ahead would arrive late even if
  // issued now (Note [Due prefetches]): then the window does not hold it back.
  bool prefetch_is_due(const ResidencyEntry* entry, int64_t distance) const;
  // An entry just swapped out: the prefetch cursor goes back to its next use
  // if it had passed it (Note [Prefetch cursor]).
  void rewind_prefetch_cursor(const ResidencyEntry* entry);
  // Whether a copy-out of the candidate queued behind `d2h_queued_bytes`
  // would end only after its predicted next use (Note [Late background copies]).
  bool copy_ends_after_next_use(const EvictionCandidate& c, size_t d2h_queued_bytes) const;
  void issue_prefetches(Stream stream);
  // Note [Recompute ahead]: whether a dropped entry may be replayed ahead
  // now (allowed, recomputable, every managed input resident).
  bool may_recompute_ahead(const ResidencyEntry* entry) const;
  void queue_recompute_ahead(ResidencyEntry* entry);
  // Queues the dropped entries used within the next few predicted unpacks
  // that free memory and the prefetch window hold.
  void queue_replays_ahead(int64_t now, size_t window);
  void unqueue_recompute_ahead(ResidencyEntry* entry);
  // An entry rebuilt ahead leaves the device before its use.
  void note_evicted_before_use(ResidencyEntry* entry);
  bool is_evictable(const ResidencyEntry* entry) const;
  // Recompute and the director (residency_recompute.cpp).
  ResidencyEntry* find(uint64_t id) const;
  // Whether dropping the entry now leaves a replay that can run: recomputable,
  // every held input present, and so for each dropped ancestor the replay
  // would rebuild (Note [Held inputs freed under us] in residency_entry.h).
  bool replayable_now(const ResidencyEntry* entry) const;
  // Whether `test` holds for the entry or for a dropped ancestor its rebuild
  // would replay (each visited once); with `every_ancestor`, for any managed
  // ancestor, dropped or not: those a rebuild may come to replay.
  bool any_in_rebuild(const ResidencyEntry* entry, bool (*test)(const ResidencyEntry*),
                      bool every_ancestor = false) const;
  static bool held_inputs_present(const ResidencyEntry* entry);
  // Note [Writes that refill a freed input] (residency_entry.h). At every
  // pack and unpack: returns at once while nothing is watched.
  void watch_held_inputs();
  // Keeps in `watched` the entries `watching` still holds whose held inputs
  // are all present; marks those it holds that lost one, and lets go of both.
  void watch(std::vector<uint64_t>& watched, bool (*watching)(const ResidencyEntry*));
  // Marks an entry whose held input has no storage now (Note [Writes that
  // refill a freed input]); from then on resident entries are watched too.
  void note_held_freed(ResidencyEntry* entry);
  // Its replay's cost with dropped ancestors' replays and host inputs'
  // copy-ins, each replay with the learned overhead (Note [Replay
  // overhead]); `replays`, when given, counts the replays it comprises.
  double recompute_total(const ResidencyEntry* entry, std::vector<uint64_t>& visited, int* replays = nullptr) const;
  // Note [Replay overhead]: a replay on demand begins (timed against its estimate).
  void begin_replay_estimate(ResidencyEntry* entry);
  std::vector<uint64_t> dropped_neighbours(const ResidencyEntry* entry) const;
  double seconds_until_next_use(const EvictionCandidate& candidate) const;
  // Note [Pressure horizon]: in backward, predicted seconds until the last
  // position where backward had to evict; -1 in forward or without a prediction.
  double seconds_of_pressure() const;
  Decision decide_for(const ResidencyEntry* entry, const EvictionCandidate& candidate,
                      const CopyInBacklog* backlog = nullptr) const;
  size_t drop_for_recompute(ResidencyEntry* entry);
  // Waits for entry's copy-out if one is in flight (the wait is logged) and
  // completes it; before its device copy is released or dropped.
  void finish_copy_out_in_flight(ResidencyEntry* entry);
  void drop_planned();
  void log_decision(const ResidencyEntry* entry, const EvictionCandidate& c, const Decision& d) const;
  // MEMBUDGET_LOG=decisions: an eviction waited `seconds` for `copy`, the
  // entry's own or (entry null) every copy in flight.
  void log_copy_wait(const ResidencyEntry* entry, double seconds, const char* copy) const;
  void note_copy_time(size_t bytes, double seconds);
  // `paused` seconds of the gap since `last` are left out of the sample.
  void note_interval(double& ema, std::chrono::steady_clock::time_point& last, double paused = 0.0);
  // Waits for copies and on-demand replays so far (Note [Pace of backward's
  // own ops]).
  double paused_seconds() const { return blocked_seconds_ + replayed_seconds_; }

  Backend& backend_;
  CachingAllocator& device_;
  CachingAllocator& host_tier_;
  ManagerConfig config_;
  std::unique_ptr<Filter> filter_;

  mutable std::recursive_mutex mutex_;
  std::unordered_set<ResidencyEntry*> entries_;
  std::unordered_map<uint64_t, ResidencyEntry*> by_id_;
  std::vector<ResidencyEntry*> planned_;          // plan_drop()ped, not yet droppable
  AllowedActions allowed_;
  std::string out_of_memory_note_;
  EvictedNeighbourhoods neighbourhoods_;
  size_t dropped_entries_ = 0;                    // entries dropped or recomputing
  bool host_tier_blocked_ = false;                // candidates() skipped one: host tier full
  double link_bytes_per_s_ = 10e9;
  double pack_interval_s_ = 0.0;                  // EMA between packs of one forward
  double unpack_interval_s_ = 0.0;                // EMA between unpacks of one backward
  // Note [Replay overhead]: a replay is priced by what its ops took when
  // forward recorded them, but a replay on demand costs more: on the CPU the
  // replay path (Python, rebuilding the arguments, first touch of a fresh
  // allocation) took 1.5-3x the estimate in real GPT-2 runs (at 50% of its
  // peak, 4 replays a step: 4.9 ms against 2.9 estimated; at 60%, 1.4 ms
  // against 0.5), so delta dropped where a swap was cheaper. Each replay on
  // demand is timed from materialize() to complete_recompute(); less its
  // estimate then and less the manager's waits for copies in between (its
  // inputs' swap-ins, its allocation's evictions: priced where they are
  // chosen, and they would happen without the replay too), per replay of
  // the chain, it feeds this moving average (either sign; counted from 0
  // up), which recompute_total() adds to every replay it prices.
  double replay_overhead_s_ = 0.0;
  double blocked_seconds_ = 0.0;                  // waits for copies, all told (Note [Replay overhead])
  // On-demand replays, all told, less the waits for copies within them
  // (counted in blocked_seconds_): with those, the time between unpacks
  // that is not backward's own work (Note [Pace of backward's own ops]).
  double replayed_seconds_ = 0.0;
  std::chrono::steady_clock::time_point last_pack_{};
  std::chrono::steady_clock::time_point last_unpack_{};
  double paused_at_last_unpack_s_ = 0.0;  // paused_seconds() then
  // The mean gap between unpacks of the last completed backward, and what
  // measures the current one (Note [Copy-in pace]).
  double mean_unpack_interval_s_ = 0.0;
  std::chrono::steady_clock::time_point first_unpack_{};
  double paused_at_first_unpack_s_ = 0.0;
  int64_t unpacks_this_backward_ = 0;
  uint64_t packs_last_iteration_ = 0;
  // The largest request forward's evictions served, this iteration and the
  // previous one (Note [Background target]).
  size_t largest_forward_request_ = 0;
  size_t largest_forward_request_last_iteration_ = 0;
  // Note [Requests to come]: the eviction requests of this iteration by the
  // pack count at which they came (in forward what they released, all told,
  // Note [Requests between two packs]; backward's, the largest, at the end
  // of forward), and over the previous iteration, at index s, all of those
  // from pack count s on, added up (Note [Evictions still to come]).
  std::vector<size_t> requests_by_pack_;
  std::vector<size_t> requests_to_come_;
  bool requests_to_come_known_ = false;  // an iteration has ended since construction or reset_prediction
  size_t evicted_this_iteration_ = 0;             // device bytes evicted (swapped or dropped)
  size_t evicted_last_iteration_ = 0;             // the same, over the previous iteration
  std::vector<ResidencyEntry*> in_flight_;        // entries with a copy_event_
  std::vector<ResidencyEntry*> by_seq_;           // this iteration's entries by pack seq
  // Dropped entries whose probes are watched (Note [Writes that refill a
  // freed input] in residency_entry.h), by id; resident ones with held
  // inputs, watched once a held input was found freed.
  std::vector<uint64_t> watched_drops_;
  std::vector<uint64_t> watched_resident_;
  bool held_freed_seen_ = false;
  UnpackOrder order_;
  uint64_t clock_ = 0;
  uint64_t iteration_ = 0;
  uint64_t packs_this_iteration_ = 0;
  bool unpacked_since_pack_ = false;
  int64_t prefetch_cursor_ = 0;
  int replays_in_progress_ = 0;                   // begun and not completed (Note [Replay inputs])
  uint64_t backward_start_clock_ = 0;             // clock_ before this backward's first unpack
  size_t prefetch_outstanding_bytes_ = 0;
  int64_t eviction_horizon_ = -1;                 // during prefetch: protect nearer uses
  std::vector<ResidencyEntry*> ahead_queue_;      // Note [Recompute ahead]
  std::atomic<bool> ahead_pending_{false};        // ahead_queue_ is not empty
  ManagerStats counters_;
};

}  // namespace membudget
