// Types shared by the hierarchical internode kernels (internode_kernels.cu) and their host side
// (internode_runtime.cpp): the record layouts, the symmetric region's layout and the kernel
// parameter blocks. Torch-free, NVSHMEM-free, includable from plain C++.
//
// Roles (docs/internode.md). Every rank r = (node n, local index i) is at once
//  * a source: it packs each token once per destination node and puts the records to the rank
//    with its own local index on that node (its "RDMA peer"; for its own node that is itself);
//  * a forwarder: it receives the records of the sources (m, i) of every node m and writes each
//    row over NVLink (P2P stores) to the local ranks of its node that own one of the token's
//    experts, at the row's final slot of their output;
//  * a receiver: it copies its rows out once every forwarder of its node is done.
// Combine is the reverse: receivers write rows to the forwarder of their source (NVLink), the
// forwarder sums one token's rows of its node (local index ascending, float32) and puts the
// partial sum to the source once (RDMA), the source sums the node partials in node order.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/error_record.hpp"
#include "common/host_device.hpp"

namespace ep {
namespace internode {

constexpr int kMaxRanksPerNode = 8;
constexpr int kMaxNodes =
    32;  // a runtime value below it: per-node tables live in the kernels' parameters
constexpr int kMaxRanks = kMaxNodes * kMaxRanksPerNode;
constexpr int kMaxTopk = 32;
constexpr int kThreads = 512;    // every internode kernel: 16 warps
constexpr int kNumParities = 2;  // calls alternate between two sets of receive buffers

enum Op : int { kOpNone = 0, kOpDispatch = 1, kOpCombine = 2, kOpCachedDispatch = 3 };

// Where the kernels of a call got to: block 0's thread 0 of each kernel writes the call's seq into
// a host-mapped word per stage (on entry, and after the waits and NVSHMEM calls that have no
// timeout of their own), so that a host whose wait for a call's kernels ran out can say which
// stage never finished (InternodeRuntime::progress). Written once per kernel: no hot-path cost.
enum Stage : int {
  kStageNotify = 0,  // entered notify: puts this rank's counts, then waits for every rank's
  kStageNotifyWaited,
  kStagePack,
  kStagePutForward,       // entered put_forward: block 0 signals every node its record count
  kStageCountsSignalled,  // the counts are signalled; the block's chunk puts next
  kStageForward,          // block 0's puts are issued: it waits for every node's record count
  kStageForwardWaited,    // block 0 saw every node's count (or gave up), forwards records next
  kStageQuiet,            // block 0 forwarded its records: nvshmem_quiet next
  kStageQuietDone,        // nvshmem_quiet returned
  kStageBarrier,
  kStageBarrierDone,
  kStageCombineSend,
  kStageCombineReduce,     // entered reduce_out: reduces and puts its tokens' partials
  kStageCombineOut,        // block 0's partials are put: sums this rank's tokens as they land
  kStageCombineQuiet,      // block 0 summed its tokens: nvshmem_quiet, then the peers' starts
  kStageCombineQuietDone,  // block 0 saw every peer start this call (or gave up)
  kNumStages
};

// After the stage marks, the progress words say which peer's word block 0 of the call's kernels
// waits for (written before each wait and again when it gives up; diagnosis only): a host whose
// wait for the kernels runs out names that peer and the value it saw.
enum WaitWord : int {
  kWaitSeq = 0,  // the call (Context::seq) of the latest wait
  kWaitStage,    // its Stage
  kWaitPeer,     // the rank whose write it waits for
  kWaitTarget,   // the value it waits for (at least)
  kWaitSeen,     // the value it saw (on entry; on a timeout, the last one)
  kNumWaitWords
};
// After the wait words: the call number (Context seq) of the latest call that started on the GPU.
// The kernels take it from the device (Control::seq), so a CUDA graph's replays advance it too.
constexpr int kLatestSeqWord = static_cast<int>(kNumStages) + static_cast<int>(kNumWaitWords);
constexpr int kProgressWords = kLatestSeqWord + 1;

inline const char* stage_name(int stage) {
  static const char* const kNames[kNumStages] = {"notify (waiting for every rank's counts)",
                                                 "notify waited",
                                                 "pack",
                                                 "put and forward (count signals)",
                                                 "RDMA puts",
                                                 "forward (waiting for the nodes' counts)",
                                                 "forward (waiting for the records' chunks)",
                                                 "nvshmem_quiet",
                                                 "quiet done",
                                                 "node barrier",
                                                 "node barrier done",
                                                 "combine send",
                                                 "combine reduce and put",
                                                 "combine out (waiting for the tokens' partials)",
                                                 "combine quiet and the peers' start signals",
                                                 "combine done"};
  return stage >= 0 && stage < kNumStages ? kNames[stage] : "?";
}

// Records per put of the RDMA leg, each put with its own signal (the forwarder's unit of waiting).
constexpr int kPutChunkRows = 8;
EP_HOST_DEVICE constexpr int64_t put_chunks(int64_t records) {
  return (records + kPutChunkRows - 1) / kPutChunkRows;
}

// Tokens whose combine partials share one signal (the source's unit of waiting).
constexpr int kPartialGroupTokens = 8;
EP_HOST_DEVICE constexpr int64_t partial_groups(int64_t tokens) {
  return (tokens + kPartialGroupTokens - 1) / kPartialGroupTokens;
}

EP_HOST_DEVICE constexpr size_t align16(size_t v) {
  return (v + 15) / 16 * 16;
}

// One record of the RDMA leg (source -> forwarder), 16-byte aligned fields:
//   [int32 src_token, int32 pad x3][int32 slot per local rank of the destination node (-1: not
//   sent there), padded to 16 B][x row bytes][scales row bytes][int64 global topk ids x K]
//   [float32 weights x K]
// and of the NVLink leg (forwarder -> receiver), the output row:
//   [x row bytes][scales row bytes][int64 local topk ids x K][float32 weights x K]
//   [int32 src_token, pad to 16 B]
struct RecordLayout {
  int64_t x_bytes = 0;      // H * element size
  int64_t scale_bytes = 0;  // S * 4 (0: none)
  int64_t topk = 0;         // K (0: cached dispatch, no top-k fields)
  int64_t ranks_per_node = 1;
  // RDMA record
  int64_t r_slots = 16;  // offset of the slot table
  int64_t r_x = 0;
  int64_t r_scales = 0;
  int64_t r_topk = 0;
  int64_t r_weights = 0;
  int64_t r_bytes = 0;
  // NVLink record
  int64_t n_x = 0;
  int64_t n_scales = 0;
  int64_t n_topk = 0;
  int64_t n_weights = 0;
  int64_t n_src = 0;
  int64_t n_bytes = 0;

