// EvictedNeighbourhoods: DTR's union-find over dropped entries, for the dtr
// filter's neighbourhood cost (Kirisame et al. 2021, section 4). Dropped
// entries that are lineage neighbours (one reads the other) form one class
// whose cost is the sum of its members' replay costs; recomputing an entry
// subtracts its cost from its class but never splits the class (the paper's
// approximation, which keeps every operation near O(1)).
#pragma once
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace membudget {

class EvictedNeighbourhoods {
 public:
  // `id` was dropped with replay cost `seconds`; joins the classes of its
  // dropped neighbours.
  void add(uint64_t id, double seconds, const std::vector<uint64_t>& dropped_neighbours);
  // `id` was brought back; its cost leaves its class.
  void remove(uint64_t id, double seconds);
  // Sum of the class costs of the given dropped neighbours, each class once.
  double cost_of(const std::vector<uint64_t>& dropped_neighbours);
  // Forgets everything (when no entry is dropped any more).
  void clear() { nodes_.clear(); }
  bool empty() const { return nodes_.empty(); }

 private:
  struct Node {
    uint64_t parent;
    double cost;  // valid at roots: the class cost
  };
  uint64_t find(uint64_t id);
  std::unordered_map<uint64_t, Node> nodes_;
};

}  // namespace membudget
