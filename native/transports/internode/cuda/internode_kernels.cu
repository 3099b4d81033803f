// The hierarchical internode kernels: dispatch (notify -> pack -> RDMA leg overlapped with NVLink
// forwarding, chunk by chunk -> node barrier -> unpack) and combine (NVLink leg -> node barrier ->
// per-node reduction and RDMA leg overlapped with the sum over nodes, group by group), each a
// sequence of kernels on one stream (docs/internode.md).
//
// Cross-node traffic uses only nvshmemx_putmem_nbi / putmem_signal_nbi (block and warp),
// nvshmemx_signal_op, nvshmem_fence and nvshmem_quiet; a rank reads the signal words of its own
// region. Peer memory is touched
// with plain loads and stores only for ranks of the caller's own node (Context::node_peer, which
// the runtime fills from nvshmem_ptr of node-local ranks only).
#include <cuda_bf16.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "common/ptx.cuh"
#include "transports/internode/cuda/internode_common.hpp"
#include "transports/internode/cuda/internode_kernels.hpp"

namespace ep {
namespace internode {
namespace {

constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ int global_warp() {
  return static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x) / 32;
}
__device__ __forceinline__ int num_warps() {
  return static_cast<int>(gridDim.x) * kWarps;
}
__device__ __forceinline__ int lane_id() {
  return static_cast<int>(threadIdx.x) & 31;
}

// The call a kernel belongs to: its number comes from the device (Control::seq, incremented by
// the first kernel of every call), so that the replays of a CUDA graph are calls of their own.
struct Call {
  uint64_t seq;  // >= 1, the same on every rank
  int parity;    // which set of receive buffers the call uses
  bool ok;       // false: the notify rejected the call on every rank; its kernels move nothing
};

__device__ __forceinline__ Call make_call(uint64_t seq, int ok) {
  return Call{seq, static_cast<int>(seq % kNumParities), ok != 0};
}

// Every kernel after the first of a call (which wrote both words before this kernel started).
__device__ __forceinline__ Call this_call(const Context& c) {
  return make_call(c.ctrl->seq, c.ctrl->call_ok);
}

// The first kernel of a call, one thread: the next call number, published for the host's
// diagnosis (progress()).
__device__ __forceinline__ uint64_t next_seq(const Context& c) {
  const uint64_t seq = c.ctrl->seq + 1;
  c.ctrl->seq = seq;
  reinterpret_cast<volatile uint64_t*>(c.progress)[kLatestSeqWord] = seq;
  return seq;
}

// Block 0's thread 0 records that this call's kernels reached `stage` (host-mapped, diagnosis).
__device__ __forceinline__ void mark(const Context& c, const Call& call, int stage) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    reinterpret_cast<volatile uint64_t*>(c.progress)[stage] = call.seq;
  }
}

__device__ __forceinline__ bool aborted(const Context& c) {
  return ptx::ld_volatile_int(&c.ctrl->abort) != 0;
}

// First error wins.
__device__ __forceinline__ void report(const Context& c, int code, int peer, long long a,
                                       long long b) {
  if (atomicCAS(&c.ctrl->error_lock, 0, 1) == 0) {
    publish_error_record(c.err, c.op, c.rank, code, peer, a, b);
  }
}

// Block 0's thread 0 records the wait it is in (WaitWord; host-mapped, diagnosis): the host names
// the peer when its own bounded wait for the kernels runs out.
__device__ __forceinline__ void mark_wait(const Context& c, const Call& call, int stage,
                                          int peer_rank, uint64_t target, uint64_t seen) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    volatile uint64_t* w = reinterpret_cast<volatile uint64_t*>(c.progress) + kNumStages;
    w[kWaitStage] = static_cast<uint64_t>(stage);
    w[kWaitPeer] = static_cast<uint64_t>(peer_rank);
    w[kWaitTarget] = target;
    w[kWaitSeen] = seen;
    __threadfence_system();  // the fields before the call number the host reads them by
    w[kWaitSeq] = call.seq;
  }
}

// One thread: spins until *word >= target and returns the value it saw; 0 on timeout (recorded:
// the awaited rank, the timeout, the awaited rank's node) or after an earlier timeout (abort).
// `target` is never 0 (it carries the call number, >= 1), so 0 means "gave up".
__device__ uint64_t wait_at_least(const Context& c, const Call& call, const uint64_t* word,
                                  uint64_t target, int peer_rank, int stage) {
  uint64_t v = ptx::ld_acquire_sys(word);
  if (v >= target) return v;
  mark_wait(c, call, stage, peer_rank, target, v);
  if (aborted(c)) return 0;
  const uint64_t start = ptx::global_timer_ns();
  for (uint32_t iter = 1;; ++iter) {
    v = ptx::ld_acquire_sys(word);
    if (v >= target) return v;
    if ((iter & 127u) == 0) {
      if (aborted(c)) return 0;
      if (static_cast<long long>(ptx::global_timer_ns() - start) > c.timeout_ns) {
        mark_wait(c, call, stage, peer_rank, target, v);
        report(c, kErrorTimeout, peer_rank, c.timeout_ns, c.rank_node[peer_rank]);
        atomicExch(&c.ctrl->abort, 1);
        return 0;
      }
    }
  }
}

// A signal word of this call carries its call number (`seq` in the high 32 bits of an RDMA
// signal, the whole word of a combine signal). A larger one is a later call's: the ranks are out
// of step (a host-side bug), and the word's count belongs to another call. Reported, never used.
__device__ __forceinline__ bool same_call(const Context& c, const Call& call, uint64_t seen,
                                          int peer_rank) {
  if (seen == call.seq) return true;
  report(c, kErrorOutOfStep, peer_rank, static_cast<long long>(seen),
         static_cast<long long>(call.seq));
  atomicExch(&c.ctrl->abort, 1);
  return false;
}

