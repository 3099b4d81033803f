// High-throughput intranode dispatch (normal, worst-case and cached), push model over NVLink.
//
// Each block has `num_send_warps` sender warps and the rest receiver warps.
//  * Senders: global sender warp w takes tokens w, w + W, w + 2W, ... (all warps walk the tokens
//    together, so rows reach every receiver in roughly increasing slot order). Per token it reads
//    the x row once (ld.global.nc, 16 B per lane) and writes it to every destination: straight into
//    recv_x for this rank (HBM to HBM, never through the buffer), and for a peer into the slot
//    send_pos[t, peer] of the region this rank owns in the peer's buffer, followed by scales,
//    metadata (source index, local expert ids, weights) and finally a per-row flag = sequence
//    number, published with a system-scope release.
//  * Receivers: global receiver warp v takes slots v, v + V, ... of every remote source, waits for
//    the row's flag (acquire) and copies the row to its final place recv_prefix[src] + slot. Rows
//    are thus copied out while later rows are still in flight.
// Before a sender first writes into a peer's buffer it waits for the peer's "entered" flag of this
// sequence: the peer has finished every earlier kernel, so the region is no longer being read.
// No ring buffer and no flow control: each source owns max_tokens rows in every receiver.
#include "intranode_kernels.hpp"
#include "ptx_utils.cuh"

namespace ep {
namespace {

constexpr uint32_t kFull = 0xffffffffu;
constexpr int kCopyUnroll = 8;  // 16-byte chunks in flight per lane (latency hiding)

// Copies n16 16-byte chunks from a read-only input row to up to kMaxRanks destinations.
__device__ __forceinline__ void copy_row_multi(const int4* __restrict__ src, int n16,
                                               char* const (&dst)[kMaxRanks], int lane) {
  for (int i = lane; i < n16; i += 32 * kCopyUnroll) {
    int4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u)
      if (i + 32 * u < n16) v[u] = device::ld_nc_v4(src + i + 32 * u);
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (i + 32 * u < n16) {
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d)
          if (dst[d] != nullptr) device::st_v4(reinterpret_cast<int4*>(dst[d]) + i + 32 * u, v[u]);
      }
    }
  }
}

// Copies a row a peer wrote into our buffer (coherent loads) to its output row.
__device__ __forceinline__ void copy_row(const int4* src, int4* dst, int n16, int lane) {
  for (int i = lane; i < n16; i += 32 * kCopyUnroll) {
    int4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u)
      if (i + 32 * u < n16) v[u] = device::ld_v4(src + i + 32 * u);
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u)
      if (i + 32 * u < n16) device::st_v4(dst + i + 32 * u, v[u]);
  }
}

__device__ __forceinline__ void store_idx(void* base, size_t i, int idx_bytes, int v) {
  if (idx_bytes == 8)
    static_cast<long long*>(base)[i] = v;
  else
    static_cast<int*>(base)[i] = v;
}

__device__ __forceinline__ long long load_idx(const void* base, size_t i, int idx_bytes) {
  return idx_bytes == 8 ? static_cast<const long long*>(base)[i]
                        : static_cast<long long>(static_cast<const int*>(base)[i]);
}

