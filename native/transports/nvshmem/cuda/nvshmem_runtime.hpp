// NvshmemRuntime: the torch-free host side of the low-latency (decode) MoE dispatch/combine
// over NVSHMEM. It owns ONE symmetric region holding two alternating buffers (nvshmem_malloc in
// the process's NVSHMEM session, which start_session began) and launches the kernels of
// nvshmem_dispatch.cu / nvshmem_combine.cu on caller streams. Semantics: ep_backend/reference.py
// (low_latency_dispatch / low_latency_combine), bit for bit, except the combine's order of
// additions (see "combine out" below).
//
// Call sequence (every rank issues the same communicating calls in the same order):
//
//   std::vector<uint8_t> uid = NvshmemRuntime::unique_id(config);  // rank 0, once per process
//   ... send uid (128 bytes) to every rank through any store ...
//   NvshmemRuntime::start_session(rank, R, device, uid, config);   // collective, ONCE per process
//   NvshmemRuntime rt(rank, R, device, config);                    // collective (nvshmem_malloc)
//   int b = rt.dispatch(dargs, stream);                            // communicating
//   ... experts compute y[E_loc, R*M, H] ...
//   cargs.buffer_index = b; cargs.layout_range = dargs.layout_range;
//   rt.combine(cargs, stream);                                     // communicating
//   std::string err = rt.check_error();                            // "" when fine
//   rt.destroy();                          // collective (nvshmem_free); the session stays
//   NvshmemRuntime rt2(rank, R, device, bigger_config);  // growing: free, then malloc, same
//   session
//
// Shapes (M = config.max_tokens_per_rank, E_loc = E / R, all device pointers, contiguous):
//   dispatch in : x BF16 [T, H] (T <= M, H % 128 == 0, H <= config.max_hidden), topk_idx int64 or
//                 int32 [T, K] (K <= config.max_topk, -1 = none, values in [-1, E)).
//   dispatch out: recv_x [E_loc, R*M, H] BF16, or FP8 e4m3 bytes with use_fp8;
//                 recv_x_scales float32 [E_loc, R*M, H/128] (use_fp8), or int32
//                 [E_loc, R*M, H/512] (use_ue8m0: four UE8M0 exponent bytes per int32);
//                 recv_count int32 [E_loc]; src_info int32 [E_loc, R*M] (-1 past recv_count);
//                 layout_range int64 [E_loc, R] = (begin << 32) | count per source rank;
//                 optional cumulative_local_expert_recv_stats int32 [E_loc] (+= recv_count).
//                 Rows of expert le: source rank 0's first, then rank 1's, ...; within a
//                 rank by token index, then k. Slots past recv_count are left untouched unless
//                 zero_padding is set.
//   combine in  : x BF16 [E_loc, R*M, H] in the dispatch layout (or zero_copy: the caller wrote
//                 it into combine_buffer(b)), topk_weights float32 [T, K] (T, K of the
//                 dispatch), layout_range of the dispatch, its buffer index.
//   combine out : out BF16 [T, H] = bf16(sum of w_k * y_k), float32, no FMA: per expert rank in k
//                 order, then the ranks in first-appearance order: bit for bit
//                 reference.low_latency_combine(per_rank_partials=float32, or bfloat16 with
//                 bf16_partials); within float32-accumulation tolerance of its k order.
//
// Rules:
//  * NVSHMEM is initialised once per process (start_session) and never finalised by ep: after
//    nvshmem_finalize a later nvshmemx_init_attr skips the bootstrap and keeps the first one's
//    PEs, ignoring the new unique id (NVSHMEM's init.cu: nvshmemi_is_nvshmem_bootstrapped is
//    never reset; NVIDIA/nvshmem issue #68), so a restart cannot resize or re-wire a session.
//    Runtimes (buffers) come and go inside it: construction and destroy() are collective over
//    all R PEs (nvshmem_malloc / nvshmem_free), any number of times. One process per GPU.
//  * Calls execute one at a time per runtime, in issue order (one stream, or streams ordered
//    by events); no CPU synchronisation, CUDA-graph capturable (the sequence numbers live in
//    device memory; the buffer index is chosen on the host at issue/capture time).
//  * Per call every rank passes the same H, K-independent layout (H, E, use_fp8, use_ue8m0).
//  * Buffers: dispatch call i uses buffer i % 2 (or the index given); its combine uses the same
//    buffer. Safe orders: dispatch -> combine -> dispatch on ONE buffer (a captured CUDA graph
//    replays its pair on the buffer chosen at capture: every combine waits for the weights
//    flag of every rank, sent after its dispatch RECV), and alternating buffers (also
//    dispatch-only, or two hooks in flight, one per buffer). Not safe: three calls in flight,
//    or dispatch repeated on one buffer (combine repeated on one buffer) with nothing in
//    between. docs/low_latency.md.
//  * Hook mode: dispatch(phases=kPhaseSend) returns b; later dispatch(same args, phases =
//    kPhaseRecv, buffer_index = b) completes it. Same for combine. Inputs must stay unchanged
//    and outputs untouched until the RECV phase has run on the stream.
//  * On a timeout (config.timeout_seconds, %globaltimer) the kernels give up (no trap) and
//    record {op, rank, stalled peer}; the runtime is then unusable (later kernels return at
//    once) and check_error() says why; destroy and rebuild it. Capacity (more than M rows from
//    one rank to one expert: extra rows dropped) and invalid topk_idx (treated as -1) errors are
//    recorded too but are not fatal; clear_error() forgets them.
// Methods throw std::invalid_argument for bad arguments, std::runtime_error for CUDA/NVSHMEM
// errors.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "transports/nvshmem/cuda/nvshmem_common.hpp"

