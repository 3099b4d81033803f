// Argument and result bundles of the MoE collectives, shared by the CPU path and the CUDA path.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace ep {

class EPProcessGroup;

// get_dispatch_layout's results: num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E],
// is_token_in_rank bool [T, R], send_pos int32 [T, R] (position of token t among the tokens sent
// to rank r, -1 where it is not sent). Dispatch may take them instead of computing its own.
using LayoutTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The routing of one high-throughput dispatch (see ep_backend/handles.py: DispatchHandle).
struct DispatchRouting {
  at::Tensor is_token_in_rank;          // bool [T, R]
  at::Tensor num_tokens_per_rank;       // int32 [R], rows sent to each rank
  at::Tensor num_recv_tokens_per_rank;  // int32 [R], rows received from each rank
  at::Tensor recv_src_idx;              // int32 [N]
  at::Tensor recv_src_rank;             // int32 [N]
};

struct DispatchArgs {
  at::Tensor x;                            // [T, H]
  std::optional<at::Tensor> x_scales;      // [T, S]
  at::Tensor topk_idx;                     // [T, K] int64/int32
  std::optional<at::Tensor> topk_weights;  // [T, K] float32
  int64_t num_experts = 0;
  int64_t expert_alignment = 1;
  int64_t num_worst_tokens = 0;
  // Empty, or a layout of topk_idx computed earlier (get_dispatch_layout, LayoutTensors order).
  std::vector<at::Tensor> layout;
};

struct DispatchResult {
  at::Tensor recv_x;
  std::optional<at::Tensor> recv_x_scales;
  at::Tensor recv_topk_idx;
  std::optional<at::Tensor> recv_topk_weights;
  at::Tensor num_recv_tokens_per_expert;  // int32 [E_loc], aligned
  // The same counts on the CPU (int64 [E_loc]) where the host knows them without reading the
  // device (normal mode); int64 [0] in worst-case mode (no host step).
  at::Tensor num_recv_tokens_per_expert_host;
  DispatchRouting routing;
};

// What is left of a dispatch whose count wait was deferred (nvlink::dispatch): waits for the
// receive counts (raising on every rank if some rank's topk_idx was rejected), sets the outputs'
// row counts in place and remembers the routing. Returns num_recv_tokens_per_expert as the host
// saw it.
using DeferredCounts = std::function<std::vector<int64_t>()>;

struct CombineArgs {
  at::Tensor x;                            // [N, H]
  std::optional<at::Tensor> topk_weights;  // [N, K]
  std::optional<at::Tensor> bias0;         // [T, H]
  std::optional<at::Tensor> bias1;         // [T, H]
  DispatchRouting routing;
};

struct LowLatencyDispatchInputs {
  at::Tensor x;         // bf16 [T, H]
  at::Tensor topk_idx;  // [T, K]
  int64_t num_max_dispatch_tokens_per_rank = 0;
  int64_t num_experts = 0;
  bool use_fp8 = true;
  bool round_scale = false;
  bool use_ue8m0 = false;
};

struct LowLatencyDispatchResult {
  at::Tensor recv_x;  // [E_loc, R*M, H]
  std::optional<at::Tensor> recv_x_scales;
  at::Tensor recv_count;    // int32 [E_loc]
  at::Tensor src_info;      // int32 [E_loc, R*M]
  at::Tensor layout_range;  // int64 [E_loc, R]
};

struct LowLatencyCombineInputs {
  at::Tensor x;             // bf16 [E_loc, R*M, H]
  at::Tensor topk_idx;      // [T, K]
  at::Tensor topk_weights;  // float32 [T, K]
  at::Tensor src_info;
  at::Tensor layout_range;
  int64_t num_max_dispatch_tokens_per_rank = 0;
};

}  // namespace ep
