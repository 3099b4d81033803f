#include "transports/internode/internode_plan.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

#include "backend/dispatch_layout.hpp"

namespace ep::internode {

Plan makePlan(const at::Tensor& is_token_in_rank, const at::Tensor& send_pos,
              const std::vector<int64_t>& offsets, const at::Tensor& node_rank_index,
              int64_t num_nodes, int64_t ranks_per_node) {
  return makePlan(is_token_in_rank, send_pos,
                  at::tensor(offsets, at::kLong).to(is_token_in_rank.device()), node_rank_index,
                  num_nodes, ranks_per_node);
}

Plan makePlan(const at::Tensor& is_token_in_rank, const at::Tensor& send_pos,
              const at::Tensor& offsets, const at::Tensor& node_rank_index, int64_t num_nodes,
              int64_t ranks_per_node) {
  TORCH_CHECK(is_token_in_rank.dim() == 2 && is_token_in_rank.scalar_type() == at::kBool,
              "ep internode plan: is_token_in_rank must be bool [T, R]");
  const int64_t T = is_token_in_rank.size(0);
  const int64_t R = is_token_in_rank.size(1);
  TORCH_CHECK(send_pos.sizes() == is_token_in_rank.sizes(),
              "ep internode plan: send_pos must have the shape of is_token_in_rank");
  TORCH_CHECK(offsets.dim() == 1 && offsets.numel() == R, "ep internode plan: ", offsets.numel(),
              " offsets for ", R, " ranks");
  TORCH_CHECK(num_nodes >= 1 && ranks_per_node >= 1 && num_nodes * ranks_per_node == R &&
                  node_rank_index.numel() == R,
              "ep internode plan: ", num_nodes, " nodes x ", ranks_per_node,
              " ranks do not match a group of ", R, " (node table of ", node_rank_index.numel(),
              ")");
  const auto dev = is_token_in_rank.device();
  const at::Tensor off = offsets.to(dev, at::kLong);
  Plan p;
  p.dest_slot = at::where(send_pos.ge(0), send_pos.to(at::kLong) + off.unsqueeze(0), -1)
                    .to(at::kInt)
                    .contiguous();
  const at::Tensor in_node = is_token_in_rank.index_select(1, node_rank_index.to(dev))
                                 .view({T, num_nodes, ranks_per_node})
                                 .any(2);
  p.node_pos = positionsInColumns(in_node);
  // [N] even when T = 0 (the sum of no rows): the signal of every node carries its count.
  p.node_count = in_node.sum(0).to(at::kInt).contiguous();
  return p;
}

std::vector<int64_t> receiveOffsets(const at::Tensor& matrix, int64_t rank) {
  const at::Tensor m64 = matrix.to(at::kCPU, at::kLong).contiguous();
  auto m = m64.accessor<int64_t, 2>();
  const int64_t R = m64.size(0);
  TORCH_CHECK(m64.size(1) == R && rank >= 0 && rank < R,
              "ep internode plan: the count matrix must be [R, R] and rank in [0, R)");
  std::vector<int64_t> off(static_cast<size_t>(R), 0);
  for (int64_t d = 0; d < R; ++d) {
    for (int64_t s = 0; s < rank; ++s) off[static_cast<size_t>(d)] += m[s][d];
  }
  return off;
}

int64_t maxReceived(const at::Tensor& matrix) {
  const at::Tensor m64 = matrix.to(at::kCPU, at::kLong).contiguous();
  auto m = m64.accessor<int64_t, 2>();
  const int64_t R = m64.size(0);
  int64_t best = 0;
  for (int64_t d = 0; d < R; ++d) {
    int64_t total = 0;
    for (int64_t s = 0; s < R; ++s) total += m[s][d];
    best = std::max(best, total);
  }
  return best;
}

int64_t roundUpPositive(int64_t v, int64_t m) {
  return (std::max<int64_t>(v, 1) + m - 1) / m * m;
}

bool holds(const Capacity& have, const Capacity& need) {
  return have.max_tokens >= need.max_tokens && have.max_recv_rows >= need.max_recv_rows &&
         have.max_record >= need.max_record && have.max_out_record >= need.max_out_record &&
         have.max_combine_row >= need.max_combine_row &&
         have.max_partial_row >= need.max_partial_row &&
         have.max_local_experts >= need.max_local_experts;
}

Capacity grownCapacity(const Capacity& have, const Capacity& need) {
  Capacity cap;
  cap.max_tokens = roundUpPositive(std::max(have.max_tokens, need.max_tokens), 256);
  cap.max_recv_rows = roundUpPositive(std::max(have.max_recv_rows, need.max_recv_rows), 1024);
  cap.max_record = std::max(have.max_record, need.max_record);
  cap.max_out_record = std::max(have.max_out_record, need.max_out_record);
  cap.max_combine_row = std::max(have.max_combine_row, need.max_combine_row);
  cap.max_partial_row = std::max(have.max_partial_row, need.max_partial_row);
  cap.max_local_experts =
      roundUpPositive(std::max(have.max_local_experts, need.max_local_experts), 8);
  return cap;
}

namespace {

int64_t aligned(int64_t bytes) {
  return static_cast<int64_t>(align16(static_cast<size_t>(bytes)));
}

}  // namespace

Capacity dispatchNeed(int64_t max_tokens, int64_t max_recv_rows, int64_t hidden, int64_t x_bytes,
                      int64_t scale_bytes, int64_t topk, int64_t ranks_per_node,
                      int64_t local_experts) {
  const RecordLayout rec = RecordLayout::make(x_bytes, scale_bytes, topk, ranks_per_node);
  Capacity need;
  need.max_tokens = max_tokens;
  need.max_recv_rows = max_recv_rows;
  need.max_local_experts = local_experts;
  need.max_record = rec.r_bytes;
  need.max_out_record = rec.n_bytes;
  // Room for the combine of this dispatch too (BF16 rows of the same H and top-k), so that the
  // first combine does not rebuild the buffers.
  const Capacity rows = combineNeed(max_tokens, hidden, 2, topk);
  need.max_combine_row = rows.max_combine_row;
  need.max_partial_row = rows.max_partial_row;
  return need;
}

Capacity combineNeed(int64_t max_tokens, int64_t hidden, int64_t element_bytes, int64_t topk) {
  Capacity need;
  need.max_tokens = max_tokens;
  need.max_recv_rows = 1;
  need.max_combine_row = aligned(element_bytes * hidden) + aligned(4 * topk);
  need.max_partial_row = aligned(4 * hidden) + aligned(4 * topk);
  return need;
}

std::string describe(const Capacity& c) {
  std::ostringstream os;
  os << "tokens " << c.max_tokens << ", received rows " << c.max_recv_rows << ", record "
     << c.max_record << " B, output record " << c.max_out_record << " B, combine row "
     << c.max_combine_row << " B, partial row " << c.max_partial_row << " B, local experts "
     << c.max_local_experts;
  return os.str();
}

CapacityDecision decideCapacity(const Capacity* have, bool combine, int64_t max_tokens,
                                int64_t max_recv_rows, int64_t hidden, int64_t element_bytes,
                                int64_t scale_bytes, int64_t topk, int64_t num_nodes,
                                int64_t ranks_per_node, int64_t local_experts) {
  const Capacity need =
      combine ? combineNeed(max_tokens, hidden, element_bytes, topk)
              : dispatchNeed(max_tokens, max_recv_rows, hidden, element_bytes * hidden, scale_bytes,
                             topk, ranks_per_node, local_experts);
  CapacityDecision d;
  d.rebuild = have == nullptr || !holds(*have, need);
  d.capacity = d.rebuild ? grownCapacity(have != nullptr ? *have : Capacity{}, need) : *have;
  d.symmetric_bytes = RegionLayout::make(num_nodes, ranks_per_node, d.capacity).bytes;
  return d;
}

}  // namespace ep::internode
