// Which ranks of a group have died or given up. Each rank announces its process (host, pid
// namespace, pid) in the group's store at the group's first MoE call; after a failed exchange, a
// rank looks up the processes of its peers on the same host and names those that no longer exist
// (killed, crashed). Peers on other hosts (or in other containers) cannot be checked from here and
// are never named as dead. A rank whose MoE calls cannot go on (a failed agreement, abort) marks
// that in the store too, for peers that cannot see the shared-memory exchange's mark.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace ep {

class EPProcessGroup;

// Posts this rank's "host/pid-namespace|pid" in the group's store (once per group; one store
// write).
void announceProcess(EPProcessGroup& pg);

// The ranks whose announced process was on this host and is gone (ascending). Never throws:
// a store error or a rank that never announced itself counts as "not known dead".
std::vector<int64_t> deadPeers(EPProcessGroup& pg);

// "1, 3" for {1, 3}.
std::string joinRanks(const std::vector<int64_t>& ranks);

// Marks in the group's store that this rank gave up on the group's MoE calls (one store write;
// never throws: where the store is gone too, peers find out by their timeout).
void postGaveUp(EPProcessGroup& pg);

// The peers that marked postGaveUp (ascending). Never throws.
std::vector<int64_t> peersThatGaveUp(EPProcessGroup& pg);

// What an agreement raises about `dead` peers (process gone) that rank `rank` of `op` found after
// waiting `waited`; and about peers that gave up on the group.
std::string deadPeersMessage(const char* op, const std::vector<int64_t>& dead, int64_t rank,
                             std::chrono::milliseconds waited);
std::string gaveUpMessage(const char* op, const std::vector<int64_t>& ranks);

}  // namespace ep
