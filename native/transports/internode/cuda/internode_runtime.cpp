// InternodeRuntime (internode_runtime.hpp): symmetric buffers in the NVSHMEM session of the
// low-latency runtime, P2P bases of the node's ranks, and the kernel launches.
#include "transports/internode/cuda/internode_runtime.hpp"

#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <iterator>
#include <stdexcept>

#include "common/runtime_util.hpp"
#include "common/str_cat.hpp"
#include "transports/internode/cuda/internode_kernels.hpp"

namespace ep {
namespace {

constexpr runtime::Checks kChecks{"ep internode"};
using runtime::DeviceGuard;

const char* op_name(int op) {
  switch (op) {
    case internode::kOpDispatch:
      return "dispatch";
    case internode::kOpCachedDispatch:
      return "cached dispatch";
    case internode::kOpCombine:
      return "combine";
    default:
      return "internode kernel";
  }
}

}  // namespace

size_t InternodeRuntime::symmetric_bytes(int num_nodes, int ranks_per_node,
                                         const internode::Capacity& capacity) {
  return static_cast<size_t>(
      internode::RegionLayout::make(num_nodes, ranks_per_node, capacity).bytes);
}

InternodeRuntime::InternodeRuntime(const InternodeSetup& setup) : setup_(setup) {
  using namespace internode;
  kChecks.require(setup.num_nodes >= 1 && setup.num_nodes <= kMaxNodes,
                  "num_nodes must be in [1, " + std::to_string(kMaxNodes) + "]");
  kChecks.require(setup.ranks_per_node >= 1 && setup.ranks_per_node <= kMaxRanksPerNode,
                  "ranks_per_node must be in [1, 8]");
  kChecks.require(setup.num_nodes * setup.ranks_per_node == setup.num_ranks,
                  "num_nodes * ranks_per_node must be the number of ranks");
  kChecks.require(setup.rank >= 0 && setup.rank < setup.num_ranks, "rank out of range");
  kChecks.require(setup.node_rank != nullptr, "node_rank table missing");
  kChecks.require(setup.capacity.max_tokens >= 1 && setup.capacity.max_recv_rows >= 1,
                  "capacity must be positive");
  kChecks.require(nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED,
                  "NVSHMEM is not initialised (NvshmemRuntime::start_session starts it)");
  kChecks.require(nvshmem_n_pes() == setup.num_ranks && nvshmem_my_pe() == setup.rank,
                  "the NVSHMEM session has other PEs than this group");
  node_rank_.assign(setup.node_rank, setup.node_rank + setup.num_ranks);
  setup_.node_rank = node_rank_.data();
  try {
    DeviceGuard guard(setup.device);
    int sms = 0;
    kChecks.cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, setup.device),
                 "cudaDeviceGetAttribute(SMs)");
    sms_ = std::max(1, sms);
    blocks_ = blocksFor(setup.num_blocks > 0 ? setup.num_blocks : sms);
    layout_ = RegionLayout::make(setup.num_nodes, setup.ranks_per_node, setup.capacity);
    kChecks.require(nodeOf(setup.rank) >= 0, "this rank is missing from the node table");
    kChecks.cuda(cudaMalloc(reinterpret_cast<void**>(&control_), sizeof(Control)),
                 "cudaMalloc(control)");
    kChecks.cuda(cudaMemset(control_, 0, sizeof(Control)), "cudaMemset(control)");
    runtime::allocMappedHost(kChecks, "error", sizeof(ErrorRecord), &error_host_, &error_dev_);
    runtime::allocMappedHost(kChecks, "progress", sizeof(uint64_t) * kProgressWords,
                             &progress_host_, &progress_dev_);
    const int64_t words = static_cast<int64_t>(setup.num_ranks) * count_columns(setup.num_ranks) +
                          setup.capacity.max_local_experts;
    runtime::allocMappedHost(kChecks, "notify counts",
                             sizeof(NotifyHost) + sizeof(int) * static_cast<size_t>(words),
                             &notify_host_, &notify_dev_);
  } catch (...) {
    release_local();
    throw;
  }
}

