#include "backend/all_to_all_v.hpp"

#include "backend/carved_tensors.hpp"
#include "backend/ep_process_group.hpp"
#include "backend/transport.hpp"

namespace ep {

std::optional<std::tuple<at::Tensor, at::Tensor>> allToAllV(EPProcessGroup& pg,
                                                            const at::Tensor& input,
                                                            const at::Tensor& splits,
                                                            const at::Tensor& output,
                                                            int64_t num_local_experts, bool flat) {
  if (!input.is_cuda() || !pg.hasCudaBackend()) return std::nullopt;
  Transport& t = transportFor(pg, OpFamily::kAllToAll, input.device());
  const int64_t num_ranks = pg.getSize();
  const CarvedShape shape = flat ? CarvedShape{{num_ranks}, at::kLong}
                                 : CarvedShape{{num_local_experts, num_ranks}, at::kLong};
  auto [recv_splits, recv_offsets] = carveTensors<2>(input.device(), {shape, shape});
  if (!t.allToAllDeviceSplits(pg, input, splits, output, num_local_experts, recv_splits,
                              recv_offsets)) {
    return std::nullopt;
  }
  return std::make_tuple(std::move(recv_splits), std::move(recv_offsets));
}

std::string takeAllToAllError(EPProcessGroup& pg) {
  Transport* t = pg.chosenTransports()[static_cast<size_t>(OpFamily::kAllToAll)];
  return t == nullptr ? "" : t->takePendingError(pg, "all_to_all_check");
}

}  // namespace ep
