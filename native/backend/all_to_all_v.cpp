#include "backend/all_to_all_v.hpp"

#include "backend/ep_process_group.hpp"
#include "backend/transport.hpp"

namespace ep {

bool allToAllDeviceSplits(EPProcessGroup& pg, const at::Tensor& input, const at::Tensor& splits,
                          const at::Tensor& output, int64_t num_local_experts,
                          const at::Tensor& recv_splits, const at::Tensor& recv_offsets) {
  if (!input.is_cuda() || !pg.hasCudaBackend()) return false;
  Transport& t = transportFor(pg, OpFamily::kAllToAll, input.device());
  return t.allToAllDeviceSplits(pg, input, splits, output, num_local_experts, recv_splits,
                                recv_offsets);
}

std::string takeAllToAllError(EPProcessGroup& pg) {
  Transport* t = pg.chosenTransports()[static_cast<size_t>(OpFamily::kAllToAll)];
  return t == nullptr ? "" : t->takePendingError(pg, "all_to_all_check");
}

}  // namespace ep