  static RecordLayout make(int64_t x_bytes, int64_t scale_bytes, int64_t topk,
                           int64_t ranks_per_node) {
    RecordLayout l;
    l.x_bytes = x_bytes;
    l.scale_bytes = scale_bytes;
    l.topk = topk;
    l.ranks_per_node = ranks_per_node;
    l.r_slots = 16;
    l.r_x = l.r_slots + static_cast<int64_t>(align16(4 * static_cast<size_t>(ranks_per_node)));
    l.r_scales = l.r_x + static_cast<int64_t>(align16(x_bytes));
    l.r_topk = l.r_scales + static_cast<int64_t>(align16(scale_bytes));
    l.r_weights = l.r_topk + static_cast<int64_t>(align16(8 * static_cast<size_t>(topk)));
    l.r_bytes = l.r_weights + static_cast<int64_t>(align16(4 * static_cast<size_t>(topk)));
    l.n_x = 0;
    l.n_scales = static_cast<int64_t>(align16(x_bytes));
    l.n_topk = l.n_scales + static_cast<int64_t>(align16(scale_bytes));
    l.n_weights = l.n_topk + static_cast<int64_t>(align16(8 * static_cast<size_t>(topk)));
    l.n_src = l.n_weights + static_cast<int64_t>(align16(4 * static_cast<size_t>(topk)));
    l.n_bytes = l.n_src + 16;
    return l;
  }
};

// Capacity of a runtime's buffers (agreed maxima over the ranks).
struct Capacity {
  int64_t max_tokens = 0;         // T of any call (per source rank)
  int64_t max_recv_rows = 0;      // rows one rank receives in a dispatch
  int64_t max_record = 0;         // RDMA record bytes
  int64_t max_out_record = 0;     // NVLink record bytes
  int64_t max_combine_row = 0;    // combine NVLink row bytes (x row + K float32 weights)
  int64_t max_partial_row = 0;    // combine RDMA row bytes (H float32 + K float32)
  int64_t max_local_experts = 0;  // experts per rank whose counts a notify row carries
};

// A rank's row of the notify (int32): the rows it sends to each of the R ranks, then its token
// count and the number of out-of-range top-k ids it was given (the count columns, which every
// rank receives alike and the host reads), then the tokens it sends to each expert of the row's
// destination (capacity's max_local_experts words; each destination gets its own row).
EP_HOST_DEVICE constexpr int64_t count_columns(int64_t num_ranks) {
  return num_ranks + 2;
}
EP_HOST_DEVICE constexpr int64_t count_row_words(int64_t num_ranks, const Capacity& c) {
  return count_columns(num_ranks) + c.max_local_experts;
}
enum CountColumn : int { kCountTokens = 0, kCountInvalid = 1 };  // after the R per-rank counts

// Byte offsets of the symmetric region (identical on every rank).
struct RegionLayout {
  int64_t num_nodes = 0;
  int64_t ranks_per_node = 0;
  Capacity cap;
  // notify: signal words [parity][rank] (uint64), this rank's count rows, one per destination
  // (the puts' sources), and every rank's row [parity][rank][count_row_words] (int32)
  int64_t notify_sig = 0;
  int64_t count_send = 0;
  int64_t count_rows = 0;
  // signals (uint64): rdma[parity][node] (record counts), rdma_chunk[parity][node][chunk] (seq
  // once a chunk of the RDMA leg landed), nvl[local] (monotonic), combine[parity][node][token
  // group] (seq once the group's partials from that node landed), combine start[parity][node]
  // (seq once that node's peer started the call)
  int64_t rdma_sig = 0;
  int64_t rdma_chunk_sig = 0;
  int64_t nvl_sig = 0;
  int64_t comb_sig = 0;
  int64_t comb_start_sig = 0;
  int64_t send_buf = 0;   // [node][max_tokens] RDMA records (local: the puts' source)
  int64_t rdma_recv = 0;  // [parity][node][max_tokens] RDMA records
  int64_t nvl_recv = 0;   // [parity][max_recv_rows] NVLink records
  int64_t comb_flag = 0;  // [parity][node][max_tokens][ranks_per_node] uint64
  int64_t comb_nvl = 0;   // [parity][node][max_tokens][ranks_per_node] combine rows
  int64_t comb_send = 0;  // [node][max_tokens] partial rows (local: the puts' source)
  int64_t comb_rdma = 0;  // [parity][node][max_tokens] partial rows
  int64_t bytes = 0;

