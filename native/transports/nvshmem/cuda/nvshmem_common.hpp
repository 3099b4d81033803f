// Types shared by the low-latency (decode) kernels and their host launcher: the layout of one
// runtime's NVSHMEM symmetric region, the private control block, the error record and the kernel
// parameter blocks. Torch-free, NVSHMEM-free and includable from plain C++.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/error_record.hpp"
#include "common/host_device.hpp"

namespace ep {
namespace nvshmem {

constexpr int kMaxTopk = 32;       // one lane of warp 0 per top-k entry of a token
constexpr int kMaxExperts = 1024;  // per-expert counters live in shared memory
constexpr int kMaxHidden = 8192;   // combine: one thread per 8 channels, 1024 threads
constexpr int kThreads = 1024;     // every low-latency kernel: 32 warps
constexpr int kGroupSize = 128;    // FP8: channels per scale
constexpr int kNumBuffers = 2;     // calls alternate between two buffers
// Header ints of a dispatch message: source token, entry count, then per entry
// (header_key(k, local expert), position p). Shared-memory rows are padded to 16 bytes.
constexpr int kHeaderInts = 2 + 2 * kMaxTopk;
constexpr int kHeaderRowInts = (kHeaderInts + 3) / 4 * 4;
constexpr int kKeyKBits = 5;  // k < kMaxTopk = 32
static_assert(kMaxTopk <= (1 << kKeyKBits), "k must fit the header key");

// Phases of one call (hook mode: SEND now, RECV later).
enum Phase : int { kPhaseSend = 1, kPhaseRecv = 2, kPhaseBoth = 3 };

// Op codes in error records and messages.
enum Op : int { kOpNone = 0, kOpDispatch = 1, kOpCombine = 2 };

// The error record and codes of both kernel families (error_record.hpp).
using ::ep::ErrorCode;
using ::ep::ErrorRecord;
using ::ep::kErrorCapacity;
using ::ep::kErrorInvalidTopkIdx;
using ::ep::kErrorNone;
using ::ep::kErrorTimeout;

// Private per-runtime control words (plain device memory, never touched by peers).
//
// Call tags: a dispatch's signals carry dispatch_seq[b] of its buffer, a combine's (weights,
// weights flags, partial flags) combine_seq[b], each advanced by the SEND of its kind on that
// buffer (a RECV-only launch takes its SEND's number), in device memory, so CUDA-graph replays
// advance them too. A rank never takes a peer's signal of another call: ranks in different kinds
// of call wait on different words, and a combine repeated or skipped on one rank waits for a
// number its peers never send; either way they time out naming the peer, and nothing stale is
// summed.
struct ControlBlock {
  uint64_t dispatch_seq[kNumBuffers];  // number of the last dispatch SEND per buffer
  uint64_t combine_seq[kNumBuffers];   // number of the last combine SEND per buffer
  unsigned int blocks_done[4];         // finish counters: [dispatch, combine] x spare
  int abort;                           // set on timeout: every later spin-wait gives up
  int error_lock;                      // first-error-wins lock of the ErrorRecord
  int message_stride[kNumBuffers];     // of the last dispatch RECV per buffer (combine reads it)
  int pad[16];
};
static_assert(sizeof(ControlBlock) == 128, "control block must stay one 128-byte line");

// A header entry's first word: the entry's k and the local expert it goes to.
EP_HOST_DEVICE int header_key(int k, int local_expert) {
  return k | (local_expert << kKeyKBits);
}
EP_HOST_DEVICE int key_k(int key) {
  return key & ((1 << kKeyKBits) - 1);
}
EP_HOST_DEVICE int key_expert(int key) {
  return key >> kKeyKBits;
}

// send_route word of entry (t, k): 2 d + 1 when it went to rank d with a slot, 2 d when it went
// without one (capacity overflow), -1 when it names no expert.
EP_HOST_DEVICE int route_word(int rank, bool has_slot) {
  return rank < 0 ? -1 : 2 * rank + (has_slot ? 1 : 0);
}
EP_HOST_DEVICE int route_rank(int route) {
  return route >= 0 ? route >> 1 : -1;
}
EP_HOST_DEVICE bool route_has_slot(int route) {
  return route >= 0 && (route & 1);
}

// Bytes of a dispatch message header for a runtime's largest top-k (16-byte multiple).
EP_HOST_DEVICE int header_bytes(int max_topk) {
  return static_cast<int>(align_up(size_t(8) + size_t(8) * size_t(max_topk), 16));
}

// A dispatched message, one per (token, destination rank):
//   [header: header_bytes][payload: H*2 (BF16) or H (FP8)][scales, padded to 16].
// Scale words: H/128 float32, or H/512 int32 (packed UE8M0).
struct Message {
  int header;
  int payload_bytes;
  int scale_words;
  int stride;
  EP_HOST_DEVICE static Message make(int hidden, bool fp8, bool ue8m0, int header) {
    Message m;
    m.header = header;
    m.payload_bytes = fp8 ? hidden : hidden * 2;
    m.scale_words = fp8 ? (ue8m0 ? hidden / (4 * kGroupSize) : hidden / kGroupSize) : 0;
    m.stride = header +
               static_cast<int>(align_up(size_t(m.payload_bytes) + size_t(m.scale_words) * 4, 16));
    return m;
  }
};

// Layout of one buffer inside the symmetric region (identical on every rank). Sized for the
// config's maxima; each call packs its rows with its own H (all ranks pass the same H).
// Signals (u64; a count signal is seq << 32 | count, a flag is the call's seq, a message flag
// seq << 1 | present):
//   disp_count[E]     rows from source s to local expert le, at le * R + s
//   disp_tokens[R]    tokens of source s (message slots to visit)
//   disp_flag[R*M]    message slot (s, t) complete, or "token t of s sent none here"
//   comb_wflag[R]     weights of source s complete; also says s finished its dispatch RECV
//   comb_flag[R*M]    partial (expert rank d, token t) complete, at d * M + t
// Data:
//   disp_recv[R*M]    messages, (s, t) at s * M + t: token t of source s
//   disp_send[M*R]    staging: token t's message for its j-th destination at t * R + j
//   comb_weights[R]   [M * max_topk] weight words of source s (stride max_topk): u64
//                     weight_tag(seq) << 32 | float32 bits, so a P2P reader polls the word
//                     itself and needs no flag
//   comb_wstage       [M * max_topk] weight words of this rank (put source)
//   comb_recv[R*M]    partials returned to this rank, (d, t) at d * M + t: float32 [H] (channels
//                     8v..8v+3 at 16-byte piece v, 8v+4..8v+7 at piece H/8 + v), or the
//                     BF16 [H] row itself when the token had one entry on d, or its BF16
//                     sum with CombineParams::bf16_partials
//   comb_stage[R*M]   partials of this rank for source s, token t (put source)
//   comb_send         [E_loc][R*M] BF16 rows (zero-copy expert outputs)
struct BufferLayout {
  size_t disp_count_offset;
  size_t disp_tokens_offset;
  size_t disp_flag_offset;
  size_t comb_wflag_offset;
  size_t comb_flag_offset;
  size_t disp_recv_offset;
  size_t disp_send_offset;
  size_t comb_weights_offset;
  size_t comb_wstage_offset;
  size_t comb_recv_offset;
  size_t comb_stage_offset;
  size_t comb_send_offset;
  size_t bytes;      // of one buffer (a multiple of 4096)
  int header_bytes;  // of every dispatch message
  int max_topk;      // weight-row stride

