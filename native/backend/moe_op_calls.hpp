// The ep ops called from Python through the typed (unboxed) dispatcher: what
// `torch.ops.ep.<op>.default(...)` does, without Python's parsing of the arguments against the
// schema and their boxing into IValues (the largest part of an op call's host time, and most of
// it on a host whose caches went cold between calls). The call still goes through the dispatcher,
// so autograd keys, dispatch modes, tensor subclasses with __torch_dispatch__ and the profiler see
// the op as they do through torch.ops. __torch_function__ overrides and torch.compile's tracing
// happen in Python before the dispatcher: the Python layer takes torch.ops for those
// (ep_backend/_custom_ops.py).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "backend/moe_ops.hpp"
#include "backend/moe_types.hpp"

namespace ep {

using OptTensor = std::optional<at::Tensor>;

LayoutTensors callDispatchLayout(const at::Tensor& topk_idx, int64_t num_experts,
                                 int64_t num_ranks);

DispatchOutputs callDispatch(const at::Tensor& x, const OptTensor& x_scales,
                             const at::Tensor& topk_idx, const OptTensor& topk_weights,
                             int64_t num_experts, int64_t expert_alignment,
                             int64_t num_worst_tokens, const std::string& group_name,
                             const std::vector<at::Tensor>& layout);

std::tuple<at::Tensor, at::Tensor> callCachedDispatch(
    const at::Tensor& x, const OptTensor& x_scales, const at::Tensor& is_token_in_rank,
    const at::Tensor& num_tokens_per_rank, const at::Tensor& num_recv_tokens_per_rank,
    const at::Tensor& recv_src_idx, const at::Tensor& recv_src_rank, const std::string& group_name);

std::tuple<at::Tensor, at::Tensor> callCombine(
    const at::Tensor& x, const OptTensor& topk_weights, const OptTensor& bias0,
    const OptTensor& bias1, const at::Tensor& is_token_in_rank,
    const at::Tensor& num_tokens_per_rank, const at::Tensor& num_recv_tokens_per_rank,
    const at::Tensor& recv_src_idx, const at::Tensor& recv_src_rank, const std::string& group_name);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> callLowLatencyDispatch(
    const at::Tensor& x, const at::Tensor& topk_idx, int64_t num_max_dispatch_tokens_per_rank,
    int64_t num_experts, bool use_fp8, bool round_scale, bool use_ue8m0,
    const std::string& group_name, bool send_only);

at::Tensor callLowLatencyCombine(const at::Tensor& x, const at::Tensor& topk_idx,
                                 const at::Tensor& topk_weights, const at::Tensor& src_info,
                                 const at::Tensor& layout_range,
                                 int64_t num_max_dispatch_tokens_per_rank,
                                 const std::string& group_name);

}  // namespace ep
