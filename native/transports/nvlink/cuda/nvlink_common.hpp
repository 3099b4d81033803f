// Types shared by the nvlink kernels and their host launchers: buffer layout, row layouts,
// control/error records and the kernel parameter blocks. Torch-free and includable from plain C++
// (the CUDA qualifiers below compile away outside nvcc).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/error_record.hpp"
#include "common/host_device.hpp"

namespace ep {

constexpr int kMaxRanks = 8;  // nvlink: at most 8 GPUs of one host
constexpr int kMaxTopk = 32;  // top-k entries per token the kernels handle
constexpr int kDefaultNumSms = 24;

// Op codes in error records and messages.
enum NvlinkOp : int {
  kOpNone = 0,
  kOpLayout = 1,
  kOpNotify = 2,
  kOpDispatch = 3,
  kOpCachedDispatch = 4,
  kOpCombine = 5,
  kOpBarrier = 6,
  kOpAllToAll = 7,
};

// ---- all-to-all (nvlink_all_to_all.cu) ----------------------------------------------------------
// Every (source, destination) pair streams its bytes through a ring of staging slots in the
// destination's buffer: a2a_lanes(R) lanes per pair (one sender block at the source, one
// receiver block at the destination), kA2ASlots slots of up to kA2AMaxChunkBytes per lane. A
// sender fills a slot over NVLink and flags it; the receiver copies it to the output (local HBM)
// and returns the slot with a credit word in the sender's buffer. Pipelined this way the local
// copy overlaps the NVLink transfer.
// The EP_A2A_* macros exist for A/B builds (benchmarks/a2a_variants.sh); normal builds take the
// defaults.
#ifndef EP_A2A_CHUNK_BYTES
#define EP_A2A_CHUNK_BYTES (512 * 1024)
#endif
#ifndef EP_A2A_SLOTS
#define EP_A2A_SLOTS 4
#endif
#ifndef EP_A2A_SEND_BLOCKS
#define EP_A2A_SEND_BLOCKS 48
#endif
// A sender block flags a chunk only once its writes are visible at the peer (a system-scope
// fence), and issues nothing while it waits: large chunks, and two sender blocks per SM's worth
// of link, keep that wait a small part of each chunk's time.
constexpr int kA2AMaxChunkBytes = EP_A2A_CHUNK_BYTES;
constexpr int kA2AChunkAlign = 4096;  // chunk sizes are multiples (16-byte vector copies)
constexpr int kA2ASlots = EP_A2A_SLOTS;
constexpr int kA2ASendBlocks = EP_A2A_SEND_BLOCKS;  // sender blocks per rank, over its peers
constexpr int kA2ASelfBlocks = 16;                  // blocks copying this rank's own segment
constexpr int kA2ASelfChunkBytes = 64 * 1024;       // their unit of work
constexpr int kA2AMaxLocalExperts = 256;            // of the 2-D (per expert) form
constexpr int kA2AThreads = 512;
static_assert(kA2AMaxChunkBytes % kA2AChunkAlign == 0,
              "the chunk size must be a multiple of 4 KiB");
EP_HOST_DEVICE constexpr int a2a_lanes(int num_ranks) {
  return num_ranks <= 1 ? 1 : (kA2ASendBlocks + num_ranks - 2) / (num_ranks - 1);
}
// Up to this many bytes per lane a pair's lane moves one chunk (latency); above it, at least two,
// so that the receiver's copy of one overlaps the transfer of the next.
constexpr long long kA2AOneChunkBytes = 128 * 1024;
// The chunk size of a pair that moves `bytes`: spread over all its lanes (small messages use
// every lane once), then cut into as many equal chunks per lane as the slot size needs (at least
// two), so that every lane moves the same number of chunks and the last round is not left to
// some of the lanes while the others idle. Sender and receiver derive it from the same byte count
// (the sender's, announced).
EP_HOST_DEVICE constexpr long long a2a_chunk_bytes(long long bytes, int lanes) {
  const long long per_lane = (bytes + lanes - 1) / lanes;
  long long chunk = per_lane;
  if (per_lane > kA2AOneChunkBytes) {
    const long long slots_worth = (per_lane + kA2AMaxChunkBytes - 1) / kA2AMaxChunkBytes;
    const long long n = slots_worth < 2 ? 2 : slots_worth;
    chunk = (per_lane + n - 1) / n;  // <= kA2AMaxChunkBytes
  }
  // Rounded up to the alignment: still within the slot, whose size is a multiple of it.
  const long long aligned = (chunk + kA2AChunkAlign - 1) / kA2AChunkAlign * kA2AChunkAlign;
  return aligned < kA2AChunkAlign ? kA2AChunkAlign : aligned;
}
// Pairs that move at most this many bytes (host splits) skip the staging ring: the sender writes
// 16-byte lines of {4 data bytes, flag, 4 data bytes, flag} straight into the receiver's buffer
// and the receiver polls each line until both flags carry this call's value. An 8-byte half of a
// line lands whole, so no fence or per-chunk flag is needed: a pair costs one NVLink crossing
// instead of fence, flag and credit round trips, at twice the bytes.
#ifndef EP_A2A_LINES_MAX_BYTES
#define EP_A2A_LINES_MAX_BYTES (256 * 1024)
#endif
constexpr long long kA2ALinesMaxBytes = EP_A2A_LINES_MAX_BYTES;
static_assert(kA2ALinesMaxBytes % 8 == 0, "the flagged-line limit must be a multiple of 8");
// Bytes of one source's line region at a receiver: a header line per lane (the bytes the lane's
// sender sends, in both protocols), then one line per 8 payload bytes.
EP_HOST_DEVICE constexpr size_t a2a_lines_region_bytes(int lanes) {
  return (size_t(lanes) + size_t(kA2ALinesMaxBytes / 8)) * 16;
}
// The flag value of a call's lines: never 0 (the buffer starts zeroed).
EP_HOST_DEVICE constexpr uint32_t a2a_line_flag(uint64_t seq) {
  return static_cast<uint32_t>(seq % 0xffffffffull) + 1;
}
// What the rule gives (16 lanes: 4 ranks): one 64 KiB chunk a lane at 1 MiB, two 256 KiB chunks at
// 8 MiB, full slots at 1 GiB; 48 lanes (2 ranks) at 64 MiB: three chunks a lane (144 in all);
// never below the alignment, never above the slot.
static_assert(a2a_chunk_bytes(0, 16) == kA2AChunkAlign && a2a_chunk_bytes(100, 16) == 4096);
static_assert(a2a_chunk_bytes(1 << 20, 16) == 64 * 1024);
static_assert(a2a_chunk_bytes(8 << 20, 16) == 256 * 1024 || kA2AMaxChunkBytes < 256 * 1024);
static_assert(a2a_chunk_bytes(1ll << 30, 16) == kA2AMaxChunkBytes);
static_assert(kA2AMaxChunkBytes != 512 * 1024 || a2a_chunk_bytes(64ll << 20, 48) == 114 * 4096);
static_assert(a2a_chunk_bytes((1ll << 30) + 12345, 7) <= kA2AMaxChunkBytes);
static_assert(a2a_line_flag(0) == 1 && a2a_line_flag(0xfffffffeull) == 0xffffffffu);
// The low 32 bits of a credit word once the receiver is done with a whole call.
constexpr uint64_t kA2ADone = 0xffffffffull;

// Private per-rank control words at the start of the rank's buffer. Peers never touch these.
struct ControlBlock {
  uint64_t epoch;             // sequence number of the last communicating kernel that finished
  unsigned int blocks_done;   // arrival counter used by finish_block(), back to 0 after each kernel
  int abort;                  // set on timeout: every later spin-wait gives up at once
  int error_lock;             // first-error-wins lock of the ErrorRecord
  unsigned int work_claimed;  // dispatch tokens claimed by sender warps; finish_block zeroes it
  int rejected_ranks;  // set by notify in normal mode: bit s = rank s's topk_idx was invalid; the
                       // dispatch kernel that follows it then moves nothing
  int pad0;
  // Sequence number of the last notify whose results (recv_counts, recv_prefix, rejected_ranks)
  // are written: a dispatch launched behind its notify waits for this, not for the whole notify.
  uint64_t notified;
  // Dispatch rows of each source claimed by receiving warps; finish_block zeroes them.
  unsigned int recv_claimed[kMaxRanks];
  int pad[14];
};
static_assert(sizeof(ControlBlock) == 128, "control block must stay one 128-byte line");

// Host-mapped counters written by the notify kernel in normal (host-synchronised) mode.
struct HostCounters {
  volatile int ready_ticket;  // equals the ticket passed to notify once the fields below are set
  volatile int num_recv_tokens;
  volatile int num_recv_tokens_per_rank[kMaxRanks];
  volatile int rejected_ranks;  // bit s: rank s found an invalid topk_idx value (its layout)
  volatile int num_send_tokens_per_rank[kMaxRanks];  // this rank's layout: rows sent to each rank
  volatile int pad[13];
  // followed in the same allocation by int num_recv_tokens_per_expert[max_local_experts]
};
static_assert(sizeof(HostCounters) == 128, "per-expert counters start 128 bytes in");

// Dispatch and combine rows in the receive areas start on this boundary (bytes), so a warp's
// 512-byte stores cover whole 32-byte sectors and 128-byte lines instead of splitting some across
// two writes.
constexpr int kRowAlign = 128;

// Row of the dispatch receive area: [x: hidden_bytes][scales: S*4, padded to 16]
// [meta: 8 reserved bytes, src_idx i32, pad i32, local idx i32 x K, weight f32 x K; padded to 16].
// A row's arrival flag is not in the row: it lives in the region's flag array (BufferLayout),
// at a place that does not move with the row layout. A flag inside the row would sit where an
// earlier call with another layout (hidden size, K, scales; a cached dispatch has no metadata)
// left payload bytes, and those bytes can equal the sequence number being waited for.
struct DispatchRow {
  int stride;
  int scales_offset;
  int meta_offset;
  EP_HOST_DEVICE static DispatchRow make(int hidden_bytes, int num_scales, int num_topk) {
    DispatchRow r;
    r.scales_offset = hidden_bytes;
    r.meta_offset = r.scales_offset + static_cast<int>(align_up(size_t(num_scales) * 4, 16));
    r.stride = static_cast<int>(
        align_up(r.meta_offset + align_up(16 + size_t(num_topk) * 8, 16), size_t(kRowAlign)));
    return r;
  }
};

// Row of the combine receive area: [x: hidden_bytes][weights f32 x K, padded to 16]. Its
// arrival flag is in the region's flag array, as for dispatch rows.
struct CombineRow {
  int stride;
  int weights_offset;
  EP_HOST_DEVICE static CombineRow make(int hidden_bytes, int num_topk) {
    CombineRow r;
    r.weights_offset = hidden_bytes;
    r.stride = static_cast<int>(
        align_up(r.weights_offset + align_up(size_t(num_topk) * 4, 16), size_t(kRowAlign)));
    return r;
  }
};

// Where everything lives inside each rank's IPC buffer (identical on all ranks).
//   [control 128 B][entered u64 x 8][slab arrivals u64 x 8]
//   [notify u64 x 2 parity x R src x (1 + max_local_experts)]
//   [dispatch area: source regions][combine area: source regions]
//   [dispatch flags: x max_tokens u64][combine flags: x max_tokens u64]
// A flag is only ever written with a sequence number, which grows with every kernel, so a stale
// flag never equals the sequence a receiver waits for.
// Source regions are indexed relative to the receiver: source s lands in region
// (s - receiver - 1 + R) % R, so no region is wasted on the receiver itself.
struct BufferLayout {
  int num_ranks;
  int max_tokens;  // rows a region holds (max tokens of any rank)
  int max_local_experts;
  size_t entered_offset;
  // u64 per source: rows it has written into the receive slab we lent, added by its publishers
  // (after their fence) instead of per-row flags; the dispatch kernel zeroes them once all came.
  size_t arrivals_offset;
  size_t notify_offset;
  size_t dispatch_offset;
  size_t dispatch_region_bytes;
  size_t combine_offset;
  size_t combine_region_bytes;
  size_t dispatch_flags_offset;
  size_t combine_flags_offset;
  // all-to-all: [private: last all-to-all sequence u64, all-to-all calls u64]
  // [announce: 2 parity x R src x (1 + kA2AMaxLocalExperts) u64] (written by the sources)
  // [credits: R dst x lanes u64] (written by the destinations' receivers)
  // [slot flags: src regions x lanes x kA2ASlots u64] (written by the sources)
  // [staging: src regions x lanes x kA2ASlots x kA2AMaxChunkBytes] (written by the sources)
  // [lines: src regions x a2a_lines_region_bytes: lanes header lines, then the data lines of
  //  the flagged-line protocol, 16 bytes each] (written by the sources)
  int a2a_lanes;
  size_t a2a_private_offset;
  size_t a2a_announce_offset;
  size_t a2a_credit_offset;
  size_t a2a_flags_offset;
  size_t a2a_staging_offset;
  size_t a2a_lines_offset;
  size_t a2a_lines_region_bytes;
  size_t total_bytes;

