#ifdef EP_WITH_CUDA

#include "transports/nvlink/nvlink_transport.hpp"

#include <utility>

#include "backend/per_group_transport.hpp"
#include "transports/nvlink/cuda/nvlink_runtime.hpp"
#include "transports/nvlink/nvlink_group_state.hpp"
#include "transports/nvlink/nvlink_pending_error.hpp"
#include "transports/nvlink/nvlink_usability.hpp"

namespace ep {
namespace {

// The NVLink transport behind the Transport interface (backend/transport.hpp).
class NvlinkTransport final : public PerGroupTransport<nvlink::GroupState> {
 public:
  TransportKind kind() const override { return TransportKind::kNvlink; }
  // The all-to-all shares the high-throughput family's verdict (one host, peer access, a
  // kernel image) and its runtime.
  bool serves(OpFamily family) const override {
    return family == OpFamily::kHighThroughput || family == OpFamily::kAllToAll;
  }
  int64_t maxLayoutRanks() const override { return kMaxRanks; }
  LayoutTensors layout(const at::Tensor& topk_idx, int64_t num_experts,
                       int64_t num_ranks) override {
    return nvlink::dispatchLayout(topk_idx, num_experts, num_ranks);
  }
  LayoutTensors layoutIgnoringInvalid(const at::Tensor& topk_idx, int64_t num_experts,
                                      int64_t num_ranks) override {
    return nvlink::dispatchLayout(topk_idx, num_experts, num_ranks, /*report_invalid=*/false);
  }
  DispatchResult dispatch(EPProcessGroup& pg, const DispatchArgs& args,
                          DeferredCounts* deferred) override {
    return nvlink::dispatch(pg, args, deferred);
  }
  std::pair<at::Tensor, std::optional<at::Tensor>> cachedDispatch(
      EPProcessGroup& pg, const at::Tensor& x, const std::optional<at::Tensor>& x_scales,
      const DispatchRouting& routing) override {
    return nvlink::cachedDispatch(pg, x, x_scales, routing);
  }
  std::pair<at::Tensor, std::optional<at::Tensor>> combine(EPProcessGroup& pg,
                                                           const CombineArgs& args) override {
    return nvlink::combine(pg, args);
  }
  std::optional<std::vector<int64_t>> reserve(EPProcessGroup& pg, const at::Device& device,
                                              const at::Tensor& gathered) override {
    return nvlink::reserve(pg, device, gathered);
  }
  std::string takePendingError(EPProcessGroup& pg, const char* op) override {
    return nvlink::takePendingError(*nvlink::stateOf(pg), op);
  }
  c10::intrusive_ptr<c10d::Work> allToAll(EPProcessGroup& pg, at::Tensor& output,
                                          const at::Tensor& input,
                                          const std::vector<int64_t>& output_split_sizes,
                                          const std::vector<int64_t>& input_split_sizes,
                                          bool async_op) override {
    return nvlink::allToAll(pg, output, input, output_split_sizes, input_split_sizes, async_op);
  }
  bool allToAllDeviceSplits(EPProcessGroup& pg, const at::Tensor& input, const at::Tensor& splits,
                            const at::Tensor& output, int64_t num_local_experts,
                            const at::Tensor& recv_splits,
                            const at::Tensor& recv_offsets) override {
    return nvlink::allToAllDeviceSplits(pg, input, splits, output, num_local_experts, recv_splits,
                                        recv_offsets);
  }
  bool graphCaptured(EPProcessGroup& pg) override { return nvlink::stateOf(pg)->graph_captured; }
  bool recordStream(const at::Tensor& tensor, const c10::Stream& stream) override {
    return nvlink::recordSlabStream(tensor, stream);
  }

 private:
  std::shared_ptr<nvlink::GroupState> stateOf(EPProcessGroup& pg) override {
    return nvlink::stateOf(pg);
  }
  std::shared_ptr<nvlink::GroupState> findState(EPProcessGroup& pg) override {
    return nvlink::stateOf(pg, /*create=*/false);
  }
  Verdict decide(EPProcessGroup& pg, nvlink::GroupState&, const at::Device& device) override {
    std::string why = nvlink::decideUsable(pg, device);
    const bool requested = why == nvlink::kAskedAten;
    return Verdict{std::move(why), requested};
  }
};

}  // namespace

Transport& nvlinkTransport() {
  static NvlinkTransport transport;
  return transport;
}

}  // namespace ep

#endif  // EP_WITH_CUDA