void InternodeRuntime::connect() {
  using namespace internode;
  kChecks.require(control_ != nullptr && region_ == nullptr,
                  "connect: once, on a runtime whose own buffers were made");
  DeviceGuard guard(setup_.device);
  region_ = static_cast<char*>(nvshmem_malloc(static_cast<size_t>(layout_.bytes)));
  if (region_ == nullptr) {
    throw std::runtime_error(runtime::strCat(
        "ep internode: nvshmem_malloc(", layout_.bytes,
        ") failed: the symmetric heap cannot hold it. It grows on demand only with CUDA VMM "
        "(leave NVSHMEM_DISABLE_CUDA_VMM unset) up to NVSHMEM_MAX_MEMORY_PER_GPU; without VMM "
        "it is NVSHMEM_SYMMETRIC_SIZE, fixed when the process's session started"));
  }
  kChecks.cuda(cudaMemset(region_, 0, static_cast<size_t>(layout_.bytes)), "cudaMemset(region)");
  // Only the ranks of this rank's node are reached with loads and stores: the legs between
  // nodes take the put path even where one host could map them (emulated nodes).
  const int node = nodeOf(setup_.rank);
  for (int l = 0; l < setup_.ranks_per_node; ++l) {
    const int pe = node_rank_[node * setup_.ranks_per_node + l];
    node_peer_[l] = static_cast<char*>(nvshmem_ptr(region_, pe));
    if (node_peer_[l] == nullptr) {
      throw std::runtime_error("ep internode: rank " + std::to_string(pe) +
                               " of this rank's node is not reachable over NVLink (P2P)");
    }
  }
  // Every region is zeroed before anyone signals into it: this rank's here, and the caller's
  // agreement that every rank connected is the barrier.
  kChecks.cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

InternodeRuntime::~InternodeRuntime() {
  try {
    destroy();
  } catch (...) {
  }
}

void InternodeRuntime::destroy() {
  if (region_ == nullptr && control_ == nullptr && error_host_ == nullptr &&
      progress_host_ == nullptr && notify_host_ == nullptr)
    return;
  DeviceGuard guard(setup_.device);
  cudaDeviceSynchronize();
  if (region_ != nullptr) nvshmem_free(region_);  // collective
  region_ = nullptr;
  release_local();
}

void InternodeRuntime::abandon() noexcept {
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(setup_.device);
  cudaDeviceSynchronize();
  // The symmetric region, if any, stays in the session's heap: nvshmem_free would wait for every
  // PE, and some PE of a failed setup never calls it.
  region_ = nullptr;
  release_local();
  cudaSetDevice(previous);
}

void InternodeRuntime::release_local() noexcept {
  if (control_ != nullptr) cudaFree(control_);
  if (error_host_ != nullptr) cudaFreeHost(error_host_);
  if (progress_host_ != nullptr) cudaFreeHost(progress_host_);
  if (notify_host_ != nullptr) cudaFreeHost(notify_host_);
  control_ = nullptr;
  error_host_ = error_dev_ = nullptr;
  progress_host_ = progress_dev_ = nullptr;
  notify_host_ = notify_dev_ = nullptr;
  for (char*& peer : node_peer_) peer = nullptr;
}

internode::Context InternodeRuntime::context(int op, double timeout_seconds,
                                             const internode::RecordLayout& rec) {
  using namespace internode;
  Context c{};
  c.region = region_;
  for (int l = 0; l < kMaxRanksPerNode; ++l) c.node_peer[l] = node_peer_[l];
  for (int i = 0; i < setup_.num_ranks; ++i) {
    c.node_rank[i] = node_rank_[i];
    c.rank_node[node_rank_[i]] = static_cast<int16_t>(i / setup_.ranks_per_node);
    c.rank_local[node_rank_[i]] = static_cast<int16_t>(i % setup_.ranks_per_node);
  }
  c.rank = setup_.rank;
  c.node = c.rank_node[setup_.rank];
  c.local = c.rank_local[setup_.rank];
  c.num_nodes = setup_.num_nodes;
  c.ranks_per_node = setup_.ranks_per_node;
  c.num_ranks = setup_.num_ranks;
  c.layout = layout_;
  c.rec = rec;
  c.ctrl = control_;
  c.err = error_dev_;
  c.progress = progress_dev_;
  last_op_ = op;
  last_timeout_ = timeout_seconds;
  c.timeout_ns = static_cast<long long>(timeout_seconds * 1e9);
  c.op = op;
  return c;
}

uint64_t InternodeRuntime::notify(const InternodeNotifyArgs& a, cudaStream_t stream) {
  using namespace internode;
  kChecks.require(region_ != nullptr, "notify on a destroyed runtime");
  kChecks.require(a.per_rank != nullptr && a.offsets != nullptr && a.recv_counts != nullptr &&
                      a.num_recv != nullptr,
                  "notify needs its count arrays");
  kChecks.require(
      a.node_count != nullptr &&
          (a.num_tokens == 0 || (a.is_token_in_rank != nullptr && a.send_pos != nullptr &&
                                 a.dest_slot != nullptr && a.node_pos != nullptr)),
      "notify needs the plan's arrays");
  kChecks.require(a.num_tokens >= 0 && a.num_tokens <= layout_.cap.max_tokens,
                  "more tokens than the buffers hold");
  kChecks.require(a.per_expert == nullptr || (a.experts_per_rank >= 1 &&
                                              a.experts_per_rank <= layout_.cap.max_local_experts &&
                                              a.recv_per_expert != nullptr),
                  "more experts per rank than the notify rows hold");
  DeviceGuard guard(setup_.device);
  NotifyParams p{};
  p.c = context(kOpDispatch, a.timeout_seconds, RecordLayout{});
  p.per_rank = a.per_rank;
  p.topk_idx = a.topk_idx;
  p.num_topk = a.num_topk;
  p.num_experts = a.num_experts;
  p.num_tokens = a.num_tokens;
  p.limit = a.limit;
  p.report_rejection = a.report_rejection;
  p.ticket = ++tickets_;
  p.offsets = a.offsets;
  p.recv_counts = a.recv_counts;
  p.num_recv = a.num_recv;
  p.host = notify_dev_;
  p.per_expert = a.per_expert;
  p.experts_per_rank = a.experts_per_rank;
  p.expert_alignment = std::max(1, a.expert_alignment);
  p.recv_per_expert = a.recv_per_expert;
  p.is_token_in_rank = a.is_token_in_rank;
  p.send_pos = a.send_pos;
  p.dest_slot = a.dest_slot;
  p.node_pos = a.node_pos;
  p.node_count = a.node_count;
  kChecks.cuda(launch_notify(p, stream), "launching the internode notify");
  return p.ticket;
}

bool InternodeRuntime::notify_counts(uint64_t ticket, int64_t* rows, int64_t* per_expert,
                                     int num_local_experts) const {
  using namespace internode;
  const volatile NotifyHost* h = notify_host_;
  if (h == nullptr || h->ticket != ticket) return false;
  std::atomic_thread_fence(std::memory_order_acquire);
  const volatile int* counts = reinterpret_cast<const volatile int*>(
      reinterpret_cast<const char*>(notify_host_) + sizeof(NotifyHost));
  const int64_t n = static_cast<int64_t>(setup_.num_ranks) * count_columns(setup_.num_ranks);
  for (int64_t i = 0; i < n; ++i) rows[i] = counts[i];
  const int64_t experts = std::min<int64_t>(num_local_experts, layout_.cap.max_local_experts);
  for (int64_t e = 0; e < experts; ++e) per_expert[e] = counts[n + e];
  return true;
}

std::string InternodeRuntime::take_rejection() {
  using namespace internode;
  const volatile NotifyHost* h = notify_host_;
  if (h == nullptr || h->rejections == rejections_seen_) return "";
  std::atomic_thread_fence(std::memory_order_acquire);
  const uint64_t count = h->rejections;
  std::string msg;
  using runtime::strCat;
  if (h->reason == kRejectInvalidTopk) {
    msg = strCat("rank ", h->a, " (node ", nodeOf(static_cast<int>(h->a)), ") was given ", h->b,
                 " top-k id(s) outside [-1, num_experts)");
  } else {
    msg = strCat("rank ", h->a, " (node ", nodeOf(static_cast<int>(h->a)), ") receives ", h->b,
                 " rows, more than num_worst_tokens=", h->limit);
  }
  if (count - rejections_seen_ > 1) {
    msg += strCat(" (the latest of ", count - rejections_seen_, " rejected calls)");
  }
  rejections_seen_ = count;
  return msg;
}

void InternodeRuntime::dispatch(const InternodeDispatchArgs& a, cudaStream_t stream) {
  using namespace internode;
  kChecks.require(region_ != nullptr, "dispatch on a destroyed runtime");
  kChecks.require(a.num_tokens >= 0 && a.num_tokens <= layout_.cap.max_tokens,
                  "more tokens than the buffers hold");
  kChecks.require(a.out_rows >= 0 && a.out_rows <= layout_.cap.max_recv_rows,
                  "more output rows than the buffers hold");
  kChecks.require(a.topk >= 0 && a.topk <= kMaxTopk, "top-k must be in [0, 32]");
  kChecks.require(
      a.recv_counts != nullptr && a.num_recv != nullptr && (a.out_x != nullptr || a.out_rows == 0),
      "dispatch needs the notify's counts and its outputs");
  const RecordLayout rec =
      RecordLayout::make(a.x_bytes, a.scale_bytes, a.topk, setup_.ranks_per_node);
  kChecks.require(
      rec.r_bytes <= layout_.cap.max_record && rec.n_bytes <= layout_.cap.max_out_record,
      "rows larger than the buffers hold");
  DeviceGuard guard(setup_.device);
  DispatchParams p{};
  p.c = context(a.cached ? kOpCachedDispatch : kOpDispatch, a.timeout_seconds, rec);
  p.x = static_cast<const char*>(a.x);
  p.x_scales = static_cast<const char*>(a.x_scales);
  p.topk_idx = a.topk_idx;
  p.topk_weights = a.topk_weights;
  p.dest_slot = a.dest_slot;
  p.node_pos = a.node_pos;
  p.node_count = a.node_count;
  p.num_tokens = a.num_tokens;
  p.experts_per_rank = a.experts_per_rank;
  p.recv_counts = a.recv_counts;
  p.num_recv = a.num_recv;
  p.out_rows = a.out_rows;
  p.out_x = static_cast<char*>(a.out_x);
  p.out_scales = static_cast<char*>(a.out_scales);
  p.out_topk = a.out_topk;
  p.out_weights = a.out_weights;
  p.out_src_idx = a.out_src_idx;
  p.out_src_rank = a.out_src_rank;
  kChecks.cuda(launch_dispatch(p, blocksFor(a.num_blocks), stream),
               "launching the internode dispatch");
}

void InternodeRuntime::combine(const InternodeCombineArgs& a, cudaStream_t stream) {
  using namespace internode;
  kChecks.require(region_ != nullptr, "combine on a destroyed runtime");
  kChecks.require(a.x_dtype == 0 || a.x_dtype == 1, "combine takes bf16 or float32 rows");
  kChecks.require(a.topk >= 0 && a.topk <= kMaxTopk, "top-k must be in [0, 32]");
  // K (agreed by every rank) decides the records' layout, never the pointer: a rank with no
  // received rows has an empty topk_weights, whose data pointer may be null.
  kChecks.require(a.topk == 0 || a.topk_weights != nullptr || a.num_rows == 0,
                  "K > 0 needs topk_weights for the received rows");
  kChecks.require(a.num_tokens >= 0 && a.num_tokens <= layout_.cap.max_tokens,
                  "more tokens than the buffers hold");
  const int64_t elem = a.x_dtype == 0 ? 2 : 4;
  const int64_t x_bytes = elem * a.hidden;
  kChecks.require(
      static_cast<int64_t>(align16(x_bytes)) + static_cast<int64_t>(align16(4 * a.topk)) <=
              layout_.cap.max_combine_row &&
          static_cast<int64_t>(align16(4 * a.hidden)) + static_cast<int64_t>(align16(4 * a.topk)) <=
              layout_.cap.max_partial_row,
      "rows larger than the buffers hold");
  DeviceGuard guard(setup_.device);
  CombineParams p{};
  p.c = context(kOpCombine, a.timeout_seconds,
                RecordLayout::make(x_bytes, 0, a.topk, setup_.ranks_per_node));
  p.x = static_cast<const char*>(a.x);
  p.topk_weights = a.topk_weights;
  p.recv_src_rank = a.recv_src_rank;
  p.recv_src_idx = a.recv_src_idx;
  p.num_rows = a.num_rows;
  p.x_dtype = a.x_dtype;
  p.hidden = a.hidden;
  p.topk = a.topk;
  p.is_token_in_rank = a.is_token_in_rank;
  p.num_tokens = a.num_tokens;
  p.bias0 = a.bias0;
  p.bias1 = a.bias1;
  p.out = static_cast<char*>(a.out);
  p.out_weights = a.out_weights;
  kChecks.cuda(launch_combine(p, blocksFor(a.num_blocks), stream),
               "launching the internode combine");
}

int InternodeRuntime::blocksFor(int requested) const {
  return std::clamp(requested > 0 ? requested : blocks_, 1, sms_);
}

int InternodeRuntime::nodeOf(int rank) const {
  for (int i = 0; i < setup_.num_ranks; ++i) {
    if (node_rank_[i] == rank) return i / setup_.ranks_per_node;
  }
  return -1;
}

std::string InternodeRuntime::check_error() const {
  if (error_host_ == nullptr) return "";
  const volatile ErrorRecord* e = error_host_;
  const int code = e->code;
  if (code == kErrorNone) return "";
  std::atomic_thread_fence(std::memory_order_acquire);
  using runtime::strCat;
  std::string msg =
      strCat("ep internode ", op_name(e->op), ": rank ", e->rank, " (node ", nodeOf(e->rank), ")");
  switch (code) {
    case kErrorTimeout:
      msg += strCat(" timed out after ", last_timeout_, " s waiting for rank ", e->peer, " (node ",
                    e->value_b, ")");
      break;
    case kErrorCapacity:
      msg += strCat(" overflowed a buffer (", e->value_a, " >= capacity ", e->value_b,
                    ", peer rank ", e->peer, ")");
      break;
    case kErrorOutOfStep:
      msg += strCat(" got a signal of call ", e->value_a, " from rank ", e->peer, " (node ",
                    nodeOf(e->peer), ") in its call ", e->value_b,
                    ": the ranks' internode calls are out of step (a bug: report it)");
      break;
    case kErrorInvalidTopkIdx:
      msg += strCat(" got an invalid routing entry (source rank ", e->peer, ", token ", e->value_a,
                    ", row ", e->value_b, ")");
      break;
    default:
      msg += strCat(" failed with error code ", code);
  }
  return msg;
}

std::string InternodeRuntime::progress() const {
  using namespace internode;
  if (progress_host_ == nullptr || last_op_ == kOpNone) return "";
  // The stages of the latest call's op, in launch order.
  static const int kDispatchStages[] = {kStageNotify,        kStageNotifyWaited,    kStagePack,
                                        kStagePutForward,    kStageCountsSignalled, kStageForward,
                                        kStageForwardWaited, kStageQuiet,           kStageQuietDone,
                                        kStageBarrier,       kStageBarrierDone};
  static const int kCombineStages[] = {kStageCombineSend,     kStageBarrier,    kStageBarrierDone,
                                       kStageCombineReduce,   kStageCombineOut, kStageCombineQuiet,
                                       kStageCombineQuietDone};
  const bool combine = last_op_ == kOpCombine;
  const int* stages = combine ? kCombineStages : kDispatchStages;
  const int count = combine ? static_cast<int>(std::size(kCombineStages))
                            : static_cast<int>(std::size(kDispatchStages));
  const volatile uint64_t* marks = progress_host_;
  // The latest call that started on the GPU (a CUDA graph's replays count too).
  const uint64_t seq = marks[kLatestSeqWord];
  using runtime::strCat;
  if (seq == 0) return strCat("its kernels (", op_name(last_op_), ") never started");
  std::string msg =
      strCat("its kernels (call ", seq, " of this runtime, ", op_name(last_op_), ") ");
  bool all = true;
  for (int i = 0; i < count && all; ++i) {
    if (marks[stages[i]] < seq) {
      msg += strCat("never got past ", i == 0 ? "their launch" : stage_name(stages[i - 1]),
                    " (next: ", stage_name(stages[i]), ")");
      all = false;
    }
  }
  if (all) msg += "reached every stage";
  // The latest wait of block 0 in this call, if any: whom it waited for and what it saw.
  const volatile uint64_t* wait = marks + kNumStages;
  if (wait[kWaitSeq] == seq) {
    std::atomic_thread_fence(std::memory_order_acquire);
    const int peer = static_cast<int>(wait[kWaitPeer]);
    msg +=
        strCat("; its latest wait (", stage_name(static_cast<int>(wait[kWaitStage])),
               ") was for rank ", peer, " (node ", nodeOf(peer), "): word ",
               runtime::Hex{wait[kWaitSeen]}, ", waiting for >= ", runtime::Hex{wait[kWaitTarget]});
  }
  return msg;
}

bool InternodeRuntime::failed() const {
  return error_host_ != nullptr && error_host_->code != kErrorNone;
}

}  // namespace ep
