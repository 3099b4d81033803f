// High-throughput nvlink combine: the reverse of dispatch, with a fixed-order reduction.
//
//  * Senders (expert side): the rows held from source s, x[recv_prefix[s] + i], go back to rank s,
//    into slot i of the region this rank owns in s's combine area (i is the row's position in s's
//    send list, i.e. s's send_pos), with its top-k weights and a per-row flag = sequence number
//    published with a system-scope release. Rows this rank holds from itself are not sent: the
//    owner side reads them straight from x.
//  * Receivers (owner side): token t waits for the flags of its rows from every rank r with
//    send_pos[t, r] >= 0, then computes, element by element,
//      acc = +0; for r = 0..R-1 ascending: acc += row_r; acc += bias0; acc += bias1
//    in float32 (float64 for float64 rows; biases of the element type, or float32 rows for
//    16-bit elements) with round-to-nearest adds (no contraction), and
//    stores acc rounded to nearest-even in the element type. Weights are summed the same way.
//    BF16 (FP16) tokens with at most two rows and no bias take add.rn.bf16x2 (f16x2), which gives
//    the same bits (see device::bf16_pair_sum) with a fifth of the instructions: on 2 ranks the
//    reduction's instructions bound the owner side (combine rows of tests/native/nvlink_bench.cu).
// Global warps walk rows/tokens interleaved, so arrivals and reductions both proceed roughly in
// token order and the reduction overlaps the transfer. Senders store from registers: senders that
// staged rows in shared memory (cp.async) were slower on NVLink (combine rows of the harness's
// benchmark, 2 GPUs), though faster with two ranks on one GPU; see docs/history/.
#include "transports/nvlink/cuda/nvlink_device.cuh"
#include "transports/nvlink/cuda/nvlink_kernels.hpp"

namespace ep {
namespace {

constexpr uint32_t kFull = 0xffffffffu;
constexpr int kWarps = kNvlinkThreads / 32;

template <CombineElem kElem>
struct ElemOps;

// acc[j] += element j of the eight 16-bit elements in v, widened to float32 by `Widen`.
template <float (*Widen)(uint32_t)>
__device__ __forceinline__ void add_16bit(float* acc, const int4& v) {
  const uint32_t w[4] = {uint32_t(v.x), uint32_t(v.y), uint32_t(v.z), uint32_t(v.w)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] = __fadd_rn(acc[2 * i], Widen(w[i] & 0xFFFFu));
    acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], Widen(w[i] >> 16));
  }
}

// Eight float32 sums as eight 16-bit elements (BF16 or FP16), one cvt.rn.<type>x2 per two: round
// to nearest even, subnormals kept.
template <bool kBFloat16>
__device__ __forceinline__ int4 pack_16bit(const float* acc) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (kBFloat16)
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(acc[2 * i + 1]), "f"(acc[2 * i]));
    else
      asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(acc[2 * i + 1]), "f"(acc[2 * i]));
  }
  return make_int4(int(w[0]), int(w[1]), int(w[2]), int(w[3]));
}

// acc[j] += f[j] for the eight float32 values of two vectors (a float32 bias of 16-bit rows).
__device__ __forceinline__ void add_f32x8(float* acc, const int4& lo, const int4& hi) {
  const int w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], __int_as_float(w[j]));
}

// What BF16 and FP16 share: eight elements per vector, summed in float32 after `Widen`.
template <float (*Widen)(uint32_t)>
struct SixteenBitOps {
  using Acc = float;
  static constexpr int kPerVec = 8;
  static __device__ __forceinline__ void add(Acc* acc, const int4& v) { add_16bit<Widen>(acc, v); }
};

template <>
struct ElemOps<CombineElem::kBFloat16> : SixteenBitOps<device::bf16_to_float> {
  // One cvt.rn.bf16x2 per two elements (round to nearest even, like float_to_bf16_rne, subnormals
  // kept). A NaN takes the slow path so it keeps float_to_bf16_rne's bits (0x7FC0; the hardware
  // writes 0x7FFF). The reduction's instructions bound the owner side on 2 ranks.
  static __device__ __forceinline__ int4 pack(const Acc* acc) {
    const int4 fast = pack_16bit<true>(acc);
    bool nan = false;
#pragma unroll
    for (int i = 0; i < 4; ++i) nan |= acc[2 * i] != acc[2 * i] || acc[2 * i + 1] != acc[2 * i + 1];
    if (!nan) return fast;
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] = uint32_t(device::float_to_bf16_rne(acc[2 * i])) |
             (uint32_t(device::float_to_bf16_rne(acc[2 * i + 1])) << 16);
    return make_int4(int(w[0]), int(w[1]), int(w[2]), int(w[3]));
  }
  // (+0 + a) + b in the element type: the float32 reduction's bits (false: take that path).
  static __device__ __forceinline__ bool pair_sum(const int4& a, const int4& b, int4& out) {
    return device::bf16_pair_sum(a, b, out);
  }
};

