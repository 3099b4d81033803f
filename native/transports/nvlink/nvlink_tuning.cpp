#ifdef EP_WITH_CUDA

#include "transports/nvlink/nvlink_tuning.hpp"

#include "backend/ep_process_group.hpp"
#include "common/env.hpp"

namespace ep::nvlink {

void applySendWarpOverrides(NvlinkConfig& cfg) {
  const bool dispatch_set = env::isSet<env::kDispatchSendWarps>();
  const bool combine_set = env::isSet<env::kCombineSendWarps>();
  if (dispatch_set) {
    cfg.dispatch_send_warps = static_cast<int>(env::integer<env::kDispatchSendWarps>(0));
    cfg.small_row_dispatch_send_warps = cfg.dispatch_send_warps;
    cfg.slab_dispatch_send_warps = 0;
  }
  if (env::isSet<env::kDispatchSendWarpsSmallRows>()) {
    cfg.small_row_dispatch_send_warps =
        static_cast<int>(env::integer<env::kDispatchSendWarpsSmallRows>(0));
  }
  if (env::isSet<env::kDispatchSendWarpsSlab>()) {
    cfg.slab_dispatch_send_warps = static_cast<int>(env::integer<env::kDispatchSendWarpsSlab>(0));
  }
  if (combine_set) {  // the given count at every rank count
    cfg.combine_send_warps = static_cast<int>(env::integer<env::kCombineSendWarps>(0));
    cfg.combine_send_warps_many_ranks = 0;
  }
  if (dispatch_set || combine_set) cfg.one_rank_send_warps = false;
}

int recvSlabs(EPProcessGroup& pg) {
  static const int env = [] {  // read once: this runs on every dispatch
    return static_cast<int>(env::integer<env::kRecvSlabs>(-1));
  }();
  return env >= 0 ? env : static_cast<int>(pg.options()->recv_slabs);
}

}  // namespace ep::nvlink

#endif  // EP_WITH_CUDA
