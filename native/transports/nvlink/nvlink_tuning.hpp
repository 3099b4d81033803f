// The NVLink transport's settings that do not come from the call: the send-warp splits set by
// hand and the number of receive slabs. Only built with EP_WITH_CUDA.
#pragma once

#include "transports/nvlink/cuda/nvlink_runtime.hpp"

namespace ep {

class EPProcessGroup;

namespace nvlink {

// Send warps per block set by hand (sweeps, the GPU tests' other splits), read when a group
// builds its transport. EP_DISPATCH_SEND_WARPS alone sets the dispatch's warps for every row
// size, slab or not; a count set by hand is used in a group of one rank too (no one-rank rule).
void applySendWarpOverrides(NvlinkConfig& cfg);

// Options.recv_slabs, or EP_RECV_SLABS (for A/B timings); every rank must agree on it.
int recvSlabs(EPProcessGroup& pg);

}  // namespace nvlink
}  // namespace ep