// A warp copies `bytes` bytes (any alignment; 16-byte vectors where both ends allow). kFromL2:
// the source was written by a peer while this kernel runs (loads bypass L1: ld.cg).
template <bool kFromL2 = false>
__device__ __forceinline__ void warp_copy(char* dst, const char* src, int64_t bytes, int lane) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                      static_cast<uintptr_t>(bytes);
  if ((a & 15u) == 0) {
    const int4* s = reinterpret_cast<const int4*>(src);
    int4* d = reinterpret_cast<int4*>(dst);
    auto load = [s](int64_t i) { return kFromL2 ? __ldcg(s + i) : s[i]; };
    const int64_t n = bytes / 16;
    int64_t i = lane;
    // Four loads in flight per lane before their stores: one at a time, a row's copy is a chain
    // of load latencies (a warp copies a 14 KB row in 28 dependent steps).
    for (; i + 96 < n; i += 128) {
      const int4 v0 = load(i);
      const int4 v1 = load(i + 32);
      const int4 v2 = load(i + 64);
      const int4 v3 = load(i + 96);
      d[i] = v0;
      d[i + 32] = v1;
      d[i + 64] = v2;
      d[i + 96] = v3;
    }
    for (; i < n; i += 32) d[i] = load(i);
  } else if ((a & 3u) == 0) {
    const int* s = reinterpret_cast<const int*>(src);
    int* d = reinterpret_cast<int*>(dst);
    for (int64_t i = lane; i < bytes / 4; i += 32) d[i] = kFromL2 ? __ldcg(s + i) : s[i];
  } else {
    for (int64_t i = lane; i < bytes; i += 32) {
      dst[i] = kFromL2 ? static_cast<char>(__ldcg(reinterpret_cast<const signed char*>(src) + i))
                       : src[i];
    }
  }
}

// A warp zeroes `bytes` bytes (16-byte stores where the span allows).
__device__ __forceinline__ void warp_zero(char* dst, int64_t bytes, int lane) {
  if (((reinterpret_cast<uintptr_t>(dst) | static_cast<uintptr_t>(bytes)) & 15u) == 0) {
    int4* d = reinterpret_cast<int4*>(dst);
    for (int64_t i = lane; i < bytes / 16; i += 32) d[i] = make_int4(0, 0, 0, 0);
  } else {
    for (int64_t i = lane; i < bytes; i += 32) dst[i] = 0;
  }
}

__device__ __forceinline__ int node_rank(const Context& c, int node, int local) {
  return c.node_rank[node * c.ranks_per_node + local];
}

__device__ __forceinline__ uint64_t* sig_word(const Context& c, int64_t offset, int index) {
  return reinterpret_cast<uint64_t*>(c.region + offset) + index;
}

// ---- notify --------------------------------------------------------------------------------

// The exclusive prefix sum of one value per thread over the block (blockDim.x a multiple of 32,
// at most 1024); `total` gets the sum. Every thread of the block calls it.
__device__ int block_exclusive_scan(int value, int* total) {
  __shared__ int warp_sums[32];
  const int lane = lane_id();
  const int warp = static_cast<int>(threadIdx.x) / 32;
  int inclusive = value;
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += v;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int warps = static_cast<int>(blockDim.x) / 32;
    int s = lane < warps ? warp_sums[lane] : 0;
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, s, d);
      if (lane >= d) s += v;
    }
    warp_sums[lane] = s;  // inclusive over warps
  }
  __syncthreads();
  const int before = warp == 0 ? 0 : warp_sums[warp - 1];
  *total = warp_sums[static_cast<int>(blockDim.x) / 32 - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return before + inclusive - value;
}

