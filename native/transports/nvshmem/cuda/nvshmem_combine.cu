// Low-latency combine over NVSHMEM symmetric memory, reduced per rank before it crosses the link.
//
// Each expert rank sums a token's entries that it holds (in k order, float32, weighted) and
// returns ONE partial per (token, expert rank): float32 [H], or the BF16 row itself when the
// token had a single entry there (the token side weights it). At EP2 with top-8 of 16 experts
// that is half the bytes of returning every (token, expert) row. With bf16_partials
// (Options.low_latency_combine_bf16_partials) a sum goes back rounded to BF16 too, which halves
// its bytes again at the cost of one more rounding (reference.low_latency_combine's model).
//
// Numbers (ControlBlock): the dispatch's messages are found by the seq of b's dispatch; every
// weight, weights flag and partial flag below carries this combine's own number (combine_seq[b]
// + 1), so nothing needs resetting and a combine never reads what an earlier one left.
// SEND (expert side, rank r):
//  0. This rank's weights [T, K] go to every rank (comb_weights[r], stride max_topk), each as a
//     tagged word (weight_word: the call's tag and the float32 bits), then the rank's weights
//     flag. Since this kernel runs after r's dispatch RECV on the same stream, the flag also
//     says "r finished reading this buffer's dispatch area".
//  1. The dispatch's message slots (recv_tokens[s] = source s's token count; slot (s, t) holds a
//     message when its flag says so) are spread over the blocks, remote sources first. For the
//     message of token t of source s with n > 1 entries: find the rows of x, then wait for the n
//     weight words of (s, t) to carry this call's tag (on the put path: for s's weights flag,
//     then read them); then acc = +0.0 and, for the header's entries in k order,
//     acc = acc + w_k * y (separately rounded, no FMA), y being x[le, begin(le, s) + p], stored
//     as float32 in two halves (st_partial), or bf16(acc) with bf16_partials; with one entry,
//     the BF16 row y itself. It goes to
//     comb_recv[r * M + t] on rank s (P2P), or to comb_stage. A block stores its items (up to
//     kMaxPending) back to back, then releases each comb_flag[r * M + t] (P2P) or puts each
//     staged partial with the flag as its signal.
// RECV (token side, rank s): wait for every rank's weights flag (its dispatch RECV is over, so
// the next dispatch on this buffer may overwrite what it read), then per token: the ranks its
// entries went to (send_route of the dispatch, first-appearance order), wait for their
// partials, out[t] = bf16(sum of the partials in that order, float32; a BF16 sum adds as w = 1).
//
// Versus the reference (one float32 sum over k): the same products, added in another order.
// The result is within float32-accumulation tolerance of it and bitwise identical run to run.
#include <cstdint>

#include "transports/nvshmem/cuda/nvshmem_device.cuh"
#include "transports/nvshmem/cuda/nvshmem_kernels.hpp"

