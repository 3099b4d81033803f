// Low-latency dispatch over NVSHMEM symmetric memory (NVLink P2P stores or NVSHMEM puts).
//
// A token goes to each destination RANK once, not once per expert: a message carries the row
// (BF16, or FP8 + scales quantised by the sender) and a header listing the token's entries on
// that rank (k, local expert, position p); the receiver copies the row into each listed slot.
// At EP2 with top-8 of 16 experts that is ~1/4 of the bytes of one message per (token, expert).
//
// A call with both phases runs steps 1 and 2 on the whole block, then warps [0, kSendWarps) do
// step 3 while the other warps receive (named barriers; their own shared state), so copies start
// as messages land. A hook-mode call (one phase) gives its phase every warp.
// SEND (rank r, call on buffer b, sequence number seq). Message slot (r, t) on rank d belongs to
// token t, so payloads need no count and go first:
//  1. Each block's tokens: warp 0 finds the destination ranks (first-appearance order of the
//     entries' ranks); the payload (BF16 straight from registers, or FP8 quantised once into the
//     local send area) is stored to slot (r, t) of every P2P destination. The loads (row, the
//     token's entries, step 2's first round) are issued before any store: a load issued behind
//     the stores waits for them. The block owning rank d sends it T (seq << 32 | T).
//  2. Whole tokens per warp, over all tokens: entries per global expert (all tokens, and those
//     before this block's chunk) in shared memory. The block owning expert e (e % grid) sends
//     the count signal (seq << 32 | count) to the expert's rank, slot (local expert, r).
//  3. Per token, warp 0 gives each (t, k) its position p among this rank's entries to expert e
//     (tokens ascending, then k: the reference's order) and builds one header per destination;
//     the group stores the headers, and after a barrier warp j releases destination j's flag
//     (seq << 1 | 1), or puts the staged message with the flag as its signal. Every rank the
//     token does not reach gets seq << 1 ("no message").
// RECV (rank d): wait for every count signal (begin of source s at expert le = rows of the
// sources before it) and token count; then (slot (s, t), 1 KB chunk) units, sources from d
// itself onwards, are spread over all warps of the grid: a warp waits for its slot's flag and,
// when it holds a message, copies its chunk into recv_x[le, begin + p] for each header entry (a
// warp per whole message was slower at H = 7168 in `nvshmem_test --bench-only`: each warp ran its
// loads and stores in series). Every peer P2P-mapped (Context::all_p2p): the instantiation without
// NVSHMEM calls runs; with them inlined the kernel spilled 240 bytes per thread, and spill reloads
// behind the payload stores made it slower.
#include <cuda_fp8.h>

#include <cstdint>

#include "transports/nvshmem/cuda/nvshmem_device.cuh"
#include "transports/nvshmem/cuda/nvshmem_kernels.hpp"