// The plan of this rank's rows (NotifyParams): each row's slot at its receivers (its index among
// the tokens sent there, after the rows of lower source ranks) and its index among the tokens
// sent to each node. Every thread of the block calls it, after p.offsets was written.
__device__ void write_plan(const NotifyParams& p, const Context& c) {
  const int R = c.num_ranks;
  const int N = c.num_nodes;
  const int T = p.num_tokens;
  const int64_t cells = static_cast<int64_t>(T) * R;
  for (int64_t i = threadIdx.x; i < cells; i += blockDim.x) {
    const int s = p.send_pos[i];
    p.dest_slot[i] = s >= 0 ? s + p.offsets[i % R] : -1;
  }
  // Node columns: each thread counts a contiguous run of tokens, then one block scan per node.
  const int per_thread = (T + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
  const int t0 = min(T, static_cast<int>(threadIdx.x) * per_thread);
  const int t1 = min(T, t0 + per_thread);
  for (int n = 0; n < N; ++n) {
    const auto in_node = [&](int t) {
      bool any = false;
      for (int l = 0; l < c.ranks_per_node; ++l) {
        any |= p.is_token_in_rank[static_cast<int64_t>(t) * R + node_rank(c, n, l)];
      }
      return any;
    };
    int count = 0;
    for (int t = t0; t < t1; ++t) count += in_node(t) ? 1 : 0;
    int total = 0;
    int next = block_exclusive_scan(count, &total);
    for (int t = t0; t < t1; ++t) {
      p.node_pos[static_cast<int64_t>(t) * N + n] = in_node(t) ? next++ : -1;
    }
    if (threadIdx.x == 0) p.node_count[n] = total;
  }
}

// One block, the first kernel of a (cached) dispatch: starts the call (its number), puts this
// rank's count row to every rank with a signal (put-with-signal: the signal lands after the row),
// waits for every rank's row of this call, and derives from the [source, destination] matrix
// where this rank's rows land at each receiver (rows of lower source ranks first) and what it
// receives. Every rank sees the same matrix, so every rank takes the same decision on a rejected
// call (an out-of-range top-k id on some rank, or a receiver over `limit` rows).
__global__ void __launch_bounds__(kThreads) notify_kernel(const __grid_constant__ NotifyParams p) {
  const Context& c = p.c;
  const int R = c.num_ranks;
  const int64_t cols = count_columns(R);
  const int64_t stride = count_row_words(R, c.layout.cap);  // words between two ranks' rows
  const int epr = p.per_expert != nullptr ? p.experts_per_rank : 0;
  __shared__ uint64_t first_seq;
  __shared__ int rejected;
  __shared__ int waited_ok;
  __shared__ unsigned long long most;  // (rows << 32) | receiver of the largest receive count
  __shared__ int invalid_rank;         // lowest source with an out-of-range top-k id, or R
  __shared__ int received;
  __shared__ int my_invalid;  // this rank's ids outside [-1, num_experts)
  if (threadIdx.x == 0) {
    first_seq = next_seq(c);
    waited_ok = aborted(c) ? 0 : 1;
    most = 0;
    invalid_rank = R;
    received = 0;
    my_invalid = 0;
  }
  __syncthreads();
  const Call call = make_call(first_seq, waited_ok);
  mark(c, call, kStageNotify);
  // A call that cannot go on (an earlier timeout, or its own waits failed): nothing moves, and
  // the host, which may wait for this call's counts, gets its ticket and then the error record.
  const auto give_up = [&] {
    if (threadIdx.x == 0) {
      c.ctrl->call_ok = 0;
      __threadfence_system();
      reinterpret_cast<volatile NotifyHost*>(p.host)->ticket = p.ticket;
    }
  };
  if (!waited_ok) {
    give_up();
    return;
  }
  // One row per destination d: the count columns (alike for all), then the tokens this rank sends
  // to each of d's experts.
  int* rows_out = reinterpret_cast<int*>(c.region + c.layout.count_send);
  for (int64_t i = threadIdx.x; i < static_cast<int64_t>(R) * R; i += blockDim.x) {
    rows_out[(i / R) * stride + i % R] = p.per_rank[i % R];
  }
  for (int64_t i = threadIdx.x; i < static_cast<int64_t>(R) * epr; i += blockDim.x) {
    const int64_t d = i / epr;
    rows_out[d * stride + cols + i % epr] = p.per_expert[i];  // expert d * epr + e
  }
  if (p.topk_idx != nullptr) {
    // The layout counted these ids as -1; the call is rejected on every rank if any rank had one.
    int bad = 0;
    const int64_t n = static_cast<int64_t>(p.num_tokens) * p.num_topk;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const int64_t v = p.topk_idx[i];
      bad += (v < -1 || v >= p.num_experts) ? 1 : 0;
    }
    if (bad > 0) atomicAdd(&my_invalid, bad);
  }
  __syncthreads();
  for (int d = static_cast<int>(threadIdx.x); d < R; d += static_cast<int>(blockDim.x)) {
    rows_out[d * stride + R + kCountTokens] = p.num_tokens;
    rows_out[d * stride + R + kCountInvalid] = my_invalid;
  }
  // The row is read by warp 0's puts (and, over RDMA, by the NIC).
  __threadfence_system();
  __syncthreads();
  const int64_t my_row = (static_cast<int64_t>(call.parity) * R + c.rank) * stride;
  uint64_t* my_signal = sig_word(c, c.layout.notify_sig, call.parity * R + c.rank);
  if (threadIdx.x < 32) {
    for (int d = 0; d < R; ++d) {
      nvshmemx_putmem_signal_nbi_warp(
          reinterpret_cast<int*>(c.region + c.layout.count_rows) + my_row, rows_out + d * stride,
          static_cast<size_t>(4 * (cols + epr)), my_signal, call.seq, NVSHMEM_SIGNAL_SET, d);
    }
    __syncwarp();
    // The row is rewritten by the next call's notify: its puts complete first.
    if (threadIdx.x == 0) nvshmem_quiet();
  }
  for (int s = static_cast<int>(threadIdx.x); s < R; s += static_cast<int>(blockDim.x)) {
    const uint64_t v = wait_at_least(c, call, sig_word(c, c.layout.notify_sig, call.parity * R + s),
                                     call.seq, s, kStageNotify);
    if (v == 0 || !same_call(c, call, v, s)) waited_ok = 0;
  }
  __syncthreads();
  mark(c, call, kStageNotifyWaited);
  if (!waited_ok) {  // a timeout or a call out of step: recorded (fatal)
    give_up();
    return;
  }
  const int* m = reinterpret_cast<const int*>(c.region + c.layout.count_rows) +
                 static_cast<int64_t>(call.parity) * R * stride;
  for (int d = static_cast<int>(threadIdx.x); d < R; d += static_cast<int>(blockDim.x)) {
    int before = 0;
    int total = 0;
    for (int s = 0; s < R; ++s) {
      const int v = m[s * stride + d];
      before += s < c.rank ? v : 0;
      total += v;
    }
    p.offsets[d] = before;
    atomicMax(&most, (static_cast<unsigned long long>(total) << 32) | static_cast<unsigned>(d));
    if (d == c.rank) received = total;
  }
  for (int s = static_cast<int>(threadIdx.x); s < R; s += static_cast<int>(blockDim.x)) {
    p.recv_counts[s] = m[s * stride + c.rank];
    if (m[s * stride + R + kCountInvalid] > 0) atomicMin(&invalid_rank, s);
  }
  int* host_counts = reinterpret_cast<int*>(reinterpret_cast<char*>(p.host) + sizeof(NotifyHost));
  for (int64_t i = threadIdx.x; i < R * cols; i += blockDim.x) {
    host_counts[i] = m[(i / cols) * stride + i % cols];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    *p.num_recv = received;
    const int most_rows = static_cast<int>(most >> 32);
    int reason = kRejectNone;
    int64_t a = 0;
    int64_t b = 0;
    if (invalid_rank < R) {
      reason = kRejectInvalidTopk;
      a = invalid_rank;
      b = m[invalid_rank * stride + R + kCountInvalid];
    } else if (p.limit > 0 && most_rows > p.limit) {
      reason = kRejectWorstTokens;
      a = static_cast<int64_t>(most & 0xffffffffu);
      b = most_rows;
    }
    c.ctrl->call_ok = reason == kRejectNone ? 1 : 0;
    rejected = reason == kRejectNone ? 0 : 1;
    volatile NotifyHost* h = p.host;
    if (reason != kRejectNone && p.report_rejection) {
      h->reason = reason;
      h->a = a;
      h->b = b;
      h->limit = p.limit;
      __threadfence_system();
      h->rejections = h->rejections + 1;
    }
  }
  __syncthreads();
  // Rows received per local expert (a rejected call receives none), rounded up to the alignment.
  int* host_experts = host_counts + R * cols;
  for (int e = static_cast<int>(threadIdx.x); e < epr; e += static_cast<int>(blockDim.x)) {
    int rows = 0;
    for (int s = 0; s < R; ++s) rows += m[s * stride + cols + e];
    const int align = p.expert_alignment;
    rows = rejected ? 0 : (rows + align - 1) / align * align;
    p.recv_per_expert[e] = rows;
    host_experts[e] = rows;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // the counts before the ticket the host reads them by
    reinterpret_cast<volatile NotifyHost*>(p.host)->ticket = p.ticket;
  }
  // After the ticket: the host's count wait does not wait for the plan; the dispatch kernels,
  // behind this one on the stream, read it. (A rejected call's kernels move nothing.)
  __syncthreads();
  write_plan(p, c);
}

