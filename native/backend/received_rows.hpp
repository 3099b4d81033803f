// Host-side assembly of a high-throughput dispatch's result from the rows it received, shared by
// the transports that move rows and then finish on the host with ATen ops (transports/aten and
// transports/internode): per-expert counts, num_worst_tokens padding and the routing handle.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "backend/moe_types.hpp"

namespace ep {

// The rows one rank received, num_recv of them in source-rank order, on the device of x.
struct ReceivedRows {
  at::Tensor x;                            // [num_recv, H], dtype of x
  std::optional<at::Tensor> x_scales;      // [num_recv, S] (when x had scales)
  at::Tensor topk_local;                   // int64 [num_recv, K]: local expert or -1
  std::optional<at::Tensor> topk_weights;  // float32 [num_recv, K] (when given)
  at::Tensor src_idx;                      // int32 [num_recv]: the row's token at its source
  at::Tensor src_rank;                     // int32 [num_recv]: its source rank
};

// The dispatch's result: num_recv_tokens_per_expert (int32, each rounded up to
// a.expert_alignment, and int64 on the host unless a.num_worst_tokens > 0), recv_topk_idx in
// topk_idx's dtype, every row tensor padded to a.num_worst_tokens when that is set (0, -1 for
// indices and sources), and the routing (num_tokens_per_rank / num_recv_tokens_per_rank: int64
// [R] on the host, stored as int32 on the device).
DispatchResult finishDispatch(const DispatchArgs& a, ReceivedRows rows, int64_t experts_per_rank,
                              const at::Tensor& is_token_in_rank,
                              const std::vector<int64_t>& send_counts,
                              const std::vector<int64_t>& recv_counts);

// The same with the counts as integer [R] tensors (on the device, or the host): nothing is read
// on the host unless a.num_worst_tokens is 0 (the per-expert counts' host copy), so a CUDA graph
// can capture a worst-case dispatch's finish. The routing keeps int32 copies of the counts on the
// device of x (the tensors themselves where they already are: pass tensors the result may keep).
DispatchResult finishDispatch(const DispatchArgs& a, ReceivedRows rows, int64_t experts_per_rank,
                              const at::Tensor& is_token_in_rank, const at::Tensor& send_counts,
                              const at::Tensor& recv_counts);

// Rows received per local expert, already rounded up to the call's expert_alignment, where the
// transport learnt them before the rows arrived (the internode notify): int32 [E / R] on the
// device, and int64 on the host unless the call has num_worst_tokens (then undefined).
struct ExpertCounts {
  at::Tensor device;
  at::Tensor host;
};

// finishDispatch with the per-expert counts given: no count over the received rows, and nothing
// read from the device.
DispatchResult finishDispatch(const DispatchArgs& a, ReceivedRows rows,
                              const at::Tensor& is_token_in_rank, const at::Tensor& send_counts,
                              const at::Tensor& recv_counts, ExpertCounts per_expert);

// Pads the first dimension of `t` to `rows` (>= t.size(0)) with `fill`.
at::Tensor padRows(const at::Tensor& t, int64_t rows, double fill);

// [0]*counts[0] ++ [1]*counts[1] ++ ...: the segment of every row, of options' dtype and device.
// Built on the host: counts are per-rank vectors, and ATen's repeat_interleave is slow for them
// on CPU (thread wake-ups).
at::Tensor segmentIds(const std::vector<int64_t>& counts, const at::TensorOptions& options);

// The elements of `t` as int64 on the host.
std::vector<int64_t> toVector(const at::Tensor& t);

}  // namespace ep