namespace ep {
namespace nvshmem {
namespace {

using namespace device;

// Warps [first_warp, first_warp + num_warps) of the block, working as one group with its own
// barrier (the whole block: __syncthreads).
struct WarpGroup {
  int first_warp;
  int num_warps;
  int barrier;
  __device__ __forceinline__ int tid() const {
    return static_cast<int>(threadIdx.x) - first_warp * 32;
  }
  __device__ __forceinline__ int threads() const { return num_warps * 32; }
  __device__ __forceinline__ int warp() const { return warp_id() - first_warp; }
  __device__ __forceinline__ void sync() const {
    if (num_warps == kThreads / 32)
      __syncthreads();
    else
      asm volatile("bar.sync %0, %1;" ::"r"(barrier), "r"(num_warps * 32) : "memory");
  }
};

// Warps of a block that send while the others receive (a call with both phases): 16 is the
// fastest split of `nvshmem_test --bench-only`'s latency rows (8 and 24 were slower).
constexpr int kSendWarps = 16;
static_assert(kSendWarps > 0 && kSendWarps < kThreads / 32, "send and receive warps");

// Quantises one 128-channel group into `payload` (FP8 bytes, lane: channels 4 lane .. 4 lane + 3
// from `raw`) and its scale into `scales`. Whole warp.
__device__ __forceinline__ void quantize_group(const DispatchParams& p, uint2 raw, int g,
                                               char* payload, char* scales) {
  const int lane = lane_id();
  float v[4] = {bf16_to_float(raw.x), bf16_hi_to_float(raw.x), bf16_to_float(raw.y),
                bf16_hi_to_float(raw.y)};
  float amax = 0.0f;
  bool nan = false;
  for (int j = 0; j < 4; ++j) {
    amax = fmaxf(amax, fabsf(v[j]));
    nan |= v[j] != v[j];
  }
  for (int s = 16; s > 0; s >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, s));
  nan = __any_sync(0xffffffffu, nan);
  // amax.clamp(min=1e-4) keeps NaN; scale = amax / 448 is a correctly rounded division.
  amax = nan ? __uint_as_float(0x7FC00000u) : fmaxf(amax, 1e-4f);
  float scale = __fdiv_rn(amax, 448.0f);
  if (p.round_scale) scale = __uint_as_float((__float_as_uint(scale) + 0x7FFFFFu) & 0x7F800000u);
  const float inv = __frcp_rn(scale);
  uint32_t packed = 0;
  for (int j = 0; j < 4; ++j) {
    float q = __fmul_rn(v[j], inv);
    q = q < -448.0f ? -448.0f : (q > 448.0f ? 448.0f : q);  // NaN stays NaN
    const uint32_t b = __nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3);
    packed |= (b & 0xFFu) << (8 * j);
  }
  *reinterpret_cast<uint32_t*>(payload + size_t(g) * kGroupSize + lane * 4) = packed;
  if (lane == 0) {
    if (p.ue8m0) {
      // Exponent byte of group g: byte g % 4 of int32 g / 4 (little-endian) = byte g.
      reinterpret_cast<uint8_t*>(scales)[g] =
          static_cast<uint8_t>((__float_as_uint(scale) >> 23) & 0xFFu);
    } else {
      reinterpret_cast<float*>(scales)[g] = scale;
    }
  }
}

// This thread's share of token t's row, loaded before the token's routing is known so the load
// latency overlaps it (the whole block; one 16-byte piece each). BF16: piece tid (H / 8 <=
// kThreads). FP8: lane's 4 channels of the 128-channel groups warp and warp + 32, as two uint2
// in x, y and z, w (H / 128 <= 64).
static_assert(kMaxHidden / 8 <= kThreads && kMaxHidden / kGroupSize <= 2 * (kThreads / 32),
              "one 16-byte piece of a row per thread");
__device__ __forceinline__ int4 load_row_share(const DispatchParams& p, int t) {
  const int tid = static_cast<int>(threadIdx.x);
  const uint16_t* x = p.x + size_t(t) * p.hidden;
  int4 v = make_int4(0, 0, 0, 0);
  if (!p.fp8) {
    if (tid < p.hidden / 8) v = ld_nc_v4_no_l2_prefetch(x + size_t(tid) * 8);
    return v;
  }
  const int groups = p.hidden / kGroupSize;
  const int lane = lane_id();
  const int warp = warp_id();
  if (warp < groups) {
    const uint2 a = *reinterpret_cast<const uint2*>(x + size_t(warp) * kGroupSize + lane * 4);
    v.x = static_cast<int>(a.x);
    v.y = static_cast<int>(a.y);
  }
  if (warp + kThreads / 32 < groups) {
    const uint2 b =
        *reinterpret_cast<const uint2*>(x + size_t(warp + kThreads / 32) * kGroupSize + lane * 4);
    v.z = static_cast<int>(b.x);
    v.w = static_cast<int>(b.y);
  }
  return v;
}

// FP8: quantises the groups of this thread's share (load_row_share) into `payload` (FP8 bytes,
// then the scales) in the local send area. The whole block.
__device__ __forceinline__ void quantize_share(const DispatchParams& p, int4 share, char* payload) {
  const int groups = p.hidden / kGroupSize;
  const int warp = warp_id();
  char* scales = payload + p.hidden;
  if (warp < groups)
    quantize_group(p, make_uint2(static_cast<uint32_t>(share.x), static_cast<uint32_t>(share.y)),
                   warp, payload, scales);
  if (warp + kThreads / 32 < groups)
    quantize_group(p, make_uint2(static_cast<uint32_t>(share.z), static_cast<uint32_t>(share.w)),
                   warp + kThreads / 32, payload, scales);
}

// The masked ranks (Context::rank_mask) as bits, rank r at bit r, for groups of up to 32 ranks;
// whole warp. Its load does not depend on the entries, so it is in flight beside theirs (a load
// of mask[rank of e] would wait for e).
__device__ __forceinline__ unsigned masked_rank_bits(const Context& c) {
  const int lane = lane_id();
  const bool masked = c.rank_mask != nullptr && lane < c.num_ranks && c.rank_mask[lane] != 0;
  return __ballot_sync(0xffffffffu, masked);
}

// Entry (t, k) as a valid expert id or -1 (invalid ids are reported once and skipped; an expert
// of a masked rank is absent). `masked_bits`: masked_rank_bits (groups of more than 32 ranks
// read the mask itself).
__device__ __forceinline__ int entry_expert(const DispatchParams& p, const Waiter& w, size_t i,
                                            unsigned masked_bits) {
  const long long e = load_idx(p.topk_idx, p.idx_bytes, i);
  if (e >= 0 && e < p.num_experts) {
    const int r = static_cast<int>(e) / (p.num_experts / p.ctx.num_ranks);
    const bool masked = r < 32 ? ((masked_bits >> r) & 1u) != 0 : rank_masked(p.ctx, r);
    return masked ? -1 : static_cast<int>(e);
  }
  if (e != -1 && blockIdx.x == 0)
    report_error(w, kErrorInvalidTopkIdx, -1, e, static_cast<long long>(i));
  return -1;
}

// Shared memory of the dispatch kernel. The SEND and RECV warps of a block run at the same time:
// each has its own part.
struct DispatchShared {
  // SEND
  int total[kMaxExperts];  // entries per global expert
  int base[kMaxExperts];   // entries per expert before the current token
  __align__(16) int header[kMaxTopk][kHeaderRowInts];  // the current token's, per destination
  int dest[kMaxTopk];                                  // its j-th destination rank
  int num_dests;
  // c.peer, copied at kernel start: read after the payload stores are out, a global load waits
  // behind them.
  char* peer[kMaxExperts];
  uint64_t seq;  // the call's sequence number, loaded by thread 0 (read after the first barrier)
  // RECV
  int rows[kMaxExperts];        // rows from source s to local expert le, at le * R + s
  int begin[kMaxExperts];       // first row of (le, s) in the expert's output
  int messages[kMaxExperts];    // message slots (= tokens) per source
  int first_item[kMaxExperts];  // first item of the i-th source taken
  int items;                    // message slots to visit, over all sources
  int fail;
};

// Lane k < K of warp 0: entry (t, k) as an expert id, or -1.
__device__ __forceinline__ int lane_entry(const DispatchParams& p, const Waiter& w, int t) {
  const int lane = lane_id();
  const unsigned masked = masked_rank_bits(p.ctx);
  return lane < p.num_topk ? entry_expert(p, w, size_t(t) * p.num_topk + lane, masked) : -1;
}

// Where message slot (c.rank, t) of destination j lies (P2P-mapped), or null: NVSHMEM put.
__device__ __forceinline__ char* message_at(const DispatchParams& p, const DispatchShared& sh,
                                            int j, int t, const Message& msg) {
  char* const peer = sh.peer[sh.dest[j]];
  return peer == nullptr ? nullptr
                         : peer + p.ctx.layout.disp_recv_offset +
                               (size_t(p.ctx.rank) * p.ctx.max_tokens + t) * msg.stride;
}

// Warp 0, token t, lane k holding entry e = lane_entry(t): the token's destination ranks in the
// order its entries first reach them (dest[j], num_dests). With `positions` (needs the counts of
// SEND step 2), also each entry's position p among this rank's entries to its expert (sh.base,
// advanced past t), the headers and send_route.
__device__ void route_token(const DispatchParams& p, DispatchShared& sh, int t, int e,
                            bool positions) {
  const Context& c = p.ctx;
  const int lane = lane_id();
  const int M = c.max_tokens;
  const int E_loc = p.num_experts / c.num_ranks;
  const int K = p.num_topk;
  const unsigned full = 0xffffffffu;
  const unsigned below = (1u << lane) - 1u;
  const int d = e >= 0 ? e / E_loc : -1;
  const unsigned same_d = lanes_equal(d, 0, K);
  const int first = __ffs(same_d) - 1;
  const unsigned firsts = __ballot_sync(full, d >= 0 && lane == first);
  // My destination's index (first < 0 only for lanes without an entry: j unused).
  const int j = first > 0 ? __popc(firsts & ((1u << first) - 1u)) : 0;
  if (positions) {
    const unsigned same_e = lanes_equal(e, 0, K);
    const int pos = e >= 0 ? sh.base[e] + __popc(same_e & below) : -1;
    __syncwarp();
    if (e >= 0 && (same_e & below) == 0) sh.base[e] += __popc(same_e);
    const int slot = pos < M ? pos : -1;  // overflow was reported with the counts
    const unsigned listed = same_d & __ballot_sync(full, slot >= 0);
    if (d >= 0 && slot >= 0) {
      const int at = 2 + 2 * __popc(listed & below);
      sh.header[j][at] = header_key(lane, e % E_loc);
      sh.header[j][at + 1] = slot;
    }
    if (d >= 0 && lane == first) {
      sh.header[j][0] = t;
      sh.header[j][1] = __popc(listed);
    }
    if (lane < K) c.send_route[size_t(t) * K + lane] = route_word(d, slot >= 0);
  }
  if (d >= 0 && lane == first) sh.dest[j] = d;
  if (lane == 0) sh.num_dests = __popc(firsts);
}

// This thread's entry in round `round` of step 2 (lane = token slot * K + k), or -1.
__device__ __forceinline__ int count_entry(const DispatchParams& p, const Waiter& w, int round) {
  const int K = p.num_topk;
  const int per_warp = 32 / K;
  const int my_token = lane_id() / K;
  const int t = (round * (kThreads / 32) + warp_id()) * per_warp + my_token;
  const unsigned masked = masked_rank_bits(p.ctx);
  return my_token < per_warp && t < p.num_tokens
             ? entry_expert(p, w, size_t(t) * K + lane_id() % K, masked)
             : -1;
}

// SEND step 1, the whole block: the payload of each of the block's tokens goes to slot (r, t)
// of every P2P destination at once (FP8 quantised into the send area first); the headers, which
// need the counts, follow in step 3. The stores cross the link while the block counts. Also
// sends this rank's token count to the ranks this block owns. False when the group was aborted
// (`abort_seen`, loaded at kernel start): nothing sent.
template <bool kP2P>
__device__ bool send_payloads(const DispatchParams& p, const Waiter& w, DispatchShared& sh,
                              int abort_seen, int& first_e, int& count_e) {
  const Context& c = p.ctx;
  const int tid = static_cast<int>(threadIdx.x);
  const int R = c.num_ranks;
  const int G = static_cast<int>(gridDim.x);
  const int2 tokens = block_tokens(p.num_tokens);
  const Message msg = Message::make(p.hidden, p.fp8 != 0, p.ue8m0 != 0, c.layout.header_bytes);
  const int vecs = msg.stride / 16;
  const int header_vecs = msg.header / 16;
  char* const send_area = c.local + c.layout.disp_send_offset;
  for (int e = tid; e < p.num_experts; e += kThreads) sh.total[e] = sh.base[e] = 0;
  for (int d = tid - 32; d >= 0 && d < R; d += kThreads - 32) sh.peer[d] = c.peer[d];
  // Loads issued before any store: the first token's entries (warp 0, kept for step 3), its row,
  // and this thread's entry of step 2's first round.
  int t = tokens.x;
  first_e = warp_id() == 0 && t < tokens.y ? lane_entry(p, w, t) : -1;
  int4 share = t < tokens.y ? load_row_share(p, t) : make_int4(0, 0, 0, 0);
  count_e = count_entry(p, w, 0);
  if (warp_id() == 0 && t < tokens.y) route_token(p, sh, t, first_e, /*positions=*/false);
  // The abort word was loaded at kernel start (its latency hidden behind topk_idx's).
  if (__syncthreads_or(abort_seen)) return false;
  const uint64_t seq = sh.seq;
  for (int d = static_cast<int>(blockIdx.x) + tid * G; d < R; d += kThreads * G)
    if (!rank_masked(c, d))
      signal_set<kP2P>(c, d, c.layout.disp_tokens_offset + size_t(c.rank) * 8,
                       (seq << 32) | static_cast<uint64_t>(p.num_tokens));
  while (t < tokens.y) {
    const int nd = sh.num_dests;
    char* const staged_row = send_area + size_t(t) * R * msg.stride;
    // The NVSHMEM put path reads a symmetric source: the payload is staged in the send area
    // (message slot t * R + 0) for it. FP8 is always quantised there once.
    bool any_put = false;
    for (int j = 0; j < nd; ++j) any_put |= sh.peer[sh.dest[j]] == nullptr;
    if (p.fp8) {
      // Quantised once into the send area, then stored to every P2P destination from there.
      quantize_share(p, share, staged_row + msg.header);
      __syncthreads();
      for (int i = header_vecs + tid; i < vecs; i += kThreads) {
        const int4 v = ld_cg_v4(staged_row + size_t(i) * 16);
        for (int j = 0; j < nd; ++j) {
          char* const m = message_at(p, sh, j, t, msg);
          if (m != nullptr) st_v4(m + size_t(i) * 16, v);
        }
      }
    } else if (tid < p.hidden / 8) {
      // BF16: the piece goes from registers to every P2P destination (and to the send area
      // when some destination takes an NVSHMEM put).
      const size_t at = size_t(header_vecs + tid) * 16;
      if (any_put) st_v4(staged_row + at, share);
      for (int j = 0; j < nd; ++j) {
        char* const m = message_at(p, sh, j, t, msg);
        if (m != nullptr) st_v4(m + at, share);
      }
    }
    if (++t == tokens.y) break;
    share = load_row_share(p, t);
    __syncthreads();  // every thread is done with the previous token's routing
    if (warp_id() == 0) route_token(p, sh, t, lane_entry(p, w, t), /*positions=*/false);
    __syncthreads();
  }
  return true;
}

// SEND step 2, the whole block (after step 1's barriers: the counters are zero). Each warp holds
// 32 / K whole tokens (lane = token slot * K + k), so one round of loads covers
// 32 * (32 / K) tokens (all of T = 128 at K = 8); one shared atomic per entry. The block owning
// expert e sends its count signal.
template <bool kP2P>
__device__ void count_phase(const DispatchParams& p, const Waiter& w, uint64_t seq,
                            DispatchShared& sh, int first_round_e) {
  const Context& c = p.ctx;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = lane_id();
  const int warp = warp_id();
  const int R = c.num_ranks;
  const int M = c.max_tokens;
  const int E = p.num_experts;
  const int E_loc = E / R;
  const int K = p.num_topk;
  const int T = p.num_tokens;
  const int G = static_cast<int>(gridDim.x);
  const int t_begin = block_tokens(T).x;
  const int per_warp = 32 / K;
  const int my_token = lane / K;
  for (int round = 0, t0 = warp * per_warp; t0 < T; ++round, t0 += (kThreads / 32) * per_warp) {
    const int t = t0 + my_token;
    const int e = round == 0 ? first_round_e : count_entry(p, w, round);
    if (e >= 0) {
      atomicAdd(&sh.total[e], 1);
      if (t < t_begin) atomicAdd(&sh.base[e], 1);
    }
  }
  __syncthreads();
  for (int e = static_cast<int>(blockIdx.x) + tid * G; e < E; e += kThreads * G) {
    int count = sh.total[e];
    if (count > M) {
      report_error(w, kErrorCapacity, -1, count, M);
      count = M;
    }
    const int slot = (e % E_loc) * R + c.rank;
    if (!rank_masked(c, e / E_loc))
      signal_set<kP2P>(c, e / E_loc, c.layout.disp_count_offset + size_t(slot) * 8,
                       (seq << 32) | static_cast<uint64_t>(count));
  }
}

// SEND step 3 on the warps of `wg`: the block's tokens in order. Warp 0 builds the headers; the
// group stores them to the P2P destinations; after a barrier warp j releases destination j
// (P2P: a release store of the flag, covering the whole block's stores, step 1's included;
// otherwise the staged message is put with the flag as its signal). Every rank the token does
// not reach gets the flag's "no message" value.
template <bool kP2P>
__device__ void send_headers(const DispatchParams& p, const Waiter& w, uint64_t seq,
                             DispatchShared& sh, const WarpGroup& wg, int first_e) {
  const Context& c = p.ctx;
  const int tid = wg.tid();
  const int lane = lane_id();
  const int warp = wg.warp();
  const int R = c.num_ranks;
  const int M = c.max_tokens;
  const int2 tokens = block_tokens(p.num_tokens);
  const Message msg = Message::make(p.hidden, p.fp8 != 0, p.ue8m0 != 0, c.layout.header_bytes);
  const int vecs = msg.stride / 16;
  const int header_vecs = msg.header / 16;
  char* const send_area = c.local + c.layout.disp_send_offset;
  for (int t = tokens.x; t < tokens.y; ++t) {
    if (warp == 0)
      route_token(p, sh, t, t == tokens.x ? first_e : lane_entry(p, w, t), /*positions=*/true);
    wg.sync();
    const int nd = sh.num_dests;
    for (int i = tid; i < nd * header_vecs; i += wg.threads()) {
      const int j = i / header_vecs;
      const int v = i - j * header_vecs;
      char* const m = message_at(p, sh, j, t, msg);
      if (m != nullptr)
        st_v4(m + size_t(v) * 16, *reinterpret_cast<const int4*>(&sh.header[j][4 * v]));
    }
    const size_t slot = size_t(c.rank) * M + t;
    const size_t flag = c.layout.disp_flag_offset + slot * 8;
    for (int d = tid; d < R; d += wg.threads()) {
      bool reached = false;
      for (int j = 0; j < nd; ++j) reached |= sh.dest[j] == d;
      if (!reached && !rank_masked(c, d)) signal_set<kP2P>(c, d, flag, message_flag(seq, false));
    }
    wg.sync();
    if (warp < nd) {
      const int d = sh.dest[warp];
      if (kP2P || sh.peer[d] != nullptr) {
        if (lane == 0)
          st_release_sys(reinterpret_cast<uint64_t*>(sh.peer[d] + flag), message_flag(seq, true));
      } else if constexpr (!kP2P) {
        // Message j = header j + the payload staged in message 0 (copied for j > 0).
        char* const staged_row = send_area + size_t(t) * R * msg.stride;
        char* row = staged_row + size_t(warp) * msg.stride;
        for (int i = lane; i < header_vecs; i += 32)
          st_v4(row + size_t(i) * 16, *reinterpret_cast<const int4*>(&sh.header[warp][4 * i]));
        if (warp > 0)
          for (int i = header_vecs + lane; i < vecs; i += 32)
            st_v4(row + size_t(i) * 16, ld_cg_v4(staged_row + size_t(i) * 16));
        warp_put_signal(c, d, c.layout.disp_recv_offset + slot * msg.stride, row, msg.stride, flag,
                        message_flag(seq, true));
      }
    }
    wg.sync();
  }
}

// RECV on the warps of `wg`.
__device__ void recv_phase(const DispatchParams& p, const Waiter& w, uint64_t seq,
                           DispatchShared& sh, const WarpGroup& wg) {
  const Context& c = p.ctx;
  const int tid = wg.tid();
  const int threads = wg.threads();
  const int R = c.num_ranks;
  const int M = c.max_tokens;
  const int E = p.num_experts;
  const int E_loc = E / R;
  const int slots = R * M;
  const int G = static_cast<int>(gridDim.x);
  const Message msg = Message::make(p.hidden, p.fp8 != 0, p.ue8m0 != 0, c.layout.header_bytes);
  const uint64_t* counts = reinterpret_cast<const uint64_t*>(c.local + c.layout.disp_count_offset);
  const uint64_t* tokens = reinterpret_cast<const uint64_t*>(c.local + c.layout.disp_tokens_offset);
  const uint64_t* flags = reinterpret_cast<const uint64_t*>(c.local + c.layout.disp_flag_offset);
  const uint32_t want = static_cast<uint32_t>(seq);

  // Every block: all count signals (rows per (le, s)) and token counts per source.
  if (tid == 0) sh.fail = 0;
  wg.sync();
  for (int i = tid; i < E + R; i += threads) {
    const bool is_count = i < E;
    const uint64_t* f = is_count ? counts + i : tokens + (i - E);
    const int source = is_count ? i % R : i - E;
    uint64_t v = 0;  // a masked source: no rows, no tokens, nothing to wait for
    const bool ok = rank_masked(c, source) || spin_wait(w, source, [&] {
                      v = ld_acquire_sys(f);
                      return static_cast<uint32_t>(v >> 32) == want;
                    });
    if (is_count)
      sh.rows[i] = static_cast<int>(v & 0xFFFFFFFFu);
    else
      sh.messages[i - E] = static_cast<int>(v & 0xFFFFFFFFu);
    if (!ok) sh.fail = 1;
  }
  wg.sync();
  if (sh.fail) return;
  for (int i = tid; i < E; i += threads) {
    const int first = i - i % R;  // (le, 0)
    int b = 0;
    for (int j = first; j < i; ++j) b += sh.rows[j];
    sh.begin[i] = b;
  }
  // Message slots are taken source by source starting with this rank (its own arrive first):
  // first_item[i] = first item of source (rank + i) % R.
  if (tid == 0) {
    int n = 0;
    for (int i = 0; i < R; ++i) {
      sh.first_item[i] = n;
      n += sh.messages[(c.rank + i) % R];
    }
    sh.items = n;
  }
  wg.sync();

  // Per-expert outputs (block le % grid): count, ranges, stats, src_info -1 past the end.
  for (int le = static_cast<int>(blockIdx.x); le < E_loc; le += G) {
    const int last = le * R + R - 1;
    const int total = sh.begin[last] + sh.rows[last];
    if (tid == 0) {
      p.recv_count[le] = total;
      if (p.cumulative_stats != nullptr) p.cumulative_stats[le] += total;
    }
    for (int s = tid; s < R; s += threads)
      p.layout_range[size_t(le) * R + s] = (static_cast<long long>(sh.begin[le * R + s]) << 32) |
                                           static_cast<long long>(sh.rows[le * R + s]);
    const size_t out_base = size_t(le) * slots;
    for (int i = total + tid; i < slots; i += threads) p.src_info[out_base + i] = -1;
    if (p.zero_padding) {
      const int4 zero = make_int4(0, 0, 0, 0);
      const size_t row_vecs = size_t(msg.payload_bytes) / 16;
      char* x0 = static_cast<char*>(p.recv_x) + out_base * msg.payload_bytes;
      for (size_t i = size_t(total) * row_vecs + tid; i < size_t(slots) * row_vecs; i += threads)
        st_v4(x0 + i * 16, zero);
      if (msg.scale_words > 0) {
        int* s0 = static_cast<int*>(p.recv_scales) + out_base * msg.scale_words;
        for (size_t i = size_t(total) * msg.scale_words + tid; i < size_t(slots) * msg.scale_words;
             i += threads)
          s0[i] = 0;
      }
    }
  }
  // What combine needs to find these messages again (its H alone does not give the stride).
  if (blockIdx.x == 0) {
    for (int s = tid; s < R; s += threads) c.recv_tokens[s] = sh.messages[s];
    if (tid == 0) c.ctrl->message_stride[c.buffer] = msg.stride;
  }

  // Work units (message slot (s, t), chunk of kChunkVecs 16-byte payload pieces), a warp each
  // (warp w of block b takes units w * grid + b, ...): the copies of one message run on several
  // warps at once; a slot whose flag says "no message" is skipped. Lane j < n holds the output
  // row of header entry j.
  const int lane = lane_id();
  const int warp = wg.warp();
  const int payload_vecs = msg.payload_bytes / 16;
  constexpr int kUnroll = 2;
  constexpr int kChunkVecs = 32 * kUnroll;
  const int chunks = (payload_vecs + kChunkVecs - 1) / kChunkVecs;
  const int units = sh.items * chunks;
  const int warps = G * wg.num_warps;
  for (int unit = warp * G + static_cast<int>(blockIdx.x); unit < units; unit += warps) {
    const int item = unit / chunks;
    const int chunk = unit - item * chunks;
    const int i = item_source(sh.first_item, R, item);
    const int s = (c.rank + i) % R;
    const int t = item - sh.first_item[i];
    const char* m = c.local + c.layout.disp_recv_offset + (size_t(s) * M + t) * msg.stride;
    int state = 1;  // 1: a message, 0: token t of s did not come here, -1: timed out or aborted
    if (lane == 0) {
      const uint64_t* f = flags + size_t(s) * M + t;
      uint64_t v = 0;
      const bool ok = spin_wait(w, s, [&] {
        v = ld_acquire_sys(f);
        return message_flag_seq(v) == seq;
      });
      state = ok ? (message_flag_present(v) ? 1 : 0) : -1;
    }
    state = __shfl_sync(0xffffffffu, state, 0);
    if (state < 0) break;
    if (state == 0) continue;
    const int n = message_entries(m);
    long long my_row = 0;
    if (lane < n) {
      const int2 entry = message_entry(m, lane);
      const int le = key_expert(entry.x);
      my_row = static_cast<long long>(le) * slots + sh.begin[le * R + s] + entry.y;
    }
    const char* payload = m + msg.header;
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int piece = chunk * kChunkVecs + 32 * u + lane;
      if (piece < payload_vecs) v[u] = ld_cg_v4(payload + size_t(piece) * 16);
    }
    // n comes from the header, the same on every lane: the shuffles see the whole warp (a
    // per-lane bound around them hung at H = 128 once).
    for (int j = 0; j < n; ++j) {
      const long long row = __shfl_sync(0xffffffffu, my_row, j);
      char* out = static_cast<char*>(p.recv_x) + size_t(row) * msg.payload_bytes;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int piece = chunk * kChunkVecs + 32 * u + lane;
        if (piece < payload_vecs) st_v4(out + size_t(piece) * 16, v[u]);
      }
    }
    if (chunk == chunks - 1 && msg.scale_words > 0) {  // scale words (lanes over words)
      for (int j = 0; j < n; ++j) {
        const long long row = __shfl_sync(0xffffffffu, my_row, j);
        for (int q2 = lane; q2 < msg.scale_words; q2 += 32)
          static_cast<int*>(p.recv_scales)[size_t(row) * msg.scale_words + q2] =
              ld_cg_s32(payload + msg.payload_bytes + size_t(q2) * 4);
      }
    }
    if (chunk == 0 && lane < n) p.src_info[my_row] = message_token(m);
  }
}

