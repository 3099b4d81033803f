// The group's node structure: which ranks share an NVLink domain ("node"), found at group creation
// from each rank's host identity (ep_backend/topology.py exchanges it through the store), or
// emulated by splitting one host's ranks into nodes of Options.ranks_per_node (EP_RANKS_PER_NODE).
// The transports read it to choose between the intranode path (one node) and the internode one.
#pragma once

#include <string>
#include <vector>

namespace ep {

struct Topology {
  int num_nodes = 1;
  // Ranks of every node when all nodes hold the same number; 0 when they do not.
  int ranks_per_node = 0;
  std::vector<int> node_of_rank;  // [R]: node index, nodes numbered by their lowest rank
  std::vector<int> local_rank;    // [R]: index of the rank within its node, in rank order
  // The nodes were split out of fewer hosts by Options.ranks_per_node / EP_RANKS_PER_NODE.
  bool emulated = false;
  // Why this topology cannot take the internode path (unequal nodes, more than 8 ranks on a
  // node): "" when it can, or when it is one node.
  std::string problem;

  // One node holding every rank: the topology of a group that was never told otherwise.
  static Topology singleNode(int num_ranks) {
    Topology t;
    t.ranks_per_node = num_ranks;
    t.node_of_rank.assign(num_ranks, 0);
    for (int r = 0; r < num_ranks; ++r) t.local_rank.push_back(r);
    return t;
  }
};

}  // namespace ep
