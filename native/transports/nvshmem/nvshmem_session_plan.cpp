#include "transports/nvshmem/nvshmem_session_plan.hpp"

#include <cstdio>
#include <sstream>
#include <stdexcept>

namespace ep::nvshmem {

std::string encodeSession(const SessionPost& post) {
  if (!post.started) return "-";
  std::ostringstream os;
  os << post.pe << ":" << post.num_pes << ":" << post.parked << ":" << post.group;
  return os.str();
}

SessionPost decodeSession(const std::string& text) {
  SessionPost p;
  if (text == "-") return p;
  long long pe = 0, pes = 0, parked = 0;
  int used = 0;
  if (std::sscanf(text.c_str(), "%lld:%lld:%lld:%n", &pe, &pes, &parked, &used) != 3 || used <= 0) {
    throw std::invalid_argument("malformed NVSHMEM session post: '" + text + "'");
  }
  p.started = true;
  p.pe = static_cast<int>(pe);
  p.num_pes = static_cast<int>(pes);
  p.parked = parked;
  p.group = text.substr(static_cast<size_t>(used));
  return p;
}

std::string placesFingerprint(const std::vector<std::string>& places) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a 64
  for (const std::string& place : places) {
    for (const char c : place + '\n') {
      h ^= static_cast<unsigned char>(c);
      h *= 1099511628211ull;
    }
  }
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(h));
  return text;
}

namespace {

// Appended to every refusal: what the user can do.
constexpr const char* kWhy =
    "; NVSHMEM is initialised once per process and cannot be re-initialised (after "
    "nvshmem_finalize it keeps its first PEs: NVIDIA/nvshmem issue #68), so this group's "
    "low-latency and internode ops take the ATen path (a new process, e.g. a restarted job, "
    "starts a new session)";

}  // namespace

SessionDecision decideSession(const std::vector<SessionPost>& posts, const std::string& group) {
  SessionDecision d;
  const int size = static_cast<int>(posts.size());
  int with = 0;
  for (const SessionPost& p : posts) with += p.started ? 1 : 0;
  if (with == 0) {
    d.action = SessionAction::kStart;
    return d;
  }
  std::ostringstream why;
  if (with != size) {
    int has = -1, lacks = -1;
    for (int r = 0; r < size; ++r) {
      if (posts[r].started && has < 0) has = r;
      if (!posts[r].started && lacks < 0) lacks = r;
    }
    why << "rank " << has << " has an NVSHMEM session from an earlier group and rank " << lacks
        << " has none (a process that restarted?)" << kWhy;
    d.why = why.str();
    return d;
  }
  for (int r = 0; r < size; ++r) {
    const SessionPost& p = posts[r];
    if (p.pe != r || p.num_pes != size || p.group != group) {
      why << "rank " << r << "'s NVSHMEM session is PE " << p.pe << " of " << p.num_pes
          << " of an earlier group";
      if (p.num_pes == size && p.pe == r) why << " on other GPUs or ranks";
      why << ", not this group of " << size
          << " ranks (a group over other ranks, or re-created without a rank that died: a session "
             "that lost a PE can never be used again)"
          << kWhy;
      d.why = why.str();
      return d;
    }
  }
  for (int r = 1; r < size; ++r) {
    if (posts[r].parked != posts[0].parked) {
      why << "the ranks disagree on the NVSHMEM buffers left by earlier groups (rank 0: "
          << posts[0].parked << ", rank " << r << ": " << posts[r].parked
          << "), which every PE must free together; is an earlier group over these ranks still "
             "alive on some rank?"
          << kWhy;
      d.why = why.str();
      return d;
    }
  }
  d.action = SessionAction::kReuse;
  return d;
}

}  // namespace ep::nvshmem
