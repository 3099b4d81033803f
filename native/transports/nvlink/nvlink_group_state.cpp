#ifdef EP_WITH_CUDA

#include "transports/nvlink/nvlink_group_state.hpp"

#include <cuda_runtime_api.h>

#include "backend/ep_process_group.hpp"
#include "backend/group_state.hpp"

namespace ep::nvlink {

std::shared_ptr<GroupState> stateOf(EPProcessGroup& pg, bool create) {
  static auto* states = new GroupStates<GroupState>([](EPProcessGroup*, GroupState& state) {
    if (state.runtime) {
      cudaDeviceSynchronize();
      state.runtime->destroy();
    }
  });
  return create ? states->of(pg) : states->find(pg);
}

std::string keyPrefix(EPProcessGroup& pg) {
  return "ep_nvlink/" + pg.options()->group_name + "/";
}

}  // namespace ep::nvlink

#endif  // EP_WITH_CUDA