namespace ep {

struct NvshmemConfig {
  int max_tokens_per_rank = 128;  // M: T of any call, and rows one rank may send to one expert
  int max_hidden = 7168;          // largest H (multiple of 128, <= 8192)
  int max_topk = 8;               // largest K (<= 32)
  int num_experts = 16;           // largest E of any call (multiple of R, <= 1024)
  int num_ranks = 0;              // R the buffers are sized for; 0: the constructor's R (and
                                  // unique_id(config) sizes the heap for R = num_experts)
  bool use_fp8 = true;            // informational: buffers always fit BF16 rows too
  double timeout_seconds = 60.0;  // every device spin-wait
  int num_sms = 0;                // blocks per kernel; 0 = one per SM
  bool p2p_fast_path = true;      // false: NVSHMEM put APIs even for P2P-mapped peers (tests)
  // Emulated nodes (Options.ranks_per_node on one host): k > 0 puts ranks r and q on one node
  // when r / k == q / k, and peers on other nodes take the NVSHMEM put path even where P2P
  // mapped, as they would across hosts; on-node peers keep P2P. 0: no emulation.
  int emulated_ranks_per_node = 0;
  // Heap room for other users of this NVSHMEM session (the internode transport's buffers,
  // transports/internode): added to the heap size the runtime sets (NVSHMEM_SYMMETRIC_SIZE).
  size_t extra_symmetric_bytes = 0;
};

// Dispatch arguments (device pointers; see the header comment for shapes).
struct NvshmemDispatchArgs {
  const void* x = nullptr;  // BF16 [T, H]
  int num_tokens = 0;       // T, 0 .. M
  int hidden = 0;           // H
  const void* topk_idx = nullptr;
  int idx_bytes = 8;  // 8: int64, 4: int32
  int num_topk = 0;   // K
  int num_experts = 0;
  bool use_fp8 = false;
  bool round_scale = false;
  bool use_ue8m0 = false;
  void* recv_x = nullptr;
  void* recv_x_scales = nullptr;  // float32, or int32 with use_ue8m0 (use_fp8 only)
  int* recv_count = nullptr;
  int* src_info = nullptr;
  int64_t* layout_range = nullptr;
  int* cumulative_local_expert_recv_stats = nullptr;  // optional
  bool zero_padding = false;  // zero recv_x / recv_x_scales rows past recv_count
  int phases = nvshmem::kPhaseBoth;
  int buffer_index = -1;           // -1: the next buffer (SEND, BOTH); required for RECV only
  double timeout_seconds = 0;      // of this call's spin-waits; 0: config().timeout_seconds
  const int* rank_mask = nullptr;  // device int32 [R], 1 = masked (nvshmem::Context), or null
};

// Combine arguments.
struct NvshmemCombineArgs {
  const void* x = nullptr;  // BF16 [E_loc, R*M, H]; ignored with zero_copy
  bool zero_copy = false;   // x was written into combine_buffer(buffer_index)
  int hidden = 0;
  // Float32 [T, K], null = all weights 1. T and K are the dispatch's; where each entry went is
  // taken from the dispatch itself (its send_route), so combine needs no topk_idx.
  const float* topk_weights = nullptr;
  int num_tokens = 0;
  int num_topk = 0;
  int num_experts = 0;
  const int64_t* layout_range = nullptr;  // of the dispatch
  int buffer_index = 0;                   // returned by the dispatch
  void* out = nullptr;                    // BF16 [T, H]
  int phases = nvshmem::kPhaseBoth;
  double timeout_seconds = 0;      // of this call's spin-waits; 0: config().timeout_seconds
  const int* rank_mask = nullptr;  // device int32 [R], 1 = masked (nvshmem::Context), or null
  // A rank's sum of a token's entries goes back rounded to BF16 instead of float32
  // (Options.low_latency_combine_bf16_partials); every rank of the call must pass the same.
  bool bf16_partials = false;
};

// A region of the symmetric heap seen as a contiguous row-major tensor.
struct NvshmemBufferView {
  void* ptr = nullptr;
  int64_t shape[3] = {0, 0, 0};  // [E_loc, R*M, H], BF16
};

class NvshmemRuntime {
 public:
  // 128 opaque bytes (nvshmemx_uniqueid_t); call on rank 0 and hand them to every rank.
  // NVSHMEM may read its environment on this first call, so the overload taking the config sets
  // the variables the runtime needs first (prefer it; the constructor sets them on other ranks).
  static std::vector<uint8_t> unique_id();
  static std::vector<uint8_t> unique_id(const NvshmemConfig& config);
  // Sets NVSHMEM_DISABLE_NVLS=1 and, unless the user chose one, NVSHMEM_SYMMETRIC_SIZE for the
  // config (symmetric_bytes + 256 MiB). Called by the constructor and unique_id(config).
  static void set_environment(const NvshmemConfig& config);
  // Collective, once per process: initialises NVSHMEM on `device` (NVSHMEMX_INIT_WITH_UNIQUEID)
  // with PE `rank` of `num_ranks`, sizing the initial heap for `config` (set_environment; the
  // heap grows on later nvshmem_malloc where CUDA VMM is on, NVSHMEM's default on x86 and arm).
  // Throws, changing nothing, if this process started a session already.
  static void start_session(int rank, int num_ranks, int device, const std::vector<uint8_t>& uid,
                            const NvshmemConfig& config);
  // Whether start_session succeeded in this process; if so its PE, PE count and device.
  static bool session(int* pe, int* num_pes, int* device);
  // This rank's part, no collective: checks the config and the session (started with PE `rank`
  // of `num_ranks` on `device`), sizes the grids, allocates the private buffers. connect() then
  // makes the symmetric region, once every rank's constructor succeeded.
  NvshmemRuntime(int rank, int num_ranks, int device, const NvshmemConfig& config);
  ~NvshmemRuntime();
  NvshmemRuntime(const NvshmemRuntime&) = delete;
  NvshmemRuntime& operator=(const NvshmemRuntime&) = delete;

