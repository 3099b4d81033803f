// Low-latency combine over NVSHMEM symmetric memory.
//
// SEND (expert side, rank r, buffer b of the dispatch): for every (local expert le, source s),
// the rows begin_s .. begin_s + count_s of x[le] (the layout_range of the dispatch) go back to
// rank s, slot (global expert r*E_loc + le, position p = row - begin_s) of its combine receive
// area; each row (remote path) or each block's batch of rows (P2P path) adds to the arrival
// counter of that global expert on rank s. Zero-copy: x is this rank's combine send area
// (remote puts read it directly; the P2P path reads it like any input).
// RECV (token side): wait until the arrival counter of every expert reaches the count this rank
// sent to it (sent_count of the dispatch) plus one handshake unit from the expert's owner, then
//   out[t] = bf16(acc), acc = +0.0; for k = 0..K-1 with a valid slot: acc = acc + w_k * y_k
// with separately rounded multiply and add (no FMA), exactly the reference's order. The last
// block resets the arrival counters.
#include <cstdint>

#include "ll_device.cuh"
#include "ll_kernels.hpp"

namespace ep {
namespace ll {
namespace {

using namespace device;

#ifdef EP_LL_TIMELINE
__device__ uint64_t g_combine_timeline[kTimelineBlocks * kTimelineStages];
#endif

__device__ void send_phase(const CombineParams& p) {
  const Context& c = p.ctx;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = lane_id();
  const int warp = warp_id();
  const int R = c.num_ranks;
  const int M = c.max_tokens;
  const int E = p.num_experts;
  const int E_loc = E / R;
  const int G = static_cast<int>(gridDim.x);
  const int splits = max(1, G / E);
  const int row_bytes = p.hidden * 2;
  const char* send_area = c.local + c.layout.comb_send_offset;
  const bool zero_copy = reinterpret_cast<const char*>(p.x) == send_area;

  for (int item = static_cast<int>(blockIdx.x); item < E * splits; item += G) {
    const int group = item % E;
    const int split = item / E;
    const int le = group / R;
    const int s = group % R;
    const long long range = p.layout_range[size_t(le) * R + s];
    const int begin = static_cast<int>(range >> 32);
    const int count = static_cast<int>(range & 0xFFFFFFFFll);
    const int expert = c.rank * E_loc + le;
    const size_t counter = c.layout.comb_arrived_offset + size_t(expert) * 8;
    // Rows split, split + splits, ... of the group are this block's.
    const int mine = count > split ? (count - split + splits - 1) / splits : 0;
    char* peer = c.peer[s];
    if (peer != nullptr) {
      // P2P: the whole block stores the rows (16-byte pieces), then one release-add below.
      const int vecs = row_bytes / 16;
      for (int i = tid; i < mine * vecs; i += kThreads) {
        const int r = split + splits * (i / vecs);
        const int v = i % vecs;
        const size_t src_row = size_t(le) * R * M + begin + r;
        const char* src = reinterpret_cast<const char*>(p.x) + src_row * row_bytes;
        const size_t dst = c.layout.comb_recv_offset + (size_t(expert) * M + r) * row_bytes;
        st_v4(peer + dst + size_t(v) * 16, ld_nc_v4(src + size_t(v) * 16));
      }
      __syncthreads();
    } else {
      for (int q = warp; q < mine; q += kThreads / 32) {
        const int r = split + splits * q;
        const size_t src_row = size_t(le) * R * M + begin + r;
        const char* src = reinterpret_cast<const char*>(p.x) + src_row * row_bytes;
        const size_t dst = c.layout.comb_recv_offset + (size_t(expert) * M + r) * row_bytes;
        if (!zero_copy) {
          // Remote puts need a symmetric source: stage the row in the send area first.
          char* staged = c.local + c.layout.comb_send_offset + src_row * row_bytes;
          for (int i = lane; i < row_bytes / 16; i += 32)
            st_v4(staged + size_t(i) * 16, ld_nc_v4(src + size_t(i) * 16));
          __syncwarp();
          src = staged;
        }
        warp_put_row(c, s, dst, src, row_bytes, counter, false);
      }
    }
    // Handshake unit: warp 0 of split 0 adds 1 to the counter, rows or no rows, so rank s hears
    // from every rank (it waits for sent_count + 1 on every expert). Without it a rank that was
    // sent no rows by this rank (T=0, or no token routed here) finishes its combine without
    // waiting for this rank and may start the next dispatch on this buffer while this rank's
    // dispatch RECV is still reading it: overwritten count words (hang until timeout) and rows,
    // and arrival increments lost to the RECV's reset. That is the normal case under CUDA-graph
    // replay (buffer index frozen at capture) and in the two-micro-batch hook pattern. This
    // kernel runs after this rank's dispatch RECV on the same stream, so the unit also says
    // "done reading this buffer's dispatch area" (and every nbi put source was consumed).
    const int unit = split == 0 ? 1 : 0;
    // P2P: warp 0 publishes the block's rows (after the barrier above) and the unit at once.
    if (warp == 0) p2p_count_rows(c, s, counter, mine + unit);
    if (peer == nullptr && unit && warp == 0 && lane == 0) {
      // No ordering with the rows is needed: the receiver waits for all rows plus this unit,
      // and each row's own signal is delivered after its data.
      nvshmemx_signal_op(reinterpret_cast<uint64_t*>(c.local + counter), 1, NVSHMEM_SIGNAL_ADD, s);
    }
  }
}

__device__ void recv_phase(const CombineParams& p, const Waiter& w, int* s_fail, int* s_rows,
                           float* s_weights, int* s_valid) {
  const Context& c = p.ctx;
  const int tid = static_cast<int>(threadIdx.x);
  const int R = c.num_ranks;
  const int M = c.max_tokens;
  const int E = p.num_experts;
  const int E_loc = E / R;
  const int K = p.num_topk;
  const int T = p.num_tokens;
  const int G = static_cast<int>(gridDim.x);
  const int chunk = (T + G - 1) / G;
  const int t_begin = min(T, static_cast<int>(blockIdx.x) * chunk);
  const int t_end = min(T, t_begin + chunk);
  const uint64_t* arrived =
      reinterpret_cast<const uint64_t*>(c.local + c.layout.comb_arrived_offset);

  // Every block waits for every expert (cheap: one word per expert): the rows this rank sent
  // to it plus the owner's handshake unit (see send_phase), so the arrival counters can be reset
  // by the last block and every rank is known to have finished its dispatch RECV.
  if (tid == 0) *s_fail = 0;
  __syncthreads();
  for (int e = tid; e < E; e += kThreads) {
    const uint64_t need = static_cast<uint64_t>(c.sent_count[e]) + 1;
    if (!spin_wait(w, e / E_loc, [&] { return ld_acquire_sys(arrived + e) >= need; })) *s_fail = 1;
  }
  __syncthreads();
  if (*s_fail) return;
  EP_LL_MARK(g_combine_timeline, 2);

  const int vecs = p.hidden / 8;
  const int row_bytes = p.hidden * 2;
  const char* recv = c.local + c.layout.comb_recv_offset;
  for (int t = t_begin; t < t_end; ++t) {
    // The token's valid entries, k ascending: row offsets and weights, once per block.
    if (tid < 32) {
      const int k = tid;
      int row = -1;
      float wk = 0.0f;
      if (k < K) {
        const size_t entry = size_t(t) * K + k;
        const int slot = c.send_pos[entry];
        const long long e = load_idx(p.topk_idx, p.idx_bytes, entry);
        if (slot >= 0 && e >= 0 && e < E) {
          row = static_cast<int>(e) * M + slot;
          wk = p.topk_weights != nullptr ? p.topk_weights[entry] : 1.0f;
        }
      }
      const unsigned valid = __ballot_sync(0xffffffffu, row >= 0);
      if (row >= 0) {
        const int q = __popc(valid & ((1u << k) - 1u));
        s_rows[q] = row;
        s_weights[q] = wk;
      }
      if (k == 0) *s_valid = __popc(valid);
    }
    __syncthreads();
    const int nvalid = *s_valid;
    for (int v = tid; v < vecs; v += kThreads) {
      float acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
      // Batches of eight independent row loads in flight, then the adds in k order.
      for (int k0 = 0; k0 < nvalid; k0 += 8) {
        int4 y[8];
#pragma unroll
        for (int u = 0; u < 8; ++u)
          if (k0 + u < nvalid)
            y[u] = ld_cg_v4(recv + size_t(s_rows[k0 + u]) * row_bytes + size_t(v) * 16);
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          if (k0 + u >= nvalid) break;
          const float wk = s_weights[k0 + u];
          const uint32_t words[4] = {static_cast<uint32_t>(y[u].x), static_cast<uint32_t>(y[u].y),
                                     static_cast<uint32_t>(y[u].z), static_cast<uint32_t>(y[u].w)};
          for (int j = 0; j < 4; ++j) {
            acc[2 * j] = __fadd_rn(acc[2 * j], __fmul_rn(wk, bf16_lo(words[j])));
            acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], __fmul_rn(wk, bf16_hi(words[j])));
          }
        }
      }
      int4 o;
      o.x = static_cast<int>(float_to_bf16_rne(acc[0]) | (float_to_bf16_rne(acc[1]) << 16));
      o.y = static_cast<int>(float_to_bf16_rne(acc[2]) | (float_to_bf16_rne(acc[3]) << 16));
      o.z = static_cast<int>(float_to_bf16_rne(acc[4]) | (float_to_bf16_rne(acc[5]) << 16));
      o.w = static_cast<int>(float_to_bf16_rne(acc[6]) | (float_to_bf16_rne(acc[7]) << 16));
      st_v4(p.out + size_t(t) * p.hidden + size_t(v) * 8, o);
    }
    __syncthreads();  // s_rows / s_weights are the next token's
  }
}

