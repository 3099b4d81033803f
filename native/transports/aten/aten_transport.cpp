#include "transports/aten/aten_transport.hpp"

#include <c10/util/Exception.h>

#include <chrono>
#include <cstdint>
#include <numeric>
#include <sstream>
#include <thread>

#include "backend/dispatch_layout.hpp"
#include "backend/ep_process_group.hpp"
#include "backend/moe_validation.hpp"
#include "backend/peer_liveness.hpp"
#include "backend/rank_mask.hpp"
#include "backend/received_rows.hpp"
#include "backend/store_exchange.hpp"
#include "backend/transport.hpp"

namespace ep::aten {
namespace {

using at::indexing::Slice;

constexpr double kFp8Max = 448.0;
constexpr int64_t kFp8Group = 128;

int64_t productOfRowDims(const at::Tensor& t) {
  int64_t n = 1;
  for (int64_t d = 1; d < t.dim(); ++d) {
    n *= t.size(d);
  }
  return n;
}

// [n, ...] of any dtype -> uint8 [n, row_bytes] (a bitwise view of a contiguous copy).
at::Tensor rowsAsBytes(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  const int64_t row_bytes = productOfRowDims(c) * c.element_size();
  if (c.size(0) == 0) {
    return at::empty({0, row_bytes}, c.options().dtype(at::kByte));
  }
  return c.reshape({c.size(0), productOfRowDims(c)}).view(at::kByte);
}

// Columns [offset, offset + nbytes) of packed rows, reinterpreted as `dtype` rows of `row_shape`.
at::Tensor bytesToRows(const at::Tensor& bytes, int64_t offset, int64_t nbytes,
                       at::ScalarType dtype, std::vector<int64_t> row_shape) {
  const int64_t n = bytes.size(0);
  std::vector<int64_t> shape{n};
  shape.insert(shape.end(), row_shape.begin(), row_shape.end());
  if (n == 0) {
    return at::empty(shape, bytes.options().dtype(dtype));
  }
  // clone, not contiguous(): a single row is contiguous already, and contiguous() would keep
  // the block's byte offset in the storage, which view(dtype) needs divisible by the element size.
  return bytes.narrow(1, offset, nbytes)
      .clone(at::MemoryFormat::Contiguous)
      .view(dtype)
      .reshape(shape);
}

// Packs per-row byte blocks side by side; records each block's (offset, size).
struct RowPacker {
  std::vector<at::Tensor> blocks;
  std::vector<std::pair<int64_t, int64_t>> spans;
  int64_t width = 0;

