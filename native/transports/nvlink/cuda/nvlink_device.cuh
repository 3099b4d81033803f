// Device helpers of the NVLink kernels: the control block's bounded spin-wait (clock64) and
// error record, the sender -> publisher hand-off of dispatch and combine blocks, the epoch /
// sequence bookkeeping, and the FP16/BF16 pair sums of the combine. The PTX they use and the
// memory-model rules behind it are in common/ptx.cuh.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "transports/nvlink/cuda/nvlink_common.hpp"

namespace ep {
namespace device {

using ptx::bf16_to_float;
using ptx::cp_async_16;
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::fence_acq_rel_sys;
using ptx::float_to_bf16_rne;
using ptx::lane_id;
using ptx::launch_dependents;
using ptx::ld_acquire_cta_shared;
using ptx::ld_acquire_sys;
using ptx::ld_nc_v4_l2_prefetch_256b;
using ptx::ld_relaxed_sys;
using ptx::ld_v4_no_l1_allocate;
using ptx::ld_volatile_int;
using ptx::red_add_relaxed_sys;
using ptx::st_relaxed_sys;
using ptx::st_release_cta_shared;
using ptx::st_release_sys;
using ptx::st_v4_no_l1_allocate;
using ptx::wait_for_prerequisite_grid;

// ---- control block, errors and bounded waits ---------------------------------------------------

// Shared by every warp of a kernel: where to report, how long to wait.
struct WaitContext {
  ControlBlock* ctrl;  // this rank's private control block (device memory)
  ErrorRecord* err;    // host-mapped error record (device pointer)
  long long timeout_cycles;
  int op;
  int rank;
};

// Records the first error of this runtime: the winner of the device-side lock fills the record
// and publishes `code` last, so the host never sees a half-written record.
__device__ __forceinline__ void report_error(const WaitContext& ctx, int code, int peer,
                                             long long a, long long b) {
  if (atomicCAS(&ctx.ctrl->error_lock, 0, 1) == 0) {
    publish_error_record(ctx.err, ctx.op, ctx.rank, code, peer, a, b);
  }
}

__device__ __forceinline__ bool aborted(const WaitContext& ctx) {
  return ld_volatile_int(&ctx.ctrl->abort) != 0;
}

// Marks the runtime as failed: every other spin loop (this kernel and later ones) gives up.
__device__ __forceinline__ void raise_timeout(const WaitContext& ctx, int peer) {
  report_error(ctx, kErrorTimeout, peer, ctx.timeout_cycles, 0);
  atomicExch(&ctx.ctrl->abort, 1);
}

// Spins (single thread) until `ready()` holds. Returns false on timeout or abort; on timeout the
// error record names `peer` as the rank we waited for. `periods` timeouts pass before it gives up.
template <typename Ready>
__device__ __forceinline__ bool spin_wait(const WaitContext& ctx, int peer, Ready ready,
                                          int periods = 1) {
  if (ready()) return true;
  const long long start = clock64();
  for (uint32_t iter = 1;; ++iter) {
    if (ready()) return true;
    if ((iter & 255u) == 0) {
      if (aborted(ctx)) return false;
      if (clock64() - start > periods * ctx.timeout_cycles) {
        raise_timeout(ctx, peer);
        return false;
      }
    }
  }
}

// A wait on other work of this GPU (our own notify kernel, this block's publisher or senders),
// which only stalls because that work waits for a peer, lasts this many timeouts: the work's own
// wait times out first and its record names the peer (the first record wins; a timeout also
// aborts every other wait). Only a stall of this GPU's own work is reported as waiting for this
// rank.
constexpr int kThisGpuWaitPeriods = 2;

template <typename Ready>
__device__ __forceinline__ bool spin_wait_on_this_gpu(const WaitContext& ctx, Ready ready) {
  return spin_wait(ctx, ctx.rank, ready, kThisGpuWaitPeriods);
}

// ---- warp row copies --------------------------------------------------------------------------

// One warp copies the 16-byte chunks `first`, `first + 32`, ... below `n16` of a row (`first` is
// the lane plus any chunks already copied), kUnroll loads in flight per lane before their stores.
// `load(i, u)` reads chunk i + 32 u and `store(i, u, v)` writes it, with the cache hints of the
// caller's data (the callers index `base + i + 32 * u`, which keeps the offsets immediate).
template <int kUnroll, typename Load, typename Store>
__device__ __forceinline__ void warp_copy_chunks(int first, int n16, Load load, Store store) {
  for (int i = first; i < n16; i += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + 32 * u < n16) v[u] = load(i, u);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + 32 * u < n16) store(i, u, v[u]);
  }
}

// ---- sender warps -> publisher warp ------------------------------------------------------------

