// NvlinkRuntime: the torch-free host side of the nvlink (NVLink, 2-8 GPUs of one host)
// high-throughput MoE dispatch/combine. It owns one IPC buffer per rank, maps every peer's
// buffer, and launches the kernels of this folder on caller-given streams.
//
// Call sequence (every rank issues the same communicating calls in the same order):
//
//   NvlinkRuntime rt(rank, R, device, config);        // allocates + zeroes the buffer
//   handles = all_gather(rt.ipc_handle());               // 64 bytes per rank, any transport
//   rt.connect(handles);                                 // or connect_local() in one process
//   rt.layout(topk_idx, ..., stream);                    // local: counts, mask, send_pos
//   t = rt.notify(..., /*host_counters=*/true, stream);  // count exchange (communicating)
//   RecvCounts n = rt.wait_recv_counts(t);               // host polls mapped memory, no sync
//   ... allocate recv tensors with n.num_recv_tokens rows ...
//   rt.dispatch(args, stream);                           // communicating
//   rt.combine(args, stream);                            // communicating
//   std::string err = rt.check_error();                  // "" when fine
//
// Worst-case (CUDA-graph capturable) mode: notify(host_counters=false, num_worst_tokens=cap,
// dispatch_follows=true) followed by dispatch(num_worst_tokens=cap) on the same stream, with no
// host wait in between; every count stays on the device, and the dispatch kernel overlaps notify.
// An overflow (a rank would receive more than cap rows) sets the error record; check_error()
// reports it later.
//
// Rules:
//  * Communicating calls (notify, dispatch, cached_dispatch, combine, barrier) must be issued by
//    every rank, in the same order, and must execute one at a time per rank (same stream, or
//    streams ordered by events). Each kernel spins on its peers, so all ranks' kernels must be
//    able to run concurrently (one process/thread per GPU).
//  * Per call, every rank must pass the same hidden_bytes (combine: hidden, elem),
//    num_scales and num_topk (combine: 0 without topk_weights): they fix the row layout in the
//    peers' buffers (a rank that received no rows may pass a null topk_weights with K > 0).
//    num_sms and the send-warp split may differ between ranks.
//  * Consecutive calls need no resets: each kernel takes a sequence number from a device-side
//    epoch (so graph replays stay correct).
//  * All pointers are device pointers, contiguous, row-major; x/recv_x/out/bias rows must be
//    16-byte aligned (hidden bytes a multiple of 16, base pointers 16-byte aligned).
//  * Inputs must stay unchanged and outputs untouched until the stream passes the call.
//  * On a timeout the kernels give up (no trap) and record {op, rank, stalled peer}; the runtime
//    is then unusable (every later kernel returns at once) and check_error() says why. Capacity
//    and invalid-topk_idx errors do not break the runtime; clear_error() resets them.
// Methods throw std::invalid_argument for bad arguments, std::runtime_error for CUDA errors.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transports/nvlink/cuda/nvlink_common.hpp"

