// Launch-gap probe: %globaltimer at the end of kernel A (one warp; optionally a release store to
// the peer GPU or a system fence first) against the first instruction of kernel B on the same
// stream, with no event, a timing event or a non-timing event between them, with and without a
// 256 MiB memset before A. Also prints event-to-event time around an empty kernel B.
// Build: nvcc -O3 -arch=sm_90a -o build/launch_gap_probe scripts/launch_gap_probe.cu
// nvidia-h200-x2 (2026-11-23): A -> B 1.9-2.6 us without an event, 4.5-5.2 us with a timing
// event between; events around an empty kernel read 4.6-4.8 us, whatever B's grid.
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <vector>
#include "probe_util.cuh"
__device__ unsigned long long g_t[4];
__global__ void kA(int* peer, int mode) {
  if (threadIdx.x == 0) {
    if (mode == 1 && peer) {
      asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(peer), "r"(1) : "memory");
    }
    if (mode == 2) __threadfence_system();
    g_t[0] = now();
  }
}
template <int kRegs>
__global__ void __launch_bounds__(512, 1) kB(float* out, int n) {
  if (threadIdx.x == 0 && blockIdx.x == 0) g_t[1] = now();
  if (n > 0) {  // never taken; keeps code size
    float acc[kRegs];
    for (int i = 0; i < kRegs; ++i) acc[i] = out[i * threadIdx.x];
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < kRegs; ++i) acc[i] = acc[i] * acc[(i + 1) % kRegs] + 1.f;
    float s = 0;
    for (int i = 0; i < kRegs; ++i) s += acc[i];
    out[threadIdx.x] = s;
  }
}
__global__ void kTiny() {
  if (threadIdx.x == 0) g_t[1] = now();
}
int main() {
  int ndev = 0;
  CK(cudaGetDeviceCount(&ndev));
  int* peer = nullptr;
  if (ndev > 1) {
    CK(cudaSetDevice(1));
    CK(cudaMalloc(&peer, 4));
    CK(cudaSetDevice(0));
    cudaDeviceEnablePeerAccess(1, 0);
  }
  CK(cudaSetDevice(0));
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  void* flush;
  size_t fb = 256u << 20;
  CK(cudaMalloc(&flush, fb));
  float* out;
  CK(cudaMalloc(&out, 1 << 20));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  cudaEvent_t n0;
  CK(cudaEventCreateWithFlags(&n0, cudaEventDisableTiming));
  const char* names[] = {"tiny B", "B 24x512", "B 132x512"};
  for (int doflush = 0; doflush < 2; ++doflush)
    for (int amode = 0; amode < 3; ++amode)
      for (int ev = 0; ev < 3; ++ev)
        for (int b = 0; b < 3; ++b) {
          std::vector<double> g, et;
          for (int it = 0; it < 30; ++it) {
            if (doflush) CK(cudaMemsetAsync(flush, it, fb, s));
            kA<<<1, 32, 0, s>>>(peer, amode);
            if (ev == 1) CK(cudaEventRecord(e0, s));
            if (ev == 2) CK(cudaEventRecord(n0, s));
            if (b == 0)
              kTiny<<<1, 32, 0, s>>>();
            else
              kB<100><<<b == 1 ? 24 : 132, 512, 0, s>>>(out, 0);
            if (ev == 1) CK(cudaEventRecord(e1, s));
            CK(cudaStreamSynchronize(s));
            unsigned long long t[4];
            CK(cudaMemcpyFromSymbol(t, g_t, sizeof(t)));
            g.push_back((double)(t[1] - t[0]) / 1e3);
            if (ev == 1) {
              float ms;
              CK(cudaEventElapsedTime(&ms, e0, e1));
              et.push_back(ms * 1e3);
            }
          }
          std::sort(g.begin(), g.end());
          std::sort(et.begin(), et.end());
          printf("flush=%d A=%s event=%s %-10s gap median %.2f us (min %.2f)%s", doflush,
                 amode == 0   ? "plain"
                 : amode == 1 ? "peer-st"
                              : "fence.sys",
                 ev == 0   ? "none  "
                 : ev == 1 ? "timing"
                           : "notime",
                 names[b], g[g.size() / 2], g[0], ev == 1 ? "" : "\n");
          if (ev == 1) printf("  e0->e1 %.2f us\n", et[et.size() / 2]);
        }
  return 0;
}
