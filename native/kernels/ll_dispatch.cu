// Low-latency dispatch over NVSHMEM symmetric memory (NVLink P2P stores or NVSHMEM puts).
//
// SEND (rank r, call on buffer b, sequence number seq):
//  1. Every block counts the entries per global expert (all tokens, and tokens before its own
//     chunk) in shared memory; the block owning expert e (e % grid) sends the count signal
//     (seq << 32 | count) to the expert's rank, slot (local expert, r). Counts need no ordering
//     with the rows: the receiver also waits for an arrival counter to reach the count.
//  2. Blocks walk their tokens in order. Warp 0 assigns each (t, k) its position p among this
//     rank's entries to expert e (tokens ascending, then k): the reference's order. FP8 (or a
//     destination reached by NVSHMEM puts) stages the message (header + payload + scales,
//     quantised here) in the local send area; BF16 to P2P peers is read straight from x. Every
//     thread then stores its 16-byte pieces to slot (le, r, p) of each P2P destination, and after
//     a barrier lane 0 of warp k releases entry k (fence + arrival-counter add); NVSHMEM
//     destinations get a put with its signal from warp k. p is kept (send_pos) for combine.
// RECV (rank d): for each (local expert le, source s), wait for the count signals of all
// sources of le (they give the packed begin of s) and for the arrival counter of (le, s), then
// copy the rows to recv_x[le, begin_s + p] (rows split over the group's blocks, all threads
// copying). The last block resets the arrival counters.
#include <cuda_fp8.h>

#include <cstdint>

#include "ll_device.cuh"
#include "ll_kernels.hpp"

