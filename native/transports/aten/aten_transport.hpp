// The MoE collectives in ATen ops over the group's inner backend (Gloo for CPU tensors; NCCL as the
// fallback for CUDA tensors the NVLink kernels do not serve): the contract of
// ep_backend/reference.py bit for bit, with one agreement all-gather (Gloo) and one packed
// all-to-all per call. This is what runs in CI and on laptops.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <utility>

#include "backend/moe_types.hpp"

namespace ep {

class EPProcessGroup;

namespace aten {

DispatchResult dispatch(EPProcessGroup& pg, const DispatchArgs& args);

std::pair<at::Tensor, std::optional<at::Tensor>> cachedDispatch(
    EPProcessGroup& pg, const at::Tensor& x, const std::optional<at::Tensor>& x_scales,
    const DispatchRouting& routing);

std::pair<at::Tensor, std::optional<at::Tensor>> combine(EPProcessGroup& pg,
                                                         const CombineArgs& args);

LowLatencyDispatchResult lowLatencyDispatch(EPProcessGroup& pg,
                                            const LowLatencyDispatchInputs& args);

at::Tensor lowLatencyCombine(EPProcessGroup& pg, const LowLatencyCombineInputs& args);

// FP8 e4m3 per-128-channel quantisation of the contract (reference.quantize_fp8_per128).
std::pair<at::Tensor, at::Tensor> quantizeFp8Per128(const at::Tensor& x, bool round_scale,
                                                    bool use_ue8m0);

}  // namespace aten
}  // namespace ep