namespace ep {

// Dispatch rows (x + scales) up to this size use NvlinkConfig::small_row_dispatch_send_warps.
constexpr int kSmallDispatchRowBytes = 8192;

struct NvlinkConfig {
  int max_tokens_per_rank = 4096;   // T of any rank (each source region holds this many rows)
  int max_hidden_bytes = 7168 * 2;  // largest row payload: dispatch H*elem and combine H*elem
  int max_topk = 8;                 // <= 32
  int max_scales = 128;             // float32 scale words per row
  int max_local_experts = 256;      // E / R
  double timeout_seconds = 60.0;    // every spin-wait, device and host
  int num_sms = kDefaultNumSms;     // blocks of dispatch/combine when a call passes 0
  // Warps of the 16 of a block that send (one more publishes, the rest receive); at most 14.
  // Every default below is the fastest count of the send-warp sweeps of
  // tests/native/nvlink_bench.cu on 2 GPUs (T=4096, H=7168); docs/history/ has the runs.
  // BF16 rows: 10 (at 11 the senders outrun the 4 receivers left).
  int dispatch_send_warps = 10;
  // Dispatch rows of at most kSmallDispatchRowBytes (x + scales; FP8 at H=7168 is 7,392 B).
  // Their senders stage x in shared memory (rows of at most kStagedRowBytes) and outrun 4
  // receivers at 12 warps; with claiming receivers, which finished senders join, 10 is best.
  int small_row_dispatch_send_warps = 10;
  // Any row, when this rank's outputs are in its own lent receive slab (its receive warps have
  // nothing to copy). <= 0: only the two above. 6 is best for BF16 and FP8 slab rows (fewer
  // senders contend less).
  int slab_dispatch_send_warps = 6;
  // Combine at 2 ranks: 5 since its BF16 sums pack with cvt.rn.bf16x2 (cheaper receivers); 4
  // and 6 are slower on every machine measured.
  int combine_send_warps = 5;
  // Combine from 3 ranks: each owner polls its tokens' rows from several peers and sums up to R of
  // them, so an 11th receive warp is worth more than a 5th sender (3 senders no longer keep the
  // link busy). <= 0: combine_send_warps at every rank count.
  int combine_send_warps_many_ranks = 4;
  // A group of one rank has no peers: its dispatch receivers and its combine senders never have
  // a row. true: dispatch sends with kNvlinkMaxSendWarps and combine with 1, whatever the
  // counts above say (the fastest counts of nvlink_bench with one rank, HT_BENCH_RANKS=1).
  bool one_rank_send_warps = true;
  // Receive slabs (PeerSlabs): a second IPC allocation of this many slabs, each sized for every
  // dispatch output at the config's maximum shape (rows: every token of every rank). 0: none.
  int recv_slabs = 0;
};

// What a dispatch call reads and writes. Rows: [tokens, hidden_bytes] raw bytes.
struct NvlinkDispatchArgs {
  const void* x = nullptr;          // [T, hidden_bytes]
  int num_tokens = 0;               // T (may be 0)
  int hidden_bytes = 0;             // H * element size, multiple of 16
  const float* x_scales = nullptr;  // [T, S] raw 4-byte words, optional
  int num_scales = 0;               // S
  const void* topk_idx = nullptr;   // [T, K] int64 (idx_bytes 8) or int32 (4)
  int idx_bytes = 8;
  const float* topk_weights = nullptr;  // [T, K], optional
  int num_topk = 0;                     // K
  int num_experts = 0;                  // E
  const int* send_pos = nullptr;        // [T, R] from layout()
  const int* recv_prefix = nullptr;     // [R+1] from notify()
  void* recv_x = nullptr;               // [rows, hidden_bytes]
  float* recv_x_scales = nullptr;       // [rows, S]   (when x_scales)
  void* recv_topk_idx = nullptr;        // [rows, K] of idx_bytes
  float* recv_topk_weights = nullptr;   // [rows, K]   (optional)
  int* recv_src_idx = nullptr;          // [rows]      (optional)
  int* recv_src_rank = nullptr;         // [rows]      (optional)
  int num_worst_tokens = 0;             // 0: rows = N exactly; > 0: rows = num_worst_tokens
  int num_sms = 0;                      // 0: config().num_sms
  // Receive slabs: dest_slabs is notify's [2R] output (null: write every peer's rows into its
  // buffer). own_slab: this rank lent recv_slab(i) to the notify before, and every recv_*
  // pointer above is that slab's array (recv_slab_layout, cached_slab_layout for a cached
  // dispatch). A cached dispatch takes slabs only right behind a notify (dispatch_follows), whose
  // num_tokens_per_rank are the handle's and whose recv_prefix it reads.
  const int* dest_slabs = nullptr;
  bool own_slab = false;
};

// What a combine call reads and writes.
struct NvlinkCombineArgs {
  const void* x = nullptr;                    // [num_recv_rows, hidden] of `elem`, dispatch order
  CombineElem elem = CombineElem::kBFloat16;  // of x, bias and out
  int hidden = 0;                             // H (elements)
  int num_recv_rows = 0;                      // rows of x: N, or num_worst_tokens
  const float* topk_weights = nullptr;        // [num_recv_rows, K], optional
  int num_topk = 0;                           // K of the weights, 0 without them
  const int* recv_prefix = nullptr;           // [R+1] of the dispatch
  const int* send_pos = nullptr;              // [T, R] of the dispatch
  int num_tokens = 0;                         // T of this rank
  const void* bias0 = nullptr;                // [T, H] of `elem` (float32: bias_f32), optional
  const void* bias1 = nullptr;                // [T, H] like bias0, optional
  bool bias_f32 = false;                      // float32 biases of 16-bit elements
  void* out = nullptr;                        // [T, H] of `elem`
  float* out_topk_weights = nullptr;          // [T, K], optional (needs K >= 1)
  int num_sms = 0;
};

// Counts the host needs after a normal-mode notify.
struct NvlinkRecvCounts {
  int num_recv_tokens = 0;         // N
  std::vector<int> per_rank;       // rows from each source rank
  std::vector<int> sent_per_rank;  // rows this rank sends to each rank (its layout)
  std::vector<int> per_expert;     // [E_loc], aligned to expert_alignment
  int rejected_ranks = 0;          // bit r: rank r's layout found an invalid topk_idx value
};

class NvlinkRuntime {
 public:
  // Allocates this rank's buffer on `device` (cudaMalloc, zeroed) and host-mapped records.
  NvlinkRuntime(int rank, int num_ranks, int device, const NvlinkConfig& config);
  ~NvlinkRuntime();
  NvlinkRuntime(const NvlinkRuntime&) = delete;
  NvlinkRuntime& operator=(const NvlinkRuntime&) = delete;