// One thread, the first kernel of a combine: starts the call.
__global__ void begin_kernel(const __grid_constant__ Context c) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  next_seq(c);
  c.ctrl->call_ok = 1;
}

// ---- dispatch ------------------------------------------------------------------------------

// Stage 0: one RDMA record per (token, destination node) into send_buf[node][position].
__global__ void __launch_bounds__(kThreads) pack_kernel(const __grid_constant__ DispatchParams p) {
  const Context& c = p.c;
  const Call call = this_call(c);
  if (!call.ok) return;
  mark(c, call, kStagePack);
  if (aborted(c)) return;
  const int lane = lane_id();
  const RecordLayout& r = c.rec;
  const int64_t T = c.layout.cap.max_tokens;
  const int K = static_cast<int>(r.topk);
  const int pairs = p.num_tokens * c.num_nodes;
  for (int pair = global_warp(); pair < pairs; pair += num_warps()) {
    const int t = pair / c.num_nodes;
    const int n = pair % c.num_nodes;
    const int k = p.node_pos[static_cast<int64_t>(t) * c.num_nodes + n];
    if (k < 0) continue;
    char* rec = c.region + c.layout.send_buf + (n * T + k) * r.r_bytes;
    if (lane == 0) reinterpret_cast<int*>(rec)[0] = t;
    if (lane < c.ranks_per_node) {
      reinterpret_cast<int*>(rec + r.r_slots)[lane] =
          p.dest_slot[static_cast<int64_t>(t) * c.num_ranks + node_rank(c, n, lane)];
    }
    warp_copy(rec + r.r_x, p.x + t * r.x_bytes, r.x_bytes, lane);
    if (r.scale_bytes > 0) {
      warp_copy(rec + r.r_scales, p.x_scales + t * r.scale_bytes, r.scale_bytes, lane);
    }
    if (K > 0 && lane < K) {
      reinterpret_cast<int64_t*>(rec + r.r_topk)[lane] =
          p.topk_idx[static_cast<int64_t>(t) * K + lane];
      reinterpret_cast<float*>(rec + r.r_weights)[lane] =
          p.topk_weights != nullptr ? p.topk_weights[static_cast<int64_t>(t) * K + lane] : 0.0f;
    }
  }
}

// The chunk signal of (source node `n`'s chunk `j`) at a forwarder, for this call's parity.
__device__ __forceinline__ uint64_t* chunk_signal(const Context& c, int parity, int n, int j) {
  return sig_word(
      c, c.layout.rdma_chunk_sig,
      (parity * c.num_nodes + n) * static_cast<int>(put_chunks(c.layout.cap.max_tokens)) + j);
}

