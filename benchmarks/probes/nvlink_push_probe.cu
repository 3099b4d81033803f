// NVLink push probe: how fast can B SMs of each GPU write into the other GPU at once?
// Compares plain 16-byte register stores (the HT kernels' method) with TMA bulk copies
// (global -> shared by cp.async.bulk, shared -> peer global by cp.async.bulk), both GPUs
// pushing to each other at the same time, as dispatch and combine do.
// Build: nvcc -O3 -arch=sm_90a -o build/nvlink_push_probe benchmarks/probes/nvlink_push_probe.cu
// Run:   build/nvlink_push_probe [MiB=64] [pull]   (needs 2 GPUs with peer access; "pull": loads
//        over NVLink and push + pull mixes only)
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

__global__ void push_st(const int4* __restrict__ src, int4* dst, size_t n16) {
  constexpr int U = 8;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n16; i += stride * U) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + u * stride < n16) v[u] = __ldg(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + u * stride < n16) dst[i + u * stride] = v[u];
  }
}

// One warp copies one row of n16 16-byte chunks, 8 loads in flight per lane, like the HT senders.
// kReadOnly: the source is local and read-only (ld.global.nc); else plain loads (a peer's memory).
template <bool kReadOnly>
__device__ __forceinline__ void copy_row_warp(const int4* s, int4* d, int n16, int lane) {
  constexpr int U = 8;
  for (int i = lane; i < n16; i += 32 * U) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + 32 * u < n16) v[u] = kReadOnly ? __ldg(s + i + 32 * u) : s[i + 32 * u];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + 32 * u < n16) d[i + 32 * u] = v[u];
  }
}

// Each warp copies whole rows (row_bytes), warp-contiguous, like the HT senders.
__global__ void push_st_rows(const char* __restrict__ src, char* dst, int rows, int row_bytes) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  const int warps = gridDim.x * blockDim.x / 32;
  for (int r = warp; r < rows; r += warps)
    copy_row_warp<true>(reinterpret_cast<const int4*>(src + size_t(r) * row_bytes),
                        reinterpret_cast<int4*>(dst + size_t(r) * row_bytes), row_bytes / 16, lane);
}

// Local: dst = a (copy) or dst = a + b as 16-byte words (integer adds stand in for the reduction).
__global__ void local_rw(const int4* __restrict__ a, const int4* __restrict__ b, int4* dst,
                         size_t n16) {
  constexpr int U = 8;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n16; i += stride * U) {
    int4 v[U], w[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + u * stride < n16) {
        v[u] = __ldg(a + i + u * stride);
        if (b != nullptr) w[u] = __ldg(b + i + u * stride);
      }
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + u * stride < n16) {
        if (b != nullptr) v[u].x += w[u].x, v[u].y += w[u].y, v[u].z += w[u].z, v[u].w += w[u].w;
        dst[i + u * stride] = v[u];
      }
  }
}