  // Bytes of each rank's buffer for a config.
  static size_t buffer_bytes(const NvlinkConfig& config, int num_ranks);

  int rank() const { return rank_; }
  int num_ranks() const { return num_ranks_; }
  int device() const { return device_; }
  const NvlinkConfig& config() const { return config_; }
  // Sets config().timeout_seconds for the launches that follow (Options.kernel_timeout_s may
  // change on a live group). Every spin-wait reads it per launch.
  void set_timeout_seconds(double seconds);
  void* buffer() const { return buffer_; }
  bool connected() const { return connected_; }

  // cudaIpcMemHandle_t of this rank's buffer (64 bytes), then of its slabs when it has any.
  std::vector<char> ipc_handle() const;
  // Opens every peer's handle (all_handles[r] from rank r; our own entry is ignored).
  void connect(const std::vector<std::vector<char>>& all_handles);
  // One process driving several GPUs: peer_buffers[r] = rank r's buffer(), already accessible
  // from this device (cudaDeviceEnablePeerAccess, or the same device); peer_slabs[r] likewise
  // rank r's recv_slab(0) (required when config.recv_slabs > 0).
  void connect_local(const std::vector<void*>& peer_buffers,
                     const std::vector<void*>& peer_slabs = {});

  // Receive slabs (NvlinkConfig::recv_slabs). Slab i starts at recv_slab(i); the output
  // arrays of a dispatch of this row shape sit at recv_slab_layout(...)'s offsets in it.
  int recv_slab_count() const { return config_.recv_slabs; }
  char* recv_slab(int i) const;
  SlabLayout recv_slab_layout(int hidden_bytes, int num_scales, int num_topk, int idx_bytes) const;
  // The arrays of a cached dispatch in a slab (x and scales only: no top-k metadata).
  SlabLayout cached_slab_layout(int hidden_bytes, int num_scales) const {
    return recv_slab_layout(hidden_bytes, num_scales, 0, 4);
  }
  // Owns the slabs' memory: destroy() drops the runtime's reference, and the memory is freed
  // once every holder (outputs still viewing a slab) has dropped theirs.
  std::shared_ptr<char> recv_slab_owner() const { return slabs_; }

