"""Patches a copy of the tree (argv[1]) with %globaltimer stamps in the LL dispatch and combine
kernels (per block, per phase) and a C entry ep_probe_dump that prints them: a diagnostic build,
never the product's kernels. Its replacements match exact source text (asserted), so it fails
loudly where the kernels have moved on. Usage and stamps: ll_phase_stamps.py."""

import pathlib
import sys

root = pathlib.Path(sys.argv[1])
d = root / "native/transports/nvshmem/cuda/nvshmem_dispatch.cu"
s = d.read_text()
probe_defs = r"""
__device__ unsigned long long g_probe[2][160][8];
__device__ __forceinline__ unsigned long long probe_now() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
#define PROBE(k, i) do { g_probe[k][blockIdx.x][i] = probe_now(); } while (0)
"""
anchor = "namespace nvshmem {\n"
assert anchor in s
s = s.replace(anchor, anchor + probe_defs, 1)
# dispatch stamps
s = s.replace(
    """  int abort_seen = 0;
  if (threadIdx.x == 0) {
    sh.seq = ld_volatile_u64(&c.ctrl->dispatch_seq[c.buffer])""",
    """  int abort_seen = 0;
  if (threadIdx.x == 0) PROBE(0, 0);
  if (threadIdx.x == 0) {
    sh.seq = ld_volatile_u64(&c.ctrl->dispatch_seq[c.buffer])""",
    1,
)
s = s.replace(
    """  const uint64_t seq = sh.seq;  // both paths passed a barrier
  if (go) {
    constexpr int kAll = kThreads / 32;
    if (send) count_phase<kP2P>(p, w, seq, sh, count_e);""",
    """  const uint64_t seq = sh.seq;  // both paths passed a barrier
  if (threadIdx.x == 0) PROBE(0, 1);
  if (go) {
    constexpr int kAll = kThreads / 32;
    if (send) count_phase<kP2P>(p, w, seq, sh, count_e);
    if (threadIdx.x == 0) PROBE(0, 2);""",
    1,
)
s = s.replace(
    """      if (warp_id() < kSendWarps)
        send_headers<kP2P>(p, w, seq, sh, WarpGroup{0, kSendWarps, 1}, first_e);
      else""",
    """      if (warp_id() < kSendWarps) {
        send_headers<kP2P>(p, w, seq, sh, WarpGroup{0, kSendWarps, 1}, first_e);
        if (threadIdx.x == 0) PROBE(0, 3);
      } else""",
    1,
)
s = s.replace(
    """  wg.sync();
  if (sh.fail) return;
  for (int i = tid; i < E; i += threads) {
    const int first = i - i % R;  // (le, 0)""",
    """  wg.sync();
  if (tid == 0) PROBE(0, 4);
  if (sh.fail) return;
  for (int i = tid; i < E; i += threads) {
    const int first = i - i % R;  // (le, 0)""",
    1,
)
s = s.replace(
    """  // What combine needs to find these messages again (its H alone does not give the stride).""",
    """  if (tid == 0) PROBE(0, 5);
  // What combine needs to find these messages again (its H alone does not give the stride).""",
    1,
)
s = s.replace(
    """  __syncthreads();
  if (threadIdx.x == 0 && (p.phases & kPhaseSend)) {
    finish_block(&c.ctrl->blocks_done[0], [&] { c.ctrl->dispatch_seq[c.buffer] = seq; });
  }""",
    """  if (threadIdx.x == kSendWarps * 32) PROBE(0, 6);
  __syncthreads();
  if (threadIdx.x == 0) PROBE(0, 7);
  if (threadIdx.x == 0 && (p.phases & kPhaseSend)) {
    finish_block(&c.ctrl->blocks_done[0], [&] { c.ctrl->dispatch_seq[c.buffer] = seq; });
  }""",
    1,
)
assert s.count("PROBE(0,") == 8, s.count("PROBE(0,")
s += r"""
#include <cstdio>
#include <algorithm>
#include <vector>
extern "C" void ep_probe_dump(int which, int blocks) {
  static unsigned long long h[2][160][8];
  cudaDeviceSynchronize();
  cudaMemcpyFromSymbol(h, ep::nvshmem::g_probe, sizeof(h));
  unsigned long long t0 = ~0ull;
  for (int b = 0; b < blocks; ++b) if (h[which][b][0]) t0 = std::min(t0, h[which][b][0]);
  std::printf("probe %s (us from the first block's start; min / median / max over blocks):\n", which ? "combine" : "dispatch");
  for (int i = 0; i < 8; ++i) {
    std::vector<double> v;
    for (int b = 0; b < blocks; ++b) if (h[which][b][i] >= t0) v.push_back((h[which][b][i] - t0) / 1e3);
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    std::printf("  stamp %d: %6.2f / %6.2f / %6.2f  (%zu blocks)\n", i, v.front(), v[v.size() / 2], v.back(), v.size());
  }
  std::memset(h, 0, sizeof(h));
  cudaMemcpyToSymbol(ep::nvshmem::g_probe, h, sizeof(h));
}
"""
s = s.replace("#include <cstdint>\n", "#include <cstdint>\n#include <cstring>\n", 1)
d.write_text(s)

