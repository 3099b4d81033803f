// RowGather: a transport's own all-gather for a group's per-call agreement (agreeAcrossRanks,
// moe_validation.cpp). Without one, the agreement's rows go through shared memory when every
// rank is on one host (HostExchange) and through Gloo (TCP) otherwise; the internode transport
// installs one that all-gathers them on the GPU over NVSHMEM, so that a group spanning hosts
// needs no TCP round trip per call.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ep {

class EPProcessGroup;

class RowGather {
 public:
  virtual ~RowGather() = default;
  // What EPProcessGroup.moe_agreement_transport reports while the gather serves the group.
  virtual const char* name() const = 0;
  // Whether a row of `width` words goes through this gather (wider ones take Gloo).
  virtual bool fits(int64_t width) const = 0;
  // Every rank's row, rank-major, into out[R * width]. Returns "" or, when some rank's row did
  // not come within `timeout`, "rank(s) a, b" naming them (the gather is unusable from then on);
  // throws on any other failure.
  virtual std::string gather(const std::vector<int64_t>& row, int64_t* out,
                             std::chrono::milliseconds timeout) = 0;
};

// Collective: the group's agreements from the next one on go through `gather`. Every rank installs
// it at the same point of the group's call sequence (the ranks' agreements must pair up).
void useRowGather(EPProcessGroup& pg, std::shared_ptr<RowGather> gather);

}  // namespace ep
