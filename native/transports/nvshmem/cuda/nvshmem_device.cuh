// Device helpers of the NVSHMEM (low-latency) kernels: bounded waits on %globaltimer, error
// reporting, the end-of-kernel bookkeeping and the two ways of reaching a peer's symmetric memory:
//  * P2P fast path: the peer's region is mapped here (nvshmem_ptr != null): plain 16-byte stores
//    by the whole block, a barrier, then one thread's st.release.sys of the peer's flag (release
//    is cumulative over the block's stores ordered by the barrier).
//  * NVSHMEM transports (nvshmem_ptr == null, e.g. RDMA): nvshmemx_putmem_signal_nbi_warp, whose
//    signal (setting the same flag) is delivered only after the data.
// Receivers poll their own flags with ld.acquire.sys and read payloads with ld.global.cg
// (L2, never a stale L1 line: the same addresses were read two calls ago). The PTX itself is in
// common/ptx.cuh.
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "common/launch_attribute.hpp"
#include "common/ptx.cuh"
#include "transports/nvshmem/cuda/nvshmem_common.hpp"

namespace ep {
namespace nvshmem {
namespace device {

using ptx::bf16_hi_to_float;
using ptx::bf16_to_float;
using ptx::float_to_bf16_rne;
using ptx::global_timer_ns;
using ptx::lane_id;
using ptx::ld_acquire_sys;
using ptx::ld_cg_s32;
using ptx::ld_cg_v4;
using ptx::ld_nc_v4_no_l2_prefetch;
using ptx::ld_volatile_int;
using ptx::ld_volatile_u64;
using ptx::st_relaxed_sys;
using ptx::st_release_sys;
using ptx::st_v4;
using ptx::warp_id;

// topk_idx entry as int64 whatever its width.
__device__ __forceinline__ long long load_idx(const void* topk_idx, int idx_bytes, size_t i) {
  if (idx_bytes == 8) return static_cast<const long long*>(topk_idx)[i];
  return static_cast<const int*>(topk_idx)[i];
}

// This block's tokens [x, y): T split over the grid in chunks of ceil(T / grid) (the dispatch
// SEND and the combine RECV walk the same tokens per block).
__device__ __forceinline__ int2 block_tokens(int num_tokens) {
  const int chunk = (num_tokens + static_cast<int>(gridDim.x) - 1) / static_cast<int>(gridDim.x);
  const int begin = min(num_tokens, static_cast<int>(blockIdx.x) * chunk);
  return make_int2(begin, min(num_tokens, begin + chunk));
}

// Bit j set when lane first_lane + j (j < n, lanes of this warp) holds the same `value` as this
// lane. Every lane of the warp calls it, with the same n. A shuffle per lane compared:
// __match_any_sync is far slower (three of them per round of the dispatch count).
__device__ __forceinline__ unsigned lanes_equal(int value, int first_lane, int n) {
  unsigned mask = 0;
  for (int j = 0; j < n; ++j)
    mask |= (__shfl_sync(0xffffffffu, value, first_lane + j) == value ? 1u : 0u) << j;
  return mask;
}

// ---- dispatch messages and work items ------------------------------------------------------

// A dispatch message in the receive area (written by a peer, acquired through its flag):
// source token, entry count, entry j as (header_key, position p).
__device__ __forceinline__ int message_token(const char* m) {
  return ld_cg_s32(m);
}
__device__ __forceinline__ int message_entries(const char* m) {
  return ld_cg_s32(m + 4);
}
__device__ __forceinline__ int2 message_entry(const char* m, int j) {
  return make_int2(ld_cg_s32(m + 8 + 8 * j), ld_cg_s32(m + 12 + 8 * j));
}

// The flag of dispatch message slot (s, t): seq << 1, plus 1 when token t of source s sent this
// rank a message (a receiver visits every slot below the source's token count, so it must also
// learn when there is none).
__device__ __forceinline__ uint64_t message_flag(uint64_t seq, bool present) {
  return (seq << 1) | (present ? 1u : 0u);
}
__device__ __forceinline__ uint64_t message_flag_seq(uint64_t flag) {
  return flag >> 1;
}
__device__ __forceinline__ bool message_flag_present(uint64_t flag) {
  return (flag & 1u) != 0;
}

// A combine weight as it crosses to an expert rank: the call's tag in the high half, the float32
// bits in the low half, stored as one 8-byte word, so the reader polls the word itself instead of
// a flag released behind every weight (one system fence and one more NVLink trip saved). The tag
// is never 0 (zeroed memory never matches); it repeats after 2^32 - 1 calls on a buffer.
__device__ __forceinline__ uint32_t weight_tag(uint64_t seq) {
  return 1u + static_cast<uint32_t>(seq % 0xffffffffull);
}
__device__ __forceinline__ uint64_t weight_word(uint32_t tag, float w) {
  return (uint64_t(tag) << 32) | __float_as_uint(w);
}
__device__ __forceinline__ bool weight_word_is(uint64_t word, uint32_t tag) {
  return static_cast<uint32_t>(word >> 32) == tag;
}
__device__ __forceinline__ float weight_word_value(uint64_t word) {
  return __uint_as_float(static_cast<uint32_t>(word));
}

// Work items taken source by source: first[i] is the first item of the i-th source taken
// (ascending; a source without items shares its successor's). The i of `item`.
__device__ __forceinline__ int item_source(const int* first, int sources, int item) {
  int i = 0;
  while (i + 1 < sources && first[i + 1] <= item) ++i;
  return i;
}

// ---- errors and bounded waits -----------------------------------------------------------------

// Whether rank r is masked for this call (Context::rank_mask).
__device__ __forceinline__ bool rank_masked(const Context& c, int r) {
  return c.rank_mask != nullptr && c.rank_mask[r] != 0;
}

struct Waiter {
  ControlBlock* ctrl;
  ErrorRecord* err;
  long long timeout_ns;
  int op;
  int rank;
};

// First error wins (lock 0 -> 1), except that a timeout (fatal) replaces a recorded non-fatal
// error (lock 1 -> 2), so check_error() always names the stalled peer.
__device__ __forceinline__ void report_error(const Waiter& w, int code, int peer, long long a,
                                             long long b) {
  const bool fatal = code == kErrorTimeout;
  const int old = atomicCAS(&w.ctrl->error_lock, 0, fatal ? 2 : 1);
  if (old == 0 || (fatal && old == 1 && atomicCAS(&w.ctrl->error_lock, 1, 2) == 1)) {
    publish_error_record(w.err, w.op, w.rank, code, peer, a, b);
  }
}

__device__ __forceinline__ bool aborted(const Waiter& w) {
  return ld_volatile_int(&w.ctrl->abort) != 0;
}

// Spins (one thread) until ready(); false on timeout (recorded, naming `peer`) or abort.
template <typename Ready>
__device__ __forceinline__ bool spin_wait(const Waiter& w, int peer, Ready ready) {
  if (ready()) return true;
  if (aborted(w)) return false;
  const uint64_t start = global_timer_ns();
  for (uint32_t iter = 1;; ++iter) {
    if (ready()) return true;
    if ((iter & 127u) == 0) {
      if (aborted(w)) return false;
      if (static_cast<long long>(global_timer_ns() - start) > w.timeout_ns) {
        report_error(w, kErrorTimeout, peer, w.timeout_ns, 0);
        atomicExch(&w.ctrl->abort, 1);
        return false;
      }
    }
  }
}

// ---- launching ------------------------------------------------------------------------------

// Cooperative launch (every block resident: receivers spin while senders progress) of a
// kThreads-wide low-latency kernel taking its parameter block by value.
template <typename Params>
cudaError_t launch_cooperative(void (*kernel)(Params), const Params& p, int num_blocks,
                               cudaStream_t stream) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  return launch_with_attribute(kernel, p, dim3(static_cast<unsigned>(num_blocks)), dim3(kThreads),
                               0, stream, attr);
}

// Largest grid a cooperative launch of `kernel` accepts on the current device.
template <typename Params>
cudaError_t max_cooperative_blocks(void (*kernel)(Params), int* blocks) {
  int device = 0, sms = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0);
  *blocks = sms * per_sm;
  return e;
}

// The kP2P = true and false instances of a kernel (launched with the same count): the smaller of
// their largest cooperative grids.
template <typename Params>
cudaError_t max_cooperative_blocks_of_both(void (*p2p)(Params), void (*other)(Params),
                                           int* blocks) {
  int p2p_blocks = 0;
  cudaError_t e = max_cooperative_blocks(p2p, &p2p_blocks);
  if (e == cudaSuccess) e = max_cooperative_blocks(other, blocks);
  if (e == cudaSuccess && p2p_blocks < *blocks) *blocks = p2p_blocks;
  return e;
}

// ---- reaching peers -----------------------------------------------------------------------------

// Sets a peer's 64-bit signal word. No ordering with other data is implied (a relaxed store:
// no fence), so it may only carry its own value, like a count.
// kP2P: every peer is P2P-mapped (Context::all_p2p), the NVSHMEM call is compiled out.
template <bool kP2P = false>
__device__ __forceinline__ void signal_set(const Context& c, int pe, size_t offset,
                                           uint64_t value) {
  char* mapped = c.peer[pe];
  if (kP2P || mapped != nullptr) {
    st_relaxed_sys(reinterpret_cast<uint64_t*>(mapped + offset), value);
  } else if constexpr (!kP2P) {
    nvshmemx_signal_op(reinterpret_cast<uint64_t*>(c.local + offset), value, NVSHMEM_SIGNAL_SET,
                       pe);
  }
}

// NVSHMEM transports (no P2P mapping): the warp puts `bytes` from local symmetric `src` to the
// same-offset destination on `pe`, then sets the peer's 64-bit flag at `flag_offset` to `value`;
// the signal is delivered only after the data. Whole warp calls; `src` was written by this block
// (ordered by a barrier or __syncwarp before the call).
__device__ __forceinline__ void warp_put_signal(const Context& c, int pe, size_t dst_offset,
                                                const char* src, size_t bytes, size_t flag_offset,
                                                uint64_t value) {
  // The NIC (or proxy) reads `src` at system scope.
  __threadfence_system();
  __syncwarp();
  nvshmemx_putmem_signal_nbi_warp(c.local + dst_offset, src, bytes,
                                  reinterpret_cast<uint64_t*>(c.local + flag_offset), value,
                                  NVSHMEM_SIGNAL_SET, pe);
}

// Called by every block at the end (thread 0, after __syncthreads): the last block to arrive runs
// `last()`, then resets the counter for the next kernel.
template <typename Last>
__device__ __forceinline__ void finish_block(unsigned int* blocks_done, Last last) {
  __threadfence();
  const unsigned int arrived = atomicAdd(blocks_done, 1u);
  if (arrived == gridDim.x - 1) {
    __threadfence();
    last();
    *blocks_done = 0;
    __threadfence();
  }
}

}  // namespace device
}  // namespace nvshmem
}  // namespace ep
