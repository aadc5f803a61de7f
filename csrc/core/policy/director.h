// Director: for one eviction victim, swap it to host or drop it to recompute
// later (DESIGN.md "The core", step 4). Torch-free and device-free: it sees
// only the facts the residency manager measured.
//
// The expected stall of each action:
//   swap      copy-out on the allocation path (unless a host copy exists),
//             behind whatever the D2H stream already queued, plus the part of
//             the copy-in (behind the H2D queue) that the time until the
//             tensor's predicted next use cannot hide, or, when the manager
//             knows backward's backlog, what the copy-in adds to backward's
//             stall (Note [Copy-in backlog] in copy_in_backlog.h);
//   recompute its replay time, including replays of dropped ancestors.
// Both wait first for a copy-out of the victim already under way (Note
// [Copy under way] in director.cpp).
// The smaller wins (a valid host copy only makes the copy-out free); a
// victim that cannot be replayed is swapped, and one
// that finds the host tier full is recomputed. MEMBUDGET_ACTIONS restricts
// the choice (an entry allowed no action is not evicted).
#pragma once
#include <cstddef>
#include <string>

namespace membudget {

enum class EvictionAction { swap, recompute, none };

struct AllowedActions {
  bool swap = true;
  bool recompute = true;
  // "swap", "recompute" or "both"; throws std::invalid_argument otherwise.
  static AllowedActions parse(const std::string& text);
};

struct VictimFacts {
  size_t bytes = 0;
  bool host_valid = false;              // a complete host copy exists
  // Its copy-out is under way (a background swap-out): the device memory
  // is read by that copy and frees only once it ends, whatever the action
  // (Note [Copy under way]).
  bool copy_out_in_flight = false;
  bool host_room = true;                // the host tier can take it
  bool recomputable = false;
  double recompute_seconds = 0.0;
  double link_bytes_per_s = 1.0;        // measured host link bandwidth
  size_t d2h_queued_bytes = 0;
  size_t h2d_queued_bytes = 0;
  double seconds_until_next_use = -1.0; // -1: unknown (assume immediate)
  // The copy-in's stall against backward's whole backlog (Note [Copy-in
  // backlog]); -1: unknown, then the copy-in behind the H2D queue is
  // hidden by seconds_until_next_use only.
  double copy_in_stall_seconds = -1.0;
};

struct Decision {
  EvictionAction action = EvictionAction::none;
  double swap_stall_seconds = 0.0;
  double recompute_stall_seconds = 0.0;
  const char* reason = "";
  bool host_tier_blocked = false;  // none, only because the host tier is full
  // The stall of the chosen action (0 for none).
  double chosen_seconds() const;
};

Decision decide(const VictimFacts& facts, const AllowedActions& allowed);
const char* action_name(EvictionAction action);

}  // namespace membudget