__device__ void dispatch_send(const DispatchParams& p, const device::WaitContext& ctx, uint64_t seq,
                              int warp, int lane) {
  const CommContext& c = p.comm;
  const int R = c.num_ranks, me = c.rank, K = p.num_topk, S = p.num_scales;
  const DispatchRow row = DispatchRow::make(p.hidden_bytes, S, K);
  const int n16 = p.hidden_bytes / 16;
  const int cap = p.num_worst_tokens;
  const bool with_meta = p.topk_idx != nullptr;
  const int first = blockIdx.x * p.num_send_warps + warp;
  const int stride = gridDim.x * p.num_send_warps;
  const int local_base = p.recv_prefix[me];
  const uint64_t* entered =
      reinterpret_cast<const uint64_t*>(c.buffers.ptr[me] + c.layout.entered_offset);
  uint32_t ready = 1u << me;  // peers known to have entered this sequence

  for (int t = first; t < p.num_tokens; t += stride) {
    const int pos = lane < R ? p.send_pos[size_t(t) * R + lane] : -1;
    const uint32_t dest_mask = __ballot_sync(kFull, pos >= 0);
    if (dest_mask == 0) continue;
    const uint32_t need = dest_mask & ~ready;
    if (need != 0) {
      bool ok = true;
      if ((need >> lane) & 1u)
        ok = device::spin_wait(ctx, lane, [&] { return device::ld_acquire_sys(entered + lane) >= seq; });
      if (!__all_sync(kFull, ok)) return;
      ready |= need;
    }

    // Destination rows: recv_x for ourselves, the peer's buffer slot otherwise.
    char* dst[kMaxRanks];
    int local_row = -1;
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) {
      const int slot = __shfl_sync(kFull, pos, d);
      dst[d] = nullptr;
      if (d < R && slot >= 0) {
        if (d == me) {
          const int r = local_base + slot;
          if (cap == 0 || r < cap) {
            local_row = r;
            dst[d] = static_cast<char*>(p.recv_x) + size_t(r) * p.hidden_bytes;
          }
        } else {
          dst[d] = c.buffers.ptr[d] + c.layout.dispatch_offset +
                   c.layout.region_index(me, d) * c.layout.dispatch_region_bytes +
                   size_t(slot) * row.stride;
        }
      }
    }

    copy_row_multi(reinterpret_cast<const int4*>(static_cast<const char*>(p.x) +
                                                 size_t(t) * p.hidden_bytes),
                   n16, dst, lane);

    for (int j = lane; j < S; j += 32) {
      const float v = p.scales[size_t(t) * S + j];
#pragma unroll
      for (int d = 0; d < kMaxRanks; ++d) {
        if (dst[d] == nullptr) continue;
        if (d == me)
          p.recv_scales[size_t(local_row) * S + j] = v;
        else
          reinterpret_cast<float*>(dst[d] + row.scales_offset)[j] = v;
      }
    }

    if (with_meta) {
      long long idx = -1;
      float w = 0.0f;
      if (lane < K) {
        idx = load_idx(p.topk_idx, size_t(t) * K + lane, p.idx_bytes);
        if (p.topk_weights != nullptr) w = p.topk_weights[size_t(t) * K + lane];
      }
#pragma unroll
      for (int d = 0; d < kMaxRanks; ++d) {
        if (dst[d] == nullptr) continue;
        const long long lo = static_cast<long long>(d) * p.experts_per_rank;
        const int local_idx = (idx >= lo && idx < lo + p.experts_per_rank) ? int(idx - lo) : -1;
        const float local_w = local_idx >= 0 ? w : 0.0f;
        if (d == me) {
          if (lane < K && p.recv_topk_idx != nullptr) {
            store_idx(p.recv_topk_idx, size_t(local_row) * K + lane, p.idx_bytes, local_idx);
            if (p.recv_topk_weights != nullptr)
              p.recv_topk_weights[size_t(local_row) * K + lane] = local_w;
          }
          if (lane == 0) {
            if (p.recv_src_idx != nullptr) p.recv_src_idx[local_row] = t;
            if (p.recv_src_rank != nullptr) p.recv_src_rank[local_row] = me;
          }
        } else {
          char* meta = dst[d] + row.meta_offset;
          if (lane < K) {
            reinterpret_cast<int*>(meta + 16)[lane] = local_idx;
            reinterpret_cast<float*>(meta + 16 + 4 * K)[lane] = local_w;
          }
          if (lane == 0) reinterpret_cast<int*>(meta + 8)[0] = t;
        }
      }
    }

    // Publish the remote rows: one system-scope fence covers the whole warp's stores.
    __syncwarp();
    const uint32_t remote = dest_mask & ~(1u << me);
    if (lane == 0 && remote != 0) {
      device::fence_acq_rel_sys();
#pragma unroll
      for (int d = 0; d < kMaxRanks; ++d)
        if (((remote >> d) & 1u) && dst[d] != nullptr)
          device::st_relaxed_sys(reinterpret_cast<uint64_t*>(dst[d] + row.meta_offset), seq);
    }
  }
}

