// Local row-copy probe: how fast can B SMs with W copying warps each move rows within one GPU?
// The HT dispatch at one rank is such a copy (every row to its own outputs); its kernel reaches
// ~400 GB/s of rows with 24 SMs on one H100. This prints what plain warp-per-row copies reach
// with the same grid, to tell the kernel's own costs from the SMs' limit:
//   reg     one warp per row, 16-byte register loads (8 in flight per lane) then stores
//   claim   as reg, rows claimed one at a time from a global counter (an atomic per row)
//   staged  one warp per row, the next row staged in shared memory by cp.async while the
//           current one is stored (the FP8 senders' method), rows claimed as above
//   +side   staged, plus each row's scales, top-k ids, weights, source index and rank loaded
//           one row ahead and stored into five arrays, as the dispatch does
//   +packed as +side, the side data stored as one 336-byte record per row
// Build: nvcc -O3 -arch=sm_90a -Inative -o build/local_copy_probe
// benchmarks/probes/local_copy_probe.cu Run:   build/local_copy_probe [row_bytes=7168] [rows=4096]
// [blocks=24] [warps=10]
#include <algorithm>
#include <vector>

#include "common/ptx.cuh"
#include "probe_util.cuh"

// The dispatch's own load, store and cp.async helpers, so the probe issues its instructions.
using ep::ptx::cp_async_16;
using ep::ptx::cp_async_commit;
using ep::ptx::cp_async_wait;
using ep::ptx::ld_nc_v4_l2_prefetch_256b;
using ep::ptx::st_v4_no_l1_allocate;

__device__ __forceinline__ void copy_row(const int4* src, int4* dst, int n16, int lane) {
  constexpr int U = 8;
  for (int i = lane; i < n16; i += 32 * U) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + 32 * u < n16) v[u] = ld_nc_v4_l2_prefetch_256b(src + i + 32 * u);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + 32 * u < n16) st_v4_no_l1_allocate(dst + i + 32 * u, v[u]);
  }
}

// mode 0: static rows (warp g takes g, g + G, ...); 1: claimed from *counter.
template <int kMode>
__global__ void copy_rows(const char* src, char* dst, int rows, int row_bytes, int warps,
                          unsigned* counter) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= warps) return;
  const int G = gridDim.x * warps, n16 = row_bytes / 16;
  int r = blockIdx.x * warps + warp;
  while (r < rows) {
    int next = r + G;
    if (kMode == 1) {
      int c = 0;
      if (lane == 0) c = static_cast<int>(atomicAdd(counter, 1u)) + G;
      next = __shfl_sync(0xffffffffu, c, 0);
    }
    copy_row(reinterpret_cast<const int4*>(src + size_t(r) * row_bytes),
             reinterpret_cast<int4*>(dst + size_t(r) * row_bytes), n16, lane);
    r = next;
  }
}

// Side data of a row as the dispatch writes it: scales (56 floats), 8 top-k ids (int64),
// 8 weights, the source index and rank, loaded one row ahead.
struct Side {
  const float* scales_in;
  const long long* idx_in;
  const float* w_in;
  float* scales_out;
  long long* idx_out;
  float* w_out;
  int* src_out;
  int* rank_out;
  char* packed_out;
};

// Staged copy: kSide 0 rows only; 1 with side data in five arrays; 2 with it packed into one
// 336-byte record per row.
enum SideMode : int { kNoSide = 0, kSideArrays = 1, kSidePacked = 2 };
template <int kSide>
__global__ void copy_rows_staged(const char* src, char* dst, int rows, int row_bytes, int warps,
                                 unsigned* counter, Side sd) {
  extern __shared__ int4 smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= warps) return;
  const int G = gridDim.x * warps, n16 = row_bytes / 16;
  int4* stage = smem + size_t(warp) * 2 * n16;
  auto prefetch = [&](int r, int buf) {
    if (r < rows) {
      const int4* s = reinterpret_cast<const int4*>(src + size_t(r) * row_bytes);
      for (int i = lane; i < n16; i += 32) cp_async_16(stage + buf * n16 + i, s + i);
    }
    cp_async_commit();
  };
  struct In {
    float sc0 = 0, sc1 = 0, w = 0;
    long long idx = -1;
  };
  auto load = [&](int r) {
    In in;
    if (kSide == kNoSide || r >= rows) return in;
    in.sc0 = sd.scales_in[size_t(r) * 56 + lane];
    if (lane < 24) in.sc1 = sd.scales_in[size_t(r) * 56 + 32 + lane];
    if (lane < 8) {
      in.idx = sd.idx_in[size_t(r) * 8 + lane];
      in.w = sd.w_in[size_t(r) * 8 + lane];
    }
    return in;
  };
  auto claim = [&]() {
    int c = 0;
    if (lane == 0) c = static_cast<int>(atomicAdd(counter, 1u)) + 2 * G;
    return __shfl_sync(0xffffffffu, c, 0);
  };
  int r = blockIdx.x * warps + warp;
  int r_next = r + G;
  prefetch(r, 0);
  In cur = load(r);
  for (int k = 0; r < rows; ++k) {
    prefetch(r_next, (k + 1) & 1);
    const In nxt = load(r_next);
    cp_async_wait<1>();
    const int4* in = stage + (k & 1) * n16;
    int4* out = reinterpret_cast<int4*>(dst + size_t(r) * row_bytes);
    for (int i = lane; i < n16; i += 32) st_v4_no_l1_allocate(out + i, in[i]);
    if (kSide == kSidePacked) {
      char* rec = sd.packed_out + size_t(r) * 336;
      reinterpret_cast<float*>(rec)[lane] = cur.sc0;
      if (lane < 24) reinterpret_cast<float*>(rec)[32 + lane] = cur.sc1;
      if (lane < 8) {
        reinterpret_cast<long long*>(rec + 224)[lane] = cur.idx;
        reinterpret_cast<float*>(rec + 288)[lane] = cur.w;
      }
      if (lane == 0) reinterpret_cast<int2*>(rec + 320)[0] = make_int2(r, 0);
    } else if (kSide == kSideArrays) {
      sd.scales_out[size_t(r) * 56 + lane] = cur.sc0;
      if (lane < 24) sd.scales_out[size_t(r) * 56 + 32 + lane] = cur.sc1;
      if (lane < 8) {
        sd.idx_out[size_t(r) * 8 + lane] = cur.idx;
        sd.w_out[size_t(r) * 8 + lane] = cur.w;
      }
      if (lane == 0) {
        sd.src_out[r] = r;
        sd.rank_out[r] = 0;
      }
    }
    const int after = r_next < rows ? claim() : rows;
    r = r_next;
    r_next = after;
    cur = nxt;
  }
  cp_async_wait<0>();
}

