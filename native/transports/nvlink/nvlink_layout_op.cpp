#ifdef EP_WITH_CUDA

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <limits>

#include "backend/carved_tensors.hpp"
#include "backend/host_stages.hpp"
#include "backend/moe_validation.hpp"
#include "transports/nvlink/cuda/nvlink_kernels.hpp"
#include "transports/nvlink/nvlink_layout_errors.hpp"
#include "transports/nvlink/nvlink_transport.hpp"

namespace ep::nvlink {

std::array<CarvedShape, 5> layoutCarvedShapes(int64_t num_tokens, int64_t num_ranks,
                                              int64_t num_experts) {
  const auto workspace_bytes = static_cast<int64_t>(
      nvlink_layout_workspace_bytes(static_cast<int>(num_tokens), static_cast<int>(num_experts)));
  return {CarvedShape{{num_ranks}, at::kInt}, CarvedShape{{num_experts}, at::kInt},
          CarvedShape{{num_tokens, num_ranks}, at::kBool},
          CarvedShape{{num_tokens, num_ranks}, at::kInt},
          CarvedShape{{workspace_bytes}, at::kByte}};
}

LayoutTensors dispatchLayout(const at::Tensor& topk_idx, int64_t num_experts, int64_t num_ranks,
                             bool report_invalid) {
  HostStages stages("layout");
  const char* op = "ep get_dispatch_layout: ";
  checkDispatchLayoutArgs(topk_idx, num_experts, num_ranks);
  TORCH_CHECK(num_ranks <= kMaxRanks, op, "the CUDA layout kernel serves 1..", kMaxRanks,
              " ranks, got ", num_ranks);
  TORCH_CHECK(num_experts <= (1 << 14), op, "num_experts=", num_experts, " exceeds 16384");
  TORCH_CHECK(topk_idx.size(0) <= std::numeric_limits<int>::max() / num_ranks, op,
              "too many tokens");
  const at::Device device = topk_idx.device();
  c10::cuda::CUDAGuard guard(device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  LayoutErrorState& err = layoutErrorState(device.index(), stream);
  // An earlier call's error is raised by the next layout that reports its own: a caller that
  // counts the invalid ids itself raises on every rank together, never here on one.
  if (const volatile ErrorRecord* e = err.host; report_invalid && e->code != kErrorNone) {
    const ErrorRecord record = takeLayoutError(device.index(), stream);
    const long long value = record.value_a, flat = record.value_b;
    TORCH_CHECK(record.code != kErrorTimeout, op, "an earlier call on ", device,
                " timed out: a block of the layout kernel waited for block ", value,
                ", which never ran (its outputs are wrong; reported by the next call)");
    TORCH_CHECK(false, op, "an earlier call on ", device, " got topk_idx value ", value,
                " at flat position ", flat,
                ", outside [-1, num_experts) (counted as -1 there; "
                "reported by the next call)");
  }
  stages.mark("checks");
  const at::Tensor idx = topk_idx.contiguous();
  // The four outputs and the kernel's scratch (empty when one block does it all) in one
  // allocation: the scratch is stream-ordered like the outputs, and its contents do not matter.
  auto [per_rank, per_expert, in_rank, send_pos, ws] =
      carveTensors<5>(device, layoutCarvedShapes(idx.size(0), num_ranks, num_experts));
  LayoutParams p{};
  p.topk_idx = idx.data_ptr();
  p.idx_bytes = static_cast<int>(idx.element_size());
  p.num_tokens = static_cast<int>(idx.size(0));
  p.num_topk = static_cast<int>(idx.size(1));
  p.num_experts = static_cast<int>(num_experts);
  p.num_ranks = static_cast<int>(num_ranks);
  p.num_tokens_per_rank = per_rank.data_ptr<int>();
  p.num_tokens_per_expert = per_expert.data_ptr<int>();
  p.is_token_in_rank = in_rank.data_ptr<bool>();
  p.send_pos = send_pos.data_ptr<int>();
  p.ctrl = err.ctrl;
  p.error = err.dev;
  p.rank = -1;
  p.ignore_invalid = !report_invalid;
  p.workspace = ws.numel() > 0 ? ws.data_ptr() : nullptr;
  stages.mark("alloc");
  C10_CUDA_CHECK(launch_nvlink_layout(p, stream));
  stages.mark("launch");
  return {per_rank, per_expert, in_rank, send_pos};
}

}  // namespace ep::nvlink

#endif  // EP_WITH_CUDA
