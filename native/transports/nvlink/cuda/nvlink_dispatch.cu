// High-throughput nvlink dispatch (normal, worst-case and cached), push model over NVLink.
//
// Block = 16 warps: `num_send_warps` senders, one publisher, the rest receivers.
//  * Senders: each sender warp claims tokens one at a time from the kernel's counter (tokens go
//    out in roughly increasing order, and fast SMs take more of them, so all senders finish
//    together). Per token it reads the x row once (ld.global.nc, 16 B per lane, many loads in
//    flight) and writes it to every destination: straight into recv_x for this rank (HBM to HBM,
//    never through the buffer), and for a peer into slot send_pos[t, peer] of the region this
//    rank owns in the peer's buffer, followed by scales and metadata (source index, local expert
//    ids, weights). Senders never wait for their remote stores: after each token they hand it to
//    the publisher through shared memory (release/acquire at CTA scope).
//  * Publisher: one warp; lane l follows sender warp l. When a sender hands over new tokens, the
//    lane issues one fence.acq_rel.sys (cumulative: it covers the sender's stores it observed)
//    and writes the per-row flags (= sequence number) of those tokens' remote rows.
//  * Receive slabs: a peer that lent one for this call (notify's dest_slabs) gets the token's
//    x, scales and metadata straight into its outputs (the slab) at its output row, so the rows
//    are not copied out of a buffer (the slab rows of tests/native/nvlink_bench.cu time it).
//    No per-row flags either: after its fence the publisher adds 1 per row to the
//    peer's arrivals word for us, and the peer (own_slab) has one warp wait until every source's
//    count is complete; its receive warps are idle.
//  * Receivers: global receiver warp v owns slots v, v + V, ... of every remote source. It polls
//    32 of its rows at once (one per lane: relaxed load of the row flag, acquire once it matches)
//    and copies every row that has arrived to recv_prefix[src] + slot, so rows leave the buffer
//    while later rows are still in flight.
// Before a sender first writes into a peer's buffer it waits for the peer's "entered" flag of this
// sequence: the peer has finished every earlier kernel, so the region is no longer being read.
// No ring buffer and no flow control: each source owns max_tokens rows in every receiver.
// Behind its notify (p.after_notify, programmatic dependent launch) the kernel starts while notify
// still runs: its launch, a sender's first loads and its wait for the peers overlap the count
// exchange; a sender waits for notify's results (ControlBlock::notified) before its first store
// (its own rows' position needs the counts), receivers before they start; the kernel ends only
// after notify has, and advances the epoch for both.
#include <atomic>

#include "common/dynamic_smem.hpp"
#include "common/launch_attribute.hpp"
#include "transports/nvlink/cuda/nvlink_device.cuh"
#include "transports/nvlink/cuda/nvlink_kernels.hpp"

