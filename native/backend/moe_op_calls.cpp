#include "backend/moe_op_calls.hpp"

#include <ATen/core/dispatch/Dispatcher.h>

namespace ep {
namespace {

// The op's handle, typed with its kernels' C++ signature (moe_ops.cpp registers every kernel of
// an op with one function type; typed<>() checks it against theirs). Looked up once per op. The
// call* functions below have that signature, except callDispatch (std::vector for the layout,
// which pybind11 converts; the kernels take at::TensorList).
template <class Signature>
c10::TypedOperatorHandle<Signature> typedOp(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace

LayoutTensors callDispatchLayout(const at::Tensor& topk_idx, int64_t num_experts,
                                 int64_t num_ranks) {
  static const auto op = typedOp<decltype(callDispatchLayout)>("ep::dispatch_layout");
  return op.call(topk_idx, num_experts, num_ranks);
}

DispatchOutputs callDispatch(const at::Tensor& x, const OptTensor& x_scales,
                             const at::Tensor& topk_idx, const OptTensor& topk_weights,
                             int64_t num_experts, int64_t expert_alignment,
                             int64_t num_worst_tokens, const std::string& group_name,
                             const std::vector<at::Tensor>& layout) {
  static const auto op = typedOp<DispatchOutputs(
      const at::Tensor&, const OptTensor&, const at::Tensor&, const OptTensor&, int64_t, int64_t,
      int64_t, const std::string&, at::TensorList)>("ep::dispatch");
  return op.call(x, x_scales, topk_idx, topk_weights, num_experts, expert_alignment,
                 num_worst_tokens, group_name, layout);
}

std::tuple<at::Tensor, at::Tensor> callCachedDispatch(
    const at::Tensor& x, const OptTensor& x_scales, const at::Tensor& is_token_in_rank,
    const at::Tensor& num_tokens_per_rank, const at::Tensor& num_recv_tokens_per_rank,
    const at::Tensor& recv_src_idx, const at::Tensor& recv_src_rank,
    const std::string& group_name) {
  static const auto op = typedOp<decltype(callCachedDispatch)>("ep::cached_dispatch");
  return op.call(x, x_scales, is_token_in_rank, num_tokens_per_rank, num_recv_tokens_per_rank,
                 recv_src_idx, recv_src_rank, group_name);
}

std::tuple<at::Tensor, at::Tensor> callCombine(const at::Tensor& x, const OptTensor& topk_weights,
                                               const OptTensor& bias0, const OptTensor& bias1,
                                               const at::Tensor& is_token_in_rank,
                                               const at::Tensor& num_tokens_per_rank,
                                               const at::Tensor& num_recv_tokens_per_rank,
                                               const at::Tensor& recv_src_idx,
                                               const at::Tensor& recv_src_rank,
                                               const std::string& group_name) {
  static const auto op = typedOp<decltype(callCombine)>("ep::combine");
  return op.call(x, topk_weights, bias0, bias1, is_token_in_rank, num_tokens_per_rank,
                 num_recv_tokens_per_rank, recv_src_idx, recv_src_rank, group_name);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> callLowLatencyDispatch(
    const at::Tensor& x, const at::Tensor& topk_idx, int64_t num_max_dispatch_tokens_per_rank,
    int64_t num_experts, bool use_fp8, bool round_scale, bool use_ue8m0,
    const std::string& group_name, bool send_only) {
  static const auto op = typedOp<decltype(callLowLatencyDispatch)>("ep::low_latency_dispatch");
  return op.call(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale,
                 use_ue8m0, group_name, send_only);
}

at::Tensor callLowLatencyCombine(const at::Tensor& x, const at::Tensor& topk_idx,
                                 const at::Tensor& topk_weights, const at::Tensor& src_info,
                                 const at::Tensor& layout_range,
                                 int64_t num_max_dispatch_tokens_per_rank,
                                 const std::string& group_name) {
  static const auto op = typedOp<decltype(callLowLatencyCombine)>("ep::low_latency_combine");
  return op.call(x, topk_idx, topk_weights, src_info, layout_range,
                 num_max_dispatch_tokens_per_rank, group_name);
}

}  // namespace ep
