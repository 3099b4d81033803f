// The skeleton every transport with per-group state shares: the state is created at the group's
// first call (GroupStates), and whether the transport serves the group is decided once, at that
// call, collectively (every rank reaches the same verdict), then read. A transport derives from
// PerGroupTransport<State> (State holds a `GroupVerdict usability`) and supplies stateOf() and
// decide(); usable() and verdict() are the same code for all.
#pragma once

#include <c10/core/DeviceGuard.h>

#include <memory>
#include <optional>

#include "backend/transport.hpp"

namespace ep {

// A transport's verdict on one group: undecided until its first call of the family.
struct GroupVerdict {
  bool decided = false;
  Verdict verdict;
  bool yes() const { return decided && verdict.yes(); }
};

template <class State>
class PerGroupTransport : public Transport {
 public:
  Verdict usable(EPProcessGroup& pg, const at::Device& device) final {
    const std::shared_ptr<State> st = stateOf(pg);
    GroupVerdict& usability = st->usability;
    if (!usability.decided) {
      const c10::DeviceGuard guard(device);
      usability.verdict = decide(pg, *st, device);
      usability.decided = true;
    }
    return usability.verdict;
  }
  // Read-only: never creates the group's state. (Creating it would register the state's
  // shutdown hook, and the hooks' order is the order of the collective NVSHMEM frees at teardown:
  // a rank that read a property before its first call would free in another order than its peers.)
  std::optional<Verdict> verdict(EPProcessGroup& pg) final {
    const std::shared_ptr<State> st = findState(pg);
    if (st == nullptr || !st->usability.decided) return std::nullopt;
    return st->usability.verdict;
  }

 protected:
  // The group's state, created at its first use; findState never creates it (null if none).
  virtual std::shared_ptr<State> stateOf(EPProcessGroup& pg) = 0;
  virtual std::shared_ptr<State> findState(EPProcessGroup& pg) = 0;
  // Collective: every rank calls it at the group's first call of the family, with the device
  // current, and every rank returns the same yes or no (the reason may be each rank's own).
  virtual Verdict decide(EPProcessGroup& pg, State& st, const at::Device& device) = 0;
};

}  // namespace ep