// Dispatch sender warps claim their tokens one at a time from the kernel's counter
// (ControlBlock::work_claimed): SMs do not get equal shares of NVLink, and with a static
// round-robin split the last sender of a dispatch ends well after the median one. A
// sender hands each stored token to its block's publisher warp through a small ring in shared
// memory. (The combine keeps the round-robin split: claiming measured no faster there.)
constexpr int kMaxSenderWarps = 16;
constexpr int kPublishRing = 8;  // items a sender may run ahead of its publisher lane
struct PublishQueue {
  int progress[kMaxSenderWarps];   // (items handed over << 1) | 1 once the sender is finished
  int published[kMaxSenderWarps];  // items whose flags the publisher has written
  int items[kMaxSenderWarps][kPublishRing];
};

// Lane 0 of a sender warp: its next item (items past the end mean "finished"). The first
// `owned` are the warp's own, `first`, `first + stride`, ... (no atomic on the critical path at
// the start, which the FP8 dispatch rows of nvlink_bench favour; a caller that needs two items
// before its first store owns two); later ones are claimed from the kernel's counter, past every
// warp's owned items, so faster SMs take more of them.
__device__ __forceinline__ int next_item(ControlBlock* ctrl, int previous, int first, int stride,
                                         int owned = 1) {
  if (previous < 0) return first;
  if (previous < first + (owned - 1) * stride) return previous + stride;
  return static_cast<int>(atomicAdd(&ctrl->work_claimed, 1u)) + owned * stride;
}

// Lane 0 of sender warp `w`, after __syncwarp(): hands the warp's k-th item (its stores are done)
// to the publisher. Waits while the ring is full; false on abort or timeout.
__device__ __forceinline__ bool hand_over(const WaitContext& ctx, PublishQueue& q, int w, int k,
                                          int item) {
  auto has_room = [&] { return k - ld_acquire_cta_shared(&q.published[w]) < kPublishRing; };
  if (!has_room() && !spin_wait_on_this_gpu(ctx, has_room)) return false;
  q.items[w][k % kPublishRing] = item;
  st_release_cta_shared(&q.progress[w], (k + 1) << 1);
  return true;
}

// Lane 0 of sender warp `w`: it handed over `count` items and will hand over no more.
__device__ __forceinline__ void hand_over_done(PublishQueue& q, int w, int count) {
  st_release_cta_shared(&q.progress[w], (count << 1) | 1);
}

// The loop of a publisher warp (lane l follows sender warp l of the block). `read(done, finished)`
// gives how many items lane l's sender has handed over and whether it will hand over more. As soon
// as any lane's sender has handed over new items the warp issues one system-scope fence,
// cumulative over the stores the senders released to it, then `publish_range(begin, end)` writes
// the arrival flags of the lane's items [begin, end). Returns once every sender is finished and
// published, or on abort or timeout (which names this rank: its own senders stalled).
template <typename Read, typename PublishRange>
__device__ __forceinline__ void run_publisher(const WaitContext& ctx, int lane, Read read,
                                              PublishRange publish_range) {
  int published = 0;
  long long idle_since = 0;
  for (uint32_t idle = 0;;) {
    int done = 0;
    bool finished = false;
    read(done, finished);
    const bool fresh = done > published;
    const bool any_fresh = __any_sync(0xffffffffu, fresh);
    if (any_fresh) fence_acq_rel_sys();
    if (fresh) {
      publish_range(published, done);
      published = done;
    }
    if (__all_sync(0xffffffffu, finished && published == done)) return;
    if (any_fresh) {
      idle = 0;
      continue;
    }
    if (idle++ == 0) idle_since = clock64();
    __nanosleep(32);
    if ((idle & 255u) == 0) {
      if (aborted(ctx)) return;  // a sender gave up
      // A wait on this GPU's own senders (see kThisGpuWaitPeriods): a sender waiting for a peer
      // times out first and names that peer.
      if (clock64() - idle_since > kThisGpuWaitPeriods * ctx.timeout_cycles) {
        if (lane == 0) raise_timeout(ctx, ctx.rank);
        return;
      }
    }
  }
}

// Publisher of a dispatch block: senders hand tokens over through the PublishQueue ring, and
// `publish(item)` flags each.
template <typename Publish>
__device__ __forceinline__ void publish_loop(const WaitContext& ctx, int lane, int num_senders,
                                             PublishQueue& q, Publish publish) {
  run_publisher(
      ctx, lane,
      [&](int& done, bool& finished) {
        const int v = lane < num_senders ? ld_acquire_cta_shared(&q.progress[lane]) : 1;
        done = v >> 1;
        finished = (v & 1) != 0;
      },
      [&](int begin, int end) {
        for (int k = begin; k < end; ++k) publish(q.items[lane][k % kPublishRing]);
        st_release_cta_shared(&q.published[lane], end);  // frees the ring slots
      });
}

// Publisher of a combine block: senders split the rows round-robin, so lane l knows its sender's
// `total` items; the sender releases through progress[l] how many it has stored, and `publish(k)`
// flags the lane's k-th item.
template <typename Publish>
__device__ __forceinline__ void publish_loop_counted(const WaitContext& ctx, int lane,
                                                     int num_senders, int total,
                                                     const int* progress, Publish publish) {
  run_publisher(
      ctx, lane,
      [&](int& done, bool& finished) {
        done = lane < num_senders ? ld_acquire_cta_shared(progress + lane) : 0;
        finished = done == total;
      },
      [&](int begin, int end) {
        for (int k = begin; k < end; ++k) publish(k);
      });
}

