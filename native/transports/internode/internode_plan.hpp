// The host planning of the internode transport, apart from its CUDA glue so that CPU builds
// compile it and CPU tests reach it (ep_backend._C._internode_plan / _internode_capacity): where
// each of a rank's rows lands at every receiver, what the RDMA leg carries to each node, and the
// capacity of the symmetric buffers. Every input is agreed across the ranks (the count matrix, T
// of every rank, H, dtypes, top-k), so every rank computes the same capacity and decides the same
// rebuilds: a rank with T = 0 or with nothing to receive takes the same collective steps as the
// others. Torch-bound (ATen ops on any device); no CUDA.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "transports/internode/cuda/internode_common.hpp"

namespace ep::internode {

// What the kernels of one (cached) dispatch take about this rank's rows. On the GPU the notify
// kernel writes it (write_plan in cuda/internode_kernels.cu); makePlan below is the same with ATen
// ops, which the CPU tests check (ep_backend._C._internode_plan).
struct Plan {
  at::Tensor dest_slot;   // int32 [T, R]: row of token t in rank d's output, -1 where not sent
  at::Tensor node_pos;    // int32 [T, N]: index of token t among those sent to node n, or -1
  at::Tensor node_count;  // int32 [N]: tokens sent to node n (0 included: every node is signalled)
};

// The plan of one source rank. is_token_in_rank: bool [T, R]; send_pos: int32 [T, R] (the
// token's index among those sent to each rank, -1 where not); offsets: [R], rows of lower source
// ranks at each receiver (receiveOffsets); node_rank_index: int64 [N * L] on the tensors' device,
// the global rank of (node, local). T = 0 gives [0, R], [0, N] and N zeros.
Plan makePlan(const at::Tensor& is_token_in_rank, const at::Tensor& send_pos,
              const std::vector<int64_t>& offsets, const at::Tensor& node_rank_index,
              int64_t num_nodes, int64_t ranks_per_node);

// The same with the offsets as an integer tensor [R] on the tensors' device (the notify's): no
// host read, so a CUDA graph can capture it.
Plan makePlan(const at::Tensor& is_token_in_rank, const at::Tensor& send_pos,
              const at::Tensor& offsets, const at::Tensor& node_rank_index, int64_t num_nodes,
              int64_t ranks_per_node);

// Receive offsets of source `rank` at every receiver: the rows of lower source ranks first
// (receive order: source rank, then source token). matrix: int64 [R, R] [src, dst] counts (CPU).
std::vector<int64_t> receiveOffsets(const at::Tensor& matrix, int64_t rank);

// The most rows any rank receives (0 when nothing moves). matrix as above.
int64_t maxReceived(const at::Tensor& matrix);

// Round v (at least 1) up to a multiple of m: buffers of a call where every rank has T = 0 still
// hold one row (the runtime refuses a zero capacity).
int64_t roundUpPositive(int64_t v, int64_t m);

// Whether buffers of capacity `have` hold a call that needs `need`.
bool holds(const Capacity& have, const Capacity& need);

// The capacity of the buffers built when `have` does not hold `need`: the larger of both per
// field, tokens rounded up to 256 and received rows to 1024 (so that a slowly growing T does not
// rebuild every call). A function of agreed values only: the same on every rank.
Capacity grownCapacity(const Capacity& have, const Capacity& need);

// What a dispatch needs: max_tokens / max_recv_rows are agreed maxima over the ranks (0 allowed),
// the record sizes follow from H's bytes, the scales' bytes and top-k (0 for a cached dispatch),
// room is kept for the BF16 combine of the same H and top-k, and the notify rows carry the
// counts of `local_experts` experts per rank (E / R; 0 for a cached dispatch).
Capacity dispatchNeed(int64_t max_tokens, int64_t max_recv_rows, int64_t hidden, int64_t x_bytes,
                      int64_t scale_bytes, int64_t topk, int64_t ranks_per_node,
                      int64_t local_experts);

// What a combine needs: its rows of `element_bytes` (2: BF16, 4: float32), H and top-k (0: no
// weights); max_tokens the agreed maximum T over the ranks.
Capacity combineNeed(int64_t max_tokens, int64_t hidden, int64_t element_bytes, int64_t topk);

// One line naming every field (trace lines, the build rendezvous' comparison).
std::string describe(const Capacity& c);

// What one call does to buffers of capacity `have` (null: none yet): whether they are rebuilt,
// the capacity they then hold and that capacity's symmetric bytes. `combine` picks combineNeed,
// else dispatchNeed (x_bytes = element_bytes * hidden). The test hook _C._internode_capacity
// (tests/test_internode_plan_cpu.py) replays the transport's sizing with it.
struct CapacityDecision {
  bool rebuild = false;
  Capacity capacity;
  int64_t symmetric_bytes = 0;
};
CapacityDecision decideCapacity(const Capacity* have, bool combine, int64_t max_tokens,
                                int64_t max_recv_rows, int64_t hidden, int64_t element_bytes,
                                int64_t scale_bytes, int64_t topk, int64_t num_nodes,
                                int64_t ranks_per_node, int64_t local_experts);

}  // namespace ep::internode
