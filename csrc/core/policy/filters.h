// Filters: score eviction candidates; the highest score is released first.
// Torch-free and device-free: they see only sizes, clocks and predictions.
//
//   lru      least recently packed/unpacked first.
//   largest  largest first (fewest evictions per byte).
//   delta    (default) byte-seconds freed per second of cost: bytes times
//            the predicted time until the next use (previous iteration's
//            unpack order at the measured pace), over the stall of the
//            director's action plus the evicted-neighbourhood cost (as dtr).
//   dtr      Dynamic Tensor Rematerialization (Kirisame et al. 2021): evict
//            the smallest h = (c + neighbourhood cost) / (m * staleness), where
//            c is its cost to bring back and the neighbourhood cost sums the
//            equivalence classes (union-find) of already evicted neighbours.
//   msps     Capuchin's memory saved per second: m / cost to bring back.
//
// "Cost to bring back" (EvictionCandidate::cost_seconds) is the director's
// choice for the candidate: its swap stall, or its replay time including
// dropped ancestors, whichever the director would pick.
//
// Note [Delta score]: evicting m bytes until their next use, t seconds
// away, frees m*t byte-seconds, for the cost c of bringing them back (the
// director's choice: swap stall or replay incl. dropped ancestors) plus what
// dropping it adds to the replays of its dropped lineage neighbours (DTR's
// neighbourhood). Smallest cost per byte-second goes first (Belady weighted
// by cost). Measured on h200 in the simulator (bench/RESULTS.md, run 3)
// against the square root of the unpack distance it replaced.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace membudget {

class ResidencyEntry;

struct EvictionCandidate {
  ResidencyEntry* entry = nullptr;
  size_t bytes = 0;
  bool host_valid = false;     // releasing it costs no copy
  uint64_t last_access = 0;    // logical clock
  uint64_t pack_seq = 0;       // pack order within its iteration
  // Unpacks until its predicted next use; -1 when no prediction exists yet
  // (first iteration): then backward's reverse order is assumed.
  int64_t next_use_distance = -1;
  // Predicted seconds until that use: the unpacks to it at the measured pace
  // of backward, plus what remains of forward (0 while nothing is measured).
  double seconds_until_next_use = 0.0;
  bool recomputable = false;
  double recompute_seconds = 0.0;     // replay incl. dropped ancestors
  double neighbourhood_seconds = 0.0; // dtr: evicted-neighbourhood cost
  double cost_seconds = 0.0;          // the director's chosen action's stall
  double copy_seconds = 0.0;          // one copy over the host link (scale)
  bool swap_chosen = false;           // the director would swap it (not recompute)
};

struct FilterContext {
  uint64_t clock = 0;          // current logical clock
  uint64_t packs_this_iteration = 0;
};

class Filter {
 public:
  virtual ~Filter() = default;
  virtual const char* name() const = 0;
  virtual double score(const EvictionCandidate& candidate, const FilterContext& context) const = 0;
};

// Names accepted by make_filter, in documentation order.
const std::vector<std::string>& filter_names();
// Throws std::invalid_argument listing the accepted names.
std::unique_ptr<Filter> make_filter(const std::string& name);

}  // namespace membudget