  EP_HOST_DEVICE int region_index(int src, int receiver) const {
    return (src - receiver - 1 + num_ranks) % num_ranks;
  }
  // Arrival flag of row `slot` that `src` writes into `receiver`'s dispatch / combine area.
  EP_HOST_DEVICE size_t dispatch_flag_offset(int src, int receiver, int slot) const {
    return dispatch_flags_offset +
           (size_t(region_index(src, receiver)) * max_tokens + size_t(slot)) * sizeof(uint64_t);
  }
  EP_HOST_DEVICE size_t combine_flag_offset(int src, int receiver, int slot) const {
    return combine_flags_offset +
           (size_t(region_index(src, receiver)) * max_tokens + size_t(slot)) * sizeof(uint64_t);
  }
  // A notify slot: [token count][count per local expert x max_local_experts]
  // [tokens the source sends to each rank x R][the receive slab the source lends, or -1].
  EP_HOST_DEVICE size_t notify_slot_words() const {  // NotifyWords::total at the most experts
    return 2 + size_t(max_local_experts) + size_t(num_ranks);
  }
  // Slot (parity, src) of the notify area, in u64 words from the area's start.
  EP_HOST_DEVICE size_t notify_slot(int parity, int src) const {
    return (size_t(parity) * num_ranks + src) * notify_slot_words();
  }
};

// Pointers to every rank's buffer as mapped in this process (peers: IPC/peer mappings).
struct PeerBuffers {
  char* ptr[kMaxRanks];
};

// Receive slabs: a second IPC allocation per rank of `count` slabs, each able to hold every
// output of a dispatch (rows: every token of every rank). A receiver that lends one for a
// dispatch (notify tells the senders which) gets its rows written there by every sender, so the
// outputs are views of the slab and nothing is copied out of the receive buffer.
struct PeerSlabs {
  char* ptr[kMaxRanks];  // each rank's slab array as mapped here (null: no slabs)
  size_t slab_bytes;
  int count;
};

// The output arrays inside one slab for one call's row shape (byte offsets from the slab's
// start; the same on every rank, which is what lets a sender address a peer's slab).
struct SlabLayout {
  size_t x;             // [rows, hidden_bytes]
  size_t scales;        // [rows, S] float32
  size_t topk_idx;      // [rows, K] of idx_bytes
  size_t topk_weights;  // [rows, K] float32
  size_t src_idx;       // [rows] int32
  size_t src_rank;      // [rows] int32
  size_t total;
  EP_HOST_DEVICE static SlabLayout make(size_t rows, int hidden_bytes, int num_scales, int num_topk,
                                        int idx_bytes) {
    SlabLayout l;
    l.x = 0;
    l.scales = align_up(l.x + rows * size_t(hidden_bytes), 256);
    l.topk_idx = align_up(l.scales + rows * size_t(num_scales) * 4, 256);
    l.topk_weights = align_up(l.topk_idx + rows * size_t(num_topk) * size_t(idx_bytes), 256);
    l.src_idx = align_up(l.topk_weights + rows * size_t(num_topk) * 4, 256);
    l.src_rank = align_up(l.src_idx + rows * 4, 256);
    const size_t off = align_up(l.src_rank + rows * 4, 256);
    l.total = off;
    return l;
  }
};

// Everything a communicating kernel needs to find buffers and report problems.
struct CommContext {
  PeerBuffers buffers;
  PeerSlabs slabs;
  BufferLayout layout;
  ErrorRecord* error;  // host-mapped, device pointer
  long long timeout_cycles;
  int rank;
  int num_ranks;
};

struct LayoutParams {
  const void* topk_idx;  // [T, K] int64 or int32 (idx_bytes), -1 = none
  int idx_bytes;
  int num_tokens;
  int num_topk;
  int num_experts;
  int num_ranks;
  int* num_tokens_per_rank;    // [R]
  int* num_tokens_per_expert;  // [E]
  bool* is_token_in_rank;      // [T, R]
  int* send_pos;               // [T, R], or null (get_dispatch_layout)
  ControlBlock* ctrl;
  ErrorRecord* error;
  int rank;
  // True: out-of-range ids count as -1 without an error record (the caller counts them itself,
  // as the internode dispatch's notify does). False (zero-initialised): they are recorded.
  bool ignore_invalid;
  // Several blocks (one chunk of tokens each) need a workspace of
  // nvlink_layout_workspace_bytes() bytes (any contents: blocks tag what they publish with
  // `epoch`, unique per launch); null: one block walks every chunk.
  void* workspace;
  unsigned long long epoch;
};

// Where a layout kernel computed outside the runtime (get_dispatch_layout) records an invalid
// topk_idx: its host-mapped record and the device-memory lock it takes before writing it.
struct LayoutErrorRef {
  const ErrorRecord* record;
  const int* lock;
};

struct NotifyParams {
  CommContext comm;
  const int* num_tokens_per_rank;    // [R] from layout
  const int* num_tokens_per_expert;  // [E] from layout
  int experts_per_rank;
  int expert_alignment;
  int num_worst_tokens;             // > 0: capacity check only
  int* recv_counts;                 // [R]   rows from each source rank
  int* recv_prefix;                 // [R+1] exclusive prefix of recv_counts
  int* num_recv_tokens_per_expert;  // [E_loc] aligned
  HostCounters* host;               // device pointer of the host-mapped counters, or null
  int* host_per_expert;             // device pointer of the host-mapped per-expert counters
  int host_ticket;
  // Error state of the layout the counts come from when the caller computed it earlier
  // (get_dispatch_layout); null: comm.error and our control block's lock, which the runtime's
  // own layout kernel uses.
  const ErrorRecord* layout_error;  // host-mapped
  const int* layout_error_lock;     // device memory: non-zero once a record is written
  // 1: the dispatch kernel is launched right behind this one (programmatic dependent launch)
  // and takes this kernel's sequence number, so notify does not advance the epoch.
  int dispatch_follows;
  int lend_slab;    // the receive slab this rank lends the dispatch that follows, or -1
  int* dest_slabs;  // [2R] or null: for each rank d, {our first row there, d's lent slab or -1}
};

// The words of one notify slot: what source s announces to receiver d for a call with E_loc
// local experts, each stored as (sequence << 32 | value): [count] rows s sends d (bit 31:
// kNotifyRejected), [per_expert + e] entries of s for d's local expert e, [sent + r] rows s sends
// rank r (for every r: receivers derive where their rows start in r's outputs), [slab] the
// receive slab s lends the dispatch that follows (-1: none).
constexpr uint32_t kNotifyRejected = 0x80000000u;  // in [count]: "my topk_idx was invalid"
struct NotifyWords {
  static constexpr int count = 0;
  static constexpr int per_expert = 1;
  int sent;
  int slab;
  int total;
  EP_HOST_DEVICE static NotifyWords make(int experts_per_rank, int num_ranks) {
    NotifyWords w;
    w.sent = 1 + experts_per_rank;
    w.slab = w.sent + num_ranks;
    w.total = w.slab + 1;
    return w;
  }
};

// Rows of x of at most this many bytes may be staged (DispatchParams::staged): two stages per
// send warp must fit the block's shared memory.
constexpr int kStagedRowBytes = 8192;

struct DispatchParams {
  CommContext comm;
  const void* x;  // [T, hidden_bytes] raw rows
  int hidden_bytes;
  const float* scales;  // [T, S] raw 4-byte words, or null
  int num_scales;
  const void* topk_idx;  // [T, K] (null: cached dispatch, no metadata)
  int idx_bytes;
  const float* topk_weights;  // [T, K] or null
  int num_topk;
  int num_tokens;
  int experts_per_rank;
  const int* send_pos;       // [T, R]
  const int* recv_prefix;    // [R+1]
  void* recv_x;              // [cap, hidden_bytes]
  float* recv_scales;        // [cap, S] or null
  void* recv_topk_idx;       // [cap, K] or null
  float* recv_topk_weights;  // [cap, K] or null
  int* recv_src_idx;         // [cap] or null
  int* recv_src_rank;        // [cap] or null
  int num_worst_tokens;      // 0: exact N rows; > 0: capacity, padding rows filled
  int num_send_warps;
  // 1: launched behind its notify (NotifyParams::dispatch_follows), which may still be running:
  // the receive prefix and the rejection verdict are read only after waiting for it.
  int after_notify;
  // Behind its notify: 1 when that notify reports invalid routings (normal mode: NotifyParams::
  // host set), so kNotifyRejected in an announced count means "move nothing".
  int notify_rejects;
  // 1: senders stage x in shared memory (rows of at most kStagedRowBytes; launched with
  // nvlink_dispatch_stage_bytes of dynamic shared memory), and receivers claim rows (finished
  // senders join them).
  int staged;
  // Receive slabs (PeerSlabs): dest_slabs [2R] as notify wrote them (null: no rank lent one);
  // senders write a token's rows for a rank that lent a slab straight into it, at the offsets
  // of `slab`, and count them into its arrivals word instead of flagging each. own_slab: this
  // rank's outputs are its lent slab (the senders wrote them): one warp waits for the counts,
  // the receive warps have nothing to do.
  const int* dest_slabs;
  SlabLayout slab;
  int own_slab;
};

// Element type of a combine's rows (x, bias, out).
enum class CombineElem : int { kBFloat16 = 0, kFloat16 = 1, kFloat32 = 2, kFloat64 = 3 };

__host__ __device__ constexpr int combine_elem_bytes(CombineElem e) {
  return e == CombineElem::kFloat64 ? 8 : (e == CombineElem::kFloat32 ? 4 : 2);
}

struct CombineParams {
  CommContext comm;
  const void* x;  // [N(cap), H] elements of `elem`
  CombineElem elem;
  int hidden;                 // elements per row
  const float* topk_weights;  // [N, K] or null
  int num_topk;
  const int* recv_prefix;   // [R+1] of the dispatch (expert side)
  int num_recv_capacity;    // rows of x (rows past it are never read)
  int num_tokens;           // T of this rank (owner side)
  const int* send_pos;      // [T, R] of the dispatch (owner side)
  const void* bias0;        // [T, H] of `elem` (float32 with bias_f32) or null
  const void* bias1;        // [T, H] like bias0, or null
  int bias_f32;             // 1: the biases are float32 rows (16-bit elements only)
  void* out;                // [T, H]
  float* out_topk_weights;  // [T, K] or null (needs K >= 1)
  int num_send_warps;
};

// An all-to-all of raw bytes. Host mode (splits == null): every size and offset is given in
// bytes. Device mode: splits [R * E] int64 rows this rank sends, chunked by (destination rank,
// local expert); the receivers learn the counts from the senders' announcements and place the
// rows grouped by local expert, then by source rank.
struct AllToAllParams {
  CommContext comm;
  const char* input;
  char* output;
  // host mode
  long long send_offset[kMaxRanks];
  long long send_bytes[kMaxRanks];
  long long recv_offset[kMaxRanks];
  long long recv_bytes[kMaxRanks];
  // device mode
  const long long* splits;  // [R * E] rows, or null (host mode)
  int num_local_experts;    // E (1: the plain all_to_all_v)
  long long row_bytes;      // bytes per row, > 0
  long long input_rows;     // rows of input (the splits must not exceed them)
  long long capacity_rows;  // rows of output
  long long* recv_splits;   // [E, R] rows received from each source for each local expert
  long long* recv_offsets;  // [E, R] their first output row
};

struct BarrierParams {
  CommContext comm;
};

}  // namespace ep
