// A kernel error of an earlier call (a timeout naming the stalled peer, a capacity overflow)
// surfaces at the next call on the group. Only built with EP_WITH_CUDA.
#pragma once

#include <string>

#include "transports/nvlink/nvlink_group_state.hpp"

namespace ep::nvlink {

// The error an earlier call's kernels recorded ("" when none), with the op that reports it;
// reported once unless the transport failed (then every later call reports it).
std::string takePendingError(GroupState& st, const char* op);

// The pending error as a call's local error for its agreement ("" when none). A timeout (a peer
// is gone or stalled: the transport must be rebuilt) raises here at once, on this rank alone: the
// peers' kernels time out too and report it at their next call, and waiting in the agreement for
// a peer that is gone would only delay the error by the group's timeout. Any other (a worst-case
// dispatch's overflow) is forgotten and returned, for the caller to pass to the agreement: every
// rank then raises together, where a raise before the agreement would leave this rank's peers
// waiting in it, or pairing it with this rank's next call.
std::string pendingErrorToAgree(GroupState& st, const char* op);

}  // namespace ep::nvlink