  // Local step (no communication). Outputs (caller-allocated, device):
  //   num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
  //   is_token_in_rank [T, R] bool, send_pos [T, R] int32 (position among tokens sent to r, -1).
  // Invalid ids (outside [-1, E)) are recorded as an error and treated as -1.
  // workspace: nvlink_layout_workspace_bytes(num_tokens, num_experts) bytes of device memory
  // (stream-ordered, any contents) lets one block per 1,024 tokens run at once; null: one block.
  void layout(const void* topk_idx, int idx_bytes, int num_tokens, int num_topk, int num_experts,
              int* num_tokens_per_rank, int* num_tokens_per_expert, bool* is_token_in_rank,
              int* send_pos, cudaStream_t stream, void* workspace = nullptr);

  // Count exchange (communicating). Outputs (caller-allocated, device; keep them in the handle):
  //   recv_counts [R] int32 (rows from each source), recv_prefix [R+1] int32,
  //   num_recv_tokens_per_expert [E_loc] int32 (rounded up to expert_alignment).
  // host_counters: also publish N, per-rank and per-expert counts to host-mapped memory;
  // returns the ticket to pass to wait_recv_counts() (0 when host_counters is false).
  // num_worst_tokens > 0 only checks capacity (error record on overflow).
  // layout_error: the error state (host-mapped record, device lock) of the layout kernel that
  // produced the counts when it was not this runtime's layout(); an invalid topk_idx recorded
  // there rejects the routing on every rank, as one found by layout() does.
  // dispatch_follows: the caller's next communicating call is dispatch() on the same stream,
  // with no host wait for these counts in between (worst-case mode, or a host wait that comes
  // after the dispatch launch). The dispatch kernel is then launched behind notify with
  // programmatic dependent launch and overlaps it. Any other communicating call before that
  // dispatch throws std::logic_error.
  // lend_slab: this rank's receive slab for the dispatch that follows (-1: none); the slab's
  // earlier contents must no longer be needed by work ordered before this notify.
  // dest_slabs: [2R] int32 device output for that dispatch (DispatchArgs::dest_slabs).
  int notify(const int* num_tokens_per_rank, const int* num_tokens_per_expert, int num_experts,
             int expert_alignment, int num_worst_tokens, int* recv_counts, int* recv_prefix,
             int* num_recv_tokens_per_expert, bool host_counters, cudaStream_t stream,
             const LayoutErrorRef* layout_error = nullptr, bool dispatch_follows = false,
             int lend_slab = -1, int* dest_slabs = nullptr);

  // Polls the host-mapped counters until notify(ticket) has published them (no stream sync).
  // Throws std::runtime_error on a kernel error or after timeout_seconds.
  NvlinkRecvCounts wait_recv_counts(int ticket);
  // Non-blocking: true once notify(ticket) has published.
  bool recv_counts_ready(int ticket) const;

  // Dispatch (communicating). args.topk_idx must be set (see cached_dispatch otherwise). Writes
  // recv_x, recv_x_scales, recv_topk_idx (local ids, -1 elsewhere), recv_topk_weights (0 where
  // -1), recv_src_idx, recv_src_rank; rows ordered by source rank then source token. In
  // worst-case mode rows past N are padding: x/scales 0, idx -1, weights 0, src -1.
  void dispatch(const NvlinkDispatchArgs& args, cudaStream_t stream);
  // Same routing as an earlier dispatch (its send_pos/recv_prefix), new x (+ scales) only:
  // topk_idx/topk_weights and the recv metadata pointers are ignored.
  void cached_dispatch(const NvlinkDispatchArgs& args, cudaStream_t stream);

  // Combine (communicating): out[t] = round(+0 + sum over r ascending of row from r + bias0 +
  // bias1), accumulated in float32 (float64 for float64 rows); out_topk_weights likewise. The
  // biases are rows of `elem`, or float32 rows of 16-bit elements (bias_f32).
  void combine(const NvlinkCombineArgs& args, cudaStream_t stream);