// Polls a flag cheaply (relaxed) and acquires only once it matches: spinning warps then do not
// issue a stream of acquire loads that slow the working warps of their SM.
__device__ __forceinline__ bool flag_arrived(const uint64_t* flag, uint64_t seq) {
  if (ld_relaxed_sys(flag) != seq) return false;
  return ld_acquire_sys(flag) == seq;
}

// Every communicating kernel reads the rank's epoch once: its sequence number is epoch + 1.
__device__ __forceinline__ uint64_t read_sequence(const ControlBlock* ctrl) {
  return ld_relaxed_sys(&ctrl->epoch) + 1;
}

// Called by thread 0 of every block after the block's work: the last block to finish advances
// the epoch, so the next kernel on the stream gets the next sequence number. Every block read the
// epoch at its start, before arriving here, so nobody can observe the new value too early.
// `on_last()` runs in the last block before the epoch advances (kernel-private bookkeeping that
// the next kernel reads).
template <typename OnLast>
__device__ __forceinline__ void finish_block(ControlBlock* ctrl, uint64_t seq, OnLast on_last) {
  __threadfence();
  const unsigned int arrived = atomicAdd(&ctrl->blocks_done, 1u);
  if (arrived == gridDim.x - 1) {
    on_last();
    ctrl->blocks_done = 0;
    ctrl->work_claimed = 0;  // every sender of every block has claimed past the end
    for (int s = 0; s < kMaxRanks; ++s) ctrl->recv_claimed[s] = 0;  // likewise every receiver
    st_relaxed_sys(&ctrl->epoch, seq);
    __threadfence();
  }
}

__device__ __forceinline__ void finish_block(ControlBlock* ctrl, uint64_t seq) {
  finish_block(ctrl, seq, [] {});
}

// ---- element sums used by combine ------------------------------------------------------

// Sums of BF16 rows from at most two ranks, 8 elements (int4) at once: (+0 + a) + b, each add
// add.rn.bf16x2, gives the bits of the spec's float32 reduction rounded to BF16. For two terms,
// rounding the float32 sum to BF16 equals rounding the exact sum once (both terms have 8-bit
// significands: their exact sum fits in float32 unless their exponents differ by more than 15,
// and then the smaller one is far below half a BF16 ulp of the larger). Starting from +0 as the
// spec does turns -0 into +0. Two instructions per element pair instead of ~10 in float32;
// returns false when a result is NaN (the caller then takes the float32 path for its bits).
__device__ __forceinline__ bool bf16_pair_sum(const int4& a, const int4& b, int4& out) {
  const uint32_t x[4] = {uint32_t(a.x), uint32_t(a.y), uint32_t(a.z), uint32_t(a.w)};
  const uint32_t y[4] = {uint32_t(b.x), uint32_t(b.y), uint32_t(b.z), uint32_t(b.w)};
  uint32_t w[4], nan = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t t, n;
    asm("add.rn.bf16x2 %0, %1, %2;" : "=r"(t) : "r"(0u), "r"(x[i]));
    asm("add.rn.bf16x2 %0, %1, %2;" : "=r"(w[i]) : "r"(t), "r"(y[i]));
    asm("{\n .reg .pred p, q;\n setp.nan.bf16x2 p|q, %1, %1;\n or.pred p, p, q;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(n)
        : "r"(w[i]));
    nan |= n;
  }
  out = make_int4(int(w[0]), int(w[1]), int(w[2]), int(w[3]));
  return nan == 0;
}

__device__ __forceinline__ float f16_to_float(uint32_t bits16) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<unsigned short>(bits16)));
  return f;
}

// FP16 rows of at most two ranks, as bf16_pair_sum: (+0 + a) + b with add.rn.f16x2 (no .ftz)
// rounds the exact sum once, and so does the float32 reduction rounded to FP16: float32 has
// 24 >= 2 * 11 + 2 significand bits, enough for double rounding of a sum to be innocuous
// (Figueroa). NaN payloads differ at most (unspecified by the contract).
__device__ __forceinline__ int4 f16_pair_sum(const int4& a, const int4& b) {
  const uint32_t x[4] = {uint32_t(a.x), uint32_t(a.y), uint32_t(a.z), uint32_t(a.w)};
  const uint32_t y[4] = {uint32_t(b.x), uint32_t(b.y), uint32_t(b.z), uint32_t(b.w)};
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t t;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(t) : "r"(0u), "r"(x[i]));
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(w[i]) : "r"(t), "r"(y[i]));
  }
  return make_int4(int(w[0]), int(w[1]), int(w[2]), int(w[3]));
}

}  // namespace device
}  // namespace ep
