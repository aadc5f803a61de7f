// Filters: score eviction candidates; the highest score is released first.
// Torch-free and device-free: they see only sizes, clocks and predictions.
//
//   lru      least recently packed/unpacked first.
//   largest  largest first (fewest evictions per byte).
//   delta    (default) byte-seconds freed per second of cost: bytes times
//            the predicted time until the next use (previous iteration's
//            unpack order at the measured pace), over the stall of the
//            director's action plus the evicted-neighbourhood cost (as dtr;
//            none for a host-backed release, Note [Host-backed victims]).
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
//
// Note [Pressure horizon]: byte-seconds are worth something only while
// memory is short. In backward, the previous iterations say where backward
// last had to evict (Note [Eviction pressure] in prefetcher.h); past that
// point memory freed serves no one, so a candidate's horizon is cut there
// (EvictionCandidate::seconds_of_pressure). Without the cut, at the loss's
// 1.5-2 GB requests at the start of backward (GPT-2, BERT on h200, the last
// evictions of the step), delta dropped activations needed last in backward
// with 3-4x the replay per byte of ones needed a few unpacks later, whose
// memory would have been free just as long where it mattered. The same
// knowledge settles what a drop costs: replaying it rebuilds its dropped
// ancestors, but they are dropped and so replayed at their own use anyway;
// rebuilt earlier they stay until then unless memory runs short in
// between. When the candidate's next use lies past the end of pressure it
// is priced by its own replay (the DTR neighbourhood term stays); before,
// by its replay with theirs (recompute_seconds), as they may be dropped
// again. Counting them always made delta keep 384 MiB activations with
// long chains (8-10 ms priced, far less paid) and drop many small ones
// needed soon (BERT at 40% on h200: 1.077 of the floor against 1.048).
// Only in backward: in forward, where backward's pressure will fall depends
// on what forward evicts (cut there too, Llama-7B at 40% went from 1.094
// to 1.109 of the floor). Measured in the simulator (bench/RESULTS.md,
// "delta against dtr on h200").
//
// Note [Host-backed victims]: DTR's neighbourhood term prices what a drop
// chains onto the replays of its dropped lineage neighbours. A victim whose
// host copy is already valid and whose director's choice is the swap is not
// dropped: its device copy is released, it joins no neighbourhood
// (EvictedNeighbourhoods grows only on drops), and bringing it back is a
// copy-in whatever its neighbours' state; a dropped dependent's replay that
// reads it is an unpack like any other, in the predicted order its copy-in
// is priced against (cost_seconds). So delta leaves the term out for it.
// With the term, at ResNet-50 at 40% on h200 delta passed over 49 MiB
// activations copied ahead for exactly this (cost 0, neighbourhood
// 0.5-0.7 ms) and dropped other 49 MiB ones (0.1 ms of replay each) in
// their place: 1.0723 of the floor against dtr's 1.0708, 1.0627 without
// it; Llama-7B at 40% 1.0886 -> 1.0693 (bench/RESULTS.md, "r50"). A swap
// whose copy-out is still to come keeps the term: until the copy exists
// its release may still end in a drop (no host slot), and leaving it out
// there too reordered background copy-outs on the CPU model (GPT-2 at 50%
// 1.0152 -> 1.0193 of plain PyTorch) for no gain on h200. dtr keeps DTR's
// published score.
//
// Note [Bytes a request needs]: the eviction loop asks the filter again as
// the bytes still missing shrink (FilterContext::bytes_wanted). Where the
// pressure horizon says memory is short no longer than the request itself,
// the bytes of a victim beyond what the request misses count only for the
// rest of the pressure (often nothing), not as needed now: a 24.5 MiB
// prefetch at ResNet-50 80% (h200) dropped a 98 MiB activation (0.106 ms
// replay) where a 49 MiB one (0.058 ms) was enough. Not in forward, where
// the excess serves the next requests (ResNet-50 at 80% then dropped 13
// tensors of 24-98 MiB in place of 3 of 196 MiB: 1.029 of the floor, not 1.016).
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
  // In backward, predicted seconds until the last position where backward
  // had to evict, 0 once past it (Note [Pressure horizon]); -1 in forward
  // and without a prediction: unknown.
  double seconds_of_pressure = -1.0;
  bool recomputable = false;
  double recompute_seconds = 0.0;     // replay incl. dropped ancestors
  double replay_seconds = 0.0;        // its own replay alone (Note [Pressure horizon])
  double neighbourhood_seconds = 0.0; // dtr: evicted-neighbourhood cost
  double cost_seconds = 0.0;          // the director's chosen action's stall
  double copy_seconds = 0.0;          // one copy over the host link (scale)
  bool swap_chosen = false;           // the director would swap it (not recompute)
};

struct FilterContext {
  uint64_t clock = 0;          // current logical clock
  uint64_t packs_this_iteration = 0;
  // Bytes the request being served still misses (0: unknown, e.g. ranking
  // for background copies); Note [Bytes a request needs].
  size_t bytes_wanted = 0;
};

class Filter {
 public:
  virtual ~Filter() = default;
  virtual const char* name() const = 0;
  virtual double score(const EvictionCandidate& candidate, const FilterContext& context) const = 0;
  // Whether score() reads FilterContext::bytes_wanted (then the eviction
  // loop ranks again after each victim, Note [Bytes a request needs]).
  virtual bool weighs_bytes_wanted() const { return false; }
};

// Names accepted by make_filter, in documentation order.
const std::vector<std::string>& filter_names();
// Throws std::invalid_argument listing the accepted names.
std::unique_ptr<Filter> make_filter(const std::string& name);

}  // namespace membudget
