// The dispatch layout of a topk_idx in plain ATen ops (any device): what get_dispatch_layout
// returns, and what a layout passed to dispatch is checked against. The ATen transport serves the
// layout op with it; the NVLink transport's layout kernel gives the same tensors.
#pragma once

#include <ATen/ATen.h>

#include "backend/moe_types.hpp"

namespace ep {

// int32 [T, C]: for each set entry of `mask` (bool [T, C]), its row's index among the set rows of
// its column; -1 where not set. The scan runs along the contiguous dimension of the transpose:
// ATen's scan over the outer dimension of a [T, C] tensor with few columns runs on a handful of
// threads (hundreds of µs at T = 4096 on a GPU).
at::Tensor positionsInColumns(const at::Tensor& mask);

LayoutTensors computeDispatchLayout(const at::Tensor& topk_idx, int64_t num_experts,
                                    int64_t num_ranks);

}  // namespace ep
