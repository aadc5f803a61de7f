#include "core/policy/filters.h"

#include <algorithm>
#include <cmath>
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
  double score(const EvictionCandidate& c, const FilterContext& ctx) const override {
    // Without a prediction, backward unpacks in reverse pack order, so the
    // earliest packed tensor is needed last.
    double distance = c.next_use_distance >= 0
                          ? static_cast<double>(c.next_use_distance)
                          : static_cast<double>(ctx.packs_this_iteration - c.pack_seq);
    // Bytes freed per second of the stall the director's action would cost
    // (Capuchin's measure), weighted by the square root of the distance to
    // the predicted next use. Simulated on h200 (bench/RESULTS.md), the
    // square root beat a linear Belady weight and a size-only weight.
    double stall = c.cost_seconds + 1e-9;
    return std::sqrt(distance + 1.0) * static_cast<double>(c.bytes) / stall;
  }
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
