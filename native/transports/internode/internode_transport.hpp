// The internode transport (registered in backend/transport_registry.cpp): high-throughput
// dispatch, cached dispatch and combine of a group spanning several nodes, through the
// hierarchical NVSHMEM kernels of cuda/ (docs/internode.md). It serves a group when the group has
// several nodes of equal size (1-8 ranks each, found from the hosts or emulated), the group's
// NVSHMEM low-latency transport is usable (it shares that NVSHMEM session), libep_nvshmem.so has
// the internode kernels on every rank, and EP_HIGH_THROUGHPUT is not "aten".
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <utility>

#include "backend/moe_types.hpp"
#include "backend/transport.hpp"

namespace ep {
class EPProcessGroup;

#ifdef EP_WITH_CUDA
namespace internode {
// Same contract as the ATen transport's (bitwise for the copies; combine: see docs/internode.md
// for its summation order).
DispatchResult dispatch(EPProcessGroup& pg, const DispatchArgs& args);
std::pair<at::Tensor, std::optional<at::Tensor>> cachedDispatch(
    EPProcessGroup& pg, const at::Tensor& x, const std::optional<at::Tensor>& x_scales,
    const DispatchRouting& routing);
std::pair<at::Tensor, std::optional<at::Tensor>> combine(EPProcessGroup& pg,
                                                         const CombineArgs& args);
}  // namespace internode

Transport& internodeTransport();
#endif

}  // namespace ep
