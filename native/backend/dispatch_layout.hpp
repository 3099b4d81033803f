// The dispatch layout of a topk_idx in plain ATen ops (any device): what get_dispatch_layout
// returns, and what a layout passed to dispatch is checked against. The ATen transport serves the
// layout op with it; the NVLink transport's layout kernel gives the same tensors.
#pragma once

#include <ATen/ATen.h>

#include "backend/moe_types.hpp"

namespace ep {

LayoutTensors computeDispatchLayout(const at::Tensor& topk_idx, int64_t num_experts,
                                    int64_t num_ranks);

}  // namespace ep