  // Symmetric bytes a config needs (both buffers).
  static size_t symmetric_bytes(const NvshmemConfig& config);

  int rank() const { return rank_; }
  int num_ranks() const { return num_ranks_; }
  int device() const { return device_; }
  const NvshmemConfig& config() const { return config_; }
  // Whether rank `pe` is reached with plain loads/stores (nvshmem_ptr != null).
  bool peer_is_p2p(int pe) const;
  // Buffer the next SEND picks.
  int next_buffer_index() const { return next_buffer_; }

  // Communicating. Returns the buffer index used (keep it for the RECV phase and combine).
  int dispatch(const NvshmemDispatchArgs& args, cudaStream_t stream);
  // Communicating.
  void combine(const NvshmemCombineArgs& args, cudaStream_t stream);
  // Zero-copy combine input of buffer `buffer_index`: BF16 [E/R, R*M, hidden]. Write the expert
  // outputs there, then combine(zero_copy = true) with the same buffer index.
  NvshmemBufferView combine_buffer(int buffer_index, int num_experts, int hidden) const;

  // Host barrier of all ranks (nvshmem_barrier_all after a device synchronisation).
  int dispatch_blocks() const { return dispatch_blocks_; }  // grid of both kernels
  void barrier();

  // "" when no kernel reported an error, else e.g.
  // "ep low_latency_dispatch: rank 0 timed out after 60 s waiting for rank 1".
  std::string check_error() const;
  // True after a timeout: the runtime must be destroyed and rebuilt.
  bool failed() const;
  // Forgets a non-fatal error (capacity, invalid topk_idx). The device must be idle.
  void clear_error();