__global__ void __launch_bounds__(kThreads, 1) combine_kernel(CombineParams p) {
  __shared__ int s_fail;
  __shared__ int s_rows[kMaxTopk];
  __shared__ float s_weights[kMaxTopk];
  __shared__ int s_valid;
  const Context& c = p.ctx;
  const Waiter w{c.ctrl, c.error, c.timeout_ns, kOpCombine, c.rank};
  // Block-uniform decisions only: every path below contains __syncthreads.
  EP_LL_MARK(g_combine_timeline, 0);
  if (!__syncthreads_or(aborted(w))) {
    if (p.phases & kPhaseSend) send_phase(p);
    EP_LL_MARK(g_combine_timeline, 1);
    if (!__syncthreads_or(aborted(w)) && (p.phases & kPhaseRecv))
      recv_phase(p, w, &s_fail, s_rows, s_weights, &s_valid);
  }
  __syncthreads();
  EP_LL_MARK(g_combine_timeline, 3);
  if (threadIdx.x == 0 && (p.phases & kPhaseRecv)) {
    finish_block(&c.ctrl->blocks_done[1], [&] {
      uint64_t* arrived = reinterpret_cast<uint64_t*>(c.local + c.layout.comb_arrived_offset);
      for (int i = 0; i < p.num_experts; ++i) arrived[i] = 0;
    });
  }
}

}  // namespace

#ifdef EP_LL_TIMELINE
cudaError_t read_combine_timeline(uint64_t* out) {
  return cudaMemcpyFromSymbol(out, g_combine_timeline, sizeof(g_combine_timeline));
}
#endif

cudaError_t launch_combine(const CombineParams& p, int num_blocks, cudaStream_t stream) {
  return device::launch_cooperative(combine_kernel, p, num_blocks, stream);
}

cudaError_t max_combine_blocks(int* blocks) {
  return device::max_cooperative_blocks(combine_kernel, blocks);
}

}  // namespace ll
}  // namespace ep
