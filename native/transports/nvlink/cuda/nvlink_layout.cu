// Dispatch layout: from topk_idx [T, K] compute, on this rank only (no communication),
//   num_tokens_per_rank[r]   tokens with at least one expert on rank r,
//   num_tokens_per_expert[e] (t, k) entries equal to e,
//   is_token_in_rank[t, r],
//   send_pos[t, r]           rank of t among the tokens sent to r (-1 if t is not sent to r).
// Tokens go in chunks of blockDim. Per chunk the block first reads the chunk's ids coalesced
// (thread i takes flat entries i, i + blockDim, ...; many loads in flight), counting experts and
// OR-ing rank bits into a per-token shared mask; then thread i owns token i of the chunk: a warp
// ballot per rank gives in-warp positions and a shared-memory pass over the warp totals gives the
// chunk positions. send_pos is an exclusive scan over tokens, so chunk positions need the totals
// of the chunks before:
//  * with a workspace, one block per chunk (all run at once): each block publishes its per-rank
//    totals and expert counts, tagged with the launch's epoch, and adds up those of the blocks
//    before it; the last block also sums every block's counts into the outputs;
//  * without, one block walks the chunks and carries running totals.
// Out-of-range expert ids (< -1 or >= E) are reported in the error record and treated as -1.
#include "common/dynamic_smem.hpp"
#include "transports/nvlink/cuda/nvlink_device.cuh"
#include "transports/nvlink/cuda/nvlink_kernels.hpp"

#include <atomic>