  static BufferLayout make(int max_tokens, int max_hidden, int max_experts, int max_topk,
                           int num_ranks) {
    BufferLayout l{};
    l.header_bytes = nvshmem::header_bytes(max_topk);
    l.max_topk = max_topk;
    const size_t msg = size_t(Message::make(max_hidden, false, false, l.header_bytes).stride);
    const size_t row = size_t(max_hidden) * 2;
    const size_t partial = size_t(max_hidden) * 4;
    const size_t e = size_t(max_experts);
    const size_t m = size_t(max_tokens);
    const size_t r = size_t(num_ranks);
    const size_t weights = m * size_t(max_topk) * 8;
    size_t off = 0;
    auto take = [&](size_t bytes) {
      const size_t at = off;
      off = align_up(off + bytes, 128);
      return at;
    };
    l.disp_count_offset = take(8 * e);
    l.disp_tokens_offset = take(8 * r);
    l.disp_flag_offset = take(8 * r * m);
    l.comb_wflag_offset = take(8 * r);
    l.comb_flag_offset = take(8 * r * m);
    l.disp_recv_offset = take(r * m * msg);
    l.disp_send_offset = take(m * r * msg);
    l.comb_weights_offset = take(r * weights);
    l.comb_wstage_offset = take(weights);
    l.comb_recv_offset = take(r * m * partial);
    l.comb_stage_offset = take(r * m * partial);
    l.comb_send_offset = take(e * m * row);
    l.bytes = align_up(off, 4096);
    return l;
  }
};

// Where a kernel finds buffers and reports problems.
struct Context {
  char* local;        // this rank's symmetric base of the call's buffer
  char* const* peer;  // [R] P2P-mapped base of the same buffer on each rank, or null
  BufferLayout layout;
  ControlBlock* ctrl;  // private control block
  ErrorRecord* error;  // host-mapped, device pointer
  // Private [M * K] of the buffer's dispatch: route_word of entry (t, k). Combine's token side
  // reads it.
  int* send_route;
  int* recv_tokens;  // private [R]: message slots (tokens) of each source in the buffer's dispatch
  long long timeout_ns;
  // [R] int32 (or null): 1 = rank masked (ep_backend.low_latency_update_mask). A masked rank is
  // sent nothing, waited for by nobody, and entries naming its experts count as -1. Read at
  // every launch from device memory that the host updates between calls (CUDA-graph safe).
  const int* rank_mask;
  int buffer;  // 0 or 1
  int rank;
  int num_ranks;
  int max_tokens;  // M
  // Every peer (this rank included) is P2P-mapped: the kernels' instantiations without NVSHMEM
  // calls run (their register pressure made the others spill).
  int all_p2p;
};

struct DispatchParams {
  Context ctx;
  const uint16_t* x;     // BF16 [T, H]
  const void* topk_idx;  // [T, K] int64 (idx_bytes 8) or int32 (4)
  int idx_bytes;
  int num_tokens;
  int num_topk;
  int hidden;
  int num_experts;
  int fp8;  // quantise in the send phase
  int round_scale;
  int ue8m0;
  int phases;
  void* recv_x;             // [E_loc, R*M, H] BF16 or FP8
  void* recv_scales;        // [E_loc, R*M, scale_words] or null
  int* recv_count;          // [E_loc]
  int* src_info;            // [E_loc, R*M]
  long long* layout_range;  // [E_loc, R]
  int* cumulative_stats;    // [E_loc] or null
  int zero_padding;         // write zeros into recv_x/recv_scales past recv_count
};

struct CombineParams {
  Context ctx;
  const uint16_t* x;              // BF16 [E_loc, R*M, H] (zero-copy: the comb_send area)
  const long long* layout_range;  // [E_loc, R] of the dispatch
  const float* topk_weights;      // [T, K] or null (weight 1); the routes are the dispatch's
  int num_tokens;
  int num_topk;
  int hidden;
  int phases;
  uint16_t* out;      // BF16 [T, H]
  int bf16_partials;  // 1: a sum of several entries goes back as BF16, not float32
};

}  // namespace nvshmem
}  // namespace ep
