// The high-throughput MoE collectives on CUDA tensors over NVLink (one host, 2-8 GPUs), through
// the torch-free NvlinkRuntime of cuda/nvlink_runtime.hpp. Only built with EP_WITH_CUDA.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Stream.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/carved_tensors.hpp"
#include "backend/moe_types.hpp"
#include "backend/transport.hpp"

namespace ep {

class EPProcessGroup;

namespace nvlink {

// get_dispatch_layout on a CUDA topk_idx: the layout kernel (one launch, no host sync). Ids
// outside [-1, E) count as -1; with `report_invalid` the first call on the device after that
// kernel ran raises (without, nothing records them: the caller counts them). num_ranks <= 8.
LayoutTensors dispatchLayout(const at::Tensor& topk_idx, int64_t num_experts, int64_t num_ranks,
                             bool report_invalid = true);

// The layout kernel's outputs as carved tensors (one allocation with whatever else a call
// carves): tokens per rank [R] int32, per expert [E] int32, is_token_in_rank [T, R] bool, send
// positions [T, R] int32, then the kernel's scratch (nvlink_layout_workspace_bytes, 0 when one
// block does it all). get_dispatch_layout and a dispatch without a given layout carve these.
std::array<CarvedShape, 5> layoutCarvedShapes(int64_t num_tokens, int64_t num_ranks,
                                              int64_t num_experts);

// The high-throughput dispatch. With `deferred` and an overlapped host wait (the default, without
// num_worst_tokens) it returns right after launching the kernels: the outputs have the worst-case
// row count until *deferred is called, which must happen before they are used. Otherwise (or
// when `deferred` is left empty) the result is complete.
DispatchResult dispatch(EPProcessGroup& pg, const DispatchArgs& args,
                        DeferredCounts* deferred = nullptr);

// Tensor.record_stream for the dispatch outputs that view a lent receive slab (which PyTorch's
// caching allocator does not own, so its record_stream ignores them): the slab is lent again only
// after the work queued on `stream` when the last of its views is freed. False (nothing done)
// for any other tensor.
bool recordSlabStream(const at::Tensor& tensor, const c10::Stream& stream);

// Transport::reserve on the NVLink path. Raises on every rank when growing the transport would
// free buffers a captured CUDA graph uses.
std::vector<int64_t> reserve(EPProcessGroup& pg, const at::Device& device,
                             const at::Tensor& gathered);

std::pair<at::Tensor, std::optional<at::Tensor>> cachedDispatch(
    EPProcessGroup& pg, const at::Tensor& x, const std::optional<at::Tensor>& x_scales,
    const DispatchRouting& routing);

std::pair<at::Tensor, std::optional<at::Tensor>> combine(EPProcessGroup& pg,
                                                         const CombineArgs& args);

// dist.all_to_all_single on the NVLink kernels (nvlink_all_to_all_op.cpp): null when this call
// is not served here (the caller runs the inner NCCL backend). Transport::allToAll.
c10::intrusive_ptr<c10d::Work> allToAll(EPProcessGroup& pg, at::Tensor& output,
                                        const at::Tensor& input,
                                        const std::vector<int64_t>& output_split_sizes,
                                        const std::vector<int64_t>& input_split_sizes,
                                        bool async_op);

// ep_backend.all_to_all_v(_2d) with device splits. Transport::allToAllDeviceSplits.
bool allToAllDeviceSplits(EPProcessGroup& pg, const at::Tensor& input, const at::Tensor& splits,
                          const at::Tensor& output, int64_t num_local_experts,
                          const at::Tensor& recv_splits, const at::Tensor& recv_offsets);

}  // namespace nvlink

// The NVLink transport (registered in backend/transport_registry.cpp).
Transport& nvlinkTransport();

}  // namespace ep
