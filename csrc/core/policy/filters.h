// Filters: score eviction candidates; the highest score is released first.
// Torch-free and device-free: they see only sizes, clocks and predictions.
//
//   lru      least recently packed/unpacked first.
//   largest  largest first (fewest evictions per byte).
//   delta    (default) Belady-style: the candidate whose predicted next use is
//            farthest away (from the previous iteration's unpack order), with
//            candidates that already have a host copy (free to release)
//            favoured 2x and larger ones favoured by sqrt(size).
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
