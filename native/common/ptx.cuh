// PTX helpers shared by every transport's kernels: loads, stores and fences with explicit
// memory-model semantics, 16-byte vector accesses with explicit cache hints, cp.async,
// programmatic dependent launch, and lane / timer reads. System scope unless a name says gpu or
// cta. Dependency-free (no NVSHMEM, no torch), so each kernel family includes it as is.
//
// Memory-model rules (why these exact instructions):
//  * Cross-GPU visibility needs a release (sender) / acquire (receiver) pair at *system* scope:
//    the GPUs are different agents, `.gpu` scope is not enough.
//  * A warp publishes a row with: every lane stores its part, `__syncwarp()` (bar.warp.sync orders
//    the lanes' accesses among the participants), then one lane issues `fence.acq_rel.sys` and
//    relaxed flag stores. Release is cumulative, so the other lanes' stores are covered.
//  * The receiver mirrors it: one lane polls with `ld.acquire.sys`, then `__syncwarp()`, after
//    which every lane may read the payload with ordinary loads.
//  * `ld.global.nc` (read-only path) is used only on inputs nobody writes during the kernel.
#pragma once

#include <cstdint>

namespace ep {
namespace ptx {

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Adds v at p without returning the old value (a peer's counter: one write, no round trip).
__device__ __forceinline__ void red_add_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

// GPU scope: blocks of one kernel on one device (the layout kernel's blocks).
__device__ __forceinline__ uint64_t ld_acquire_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Another block's data, read after an acquire (never from a stale L1 line).
__device__ __forceinline__ int ld_relaxed_gpu(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_gpu(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ int ld_volatile_int(const int* p) {
  int v;
  asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t ld_volatile_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// ---- CTA-scope hand-offs through shared memory -----------------------------------------------

// CTA-scope release/acquire on shared memory: the hand-off from a worker warp to its block's
// publisher warp. With the publisher's later fence.acq_rel.sys this forms a cumulative release
// chain (as bar.sync + one thread's system fence does in NCCL's protocols), so the worker never
// waits for its remote stores itself.
__device__ __forceinline__ void st_release_cta_shared(int* p, int v) {
  asm volatile("st.release.cta.shared.b32 [%0], %1;" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(p))),
               "r"(v)
               : "memory");
}

__device__ __forceinline__ int ld_acquire_cta_shared(const int* p) {
  int v;
  asm volatile("ld.acquire.cta.shared.b32 %0, [%1];"
               : "=r"(v)
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p)))
               : "memory");
  return v;
}

// ---- 16-byte vector accesses -----------------------------------------------------------------
// Two read-only loads exist on purpose: the NVLink kernels read large contiguous rows and ask L2
// to fetch 256 B sectors at once; the NVSHMEM kernels read short rows and keep L2's default.

// Read-only input (nobody writes it during the kernel): non-coherent path, no L1 allocation, L2
// prefetch of 256 B. Not volatile, so the compiler may hoist it for more overlap.
__device__ __forceinline__ int4 ld_nc_v4_l2_prefetch_256b(const void* p) {
  int4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// Read-only input as above, without the L2 prefetch hint.
__device__ __forceinline__ int4 ld_nc_v4_no_l2_prefetch(const void* p) {
  int4 v;
  asm("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// Data written by a peer during this kernel (after an acquire): coherent load, no L1 allocation.
__device__ __forceinline__ int4 ld_v4_no_l1_allocate(const void* p) {
  int4 v;
  asm volatile("ld.global.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// Data written during the kernel (by this block or, after an acquire, by a peer): from L2, never
// a stale L1 line.
__device__ __forceinline__ int4 ld_cg_v4(const void* p) {
  int4 v;
  asm volatile("ld.global.cg.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ int ld_cg_s32(const void* p) {
  int v;
  asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Store that does not allocate in L1 (rows the writer never reads back).
__device__ __forceinline__ void st_v4_no_l1_allocate(void* p, const int4& v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// Plain 16-byte store (default cache policy).
__device__ __forceinline__ void st_v4(void* p, const int4& v) {
  asm volatile("st.global.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

// 16 bytes global -> shared without passing through registers (cp.async, L2 only); visible to
// the issuing thread after cp_async_wait. Groups: one commit per batch, waited for in order.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
// Waits until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// ---- launch order, lanes and time --------------------------------------------------------------

// Programmatic dependent launch (sm_90): lets the kernel launched behind this one on the
// stream start now, while this one still runs (a no-op when nothing is launched behind it).
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The calling thread waits until the kernel this one was launched behind (programmatic
// dependent launch) has finished and its writes are visible; at once after a normal launch.
__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ int lane_id() {
  return static_cast<int>(threadIdx.x & 31u);
}

__device__ __forceinline__ int warp_id() {
  return static_cast<int>(threadIdx.x >> 5);
}

// Nanoseconds of the GPU's global timer (comparable across the SMs of one GPU).
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---- BF16 conversions ------------------------------------------------------------------------

// float -> bfloat16 bits (in the low 16 bits), round to nearest even; NaN becomes the quiet NaN
// 0x7FC0 of c10::BFloat16's scalar cast (PyTorch's vectorized CPU cast writes 0xFFFF: NaN bits
// are not part of the spec, NaN positions are).
__device__ __forceinline__ uint32_t float_to_bf16_rne(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

// The BF16 value in the low / high 16 bits of a word.
__device__ __forceinline__ float bf16_to_float(uint32_t w) {
  return __uint_as_float(w << 16);
}
__device__ __forceinline__ float bf16_hi_to_float(uint32_t w) {
  return __uint_as_float(w & 0xFFFF0000u);
}

}  // namespace ptx
}  // namespace ep