  static RegionLayout make(int64_t num_nodes, int64_t ranks_per_node, const Capacity& c) {
    RegionLayout l;
    l.num_nodes = num_nodes;
    l.ranks_per_node = ranks_per_node;
    l.cap = c;
    int64_t o = 0;
    auto take = [&o](int64_t bytes) {
      const int64_t at = o;
      o += static_cast<int64_t>(align16(static_cast<size_t>(bytes)));
      o = (o + 127) / 128 * 128;
      return at;
    };
    const int64_t P = kNumParities, N = num_nodes, L = ranks_per_node, T = c.max_tokens;
    const int64_t R = N * L;
    l.notify_sig = take(8 * P * R);
    l.count_send = take(4 * R * count_row_words(R, c));
    l.count_rows = take(4 * P * R * count_row_words(R, c));
    l.rdma_sig = take(8 * P * N);
    l.rdma_chunk_sig = take(8 * P * N * put_chunks(T));
    l.nvl_sig = take(8 * L);
    l.comb_sig = take(8 * P * N * partial_groups(T));
    l.comb_start_sig = take(8 * P * N);
    l.send_buf = take(N * T * c.max_record);
    l.rdma_recv = take(P * N * T * c.max_record);
    l.nvl_recv = take(P * c.max_recv_rows * c.max_out_record);
    l.comb_flag = take(8 * P * N * T * L);
    l.comb_nvl = take(P * N * T * L * c.max_combine_row);
    l.comb_send = take(N * T * c.max_partial_row);
    l.comb_rdma = take(P * N * T * c.max_partial_row);
    l.bytes = o;
    return l;
  }
};

// Private control words of a runtime (plain device memory).
struct Control {
  uint64_t seq;    // the latest call's number: the first kernel of each call increments it
  int abort;       // set on a timeout: every later wait gives up at once
  int error_lock;  // first error wins
  int call_ok;     // 0: the notify rejected this call (every rank alike): its kernels move nothing
  int pad[27];
};

// Why a notify rejected a call (NotifyHost::reason).
enum Rejection : int {
  kRejectNone = 0,
  kRejectInvalidTopk = 1,  // rank `a` was given `b` out-of-range top-k ids
  kRejectWorstTokens = 2,  // rank `a` receives `b` rows, more than num_worst_tokens
};

// Host-mapped: the notify's results for the host. `ticket` (the host's number for the call,
// written last) says the counts are this call's; a rejected worst-case call (no host read follows
// it) also counts itself in `rejections` with its reason, for the next call to raise.
struct NotifyHost {
  uint64_t ticket;
  uint64_t rejections;
  int reason;
  int pad;
  int64_t a;
  int64_t b;
  int64_t limit;
  // then int32 counts[R][count_columns(R)], then this rank's received rows per local expert
  // (int32 [max_local_experts], rounded up to the call's expert_alignment)
};

// What every kernel needs to know about the group and the call.
struct Context {
  char* region;                       // this rank's symmetric region (nvshmem_malloc)
  char* node_peer[kMaxRanksPerNode];  // P2P base of the region of each local rank of my node
  int node_rank[kMaxRanks];           // global rank of (node, local): [node * rpn + local]
  int16_t rank_node[kMaxRanks];       // node of each global rank
  int16_t rank_local[kMaxRanks];      // local index of each global rank
  int rank;
  int node;
  int local;
  int num_nodes;
  int ranks_per_node;
  int num_ranks;
  RegionLayout layout;
  RecordLayout rec;
  Control* ctrl;
  ErrorRecord* err;
  uint64_t* progress;  // [kProgressWords] host-mapped: the last seq that reached each stage,
                       // then the latest wait (WaitWord)
  long long timeout_ns;
  int op;
};

// The count exchange of a (cached) dispatch: every rank puts its row (count_columns) to every
// rank with a signal, waits for every rank's, and derives where its rows land at each receiver.
struct NotifyParams {
  Context c;
  const int* per_rank;  // [R] int32: rows this rank sends to each rank
  // [T, K] int64 global expert ids, or null (a cached dispatch): the kernel counts the ids
  // outside [-1, num_experts) into the row it announces.
  const int64_t* topk_idx;
  int num_topk;
  int num_experts;
  int num_tokens;
  int64_t limit;          // > 0: a call where some rank receives more rows is rejected
  bool report_rejection;  // no host reads the counts: a rejection is recorded for the next call
  uint64_t ticket;
  int* offsets;      // [R] out: rows of lower source ranks at each receiver
  int* recv_counts;  // [R] out: rows this rank receives from each source
  int* num_recv;     // [1] out: rows this rank receives
  NotifyHost* host;  // host-mapped (device address)
  // Per expert (null for a cached dispatch): this rank's tokens per global expert (the layout's
  // [E] int32) in, and the rows it receives per local expert, rounded up to expert_alignment,
  // out ([experts_per_rank] int32; also to the host-mapped tail).
  const int* per_expert;
  int experts_per_rank;
  int expert_alignment;
  int* recv_per_expert;
  // The plan of this rank's rows, written after the counts (DispatchParams reads it):
  const bool* is_token_in_rank;  // [T, R] in
  const int* send_pos;           // [T, R] in: index among the tokens sent to each rank, or -1
  int* dest_slot;                // [T, R] out: send_pos + offsets, -1 where not sent
  int* node_pos;                 // [T, N] out: index among the tokens sent to each node, or -1
  int* node_count;               // [N] out: tokens sent to each node
};

struct DispatchParams {
  Context c;
  const char* x;              // [T, H] bytes (row = rec.x_bytes)
  const char* x_scales;       // [T, S] 4-byte values, or null
  const int64_t* topk_idx;    // [T, K] int64 global ids, or null (cached dispatch)
  const float* topk_weights;  // [T, K], or null
  const int* dest_slot;       // [T, R] int32: slot in rank d's output, -1 where not sent
  const int* node_pos;        // [T, N] int32: index among the tokens sent to node n, or -1
  const int* node_count;      // [N] int32: tokens sent to node n
  int num_tokens;
  int experts_per_rank;
  // This rank's outputs (unpack_kernel): rows [0, num_recv) received, the rest up to out_rows
  // padding. The notify's recv_counts [R] and num_recv [1] (device).
  const int* recv_counts;
  const int* num_recv;
  int64_t out_rows;
  char* out_x;         // [out_rows, x_bytes]
  char* out_scales;    // [out_rows, scale_bytes] or null
  int64_t* out_topk;   // [out_rows, K] local expert ids (-1: not this rank's), or null
  float* out_weights;  // [out_rows, K] or null
  int* out_src_idx;    // [out_rows] or null
  int* out_src_rank;   // [out_rows] or null
};

struct CombineParams {
  Context c;
  const char* x;              // [N, H] of x_dtype (row = x_bytes)
  const float* topk_weights;  // [N, K] or null
  const int* recv_src_rank;   // [N]
  const int* recv_src_idx;    // [N]
  int num_rows;               // valid rows of x
  int x_dtype;                // 0: bf16, 1: float32
  int hidden;
  int topk;                      // K of topk_weights (0: none)
  const bool* is_token_in_rank;  // [T, R] of this rank as source
  int num_tokens;
  const float* bias0;  // [T, H] float32 (the reference adds biases in float32), or null
  const float* bias1;
  char* out;           // [T, H] of x_dtype
  float* out_weights;  // [T, K] or null
};

}  // namespace internode
}  // namespace ep