template <>
struct ElemOps<CombineElem::kFloat16> : SixteenBitOps<device::f16_to_float> {
  // cvt.rn.f16x2: round to nearest even, subnormals kept, overflow to infinity (a NaN becomes
  // the canonical 0x7FFF; the contract leaves NaN payloads unspecified).
  static __device__ __forceinline__ int4 pack(const Acc* acc) { return pack_16bit<false>(acc); }
  static __device__ __forceinline__ bool pair_sum(const int4& a, const int4& b, int4& out) {
    out = device::f16_pair_sum(a, b);
    return true;
  }
};

template <>
struct ElemOps<CombineElem::kFloat32> {
  using Acc = float;
  static constexpr int kPerVec = 4;
  static __device__ __forceinline__ void add(Acc* acc, const int4& v) {
    acc[0] = __fadd_rn(acc[0], __int_as_float(v.x));
    acc[1] = __fadd_rn(acc[1], __int_as_float(v.y));
    acc[2] = __fadd_rn(acc[2], __int_as_float(v.z));
    acc[3] = __fadd_rn(acc[3], __int_as_float(v.w));
  }
  static __device__ __forceinline__ int4 pack(const Acc* acc) {
    return make_int4(__float_as_int(acc[0]), __float_as_int(acc[1]), __float_as_int(acc[2]),
                     __float_as_int(acc[3]));
  }
};

template <>
struct ElemOps<CombineElem::kFloat64> {
  using Acc = double;
  static constexpr int kPerVec = 2;
  static __device__ __forceinline__ void add(Acc* acc, const int4& v) {
    const long long lo = (static_cast<long long>(uint32_t(v.y)) << 32) | uint32_t(v.x);
    const long long hi = (static_cast<long long>(uint32_t(v.w)) << 32) | uint32_t(v.z);
    acc[0] = __dadd_rn(acc[0], __longlong_as_double(lo));
    acc[1] = __dadd_rn(acc[1], __longlong_as_double(hi));
  }
  static __device__ __forceinline__ int4 pack(const Acc* acc) {
    const long long lo = __double_as_longlong(acc[0]);
    const long long hi = __double_as_longlong(acc[1]);
    return make_int4(int(lo & 0xffffffff), int(lo >> 32), int(hi & 0xffffffff), int(hi >> 32));
  }
};

// Start of the combine row `slot` that `src` writes into `owner`'s buffer (mapped as `buffer`).
__device__ __forceinline__ char* combine_row(const CommContext& c, char* buffer, int src, int owner,
                                             int slot, int stride) {
  return buffer + c.layout.combine_offset +
         c.layout.region_index(src, owner) * c.layout.combine_region_bytes + size_t(slot) * stride;
}

// A sender warp's first row for rank d waits until d has entered this combine (its word in our
// `entered` array reaches seq: d's combine area is free); `ready` marks ranks seen. False: the
// wait gave up (timeout or abort, recorded in ctx).
__device__ __forceinline__ bool wait_entered(const device::WaitContext& ctx,
                                             const uint64_t* entered, int d, uint64_t seq, int lane,
                                             uint32_t& ready) {
  if ((ready >> d) & 1u) return true;
  bool ok = true;
  if (lane == 0)
    ok = device::spin_wait(ctx, d, [&] { return device::ld_acquire_sys(entered + d) >= seq; });
  if (!__shfl_sync(kFull, ok, 0)) return false;
  ready |= 1u << d;
  return true;
}