// Stages 1 and 2 in one kernel, so that forwarding (NVLink) runs while the RDMA leg is in flight.
// Every block is first a source, then a forwarder:
//  * source: block 0 signals each node's forwarder (the rank with my local index there) how many
//    records it gets, (seq << 32) | count, count 0 included; then the blocks put the records, in
//    chunks of kPutChunkRows, round robin over the destination nodes (mine last: a local copy),
//    each chunk with put-with-signal (its word at the forwarder is set to seq once its bytes
//    have landed). No source waits for anything, so no rank's forwarding can hold up a put.
//  * forwarder: waits for the counts of every source node (block 0's thread per block), then
//    each warp takes records interleaved over the source nodes, waits for the record's chunk
//    signal and writes its row over NVLink to the local ranks its slot table names, at that slot
//    of their nvl_recv, with top-k rewritten for them. Records are read from L2 (ld.cg): a chunk
//    lands while this kernel runs, and a line of it may sit in L1 from a neighbouring record.
//  * finally each block's thread 0 runs nvshmem_quiet: the puts are complete before the next
//    call's pack rewrites send_buf.
__global__ void __launch_bounds__(kThreads)
    put_forward_kernel(const __grid_constant__ DispatchParams p) {
  const Context& c = p.c;
  const Call call = this_call(c);
  if (!call.ok) return;
  mark(c, call, kStagePutForward);
  const RecordLayout& r = c.rec;
  const int64_t T = c.layout.cap.max_tokens;
  const int N = c.num_nodes;
  __shared__ int chunks[kMaxNodes];
  __shared__ int most_chunks;
  __shared__ int counts[kMaxNodes];
  __shared__ int most_records;
  __shared__ int ok;
  if (threadIdx.x == 0) {
    // One thread decides for the block: the source loop's puts are block-collective.
    ok = !aborted(c);
    int most = 0;
    for (int n = 0; n < N; ++n) {
      chunks[n] = static_cast<int>(put_chunks(p.node_count[n]));
      most = max(most, chunks[n]);
    }
    most_chunks = most;
    if (ok && blockIdx.x == 0) {
      for (int n = 0; n < N; ++n) {
        const uint64_t value = (call.seq << 32) | static_cast<uint32_t>(p.node_count[n]);
        nvshmemx_signal_op(sig_word(c, c.layout.rdma_sig, call.parity * N + c.node), value,
                           NVSHMEM_SIGNAL_SET, node_rank(c, n, c.local));
      }
    }
  }
  __syncthreads();
  if (!ok) return;
  mark(c, call, kStageCountsSignalled);
  // Source: chunk j of every node before chunk j + 1 of any, so every forwarder gets data early.
  const int items = most_chunks * N;
  for (int item = static_cast<int>(blockIdx.x); item < items; item += static_cast<int>(gridDim.x)) {
    const int j = item / N;
    const int n = (c.node + 1 + item % N) % N;
    if (j >= chunks[n]) continue;
    const int first = j * kPutChunkRows;
    const int rows = min(kPutChunkRows, p.node_count[n] - first);
    const char* src = c.region + c.layout.send_buf + (n * T + first) * r.r_bytes;
    char* dst = c.region + c.layout.rdma_recv +
                ((static_cast<int64_t>(call.parity) * N + c.node) * T + first) * r.r_bytes;
    nvshmemx_putmem_signal_nbi_block(dst, src, static_cast<size_t>(rows) * r.r_bytes,
                                     chunk_signal(c, call.parity, c.node, j), call.seq,
                                     NVSHMEM_SIGNAL_SET, node_rank(c, n, c.local));
  }
  mark(c, call, kStageForward);
  // Forwarder: the record counts of every source node.
  if (threadIdx.x == 0) {
    ok = 1;
    int most = 0;
    for (int n = 0; n < N && ok; ++n) {
      // Every source signals every node, with a count of 0 where it sends nothing there (an
      // empty rank included): this wait always has a writer.
      const int src = node_rank(c, n, c.local);
      const uint64_t* word = sig_word(c, c.layout.rdma_sig, call.parity * N + n);
      const uint64_t v = wait_at_least(c, call, word, call.seq << 32, src, kStageForward);
      if (v == 0 || !same_call(c, call, v >> 32, src)) {
        ok = 0;
        break;
      }
      const int64_t count = static_cast<int64_t>(v & 0xffffffffu);
      if (count > T) {
        report(c, kErrorCapacity, src, count, T);
        ok = 0;
        break;
      }
      counts[n] = static_cast<int>(count);
      most = max(most, counts[n]);
    }
    most_records = most;
  }
  __syncthreads();
  mark(c, call, kStageForwardWaited);
  if (ok) {
    const int lane = lane_id();
    const int K = static_cast<int>(r.topk);
    const int total = most_records * N;
    for (int item = global_warp(); item < total; item += num_warps()) {
      const int n = item % N;
      const int k = item / N;
      if (k >= counts[n]) continue;
      int arrived = 1;
      if (lane == 0) {
        const int src = node_rank(c, n, c.local);
        const uint64_t v =
            wait_at_least(c, call, chunk_signal(c, call.parity, n, k / kPutChunkRows), call.seq,
                          src, kStageForward);
        arrived = v != 0 && same_call(c, call, v, src);
      }
      if (__shfl_sync(0xffffffffu, arrived, 0) == 0) break;
      const char* rec = c.region + c.layout.rdma_recv +
                        ((static_cast<int64_t>(call.parity) * N + n) * T + k) * r.r_bytes;
      const int src_token = __ldcg(reinterpret_cast<const int*>(rec));
      const int my_slot = lane < c.ranks_per_node
                              ? __ldcg(reinterpret_cast<const int*>(rec + r.r_slots) + lane)
                              : -1;
      const int64_t expert =
          K > 0 && lane < K ? static_cast<int64_t>(
                                  __ldcg(reinterpret_cast<const long long*>(rec + r.r_topk) + lane))
                            : -1;
      const float weight = K > 0 && lane < K
                               ? __ldcg(reinterpret_cast<const float*>(rec + r.r_weights) + lane)
                               : 0.0f;
      for (int l = 0; l < c.ranks_per_node; ++l) {
        const int slot = __shfl_sync(0xffffffffu, my_slot, l);
        if (slot < 0) continue;
        if (slot >= c.layout.cap.max_recv_rows) {
          if (lane == 0)
            report(c, kErrorCapacity, node_rank(c, c.node, l), slot, c.layout.cap.max_recv_rows);
          continue;
        }
        const int d = node_rank(c, c.node, l);
        char* out =
            c.node_peer[l] + c.layout.nvl_recv +
            (static_cast<int64_t>(call.parity) * c.layout.cap.max_recv_rows + slot) * r.n_bytes;
        // x and scales are adjacent, 16-byte aligned, in both records.
        warp_copy<true>(out + r.n_x, rec + r.r_x, r.n_topk - r.n_x, lane);
        if (K > 0 && lane < K) {
          const bool mine = expert >= 0 && expert / p.experts_per_rank == d;
          reinterpret_cast<int64_t*>(out + r.n_topk)[lane] =
              mine ? expert - static_cast<int64_t>(d) * p.experts_per_rank : -1;
          reinterpret_cast<float*>(out + r.n_weights)[lane] = mine ? weight : 0.0f;
        }
        if (lane == 0) reinterpret_cast<int*>(out + r.n_src)[0] = src_token;
      }
    }
  }
  __syncthreads();
  mark(c, call, kStageQuiet);
  if (threadIdx.x == 0) nvshmem_quiet();
  mark(c, call, kStageQuietDone);
}

// Node barrier: every local rank has finished the previous kernel (its stores into my region are
// done) once its word in my region reaches seq. Stores of the previous kernel are complete at its
// end; the release store orders them before the flag for the peer. The word has no parity: a
// peer that passed this barrier (it saw every word at seq) may already have written seq + 1 from
// its next call's barrier before this rank reads its word, which also means it reached seq. It
// cannot get further (its next barrier waits for this rank's seq + 1).
__global__ void node_barrier_kernel(const __grid_constant__ Context c) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const Call call = this_call(c);
  if (!call.ok) return;
  mark(c, call, kStageBarrier);
  if (aborted(c)) return;
  ptx::fence_acq_rel_sys();
  for (int l = 0; l < c.ranks_per_node; ++l) {
    ptx::st_release_sys(reinterpret_cast<uint64_t*>(c.node_peer[l] + c.layout.nvl_sig) + c.local,
                        call.seq);
  }
  for (int l = 0; l < c.ranks_per_node; ++l) {
    const int peer = node_rank(c, c.node, l);
    const uint64_t v =
        wait_at_least(c, call, sig_word(c, c.layout.nvl_sig, l), call.seq, peer, kStageBarrier);
    if (v == 0 || (v != call.seq + 1 && !same_call(c, call, v, peer))) return;
  }
  mark(c, call, kStageBarrierDone);
}