namespace ep {
namespace {

constexpr uint32_t kFull = 0xffffffffu;
constexpr int kWarps = kNvlinkThreads / 32;
// Sender tuning: 16-byte loads in flight per lane, and the x chunks per lane loaded with the
// token's inputs (chosen with the harness's dispatch rows: tests/native/nvlink_bench.cu).
constexpr int kSendUnroll = 8;
constexpr int kRecvUnroll = 16;
constexpr int kSendEarly = 4;
// An idle receiver warp sleeps this long between polls, leaving the issue slots to the working
// warps of its SM.
constexpr int kRecvSleepNs = 64;

// Register path: stores a read-only input row to N destinations (`to`; with kMayBeNull some are
// null and skipped): chunks [0, 32 * kSendEarly) from `first` (loaded with the token's inputs),
// the rest loaded kSendUnroll chunks per lane at a time. N = 1 and 2 are the common cases (one
// rank, or our own row plus one peer's) and get no per-destination tests.
template <int N, bool kMayBeNull>
__device__ __forceinline__ void send_row(const int4* __restrict__ src, int n16,
                                         const int4 (&first)[kSendEarly], int4* const (&to)[N],
                                         int lane) {
  const auto store_all = [&](int i, int u, const int4& v) {  // chunk i + 32 u to every destination
#pragma unroll
    for (int a = 0; a < N; ++a)
      if (!kMayBeNull || to[a] != nullptr) device::st_v4_no_l1_allocate(to[a] + i + 32 * u, v);
  };
#pragma unroll
  for (int u = 0; u < kSendEarly; ++u)
    if (lane + 32 * u < n16) store_all(lane, u, first[u]);
  device::warp_copy_chunks<kSendUnroll>(
      32 * kSendEarly + lane, n16,
      [&](int i, int u) { return device::ld_nc_v4_l2_prefetch_256b(src + i + 32 * u); }, store_all);
}

// Copies chunks [begin, n16) of a row a peer wrote into our buffer (coherent loads).
__device__ __forceinline__ void copy_row(const int4* src, int4* dst, int n16, int lane, int begin) {
  device::warp_copy_chunks<kRecvUnroll>(
      begin + lane, n16,
      [&](int i, int u) { return device::ld_v4_no_l1_allocate(src + i + 32 * u); },
      [&](int i, int u, const int4& v) { device::st_v4_no_l1_allocate(dst + i + 32 * u, v); });
}

__device__ __forceinline__ void store_idx(void* base, size_t i, int idx_bytes, int v) {
  if (idx_bytes == 8)
    static_cast<long long*>(base)[i] = v;
  else
    static_cast<int*>(base)[i] = v;
}

__device__ __forceinline__ long long load_idx(const void* base, size_t i, int idx_bytes) {
  return idx_bytes == 8 ? static_cast<const long long*>(base)[i]
                        : static_cast<long long>(static_cast<const int*>(base)[i]);
}

// Behind a running notify (p.after_notify): waits until notify has written the receive counts,
// prefix and verdict of this sequence (ControlBlock::notified); false on abort or timeout.
__device__ __forceinline__ bool wait_notified(const device::WaitContext& ctx, uint64_t seq) {
  return device::spin_wait_on_this_gpu(
      ctx, [&] { return ptx::ld_acquire_gpu(&ctx.ctrl->notified) >= seq; });
}

// Start of the row `slot` that `src` writes into `receiver`'s buffer (mapped as `buffer`).
__device__ __forceinline__ char* dispatch_row(const CommContext& c, char* buffer, int src,
                                              int receiver, int slot, int stride) {
  return buffer + c.layout.dispatch_offset +
         c.layout.region_index(src, receiver) * c.layout.dispatch_region_bytes +
         size_t(slot) * stride;
}

// Array `own` of our outputs, or the same array in a peer's lent slab (`slab` non-null).
template <typename T>
__device__ __forceinline__ T* out_array(T* own, char* slab, size_t offset) {
  return slab == nullptr ? own : reinterpret_cast<T*>(slab + offset);
}

// Start of the slab rank d lent (its slab index `ds`), as mapped here.
__device__ __forceinline__ char* lent_slab(const CommContext& c, int d, int ds) {
  return c.slabs.ptr[d] + size_t(ds) * c.slabs.slab_bytes;
}

// A token's scales for destination d: into output row lrow of our arrays (d == me) or of the
// slab d lent (`slab`), else into its row `to` of d's buffer.
__device__ __forceinline__ void store_token_scales(const DispatchParams& p, const DispatchRow& row,
                                                   int me, int d, char* to, char* slab, int lrow,
                                                   int t, int lane, float sc0, float sc1) {
  const int S = p.num_scales;
  float* sc_out = d == me || slab != nullptr
                      ? out_array(p.recv_scales, slab, p.slab.scales) + size_t(lrow) * S
                      : reinterpret_cast<float*>(to + row.scales_offset);
  if (lane < S) sc_out[lane] = sc0;
  if (lane + 32 < S) sc_out[lane + 32] = sc1;
  for (int j = lane + 64; j < S; j += 32) sc_out[j] = p.scales[size_t(t) * S + j];
}

// A token's metadata for destination d: its top-k ids local to d (-1 elsewhere) and weights (0
// where -1), source index and rank; into output row lrow of our arrays or of d's lent slab,
// else into its row of d's buffer.
__device__ __forceinline__ void store_token_meta(const DispatchParams& p, const DispatchRow& row,
                                                 int me, int d, char* to, char* slab, int lrow,
                                                 int t, int lane, long long idx, float w) {
  const int K = p.num_topk;
  const long long lo = static_cast<long long>(d) * p.experts_per_rank;
  const int local_idx = (idx >= lo && idx < lo + p.experts_per_rank) ? int(idx - lo) : -1;
  const float local_w = local_idx >= 0 ? w : 0.0f;
  if (d == me || slab != nullptr) {
    if (lane < K && p.recv_topk_idx != nullptr) {
      store_idx(out_array(p.recv_topk_idx, slab, p.slab.topk_idx), size_t(lrow) * K + lane,
                p.idx_bytes, local_idx);
      if (p.recv_topk_weights != nullptr)
        out_array(p.recv_topk_weights, slab, p.slab.topk_weights)[size_t(lrow) * K + lane] =
            local_w;
    }
    if (lane == 0) {
      if (p.recv_src_idx != nullptr) out_array(p.recv_src_idx, slab, p.slab.src_idx)[lrow] = t;
      // A lent slab's source ranks are filled by its owner instead (fill_slab_src_rank): one
      // small NVLink write less per row (faster slab rows of tests/native/nvlink_bench.cu).
      if (p.recv_src_rank != nullptr && slab == nullptr)
        out_array(p.recv_src_rank, slab, p.slab.src_rank)[lrow] = me;
    }
  } else {
    char* meta = to + row.meta_offset;
    if (lane < K) {
      reinterpret_cast<int*>(meta + 16)[lane] = local_idx;
      reinterpret_cast<float*>(meta + 16 + 4 * K)[lane] = local_w;
    }
    if (lane == 0) reinterpret_cast<int*>(meta + 8)[0] = t;
  }
}

// A token's scales and (with_meta) metadata for destination d, as the two functions above; both
// sender paths call this.
__device__ __forceinline__ void store_token_side(const DispatchParams& p, const DispatchRow& row,
                                                 int me, int d, char* to, char* slab, int lrow,
                                                 int t, int lane, float sc0, float sc1,
                                                 bool with_meta, long long idx, float w) {
  store_token_scales(p, row, me, d, to, slab, lrow, t, lane, sc0, sc1);
  if (with_meta) store_token_meta(p, row, me, d, to, slab, lrow, t, lane, idx, w);
}

// Lane d (< R): where our rows start in rank d's outputs and the slab d lent (-1: none).
__device__ __forceinline__ void load_dest_slabs(const DispatchParams& p, int lane, int& dest_base,
                                                int& dest_slab) {
  dest_base = 0;
  dest_slab = -1;
  if (p.dest_slabs != nullptr && lane < p.comm.num_ranks && lane != p.comm.rank) {
    dest_base = p.dest_slabs[2 * lane];
    dest_slab = p.dest_slabs[2 * lane + 1];
  }
}

// Before a sender's first store to a destination: waits (once per peer) until the peers in
// dest_mask have entered this sequence, and behind a running notify (once) until notify has
// written the counts, then reads
// this rank's first output row. False when the warp must stop
// (abort, timeout, or a routing notify rejected: that moves nothing). Behind a notify the
// "entered" wait is implied: notify returned only after every peer's notify of this sequence
// had written to us, and a peer's notify starts only after its earlier kernels have finished
// (it is not launched early), so no earlier kernel of a peer still reads what we write.
// A sender's state for its stores: the peers it has seen enter, whether notify's results are
// in, and where its rows start (local_base; lane d: dest_base / dest_slab of destination d).
struct SenderState {
  uint32_t ready;
  bool notified;
  int local_base, dest_base, dest_slab;
  bool ok;  // false: the warp must stop
};

// The waits run once per warp: they are kept out of line (EP_INLINE_FIRST_STORE=1 inlines
// them), so the per-token loop that calls sender_may_store carries only its test.
#ifndef EP_INLINE_FIRST_STORE
#define EP_INLINE_FIRST_STORE 0
#endif
#if EP_INLINE_FIRST_STORE
__device__ __forceinline__
#else
__device__ __noinline__
#endif
    SenderState sender_first_store(const DispatchParams& p, const device::WaitContext& ctx,
                                   uint64_t seq, int lane, uint32_t dest_mask, SenderState st) {
  st.ok = false;
  const uint32_t need = p.after_notify ? 0u : dest_mask & ~st.ready;
  if (need != 0) {
    const uint64_t* entered = reinterpret_cast<const uint64_t*>(p.comm.buffers.ptr[p.comm.rank] +
                                                                p.comm.layout.entered_offset);
    bool ok = true;
    if ((need >> lane) & 1u)
      ok = device::spin_wait(ctx, lane,
                             [&] { return device::ld_acquire_sys(entered + lane) >= seq; });
    if (!__all_sync(kFull, ok)) return st;
    st.ready |= need;
  }
  if (!st.notified) {
    st.notified = true;
    if (!wait_notified(ctx, seq) ||
        (p.topk_idx != nullptr && *reinterpret_cast<volatile int*>(&ctx.ctrl->rejected_ranks)))
      return st;
    st.local_base = p.recv_prefix[p.comm.rank];
    load_dest_slabs(p, lane, st.dest_base, st.dest_slab);
  }
  st.ok = true;
  return st;
}

__device__ __forceinline__ bool sender_may_store(const DispatchParams& p,
                                                 const device::WaitContext& ctx, uint64_t seq,
                                                 int lane, uint32_t dest_mask, uint32_t& ready,
                                                 bool& notified, int& local_base, int& dest_base,
                                                 int& dest_slab) {
  const uint32_t need = p.after_notify ? 0u : dest_mask & ~ready;
  if (need == 0 && notified) return true;
  const SenderState st = sender_first_store(
      p, ctx, seq, lane, dest_mask, {ready, notified, local_base, dest_base, dest_slab, true});
  ready = st.ready;
  notified = st.notified;
  local_base = st.local_base;
  dest_base = st.dest_base;
  dest_slab = st.dest_slab;
  return st.ok;
}

// Lane d (< R) of a sender warp: where a token's row goes on destination d, computed by that
// lane alone (the warp then shuffles it to the others once per destination the token has, instead
// of every lane working out all kMaxRanks destinations with shuffles and branches per token).
struct LaneDest {
  char* row;   // the x row (null: d takes nothing from this token)
  char* slab;  // the slab d lent (null: d is us or lent none)
  int lrow;    // our output row (d == us) or d's output row in its slab
};

// Lane d: the start of the region our rows use in peer d's buffer (no slab), once per warp: its
// index needs a modulo, which per token and destination cost a division sequence each.
__device__ __forceinline__ char* lane_region(const CommContext& c, int lane) {
  if (lane >= c.num_ranks || lane == c.rank) return nullptr;
  return c.buffers.ptr[lane] + c.layout.dispatch_offset +
         size_t(c.layout.region_index(c.rank, lane)) * c.layout.dispatch_region_bytes;
}

// Lane d, for a token whose send position there is `pos`: where the token's row goes on
// destination d: our output row local_base + pos, the slab d lent, or the slot's row in d's
// buffer (null past a worst-case capacity, or where d takes nothing). dest_slab / dest_base are
// lane d's own (load_dest_slabs).
__device__ __forceinline__ LaneDest lane_dest(const DispatchParams& p, const DispatchRow& row,
                                              int lane, int pos, int local_base, int dest_slab,
                                              int dest_base, char* region) {
  const CommContext& c = p.comm;
  LaneDest ld{nullptr, nullptr, -1};
  if (lane >= c.num_ranks || pos < 0) return ld;
  if (lane == c.rank) {
    const int r = local_base + pos;
    if (p.num_worst_tokens != 0 && r >= p.num_worst_tokens) return ld;
    ld.lrow = r;
    ld.row = static_cast<char*>(p.recv_x) + size_t(r) * p.hidden_bytes;
  } else if (dest_slab >= 0) {
    ld.slab = lent_slab(c, lane, dest_slab);
    ld.lrow = dest_base + pos;
    ld.row = ld.slab + p.slab.x + size_t(ld.lrow) * p.hidden_bytes;
  } else {
    ld.row = region + size_t(pos) * row.stride;
  }
  return ld;
}

template <typename T>
__device__ __forceinline__ T* shfl_ptr(T* v, int src) {
  return reinterpret_cast<T*>(
      __shfl_sync(kFull, static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(v)), src));
}

// The destinations of a store mask in sending order: peers first (their rows cross NVLink, the
// longer trip), then our own. Returns -1 when none is left.
__device__ __forceinline__ int next_destination(uint32_t& peers, bool& own, int me) {
  if (peers != 0) {
    const int d = __ffs(peers) - 1;
    peers &= peers - 1;
    return d;
  }
  if (own) {
    own = false;
    return me;
  }
  return -1;
}

// Register path: every lane loads 16-byte chunks of x and stores them to every destination. The
// loads that do not depend on the destinations (send_pos, ids, weights, scales, the first chunks
// of x) are issued together, so they cost one memory latency instead of one each.
__device__ void dispatch_send(const DispatchParams& p, const device::WaitContext& ctx, uint64_t seq,
                              int warp, int lane, device::PublishQueue& queue) {
  const CommContext& c = p.comm;
  const int R = c.num_ranks, me = c.rank, K = p.num_topk, S = p.num_scales;
  const DispatchRow row = DispatchRow::make(p.hidden_bytes, S, K);
  const int n16 = p.hidden_bytes / 16;
  const bool with_meta = p.topk_idx != nullptr;
  int local_base = p.after_notify ? 0 : p.recv_prefix[me];  // read after notify when behind it
  bool notified = p.after_notify == 0;
  int dest_base = 0, dest_slab = -1;
  if (notified) load_dest_slabs(p, lane, dest_base, dest_slab);
  uint32_t ready = 1u << me;                  // peers known to have entered this sequence
  char* const region = lane_region(c, lane);  // lane d: our rows' region in d's buffer
  const int first = blockIdx.x * p.num_send_warps + warp, stride = gridDim.x * p.num_send_warps;
  int claimed = lane == 0 ? device::next_item(ctx.ctrl, -1, first, stride) : 0;
  int t = __shfl_sync(kFull, claimed, 0);
  int k = 0;
  for (; t < p.num_tokens; ++k) {
    // The next token's claim travels while this one is copied.
    if (lane == 0) claimed = device::next_item(ctx.ctrl, t, first, stride);
    // 1. Independent loads.
    const int pos = lane < R ? p.send_pos[size_t(t) * R + lane] : -1;
    long long idx = -1;
    float w = 0.0f;
    if (with_meta && lane < K) {
      idx = load_idx(p.topk_idx, size_t(t) * K + lane, p.idx_bytes);
      if (p.topk_weights != nullptr) w = p.topk_weights[size_t(t) * K + lane];
    }
    float sc0 = 0.0f, sc1 = 0.0f;
    if (lane < S) sc0 = p.scales[size_t(t) * S + lane];
    if (lane + 32 < S) sc1 = p.scales[size_t(t) * S + lane + 32];
    const int4* src =
        reinterpret_cast<const int4*>(static_cast<const char*>(p.x) + size_t(t) * p.hidden_bytes);
    int4 v[kSendEarly];
#pragma unroll
    for (int u = 0; u < kSendEarly; ++u)
      if (lane + 32 * u < n16) v[u] = device::ld_nc_v4_l2_prefetch_256b(src + lane + 32 * u);

    // 2. Destinations.
    const uint32_t dest_mask = __ballot_sync(kFull, pos >= 0);
    if (!sender_may_store(p, ctx, seq, lane, dest_mask, ready, notified, local_base, dest_base,
                          dest_slab)) {
      if (lane == 0) device::hand_over_done(queue, warp, k);
      return;
    }
    const LaneDest mine = lane_dest(p, row, lane, pos, local_base, dest_slab, dest_base, region);
    const uint32_t store_mask = __ballot_sync(kFull, mine.row != nullptr);

    // 3. Stores: x to every destination (peers first), then each one's scales and metadata.
    const int num_dest = __popc(store_mask);
    uint32_t peers = store_mask & ~(1u << me);
    bool own = (store_mask >> me) & 1u;
    if (num_dest == 1) {
      int4* const to[1] = {shfl_ptr(reinterpret_cast<int4*>(mine.row), __ffs(store_mask) - 1)};
      send_row<1, false>(src, n16, v, to, lane);
    } else if (num_dest == 2) {
      const int d0 = next_destination(peers, own, me);
      const int d1 = next_destination(peers, own, me);
      int4* const to[2] = {shfl_ptr(reinterpret_cast<int4*>(mine.row), d0),
                           shfl_ptr(reinterpret_cast<int4*>(mine.row), d1)};
      send_row<2, false>(src, n16, v, to, lane);
    } else if (num_dest > 2) {
      int4* to[kMaxRanks];
#pragma unroll
      for (int a = 0; a < kMaxRanks; ++a) {
        const int d = next_destination(peers, own, me);
        int4* ptr = shfl_ptr(reinterpret_cast<int4*>(mine.row), d < 0 ? 0 : d);
        to[a] = d < 0 ? nullptr : ptr;
      }
      send_row<kMaxRanks, true>(src, n16, v, to, lane);
    }
    peers = store_mask & ~(1u << me);
    own = (store_mask >> me) & 1u;
    for (int d = next_destination(peers, own, me); d >= 0; d = next_destination(peers, own, me))
      store_token_side(p, row, me, d, shfl_ptr(mine.row, d), shfl_ptr(mine.slab, d),
                       __shfl_sync(kFull, mine.lrow, d), t, lane, sc0, sc1, with_meta, idx, w);
    // Hand the token to the publisher (covers every lane's stores: bar.warp.sync + release).
    __syncwarp();
    bool ok = true;
    if (lane == 0) ok = device::hand_over(ctx, queue, warp, k, t);
    if (!__shfl_sync(kFull, ok, 0)) return;
    t = __shfl_sync(kFull, claimed, 0);
  }
  if (lane == 0) device::hand_over_done(queue, warp, k);
}

// Lane l publishes the rows of the tokens sender warp l of this block hands over.
// Shared-memory-staged sender for rows of at most kStagedRowBytes (FP8 rows): with short rows
// the register path spends most of a token waiting for its loads (three batches of x loads, each
// one memory latency), not storing. Here every lane copies the next token's x chunks into the
// warp's other shared-memory stage with cp.async (no registers held) and loads its send_pos, ids,
// weights and scales into registers while the current token is stored, so a token's stores start
// without waiting for memory. Each lane reads back only the chunks it copied itself, so
// cp.async.wait_group alone orders them (no warp barrier). A warp owns its first two tokens;
// it claims each later one after storing the token before it (not before): a warp then holds at
// most two tokens when the counter runs out, so the senders end closer together (FP8 dispatch
// rows of tests/native/nvlink_bench.cu). The next token's inputs load after the wait for the
// current token's staged row, not before: cp.async.wait_group compiles to a scoreboard wait that
// global loads issued before it share, so it would also wait for those loads, once per token.
struct TokenInputs {
  int pos = -1;  // lane < R: send_pos[t, lane]
  long long idx = -1;
  float w = 0.0f, sc0 = 0.0f, sc1 = 0.0f;
};

__device__ void dispatch_send_staged(const DispatchParams& p, const device::WaitContext& ctx,
                                     uint64_t seq, int warp, int lane, device::PublishQueue& queue,
                                     int4* stage) {
  const CommContext& c = p.comm;
  const int R = c.num_ranks, me = c.rank, K = p.num_topk, S = p.num_scales;
  const DispatchRow row = DispatchRow::make(p.hidden_bytes, S, K);
  const int n16 = p.hidden_bytes / 16;
  const int T = p.num_tokens;
  const bool with_meta = p.topk_idx != nullptr;
  int local_base = p.after_notify ? 0 : p.recv_prefix[me];
  bool notified = p.after_notify == 0;
  int dest_base = 0, dest_slab = -1;
  if (notified) load_dest_slabs(p, lane, dest_base, dest_slab);
  uint32_t ready = 1u << me;
  char* const region = lane_region(c, lane);  // lane d: our rows' region in d's buffer
  const int first = blockIdx.x * p.num_send_warps + warp, stride = gridDim.x * p.num_send_warps;

  auto prefetch = [&](int tt, int buf) {  // always commits a group (empty past the end)
    if (tt < T) {
      const int4* src = reinterpret_cast<const int4*>(static_cast<const char*>(p.x) +
                                                      size_t(tt) * p.hidden_bytes);
      for (int i = lane; i < n16; i += 32) device::cp_async_16(stage + buf * n16 + i, src + i);
    }
    device::cp_async_commit();
  };
  auto load_inputs = [&](int tt) {
    TokenInputs in;
    if (tt >= T) return in;
    if (lane < R) in.pos = p.send_pos[size_t(tt) * R + lane];
    if (with_meta && lane < K) {
      in.idx = load_idx(p.topk_idx, size_t(tt) * K + lane, p.idx_bytes);
      if (p.topk_weights != nullptr) in.w = p.topk_weights[size_t(tt) * K + lane];
    }
    if (lane < S) in.sc0 = p.scales[size_t(tt) * S + lane];
    if (lane + 32 < S) in.sc1 = p.scales[size_t(tt) * S + lane + 32];
    return in;
  };

  // t: the token being stored, t_next: the one staged behind it.
  int claimed = lane == 0 ? device::next_item(ctx.ctrl, -1, first, stride, 2) : 0;
  int t = __shfl_sync(kFull, claimed, 0);
  if (t < T) prefetch(t, 0);
  TokenInputs cur = load_inputs(t);
  claimed = lane == 0 && t < T ? device::next_item(ctx.ctrl, t, first, stride, 2) : T;
  int t_next = __shfl_sync(kFull, claimed, 0);
  int k = 0;
  for (; t < T; ++k) {
    // t_next's row travels while t is stored; its inputs load after t's row is in.
    prefetch(t_next, (k + 1) & 1);

    const uint32_t dest_mask = __ballot_sync(kFull, cur.pos >= 0);
    if (!sender_may_store(p, ctx, seq, lane, dest_mask, ready, notified, local_base, dest_base,
                          dest_slab))
      break;
    // Each destination in turn: lane d says where the row goes, the warp stores the staged row
    // there, then its scales and metadata.
    const LaneDest mine =
        lane_dest(p, row, lane, cur.pos, local_base, dest_slab, dest_base, region);
    const uint32_t store_mask = __ballot_sync(kFull, mine.row != nullptr);
    uint32_t peers = store_mask & ~(1u << me);
    bool own = (store_mask >> me) & 1u;
    device::cp_async_wait<1>();  // t's chunks are in stage k & 1 (t_next's may still travel)
    const TokenInputs nxt = load_inputs(t_next);
    const int4* in = stage + (k & 1) * n16;
    for (int d = next_destination(peers, own, me); d >= 0; d = next_destination(peers, own, me)) {
      char* to = shfl_ptr(mine.row, d);
      int4* to16 = reinterpret_cast<int4*>(to);
#pragma unroll 4
      for (int i = lane; i < n16; i += 32) device::st_v4_no_l1_allocate(to16 + i, in[i]);
      store_token_side(p, row, me, d, to, shfl_ptr(mine.slab, d), __shfl_sync(kFull, mine.lrow, d),
                       t, lane, cur.sc0, cur.sc1, with_meta, cur.idx, cur.w);
    }
    if (lane == 0 && t_next < T) claimed = device::next_item(ctx.ctrl, t_next, first, stride, 2);
    __syncwarp();
    bool ok = true;
    if (lane == 0) ok = device::hand_over(ctx, queue, warp, k, t);
    if (!__shfl_sync(kFull, ok, 0)) break;
    t = t_next;
    cur = nxt;
    t_next = __shfl_sync(kFull, claimed, 0);
  }
  device::cp_async_wait<0>();  // no copy into shared memory outlives the warp's work
  if (lane == 0) device::hand_over_done(queue, warp, k);
}

__device__ void dispatch_publish(const DispatchParams& p, const device::WaitContext& ctx,
                                 uint64_t seq, int lane, device::PublishQueue& queue) {
  const CommContext& c = p.comm;
  const int R = c.num_ranks, me = c.rank;
  // A row for a destination that lent us a receive slab adds 1 to its arrivals word for us
  // instead of setting the row's flag (same ordering: after the publisher's fence).
  uint32_t lent = 0;
  if (p.dest_slabs != nullptr) {
    // Behind a running notify, its results first (the first token comes after them anyway).
    if (p.after_notify && !wait_notified(ctx, seq)) return;
    for (int d = 0; d < R; ++d)
      if (d != me && p.dest_slabs[2 * d + 1] >= 0) lent |= 1u << d;
  }
  device::publish_loop(ctx, lane, p.num_send_warps, queue, [&](int t) {
    for (int d = 0; d < R; ++d) {
      if (d == me) continue;
      const int pos = p.send_pos[size_t(t) * R + d];
      if (pos < 0) continue;
      char* peer = c.buffers.ptr[d];
      if ((lent >> d) & 1u)
        device::red_add_relaxed_sys(
            reinterpret_cast<uint64_t*>(peer + c.layout.arrivals_offset) + me, 1);
      else
        device::st_relaxed_sys(
            reinterpret_cast<uint64_t*>(peer + c.layout.dispatch_flag_offset(me, d, pos)), seq);
    }
  });
}

// In a lent receive slab (p.own_slab), the senders wrote every row in place: waits until each
// source's arrivals word counts all its rows, then zeroes the words for the next dispatch (its
// senders add only after its notify, which runs after this kernel). One warp of block 0.
__device__ void wait_slab_arrivals(const DispatchParams& p, const device::WaitContext& ctx,
                                   int lane) {
  const CommContext& c = p.comm;
  const int R = c.num_ranks, me = c.rank;
  uint64_t* arrivals = reinterpret_cast<uint64_t*>(c.buffers.ptr[me] + c.layout.arrivals_offset);
  if (lane < R && lane != me) {
    const uint64_t expected = uint64_t(p.recv_prefix[lane + 1] - p.recv_prefix[lane]);
    // Relaxed polls with a short sleep (this warp's SM still sends), one acquire at the end.
    if (device::spin_wait(ctx, lane, [&] {
          if (device::ld_relaxed_sys(arrivals + lane) >= expected)
            return device::ld_acquire_sys(arrivals + lane) >= expected;
          __nanosleep(64);
          return false;
        }))
      device::st_relaxed_sys(arrivals + lane, 0);
  }
  __syncwarp();
}

// In a lent receive slab, the rows of remote source s are output rows [recv_prefix[s],
// recv_prefix[s + 1]): their source rank is known here, so the senders do not write it. Global
// receive warp `first` of `stride` fills every stride-th row (the receive warps of a slab
// dispatch are otherwise idle; the kernel's end orders these stores before later work).
__device__ void fill_slab_src_rank(const DispatchParams& p, int first, int stride, int lane) {
  const int R = p.comm.num_ranks, me = p.comm.rank;
  for (int s = 0; s < R; ++s) {
    if (s == me) continue;
    const int end = p.recv_prefix[s + 1];
    for (int r = p.recv_prefix[s] + first * 32 + lane; r < end; r += stride * 32)
      p.recv_src_rank[r] = s;
  }
}

// Copies a received row (x, scales, metadata; `in`: its start in our buffer) from source `src`
// to output row r. Scales and metadata are loaded before the row copy, so their loads travel
// with the row's first loads (one latency per row, not one more after the copy).
__device__ __forceinline__ void copy_received_row(const DispatchParams& p, const DispatchRow& row,
                                                  const char* in, int r, int src, int lane) {
  const int K = p.num_topk, S = p.num_scales;
  const int n16 = p.hidden_bytes / 16;
  int4* out16 = reinterpret_cast<int4*>(static_cast<char*>(p.recv_x) + size_t(r) * p.hidden_bytes);
  const float* sc = reinterpret_cast<const float*>(in + row.scales_offset);
  const char* meta = in + row.meta_offset;
  const bool copy_scales = p.recv_scales != nullptr;
  const bool copy_meta = p.recv_topk_idx != nullptr;
  float sc0 = 0.0f, sc1 = 0.0f, mw = 0.0f;
  int mi = -1, msrc = -1;
  if (copy_scales && lane < S) sc0 = sc[lane];
  if (copy_scales && lane + 32 < S) sc1 = sc[lane + 32];
  if (copy_meta && lane < K) {
    mi = reinterpret_cast<const int*>(meta + 16)[lane];
    mw = reinterpret_cast<const float*>(meta + 16 + 4 * K)[lane];
  }
  if (lane == 0) msrc = reinterpret_cast<const int*>(meta + 8)[0];
  copy_row(reinterpret_cast<const int4*>(in), out16, n16, lane, 0);
  if (copy_scales) {
    float* sc_out = p.recv_scales + size_t(r) * S;
    if (lane < S) sc_out[lane] = sc0;
    if (lane + 32 < S) sc_out[lane + 32] = sc1;
    for (int j = lane + 64; j < S; j += 32) sc_out[j] = sc[j];
  }
  if (copy_meta && lane < K) {
    store_idx(p.recv_topk_idx, size_t(r) * K + lane, p.idx_bytes, mi);
    if (p.recv_topk_weights != nullptr) p.recv_topk_weights[size_t(r) * K + lane] = mw;
  }
  if (lane == 0) {
    if (p.recv_src_idx != nullptr) p.recv_src_idx[r] = msrc;
    if (p.recv_src_rank != nullptr) p.recv_src_rank[r] = src;
  }
}

// Claiming receivers (staged small rows): a warp takes the next row of a source from that
// source's counter (ControlBlock::recv_claimed; sources in turn), waits for its flag and copies
// it out, claiming its next row while it copies. Rows arrive roughly in slot order, so claimed
// rows are the next to arrive. Sender warps that have finished join in, so the copies that trail
// the last arrivals spread over more warps. They won for FP8 (staged) rows in nvlink_bench's
// dispatch rows on 2 GPUs; for BF16 rows the static receivers below were faster, so those keep
// them.
__device__ void dispatch_recv_claimed(const DispatchParams& p, const device::WaitContext& ctx,
                                      uint64_t seq, int lane, int start_source) {
  const CommContext& c = p.comm;
  const int R = c.num_ranks, me = c.rank;
  const DispatchRow row = DispatchRow::make(p.hidden_bytes, p.num_scales, p.num_topk);
  const int cap = p.num_worst_tokens;
  const int prefix = lane <= R ? p.recv_prefix[lane] : 0;  // lane s: first row of source s
  const int next_prefix = __shfl_down_sync(kFull, prefix, 1);
  const int count = lane < R && lane != me ? next_prefix - prefix : 0;
  uint32_t open = __ballot_sync(kFull, count > 0);  // sources that may have unclaimed rows
  char* const own = c.buffers.ptr[me];
  int s = start_source % R;
  int claimed = 0;  // lane 0: the row number its last atomicAdd returned
  // Picks the next open source and claims a row of it (lane 0's atomic, not yet read).
  auto issue = [&]() -> int {
    if (open == 0) return -1;
    while (!((open >> s) & 1u)) s = (s + 1) % R;
    const int src = s;
    s = (s + 1) % R;
    if (lane == 0) claimed = static_cast<int>(atomicAdd(&ctx.ctrl->recv_claimed[src], 1u));
    return src;
  };
  // Reads the claim of `src`: true with `slot` when the row exists, else closes the source.
  auto resolve = [&](int src, int& slot) {
    slot = __shfl_sync(kFull, claimed, 0);
    if (slot < __shfl_sync(kFull, count, src)) return true;
    open &= ~(1u << src);
    return false;
  };
  int slot = 0;
  int src = issue();
  while (src >= 0 && !resolve(src, slot)) src = issue();
  while (src >= 0) {
    const int cur_src = src, cur_slot = slot;
    const uint64_t* flag = reinterpret_cast<const uint64_t*>(
        own + c.layout.dispatch_flag_offset(cur_src, me, cur_slot));
    bool ok = true;
    if (lane == 0)
      ok = device::spin_wait(ctx, cur_src, [&] { return device::flag_arrived(flag, seq); });
    if (!__shfl_sync(kFull, ok, 0)) return;
    __syncwarp();   // lane 0's acquire orders every lane's payload reads below
    src = issue();  // the next claim travels while this row is copied
    // Past the capacity (worst-case overflow, which notify reports) nothing is written.
    const int r = __shfl_sync(kFull, prefix, cur_src) + cur_slot;
    if (cap == 0 || r < cap)
      copy_received_row(p, row, dispatch_row(c, own, cur_src, me, cur_slot, row.stride), r, cur_src,
                        lane);
    while (src >= 0 && !resolve(src, slot)) src = issue();
  }
}

template <bool kStaged>
__device__ void dispatch_recv(const DispatchParams& p, const device::WaitContext& ctx, uint64_t seq,
                              int warp, int lane) {
  const CommContext& c = p.comm;
  const int R = c.num_ranks, me = c.rank, K = p.num_topk, S = p.num_scales;
  const DispatchRow row = DispatchRow::make(p.hidden_bytes, S, K);
  const int n16 = p.hidden_bytes / 16;
  const int cap = p.num_worst_tokens;
  const int num_recv_warps = kWarps - p.num_send_warps - 1;
  const int first = blockIdx.x * num_recv_warps + (warp - p.num_send_warps - 1);
  const int stride = gridDim.x * num_recv_warps;
  const int prefix = lane <= R ? p.recv_prefix[lane] : 0;  // lane s: first row of source s
  const int total = __shfl_sync(kFull, prefix, R);
  // Lane s (a remote source) also keeps that source's row count.
  const int next_prefix = __shfl_down_sync(kFull, prefix, 1);
  const int count = lane < R && lane != me ? next_prefix - prefix : 0;

  // Worst-case mode: fill the padding rows first (their values are known before any arrival).
  if (cap > 0) {
    for (int r = total + first; r < cap; r += stride) {
      int4* out =
          reinterpret_cast<int4*>(static_cast<char*>(p.recv_x) + size_t(r) * p.hidden_bytes);
      for (int i = lane; i < n16; i += 32)
        device::st_v4_no_l1_allocate(out + i, make_int4(0, 0, 0, 0));
      if (p.recv_scales != nullptr)
        for (int j = lane; j < S; j += 32) p.recv_scales[size_t(r) * S + j] = 0.0f;
      if (p.recv_topk_idx != nullptr && lane < K) {
        store_idx(p.recv_topk_idx, size_t(r) * K + lane, p.idx_bytes, -1);
        if (p.recv_topk_weights != nullptr) p.recv_topk_weights[size_t(r) * K + lane] = 0.0f;
      }
      if (lane == 0) {
        if (p.recv_src_idx != nullptr) p.recv_src_idx[r] = -1;
        if (p.recv_src_rank != nullptr) p.recv_src_rank[r] = -1;
      }
    }
  }

  if (kStaged) {  // small rows: claiming receivers, joined by the senders as they finish
    dispatch_recv_claimed(p, ctx, seq, lane, warp);
    return;
  }
  int max_count = count;
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) max_count = max(max_count, __shfl_xor_sync(kFull, max_count, d));

