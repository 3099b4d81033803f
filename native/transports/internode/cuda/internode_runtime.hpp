// InternodeRuntime: the torch-free host side of the hierarchical internode dispatch / combine.
// It lives in libep_nvshmem.so next to the low-latency runtime and uses the process's NVSHMEM
// session (NvshmemRuntime::start_session: once per process, one unique id through the c10d
// store, never finalised): its buffers are one nvshmem_malloc of the session's symmetric heap,
// independent of the low-latency buffers. Construction and destroy() are collective; growing is
// destroy() then a new runtime, in the same session.
//
// Per call (every rank issues the same calls in the same order, one stream or streams ordered
// by events): dispatch() or combine() enqueue their kernels; check_error() reports a kernel error
// of an earlier call ("" when none), naming the stalled peer as (node, rank) on a timeout.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "transports/internode/cuda/internode_common.hpp"

namespace ep {

struct InternodeSetup {
  int rank = 0;
  int num_ranks = 0;
  int device = 0;
  int num_nodes = 0;
  int ranks_per_node = 0;
  const int* node_rank = nullptr;  // [num_nodes * ranks_per_node]: global rank of (node, local)
  internode::Capacity capacity;
  int num_blocks = 0;  // blocks per kernel; 0: one per SM
};

// Host arguments of one notify, the count exchange that starts a (cached) dispatch (device
// pointers; NotifyParams in internode_common.hpp).
struct InternodeNotifyArgs {
  const int* per_rank = nullptr;      // [R] int32: rows this rank sends to each rank
  const int64_t* topk_idx = nullptr;  // [T, K] int64 global ids (its out-of-range ids are
                                      // counted), or null: a cached dispatch
  int num_topk = 0;
  int num_experts = 0;
  int num_tokens = 0;
  int64_t limit = 0;              // > 0: reject a call where a rank receives more rows
  bool report_rejection = false;  // no host read follows: record a rejection for later
  int* offsets = nullptr;         // [R] out
  int* recv_counts = nullptr;     // [R] out
  int* num_recv = nullptr;        // [1] out
  // A dispatch's (null for a cached one): the layout's tokens per global expert ([E] int32) in,
  // rows received per local expert rounded up to expert_alignment ([experts_per_rank]) out.
  const int* per_expert = nullptr;
  int experts_per_rank = 0;
  int expert_alignment = 1;
  int* recv_per_expert = nullptr;
  // The plan of this rank's rows (NotifyParams), made on the device after the counts.
  const bool* is_token_in_rank = nullptr;  // [T, R]
  const int* send_pos = nullptr;           // [T, R]
  int* dest_slot = nullptr;                // [T, R] out
  int* node_pos = nullptr;                 // [T, N] out
  int* node_count = nullptr;               // [N] out
  double timeout_seconds = 60;
};

// Host arguments of one dispatch (device pointers; shapes in internode_common.hpp). It follows
// its notify, whose recv_counts and num_recv it reads on the device.
struct InternodeDispatchArgs {
  const void* x = nullptr;
  int64_t x_bytes = 0;  // bytes of one row of x
  const void* x_scales = nullptr;
  int64_t scale_bytes = 0;            // bytes of one row of x_scales (0: none)
  const int64_t* topk_idx = nullptr;  // null: cached dispatch
  const float* topk_weights = nullptr;
  int topk = 0;
  const int* dest_slot = nullptr;
  const int* node_pos = nullptr;
  const int* node_count = nullptr;
  int num_tokens = 0;
  int experts_per_rank = 1;
  const int* recv_counts = nullptr;
  const int* num_recv = nullptr;
  int64_t out_rows = 0;  // rows of the outputs: the received ones, then padding
  void* out_x = nullptr;
  void* out_scales = nullptr;
  int64_t* out_topk = nullptr;
  float* out_weights = nullptr;
  int* out_src_idx = nullptr;
  int* out_src_rank = nullptr;
  double timeout_seconds = 60;
  bool cached = false;
  int num_blocks = 0;  // blocks of the kernels (Options.num_sms, read per call); 0: the setup's
};

struct InternodeCombineArgs {
  const void* x = nullptr;  // [num_rows, hidden] bf16 or float32
  int x_dtype = 0;          // 0: bf16, 1: float32
  int hidden = 0;
  int num_rows = 0;
  const float* topk_weights = nullptr;
  int topk = 0;
  const int* recv_src_rank = nullptr;
  const int* recv_src_idx = nullptr;
  const bool* is_token_in_rank = nullptr;
  int num_tokens = 0;
  const float* bias0 = nullptr;  // [num_tokens, hidden] float32
  const float* bias1 = nullptr;
  void* out = nullptr;
  float* out_weights = nullptr;
  double timeout_seconds = 60;
  int num_blocks = 0;  // blocks of the kernels (Options.num_sms, read per call); 0: the setup's
};

class InternodeRuntime {
 public:
  // Local: checks the setup and makes this rank's own buffers (no collective, so a failure here
  // leaves no peer waiting). connect() then makes the symmetric region.
  explicit InternodeRuntime(const InternodeSetup& setup);
  ~InternodeRuntime();
  InternodeRuntime(const InternodeRuntime&) = delete;
  InternodeRuntime& operator=(const InternodeRuntime&) = delete;