// kP2P: every peer is P2P-mapped (Context::all_p2p); that instantiation has no NVSHMEM calls.
template <bool kP2P>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(DispatchParams p) {
  __shared__ DispatchShared sh;
  const Context& c = p.ctx;
  const Waiter w{c.ctrl, c.error, c.timeout_ns, kOpDispatch, c.rank};
  // Block-uniform decisions only: every path below contains barriers. A SEND checks the abort
  // word at its first barrier; the RECV's waits give up on it by themselves. With both phases,
  // warps [0, kSendWarps) send the block's tokens while the others receive: the copies start as
  // messages land instead of after the block's own send.
  // Control words are read by one thread per block: every thread of every block reading the
  // same words queued thousands of requests on one L2 line at kernel start.
  int abort_seen = 0;
  if (threadIdx.x == 0) {
    sh.seq = ld_volatile_u64(&c.ctrl->dispatch_seq[c.buffer]) + ((p.phases & kPhaseSend) ? 1 : 0);
    abort_seen = aborted(w) ? 1 : 0;
  }
  const bool send = (p.phases & kPhaseSend) != 0;
  const bool recv = (p.phases & kPhaseRecv) != 0;
  int first_e = -1;  // warp 0: the block's first token's entries, kept from step 1 to step 3
  int count_e = -1;  // step 2's first-round entry, loaded in step 1
  const bool go = send ? send_payloads<kP2P>(p, w, sh, abort_seen, first_e, count_e)
                       : !__syncthreads_or(abort_seen);
  const uint64_t seq = sh.seq;  // both paths passed a barrier
  if (go) {
    constexpr int kAll = kThreads / 32;
    if (send) count_phase<kP2P>(p, w, seq, sh, count_e);
    if (send && recv) {
      if (warp_id() < kSendWarps)
        send_headers<kP2P>(p, w, seq, sh, WarpGroup{0, kSendWarps, 1}, first_e);
      else
        recv_phase(p, w, seq, sh, WarpGroup{kSendWarps, kAll - kSendWarps, 2});
    } else if (send) {
      send_headers<kP2P>(p, w, seq, sh, WarpGroup{0, kAll, 0}, first_e);
    } else if (recv) {
      recv_phase(p, w, seq, sh, WarpGroup{0, kAll, 0});
    }
  }
  __syncthreads();
  if (threadIdx.x == 0 && (p.phases & kPhaseSend)) {
    finish_block(&c.ctrl->blocks_done[0], [&] { c.ctrl->dispatch_seq[c.buffer] = seq; });
  }
}

}  // namespace

cudaError_t launch_dispatch(const DispatchParams& p, int num_blocks, cudaStream_t stream) {
  return p.ctx.all_p2p ? device::launch_cooperative(dispatch_kernel<true>, p, num_blocks, stream)
                       : device::launch_cooperative(dispatch_kernel<false>, p, num_blocks, stream);
}

cudaError_t max_dispatch_blocks(int* blocks) {
  return device::max_cooperative_blocks_of_both(dispatch_kernel<true>, dispatch_kernel<false>,
                                                blocks);
}

}  // namespace nvshmem
}  // namespace ep
