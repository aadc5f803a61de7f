// CopyInBacklog: what bringing one more entry back from host would cost
// backward, given everything already on host (DESIGN.md "The core", steps
// 4-5). Torch-free and device-free: it sees only sizes, times and the link.
//
// Note [Copy-in backlog]: backward's swap-ins share one host-to-device
// link, served in the order backward needs them (the prefetcher walks the
// predicted unpack order). Entry i, needed `a_i` seconds after copy-ins can
// start, arrives at C_i = (queued + sum of the bytes needed no later than
// it) / link; if it is late the compute stream waits, and every later need
// moves by as much, so the whole backward loses the largest lateness,
// max_i (C_i - a_i), not their sum. The stall of swapping one more entry is
// therefore what it adds to that maximum: its own lateness, and the delay it
// puts in front of every entry needed after it. Pricing a swap by its own
// copy alone (the director's first estimate) made every swap look hidden
// during forward, where backward is seconds away, and oversubscribed the
// link in backward (bench/RESULTS.md, "Simulated policies, run 4": "tried
// and not kept"). Device memory for the copies is not modelled: the
// prefetcher's window and room can only make them later, so this is the
// least stall a swap adds.
#pragma once
#include <cstddef>
#include <vector>

namespace membudget {

class CopyInBacklog {
 public:
  // `queued_bytes` are already on the link; `link_bytes_per_s` its rate.
  CopyInBacklog(size_t queued_bytes, double link_bytes_per_s);
  // An entry on host of `bytes`, needed `seconds_available` after copy-ins
  // can start.
  void add(double seconds_available, size_t bytes);
  // Call after the last add() and before stall_*().
  void seal();
  // Seconds of backward lost to late copy-ins with what was added.
  double stall_seconds() const;
  // The latest of all arrivals relative to its need, in seconds (negative:
  // the earliest slack; -infinity when nothing was added).
  double max_lateness_seconds() const;
  // What adding one more entry would add to stall_seconds().
  double added_stall_seconds(double seconds_available, size_t bytes) const;
  bool empty() const { return needs_.empty(); }

 private:
  struct Need {
    double available;
    double bytes;
  };
  double queued_bytes_;
  double link_bytes_per_s_;
  std::vector<Need> needs_;           // by `available`, after seal()
  std::vector<double> bytes_before_;  // bytes_before_[i]: queued + needs_[0..i) bytes
  std::vector<double> late_prefix_;   // late_prefix_[i]: max lateness of needs_[0..i), or -inf
  std::vector<double> late_suffix_;   // late_suffix_[i]: max lateness of needs_[i..), or -inf
};

}  // namespace membudget