namespace ep {
namespace ll {
namespace {

using namespace device;

#ifdef EP_LL_TIMELINE
__device__ uint64_t g_dispatch_timeline[kTimelineBlocks * kTimelineStages];
#endif

// Stages token t's message in the local send area: header, then BF16 or FP8 + scales.
__device__ __forceinline__ void stage_message(const DispatchParams& p, const Message& msg, int t,
                                              char* row) {
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = lane_id();
  const int warp = warp_id();
  if (tid == 0) *reinterpret_cast<int*>(row) = t;
  char* payload = row + kMessageHeader;
  const uint16_t* x = p.x + size_t(t) * p.hidden;
  if (!p.fp8) {
    const int n = p.hidden / 8;
    for (int i = tid; i < n; i += kThreads)
      st_v4(payload + size_t(i) * 16, ld_nc_v4(x + size_t(i) * 8));
    return;
  }
  char* scales = payload + p.hidden;
  const int groups = p.hidden / kGroupSize;
  for (int g = warp; g < groups; g += kThreads / 32) {
    const uint2 raw = *reinterpret_cast<const uint2*>(x + size_t(g) * kGroupSize + lane * 4);
    float v[4] = {bf16_lo(raw.x), bf16_hi(raw.x), bf16_lo(raw.y), bf16_hi(raw.y)};
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
}

// Entry (t, k) as a valid expert id or -1 (invalid ids are reported once and skipped).
__device__ __forceinline__ int entry_expert(const DispatchParams& p, const Waiter& w, size_t i) {
  const long long e = load_idx(p.topk_idx, p.idx_bytes, i);
  if (e >= 0 && e < p.num_experts) return static_cast<int>(e);
  if (e != -1 && blockIdx.x == 0)
    report_error(w, kErrorInvalidTopkIdx, -1, e, static_cast<long long>(i));
  return -1;
}

__device__ void send_phase(const DispatchParams& p, const Waiter& w, uint64_t seq, int* s_total,
                           int* s_base, int* s_expert, int* s_slot) {
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
  const int chunk = (T + G - 1) / G;
  const int t_begin = min(T, static_cast<int>(blockIdx.x) * chunk);
  const int t_end = min(T, t_begin + chunk);
  const Message msg = Message::make(p.hidden, p.fp8 != 0, p.ue8m0 != 0);

  for (int e = tid; e < E; e += kThreads) s_total[e] = s_base[e] = 0;
  __syncthreads();
  // 1. Counts (warp-aggregated shared atomics; order does not matter for counts).
  const int n = T * K;
  const int before = t_begin * K;
  for (int base = 0; base < n; base += kThreads) {
    const int i = base + tid;
    const int e = i < n ? entry_expert(p, w, size_t(i)) : -1;
    const unsigned mask = __match_any_sync(0xffffffffu, e);
    const bool leader = lane == __ffs(mask) - 1;
    if (leader && e >= 0) atomicAdd(&s_total[e], __popc(mask));
    const int eb = i < before ? e : -1;
    const unsigned mask_b = __match_any_sync(0xffffffffu, eb);
    if (lane == __ffs(mask_b) - 1 && eb >= 0) atomicAdd(&s_base[eb], __popc(mask_b));
  }
  __syncthreads();
  for (int e = static_cast<int>(blockIdx.x) + tid * G; e < E; e += kThreads * G) {
    int count = s_total[e];
    if (count > M) {
      report_error(w, kErrorCapacity, -1, count, M);
      count = M;
    }
    c.sent_count[e] = count;
    const int dest = e / E_loc;
    const int slot = (e % E_loc) * R + c.rank;
    signal_set(c, dest, c.layout.disp_count_offset + size_t(slot) * 8,
               (seq << 32) | static_cast<uint64_t>(count));
  }

  EP_LL_MARK(g_dispatch_timeline, 1);
  // 2. Tokens of this block, in order.
  const int vecs = msg.stride / 16;
  for (int t = t_begin; t < t_end; ++t) {
    if (warp == 0) {
      const int e = lane < K ? entry_expert(p, w, size_t(t) * K + lane) : -1;
      const unsigned mask = __match_any_sync(0xffffffffu, e);
      const unsigned lower = mask & ((1u << lane) - 1u);
      const int pos = e >= 0 ? s_base[e] + __popc(lower) : -1;
      __syncwarp();
      if (e >= 0 && lower == 0) s_base[e] += __popc(mask);
      const int slot = pos < M ? pos : -1;  // overflow was reported with the counts
      if (lane < K) {
        s_expert[lane] = slot >= 0 ? e : -1;
        s_slot[lane] = slot;
        c.send_pos[size_t(t) * K + lane] = slot;
      }
    }
    __syncthreads();
    // The NVSHMEM put path reads a symmetric source, and FP8 is quantised once for all K
    // copies: both stage the message in the send area. BF16 to P2P peers goes straight from x.
    bool staged = p.fp8 != 0;
    for (int k = 0; k < K; ++k)
      staged |= s_expert[k] >= 0 && c.peer[s_expert[k] / E_loc] == nullptr;
    char* row = c.local + c.layout.disp_send_offset + size_t(t) * msg.stride;
    if (staged) {
      stage_message(p, msg, t, row);
      __syncthreads();
    }
    // P2P destinations: every thread stores its 16-byte pieces of the message to each of them
    // (the whole block writes, not one warp per destination).
    const int4* x_row = reinterpret_cast<const int4*>(p.x + size_t(t) * p.hidden);
    for (int i = tid; i < vecs; i += kThreads) {
      const int4 v = staged ? ld_cg_v4(row + size_t(i) * 16)
                            : (i == 0 ? make_int4(t, 0, 0, 0) : ld_nc_v4(x_row + (i - 1)));
      for (int k = 0; k < K; ++k) {
        const int e = s_expert[k];
        if (e < 0) continue;
        char* peer = c.peer[e / E_loc];
        if (peer == nullptr) continue;
        const int group = (e % E_loc) * R + c.rank;
        const size_t dst = c.layout.disp_recv_offset + (size_t(group) * M + s_slot[k]) * msg.stride;
        st_v4(peer + dst + size_t(i) * 16, v);
      }
    }
    __syncthreads();
    // Publish: warp k releases entry k (P2P: fence + counter add, covering the whole block's
    // stores ordered by the barrier; otherwise a put with its signal).
    if (warp < K) {
      const int e = s_expert[warp];
      if (e >= 0) {
        const int dest = e / E_loc;
        const int group = (e % E_loc) * R + c.rank;
        const size_t counter = c.layout.disp_arrived_offset + size_t(group) * 8;
        if (c.peer[dest] == nullptr) {
          const size_t dst =
              c.layout.disp_recv_offset + (size_t(group) * M + s_slot[warp]) * msg.stride;
          warp_put_row(c, dest, dst, row, msg.stride, counter, false);
        }
        p2p_count_rows(c, dest, counter, 1);
      }
    }
    __syncthreads();
  }
  EP_LL_MARK(g_dispatch_timeline, 2);
}

__device__ void recv_phase(const DispatchParams& p, const Waiter& w, uint64_t seq, int* s_count,
                           int* s_fail) {
  const Context& c = p.ctx;
  const int tid = static_cast<int>(threadIdx.x);
  const int R = c.num_ranks;
  const int M = c.max_tokens;
  const int E = p.num_experts;
  const int slots = R * M;
  const int G = static_cast<int>(gridDim.x);
  const Message msg = Message::make(p.hidden, p.fp8 != 0, p.ue8m0 != 0);
  const int splits = max(1, G / E);
  const uint64_t* counts = reinterpret_cast<const uint64_t*>(c.local + c.layout.disp_count_offset);
  const uint64_t* arrived =
      reinterpret_cast<const uint64_t*>(c.local + c.layout.disp_arrived_offset);
  const uint32_t want = static_cast<uint32_t>(seq);

  for (int item = static_cast<int>(blockIdx.x); item < E * splits; item += G) {
    const int group = item % E;
    const int split = item / E;
    const int le = group / R;
    const int s = group % R;
    if (tid == 0) *s_fail = 0;
    __syncthreads();
    for (int src = tid; src < R; src += kThreads) {
      const uint64_t* f = counts + size_t(le) * R + src;
      uint64_t v = 0;
      const bool ok = spin_wait(w, src, [&] {
        v = ld_acquire_sys(f);
        return static_cast<uint32_t>(v >> 32) == want;
      });
      s_count[src] = static_cast<int>(v & 0xFFFFFFFFu);
      if (!ok) *s_fail = 1;
    }
    __syncthreads();
    if (*s_fail) return;
    int begin = 0, total = 0;
    for (int src = 0; src < R; ++src) {
      if (src < s) begin += s_count[src];
      total += s_count[src];
    }
    const int count = s_count[s];
    if (tid == 0 && count > 0) {
      const uint64_t* a = arrived + group;
      if (!spin_wait(w, s, [&] { return ld_acquire_sys(a) >= static_cast<uint64_t>(count); }))
        *s_fail = 1;
    }
    __syncthreads();
    if (*s_fail) return;

    if (item == static_cast<int>(blockIdx.x)) EP_LL_MARK(g_dispatch_timeline, 3);
    // Rows split, split + splits, ... of the group are this block's; all threads copy them.
    const size_t out_base = size_t(le) * slots;
    const int mine = count > split ? (count - split + splits - 1) / splits : 0;
    const int payload_vecs = msg.payload_bytes / 16;
    const char* group_base = c.local + c.layout.disp_recv_offset + size_t(group) * M * msg.stride;
    char* x_base = static_cast<char*>(p.recv_x) + (out_base + begin) * msg.payload_bytes;
    // Payload: four independent 16-byte loads in flight per thread before their stores.
    constexpr int kUnroll = 4;
    const int pieces = mine * payload_vecs;
    for (int i0 = tid; i0 < pieces; i0 += kThreads * kUnroll) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u * kThreads;
        if (i < pieces) {
          const int r = split + splits * (i / payload_vecs);
          v[u] = ld_cg_v4(group_base + size_t(r) * msg.stride + kMessageHeader +
                          size_t(i % payload_vecs) * 16);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u * kThreads;
        if (i < pieces) {
          const int r = split + splits * (i / payload_vecs);
          st_v4(x_base + size_t(r) * msg.payload_bytes + size_t(i % payload_vecs) * 16, v[u]);
        }
      }
    }
    // Scale words and the source token of each row.
    const int extras = msg.scale_words + 1;
    for (int i = tid; i < mine * extras; i += kThreads) {
      const int r = split + splits * (i / extras);
      const int q = i % extras;
      const char* m = group_base + size_t(r) * msg.stride;
      const size_t out_row = out_base + begin + r;
      if (q < msg.scale_words) {
        static_cast<int*>(p.recv_scales)[out_row * msg.scale_words + q] =
            ld_cg_s32(m + kMessageHeader + msg.payload_bytes + size_t(q) * 4);
      } else {
        p.src_info[out_row] = ld_cg_s32(m);
      }
    }
    if (split == 0 && s == 0) {
      // Per-expert outputs: counts, ranges, stats, src_info (and optionally rows) past the end.
      if (tid == 0) {
        p.recv_count[le] = total;
        if (p.cumulative_stats != nullptr) p.cumulative_stats[le] += total;
      }
      for (int src = tid; src < R; src += kThreads) {
        int b = 0;
        for (int j = 0; j < src; ++j) b += s_count[j];
        p.layout_range[size_t(le) * R + src] =
            (static_cast<long long>(b) << 32) | static_cast<long long>(s_count[src]);
      }
      for (int i = total + tid; i < slots; i += kThreads) p.src_info[out_base + i] = -1;
      if (p.zero_padding) {
        const int4 zero = make_int4(0, 0, 0, 0);
        const size_t row_vecs = size_t(msg.payload_bytes) / 16;
        char* x0 = static_cast<char*>(p.recv_x) + out_base * msg.payload_bytes;
        for (size_t i = size_t(total) * row_vecs + tid; i < size_t(slots) * row_vecs; i += kThreads)
          st_v4(x0 + i * 16, zero);
        if (msg.scale_words > 0) {
          int* s0 = static_cast<int*>(p.recv_scales) + out_base * msg.scale_words;
          for (size_t i = size_t(total) * msg.scale_words + tid;
               i < size_t(slots) * msg.scale_words; i += kThreads)
            s0[i] = 0;
        }
      }
    }
    __syncthreads();  // s_count / s_fail are reused by the next item
  }
}

__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(DispatchParams p) {
  __shared__ int s_total[kMaxExperts];
  __shared__ int s_base[kMaxExperts];
  __shared__ int s_expert[kMaxTopk];
  __shared__ int s_slot[kMaxTopk];
  __shared__ int s_fail;
  const Context& c = p.ctx;
  const Waiter w{c.ctrl, c.error, c.timeout_ns, kOpDispatch, c.rank};
  const uint64_t seq =
      ld_volatile_u64(&c.ctrl->dispatch_seq[c.buffer]) + ((p.phases & kPhaseSend) ? 1 : 0);
  // Block-uniform decisions only: every path below contains __syncthreads.
  EP_LL_MARK(g_dispatch_timeline, 0);
  if (!__syncthreads_or(aborted(w))) {
    if (p.phases & kPhaseSend) send_phase(p, w, seq, s_total, s_base, s_expert, s_slot);
    // s_total is free again: it holds the counts of the current expert's sources.
    if (!__syncthreads_or(aborted(w)) && (p.phases & kPhaseRecv))
      recv_phase(p, w, seq, s_total, &s_fail);
  }
  __syncthreads();
  EP_LL_MARK(g_dispatch_timeline, 4);
  if (threadIdx.x == 0) {
    finish_block(&c.ctrl->blocks_done[0], [&] {
      if (p.phases & kPhaseSend) c.ctrl->dispatch_seq[c.buffer] = seq;
      if (p.phases & kPhaseRecv) {
        uint64_t* arrived = reinterpret_cast<uint64_t*>(c.local + c.layout.disp_arrived_offset);
        for (int i = 0; i < p.num_experts; ++i) arrived[i] = 0;
      }
    });
  }
}

}  // namespace

#ifdef EP_LL_TIMELINE
cudaError_t read_dispatch_timeline(uint64_t* out) {
  return cudaMemcpyFromSymbol(out, g_dispatch_timeline, sizeof(g_dispatch_timeline));
}
#endif

cudaError_t launch_dispatch(const DispatchParams& p, int num_blocks, cudaStream_t stream) {
  return device::launch_cooperative(dispatch_kernel, p, num_blocks, stream);
}

cudaError_t max_dispatch_blocks(int* blocks) {
  return device::max_cooperative_blocks(dispatch_kernel, blocks);
}

}  // namespace ll
}  // namespace ep
