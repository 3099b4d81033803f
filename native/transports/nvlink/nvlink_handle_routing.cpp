#ifdef EP_WITH_CUDA

#include "transports/nvlink/nvlink_handle_routing.hpp"

#include <c10/cuda/CUDACachingAllocator.h>

#include "backend/moe_validation.hpp"

namespace ep::nvlink {
namespace {

// Per-token send positions and receive prefix of a handle (the kernels' view of the routing);
// the prefix is left undefined unless `with_prefix`.
std::pair<at::Tensor, at::Tensor> kernelRouting(const DispatchRouting& r, bool with_prefix) {
  at::Tensor in_rank = r.is_token_in_rank.to(at::kInt);
  at::Tensor send_pos =
      at::where(r.is_token_in_rank, in_rank.cumsum(0, at::kInt) - 1, -1).to(at::kInt).contiguous();
  if (!with_prefix) {
    return {send_pos, at::Tensor()};
  }
  at::Tensor prefix = at::zeros({r.num_recv_tokens_per_rank.numel() + 1},
                                r.num_recv_tokens_per_rank.options().dtype(at::kInt));
  prefix.narrow(0, 1, r.num_recv_tokens_per_rank.numel())
      .copy_(r.num_recv_tokens_per_rank.cumsum(0, at::kInt));
  return {send_pos, prefix};
}

}  // namespace

std::pair<at::Tensor, at::Tensor> routingFor(const KernelRouting* known, const DispatchRouting& r,
                                             const c10::cuda::CUDAStream& stream,
                                             bool with_prefix) {
  if (known == nullptr) {
    return kernelRouting(r, with_prefix);
  }
  for (const at::Tensor* t : {&known->send_pos, &known->recv_prefix}) {
    c10::cuda::CUDACachingAllocator::recordStream(t->storage().data_ptr(), stream);
  }
  return {known->send_pos, known->recv_prefix};
}

HandleCounts handleCounts(const KernelRouting* known, const DispatchRouting& r, int64_t num_ranks,
                          bool capture, bool valid, const char* op) {
  if (!valid || capture || (known != nullptr && known->host_counts.empty())) {
    return {std::vector<int64_t>(2 * num_ranks, 0), false, ""};
  }
  if (known != nullptr) {
    return {known->host_counts, true, ""};
  }
  HandleCounts h;
  h.counts = checkedRoutingCounts(op, r, h.error);
  h.known = true;
  return h;
}

}  // namespace ep::nvlink

#endif  // EP_WITH_CUDA