  // Collective over the session's PEs (nvshmem_malloc, which has no timeout: call it only once
  // every rank's constructor succeeded, as the caller agrees out of band): allocates and zeroes
  // the symmetric region (both buffers) and maps P2P-reachable peers; the device is synchronised
  // on return. No peer may signal into this rank's region before this rank's connect returned:
  // the caller's agreement that every rank connected is that barrier.
  void connect();

  // Collective once connected: frees the symmetric region (nvshmem_free; idempotent), then the
  // rest. Before connect() it only frees this rank's buffers. NVSHMEM stays initialised: a new
  // runtime may be created afterwards in the same session.
  void destroy();

  // Frees this rank's buffers with no collective, leaving the symmetric region (if connect made
  // one) in the session's heap: for a setup that failed on some rank, whose nvshmem_free would
  // wait for a PE that never calls it. The object is then unusable (destroy() does nothing).
  void abandon() noexcept;

 private:
  // The launch context of a call. timeout_seconds: the call's (0: config().timeout_seconds);
  // the one resolved here is kept for the call's timeout message.
  nvshmem::Context context(int buffer, double timeout_seconds);
  void require_num_experts(int num_experts, const char* op) const;
  void check_ready(const char* op) const;
  // Frees what only this rank holds (private buffers, peer table, error record) and marks the
  // runtime uninitialised: the shared tail of destroy() and abandon().
  void release_local() noexcept;

  int rank_ = 0;
  int num_ranks_ = 0;
  int device_ = 0;
  NvshmemConfig config_;
  nvshmem::BufferLayout layout_{};
  char* symmetric_ = nullptr;     // both buffers, nvshmem_malloc
  char* private_ = nullptr;       // control block, send_route, recv_tokens (cudaMalloc)
  char** peer_table_ = nullptr;   // device [2][R] P2P bases (or null) per buffer
  std::vector<char*> peer_base_;  // host copy for buffer 0 (nvshmem_ptr of the region)
  bool all_p2p_ = false;          // every peer_base_ entry is mapped (nvshmem::Context::all_p2p)
  nvshmem::ErrorRecord* error_host_ = nullptr;
  nvshmem::ErrorRecord* error_dev_ = nullptr;
  int next_buffer_ = 0;
  double last_timeout_seconds_ = 0;  // of the latest launch, for its timeout message
  int dispatch_blocks_ = 1;
  int combine_blocks_ = 1;
  bool initialized_ = false;
};

}  // namespace ep