// Expert side: rows held from source s go back into s's combine area; progress to the publisher.
__device__ void combine_send(const CombineParams& p, const device::WaitContext& ctx, uint64_t seq,
                             int hidden_bytes, int warp, int lane, int* progress) {
  const CommContext& c = p.comm;
  const int R = c.num_ranks, me = c.rank, K = p.num_topk;
  const CombineRow row = CombineRow::make(hidden_bytes, K);
  const int n16 = hidden_bytes / 16;
  const int first = blockIdx.x * p.num_send_warps + warp;
  const int stride = gridDim.x * p.num_send_warps;
  const int prefix = lane <= R ? p.recv_prefix[lane] : 0;
  const uint64_t* entered =
      reinterpret_cast<const uint64_t*>(c.buffers.ptr[me] + c.layout.entered_offset);
  uint32_t ready = 1u << me;

  int max_count = 0;
  for (int s = 0; s < R; ++s) {
    const int n = __shfl_sync(kFull, prefix, s + 1) - __shfl_sync(kFull, prefix, s);
    if (s != me) max_count = max(max_count, n);
  }
  int k = 0;
  for (int i = first; i < max_count; i += stride, ++k) {
    // Slot i starts at peer (me + 1 + i % (R - 1)): warps at different slots write to different
    // peers at once, as a dispatch warp's chunk-by-chunk stores to every destination do, instead
    // of every warp of this rank writing to the same peer first.
    for (int step = 1; step < R; ++step) {
      const int dst = (me + 1 + (step - 1 + i) % (R - 1)) % R;
      const int base = __shfl_sync(kFull, prefix, dst);
      const int count = __shfl_sync(kFull, prefix, dst + 1) - base;
      if (i >= count) continue;
      if (!wait_entered(ctx, entered, dst, seq, lane, ready)) return;
      char* out = combine_row(c, c.buffers.ptr[dst], me, dst, i, row.stride);
      const int r = base + i;
      if (r < p.num_recv_capacity) {  // rows past the capacity never existed (overflow)
        const int4* src =
            reinterpret_cast<const int4*>(static_cast<const char*>(p.x) + size_t(r) * hidden_bytes);
        int4* o = reinterpret_cast<int4*>(out);
        constexpr int kUnroll = 16;
        for (int j = lane; j < n16; j += 32 * kUnroll) {
          int4 v[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u)
            if (j + 32 * u < n16) v[u] = device::ld_nc_v4_l2_prefetch_256b(src + j + 32 * u);
#pragma unroll
          for (int u = 0; u < kUnroll; ++u)
            if (j + 32 * u < n16) device::st_v4_no_l1_allocate(o + j + 32 * u, v[u]);
        }
        if (p.topk_weights != nullptr && lane < K)
          reinterpret_cast<float*>(out + row.weights_offset)[lane] =
              p.topk_weights[size_t(r) * K + lane];
      }
    }
    __syncwarp();
    if (lane == 0) device::st_release_cta_shared(progress + warp, k + 1);
  }
}

// Lane l publishes the rows of sender warp l of this block (see the dispatch publisher).
__device__ void combine_publish(const CombineParams& p, const device::WaitContext& ctx,
                                uint64_t seq, int lane, const int* progress) {
  const CommContext& c = p.comm;
  const int R = c.num_ranks, me = c.rank;
  const int S = p.num_send_warps;
  const int stride = gridDim.x * S;
  const int first = blockIdx.x * S + lane;
  int count[kMaxRanks];
  int max_count = 0;
#pragma unroll
  for (int d = 0; d < kMaxRanks; ++d) {
    count[d] = (d < R && d != me) ? p.recv_prefix[d + 1] - p.recv_prefix[d] : 0;
    max_count = max(max_count, count[d]);
  }
  const int total = (lane < S && first < max_count) ? (max_count - 1 - first) / stride + 1 : 0;
  device::publish_loop_counted(ctx, lane, S, total, progress, [&](int k) {
    const int i = first + k * stride;
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d)
      if (i < count[d])
        device::st_relaxed_sys(
            reinterpret_cast<uint64_t*>(c.buffers.ptr[d] + c.layout.combine_flag_offset(me, d, i)),
            seq);
  });
}