  // The dispatch's send warps for rows of this shape (the small-row and slab rules of
  // NvlinkConfig); own_slab: the outputs are in this rank's own lent slab.
  int dispatch_send_warps(int hidden_bytes, int num_scales, bool own_slab = false) const;
  // The combine's send warps at this group's size (NvlinkConfig::combine_send_warps and
  // combine_send_warps_many_ranks, or the one-rank rule).
  int combine_send_warps() const;
  // Tuning knob: warps per block (of 16) that send in dispatch / combine (one more publishes,
  // the rest receive). small_row_dispatch_send_warps < 0: dispatch_send_warps for every row;
  // slab_dispatch_send_warps <= 0: no separate count for slab dispatches; one_rank_send_warps:
  // NvlinkConfig's rule for groups of one rank (off: the counts given here, for sweeps);
  // combine_send_warps_many_ranks <= 0: combine_send_warps at every rank count.
  void set_send_warps(int dispatch_send_warps, int combine_send_warps,
                      int small_row_dispatch_send_warps = -1, int slab_dispatch_send_warps = 0,
                      bool one_rank_send_warps = false, int combine_send_warps_many_ranks = 0);

  // All-to-all of raw bytes (communicating): AllToAllParams without `comm` (the runtime fills
  // it). Host mode: this rank's byte sizes and offsets, consistent with its peers' (rank s's
  // send_bytes[d] == rank d's recv_bytes[s]; on a mismatch rank d writes nothing from s and
  // records a non-fatal error naming both, never a write outside the given ranges). Device mode:
  // the splits stay on the device; an overflow of capacity_rows or invalid splits are recorded as a
  // non-fatal error (check_error) and nothing is written to the output. Every byte lands where the
  // split sizes say, so the result is bitwise that of any correct all-to-all.
  void all_to_all(const AllToAllParams& args, cudaStream_t stream);

  // Device-side barrier of all ranks' streams (communicating).
  void barrier(cudaStream_t stream);

  // A copy of the error record (code kErrorNone when there is none).
  ErrorRecord error_record() const;
  // "" when no kernel reported an error, else e.g.
  // "ep dispatch: rank 0 timed out after 60 s waiting for rank 1".
  std::string check_error() const;
  // True after a timeout: the runtime must be destroyed and rebuilt.
  bool failed() const;
  // Forgets a non-fatal error (capacity, invalid topk_idx). The stream must be idle.
  void clear_error();

  // Frees everything (idempotent). The device must be idle for this runtime's streams.
  void destroy();

 private:
  void check_ready(const char* op) const;
  // Throws std::logic_error when a notify(dispatch_follows) still waits for its dispatch.
  void check_no_dispatch_due(const char* op) const;
  CommContext comm_context() const;
  void launch_dispatch(const NvlinkDispatchArgs& args, bool cached, cudaStream_t stream);

  int rank_;
  int num_ranks_;
  int device_;
  NvlinkConfig config_;
  BufferLayout layout_{};
  char* buffer_ = nullptr;
  std::vector<char*> peers_;
  std::vector<bool> peer_opened_;  // opened with cudaIpcOpenMemHandle (close on destroy)
  std::shared_ptr<char> slabs_;    // recv_slabs x slab_bytes_ (null: none)
  size_t slab_bytes_ = 0;
  std::vector<char*> peer_slabs_;
  std::vector<bool> peer_slabs_opened_;
  bool connected_ = false;
  ErrorRecord* error_host_ = nullptr;
  ErrorRecord* error_dev_ = nullptr;
  HostCounters* counters_host_ = nullptr;
  HostCounters* counters_dev_ = nullptr;
  int next_ticket_ = 0;
  // Set by notify(dispatch_follows): the next communicating call must be dispatch() on this
  // stream (the pair shares one sequence number).
  bool dispatch_due_ = false;
  cudaStream_t dispatch_due_stream_ = nullptr;
  int due_experts_per_rank_ = 0;    // that notify's E_loc (its slots' word layout)
  bool due_rejects_ = false;        // that notify reports invalid routings (host counters)
  int host_num_local_experts_ = 0;  // E_loc of the last notify with host counters
  long long timeout_cycles_ = 0;
  int clock_khz_ = 0;  // peak SM clock, for timeout_cycles_
};

}  // namespace ep
