// Stream-op probe: %globaltimer at the end of kernel A against the first instruction of kernel B
// on the same stream (queued ahead, as a model's host runs ahead of the GPU), with between them:
// nothing; a cudaStreamWaitEvent on an event recorded on the same stream before A (what a receive
// slab's lend used to queue); the same on an event of another, idle stream. And B with 0 or
// 172 KB of dynamic shared memory (the FP8 dispatch's staging), after an A with none or the same,
// to see what a shared-memory carveout change between kernels costs.
// Build: nvcc -O3 -arch=sm_90a -o build/stream_wait_probe scripts/stream_wait_probe.cu
// nvidia-h100-x1 (2026-11-23): A -> B 1.82-1.86 us in every case (a same-stream wait +0.03-0.07,
// an idle other-stream wait +0.04, 172 KB of shared memory in A or B +0.00-0.04): none of these
// stream ops costs the GPU a measurable start delay.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>
#include "probe_util.cuh"
__device__ unsigned long long g_t[2];
__global__ void kBusy(long long cycles) {  // keeps the stream busy so later ops queue up
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}
__global__ void kA(int uses_smem) {
  extern __shared__ int smem[];
  if (threadIdx.x == 0) {
    if (uses_smem) smem[0] = 1;
    if (blockIdx.x == 0) g_t[0] = now();
  }
}
__global__ void kB(int uses_smem) {
  extern __shared__ int smem[];
  if (threadIdx.x == 0) {
    if (uses_smem) smem[0] = 2;
    if (blockIdx.x == 0) g_t[1] = now();
  }
}
int main() {
  CK(cudaSetDevice(0));
  const int big = 172 * 1024;
  CK(cudaFuncSetAttribute(kA, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  CK(cudaFuncSetAttribute(kB, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
  cudaStream_t s, other;
  CK(cudaStreamCreate(&s));
  CK(cudaStreamCreate(&other));
  cudaEvent_t same, idle;
  CK(cudaEventCreateWithFlags(&same, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&idle, cudaEventDisableTiming));
  CK(cudaEventRecord(idle, other));
  CK(cudaDeviceSynchronize());
  const char* waits[] = {"none", "same-stream event", "idle other-stream event"};
  for (int a_smem = 0; a_smem < 2; ++a_smem)
    for (int b_smem = 0; b_smem < 2; ++b_smem)
      for (int w = 0; w < 3; ++w) {
        std::vector<double> g;
        for (int it = 0; it < 41; ++it) {
          kBusy<<<1, 32, 0, s>>>(200000);  // ~100 us: everything below is queued behind it
          CK(cudaEventRecord(same, s));
          kA<<<24, 512, a_smem ? big : 0, s>>>(a_smem);
          if (w == 1) CK(cudaStreamWaitEvent(s, same, 0));
          if (w == 2) CK(cudaStreamWaitEvent(s, idle, 0));
          kB<<<24, 512, b_smem ? big : 0, s>>>(b_smem);
          CK(cudaStreamSynchronize(s));
          unsigned long long t[2];
          CK(cudaMemcpyFromSymbol(t, g_t, sizeof(t)));
          if (it > 0) g.push_back(static_cast<double>(t[1] - t[0]) / 1e3);
        }
        std::sort(g.begin(), g.end());
        printf(
            "A smem %3d KB, B smem %3d KB, wait %-24s A->B median %.2f us (min %.2f, max %.2f)\n",
            a_smem ? big / 1024 : 0, b_smem ? big / 1024 : 0, waits[w], g[g.size() / 2], g[0],
            g.back());
      }
  return 0;
}