// Owner side: reduce token t whose rows from rank r sit at pos[r] (-1: none).
// kBiasF32: the biases are float32 rows of 16-bit elements (two vectors per vector of x), a rare
// case kept out of the common instantiation, with one vector in flight so that it needs no more
// registers than the common one.
template <CombineElem kElem, int kRanks, bool kBiasF32>
__device__ __forceinline__ void combine_token(const CombineParams& p, int t,
                                              const int (&pos)[kRanks], int local_base, int lane) {
  using Ops = ElemOps<kElem>;
  constexpr int kElemBytes = combine_elem_bytes(kElem);
  static_assert(!kBiasF32 || kElemBytes == 2, "float32 biases are for 16-bit elements");
  using Acc = typename Ops::Acc;
  // 16-byte loads in flight per lane: kRanks * kUnroll, all issued before any add.
  constexpr int kUnroll =
      kBiasF32 ? 1 : (kRanks <= 2 ? 8 : (kRanks <= 4 ? 2 : 1));  // no register spills
  const CommContext& c = p.comm;
  const int R = c.num_ranks, me = c.rank, K = p.num_topk;
  const int hidden_bytes = p.hidden * kElemBytes;
  const CombineRow row = CombineRow::make(hidden_bytes, K);
  const int n16 = hidden_bytes / 16;
  char* const own = c.buffers.ptr[me];

  int local_row = -1;  // row of x this rank holds from itself for token t
  const char* src[kRanks];
#pragma unroll
  for (int r = 0; r < kRanks; ++r) {
    src[r] = nullptr;
    if (r < R && pos[r] >= 0) {
      if (r == me) {
        local_row = local_base + pos[r];
        if (local_row < p.num_recv_capacity)
          src[r] = static_cast<const char*>(p.x) + size_t(local_row) * hidden_bytes;
      } else {
        src[r] = combine_row(c, own, r, me, pos[r], row.stride);
      }
    }
  }
  const size_t bias_row_bytes = size_t(hidden_bytes) * (kBiasF32 ? 2 : 1);
  const int4* b0 = p.bias0 == nullptr
                       ? nullptr
                       : reinterpret_cast<const int4*>(static_cast<const char*>(p.bias0) +
                                                       size_t(t) * bias_row_bytes);
  const int4* b1 = p.bias1 == nullptr
                       ? nullptr
                       : reinterpret_cast<const int4*>(static_cast<const char*>(p.bias1) +
                                                       size_t(t) * bias_row_bytes);
  int4* out = reinterpret_cast<int4*>(static_cast<char*>(p.out) + size_t(t) * hidden_bytes);
  // BF16 / FP16 on 2 ranks: at most two rows per token, summed in the element type (same
  // bits) when there is no bias.
  constexpr bool kPairSum = kElemBytes == 2 && kRanks == 2;  // BF16 and FP16
  const bool pair_path = b0 == nullptr && b1 == nullptr;

  // Weights first: their loads overlap the row loads below.
  float acc_w = 0.0f;
  if (p.out_topk_weights != nullptr && lane < K) {
#pragma unroll
    for (int r = 0; r < kRanks; ++r) {
      if (src[r] == nullptr) continue;
      const float* w = r == me ? p.topk_weights + size_t(local_row) * K
                               : reinterpret_cast<const float*>(src[r] + row.weights_offset);
      acc_w = __fadd_rn(acc_w, w[lane]);
    }
  }

  for (int i = lane; i < n16; i += 32 * kUnroll) {
    int4 v[kRanks][kUnroll];
#pragma unroll
    for (int r = 0; r < kRanks; ++r) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if constexpr (kPairSum) v[r][u] = make_int4(0, 0, 0, 0);  // a missing row adds +0
        if (src[r] != nullptr && i + 32 * u < n16)
          v[r][u] =
              device::ld_v4_no_l1_allocate(reinterpret_cast<const int4*>(src[r]) + i + 32 * u);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (i + 32 * u >= n16) continue;
      if constexpr (kPairSum) {
        int4 sum;
        if (pair_path && Ops::pair_sum(v[0][u], v[1][u], sum)) {
          device::st_v4_no_l1_allocate(out + i + 32 * u, sum);
          continue;
        }
      }
      Acc acc[Ops::kPerVec];
#pragma unroll
      for (int e = 0; e < Ops::kPerVec; ++e) acc[e] = Acc(0);  // +0: the spec's start value
#pragma unroll
      for (int r = 0; r < kRanks; ++r)
        if (src[r] != nullptr) Ops::add(acc, v[r][u]);
      if constexpr (kBiasF32) {
        const int j = i + 32 * u;
        if (b0 != nullptr)
          add_f32x8(acc, device::ld_nc_v4_l2_prefetch_256b(b0 + 2 * j),
                    device::ld_nc_v4_l2_prefetch_256b(b0 + 2 * j + 1));
        if (b1 != nullptr)
          add_f32x8(acc, device::ld_nc_v4_l2_prefetch_256b(b1 + 2 * j),
                    device::ld_nc_v4_l2_prefetch_256b(b1 + 2 * j + 1));
      } else {
        if (b0 != nullptr) Ops::add(acc, device::ld_nc_v4_l2_prefetch_256b(b0 + i + 32 * u));
        if (b1 != nullptr) Ops::add(acc, device::ld_nc_v4_l2_prefetch_256b(b1 + i + 32 * u));
      }
      device::st_v4_no_l1_allocate(out + i + 32 * u, Ops::pack(acc));
    }
  }

  if (p.out_topk_weights != nullptr && lane < K) p.out_topk_weights[size_t(t) * K + lane] = acc_w;
}