  size_t add(const at::Tensor& rows) {
    at::Tensor b = rowsAsBytes(rows);
    spans.emplace_back(width, b.size(1));
    width += b.size(1);
    blocks.push_back(b);
    return spans.size() - 1;
  }
  at::Tensor packed() const { return at::cat(blocks, 1); }
};

int64_t sum(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

// The data exchange of a call failed after its agreement: a peer's process died (Gloo: its
// connections closed) or the exchange timed out. The ranks' calls are out of step from here, so
// the group's MoE calls cannot go on (as after an agreement timeout: abort and re-create). The
// error names the peers on this host whose process is gone (peer_liveness.hpp); a socket closes
// before its process is reaped, so the lookup is retried briefly.
[[noreturn]] void exchangeFailed(EPProcessGroup& pg, const char* op, const std::exception& e) {
  std::vector<int64_t> dead = deadPeers(pg);
  for (int attempt = 0; dead.empty() && attempt < 10; ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    dead = deadPeers(pg);
  }
  std::ostringstream os;
  os << "ep " << op << ": rank " << pg.getRank() << " lost the data exchange after the agreement";
  if (!dead.empty()) {
    os << ": rank(s) " << joinRanks(dead) << " died during this call (their process is gone)";
  }
  os << " (" << messageWithoutTrace(e) << ")";
  pg.markMoeUnusable(os.str());
  abandonMoeAgreement(pg);  // peers on this host still calling raise at once
  TORCH_CHECK(false, os.str());
}

// Exchanges packed rows: rows [off_r, off_r + send_counts[r]) go to rank r. The exchange runs
// on flat byte buffers that always own storage (Gloo dislikes null pointers of empty tensors).
at::Tensor allToAllRows(EPProcessGroup& pg, const char* op, const at::Tensor& send,
                        int64_t row_bytes, const std::vector<int64_t>& send_counts,
                        const std::vector<int64_t>& recv_counts) {
  const int64_t num_recv = sum(recv_counts);
  const auto bytes = send.options().dtype(at::kByte);
  at::Tensor recv = at::empty({num_recv * row_bytes + 1}, bytes).narrow(0, 0, num_recv * row_bytes);
  at::Tensor send_flat =
      send.numel() > 0 ? send.contiguous().view(-1) : at::empty({1}, bytes).narrow(0, 0, 0);
  std::vector<int64_t> in_splits, out_splits;
  for (int64_t c : send_counts) {
    in_splits.push_back(c * row_bytes);
  }
  for (int64_t c : recv_counts) {
    out_splits.push_back(c * row_bytes);
  }
  c10d::AllToAllOptions opts;
  opts.timeout = pg.options()->timeout;
  opts.asyncOp = false;  // on CUDA: enqueue on the current stream, like the surrounding ops
  if (C10_UNLIKELY(testExchangeDelay() > 0)) {  // test hook (moe_validation.hpp)
    std::this_thread::sleep_for(std::chrono::milliseconds(testExchangeDelay()));
  }
  try {
    auto work = pg.innerBackend(send.device().type(), op)
                    ->alltoall_base(recv, send_flat, out_splits, in_splits, opts);
    if (work) {  // NCCL returns no Work for a synchronous op: it is already on the current stream
      work->wait();
    }
  } catch (const std::exception& e) {
    exchangeFailed(pg, op, e);
  }
  return recv.view({num_recv, row_bytes});
}

// Token indices sent to each rank (ascending), concatenated in rank order, and the counts.
std::pair<at::Tensor, std::vector<int64_t>> sendPlan(const at::Tensor& is_token_in_rank) {
  const int64_t num_ranks = is_token_in_rank.size(1);
  std::vector<at::Tensor> tokens;
  std::vector<int64_t> counts;
  for (int64_t r = 0; r < num_ranks; ++r) {
    at::Tensor t = is_token_in_rank.select(1, r).nonzero().squeeze(1);
    counts.push_back(t.numel());
    tokens.push_back(t);
  }
  return {at::cat(tokens), counts};
}

// The valid entries of a low-latency topk_idx: their flat positions ([T*K] order), sorted by
// expert (stable: by token within an expert), and each entry's expert (in flat order).
std::pair<at::Tensor, at::Tensor> entriesByExpert(const at::Tensor& topk_idx) {
  const at::Tensor flat = topk_idx.to(at::kLong).reshape(-1);
  const at::Tensor positions = flat.ge(0).nonzero().squeeze(1);
  const at::Tensor experts = flat.index_select(0, positions);
  const at::Tensor order = std::get<1>(experts.sort(/*stable=*/true, 0, false));
  return {positions.index_select(0, order), experts};
}

// topk_idx with every entry on a masked rank set to -1: the spec's absent experts (valid ids
// only: callers pass inputs that passed validation).
at::Tensor withoutMaskedRanks(const at::Tensor& topk_idx, const RankMaskSnapshot& mask,
                              int64_t experts_per_rank) {
  if (!mask.live_only() || experts_per_rank <= 0 || topk_idx.numel() == 0) {
    return topk_idx;
  }
  const int64_t num_ranks = static_cast<int64_t>(mask.masked.size());
  std::vector<int64_t> bits(mask.masked.begin(), mask.masked.end());
  const at::Tensor masked = at::tensor(bits, at::kLong).to(topk_idx.device()).gt(0);
  const at::Tensor rank_of = topk_idx.to(at::kLong)
                                 .clamp(0, num_ranks * experts_per_rank - 1)
                                 .div(experts_per_rank, "floor");
  const at::Tensor drop = masked.index_select(0, rank_of.reshape(-1))
                              .reshape(topk_idx.sizes())
                              .logical_and(topk_idx.ge(0));
  return at::where(drop, at::full({}, -1, topk_idx.options()), topk_idx);
}

// low_latency_combine with Options.low_latency_combine_bf16_partials, token side, as the NVSHMEM
// kernels add (reference.low_latency_combine(per_rank_partials=torch.bfloat16)): per expert rank
// in the order the token's entries first reach it, the rank's partial (+0.0, then + w * y of
// each of its entries in k order), rounded to BF16 where it summed more than one entry; out =
// bf16(+0.0 + each rank's partial in that order). `live_idx`: topk_idx without masked ranks;
// `y`: float32 [T, K, H], the returned rows in their entries' places.
at::Tensor sumOfRankPartialsInBf16(const at::Tensor& live_idx, const at::Tensor& topk_weights,
                                   const at::Tensor& y, int64_t experts_per_rank) {
  const int64_t topk = live_idx.size(1);
  const at::Tensor idx = live_idx.to(at::kLong);
  const at::Tensor valid = idx.ge(0);
  const at::Tensor dest =
      at::where(valid, idx.div(experts_per_rank, "floor"), at::full({}, -1, idx.options()));
  // Each entry's product, formed once: w * y in float32, as the kernels form it.
  const at::Tensor weighted = topk_weights.unsqueeze(2) * y;
  at::Tensor acc = at::zeros({y.size(0), y.size(2)}, y.options());
  for (int64_t k = 0; k < topk; ++k) {
    const at::Tensor d = dest.select(1, k);
    at::Tensor first = valid.select(1, k);  // the token's first entry on rank d
    for (int64_t j = 0; j < k; ++j) first = first.logical_and(dest.select(1, j).ne(d));
    at::Tensor partial = at::zeros_like(acc);
    at::Tensor entries = at::zeros_like(d);
    for (int64_t j = k; j < topk; ++j) {
      const at::Tensor on_d = valid.select(1, j).logical_and(dest.select(1, j).eq(d));
      partial = at::where(on_d.unsqueeze(1), partial + weighted.select(1, j), partial);
      entries = entries + on_d.to(at::kLong);
    }
    partial =
        at::where(entries.gt(1).unsqueeze(1), partial.to(at::kBFloat16).to(at::kFloat), partial);
    acc = at::where(first.unsqueeze(1), acc + partial, acc);
  }
  return acc.to(at::kBFloat16);
}

// allToAllRows among the live ranks of a masked call: point-to-point over the group's CPU
// backend (a CUDA tensor goes through the host), nothing to or from a masked rank (its counts are
// zero by construction: its rows were announced as absent).
at::Tensor allToAllRowsAmongLive(EPProcessGroup& pg, const char* op, const at::Tensor& send,
                                 int64_t row_bytes, const std::vector<int64_t>& send_counts,
                                 const std::vector<int64_t>& recv_counts,
                                 const RankMaskSnapshot& mask) {
  // A tag of its own: pairs deliver in order, and the agreement's tags carry the call number.
  constexpr int kTag = 0x3FFFFFF0;
  const int64_t num_ranks = pg.getSize();
  const int64_t rank = pg.getRank();
  const at::Tensor out_rows = send.to(at::kCPU).contiguous().view({-1, row_bytes});
  at::Tensor recv = at::empty({sum(recv_counts), row_bytes}, out_rows.options());
  auto backend = pg.innerBackend(c10::DeviceType::CPU, op);
  std::vector<std::pair<int64_t, c10::intrusive_ptr<c10d::Work>>> works;
  int64_t send_at = 0, recv_at = 0;
  for (int64_t p = 0; p < num_ranks; ++p) {
    const int64_t n_out = send_counts[p], n_in = recv_counts[p];
    if (p == rank) {
      recv.narrow(0, recv_at, n_in).copy_(out_rows.narrow(0, send_at, n_out));
    } else if (mask.is_masked(p)) {
      TORCH_INTERNAL_ASSERT(n_out == 0 && n_in == 0, "rows announced for masked rank ", p);
    } else {
      if (n_out > 0) {
        std::vector<at::Tensor> t{out_rows.narrow(0, send_at, n_out)};
        works.emplace_back(p, backend->send(t, static_cast<int>(p), kTag));
      }
      if (n_in > 0) {
        std::vector<at::Tensor> t{recv.narrow(0, recv_at, n_in)};
        works.emplace_back(p, backend->recv(t, static_cast<int>(p), kTag));
      }
    }
    send_at += n_out;
    recv_at += n_in;
  }
  for (auto& [peer, work] : works) {
    bool done = false;
    std::string why = "timed out";
    try {
      done = work->wait(pg.options()->timeout);
    } catch (const std::exception& e) {
      why = e.what();
      why = why.substr(0, why.find('\n'));
    }
    if (!done) {
      // The ranks are out of step from here and the Gloo pair may be closed, so masking the
      // peer cannot help: the group's MoE calls end, as after any lost exchange.
      const std::string message = "ep " + std::string(op) + ": rank " + std::to_string(rank) +
                                  ": the exchange with rank " + std::to_string(peer) +
                                  " failed after the agreement (" + why +
                                  "); abort the group (ep_backend.abort) and create a new one "
                                  "without that rank";
      pg.markMoeUnusable(message);
      abandonMoeAgreement(pg);  // peers on this host still calling raise at once
      TORCH_CHECK(false, message);
    }
  }
  return recv.to(send.device());
}

}  // namespace

DispatchResult dispatch(EPProcessGroup& pg, const DispatchArgs& a) {
  const int64_t num_ranks = pg.getSize();
  const int64_t rank = pg.getRank();
  const std::string error = validateDispatch(a, num_ranks);
  const bool ok = error.empty();

  at::Tensor is_token_in_rank, send_token;
  std::vector<int64_t> send_counts(num_ranks, 0);
  if (ok) {
    // A given layout: on CPU validateDispatch compared it with topk_idx's; on CUDA it is trusted,
    // as on the NVLink path (the caller's check ties it to this topk_idx).
    is_token_in_rank =
        a.layout.empty() ? std::get<2>(computeDispatchLayout(a.topk_idx, a.num_experts, num_ranks))
                         : a.layout[2];
    std::tie(send_token, send_counts) = sendPlan(is_token_in_rank);
  }
  const bool has_scales = a.x_scales.has_value();
  const bool has_weights = a.topk_weights.has_value();
  std::vector<int64_t> announced = send_counts;
  if (C10_UNLIKELY(testCountInflation() != 0)) {
    for (auto& c : announced) {
      c += testCountInflation();
    }
  }
  at::Tensor matrix =
      agreeAcrossRanks(pg, "dispatch", error, dispatchFields(a, ok), announced);  // [src, dst]
  std::vector<int64_t> recv_counts(num_ranks);
  auto m = matrix.accessor<int64_t, 2>();
  int64_t max_recv = 0;
  for (int64_t d = 0; d < num_ranks; ++d) {
    int64_t total = 0;
    for (int64_t s = 0; s < num_ranks; ++s) {
      total += m[s][d];
    }
    max_recv = std::max(max_recv, total);
  }
  for (int64_t s = 0; s < num_ranks; ++s) {
    recv_counts[s] = m[s][rank];
  }
  const int64_t num_recv = sum(recv_counts);
  TORCH_CHECK(a.num_worst_tokens == 0 || max_recv <= a.num_worst_tokens,
              "ep dispatch: num_worst_tokens=", a.num_worst_tokens,
              " is smaller than the rows a rank receives (up to ", max_recv,
              "); nothing was exchanged");

  const int64_t experts_per_rank = a.num_experts / num_ranks;
  const auto dev = a.x.options();
  at::Tensor dest = segmentIds(send_counts, dev.dtype(at::kLong));
  at::Tensor sent_topk = a.topk_idx.index_select(0, send_token).to(at::kLong);
  at::Tensor dest_col = dest.unsqueeze(1);
  at::Tensor on_dest =
      sent_topk.ge(0).logical_and(sent_topk.div(experts_per_rank, "floor").eq(dest_col));
  at::Tensor sent_local = at::where(on_dest, sent_topk - dest_col * experts_per_rank, -1);

  RowPacker packer;
  const size_t x_block = packer.add(a.x.index_select(0, send_token));
  const size_t s_block = has_scales ? packer.add(a.x_scales->index_select(0, send_token)) : 0;
  const size_t i_block = packer.add(sent_local);
  const size_t w_block =
      has_weights ? packer.add(at::where(on_dest, a.topk_weights->index_select(0, send_token), 0.0))
                  : 0;
  const size_t src_block = packer.add(send_token.to(at::kInt));
  at::Tensor recv =
      allToAllRows(pg, "dispatch", packer.packed(), packer.width, send_counts, recv_counts);

  const int64_t hidden = a.x.size(1);
  const int64_t topk = a.topk_idx.size(1);
  ReceivedRows rows;
  rows.x = bytesToRows(recv, packer.spans[x_block].first, packer.spans[x_block].second,
                       a.x.scalar_type(), {hidden});
  if (has_scales) {
    rows.x_scales = bytesToRows(recv, packer.spans[s_block].first, packer.spans[s_block].second,
                                a.x_scales->scalar_type(), {a.x_scales->size(1)});
  }
  rows.topk_local = bytesToRows(recv, packer.spans[i_block].first, packer.spans[i_block].second,
                                at::kLong, {topk});
  if (has_weights) {
    rows.topk_weights = bytesToRows(recv, packer.spans[w_block].first, packer.spans[w_block].second,
                                    at::kFloat, {topk});
  }
  rows.src_idx = bytesToRows(recv, packer.spans[src_block].first, packer.spans[src_block].second,
                             at::kInt, {1})
                     .reshape({num_recv});
  rows.src_rank = segmentIds(recv_counts, dev.dtype(at::kInt));
  return finishDispatch(a, std::move(rows), experts_per_rank, is_token_in_rank, send_counts,
                        recv_counts);
}

std::pair<at::Tensor, std::optional<at::Tensor>> cachedDispatch(
    EPProcessGroup& pg, const at::Tensor& x, const std::optional<at::Tensor>& x_scales,
    const DispatchRouting& routing) {
  const int64_t num_ranks = pg.getSize();
  const std::string error = validateCachedDispatch(x, x_scales, routing, num_ranks);
  const bool ok = error.empty();
  at::Tensor gathered =
      agreeAcrossRanks(pg, "cached dispatch", error, cachedDispatchFields(x, x_scales, ok),
                       routingCounts(routing, num_ranks));
  checkRoutingAgrees("cached dispatch", gathered, 0, pg.getRank());

  auto [send_token, send_counts] = sendPlan(routing.is_token_in_rank);
  std::vector<int64_t> recv_counts = toVector(routing.num_recv_tokens_per_rank);
  RowPacker packer;
  const size_t x_block = packer.add(x.index_select(0, send_token));
  const size_t s_block = x_scales ? packer.add(x_scales->index_select(0, send_token)) : 0;
  at::Tensor recv =
      allToAllRows(pg, "cached dispatch", packer.packed(), packer.width, send_counts, recv_counts);
  const int64_t cap = routing.recv_src_idx.size(0);
  at::Tensor recv_x =
      padRows(bytesToRows(recv, packer.spans[x_block].first, packer.spans[x_block].second,
                          x.scalar_type(), {x.size(1)}),
              cap, 0);
  std::optional<at::Tensor> recv_scales;
  if (x_scales) {
    recv_scales =
        padRows(bytesToRows(recv, packer.spans[s_block].first, packer.spans[s_block].second,
                            x_scales->scalar_type(), {x_scales->size(1)}),
                cap, 0);
  }
  return {recv_x, recv_scales};
}

std::pair<at::Tensor, std::optional<at::Tensor>> combine(EPProcessGroup& pg, const CombineArgs& a) {
  const int64_t num_ranks = pg.getSize();
  const std::string error = validateCombine(a, num_ranks);
  const bool ok = error.empty();
  const bool has_weights = a.topk_weights.has_value();
  at::Tensor gathered = agreeAcrossRanks(pg, "combine", error, combineFields(a, ok),
                                         routingCounts(a.routing, num_ranks));
  checkRoutingAgrees("combine", gathered, 0, pg.getRank());

  const auto& r = a.routing;
  std::vector<int64_t> held = toVector(r.num_recv_tokens_per_rank);
  std::vector<int64_t> back = toVector(r.num_tokens_per_rank);
  const int64_t num_valid = sum(held);
  RowPacker packer;
  const size_t x_block = packer.add(a.x.narrow(0, 0, num_valid));
  const size_t w_block = has_weights ? packer.add(a.topk_weights->narrow(0, 0, num_valid)) : 0;
  at::Tensor returned = allToAllRows(pg, "combine", packer.packed(), packer.width, held, back);

  const int64_t num_tokens = r.is_token_in_rank.size(0);
  const int64_t hidden = a.x.size(1);
  at::Tensor rows = bytesToRows(returned, packer.spans[x_block].first, packer.spans[x_block].second,
                                a.x.scalar_type(), {hidden});
  const auto acc_dtype = a.x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor acc = at::zeros({num_tokens, hidden}, a.x.options().dtype(acc_dtype));
  std::optional<at::Tensor> acc_w;
  at::Tensor w_rows;
  if (has_weights) {
    const int64_t topk = a.topk_weights->size(1);
    w_rows = bytesToRows(returned, packer.spans[w_block].first, packer.spans[w_block].second,
                         at::kFloat, {topk});
    acc_w = at::zeros({num_tokens, topk}, a.x.options().dtype(at::kFloat));
  }
  // Fixed order: ranks ascending, each adding once into the tokens it served.
  int64_t offset = 0;
  for (int64_t s = 0; s < num_ranks; ++s) {
    at::Tensor tokens = r.is_token_in_rank.select(1, s).nonzero().squeeze(1);
    const int64_t n = tokens.numel();
    at::Tensor part = rows.narrow(0, offset, n).to(acc_dtype);
    acc.index_put_({tokens}, acc.index({tokens}) + part);
    if (acc_w) {
      acc_w->index_put_({tokens}, acc_w->index({tokens}) + w_rows.narrow(0, offset, n));
    }
    offset += n;
  }
  for (const auto* b : {&a.bias0, &a.bias1}) {
    if (b->has_value()) {
      acc = acc + (*b)->to(acc_dtype);
    }
  }
  return {acc.to(a.x.scalar_type()), acc_w};
}

std::pair<at::Tensor, at::Tensor> quantizeFp8Per128(const at::Tensor& x, bool round_scale,
                                                    bool use_ue8m0) {
  const int64_t hidden = x.size(-1);
  const int64_t groups = hidden / kFp8Group;
  std::vector<int64_t> grouped(x.sizes().begin(), x.sizes().end() - 1);
  grouped.push_back(groups);
  grouped.push_back(kFp8Group);
  at::Tensor xf = x.to(at::kFloat).reshape(grouped);
  at::Tensor amax = xf.abs().amax(-1).clamp_min(1e-4);
  // A true IEEE division (not a multiply by 1/448), as the contract states.
  at::Tensor scale = amax / at::full_like(amax, kFp8Max);
  if (round_scale) {
    at::Tensor bits = scale.view(at::kInt).to(at::kLong);
    bits = (bits + 0x7FFFFF).bitwise_and(0x7F800000);
    scale = bits.to(at::kInt).view(at::kFloat);
  }
  at::Tensor inv = at::reciprocal(scale);
  at::Tensor q =
      (xf * inv.unsqueeze(-1)).clamp(-kFp8Max, kFp8Max).to(at::kFloat8_e4m3fn).reshape(x.sizes());
  if (!use_ue8m0) {
    return {q, scale.contiguous()};
  }
  at::Tensor exps =
      scale.contiguous().view(at::kInt).bitwise_right_shift(23).bitwise_and(0xFF).to(at::kLong);
  std::vector<int64_t> packed_shape(scale.sizes().begin(), scale.sizes().end() - 1);
  packed_shape.push_back(groups / 4);
  std::vector<int64_t> four = packed_shape;
  four.push_back(4);
  exps = exps.reshape(four);
  at::Tensor packed = at::zeros(packed_shape, x.options().dtype(at::kLong));
  for (int64_t j = 0; j < 4; ++j) {
    packed.bitwise_or_(exps.select(-1, j).bitwise_left_shift(8 * j));
  }
  packed = at::where(packed.ge(int64_t{1} << 31), packed - (int64_t{1} << 32), packed);
  return {q, packed.to(at::kInt)};
}

LowLatencyDispatchResult lowLatencyDispatch(EPProcessGroup& pg, const LowLatencyDispatchInputs& a) {
  const int64_t num_ranks = pg.getSize();
  const int64_t rank = pg.getRank();
  std::string error = validateLowLatencyDispatch(a, num_ranks);
  const int64_t max_tokens = a.num_max_dispatch_tokens_per_rank;
  RankMaskSnapshot mask = rankMask(pg);
  at::Tensor entry_token, per_expert;
  // The entries this rank sends: those on masked ranks are absent.
  auto plan = [&] {
    const int64_t topk = a.topk_idx.size(1);
    const at::Tensor topk_idx = withoutMaskedRanks(a.topk_idx, mask, a.num_experts / num_ranks);
    const auto [positions, experts] = entriesByExpert(topk_idx);
    per_expert = at::bincount(experts, {}, a.num_experts);
    entry_token = positions.div(topk, "floor");
  };
  if (error.empty()) {
    plan();
    if (per_expert.numel() > 0 && per_expert.max().item<int64_t>() > max_tokens) {
      error =
          "ep low_latency_dispatch: a rank may send at most num_max_dispatch_tokens_per_rank "
          "rows to one expert (a token lists the same expert more than once?)";
    }
  }
  const bool ok = error.empty();
  const std::vector<AgreedField> fields = lowLatencyDispatchFields(a, ok);
  std::vector<int64_t> payload =
      ok ? toVector(per_expert) : std::vector<int64_t>(a.num_experts > 0 ? a.num_experts : 0, 0);
  const std::vector<uint8_t> masked_before = mask.masked;
  at::Tensor gathered =
      agreeAmongLiveRanks(pg, "low_latency_dispatch", error, fields, payload, mask).toTensor();
  if (mask.masked != masked_before) {
    plan();  // a peer was auto-masked in the agreement: nothing goes to it either
  }

  const int64_t experts_per_rank = a.num_experts / num_ranks;
  const int64_t slots = num_ranks * max_tokens;
  const int64_t hidden = a.x.size(1);
  // recv_matrix [src rank, local expert]
  at::Tensor recv_matrix =
      gathered.narrow(1, rank * experts_per_rank, experts_per_rank).contiguous().to(a.x.device());
  at::Tensor send_matrix = per_expert.reshape({num_ranks, experts_per_rank});
  std::vector<int64_t> send_counts = toVector(send_matrix.sum(1));
  std::vector<int64_t> recv_counts = toVector(recv_matrix.sum(1));

  RowPacker packer;
  at::Tensor x_q, scales;
  size_t x_block, s_block = 0;
  if (a.use_fp8) {
    std::tie(x_q, scales) = quantizeFp8Per128(a.x, a.round_scale, a.use_ue8m0);
    x_block = packer.add(x_q.index_select(0, entry_token));
    s_block = packer.add(scales.index_select(0, entry_token));
  } else {
    x_block = packer.add(a.x.index_select(0, entry_token));
  }
  const size_t src_block = packer.add(entry_token.to(at::kInt));
  at::Tensor recv = mask.live_only()
                        ? allToAllRowsAmongLive(pg, "low_latency_dispatch", packer.packed(),
                                                packer.width, send_counts, recv_counts, mask)
                        : allToAllRows(pg, "low_latency_dispatch", packer.packed(), packer.width,
                                       send_counts, recv_counts);
  const int64_t num_entries = recv.size(0);

  // Received segments are (src rank, local expert) in that order; segment (s, le) lands at
  // slots begin[s, le] .. of expert le, where begin stacks the source ranks of one expert.
  at::Tensor seg_count = recv_matrix.reshape(-1);
  at::Tensor seg_begin = (recv_matrix.cumsum(0) - recv_matrix).reshape(-1);
  at::Tensor seg_offset = seg_count.cumsum(0) - seg_count;
  const auto dev = a.x.options();
  at::Tensor seg_expert = at::arange(experts_per_rank, dev.dtype(at::kLong)).repeat({num_ranks});
  at::Tensor entry_seg = segmentIds(toVector(seg_count), dev.dtype(at::kLong));
  at::Tensor entry_pos = at::arange(num_entries, dev.dtype(at::kLong));
  at::Tensor entry_slot =
      seg_begin.index_select(0, entry_seg) + entry_pos - seg_offset.index_select(0, entry_seg);
  at::Tensor entry_expert = seg_expert.index_select(0, entry_seg);

  LowLatencyDispatchResult out;
  const auto x_dtype = a.use_fp8 ? at::kFloat8_e4m3fn : at::kBFloat16;
  at::Tensor rows = bytesToRows(recv, packer.spans[x_block].first, packer.spans[x_block].second,
                                x_dtype, {hidden});
  out.recv_x = at::zeros({experts_per_rank, slots, hidden}, dev.dtype(x_dtype));
  out.recv_x.index_put_({entry_expert, entry_slot}, rows);
  if (a.use_fp8) {
    const int64_t cols = scales.size(1);
    at::Tensor scale_rows = bytesToRows(recv, packer.spans[s_block].first,
                                        packer.spans[s_block].second, scales.scalar_type(), {cols});
    out.recv_x_scales = at::zeros({experts_per_rank, slots, cols}, scales.options());
    out.recv_x_scales->index_put_({entry_expert, entry_slot}, scale_rows);
  }
  at::Tensor recv_src = bytesToRows(recv, packer.spans[src_block].first,
                                    packer.spans[src_block].second, at::kInt, {1})
                            .reshape({num_entries});
  out.src_info = at::full({experts_per_rank, slots}, -1, dev.dtype(at::kInt));
  out.src_info.index_put_({entry_expert, entry_slot}, recv_src);
  at::Tensor begin = (recv_matrix.cumsum(0) - recv_matrix).t();
  out.layout_range = begin.bitwise_left_shift(32).bitwise_or(recv_matrix.t()).contiguous();
  out.recv_count = recv_matrix.sum(0).to(at::kInt);
  return out;
}

at::Tensor lowLatencyCombine(EPProcessGroup& pg, const LowLatencyCombineInputs& a) {
  const int64_t num_ranks = pg.getSize();
  const int64_t rank = pg.getRank();
  const std::string error = validateLowLatencyCombine(a, num_ranks);
  const bool ok = error.empty();
  const int64_t experts_per_rank = ok ? a.x.size(0) : 0;
  const int64_t num_experts = experts_per_rank * num_ranks;

  // Expert side: what goes back to each source rank; token side: what comes back from each.
  std::vector<int64_t> send_back(num_ranks, 0), expect(num_ranks, 0);
  at::Tensor begin, count, entry_token, entry_k;
  RankMaskSnapshot mask = rankMask(pg);
  // Nothing goes back to a masked source and nothing comes from a masked expert rank (also when
  // the rank was masked after the dispatch): its entries are absent from the sum.
  auto plan = [&] {
    begin = a.layout_range.bitwise_right_shift(32);
    count = a.layout_range.bitwise_and(0xFFFFFFFFLL);
    if (mask.live_only()) {
      std::vector<int64_t> live(mask.masked.size());
      for (size_t r = 0; r < live.size(); ++r) live[r] = mask.masked[r] != 0 ? 0 : 1;
      count = count * at::tensor(live, at::kLong).to(count.device()).unsqueeze(0);
    }
    send_back = toVector(count.sum(0));
    const int64_t topk = a.topk_idx.size(1);
    const auto [positions, experts] =
        entriesByExpert(withoutMaskedRanks(a.topk_idx, mask, experts_per_rank));
    entry_token = positions.div(topk, "floor");
    entry_k = positions.remainder(topk);
    at::Tensor per_expert = at::bincount(experts, {}, num_experts);
    expect = toVector(per_expert.reshape({num_ranks, experts_per_rank}).sum(1));
  };
  if (ok) {
    plan();
  }
  std::vector<int64_t> payload = send_back;
  payload.insert(payload.end(), expect.begin(), expect.end());
  const bool bf16_partials = pg.options()->low_latency_combine_bf16_partials;
  std::vector<AgreedField> fields{
      {"num_max_dispatch_tokens_per_rank", a.num_max_dispatch_tokens_per_rank},
      {"hidden size H", ok ? a.x.size(2) : -1},
      {"experts per rank", experts_per_rank},
      {"Options.low_latency_combine_bf16_partials", bf16_partials},
  };
  const std::vector<uint8_t> masked_before = mask.masked;
  at::Tensor gathered =
      agreeAmongLiveRanks(pg, "low_latency_combine", error, fields, payload, mask).toTensor();
  if (mask.masked != masked_before) {
    plan();  // a peer was auto-masked in the agreement: its rows are absent
  }
  for (int64_t p = 0; p < num_ranks && mask.live_only(); ++p) {
    if (mask.is_masked(p)) {  // what live ranks announced for a peer masked since then
      gathered.select(1, p).zero_();
      gathered.select(1, num_ranks + p).zero_();
    }
  }
  checkRoutingAgrees("low_latency_combine", gathered, 0, rank);

  const int64_t hidden = a.x.size(2);
  std::vector<at::Tensor> back_rows;
  at::Tensor begin_host = begin.cpu();
  at::Tensor count_host = count.cpu();
  auto b = begin_host.accessor<int64_t, 2>();
  auto c = count_host.accessor<int64_t, 2>();
  for (int64_t s = 0; s < num_ranks; ++s) {
    for (int64_t le = 0; le < experts_per_rank; ++le) {
      back_rows.push_back(a.x.select(0, le).narrow(0, b[le][s], c[le][s]));
    }
  }
  RowPacker packer;
  packer.add(at::cat(back_rows));
  at::Tensor returned = mask.live_only()
                            ? allToAllRowsAmongLive(pg, "low_latency_combine", packer.packed(),
                                                    packer.width, send_back, expect, mask)
                            : allToAllRows(pg, "low_latency_combine", packer.packed(), packer.width,
                                           send_back, expect);
  at::Tensor rows = bytesToRows(returned, 0, packer.width, at::kBFloat16, {hidden});

  const int64_t num_tokens = a.topk_idx.size(0);
  const int64_t topk = a.topk_idx.size(1);
  at::Tensor y = at::zeros({num_tokens, topk, hidden}, a.x.options().dtype(at::kFloat));
  y.index_put_({entry_token, entry_k}, rows.to(at::kFloat));
  if (bf16_partials) {
    return sumOfRankPartialsInBf16(withoutMaskedRanks(a.topk_idx, mask, experts_per_rank),
                                   a.topk_weights, y, experts_per_rank);
  }
  at::Tensor valid = a.topk_idx.ge(0);
  at::Tensor acc = at::zeros({num_tokens, hidden}, a.x.options().dtype(at::kFloat));
  for (int64_t k = 0; k < topk; ++k) {
    at::Tensor weighted = a.topk_weights.select(1, k).unsqueeze(1) * y.select(1, k);
    acc = at::where(valid.select(1, k).unsqueeze(1), acc + weighted, acc);
  }
  return acc.to(at::kBFloat16);
}

}  // namespace ep::aten

namespace ep {
namespace {

// The ATen transport behind the Transport interface (backend/transport.hpp): serves every call,
// so the registry lists it last.
class AtenTransport final : public Transport {
 public:
  TransportKind kind() const override { return TransportKind::kAten; }
  bool serves(OpFamily) const override { return true; }
  int64_t maxLayoutRanks() const override { return INT64_MAX; }
  Verdict usable(EPProcessGroup&, const at::Device&) override { return {}; }
  std::optional<Verdict> verdict(EPProcessGroup&) override { return Verdict{}; }
  LayoutTensors layout(const at::Tensor& topk_idx, int64_t num_experts,
                       int64_t num_ranks) override {
    return computeDispatchLayout(topk_idx, num_experts, num_ranks);
  }
  DispatchResult dispatch(EPProcessGroup& pg, const DispatchArgs& args, DeferredCounts*) override {
    return aten::dispatch(pg, args);
  }
  std::pair<at::Tensor, std::optional<at::Tensor>> cachedDispatch(
      EPProcessGroup& pg, const at::Tensor& x, const std::optional<at::Tensor>& x_scales,
      const DispatchRouting& routing) override {
    return aten::cachedDispatch(pg, x, x_scales, routing);
  }
  std::pair<at::Tensor, std::optional<at::Tensor>> combine(EPProcessGroup& pg,
                                                           const CombineArgs& args) override {
    return aten::combine(pg, args);
  }
  LowLatencyDispatchResult lowLatencyDispatch(EPProcessGroup& pg,
                                              const LowLatencyDispatchInputs& args,
                                              bool /*send_only*/) override {
    return aten::lowLatencyDispatch(pg, args);  // complete on return: a recv hook has nothing left
  }
  std::optional<at::Tensor> lowLatencyCombine(EPProcessGroup& pg,
                                              const LowLatencyCombineInputs& args) override {
    return aten::lowLatencyCombine(pg, args);
  }
};

}  // namespace

Transport& atenTransport() {
  static AtenTransport transport;
  return transport;
}

}  // namespace ep