// After the node barrier: this rank's output rows from its NVLink records (rows of the call's
// receive set), then padding up to the output's rows (0, and -1 for ids and sources), so that a
// worst-case output is complete without the host knowing the count; a rejected call's output is
// all padding. The source rank of row i is the s with prefix[s] <= i < prefix[s + 1].
__global__ void __launch_bounds__(kThreads)
    unpack_kernel(const __grid_constant__ DispatchParams p) {
  const Context& c = p.c;
  const Call call = this_call(c);
  const RecordLayout& r = c.rec;
  __shared__ int prefix[kMaxRanks + 1];
  if (threadIdx.x == 0) {
    prefix[0] = 0;
    for (int s = 0; s < c.num_ranks; ++s) prefix[s + 1] = prefix[s] + p.recv_counts[s];
  }
  __syncthreads();
  const int64_t valid = call.ok ? min(static_cast<int64_t>(*p.num_recv), p.out_rows) : 0;
  const int lane = lane_id();
  const int K = static_cast<int>(r.topk);
  const char* records = c.region + c.layout.nvl_recv +
                        static_cast<int64_t>(call.parity) * c.layout.cap.max_recv_rows * r.n_bytes;
  for (int64_t row = global_warp(); row < p.out_rows; row += num_warps()) {
    char* x = p.out_x + row * r.x_bytes;
    char* scales = p.out_scales != nullptr ? p.out_scales + row * r.scale_bytes : nullptr;
    if (row < valid) {
      const char* rec = records + row * r.n_bytes;
      warp_copy(x, rec + r.n_x, r.x_bytes, lane);
      if (scales != nullptr) warp_copy(scales, rec + r.n_scales, r.scale_bytes, lane);
      if (lane < K) {
        if (p.out_topk != nullptr) {
          p.out_topk[row * K + lane] = reinterpret_cast<const int64_t*>(rec + r.n_topk)[lane];
        }
        if (p.out_weights != nullptr) {
          p.out_weights[row * K + lane] = reinterpret_cast<const float*>(rec + r.n_weights)[lane];
        }
      }
      if (lane == 0) {
        if (p.out_src_idx != nullptr)
          p.out_src_idx[row] = reinterpret_cast<const int*>(rec + r.n_src)[0];
        if (p.out_src_rank != nullptr) {
          int lo = 0;
          int hi = c.num_ranks - 1;
          while (lo < hi) {  // the last s with prefix[s] <= row
            const int mid = (lo + hi + 1) / 2;
            if (prefix[mid] <= row) {
              lo = mid;
            } else {
              hi = mid - 1;
            }
          }
          p.out_src_rank[row] = lo;
        }
      }
    } else {
      warp_zero(x, r.x_bytes, lane);
      if (scales != nullptr) warp_zero(scales, r.scale_bytes, lane);
      if (lane < K) {
        if (p.out_topk != nullptr) p.out_topk[row * K + lane] = -1;
        if (p.out_weights != nullptr) p.out_weights[row * K + lane] = 0.0f;
      }
      if (lane == 0) {
        if (p.out_src_idx != nullptr) p.out_src_idx[row] = -1;
        if (p.out_src_rank != nullptr) p.out_src_rank[row] = -1;
      }
    }
  }
}

// ---- combine -------------------------------------------------------------------------------

__device__ __forceinline__ float load_value(const char* row, int dtype, int i) {
  return dtype == 0 ? __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row)[i])
                    : reinterpret_cast<const float*>(row)[i];
}

__device__ __forceinline__ void store_value(char* row, int dtype, int i, float v) {
  if (dtype == 0) {
    reinterpret_cast<__nv_bfloat16*>(row)[i] = __float2bfloat16_rn(v);
  } else {
    reinterpret_cast<float*>(row)[i] = v;
  }
}

// acc[i] += value i of the v-th 16 bytes of `row` (8 BF16 or 4 float32 values), float32, in
// order: the scalar loop's additions.
// kFromL2: the row was put by a peer while this kernel runs (ld.cg, never a stale L1 line).
template <bool kFromL2 = false>
__device__ __forceinline__ void add_vector(float* acc, const char* row, int dtype, int v) {
  const int4 raw = kFromL2 ? __ldcg(reinterpret_cast<const int4*>(row) + v)
                           : reinterpret_cast<const int4*>(row)[v];
  if (dtype == 0) {
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(pairs[i]);
      acc[2 * i] = __fadd_rn(acc[2 * i], f.x);
      acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], f.y);
    }
  } else {
    const float* f = reinterpret_cast<const float*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] = __fadd_rn(acc[i], f[i]);
  }
}

__device__ __forceinline__ int64_t combine_slot(const Context& c, const Call& call, int src_node,
                                                int token, int local) {
  const int64_t T = c.layout.cap.max_tokens;
  return ((static_cast<int64_t>(call.parity) * c.num_nodes + src_node) * T + token) *
             c.ranks_per_node +
         local;
}

// NVLink leg: each held row goes to the forwarder of its source (my node, the source's local
// index), at [source node][source token][my local index], flagged with seq.
__global__ void __launch_bounds__(kThreads)
    combine_send_kernel(const __grid_constant__ CombineParams p) {
  const Context& c = p.c;
  const Call call = this_call(c);
  if (!call.ok) return;
  mark(c, call, kStageCombineSend);
  if (aborted(c)) return;
  const int lane = lane_id();
  const int64_t x_bytes = c.rec.x_bytes;
  const int64_t w_offset = static_cast<int64_t>(align16(static_cast<size_t>(x_bytes)));
  for (int row = global_warp(); row < p.num_rows; row += num_warps()) {
    const int s = p.recv_src_rank[row];
    const int t = p.recv_src_idx[row];
    if (s == -1) continue;  // a padding row of a worst-case dispatch: no source
    if (s < 0 || s >= c.num_ranks || t < 0 || t >= c.layout.cap.max_tokens) {
      if (lane == 0) report(c, kErrorInvalidTopkIdx, s, t, row);
      continue;
    }
    const int64_t slot = combine_slot(c, call, c.rank_node[s], t, c.local);
    char* base = c.node_peer[c.rank_local[s]];
    char* dst = base + c.layout.comb_nvl + slot * c.layout.cap.max_combine_row;
    warp_copy(dst, p.x + row * x_bytes, x_bytes, lane);
    if (p.topk > 0 && lane < p.topk) {
      reinterpret_cast<float*>(dst + w_offset)[lane] =
          p.topk_weights[static_cast<int64_t>(row) * p.topk + lane];
    }
    if (lane == 0) {
      reinterpret_cast<volatile uint64_t*>(base + c.layout.comb_flag)[slot] = call.seq;
    }
  }
}

// The signal word of (source node `n`, token group `g`)'s partials at the source, for this call's
// parity.
__device__ __forceinline__ uint64_t* partial_signal(const Context& c, int parity, int n, int g) {
  return sig_word(
      c, c.layout.comb_sig,
      (parity * c.num_nodes + n) * static_cast<int>(partial_groups(c.layout.cap.max_tokens)) + g);
}