// Owner side: 32 tokens per batch, lane j polls the flags of token first + (k0 + j) * stride and
// the warp reduces every token whose rows have all arrived.
template <CombineElem kElem, int kRanks, bool kBiasF32>
__device__ void combine_recv(const CombineParams& p, const device::WaitContext& ctx, uint64_t seq,
                             int warp, int lane) {
  const CommContext& c = p.comm;
  const int R = c.num_ranks, me = c.rank;
  const CombineRow row = CombineRow::make(p.hidden * combine_elem_bytes(kElem), p.num_topk);
  const int num_recv_warps = kWarps - p.num_send_warps - 1;
  const int first = blockIdx.x * num_recv_warps + (warp - p.num_send_warps - 1);
  const int stride = gridDim.x * num_recv_warps;
  char* const own = c.buffers.ptr[me];
  const int local_base = p.recv_prefix[me];

  for (int k0 = 0; first + k0 * stride < p.num_tokens; k0 += 32) {
    const int my_t = first + (k0 + lane) * stride;
    const bool valid = my_t < p.num_tokens;
    int my_pos[kRanks];
    uint32_t waiting = 0;  // remote ranks whose row of my_t has not been seen yet
#pragma unroll
    for (int r = 0; r < kRanks; ++r) {
      my_pos[r] = (valid && r < R) ? p.send_pos[size_t(my_t) * R + r] : -1;
      if (r != me && my_pos[r] >= 0) waiting |= 1u << r;
    }
    uint32_t pending = __ballot_sync(kFull, valid);
    long long idle_since = 0;
    for (uint32_t idle = 0; pending != 0;) {
      if (((pending >> lane) & 1u) && waiting != 0) {
#pragma unroll
        for (int r = 0; r < kRanks; ++r) {
          if (!((waiting >> r) & 1u)) continue;
          const uint64_t* flag = reinterpret_cast<const uint64_t*>(
              own + c.layout.combine_flag_offset(r, me, my_pos[r]));
          if (device::flag_arrived(flag, seq)) waiting &= ~(1u << r);
        }
      }
      uint32_t ready = __ballot_sync(kFull, ((pending >> lane) & 1u) && waiting == 0);
      __syncwarp();  // the polling lanes' acquires order every lane's reads below
      pending &= ~ready;
      if (ready != 0) {
        idle = 0;
      } else {
        if (idle++ == 0) idle_since = clock64();
        __nanosleep(64);  // leave the issue slots to the working warps of this SM
        if ((idle & 63u) == 0) {
          if (device::aborted(ctx)) return;
          if (clock64() - idle_since > ctx.timeout_cycles) {
            const uint32_t w = __reduce_or_sync(kFull, waiting);
            if (lane == 0) device::raise_timeout(ctx, __ffs(w) - 1);
            return;
          }
        }
      }
      while (ready != 0) {
        const int j = __ffs(ready) - 1;
        ready &= ready - 1;
        int pos[kRanks];
#pragma unroll
        for (int r = 0; r < kRanks; ++r) pos[r] = __shfl_sync(kFull, my_pos[r], j);
        combine_token<kElem, kRanks, kBiasF32>(p, first + (k0 + j) * stride, pos, local_base, lane);
      }
    }
  }
}

