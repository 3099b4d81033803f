#include "backend/dispatch_layout.hpp"

#include "backend/moe_validation.hpp"

namespace ep {

at::Tensor positionsInColumns(const at::Tensor& mask) {
  const at::Tensor inclusive = mask.t().to(at::kInt).contiguous().cumsum(1, at::kInt).t();
  return at::where(mask, inclusive - 1, -1).to(at::kInt).contiguous();
}

LayoutTensors computeDispatchLayout(const at::Tensor& topk_idx, int64_t num_experts,
                                    int64_t num_ranks) {
  checkDispatchLayoutArgs(topk_idx, num_experts, num_ranks);
  const int64_t experts_per_rank = num_experts / num_ranks;
  at::Tensor idx = topk_idx.to(at::kLong);
  at::Tensor valid = idx.ge(0);
  // Invalid entries go to a spare column/bin that is dropped afterwards.
  at::Tensor rank_of = at::where(valid, idx.div(experts_per_rank, "floor"), num_ranks);
  at::Tensor in_rank = at::zeros({idx.size(0), num_ranks + 1}, idx.options().dtype(at::kBool));
  in_rank.scatter_(1, rank_of, true);
  at::Tensor is_token_in_rank = in_rank.narrow(1, 0, num_ranks).contiguous();
  at::Tensor per_rank = is_token_in_rank.sum(0).to(at::kInt);
  at::Tensor experts = at::where(valid, idx, num_experts).reshape(-1);
  at::Tensor per_expert = at::zeros({num_experts + 1}, idx.options());
  per_expert.scatter_add_(0, experts, at::ones_like(experts));
  // Exclusive scan over tokens of each rank's column; -1 where the token is not sent.
  at::Tensor send_pos = positionsInColumns(is_token_in_rank);
  return {per_rank, per_expert.narrow(0, 0, num_experts).to(at::kInt), is_token_in_rank, send_pos};
}

}  // namespace ep
