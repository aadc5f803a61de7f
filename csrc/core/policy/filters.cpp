#include "core/policy/filters.h"

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
    double cost_factor = c.host_valid ? 2.0 : 1.0;
    return (distance + 1.0) * cost_factor * std::sqrt(static_cast<double>(c.bytes));
  }
};

}  // namespace

const std::vector<std::string>& filter_names() {
  static const std::vector<std::string> names = {"delta", "lru", "largest"};
  return names;
}

std::unique_ptr<Filter> make_filter(const std::string& name) {
  if (name == "delta") return std::make_unique<DeltaFilter>();
  if (name == "lru") return std::make_unique<LruFilter>();
  if (name == "largest") return std::make_unique<LargestFilter>();
  std::string accepted;
  for (const auto& n : filter_names()) accepted += (accepted.empty() ? "" : ", ") + n;
  throw std::invalid_argument("unknown eviction policy '" + name + "': accepted are " + accepted);
}

}  // namespace membudget
