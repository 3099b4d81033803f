// Copy-engine dispatch probe (2 GPUs, both directions at once): each GPU copies its whole x
// (T rows) into the peer's bulk region with cudaMemcpyAsync in C chunks on a side stream, each
// chunk followed by cuStreamWriteValue64 of a per-iteration value into the peer's chunk flag.
// On the main stream a 24 x 512 "receiver" kernel waits for each chunk's flag and copies the rows
// of the bulk region it received into recv_x (the gather dispatch receivers would do).
// Build: nvcc -O3 -arch=sm_90a -o build/ce_dispatch_probe scripts/ce_dispatch_probe.cu
// Run:   build/ce_dispatch_probe [row bytes = 14336]   (2 GPUs with peer access)
// nvidia-h200-x2 (2026-11-23), 4096 rows of 14,336 B: one copy 166.0 us (both directions at
// once), 4 chunks 188.8, 16 chunks 250.7 (each chunk adds ~5-6 us); with the gather 213.7 at
// best (4 chunks). The SM dispatch kernel moves the same rows in ~195 us: not a way forward.
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "probe_util.cuh"
typedef CUresult (*WriteValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
__device__ __forceinline__ unsigned long long ld_acq(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__global__ void spin(long long cyc) {
  long long t0 = clock64();
  while (clock64() - t0 < cyc) {
  }
}
__global__ void __launch_bounds__(512, 1)
    gather(const char* bulk, char* out, int rows, int row_bytes, int rows_per_chunk,
           const unsigned long long* flags, unsigned long long v, int skip_wait) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32,
            warps = gridDim.x * blockDim.x / 32;
  // chunk-major: warps sweep rows in order so early chunks are copied first
  for (int r = warp; r < rows; r += warps) {
    if (!skip_wait) {
      if (lane == 0) {
        const unsigned long long* f = flags + r / rows_per_chunk;
        while (ld_acq(f) != v) {
        }
      }
      __syncwarp();
    }
    const int4* s = reinterpret_cast<const int4*>(bulk + size_t(r) * row_bytes);
    int4* d = reinterpret_cast<int4*>(out + size_t(r) * row_bytes);
    const int n16 = row_bytes / 16;
    for (int i = lane; i < n16; i += 32 * 8) {
      int4 t[8];
#pragma unroll
      for (int u = 0; u < 8; ++u)
        if (i + 32 * u < n16) t[u] = s[i + 32 * u];
#pragma unroll
      for (int u = 0; u < 8; ++u)
        if (i + 32 * u < n16) d[i + 32 * u] = t[u];
    }
  }
}
int main(int argc, char** argv) {
  const int T = 4096;
  const int row = argc > 1 ? atoi(argv[1]) : 14336;
  const size_t bytes = size_t(T) * row;
  WriteValue64 wv = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", (void**)&wv, 12000, cudaEnableDefault,
                                      &q));
  if (!wv) {
    printf("no cuStreamWriteValue64\n");
    return 1;
  }
  char *x[2], *bulk[2], *out[2];
  unsigned long long* flags[2];
  cudaStream_t st[2], side[2];
  cudaEvent_t e0[2], e1[2], fork[2], join[2];
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(d));
    cudaDeviceEnablePeerAccess(1 - d, 0);
    CK(cudaMalloc(&x[d], bytes));
    CK(cudaMalloc(&bulk[d], bytes));
    CK(cudaMalloc(&out[d], bytes));
    CK(cudaMalloc(&flags[d], 4096 * 8));
    CK(cudaMemset(flags[d], 0, 4096 * 8));
    CK(cudaMemset(x[d], d + 1, bytes));
    CK(cudaStreamCreateWithFlags(&st[d], cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&side[d], cudaStreamNonBlocking));
    CK(cudaEventCreate(&e0[d]));
    CK(cudaEventCreate(&e1[d]));
    CK(cudaEventCreateWithFlags(&fork[d], cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&join[d], cudaEventDisableTiming));
  }
  unsigned long long v = 0;
  for (int mode = 0; mode < 3; ++mode)  // 0: CE only; 1: CE + gather; 2: gather only (no wait)
    for (int chunks : {1, 4, 8, 16, 32, 64}) {
      if (mode == 2 && chunks > 1) continue;
      std::vector<double> tm[2];
      for (int it = 0; it < 12; ++it) {
        ++v;
        for (int d = 0; d < 2; ++d) {
          CK(cudaSetDevice(d));
          spin<<<1, 32, 0, st[d]>>>(400000);
          CK(cudaEventRecord(e0[d], st[d]));
          CK(cudaEventRecord(fork[d], st[d]));
          CK(cudaStreamWaitEvent(side[d], fork[d]));
          if (mode != 2) {
            const int rpc = T / chunks;
            for (int c = 0; c < chunks; ++c) {
              size_t off = size_t(c) * rpc * row, n = size_t(rpc) * row;
              CK(cudaMemcpyAsync(bulk[1 - d] + off, x[d] + off, n, cudaMemcpyDeviceToDevice,
                                 side[d]));
              if (wv((CUstream)side[d], (CUdeviceptr)(flags[1 - d] + c), v, 0) != CUDA_SUCCESS) {
                printf("writevalue failed\n");
                return 1;
              }
            }
          }
          if (mode >= 1)
            gather<<<24, 512, 0, st[d]>>>(bulk[d], out[d], T, row, T / chunks, flags[d], v,
                                          mode == 2);
          CK(cudaEventRecord(join[d], side[d]));
          CK(cudaStreamWaitEvent(st[d], join[d]));
          CK(cudaEventRecord(e1[d], st[d]));
        }
        for (int d = 0; d < 2; ++d) {
          CK(cudaSetDevice(d));
          CK(cudaEventSynchronize(e1[d]));
          float ms;
          CK(cudaEventElapsedTime(&ms, e0[d], e1[d]));
          if (it >= 2) tm[d].push_back(ms * 1e3);
        }
      }
      double worst = 0;
      for (int d = 0; d < 2; ++d) {
        std::sort(tm[d].begin(), tm[d].end());
        worst = std::max(worst, tm[d][tm[d].size() / 2]);
      }
      printf("row %d %s chunks %2d: %.1f us  (%.1f GB/s per direction)\n", row,
             mode == 0   ? "CE only     "
             : mode == 1 ? "CE + gather "
                         : "gather only ",
             chunks, worst, bytes / worst / 1e3);
    }
  // check data
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(d));
    char h;
    CK(cudaMemcpy(&h, out[d] + bytes - 1, 1, cudaMemcpyDeviceToHost));
    printf("dev %d out last byte %d (expect %d)\n", d, h, 2 - d);
  }
}
