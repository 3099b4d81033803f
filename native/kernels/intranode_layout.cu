// Dispatch layout: from topk_idx [T, K] compute, on this rank only (no communication),
//   num_tokens_per_rank[r]   tokens with at least one expert on rank r,
//   num_tokens_per_expert[e] (t, k) entries equal to e,
//   is_token_in_rank[t, r],
//   send_pos[t, r]           rank of t among the tokens sent to r (-1 if t is not sent to r).
// send_pos is an exclusive scan over tokens, so the kernel is one block walking the tokens in
// chunks of blockDim. Per chunk the block first reads the chunk's ids coalesced (thread i takes
// flat entries i, i + blockDim, ...; many loads in flight), counting experts and OR-ing rank bits
// into a per-token shared mask; then thread i owns token i of the chunk: a warp ballot per rank
// gives in-warp positions, a shared-memory pass over the warp totals gives the chunk positions,
// and running totals carry across chunks.
// Out-of-range expert ids (< -1 or >= E) are reported in the error record and treated as -1.
#include "intranode_kernels.hpp"
#include "ptx_utils.cuh"

namespace ep {
namespace {

constexpr int kLayoutThreads = 1024;
constexpr int kLayoutWarps = kLayoutThreads / 32;
constexpr int kLoads = 8;  // ids in flight per thread

__device__ __forceinline__ void report_invalid(const LayoutParams& p, long long idx, size_t flat) {
  if (atomicCAS(&p.ctrl->error_lock, 0, 1) == 0) {
    volatile ErrorRecord* err = p.error;
    err->op = kOpLayout;
    err->rank = p.rank;
    err->peer = -1;
    err->value_a = idx;
    err->value_b = static_cast<long long>(flat);
    __threadfence_system();
    err->code = kErrorInvalidTopkIdx;
    __threadfence_system();
  }
}

__global__ void __launch_bounds__(kLayoutThreads, 1) intranode_layout_kernel(LayoutParams p) {
  extern __shared__ int expert_hist[];             // [E]
  __shared__ uint32_t token_mask[kLayoutThreads];  // ranks of each token of the chunk
  __shared__ int warp_count[kLayoutWarps][kMaxRanks];
  __shared__ int warp_offset[kLayoutWarps][kMaxRanks];
  __shared__ int running[kMaxRanks];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int R = p.num_ranks, K = p.num_topk, E = p.num_experts;
  const int experts_per_rank = E / R;
  for (int e = tid; e < E; e += kLayoutThreads) expert_hist[e] = 0;
  if (tid < kMaxRanks) running[tid] = 0;
  token_mask[tid] = 0;
  __syncthreads();

  const uint32_t lane_mask_lt = (1u << lane) - 1u;
  for (int base = 0; base < p.num_tokens; base += kLayoutThreads) {
    // 1. The chunk's ids, coalesced, kLoads in flight per thread.
    const size_t flat0 = size_t(base) * K;
    const int num_flat = min(kLayoutThreads, p.num_tokens - base) * K;
    for (int j0 = tid; j0 < num_flat; j0 += kLayoutThreads * kLoads) {
      long long v[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int j = j0 + u * kLayoutThreads;
        v[u] = -1;
        if (j < num_flat)
          v[u] = p.idx_bytes == 8 ? static_cast<const long long*>(p.topk_idx)[flat0 + j]
                                  : static_cast<const int*>(p.topk_idx)[flat0 + j];
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int j = j0 + u * kLayoutThreads;
        const long long idx = v[u];
        if (idx < -1 || idx >= E) {
          report_invalid(p, idx, flat0 + j);
          continue;
        }
        if (idx < 0) continue;
        atomicAdd(&expert_hist[idx], 1);
        atomicOr(&token_mask[j / K], 1u << (static_cast<int>(idx) / experts_per_rank));
      }
    }
    __syncthreads();
    const int t = base + tid;
    const uint32_t rank_mask = token_mask[tid];
    // 2. Position of this token among this chunk's tokens sent to each rank.
    int in_warp_pos[kMaxRanks];
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) {
      if (r < R) {
        const uint32_t ballot = __ballot_sync(0xffffffffu, (rank_mask >> r) & 1u);
        in_warp_pos[r] = __popc(ballot & lane_mask_lt);
        if (lane == 0) warp_count[warp][r] = __popc(ballot);
      }
    }
    token_mask[tid] = 0;  // only this thread reads it; the next chunk ORs after __syncthreads
    __syncthreads();
    if (warp < R) {  // warp r scans the warp totals of rank r
      const int r = warp;
      const int c = warp_count[lane][r];
      int incl = c;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += v;
      }
      warp_offset[lane][r] = running[r] + incl - c;
      __syncwarp();
      const int chunk_total = __shfl_sync(0xffffffffu, incl, 31);
      if (lane == 0) running[r] += chunk_total;  // read by nobody until the next __syncthreads
    }
    __syncthreads();
    if (t < p.num_tokens) {
      for (int r = 0; r < R; ++r) {
        const bool in = (rank_mask >> r) & 1u;
        p.is_token_in_rank[size_t(t) * R + r] = in;
        if (p.send_pos != nullptr)
          p.send_pos[size_t(t) * R + r] = in ? warp_offset[warp][r] + in_warp_pos[r] : -1;
      }
    }
    __syncthreads();  // warp_count/warp_offset are reused by the next chunk
  }
  if (tid < R) p.num_tokens_per_rank[tid] = running[tid];
  for (int e = tid; e < E; e += kLayoutThreads) p.num_tokens_per_expert[e] = expert_hist[e];
}

}  // namespace

cudaError_t preload_intranode_layout() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, intranode_layout_kernel);
}

cudaError_t launch_intranode_layout(const LayoutParams& p, cudaStream_t stream) {
  const size_t smem = size_t(p.num_experts) * sizeof(int);
  if (smem > 48 * 1024) {
    cudaError_t e =
        cudaFuncSetAttribute(intranode_layout_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  intranode_layout_kernel<<<1, kLayoutThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace ep
