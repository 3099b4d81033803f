// The NVLink transport's capacity: the sizes a call needs (agreed across ranks), and the runtime
// that holds them, built or grown collectively when a call needs more. Only built with
// EP_WITH_CUDA.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "backend/moe_validation.hpp"
#include "transports/nvlink/nvlink_group_state.hpp"

namespace ep {

class EPProcessGroup;

namespace nvlink {

// The largest shape a call moves, the max over ranks (the agreed payload's first five columns).
struct Needs {
  int64_t tokens = 0;
  int64_t hidden_bytes = 0;
  int64_t topk = 0;
  int64_t scales = 0;
  int64_t local_experts = 0;
};

// gathered [R, >=5]: tokens, hidden bytes, top-k, scales, local experts of each rank.
Needs maxNeeds(const AgreedRows& gathered);

// The most rows a dispatch can deliver to one rank: every token of every rank (column 0 of the
// agreed payload), each received at most once.
int64_t worstCaseRows(const AgreedRows& gathered);

// The agreed field that keeps every rank's decision on growing the transport alike.
AgreedField graphCapturedField(const GroupState& st);

// Makes sure a connected runtime big enough for `needs` (the max over ranks) exists. Collective:
// every rank calls it with the same `needs` and graph_captured (an agreed field). It refuses to
// build or grow the transport while a graph is captured, or once one was: that graph's kernels
// keep the buffers' addresses, which a rebuild frees. `capture`: streamCapturing(), which the
// caller has already asked. `agreed_recv_slabs`: Options.recv_slabs where the call agreed it
// across ranks (a dispatch): a runtime built with another count is rebuilt, so that a change on
// a live group takes effect; -1 where it was not agreed (the runtime keeps its count).
NvlinkRuntime& ensureRuntime(EPProcessGroup& pg, GroupState& st, const at::Device& device,
                             Needs needs, const char* op, bool capture, int agreed_recv_slabs);

}  // namespace nvlink
}  // namespace ep
