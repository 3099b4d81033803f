// Whether a group may use this process's NVSHMEM session: torch-free host logic of the NVSHMEM
// transport's setup (nvshmem_transport.cpp), kept apart so that CPU tests reach it
// (tests/test_nvshmem_session_cpu.py, through _C._nvshmem_session_decision).
//
// NVSHMEM is initialised at most once per process and never finalised by ep: after
// nvshmem_finalize, a new nvshmemx_init_attr skips the bootstrap and keeps the first session's
// PEs, ignoring the new unique id (NVSHMEM's init.cu never resets nvshmemi_is_nvshmem_bootstrapped;
// NVIDIA/nvshmem issue #68). So the first group of a process that uses NVSHMEM starts the
// session, with its ranks as the PEs, for the life of the process; a later group (after
// ep_backend.abort and re-creation, say) uses that session only if its ranks are exactly those
// PEs, on the same GPUs, in the same order, and on every rank. Any other group takes the ATen
// path, with a reason (its low_latency_transport says it), on every rank alike.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ep::nvshmem {

// What one rank says about its process's session in the setup exchange.
struct SessionPost {
  bool started = false;  // this process has a session
  int pe = -1;           // its PE and PE count
  int num_pes = 0;
  std::string group;   // fingerprint of the ranks' GPUs when it started (placesFingerprint)
  int64_t parked = 0;  // buffers of destroyed groups awaiting their collective free
};

// "-" for no session, else "pe:num_pes:parked:group". No '#' (the setup post's separator).
std::string encodeSession(const SessionPost& post);
// The inverse of encodeSession; throws std::invalid_argument on a malformed text.
SessionPost decodeSession(const std::string& text);

// A group's identity for the session: its ranks' GPU places ("host|index|bus", in rank order),
// hashed (FNV-1a, 16 hex digits): the same on every rank and in every process.
std::string placesFingerprint(const std::vector<std::string>& places);

enum class SessionAction {
  kStart,   // no rank has a session: start one with this group's ranks as PEs
  kReuse,   // every rank's session is this group's ranks: use it (free the parked buffers first)
  kRefuse,  // the group cannot use NVSHMEM: `why`
};

struct SessionDecision {
  SessionAction action = SessionAction::kRefuse;
  std::string why;  // for kRefuse: the group's why-not (the same on every rank)
};

// The decision for a group of posts.size() ranks (posts in rank order, as every rank gathered
// them) whose places fingerprint is `group`. A function of its arguments only, so every rank
// decides alike.
SessionDecision decideSession(const std::vector<SessionPost>& posts, const std::string& group);

}  // namespace ep::nvshmem