namespace ep {
namespace nvshmem {
namespace {

using namespace device;

// Partials a block stores before it releases their flags together (see send_phase).
constexpr int kMaxPending = 8;

struct CombineShared {
  int first_item[kMaxExperts];  // SEND: first item of the i-th source taken (rank + 1 + i) % R
  // SEND: x row and weight of entry j of an item, two sets used by alternate items: an item
  // writes its set before its first barrier, while threads may still be reading the previous
  // item's set (the barrier after it guarantees the set before that is no longer read).
  long long item_row[2][kMaxTopk];
  float item_weight[2][kMaxTopk];
  long long row[kMaxTopk];  // RECV: partial offset of destination j
  float weight[kMaxTopk];   // RECV: w of a BF16 row (1 for a BF16 sum)
  int bf16_row[kMaxTopk];   // RECV: destination j returned a BF16 row, else float32
  int dest[kMaxTopk];       // RECV: destination rank j
  int count;                // entries (SEND) or destinations (RECV) of the current token
  int items;
  int weights_of;  // SEND, put path: source whose weights flag this block has seen, or -1
  int fail;
  uint64_t seq;   // the dispatch's call number, loaded by thread 0 (read after a barrier)
  uint64_t call;  // this combine's number (ControlBlock::combine_seq), likewise: its signals
  int stride;     // the dispatch's message stride, likewise
  // SEND: items stored and not yet released: destination rank, token, entry count.
  int pending_rank[kMaxPending];
  int pending_token[kMaxPending];
  int pending_entries[kMaxPending];
};

// A float32 partial row is stored as two halves: channels 8v..8v+3 at piece v of the first
// half, 8v+4..8v+7 at piece v of the second. A warp's store is then 512 contiguous bytes (with
// the 8 floats of a thread side by side, every 32-byte sector was half-written per store).
__device__ __forceinline__ void st_partial(char* row, int v, int vecs, const float* acc) {
  st_v4(row + size_t(v) * 16, make_int4(__float_as_int(acc[0]), __float_as_int(acc[1]),
                                        __float_as_int(acc[2]), __float_as_int(acc[3])));
  st_v4(row + size_t(vecs + v) * 16, make_int4(__float_as_int(acc[4]), __float_as_int(acc[5]),
                                               __float_as_int(acc[6]), __float_as_int(acc[7])));
}

// Eight float32 values as eight BF16 (round to nearest even), in channel order.
__device__ __forceinline__ int4 pack_bf16x8(const float* acc) {
  int4 o;
  o.x = static_cast<int>(float_to_bf16_rne(acc[0]) | (float_to_bf16_rne(acc[1]) << 16));
  o.y = static_cast<int>(float_to_bf16_rne(acc[2]) | (float_to_bf16_rne(acc[3]) << 16));
  o.z = static_cast<int>(float_to_bf16_rne(acc[4]) | (float_to_bf16_rne(acc[5]) << 16));
  o.w = static_cast<int>(float_to_bf16_rne(acc[6]) | (float_to_bf16_rne(acc[7]) << 16));
  return o;
}

// acc[0..8) += w * the eight BF16 values of `y` (separately rounded multiply and add).
__device__ __forceinline__ void add_weighted_bf16x8(float* acc, float w, const int4& y) {
  const uint32_t words[4] = {static_cast<uint32_t>(y.x), static_cast<uint32_t>(y.y),
                             static_cast<uint32_t>(y.z), static_cast<uint32_t>(y.w)};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    acc[2 * j] = __fadd_rn(acc[2 * j], __fmul_rn(w, bf16_to_float(words[j])));
    acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], __fmul_rn(w, bf16_hi_to_float(words[j])));
  }
}

// False when the group was aborted (`abort_seen`, loaded at kernel start): nothing sent. The
// first weight is loaded before the abort check, so the two loads overlap. Each weight goes as a
// tagged word (weight_word); the flag released after them is the handshake recv_phase waits for
// and, on the put path, the weights' signal.
template <bool kP2P>
__device__ bool send_weights(const CombineParams& p, const CombineShared& sh, int abort_seen) {
  const Context& c = p.ctx;
  const int tid = static_cast<int>(threadIdx.x);
  const int R = c.num_ranks;
  const int G = static_cast<int>(gridDim.x);
  const int KM = c.layout.max_topk;
  const int n = p.num_tokens * p.num_topk;
  auto weight = [&](int i) { return p.topk_weights != nullptr ? p.topk_weights[i] : 1.0f; };
  if (static_cast<int>(blockIdx.x) >= R) return true;
  const float first = tid < n ? weight(tid) : 0.0f;
  if (__syncthreads_or(abort_seen)) return false;
  const uint64_t call = sh.call;
  const uint32_t tag = weight_tag(call);
  for (int d = static_cast<int>(blockIdx.x); d < R; d += G) {
    if (rank_masked(c, d)) continue;  // block-uniform: the barriers below stay matched
    char* peer = c.peer[d];
    const size_t area = c.layout.comb_weights_offset + size_t(c.rank) * c.max_tokens * KM * 8;
    uint64_t* dst = reinterpret_cast<uint64_t*>(
        peer != nullptr ? peer + area : c.local + c.layout.comb_wstage_offset);
    for (int i = tid; i < n; i += kThreads) {
      const int t = i / p.num_topk;
      const int k = i % p.num_topk;
      st_relaxed_sys(dst + size_t(t) * KM + k, weight_word(tag, i == tid ? first : weight(i)));
    }
    __syncthreads();
    const size_t flag = c.layout.comb_wflag_offset + size_t(c.rank) * 8;
    if (kP2P || peer != nullptr) {
      if (tid == 0) st_release_sys(reinterpret_cast<uint64_t*>(peer + flag), call);
    } else if (!kP2P && warp_id() == 0) {
      const size_t bytes = size_t(max(p.num_tokens, 1)) * KM * 8;
      warp_put_signal(c, d, area, reinterpret_cast<const char*>(dst), bytes, flag, call);
    }
    __syncthreads();  // the staged weights may be rewritten for the next rank
  }
  return true;
}