// Blocks [0, push_blocks) push rows [0, push_rows) (local -> peer, stores over NVLink); the other
// blocks pull rows [push_rows, rows) (peer -> local, loads over NVLink). push_blocks = 0 is a pure
// pull, push_rows = rows a pure push. Each warp moves whole rows, as the HT kernels do.
__global__ void push_pull_rows(const char* __restrict__ local_src, char* peer_dst,
                               const char* peer_src, char* local_dst, int rows, int row_bytes,
                               int push_rows, int push_blocks) {
  const bool push = int(blockIdx.x) < push_blocks;
  const int nblocks = push ? push_blocks : int(gridDim.x) - push_blocks;
  const int block = push ? int(blockIdx.x) : int(blockIdx.x) - push_blocks;
  const int wpb = blockDim.x / 32;
  const int warp = block * wpb + int(threadIdx.x) / 32, lane = threadIdx.x % 32;
  const int warps = nblocks * wpb;
  const int first = push ? 0 : push_rows, last = push ? push_rows : rows;
  const char* src = push ? local_src : peer_src;
  char* dst = push ? peer_dst : local_dst;
  for (int r = first + warp; r < last; r += warps)
    copy_row_warp<false>(reinterpret_cast<const int4*>(src + size_t(r) * row_bytes),
                         reinterpret_cast<int4*>(dst + size_t(r) * row_bytes), row_bytes / 16,
                         lane);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// TMA: lane 0 of each warp streams chunks through `stages` shared-memory slots of `chunk` bytes:
// bulk load (local HBM -> smem, mbarrier), then bulk store (smem -> peer). kPipelined: loads run
// `stages - 1` chunks ahead of the stores; otherwise each chunk is loaded, then stored.
template <bool kPipelined>
__global__ void push_tma(const char* __restrict__ src, char* dst, size_t bytes, int chunk,
                         int stages) {
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t bars[32 * 8];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
  char* mine = smem + size_t(warp) * stages * chunk;
  uint64_t* mbar = bars + warp * 8;
  if (lane == 0)
    for (int s = 0; s < stages; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(mbar + s)));
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncwarp();
  if (lane != 0) return;
  const size_t nchunks = bytes / chunk;
  const size_t gw = size_t(blockIdx.x) * nwarps + warp, W = size_t(gridDim.x) * nwarps;
  const size_t mycount = gw < nchunks ? (nchunks - gw + W - 1) / W : 0;
  auto bar_of = [&](size_t j) { return smem_addr(mbar + j % stages); };
  auto buf_of = [&](size_t j) { return smem_addr(mine + (j % stages) * chunk); };
  auto load = [&](size_t j) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar_of(j)),
                 "r"(chunk)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(buf_of(j)),
        "l"(src + (gw + j * W) * chunk), "r"(chunk), "r"(bar_of(j))
        : "memory");
  };
  if (kPipelined)
    for (size_t j = 0; j < mycount && j < size_t(stages - 1); ++j) load(j);
  uint32_t phase = 0;  // bit s: parity of slot s
  for (size_t j = 0; j < mycount; ++j) {
    const int s = int(j % stages);
    if (!kPipelined) {
      // The slot is free once the store issued `stages` chunks ago has read it.
      if (j >= size_t(stages))
        asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(0) : "memory");
      load(j);
    }
    asm volatile(
        "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        " @!p bra W;\n}" ::"r"(bar_of(j)),
        "r"((phase >> s) & 1u)
        : "memory");
    phase ^= 1u << s;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(
                     dst + (gw + j * W) * chunk),
                 "r"(buf_of(j)), "r"(chunk)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    // Pipelined: the slot of chunk j + stages - 1 was read by store j - 1 (one group may pend).
    if (kPipelined && j + stages - 1 < mycount) {
      asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(1) : "memory");
      load(j + stages - 1);
    }
  }
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(0) : "memory");
}

struct Gpu {
  char* src;
  char* dst;  // on this GPU, written by the peer
  cudaStream_t s;
  cudaEvent_t a, b;
};