// Forwarder: for each (source node, token) some local rank sent, the sum of the local ranks'
// rows in local index order (float32, from +0.0), put once to the source (RDMA leg). A warp
// takes a group of kPartialGroupTokens tokens of one source node: it puts each partial it has,
// then (nvshmem_fence: the puts land first) signals the group with seq, if it put any. One
// signal per group rather than per token: on NVLink every signal behind data costs a
// system-scope fence that waits for the data's stores.
__device__ void reduce_and_put(const CombineParams& p, const Call& call) {
  const Context& c = p.c;
  const int lane = lane_id();
  const int64_t T = c.layout.cap.max_tokens;
  const int groups = static_cast<int>(partial_groups(T));
  const int64_t x_bytes = c.rec.x_bytes;
  const int64_t w_offset = static_cast<int64_t>(align16(static_cast<size_t>(x_bytes)));
  const int64_t pw_offset = static_cast<int64_t>(align16(4 * static_cast<size_t>(p.hidden)));
  const uint64_t* flags = reinterpret_cast<const uint64_t*>(c.region + c.layout.comb_flag);
  const int per_vector = p.x_dtype == 0 ? 8 : 4;  // values in 16 bytes of a row
  const int vectors = p.hidden % per_vector == 0 ? p.hidden / per_vector : 0;
  const int items = c.num_nodes * groups;
  for (int item = global_warp(); item < items; item += num_warps()) {
    const int n = item / groups;
    const int g = item % groups;
    const int source = node_rank(c, n, c.local);
    bool put_any = false;
    for (int t = g * kPartialGroupTokens;
         t < min(static_cast<int64_t>(g + 1) * kPartialGroupTokens, T); ++t) {
      const int64_t first = combine_slot(c, call, n, t, 0);
      const bool flagged =
          lane < c.ranks_per_node && ptx::ld_volatile_u64(flags + first + lane) == call.seq;
      const unsigned present = __ballot_sync(0xffffffffu, flagged);
      if (present == 0) continue;
      put_any = true;
      const char* rows = c.region + c.layout.comb_nvl + first * c.layout.cap.max_combine_row;
      float* partial = reinterpret_cast<float*>(c.region + c.layout.comb_send +
                                                (n * T + t) * c.layout.cap.max_partial_row);
      if (vectors > 0) {
        // 16-byte loads of each row (8 BF16 or 4 float32 values), summed in local index order as
        // the scalar loop below does: the same bits.
        for (int v = lane; v < vectors; v += 32) {
          float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
          for (int l = 0; l < c.ranks_per_node; ++l) {
            if (present & (1u << l)) {
              add_vector(acc, rows + l * c.layout.cap.max_combine_row, p.x_dtype, v);
            }
          }
          float4* out = reinterpret_cast<float4*>(partial + static_cast<int64_t>(v) * per_vector);
          out[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
          if (per_vector == 8) out[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
        }
      } else {
        for (int h = lane; h < p.hidden; h += 32) {
          float acc = 0.0f;
          for (int l = 0; l < c.ranks_per_node; ++l) {
            if (present & (1u << l)) {
              acc =
                  __fadd_rn(acc, load_value(rows + l * c.layout.cap.max_combine_row, p.x_dtype, h));
            }
          }
          partial[h] = acc;
        }
      }
      if (lane < p.topk) {
        float acc = 0.0f;
        for (int l = 0; l < c.ranks_per_node; ++l) {
          if (present & (1u << l)) {
            acc = __fadd_rn(acc, reinterpret_cast<const float*>(
                                     rows + l * c.layout.cap.max_combine_row + w_offset)[lane]);
          }
        }
        reinterpret_cast<float*>(reinterpret_cast<char*>(partial) + pw_offset)[lane] = acc;
      }
      __syncwarp();
      __threadfence();
      char* dst = c.region + c.layout.comb_rdma +
                  ((static_cast<int64_t>(call.parity) * c.num_nodes + c.node) * T + t) *
                      c.layout.cap.max_partial_row;
      nvshmemx_putmem_nbi_warp(dst, partial, static_cast<size_t>(pw_offset + 4 * p.topk), source);
    }
    if (put_any) {
      __syncwarp();
      if (lane == 0) {
        nvshmem_fence();
        nvshmemx_signal_op(partial_signal(c, call.parity, c.node, g), call.seq, NVSHMEM_SIGNAL_SET,
                           source);
      }
      __syncwarp();
    }
  }
}

// Source: out[t] = cast(sum over nodes in node order of the node partials (float32, from +0.0),
// then + bias0, + bias1). Each partial is read once its group's signal says it landed (lane 0
// waits, with the timeout naming the forwarder): the sums of early tokens overlap later puts.
__device__ void sum_partials(const CombineParams& p, const Call& call) {
  const Context& c = p.c;
  const int64_t T = c.layout.cap.max_tokens;
  const int lane = lane_id();
  const int64_t pw_offset = static_cast<int64_t>(align16(4 * static_cast<size_t>(p.hidden)));
  const int64_t x_bytes = c.rec.x_bytes;
  for (int t = global_warp(); t < p.num_tokens; t += num_warps()) {
    // Nodes this token visited (some rank of the node holds it).
    uint32_t visited = 0;
    for (int n = 0; n < c.num_nodes; ++n) {
      bool any = false;
      for (int l = 0; l < c.ranks_per_node; ++l) {
        any = any || p.is_token_in_rank[static_cast<int64_t>(t) * c.num_ranks + node_rank(c, n, l)];
      }
      if (any) visited |= 1u << n;
    }
    int arrived = 1;
    if (lane == 0) {
      for (int n = 0; n < c.num_nodes && arrived; ++n) {
        if (!(visited & (1u << n))) continue;
        const int fwd = node_rank(c, n, c.local);
        const uint64_t v =
            wait_at_least(c, call, partial_signal(c, call.parity, n, t / kPartialGroupTokens),
                          call.seq, fwd, kStageCombineOut);
        arrived = v != 0 && same_call(c, call, v, fwd);
      }
    }
    if (__shfl_sync(0xffffffffu, arrived, 0) == 0) return;
    const char* part = c.region + c.layout.comb_rdma;
    const int64_t node_stride = T * c.layout.cap.max_partial_row;
    const int64_t parity_base = static_cast<int64_t>(call.parity) * c.num_nodes * node_stride;
    const char* token_part = part + parity_base + t * c.layout.cap.max_partial_row;
    if (p.hidden % 8 == 0) {
      // 8 values per lane and step (two 16-byte loads of each float32 partial and bias row),
      // added in the scalar loop's order: the same bits.
      for (int v = lane; v < p.hidden / 8; v += 32) {
        float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (int n = 0; n < c.num_nodes; ++n) {
          if (visited & (1u << n)) {
            const char* row = token_part + n * node_stride + static_cast<int64_t>(v) * 32;
            add_vector<true>(acc, row, 1, 0);
            add_vector<true>(acc + 4, row, 1, 1);
          }
        }
        const int64_t h = static_cast<int64_t>(t) * p.hidden + static_cast<int64_t>(v) * 8;
        if (p.bias0 != nullptr) {
          add_vector(acc, reinterpret_cast<const char*>(p.bias0 + h), 1, 0);
          add_vector(acc + 4, reinterpret_cast<const char*>(p.bias0 + h), 1, 1);
        }
        if (p.bias1 != nullptr) {
          add_vector(acc, reinterpret_cast<const char*>(p.bias1 + h), 1, 0);
          add_vector(acc + 4, reinterpret_cast<const char*>(p.bias1 + h), 1, 1);
        }
        if (p.x_dtype == 0) {
          int4 packed;
          __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            pairs[i] = __halves2bfloat162(__float2bfloat16_rn(acc[2 * i]),
                                          __float2bfloat16_rn(acc[2 * i + 1]));
          }
          reinterpret_cast<int4*>(p.out)[h / 8] = packed;
        } else {
          float4* out = reinterpret_cast<float4*>(reinterpret_cast<float*>(p.out) + h);
          out[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
          out[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
        }
      }
    } else {
      for (int h = lane; h < p.hidden; h += 32) {
        float acc = 0.0f;
        for (int n = 0; n < c.num_nodes; ++n) {
          if (visited & (1u << n)) {
            acc = __fadd_rn(
                acc, __ldcg(reinterpret_cast<const float*>(token_part + n * node_stride) + h));
          }
        }
        if (p.bias0 != nullptr) acc = __fadd_rn(acc, p.bias0[t * p.hidden + h]);
        if (p.bias1 != nullptr) acc = __fadd_rn(acc, p.bias1[t * p.hidden + h]);
        store_value(p.out + t * x_bytes, p.x_dtype, h, acc);
      }
    }
    if (p.out_weights != nullptr && lane < p.topk) {
      float acc = 0.0f;
      for (int n = 0; n < c.num_nodes; ++n) {
        if (visited & (1u << n)) {
          const char* row = part + parity_base + n * node_stride + t * c.layout.cap.max_partial_row;
          acc = __fadd_rn(acc, __ldcg(reinterpret_cast<const float*>(row + pw_offset) + lane));
        }
      }
      p.out_weights[static_cast<int64_t>(t) * p.topk + lane] = acc;
    }
  }
}

// Stages 3 and 4 of a combine in one kernel: every block first reduces and puts its share of the
// forwarder's tokens (no waits), then sums its share of this rank's tokens as their partials land.
// Each block's thread 0 ends with nvshmem_quiet: the puts are complete before the next combine
// rewrites comb_send.
// The partial signals are conditional (a source waits only for the nodes its tokens visited), so
// on their own they would not keep two RDMA peers within one call of each other, which the two
// parities of comb_rdma need (consecutive combines, e.g. replayed from a graph, have no notify
// between them). So block 0 also tells every node's peer that this rank is in the call
// (comb_start_sig = seq, sent first: this rank finished its previous call) and, before the
// kernel ends, waits for every peer's: a peer that puts call c + 2's partials has seen this
// rank start call c + 1, so this rank is done reading call c's.
__global__ void __launch_bounds__(kThreads)
    combine_reduce_out_kernel(const __grid_constant__ CombineParams p) {
  const Context& c = p.c;
  const Call call = this_call(c);
  if (!call.ok) return;
  mark(c, call, kStageCombineReduce);
  __shared__ int stop;
  if (threadIdx.x == 0) {
    stop = aborted(c);
    if (!stop && blockIdx.x == 0) {
      for (int n = 0; n < c.num_nodes; ++n) {
        nvshmemx_signal_op(sig_word(c, c.layout.comb_start_sig, call.parity * c.num_nodes + c.node),
                           call.seq, NVSHMEM_SIGNAL_SET, node_rank(c, n, c.local));
      }
    }
  }
  __syncthreads();
  if (stop) return;
  reduce_and_put(p, call);
  mark(c, call, kStageCombineOut);
  sum_partials(p, call);
  __syncthreads();
  mark(c, call, kStageCombineQuiet);
  if (threadIdx.x == 0) {
    nvshmem_quiet();
    if (blockIdx.x == 0) {
      for (int n = 0; n < c.num_nodes; ++n) {
        const int peer = node_rank(c, n, c.local);
        const uint64_t v = wait_at_least(
            c, call, sig_word(c, c.layout.comb_start_sig, call.parity * c.num_nodes + n), call.seq,
            peer, kStageCombineQuiet);
        if (v == 0 || !same_call(c, call, v, peer)) break;
      }
    }
  }
  mark(c, call, kStageCombineQuietDone);
}

}  // namespace

cudaError_t launch_notify(const NotifyParams& p, cudaStream_t stream) {
  notify_kernel<<<1, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_dispatch(const DispatchParams& p, int num_blocks, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(num_blocks));
  pack_kernel<<<grid, kThreads, 0, stream>>>(p);
  put_forward_kernel<<<grid, kThreads, 0, stream>>>(p);
  node_barrier_kernel<<<1, 32, 0, stream>>>(p.c);
  unpack_kernel<<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_combine(const CombineParams& p, int num_blocks, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(num_blocks));
  begin_kernel<<<1, 32, 0, stream>>>(p.c);
  combine_send_kernel<<<grid, kThreads, 0, stream>>>(p);
  node_barrier_kernel<<<1, 32, 0, stream>>>(p.c);
  combine_reduce_out_kernel<<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace internode
}  // namespace ep
