#include "backend/received_rows.hpp"

#include <numeric>
#include <utility>

namespace ep {

DispatchResult finishDispatch(const DispatchArgs& a, ReceivedRows rows, int64_t experts_per_rank,
                              const at::Tensor& is_token_in_rank, const at::Tensor& send_counts,
                              const at::Tensor& recv_counts) {
  // A scatter into a spare bin for -1: bincount would size its output on the host.
  const at::Tensor ids = rows.topk_local.flatten();
  const at::Tensor valid = ids.ge(0);
  at::Tensor per_expert = at::zeros({experts_per_rank + 1}, ids.options().dtype(at::kLong));
  per_expert.scatter_add_(0, at::where(valid, ids, experts_per_rank), valid.to(at::kLong));
  const int64_t align = a.expert_alignment;
  ExpertCounts counts;
  counts.device = (per_expert.narrow(0, 0, experts_per_rank) + (align - 1))
                      .div(align, "floor")
                      .mul(align)
                      .to(at::kInt);
  // The one read of the device in normal mode (the paths that take it synchronise anyway).
  if (a.num_worst_tokens == 0) counts.host = counts.device.to(at::kCPU, at::kLong);
  return finishDispatch(a, std::move(rows), is_token_in_rank, send_counts, recv_counts,
                        std::move(counts));
}

DispatchResult finishDispatch(const DispatchArgs& a, ReceivedRows rows,
                              const at::Tensor& is_token_in_rank, const at::Tensor& send_counts,
                              const at::Tensor& recv_counts, ExpertCounts per_expert) {
  DispatchResult out;
  out.num_recv_tokens_per_expert = std::move(per_expert.device);
  out.num_recv_tokens_per_expert_host = a.num_worst_tokens > 0 || !per_expert.host.defined()
                                            ? at::empty({0}, at::TensorOptions().dtype(at::kLong))
                                            : std::move(per_expert.host);
  out.recv_x = std::move(rows.x);
  out.recv_x_scales = std::move(rows.x_scales);
  out.recv_topk_idx = rows.topk_local.to(a.topk_idx.scalar_type());
  out.recv_topk_weights = std::move(rows.topk_weights);
  if (a.num_worst_tokens > 0) {
    const int64_t cap = a.num_worst_tokens;
    out.recv_x = padRows(out.recv_x, cap, 0);
    if (out.recv_x_scales) out.recv_x_scales = padRows(*out.recv_x_scales, cap, 0);
    out.recv_topk_idx = padRows(out.recv_topk_idx, cap, -1);
    if (out.recv_topk_weights) out.recv_topk_weights = padRows(*out.recv_topk_weights, cap, 0);
    rows.src_idx = padRows(rows.src_idx, cap, -1);
    rows.src_rank = padRows(rows.src_rank, cap, -1);
  }
  const at::Device device = a.x.device();
  out.routing.is_token_in_rank = is_token_in_rank;
  out.routing.num_tokens_per_rank = send_counts.to(device, at::kInt);
  out.routing.num_recv_tokens_per_rank = recv_counts.to(device, at::kInt);
  out.routing.recv_src_idx = std::move(rows.src_idx);
  out.routing.recv_src_rank = std::move(rows.src_rank);
  return out;
}

DispatchResult finishDispatch(const DispatchArgs& a, ReceivedRows rows, int64_t experts_per_rank,
                              const at::Tensor& is_token_in_rank,
                              const std::vector<int64_t>& send_counts,
                              const std::vector<int64_t>& recv_counts) {
  return finishDispatch(a, std::move(rows), experts_per_rank, is_token_in_rank,
                        at::tensor(send_counts, at::kLong), at::tensor(recv_counts, at::kLong));
}

at::Tensor padRows(const at::Tensor& t, int64_t rows, double fill) {
  if (t.size(0) >= rows) {
    return t;
  }
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  shape[0] = rows;
  at::Tensor out = at::full(shape, fill, t.options());
  out.narrow(0, 0, t.size(0)).copy_(t);
  return out;
}

at::Tensor segmentIds(const std::vector<int64_t>& counts, const at::TensorOptions& options) {
  std::vector<int64_t> ids;
  ids.reserve(static_cast<size_t>(std::accumulate(counts.begin(), counts.end(), int64_t{0})));
  for (size_t s = 0; s < counts.size(); ++s) {
    ids.insert(ids.end(), static_cast<size_t>(counts[s]), static_cast<int64_t>(s));
  }
  return at::tensor(ids, at::kLong).to(options.device(), options.dtype().toScalarType());
}

std::vector<int64_t> toVector(const at::Tensor& t) {
  at::Tensor c = t.to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

}  // namespace ep
