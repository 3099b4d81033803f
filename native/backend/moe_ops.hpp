// Entry points of the MoE ops for the Python layer that bypass the torch dispatcher (the ops
// themselves are registered in moe_ops.cpp under TORCH_LIBRARY(ep)).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/moe_types.hpp"

namespace ep {

// The outputs of the dispatch op, in its schema's order (absent optional ones empty).
using DispatchOutputs =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
               at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// ep::dispatch for an eager caller without autograd: the same arguments, checks and agreement
// step. Where the NVLink path overlaps its host wait with the kernel (no num_worst_tokens), it
// returns once the kernels are launched, with `second` set: the outputs then have the worst-case
// row count and num_recv_tokens_per_expert_host is empty until `second()` runs (the count wait,
// in place), which the caller must call before using them. Elsewhere `second` is empty and the
// outputs are final. Lets the caller build its result objects while the GPU runs notify.
std::pair<DispatchOutputs, DeferredCounts> dispatchDeferred(
    const at::Tensor& x, const std::optional<at::Tensor>& x_scales, const at::Tensor& topk_idx,
    const std::optional<at::Tensor>& topk_weights, int64_t num_experts, int64_t expert_alignment,
    int64_t num_worst_tokens, const std::string& group_name, const std::vector<at::Tensor>& layout);

}  // namespace ep