template <CombineElem kElem, int kRanks, bool kBiasF32>
__global__ void __launch_bounds__(kNvlinkThreads, 1) nvlink_combine_kernel(CombineParams p) {
  __shared__ uint64_t s_seq;
  __shared__ int s_progress[kWarps];
  const CommContext& c = p.comm;
  const int me = c.rank, R = c.num_ranks;
  const int warp = threadIdx.x / 32, lane = device::lane_id();
  ControlBlock* ctrl = reinterpret_cast<ControlBlock*>(c.buffers.ptr[me]);
  if (threadIdx.x == 0) s_seq = device::read_sequence(ctrl);
  if (threadIdx.x < kWarps) s_progress[threadIdx.x] = 0;
  __syncthreads();
  const uint64_t seq = s_seq;
  const device::WaitContext ctx{ctrl, c.error, c.timeout_cycles, kOpCombine, me};
  if (blockIdx.x == 0 && threadIdx.x < R && int(threadIdx.x) != me)
    device::st_release_sys(
        reinterpret_cast<uint64_t*>(c.buffers.ptr[threadIdx.x] + c.layout.entered_offset) + me,
        seq);

  if (!device::aborted(ctx)) {
    const int hidden_bytes = p.hidden * combine_elem_bytes(kElem);
    if (warp < p.num_send_warps)
      combine_send(p, ctx, seq, hidden_bytes, warp, lane, s_progress);
    else if (warp == p.num_send_warps)
      combine_publish(p, ctx, seq, lane, s_progress);
    else
      combine_recv<kElem, kRanks, kBiasF32>(p, ctx, seq, warp, lane);
  }
  // Block 0 sees every peer enter (see the dispatch kernel for why).
  if (blockIdx.x == 0 && warp == 0 && lane < R && lane != me && !device::aborted(ctx)) {
    const uint64_t* entered =
        reinterpret_cast<const uint64_t*>(c.buffers.ptr[me] + c.layout.entered_offset);
    device::spin_wait(ctx, lane, [&] { return device::ld_acquire_sys(entered + lane) >= seq; });
  }
  __syncthreads();
  if (threadIdx.x == 0) device::finish_block(ctrl, seq);
}

template <CombineElem kElem, int kRanks, bool kBiasF32>
cudaError_t launch_one(const CombineParams& p, int num_sms, cudaStream_t stream) {
  nvlink_combine_kernel<kElem, kRanks, kBiasF32><<<num_sms, kNvlinkThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <CombineElem kElem, bool kBiasF32>
cudaError_t launch_for_ranks(const CombineParams& p, int num_sms, cudaStream_t stream) {
  const int R = p.comm.num_ranks;
  if (R <= 2) return launch_one<kElem, 2, kBiasF32>(p, num_sms, stream);
  if (R <= 4) return launch_one<kElem, 4, kBiasF32>(p, num_sms, stream);
  return launch_one<kElem, 8, kBiasF32>(p, num_sms, stream);
}

// Float32 biases of 16-bit rows take their own kernels: the common ones stay as they are.
template <CombineElem kElem>
cudaError_t launch_for_elem(const CombineParams& p, int num_sms, cudaStream_t stream) {
  if constexpr (combine_elem_bytes(kElem) == 2) {
    if (p.bias_f32) return launch_for_ranks<kElem, true>(p, num_sms, stream);
  }
  return launch_for_ranks<kElem, false>(p, num_sms, stream);
}

template <CombineElem kElem, bool kBiasF32>
cudaError_t preload_for_ranks() {
  cudaFuncAttributes attr;
  cudaError_t e = cudaFuncGetAttributes(&attr, nvlink_combine_kernel<kElem, 2, kBiasF32>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, nvlink_combine_kernel<kElem, 4, kBiasF32>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, nvlink_combine_kernel<kElem, 8, kBiasF32>);
  return e;
}

template <CombineElem kElem>
cudaError_t preload_for_elem() {
  cudaError_t e = preload_for_ranks<kElem, false>();
  if constexpr (combine_elem_bytes(kElem) == 2) {
    if (e == cudaSuccess) e = preload_for_ranks<kElem, true>();
  }
  return e;
}

}  // namespace

cudaError_t preload_nvlink_combine() {
  cudaError_t e = preload_for_elem<CombineElem::kBFloat16>();
  if (e == cudaSuccess) e = preload_for_elem<CombineElem::kFloat16>();
  if (e == cudaSuccess) e = preload_for_elem<CombineElem::kFloat32>();
  if (e == cudaSuccess) e = preload_for_elem<CombineElem::kFloat64>();
  return e;
}

cudaError_t launch_nvlink_combine(const CombineParams& p, int num_sms, cudaStream_t stream) {
  switch (p.elem) {
    case CombineElem::kBFloat16:
      return launch_for_elem<CombineElem::kBFloat16>(p, num_sms, stream);
    case CombineElem::kFloat16:
      return launch_for_elem<CombineElem::kFloat16>(p, num_sms, stream);
    case CombineElem::kFloat32:
      return launch_for_elem<CombineElem::kFloat32>(p, num_sms, stream);
    case CombineElem::kFloat64:
      return launch_for_elem<CombineElem::kFloat64>(p, num_sms, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace ep