namespace ep {
namespace {

constexpr int kLayoutThreads = 1024;
constexpr int kLayoutWarps = kLayoutThreads / 32;
constexpr int kLoads = 8;  // ids in flight per thread

__device__ __forceinline__ void report_error(const LayoutParams& p, int code, long long a,
                                             long long b) {
  if (atomicCAS(&p.ctrl->error_lock, 0, 1) == 0) {
    volatile ErrorRecord* err = p.error;
    err->op = kOpLayout;
    err->rank = p.rank;
    err->peer = -1;
    err->value_a = a;
    err->value_b = b;
    __threadfence_system();
    err->code = code;
    __threadfence_system();
  }
}

// What a block publishes in the workspace: [max blocks] x Published, then [blocks][E] counts.
struct Published {
  uint64_t epoch;         // written last (release): the fields below are this launch's
  int totals[kMaxRanks];  // tokens of this block's chunk sent to each rank
  int pad[6];
};
static_assert(sizeof(Published) == 64, "one published record per 64 bytes");
constexpr int kMaxLayoutBlocks = 128;  // all resident at once (one 1,024-thread block per SM)
constexpr long long kWaitCycles = 1ll << 33;  // ~4 s: a block waiting for an earlier one

__global__ void __launch_bounds__(kLayoutThreads, 1) nvlink_layout_kernel(LayoutParams p) {
  extern __shared__ int expert_hist[];             // [E]
  __shared__ uint32_t token_mask[kLayoutThreads];  // ranks of each token of the chunk
  __shared__ int warp_count[kLayoutWarps][kMaxRanks];
  __shared__ int warp_offset[kLayoutWarps][kMaxRanks];
  __shared__ int running[kMaxRanks];  // tokens sent to each rank before the current chunk
  __shared__ int chunk_total[kMaxRanks];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int R = p.num_ranks, K = p.num_topk, E = p.num_experts;
  const int experts_per_rank = E / R;
  const bool split = gridDim.x > 1;  // one chunk per block (workspace) or one block for all
  Published* published = static_cast<Published*>(p.workspace);
  int* block_hist = reinterpret_cast<int*>(published + kMaxLayoutBlocks);  // [blocks][E]
  for (int e = tid; e < E; e += kLayoutThreads) expert_hist[e] = 0;
  if (tid < kMaxRanks) running[tid] = 0;
  token_mask[tid] = 0;
  __syncthreads();

  const uint32_t lane_mask_lt = (1u << lane) - 1u;
  const int chunk_stride = split ? p.num_tokens : kLayoutThreads;  // split: one chunk per block
  for (int base = blockIdx.x * kLayoutThreads; base < p.num_tokens; base += chunk_stride) {
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
          if (!p.ignore_invalid) {
            report_error(p, kErrorInvalidTopkIdx, idx, static_cast<long long>(flat0 + j));
          }
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
      warp_offset[lane][r] = incl - c;
      if (lane == 31) chunk_total[r] = incl;
    }
    __syncthreads();
    if (split) {
      // 3. Publish this chunk's totals and counts, then add up the chunks before it.
      const int b = blockIdx.x;
      if (tid < R) published[b].totals[tid] = chunk_total[tid];
      for (int e = tid; e < E; e += kLayoutThreads) block_hist[size_t(b) * E + e] = expert_hist[e];
      __syncthreads();
      if (tid == 0) {
        __threadfence();
        ptx::st_release_gpu(&published[b].epoch, p.epoch);
      }
      // The last block waits for every other block (it sums their counts below); the others
      // for the blocks before them. They all run at once, so nobody waits forever.
      if (tid < b) {
        const long long start = clock64();
        while (ptx::ld_acquire_gpu(&published[tid].epoch) != p.epoch) {
          __nanosleep(32);
          if (clock64() - start > kWaitCycles) {  // cannot happen while all blocks are resident
            report_error(p, kErrorTimeout, tid, kWaitCycles);
            break;
          }
        }
      }
      __syncthreads();
      if (tid < R) {
        int before = 0;
        for (int q = 0; q < b; ++q) before += ptx::ld_relaxed_gpu(&published[q].totals[tid]);
        running[tid] = before;
      }
      __syncthreads();
    }
    if (t < p.num_tokens) {
      for (int r = 0; r < R; ++r) {
        const bool in = (rank_mask >> r) & 1u;
        p.is_token_in_rank[size_t(t) * R + r] = in;
        if (p.send_pos != nullptr)
          p.send_pos[size_t(t) * R + r] =
              in ? running[r] + warp_offset[warp][r] + in_warp_pos[r] : -1;
      }
    }
    __syncthreads();  // warp_count/warp_offset/running are reused by the next chunk
    if (!split && tid < R) running[tid] += chunk_total[tid];
    __syncthreads();
  }
  if (!split) {
    if (tid < R) p.num_tokens_per_rank[tid] = running[tid];
    for (int e = tid; e < E; e += kLayoutThreads) p.num_tokens_per_expert[e] = expert_hist[e];
    return;
  }
  if (blockIdx.x != gridDim.x - 1) return;
  // The last block saw every block's record: the totals are its prefix plus its own chunk.
  if (tid < R) p.num_tokens_per_rank[tid] = running[tid] + chunk_total[tid];
  for (int e = tid; e < E; e += kLayoutThreads) {
    int n = expert_hist[e];
    for (int q = 0; q + 1 < int(gridDim.x); ++q)
      n += ptx::ld_relaxed_gpu(&block_hist[size_t(q) * E + e]);
    p.num_tokens_per_expert[e] = n;
  }
}

}  // namespace

cudaError_t preload_nvlink_layout() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, nvlink_layout_kernel);
}

size_t nvlink_layout_workspace_bytes(int num_tokens, int num_experts) {
  const int blocks = (num_tokens + kLayoutThreads - 1) / kLayoutThreads;
  if (blocks <= 1 || blocks > kMaxLayoutBlocks) return 0;
  return sizeof(Published) * kMaxLayoutBlocks + sizeof(int) * size_t(blocks) * num_experts;
}

cudaError_t launch_nvlink_layout(LayoutParams p, cudaStream_t stream) {
  static std::atomic<unsigned long long> epochs{0};
  p.epoch = ++epochs;  // unique per launch in this process: stale records never match
  const size_t smem = size_t(p.num_experts) * sizeof(int);
  static std::atomic<size_t> allowed[64];
  const cudaError_t e = allow_dynamic_smem(nvlink_layout_kernel, smem, allowed);
  if (e != cudaSuccess) return e;
  const bool split =
      p.workspace != nullptr && nvlink_layout_workspace_bytes(p.num_tokens, p.num_experts) > 0;
  const int blocks = split ? (p.num_tokens + kLayoutThreads - 1) / kLayoutThreads : 1;
  nvlink_layout_kernel<<<blocks, kLayoutThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace ep
