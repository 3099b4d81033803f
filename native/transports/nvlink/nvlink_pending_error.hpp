// A kernel error of an earlier call (a timeout naming the stalled peer, a capacity overflow)
// surfaces at the next call on the group. Only built with EP_WITH_CUDA.
#pragma once

#include <string>

#include "transports/nvlink/nvlink_group_state.hpp"

namespace ep::nvlink {

// The error an earlier call's kernels recorded ("" when none), with the op that reports it;
// reported once unless the transport failed (then every later call reports it).
std::string takePendingError(GroupState& st, const char* op);

// Raises the pending error, if any.
void raisePendingError(GroupState& st, const char* op);

}  // namespace ep::nvlink
