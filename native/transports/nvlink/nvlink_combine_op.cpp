#ifdef EP_WITH_CUDA

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "backend/aligned_rows.hpp"
#include "backend/ep_process_group.hpp"
#include "backend/host_stages.hpp"
#include "backend/moe_validation.hpp"
#include "backend/stream_capture.hpp"
#include "transports/nvlink/nvlink_capacity.hpp"
#include "transports/nvlink/nvlink_handle_routing.hpp"
#include "transports/nvlink/nvlink_pending_error.hpp"
#include "transports/nvlink/nvlink_transport.hpp"

namespace ep::nvlink {
namespace {

// The combine kernels' element type of a payload dtype (validation admitted only these).
CombineElem combineElem(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16:
      return CombineElem::kBFloat16;
    case at::kHalf:
      return CombineElem::kFloat16;
    case at::kFloat:
      return CombineElem::kFloat32;
    case at::kDouble:
      return CombineElem::kFloat64;
    default:
      TORCH_CHECK(false, "ep combine: no kernel sums ", t, " rows");
  }
}

// The biases as the kernels read them: rows of x's element type, or float32 rows for 16-bit x.
// A bias of another dtype is widened to the accumulation type (float64 for float64 x, else
// float32), which is exact and what the spec adds (b.to(acc dtype)); every bias then takes that
// type. Non-contiguous or unaligned biases are copied (the kernels read 16-byte row vectors).
struct KernelBiases {
  std::optional<at::Tensor> b0, b1;
  bool f32 = false;
};

KernelBiases kernelBiases(const CombineArgs& a) {
  const at::ScalarType elem = a.x.scalar_type();
  bool same = true;
  for (const auto* b : {&a.bias0, &a.bias1}) same = same && (!*b || (*b)->scalar_type() == elem);
  const at::ScalarType type = same ? elem : (elem == at::kDouble ? at::kDouble : at::kFloat);
  const auto prepare = [type](const std::optional<at::Tensor>& b) -> std::optional<at::Tensor> {
    if (!b) return std::nullopt;
    return alignedTo16(b->to(type).contiguous());
  };
  return {prepare(a.bias0), prepare(a.bias1), type == at::kFloat && elem != at::kFloat};
}

}  // namespace

std::pair<at::Tensor, std::optional<at::Tensor>> combine(EPProcessGroup& pg, const CombineArgs& a) {
  HostStages stages("combine");
  const int64_t num_ranks = pg.getSize();
  auto st = stateOf(pg);
  const std::string pending = pendingErrorToAgree(*st, "combine");
  std::string input_error = validateCombine(a, num_ranks);
  const std::shared_ptr<const KernelRouting> known = st->routings.recall(a.routing);
  const bool capture = streamCapturing();
  const HandleCounts handle =
      handleCounts(known.get(), a.routing, num_ranks, capture, input_error.empty(), "combine");
  if (input_error.empty()) input_error = handle.error;
  stages.mark("validate");
  const bool ok = input_error.empty();
  const std::string& error = pending.empty() ? input_error : pending;
  const bool has_weights = a.topk_weights.has_value();
  std::vector<AgreedField> fields = combineFields(a, ok);
  fields.push_back(graphCapturedField(*st));
  const auto& r = a.routing;
  std::vector<int64_t> payload{ok ? r.is_token_in_rank.size(0) : 0,
                               ok ? a.x.size(1) * a.x.element_size() : 0,
                               ok && has_weights ? a.topk_weights->size(1) : 0, 0, 0};
  payload.insert(payload.end(), handle.counts.begin(), handle.counts.end());
  payload.push_back(handle.known ? 1 : 0);
  const AgreedRows gathered = agreeRowsAcrossRanks(pg, "combine", error, fields, payload);
  checkRoutingAgrees("combine", gathered, 5, pg.getRank(), 5 + 2 * num_ranks);
  stages.mark("agree");
  stages.note("agree_wait", lastAgreementWaitUs());  // of "agree": waiting for the peers' rows

  const at::Device device = a.x.device();
  c10::cuda::CUDAGuard guard(device);
  NvlinkRuntime& rt = ensureRuntime(pg, *st, device, maxNeeds(gathered), "combine", capture, -1);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  auto [send_pos, recv_prefix] =
      routingFor(known.get(), r, c10::cuda::getCurrentCUDAStream(device.index()));
  stages.mark("routing");
  const int64_t num_tokens = r.is_token_in_rank.size(0);
  at::Tensor out = at::empty({num_tokens, a.x.size(1)}, a.x.options());
  std::optional<at::Tensor> out_w;
  if (has_weights) {
    out_w = at::empty({num_tokens, a.topk_weights->size(1)}, a.topk_weights->options());
  }
  const KernelBiases biases = kernelBiases(a);
  const at::Tensor x = alignedTo16(a.x);
  NvlinkCombineArgs args;
  args.x = x.data_ptr();
  args.elem = combineElem(a.x.scalar_type());
  args.hidden = static_cast<int>(a.x.size(1));
  args.num_recv_rows = static_cast<int>(a.x.size(0));
  args.topk_weights = has_weights ? a.topk_weights->data_ptr<float>() : nullptr;
  args.num_topk = has_weights ? static_cast<int>(a.topk_weights->size(1)) : 0;
  args.recv_prefix = recv_prefix.data_ptr<int>();
  args.send_pos = send_pos.data_ptr<int>();
  args.num_tokens = static_cast<int>(num_tokens);
  args.bias0 = biases.b0 ? biases.b0->data_ptr() : nullptr;
  args.bias1 = biases.b1 ? biases.b1->data_ptr() : nullptr;
  args.bias_f32 = biases.f32;
  args.out = out.data_ptr();
  args.out_topk_weights = out_w ? out_w->data_ptr<float>() : nullptr;
  args.num_sms = static_cast<int>(pg.options()->num_sms);  // per call: settable live
  rt.combine(args, stream);
  stages.mark("alloc+launch");
  return {out, out_w};
}

}  // namespace ep::nvlink

#endif  // EP_WITH_CUDA