int main(int argc, char** argv) {
  const int row_bytes = argc > 1 ? std::atoi(argv[1]) : 7168;
  const int rows = argc > 2 ? std::atoi(argv[2]) : 4096;
  const int blocks = argc > 3 ? std::atoi(argv[3]) : 24;
  const int warps = argc > 4 ? std::atoi(argv[4]) : 10;
  const size_t bytes = size_t(rows) * row_bytes;
  char *src, *dst, *flush;
  unsigned* counter;
  const size_t flush_bytes = size_t(256) << 20;
  CK(cudaMalloc(&src, bytes));
  CK(cudaMalloc(&dst, bytes));
  CK(cudaMalloc(&flush, flush_bytes));
  CK(cudaMalloc(&counter, sizeof(unsigned)));
  CK(cudaMemset(src, 1, bytes));
  const size_t smem = size_t(warps) * 2 * row_bytes;
  for (const void* k : {reinterpret_cast<const void*>(copy_rows_staged<kNoSide>),
                        reinterpret_cast<const void*>(copy_rows_staged<kSideArrays>),
                        reinterpret_cast<const void*>(copy_rows_staged<kSidePacked>)})
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            static_cast<int>(smem)));
  Side sd{};
  {
    char* side;
    const size_t n = size_t(rows);
    CK(cudaMalloc(&side, n * (224 + 64 + 32) * 2 + n * 8 + n * 336 + (8 << 10)));
    char* q = side;
    auto take = [&](size_t b) {
      char* at = q;
      q += (b + 255) / 256 * 256;
      return at;
    };
    sd.scales_in = reinterpret_cast<float*>(take(n * 224));
    sd.idx_in = reinterpret_cast<long long*>(take(n * 64));
    sd.w_in = reinterpret_cast<float*>(take(n * 32));
    sd.scales_out = reinterpret_cast<float*>(take(n * 224));
    sd.idx_out = reinterpret_cast<long long*>(take(n * 64));
    sd.w_out = reinterpret_cast<float*>(take(n * 32));
    sd.src_out = reinterpret_cast<int*>(take(n * 4));
    sd.rank_out = reinterpret_cast<int*>(take(n * 4));
    sd.packed_out = take(n * 336);
  }
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto time = [&](int mode) {
    std::vector<double> v;
    for (int i = 0; i < 25; ++i) {
      CK(cudaMemset(flush, i, flush_bytes));
      CK(cudaMemset(counter, 0, sizeof(unsigned)));
      CK(cudaEventRecord(e0));
      if (mode == 0)
        copy_rows<0><<<blocks, 512>>>(src, dst, rows, row_bytes, warps, counter);
      else if (mode == 1)
        copy_rows<1><<<blocks, 512>>>(src, dst, rows, row_bytes, warps, counter);
      else if (mode == 2)
        copy_rows_staged<kNoSide>
            <<<blocks, 512, smem>>>(src, dst, rows, row_bytes, warps, counter, sd);
      else if (mode == 3)
        copy_rows_staged<kSideArrays>
            <<<blocks, 512, smem>>>(src, dst, rows, row_bytes, warps, counter, sd);
      else
        copy_rows_staged<kSidePacked>
            <<<blocks, 512, smem>>>(src, dst, rows, row_bytes, warps, counter, sd);
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (i >= 5) v.push_back(ms * 1e3);
    }
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("local copy: %d rows x %d B (%.1f MB), %d blocks x %d warps\n", rows, row_bytes,
              bytes / 1e6, blocks, warps);
  const char* names[5] = {"reg", "claim", "staged", "+side", "+packed"};
  for (int round = 0; round < 2; ++round)
    for (int mode = 0; mode < 5; ++mode) {
      const double us = time(mode);
      std::printf("  %-7s %8.1f us  %7.1f GB/s of rows  %5.1f GB/s per SM\n", names[mode], us,
                  bytes / us * 1e-3, bytes / us * 1e-3 / blocks);
    }
  return 0;
}
