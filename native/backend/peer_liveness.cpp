#include "backend/peer_liveness.hpp"

#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <exception>
#include <fstream>

#include "backend/ep_process_group.hpp"
#include "backend/store_exchange.hpp"

namespace ep {
namespace {

std::string keyOf(EPProcessGroup& pg, int64_t rank) {
  return "ep_proc/" + pg.options()->group_name + "/" + std::to_string(rank);
}

std::string gaveUpKey(EPProcessGroup& pg, int64_t rank) {
  return "ep_gave_up/" + pg.options()->group_name + "/" + std::to_string(rank);
}

// The host and pid namespace this process's pid means something in ("host/pid:[4026531836]"):
// two containers on one host share a host name but not their pids.
std::string placeOfPids() {
  char ns[64] = {0};
  const ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
  return hostName() + "/" + (n > 0 ? std::string(ns, static_cast<size_t>(n)) : std::string());
}

// Whether process `pid` of this pid namespace is gone: no such process, or a zombie (killed,
// not yet reaped by its parent, as a launcher polling its children leaves it for a while).
bool processGone(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t paren = line.rfind(')');  // the name may hold spaces and parentheses
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z';
}

}  // namespace

void announceProcess(EPProcessGroup& pg) {
  const std::string mine = placeOfPids() + "|" + std::to_string(getpid());
  pg.store()->set(keyOf(pg, pg.getRank()), std::vector<uint8_t>(mine.begin(), mine.end()));
}

std::vector<int64_t> deadPeers(EPProcessGroup& pg) {
  std::vector<int64_t> dead;
  const std::string here = placeOfPids();
  for (int64_t r = 0; r < pg.getSize(); ++r) {
    if (r == pg.getRank()) continue;
    try {
      const std::string key = keyOf(pg, r);
      if (!pg.store()->check({key})) continue;
      const std::vector<uint8_t> bytes = pg.store()->get(key);
      const std::string posted(bytes.begin(), bytes.end());
      const size_t bar = posted.rfind('|');
      if (bar == std::string::npos || posted.substr(0, bar) != here) continue;
      const pid_t pid = static_cast<pid_t>(std::stoll(posted.substr(bar + 1)));
      if (pid > 0 && processGone(pid)) dead.push_back(r);
    } catch (const std::exception&) {
      // The store is gone too (its host died): nothing can be said about this rank.
    }
  }
  return dead;
}

std::string joinRanks(const std::vector<int64_t>& ranks) {
  std::string out;
  for (int64_t r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

void postGaveUp(EPProcessGroup& pg) {
  try {
    pg.store()->set(gaveUpKey(pg, pg.getRank()), std::vector<uint8_t>{1});
  } catch (const std::exception&) {
  }
}

std::vector<int64_t> peersThatGaveUp(EPProcessGroup& pg) {
  std::vector<int64_t> ranks;
  try {
    for (int64_t r = 0; r < pg.getSize(); ++r) {
      if (r != pg.getRank() && pg.store()->check({gaveUpKey(pg, r)})) ranks.push_back(r);
    }
  } catch (const std::exception&) {
  }
  return ranks;
}

std::string deadPeersMessage(const char* op, const std::vector<int64_t>& dead, int64_t rank,
                             std::chrono::milliseconds waited) {
  return std::string("ep ") + op + ": rank(s) " + joinRanks(dead) +
         " never joined this call and never will: their process is gone (killed or crashed); "
         "rank " +
         std::to_string(rank) + " found out after " + std::to_string(waited.count()) +
         " ms. The group's MoE calls cannot go on: call ep_backend.abort(group) on every live "
         "rank and create a new group without them";
}

std::string gaveUpMessage(const char* op, const std::vector<int64_t>& ranks) {
  return std::string("ep ") + op + ": rank(s) " + joinRanks(ranks) +
         " never joined this call: that rank gave up on this group (one of its MoE calls timed "
         "out or failed, or it called ep_backend.abort). The group's MoE calls cannot go on: "
         "call ep_backend.abort(group) on every rank and create a new group";
}

}  // namespace ep