c = root / "native/transports/nvshmem/cuda/nvshmem_combine.cu"
s = c.read_text()
s = s.replace(
    anchor,
    anchor
    + """
extern __device__ unsigned long long g_probe[2][160][8];
__device__ __forceinline__ unsigned long long probe_now_c() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
#define PROBE(k, i) do { g_probe[k][blockIdx.x][i] = probe_now_c(); } while (0)
""",
    1,
)
c.write_text(s)
print("patched")
s = c.read_text()
s = s.replace(
    """  int abort_seen = 0;
  const bool send = (p.phases & kPhaseSend) != 0;
  if (threadIdx.x == 0) {
    sh.seq = ld_volatile_u64(&c.ctrl->dispatch_seq[c.buffer]);""",
    """  int abort_seen = 0;
  const bool send = (p.phases & kPhaseSend) != 0;
  if (threadIdx.x == 0) PROBE(1, 0);
  if (threadIdx.x == 0) {
    sh.seq = ld_volatile_u64(&c.ctrl->dispatch_seq[c.buffer]);""",
    1,
)
s = s.replace(
    """  const bool sent = send ? send_phase<kP2P>(p, w, sh, abort_seen) : !__syncthreads_or(abort_seen);
  if (sent && (p.phases & kPhaseRecv)) recv_phase(p, w, sh.call, sh);
  __syncthreads();""",
    """  const bool sent = send ? send_phase<kP2P>(p, w, sh, abort_seen) : !__syncthreads_or(abort_seen);
  if (threadIdx.x == 0) PROBE(1, 3);
  if (sent && (p.phases & kPhaseRecv)) recv_phase(p, w, sh.call, sh);
  if (threadIdx.x == 0) PROBE(1, 6);
  __syncthreads();
  if (threadIdx.x == 0) PROBE(1, 7);""",
    1,
)
s = s.replace(
    """  if (!send_weights<kP2P>(p, sh, abort_seen)) return false;
  // Sources are taken from the next rank on""",
    """  if (!send_weights<kP2P>(p, sh, abort_seen)) return false;
  if (tid == 0) PROBE(1, 1);
  // Sources are taken from the next rank on""",
    1,
)
s = s.replace(
    """    // Release: every pending item's flag, after the barrier that orders the block's stores
    // (P2P: thread j's release store covers them; otherwise warp j puts item j from comb_stage
    // with the flag as its signal).
    __syncthreads();""",
    """    // Release: every pending item's flag, after the barrier that orders the block's stores
    // (P2P: thread j's release store covers them; otherwise warp j puts item j from comb_stage
    // with the flag as its signal).
    __syncthreads();
    if (tid == 0) PROBE(1, 2);""",
    1,
)
assert s.count("PROBE(1,") == 6, s.count("PROBE(1,")
c.write_text(s)
print("patched combine")