  char* const own = c.buffers.ptr[me];
  // Batches of 32 rows per source: this lane polls row first + (k0 + lane) * stride.
  for (int k0 = 0; first + k0 * stride < max_count; k0 += 32) {
    const int my_slot = first + (k0 + lane) * stride;
    // Lane s keeps the mask of rows of source s still to copy (bit j: row of lane j).
    uint32_t my_pending = 0;
    for (int s = 0; s < R; ++s) {
      const uint32_t m = __ballot_sync(kFull, my_slot < __shfl_sync(kFull, count, s));
      if (lane == s) my_pending = m;
    }
    long long idle_since = 0;
    for (uint32_t idle = 0;;) {
      bool progressed = false;
      uint32_t left = 0;
      for (int s = 0; s < R; ++s) {
        uint32_t pending = __shfl_sync(kFull, my_pending, s);
        if (pending == 0) continue;
        bool arrived = false;
        if ((pending >> lane) & 1u) {
          const uint64_t* flag = reinterpret_cast<const uint64_t*>(
              own + c.layout.dispatch_flag_offset(s, me, my_slot));
          arrived = device::flag_arrived(flag, seq);
        }
        uint32_t ready = __ballot_sync(kFull, arrived);
        __syncwarp();  // the polling lanes' acquires order every lane's payload reads below
        pending &= ~ready;
        if (lane == s) my_pending = pending;
        left |= pending;
        progressed |= ready != 0;
        const int base = __shfl_sync(kFull, prefix, s);
        while (ready != 0) {
          const int j = __ffs(ready) - 1;
          ready &= ready - 1;
          const int slot = first + (k0 + j) * stride;
          const int r = base + slot;
          if (cap > 0 && r >= cap) continue;  // overflow: reported by notify, nothing written
          copy_received_row(p, row, dispatch_row(c, own, s, me, slot, row.stride), r, s, lane);
        }
      }
      if (left == 0) break;
      if (progressed) {
        idle = 0;
        continue;
      }
      if (idle++ == 0) idle_since = clock64();
      __nanosleep(kRecvSleepNs);  // leave the issue slots to the working warps of this SM
      if ((idle & 63u) == 0) {
        if (device::aborted(ctx)) return;
        if (clock64() - idle_since > ctx.timeout_cycles) {
          // Name the first source still missing.
          const int stalled = __ffs(__ballot_sync(kFull, my_pending != 0)) - 1;
          if (lane == 0) device::raise_timeout(ctx, stalled);
          return;
        }
      }
    }
  }
}

