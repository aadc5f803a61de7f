#include "core/policy/filters.h"

#include <algorithm>
#include <stdexcept>

namespace membudget {
namespace {

class LruFilter final : public Filter {
 public:
  const char* name() const override { return "lru"; }
  double score(const EvictionCandidate& c, const FilterContext& ctx) const override {
    return static_cast<double>(ctx.clock - c.last_access);
  }
};

class LargestFilter final : public Filter {
 public:
  const char* name() const override { return "largest"; }
  double score(const EvictionCandidate& c, const FilterContext&) const override {
    return static_cast<double>(c.bytes);
  }
};

class DeltaFilter final : public Filter {
 public:
  const char* name() const override { return "delta"; }
  bool weighs_bytes_wanted() const override { return true; }
  double score(const EvictionCandidate& c, const FilterContext& ctx) const override {
    // Cost-aware Belady: memory freed, in byte-seconds until the predicted
    // next use, per second of what bringing it back costs. The time (not the
    // count of unpacks) is what matters: during forward every candidate is
    // away at least for the rest of forward, so the unpack order alone
    // overstated the gap between near and far ones. The cost is the
    // director's action plus, as in DTR, the replays of the evicted
    // neighbourhood a drop would chain onto (Note [Delta score]). Where
    // backward's pressure is known to end, memory free past that point
    // counts for nothing, nor do bytes the request does not miss, nor the
    // replays of dropped ancestors that rebuilding it only brings forward
    // (Note [Pressure horizon], Note [Bytes a request needs]).
    const bool pressure_known = c.seconds_of_pressure >= 0.0;
    const double until = pressure_known ? std::min(c.seconds_until_next_use, c.seconds_of_pressure)
                                        : c.seconds_until_next_use;
    const double bytes = static_cast<double>(c.bytes);
    const double missing = pressure_known && ctx.bytes_wanted > 0
                               ? std::min(bytes, static_cast<double>(ctx.bytes_wanted)) : bytes;
    // What the request misses is needed now (hence the minimum horizon);
    // the rest only helps while pressure lasts.
    const double freed = missing * (until + kMinHorizonSeconds) + (bytes - missing) * until;
    const bool ancestors_only_move = pressure_known && c.seconds_until_next_use >= c.seconds_of_pressure;
    const double action = !c.swap_chosen && ancestors_only_move ? c.replay_seconds : c.cost_seconds;
    // A device copy backed by a valid host copy is released, not dropped:
    // it joins no evicted neighbourhood (Note [Host-backed victims]).
    const bool released_not_dropped = c.swap_chosen && c.host_valid;
    const double neighbourhood = released_not_dropped ? 0.0 : c.neighbourhood_seconds;
    const double cost = action + neighbourhood + kTinySeconds;
    return freed / cost;
  }
  // Keeps the score ordered by bytes per second of cost when no pace has
  // been measured yet (first iteration: every horizon is 0).
  static constexpr double kMinHorizonSeconds = 1e-6;
  static constexpr double kTinySeconds = 1e-9;
};

// Smallest h = (c + neighbourhood) / (m * staleness) evicts first, so the
// score is its inverse.
class DtrFilter final : public Filter {
 public:
  const char* name() const override { return "dtr"; }
  double score(const EvictionCandidate& c, const FilterContext& ctx) const override {
    double staleness = static_cast<double>(ctx.clock - c.last_access) + 1.0;
    double cost = c.cost_seconds + c.neighbourhood_seconds + kTinySeconds;
    return static_cast<double>(c.bytes) * staleness / cost;
  }
  static constexpr double kTinySeconds = 1e-9;
};

class MspsFilter final : public Filter {
 public:
  const char* name() const override { return "msps"; }
  double score(const EvictionCandidate& c, const FilterContext&) const override {
    return static_cast<double>(c.bytes) / (c.cost_seconds + 1e-9);
  }
};

}  // namespace

const std::vector<std::string>& filter_names() {
  static const std::vector<std::string> names = {"delta", "dtr", "msps", "lru", "largest"};
  return names;
}

std::unique_ptr<Filter> make_filter(const std::string& name) {
  if (name == "delta") return std::make_unique<DeltaFilter>();
  if (name == "dtr") return std::make_unique<DtrFilter>();
  if (name == "msps") return std::make_unique<MspsFilter>();
  if (name == "lru") return std::make_unique<LruFilter>();
  if (name == "largest") return std::make_unique<LargestFilter>();
  std::string accepted;
  for (const auto& n : filter_names()) accepted += (accepted.empty() ? "" : ", ") + n;
  throw std::invalid_argument("unknown eviction policy '" + name + "': accepted are " + accepted);
}

}  // namespace membudget
