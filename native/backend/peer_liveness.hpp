// Which ranks of a group have died: each rank announces its process (host, pid namespace, pid) in
// the group's store at the group's first MoE call; after a failed exchange, a rank looks up the
// processes of its peers on the same host and names those that no longer exist (killed, crashed).
// Peers on other hosts (or in other containers) cannot be checked from here and are never named
// as dead.
#pragma once

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

}  // namespace ep
