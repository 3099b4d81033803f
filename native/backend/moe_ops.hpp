// Entry points of the MoE collectives for the Python layer that bypass the torch dispatcher (the
// ops themselves are registered in moe_ops.cpp under TORCH_LIBRARY(ep)); docs/architecture.md
// ("One way from Python into C++") says why these three are not ops.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <c10/core/Stream.h>

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

class EPProcessGroup;

// ep_backend.reserve (collective): all ranks agree on the largest shapes (and on a pending
// kernel error, and whether a CUDA graph pins the transport), then the transport that serves the
// group's high-throughput ops on `device_index` (-1: no CUDA device) builds or grows for them.
// Returns what it holds (Transport::reserve), or nullopt where nothing is reserved (ATen, CPU).
std::optional<std::vector<int64_t>> reserve(EPProcessGroup& pg, int64_t device_index,
                                            int64_t num_tokens, int64_t hidden_bytes, int64_t topk,
                                            int64_t num_scales, int64_t num_experts);

// Tensor.record_stream for tensors a transport lent (the dispatch outputs viewing a receive slab,
// which PyTorch's caching allocator does not own): true when one took it, false (nothing done)
// for any other tensor.
bool recordLentStream(const at::Tensor& tensor, const c10::Stream& stream);

// ep_backend.record_stream for each CUDA tensor of `tensors`: lent ones as above, others through
// Tensor.record_stream.
void recordStreams(const std::vector<at::Tensor>& tensors, const c10::Stream& stream);

}  // namespace ep