// False when aborted or a wait failed (block-uniform).
template <bool kP2P>
__device__ bool send_phase(const CombineParams& p, const Waiter& w, CombineShared& sh,
                           int abort_seen) {
  const Context& c = p.ctx;
  const int tid = static_cast<int>(threadIdx.x);
  const int R = c.num_ranks;
  const int M = c.max_tokens;
  const int G = static_cast<int>(gridDim.x);
  const int KM = c.layout.max_topk;
  const int H = p.hidden;
  const int vecs = H / 8;
  const uint64_t* wflags = reinterpret_cast<const uint64_t*>(c.local + c.layout.comb_wflag_offset);
  const uint64_t* dflags = reinterpret_cast<const uint64_t*>(c.local + c.layout.disp_flag_offset);

  if (!send_weights<kP2P>(p, sh, abort_seen)) return false;
  // Sources are taken from the next rank on, this rank's own last: the link is busy from the
  // first item of every block (taking the local source first left it idle for microseconds).
  if (tid == 0) {
    int n = 0;
    for (int i = 0; i < R; ++i) {
      sh.first_item[i] = n;
      n += c.recv_tokens[(c.rank + 1 + i) % R];
    }
    sh.items = n;
    sh.weights_of = -1;
    sh.fail = 0;
  }
  if (__syncthreads_or(abort_seen)) return false;
  const int items = sh.items;
  const uint64_t seq = sh.seq;    // the dispatch's: its message flags
  const uint64_t call = sh.call;  // this combine's: the weights it waits for, what it sends
  // The dispatch's messages (BF16 or FP8: their stride was recorded by its RECV).
  const int stride = sh.stride;
  // A block's items are stored back to back and their flags released together: a release waits
  // until the block's remote stores have landed (long for the remote items at this size), and
  // the local items' loads and stores now run during that wait instead of after it.
  int pending = 0;
  int set = 0;  // item_row / item_weight set of the next item with a message
  for (int item = static_cast<int>(blockIdx.x); item < items; item += G) {
    const int i = item_source(sh.first_item, R, item);
    const int s = (c.rank + 1 + i) % R;
    const int t = item - sh.first_item[i];
    // The dispatch's slot (s, t) is still in this rank's receive area, final since its RECV (an
    // earlier kernel): with a message, its header says which rows of x belong to the token and
    // with which k. Block-uniform (every thread reads the same word).
    // A source masked since the dispatch gets nothing back.
    const bool present = !rank_masked(c, s) &&
                         ld_volatile_u64(dflags + size_t(s) * M + t) == message_flag(seq, true);
    if (present) {
      const char* m = c.local + c.layout.disp_recv_offset + (size_t(s) * M + t) * stride;
      const int n = message_entries(m);
      long long* rows = sh.item_row[set];
      float* weights = sh.item_weight[set];
      set ^= 1;
      // Which rows of x, and each entry's weight. A single entry goes back unweighted: only
      // sums wait for the source's weights. Over P2P each weight word carries the call's tag
      // (polled by the thread of its entry); on the put path the flag is the put's signal.
      const bool tagged = kP2P || c.peer[s] != nullptr;
      const uint64_t* words =
          reinterpret_cast<const uint64_t*>(c.local + c.layout.comb_weights_offset) +
          (size_t(s) * M + t) * KM;
      int k = 0;
      if (tid < n) {
        const int2 entry = message_entry(m, tid);
        const int le = key_expert(entry.x);
        const long long begin = p.layout_range[size_t(le) * R + s] >> 32;
        rows[tid] = static_cast<long long>(le) * R * M + begin + entry.y;
        k = key_k(entry.x);
        if (n > 1 && tagged) {
          const uint32_t tag = weight_tag(call);
          uint64_t word = 0;
          if (spin_wait(w, s,
                        [&] { return weight_word_is(word = ld_volatile_u64(words + k), tag); }))
            weights[tid] = weight_word_value(word);
          else
            sh.fail = 1;
        }
      }
      if (n > 1 && !tagged) {
        if (tid == 0 && sh.weights_of != s) {
          if (spin_wait(w, s, [&] { return ld_acquire_sys(wflags + s) == call; }))
            sh.weights_of = s;
          else
            sh.fail = 1;
        }
        __syncthreads();
        if (tid < n && !sh.fail) weights[tid] = weight_word_value(ld_volatile_u64(words + k));
      }
      __syncthreads();
      if (sh.fail) return false;
      char* peer = c.peer[s];
      const size_t slot = size_t(c.rank) * M + t;
      char* dst = peer != nullptr
                      ? peer + c.layout.comb_recv_offset + slot * size_t(H) * 4
                      : c.local + c.layout.comb_stage_offset + (size_t(s) * M + t) * size_t(H) * 4;
      const char* x = reinterpret_cast<const char*>(p.x);
      for (int v = tid; v < vecs; v += kThreads) {
        if (n == 1) {
          st_v4(dst + size_t(v) * 16,
                ld_nc_v4_no_l2_prefetch(x + size_t(rows[0]) * H * 2 + size_t(v) * 16));
          continue;
        }
        float acc[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
        // Batches of four independent row loads in flight, then the adds in k order.
        constexpr int kBatch = 4;
        for (int k0 = 0; k0 < n; k0 += kBatch) {
          int4 y[kBatch];
#pragma unroll
          for (int u = 0; u < kBatch; ++u)
            if (k0 + u < n)
              y[u] = ld_nc_v4_no_l2_prefetch(x + size_t(rows[k0 + u]) * H * 2 + size_t(v) * 16);
#pragma unroll
          for (int u = 0; u < kBatch; ++u) {
            if (k0 + u >= n) break;
            add_weighted_bf16x8(acc, weights[k0 + u], y[u]);
          }
        }
        if (p.bf16_partials)
          st_v4(dst + size_t(v) * 16, pack_bf16x8(acc));
        else
          st_partial(dst, v, vecs, acc);
      }
      if (tid == 0) {
        sh.pending_rank[pending] = s;
        sh.pending_token[pending] = t;
        sh.pending_entries[pending] = n;
      }
      ++pending;
    }
    if (pending == 0 || (pending < kMaxPending && item + G < items)) continue;
    // Release: every pending item's flag, after the barrier that orders the block's stores
    // (P2P: thread j's release store covers them; otherwise warp j puts item j from comb_stage
    // with the flag as its signal).
    __syncthreads();
    for (int j = warp_id(); j < pending; j += kThreads / 32) {
      const int d = sh.pending_rank[j];
      const size_t at = size_t(c.rank) * M + sh.pending_token[j];
      const size_t flag = c.layout.comb_flag_offset + at * 8;
      if (kP2P || c.peer[d] != nullptr) {
        if (lane_id() == 0) st_release_sys(reinterpret_cast<uint64_t*>(c.peer[d] + flag), call);
      } else if constexpr (!kP2P) {
        const size_t bytes = size_t(H) * (sh.pending_entries[j] == 1 || p.bf16_partials ? 2 : 4);
        const char* src = c.local + c.layout.comb_stage_offset +
                          (size_t(d) * M + sh.pending_token[j]) * size_t(H) * 4;
        warp_put_signal(c, d, c.layout.comb_recv_offset + at * size_t(H) * 4, src, bytes, flag,
                        call);
      }
    }
    __syncthreads();  // pending_* are rewritten by the next items
    pending = 0;
  }
  return true;
}

__device__ void recv_phase(const CombineParams& p, const Waiter& w, uint64_t call,
                           CombineShared& sh) {
  const Context& c = p.ctx;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = lane_id();
  const int R = c.num_ranks;
  const int M = c.max_tokens;
  const int K = p.num_topk;
  const int T = p.num_tokens;
  const int H = p.hidden;
  const int2 tokens = block_tokens(T);
  const int t_begin = tokens.x;
  const int t_end = tokens.y;
  const uint64_t* wflags = reinterpret_cast<const uint64_t*>(c.local + c.layout.comb_wflag_offset);
  const uint64_t* flags = reinterpret_cast<const uint64_t*>(c.local + c.layout.comb_flag_offset);
  const char* recv = c.local + c.layout.comb_recv_offset;

  // Every rank's weights flag: it has finished its dispatch RECV of this buffer.
  if (tid == 0) sh.fail = 0;
  __syncthreads();
  for (int d = tid; d < R; d += kThreads)
    if (!rank_masked(c, d) && !spin_wait(w, d, [&] { return ld_acquire_sys(wflags + d) == call; }))
      sh.fail = 1;
  __syncthreads();
  if (sh.fail) return;

  const unsigned full = 0xffffffffu;
  for (int t = t_begin; t < t_end; ++t) {
    // The token's destination ranks, first-appearance order, from the dispatch's routes.
    if (tid < 32) {
      // An entry on a rank masked since the dispatch is absent: no partial comes from it.
      int route = lane < K ? c.send_route[size_t(t) * K + lane] : -1;
      if (route >= 0 && rank_masked(c, route_rank(route))) route = -1;
      const int d = route_rank(route);
      const unsigned same = lanes_equal(d, 0, K);
      const int first = __ffs(same) - 1;
      const unsigned firsts = __ballot_sync(full, d >= 0 && lane == first);
      const unsigned listed = same & __ballot_sync(full, route_has_slot(route));
      if (d >= 0 && lane == first) {
        const int j = __popc(firsts & ((1u << lane) - 1u));
        const bool single = __popc(listed) == 1;
        const int k = __ffs(listed) - 1;
        sh.dest[j] = d;
        // A BF16 row: a single entry (weighted here) or, with bf16_partials, a sum weighted
        // on its rank (w = 1 adds it as it is).
        float weight = 1.0f;
        if (single && p.topk_weights != nullptr) weight = p.topk_weights[size_t(t) * K + k];
        sh.bf16_row[j] = single || p.bf16_partials ? 1 : 0;
        sh.weight[j] = weight;
        sh.row[j] = static_cast<long long>(size_t(d) * M + t) * H * 4;
      }
      if (lane == 0) sh.count = __popc(firsts);
    }
    __syncthreads();
    const int nd = sh.count;
    if (tid < nd) {
      const uint64_t* f = flags + size_t(sh.dest[tid]) * M + t;
      if (!spin_wait(w, sh.dest[tid], [&] { return ld_acquire_sys(f) == call; })) sh.fail = 1;
    }
    __syncthreads();
    if (sh.fail) return;
    for (int v = tid; v < H / 8; v += kThreads) {
      float acc[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
      for (int j = 0; j < nd; ++j) {
        const char* part = recv + sh.row[j];
        if (sh.bf16_row[j]) {
          add_weighted_bf16x8(acc, sh.weight[j], ld_cg_v4(part + size_t(v) * 16));
        } else {
          const int4 a = ld_cg_v4(part + size_t(v) * 16);
          const int4 b = ld_cg_v4(part + size_t(H / 8 + v) * 16);
          acc[0] = __fadd_rn(acc[0], __int_as_float(a.x));
          acc[1] = __fadd_rn(acc[1], __int_as_float(a.y));
          acc[2] = __fadd_rn(acc[2], __int_as_float(a.z));
          acc[3] = __fadd_rn(acc[3], __int_as_float(a.w));
          acc[4] = __fadd_rn(acc[4], __int_as_float(b.x));
          acc[5] = __fadd_rn(acc[5], __int_as_float(b.y));
          acc[6] = __fadd_rn(acc[6], __int_as_float(b.z));
          acc[7] = __fadd_rn(acc[7], __int_as_float(b.w));
        }
      }
      st_v4(p.out + size_t(t) * H + size_t(v) * 8, pack_bf16x8(acc));
    }
    __syncthreads();  // sh.dest / sh.row are the next token's
  }
}

// kP2P: every peer is P2P-mapped (Context::all_p2p); that instantiation has no NVSHMEM calls.
template <bool kP2P>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(CombineParams p) {
  __shared__ CombineShared sh;
  const Context& c = p.ctx;
  const Waiter w{c.ctrl, c.error, c.timeout_ns, kOpCombine, c.rank};
  // Block-uniform decisions only: every path below contains __syncthreads. A SEND checks the
  // abort word before its first remote store; the RECV's waits give up on it by themselves.
  // Control words are read by one thread per block (all threads of all blocks reading the same
  // words queue thousands of requests on one L2 line at kernel start).
  int abort_seen = 0;
  const bool send = (p.phases & kPhaseSend) != 0;
  if (threadIdx.x == 0) {
    sh.seq = ld_volatile_u64(&c.ctrl->dispatch_seq[c.buffer]);
    // A SEND takes the buffer's next combine number; a RECV-only launch its SEND's.
    sh.call = ld_volatile_u64(&c.ctrl->combine_seq[c.buffer]) + (send ? 1 : 0);
    sh.stride = ld_volatile_int(&c.ctrl->message_stride[c.buffer]);
    abort_seen = aborted(w) ? 1 : 0;
  }
  const bool sent = send ? send_phase<kP2P>(p, w, sh, abort_seen) : !__syncthreads_or(abort_seen);
  if (sent && (p.phases & kPhaseRecv)) recv_phase(p, w, sh.call, sh);
  __syncthreads();
  if (threadIdx.x == 0 && send) {
    const uint64_t call = sh.call;
    finish_block(&c.ctrl->blocks_done[1], [&] { c.ctrl->combine_seq[c.buffer] = call; });
  }
}

}  // namespace

cudaError_t launch_combine(const CombineParams& p, int num_blocks, cudaStream_t stream) {
  return p.ctx.all_p2p ? device::launch_cooperative(combine_kernel<true>, p, num_blocks, stream)
                       : device::launch_cooperative(combine_kernel<false>, p, num_blocks, stream);
}

cudaError_t max_combine_blocks(int* blocks) {
  return device::max_cooperative_blocks_of_both(combine_kernel<true>, combine_kernel<false>,
                                                blocks);
}

}  // namespace nvshmem
}  // namespace ep