// kStaged (DispatchParams::staged): a separate instance, so the register-path kernel (BF16
// rows) keeps its own register allocation: with both paths in one kernel it spilled more and
// its BF16 dispatch ran slower.
template <bool kStaged>
__global__ void __launch_bounds__(kNvlinkThreads, 1)
    nvlink_dispatch_kernel(const __grid_constant__ DispatchParams p) {
  static_assert(kWarps <= device::kMaxSenderWarps, "publish queue too small");
  __shared__ uint64_t s_seq;
  __shared__ int s_rejected;
  __shared__ device::PublishQueue s_queue;  // sender warps -> publisher warp
  extern __shared__ int4 s_stage[];         // staged senders: [send warps][2][hidden_bytes / 16]
  const CommContext& c = p.comm;
  const int me = c.rank, R = c.num_ranks;
  const int warp = threadIdx.x / 32, lane = device::lane_id();
  ControlBlock* ctrl = reinterpret_cast<ControlBlock*>(c.buffers.ptr[me]);
  if (threadIdx.x == 0) {
    s_seq = device::read_sequence(ctrl);
    // A normal dispatch follows its notify, which found every rank's routing valid or not (the
    // same verdict on every rank); a cached dispatch reuses a routing that was valid. Launched
    // behind a notify still running, each role reads the verdict once it has waited for it.
    s_rejected = p.topk_idx != nullptr && p.after_notify == 0
                     ? *reinterpret_cast<volatile int*>(&ctrl->rejected_ranks)
                     : 0;
  }
  if (threadIdx.x < device::kMaxSenderWarps) {
    s_queue.progress[threadIdx.x] = 0;
    s_queue.published[threadIdx.x] = 0;
  }
  __syncthreads();
  const uint64_t seq = s_seq;
  const device::WaitContext ctx{ctrl, c.error, c.timeout_cycles,
                                p.topk_idx != nullptr ? kOpDispatch : kOpCachedDispatch, me};
  // Tell every peer we have entered this sequence (so finished all earlier kernels).
  if (blockIdx.x == 0 && threadIdx.x < R && int(threadIdx.x) != me)
    device::st_release_sys(
        reinterpret_cast<uint64_t*>(c.buffers.ptr[threadIdx.x] + c.layout.entered_offset) + me,
        seq);

  // Receiving needs notify's counts and verdict (behind a running notify: wait for them).
  auto may_receive = [&] {
    if (!p.after_notify) return true;
    return wait_notified(ctx, seq) &&
           (p.topk_idx == nullptr || *reinterpret_cast<volatile int*>(&ctrl->rejected_ranks) == 0);
  };
  if (!device::aborted(ctx) && s_rejected == 0) {
    if (warp < p.num_send_warps) {
      if (kStaged)
        dispatch_send_staged(p, ctx, seq, warp, lane, s_queue,
                             s_stage + size_t(warp) * 2 * (p.hidden_bytes / 16));
      else
        dispatch_send(p, ctx, seq, warp, lane, s_queue);
      // Done sending: help copy out what has arrived; in a lent slab, warp 0 of block 0 waits
      // for the arrival counts instead (nothing to copy).
      if (p.own_slab) {
        if (blockIdx.x == 0 && warp == 0 && may_receive()) wait_slab_arrivals(p, ctx, lane);
      } else if (kStaged && may_receive()) {
        dispatch_recv_claimed(p, ctx, seq, lane, warp);
      }
    } else if (warp == p.num_send_warps) {
      dispatch_publish(p, ctx, seq, lane, s_queue);
    } else if (!p.own_slab) {
      if (may_receive()) dispatch_recv<kStaged>(p, ctx, seq, warp, lane);
    } else if (p.recv_src_rank != nullptr && may_receive()) {
      const int num_recv_warps = kWarps - p.num_send_warps - 1;
      fill_slab_src_rank(p, blockIdx.x * num_recv_warps + (warp - p.num_send_warps - 1),
                         gridDim.x * num_recv_warps, lane);
    }
  }
  // Block 0 also sees every peer enter, even peers it sent nothing to: each kernel then waits on
  // every peer, which the notify slots' parity scheme relies on.
  if (blockIdx.x == 0 && warp == 0) {
    const uint64_t* entered =
        reinterpret_cast<const uint64_t*>(c.buffers.ptr[me] + c.layout.entered_offset);
    if (lane < R && lane != me && !device::aborted(ctx))
      device::spin_wait(ctx, lane, [&] { return device::ld_acquire_sys(entered + lane) >= seq; });
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // The epoch advances after the paired notify has finished (it shares our sequence number).
    device::wait_for_prerequisite_grid();
    device::finish_block(ctrl, seq);
  }
}

}  // namespace

