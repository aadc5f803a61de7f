#include "core/policy/neighbourhood.h"

#include <algorithm>

namespace membudget {

uint64_t EvictedNeighbourhoods::find(uint64_t id) {
  uint64_t root = id;
  while (nodes_.at(root).parent != root) root = nodes_.at(root).parent;
  while (id != root) {  // path compression
    uint64_t next = nodes_.at(id).parent;
    nodes_.at(id).parent = root;
    id = next;
  }
  return root;
}

void EvictedNeighbourhoods::add(uint64_t id, double seconds, const std::vector<uint64_t>& dropped_neighbours) {
  if (nodes_.count(id) == 0) {
    nodes_[id] = Node{id, seconds};
  } else {
    nodes_[find(id)].cost += seconds;
  }
  for (uint64_t other : dropped_neighbours) {
    if (nodes_.count(other) == 0) continue;
    uint64_t a = find(id);
    uint64_t b = find(other);
    if (a == b) continue;
    nodes_[b].parent = a;
    nodes_[a].cost += nodes_[b].cost;
  }
}

void EvictedNeighbourhoods::remove(uint64_t id, double seconds) {
  if (nodes_.count(id) == 0) return;
  Node& root = nodes_[find(id)];
  root.cost = std::max(0.0, root.cost - seconds);
}

double EvictedNeighbourhoods::cost_of(const std::vector<uint64_t>& dropped_neighbours) {
  std::vector<uint64_t> roots;
  double total = 0.0;
  for (uint64_t id : dropped_neighbours) {
    if (nodes_.count(id) == 0) continue;
    uint64_t root = find(id);
    if (std::find(roots.begin(), roots.end(), root) != roots.end()) continue;
    roots.push_back(root);
    total += nodes_[root].cost;
  }
  return total;
}

}  // namespace membudget