__device__ void dispatch_recv(const DispatchParams& p, const device::WaitContext& ctx, uint64_t seq,
                              int warp, int lane) {
  const CommContext& c = p.comm;
  const int R = c.num_ranks, me = c.rank, K = p.num_topk, S = p.num_scales;
  const DispatchRow row = DispatchRow::make(p.hidden_bytes, S, K);
  const int n16 = p.hidden_bytes / 16;
  const int cap = p.num_worst_tokens;
  const int num_recv_warps = kIntranodeThreads / 32 - p.num_send_warps;
  const int first = blockIdx.x * num_recv_warps + (warp - p.num_send_warps);
  const int stride = gridDim.x * num_recv_warps;
  const int prefix = lane <= R ? p.recv_prefix[lane] : 0;  // lane s: first row of source s
  const int total = __shfl_sync(kFull, prefix, R);

  // Worst-case mode: fill the padding rows first (their values are known before any arrival).
  if (cap > 0) {
    for (int r = total + first; r < cap; r += stride) {
      int4* out = reinterpret_cast<int4*>(static_cast<char*>(p.recv_x) + size_t(r) * p.hidden_bytes);
      for (int i = lane; i < n16; i += 32) device::st_v4(out + i, make_int4(0, 0, 0, 0));
      if (p.recv_scales != nullptr)
        for (int j = lane; j < S; j += 32) p.recv_scales[size_t(r) * S + j] = 0.0f;
      if (p.recv_topk_idx != nullptr && lane < K) {
        store_idx(p.recv_topk_idx, size_t(r) * K + lane, p.idx_bytes, -1);
        if (p.recv_topk_weights != nullptr) p.recv_topk_weights[size_t(r) * K + lane] = 0.0f;
      }
      if (lane == 0) {
        if (p.recv_src_idx != nullptr) p.recv_src_idx[r] = -1;
        if (p.recv_src_rank != nullptr) p.recv_src_rank[r] = -1;
      }
    }
  }

  int max_count = 0;
  for (int s = 0; s < R; ++s) {
    const int n = __shfl_sync(kFull, prefix, s + 1) - __shfl_sync(kFull, prefix, s);
    if (s != me) max_count = max(max_count, n);
  }
  const char* area = c.buffers.ptr[me] + c.layout.dispatch_offset;
  for (int i = first; i < max_count; i += stride) {
    for (int k = 1; k < R; ++k) {
      const int src = (me + k) % R;
      const int base = __shfl_sync(kFull, prefix, src);
      const int count = __shfl_sync(kFull, prefix, src + 1) - base;
      if (i >= count) continue;
      const char* in = area + c.layout.region_index(src, me) * c.layout.dispatch_region_bytes +
                       size_t(i) * row.stride;
      bool ok = true;
      if (lane == 0) {
        const uint64_t* flag = reinterpret_cast<const uint64_t*>(in + row.meta_offset);
        ok = device::spin_wait(ctx, src, [&] { return device::ld_acquire_sys(flag) == seq; });
      }
      if (!__shfl_sync(kFull, ok, 0)) return;
      __syncwarp();  // lane 0's acquire orders the other lanes' payload reads
      const int r = base + i;
      if (cap > 0 && r >= cap) continue;  // overflow: reported by notify, nothing written
      copy_row(reinterpret_cast<const int4*>(in),
               reinterpret_cast<int4*>(static_cast<char*>(p.recv_x) + size_t(r) * p.hidden_bytes),
               n16, lane);
      if (p.recv_scales != nullptr) {
        const float* sc = reinterpret_cast<const float*>(in + row.scales_offset);
        for (int j = lane; j < S; j += 32) p.recv_scales[size_t(r) * S + j] = sc[j];
      }
      const char* meta = in + row.meta_offset;
      if (p.recv_topk_idx != nullptr && lane < K) {
        store_idx(p.recv_topk_idx, size_t(r) * K + lane, p.idx_bytes,
                  reinterpret_cast<const int*>(meta + 16)[lane]);
        if (p.recv_topk_weights != nullptr)
          p.recv_topk_weights[size_t(r) * K + lane] =
              reinterpret_cast<const float*>(meta + 16 + 4 * K)[lane];
      }
      if (lane == 0) {
        if (p.recv_src_idx != nullptr) p.recv_src_idx[r] = reinterpret_cast<const int*>(meta + 8)[0];
        if (p.recv_src_rank != nullptr) p.recv_src_rank[r] = src;
      }
    }
  }
}

__global__ void __launch_bounds__(kIntranodeThreads, 1) intranode_dispatch_kernel(DispatchParams p) {
  __shared__ uint64_t s_seq;
  const CommContext& c = p.comm;
  const int me = c.rank, R = c.num_ranks;
  const int warp = threadIdx.x / 32, lane = device::lane_id();
  ControlBlock* ctrl = reinterpret_cast<ControlBlock*>(c.buffers.ptr[me]);
  if (threadIdx.x == 0) s_seq = device::read_sequence(ctrl);
  __syncthreads();
  const uint64_t seq = s_seq;
  const device::WaitContext ctx{ctrl, c.error, c.timeout_cycles,
                                p.topk_idx != nullptr ? kOpDispatch : kOpCachedDispatch, me};
  // Tell every peer we have entered this sequence (so finished all earlier kernels).
  if (blockIdx.x == 0 && threadIdx.x < R && int(threadIdx.x) != me)
    device::st_release_sys(
        reinterpret_cast<uint64_t*>(c.buffers.ptr[threadIdx.x] + c.layout.entered_offset) + me, seq);

  if (!device::aborted(ctx)) {
    if (warp < p.num_send_warps)
      dispatch_send(p, ctx, seq, warp, lane);
    else
      dispatch_recv(p, ctx, seq, warp, lane);
  }
  // Block 0 also sees every peer enter, even peers it sent nothing to: each kernel then waits on
  // every peer, which the notify slots' parity scheme relies on.
  if (blockIdx.x == 0 && warp == 0) {
    const uint64_t* entered =
        reinterpret_cast<const uint64_t*>(c.buffers.ptr[me] + c.layout.entered_offset);
    if (lane < R && lane != me && !device::aborted(ctx))
      device::spin_wait(ctx, lane, [&] { return device::ld_acquire_sys(entered + lane) >= seq; });
  }
  __syncthreads();
  if (threadIdx.x == 0) device::finish_block(ctrl, seq);
}

}  // namespace

cudaError_t launch_intranode_dispatch(const DispatchParams& p, int num_sms, cudaStream_t stream) {
  intranode_dispatch_kernel<<<num_sms, kIntranodeThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace ep