cudaError_t preload_nvlink_dispatch() {
  cudaFuncAttributes attr;
  const cudaError_t e = cudaFuncGetAttributes(&attr, nvlink_dispatch_kernel<false>);
  return e != cudaSuccess ? e : cudaFuncGetAttributes(&attr, nvlink_dispatch_kernel<true>);
}

// The largest stage (every send warp, the longest staged row) fits beside the kernel's static
// shared memory in the 227 KB a block of sm_90 may opt in to (a group of one rank uses 14 warps).
static_assert(size_t(kNvlinkMaxSendWarps) * 2 * kStagedRowBytes + sizeof(device::PublishQueue) +
                      64 <=
                  227 * 1024,
              "the staged dispatch's shared memory exceeds what a block may use");

size_t nvlink_dispatch_stage_bytes(int hidden_bytes, int num_send_warps) {
  return size_t(num_send_warps) * 2 * size_t(hidden_bytes);
}

cudaError_t launch_nvlink_dispatch(const DispatchParams& p, int num_sms, cudaStream_t stream) {
  const size_t smem = p.staged ? nvlink_dispatch_stage_bytes(p.hidden_bytes, p.num_send_warps) : 0;
  // Only the staged instance has dynamic shared memory (a 48 KB stage once failed to launch
  // without the opt-in: static shared memory counts against the default 48 KB).
  static std::atomic<size_t> allowed[64];
  const cudaError_t e = allow_dynamic_smem(nvlink_dispatch_kernel<true>, smem, allowed);
  if (e != cudaSuccess) return e;
  auto* kernel = p.staged ? nvlink_dispatch_kernel<true> : nvlink_dispatch_kernel<false>;
  if (!p.after_notify) {
    kernel<<<num_sms, kNvlinkThreads, smem, stream>>>(p);
    return cudaGetLastError();
  }
  // Behind its notify: may start as soon as notify has started (it triggers at once).
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  return launch_with_attribute(kernel, p, dim3(num_sms), dim3(kNvlinkThreads), smem, stream, attr);
}

}  // namespace ep