  // Symmetric bytes of a setup (to size the heap before NVSHMEM starts).
  static size_t symmetric_bytes(int num_nodes, int ranks_per_node,
                                const internode::Capacity& capacity);

  const internode::Capacity& capacity() const { return layout_.cap; }
  // Enqueues the notify of a (cached) dispatch; returns its ticket, which notify_counts takes.
  uint64_t notify(const InternodeNotifyArgs& args, cudaStream_t stream);
  // Whether the notify of `ticket` has finished; if so, the [R, R + 2] count rows it saw
  // (internode::count_columns) in `rows` (R * (R + 2) values) and the rows this rank receives
  // per local expert, aligned, in `per_expert` (num_local_experts values; a dispatch's notify).
  // A notify that failed (a timeout) finishes too: check_error() says so.
  bool notify_counts(uint64_t ticket, int64_t* rows, int64_t* per_expert,
                     int num_local_experts) const;
  // A worst-case call the notify rejected since the last take (none: ""), as a message naming
  // the rank and the reason; the rejected call moved nothing and the runtime stays usable.
  std::string take_rejection();
  void dispatch(const InternodeDispatchArgs& args, cudaStream_t stream);
  void combine(const InternodeCombineArgs& args, cudaStream_t stream);
  std::string check_error() const;
  bool failed() const;
  // Which stages the kernels of the latest call reached (host-mapped marks, see
  // internode::Stage): "" while none was launched. For the error of a host wait that ran out.
  std::string progress() const;
  // Collective (nvshmem_malloc, which waits for every PE with no timeout): the symmetric region,
  // zeroed, and the pointers to the node's peers. Call it only once every rank's constructor
  // succeeded (the caller agrees on that first); no barrier: the caller's agreement that every
  // rank connected is that barrier.
  void connect();
  void destroy();  // collective (nvshmem_free) once connected; idempotent
  // Frees this rank's buffers with no collective, leaving the symmetric region (if connect made
  // one) in the session's heap: for a setup that failed on some rank, whose nvshmem_free would
  // wait for a PE that never calls it. The object is then unusable (destroy() does nothing).
  void abandon() noexcept;

 private:
  // The node of `rank` in the node table (setup's node_rank), -1 if it is not in it.
  int nodeOf(int rank) const;
  // Frees what only this rank holds (control block, host-mapped words): the shared tail of
  // destroy() and abandon().
  void release_local() noexcept;
  internode::Context context(int op, double timeout_seconds, const internode::RecordLayout& rec);

  InternodeSetup setup_;
  std::vector<int> node_rank_;
  internode::RegionLayout layout_{};
  char* region_ = nullptr;
  char* node_peer_[internode::kMaxRanksPerNode] = {};
  internode::Control* control_ = nullptr;
  ErrorRecord* error_host_ = nullptr;
  ErrorRecord* error_dev_ = nullptr;
  uint64_t* progress_host_ = nullptr;  // [kNumStages], host-mapped
  uint64_t* progress_dev_ = nullptr;
  internode::NotifyHost* notify_host_ = nullptr;  // host-mapped, then the count rows
  internode::NotifyHost* notify_dev_ = nullptr;
  uint64_t tickets_ = 0;          // notifies enqueued
  uint64_t rejections_seen_ = 0;  // NotifyHost::rejections already taken
  int last_op_ = internode::kOpNone;
  // The grid of a call's kernels: `requested` (or the setup's when 0), at most one block per SM.
  // The fused kernels' blocks wait for chunks that other blocks put, so all of them must be
  // resident at once.
  int blocksFor(int requested) const;
  int blocks_ = 1;
  int sms_ = 1;
  double last_timeout_ = 0;
};

}  // namespace ep