template <class Launch>
double run_both(Gpu* g, Launch launch, size_t bytes, int iters) {
  std::vector<float> best(2, 1e30f);
  for (int it = 0; it < iters + 2; ++it) {
    for (int d = 0; d < 2; ++d) {
      CHECK(cudaSetDevice(d));
      CHECK(cudaDeviceSynchronize());
    }
    for (int d = 0; d < 2; ++d) {
      CHECK(cudaSetDevice(d));
      CHECK(cudaEventRecord(g[d].a, g[d].s));
      launch(d, g[d].src, g[1 - d].dst, g[d].s);
      CHECK(cudaGetLastError());
      CHECK(cudaEventRecord(g[d].b, g[d].s));
    }
    float ms[2];
    for (int d = 0; d < 2; ++d) {
      CHECK(cudaSetDevice(d));
      CHECK(cudaEventSynchronize(g[d].b));
      CHECK(cudaEventElapsedTime(&ms[d], g[d].a, g[d].b));
    }
    if (it >= 2)
      for (int d = 0; d < 2; ++d) best[d] = std::min(best[d], ms[d]);
  }
  (void)bytes;
  return std::max(best[0], best[1]) * 1e3;  // us, slower GPU of the best runs
}

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? std::atoi(argv[1]) : 64;
  const size_t bytes = mib << 20;
  Gpu g[2];
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    CHECK(cudaDeviceEnablePeerAccess(1 - d, 0));
    CHECK(cudaMalloc(&g[d].src, bytes));
    CHECK(cudaMalloc(&g[d].dst, bytes));
    CHECK(cudaMemset(g[d].src, d + 1, bytes));
    CHECK(cudaStreamCreateWithFlags(&g[d].s, cudaStreamNonBlocking));
    CHECK(cudaEventCreate(&g[d].a));
    CHECK(cudaEventCreate(&g[d].b));
  }
  const int iters = 10;
  auto report = [&](const char* name, double us) {
    std::printf("%-44s %8.1f us  %6.1f GB/s per direction\n", name, us, bytes / us / 1e3);
  };
  // The last copy landed: each GPU's dst ends with the peer's fill byte.
  auto check_tail = [&](const char* what) {
    std::vector<char> h(4096);
    for (int d = 0; d < 2; ++d) {
      CHECK(cudaSetDevice(d));
      CHECK(cudaMemcpy(h.data(), g[d].dst + bytes - 4096, 4096, cudaMemcpyDeviceToHost));
      int bad = 0;
      for (char v : h) bad += v != char(2 - d);
      std::printf("gpu %d %s tail %s\n", d, what, bad ? "WRONG" : "ok");
    }
  };
  if (argc > 2 && std::string(argv[2]) == "pull") {
    // Loads over NVLink (each GPU reads the peer's src into its own dst), and push + pull mixed.
    const int row = 14336, rows = int(bytes / row);
    for (int blocks : {24, 132})
      for (int warps : {8, 16, 32}) {
        char name[96];
        std::snprintf(name, sizeof name, "pull rows %dB %d x %d warps", row, blocks, warps);
        report(name, run_both(
                         g,
                         [&](int dev, char*, char*, cudaStream_t st) {
                           push_pull_rows<<<blocks, warps * 32, 0, st>>>(g[dev].src, g[1 - dev].dst,
                                                                         g[1 - dev].src, g[dev].dst,
                                                                         rows, row, 0, 0);
                         },
                         bytes, iters));
      }
    for (double f : {0.25, 0.4, 0.5, 0.6}) {
      for (int pull_blocks : {6, 8, 10, 12}) {
        char name[96];
        std::snprintf(name, sizeof name, "push %.0f%% + pull 24 SMs (%d pull)", (1 - f) * 100,
                      pull_blocks);
        const int push_rows = int((1 - f) * rows);
        report(name, run_both(
                         g,
                         [&](int dev, char*, char*, cudaStream_t st) {
                           push_pull_rows<<<24, 512, 0, st>>>(g[dev].src, g[1 - dev].dst,
                                                              g[1 - dev].src, g[dev].dst, rows, row,
                                                              push_rows, 24 - pull_blocks);
                         },
                         bytes, iters));
      }
    }
    for (int blocks : {24, 132}) {
      char name[96];
      std::snprintf(name, sizeof name, "push rows (same kernel) %d x 16 warps", blocks);
      report(name, run_both(
                       g,
                       [&](int dev, char*, char*, cudaStream_t st) {
                         push_pull_rows<<<blocks, 512, 0, st>>>(g[dev].src, g[1 - dev].dst,
                                                                g[1 - dev].src, g[dev].dst, rows,
                                                                row, rows, blocks);
                       },
                       bytes, iters));
    }
    // TMA pull: bulk loads from the peer into shared memory, bulk stores to local memory.
    for (int dev = 0; dev < 2; ++dev) {
      CHECK(cudaSetDevice(dev));
      CHECK(cudaFuncSetAttribute(push_tma<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 200 * 1024));
    }
    for (int warps : {4, 8}) {  // 3 stages of 8 KB per warp: 16 warps exceed shared memory
      const int chunk = 8192, stages = 3;
      char name[96];
      std::snprintf(name, sizeof name, "tma pull 24 x %dw chunk %d stages %d", warps, chunk,
                    stages);
      report(name, run_both(
                       g,
                       [&](int dev, char*, char*, cudaStream_t st) {
                         push_tma<true><<<24, warps * 32, size_t(warps) * chunk * stages, st>>>(
                             g[1 - dev].src, g[dev].dst, bytes, chunk, stages);
                       },
                       bytes, iters));
    }
    check_tail("pulled");
    return 0;
  }
  for (int blocks : {24, 132}) {
    for (int threads : {512, 1024}) {
      char name[96];
      std::snprintf(name, sizeof name, "st.v4 grid-stride %d x %d", blocks, threads);
      report(name, run_both(
                       g,
                       [&](int, char* s, char* d, cudaStream_t st) {
                         push_st<<<blocks, threads, 0, st>>>(
                             reinterpret_cast<int4*>(s), reinterpret_cast<int4*>(d), bytes / 16);
                       },
                       bytes, iters));
    }
    for (int row : {7168, 14336}) {
      char name[96];
      std::snprintf(name, sizeof name, "st.v4 warp rows %dB %d x 512", row, blocks);
      const int rows = int(bytes / row);
      report(name, run_both(
                       g,
                       [&](int, char* s, char* d, cudaStream_t st) {
                         push_st_rows<<<blocks, 512, 0, st>>>(s, d, rows, row);
                       },
                       bytes, iters));
    }
  }
  // How many sending warps per SM does the link need?
  for (int warps : {2, 4, 6, 8, 11, 16}) {
    char name[96];
    std::snprintf(name, sizeof name, "st.v4 warp rows 14336B 24 x %d warps", warps);
    const int rows = int(bytes / 14336);
    report(name, run_both(
                     g,
                     [&](int, char* s, char* d, cudaStream_t st) {
                       push_st_rows<<<24, warps * 32, 0, st>>>(s, d, rows, 14336);
                     },
                     bytes, iters));
  }
  // SM memory ceiling: local copy and local a + b with 24 blocks (bytes = what the SMs move).
  for (int withb = 0; withb < 2; ++withb) {
    char name[96];
    std::snprintf(name, sizeof name, "local %s 24 x 512 (GB/s = SM traffic)",
                  withb ? "a+b" : "copy");
    const double us = run_both(
        g,
        [&](int dev, char* s, char*, cudaStream_t st) {
          local_rw<<<24, 512, 0, st>>>(reinterpret_cast<int4*>(s),
                                       withb ? reinterpret_cast<int4*>(g[dev].dst) : nullptr,
                                       reinterpret_cast<int4*>(g[dev].dst) + 0, bytes / 32);
        },
        bytes, iters);
    std::printf("%-44s %8.1f us  %6.1f GB/s SM traffic (%.1f per SM)\n", name, us,
                (withb ? 3 : 2) * (bytes / 2) / us / 1e3,
                (withb ? 3 : 2) * (bytes / 2) / us / 1e3 / 24);
  }
  // SMs and copy engine pushing at once: SMs take (1 - f) of the bytes, one copy the rest.
  for (double f : {0.0, 0.2, 0.3, 0.4, 0.5, 1.0}) {
    const size_t ce = size_t(f * (bytes / 16)) * 16, sm = bytes - ce;
    cudaStream_t side[2];
    for (int d = 0; d < 2; ++d) {
      CHECK(cudaSetDevice(d));
      CHECK(cudaStreamCreateWithFlags(&side[d], cudaStreamNonBlocking));
    }
    cudaEvent_t fork[2], join[2];
    for (int d = 0; d < 2; ++d) {
      CHECK(cudaSetDevice(d));
      CHECK(cudaEventCreateWithFlags(&fork[d], cudaEventDisableTiming));
      CHECK(cudaEventCreateWithFlags(&join[d], cudaEventDisableTiming));
    }
    char name[96];
    std::snprintf(name, sizeof name, "SM 24 x 512 + copy engine %.0f%%", f * 100);
    report(name,
           run_both(
               g,
               [&](int dev, char* s, char* d, cudaStream_t st) {
                 CHECK(cudaEventRecord(fork[dev], st));
                 CHECK(cudaStreamWaitEvent(side[dev], fork[dev]));
                 if (ce > 0)
                   CHECK(cudaMemcpyAsync(d + sm, s + sm, ce, cudaMemcpyDeviceToDevice, side[dev]));
                 if (sm > 0) push_st_rows<<<24, 512, 0, st>>>(s, d, int(sm / 14336), 14336);
                 CHECK(cudaEventRecord(join[dev], side[dev]));
                 CHECK(cudaStreamWaitEvent(st, join[dev]));
               },
               bytes, iters));
  }
  if (argc > 2) return 0;  // sends-per-SM sweep only
  for (int dev = 0; dev < 2; ++dev) {
    CHECK(cudaSetDevice(dev));
    CHECK(cudaFuncSetAttribute(push_tma<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               200 * 1024));
    CHECK(cudaFuncSetAttribute(push_tma<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               200 * 1024));
  }
  struct Cfg {
    int warps, chunk, stages;
  };
  for (int blocks : {24, 132}) {
    for (Cfg c : {Cfg{4, 16384, 3}, Cfg{8, 8192, 3}, Cfg{8, 7168, 3}, Cfg{16, 4096, 3},
                  Cfg{4, 14336, 3}, Cfg{2, 32768, 3}, Cfg{8, 4096, 6}, Cfg{16, 2048, 6}}) {
      const size_t smem = size_t(c.warps) * c.chunk * c.stages;
      if (smem > 200 * 1024) continue;
      if (bytes % c.chunk) continue;
      for (int pipe = 0; pipe < 2; ++pipe) {
        char name[96];
        std::snprintf(name, sizeof name, "tma%s %d x %dw chunk %d stages %d", pipe ? "-pipe" : "",
                      blocks, c.warps, c.chunk, c.stages);
        report(name, run_both(
                         g,
                         [&](int, char* s, char* d, cudaStream_t st) {
                           auto kernel = pipe ? push_tma<true> : push_tma<false>;
                           kernel<<<blocks, c.warps * 32, smem, st>>>(s, d, bytes, c.chunk,
                                                                      c.stages);
                         },
                         bytes, iters));
      }
    }
  }
  check_tail("received");
  return 0;
}
