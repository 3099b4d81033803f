// Host side of the nvlink runtime: buffer ownership, peer mapping, argument checks, launches.
#include "transports/nvlink/cuda/nvlink_runtime.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "common/env.hpp"
#include "common/runtime_util.hpp"
#include "transports/nvlink/cuda/nvlink_kernels.hpp"

namespace ep {
namespace {

constexpr runtime::Checks kChecks{"ep nvlink"};

using runtime::aligned16;
using runtime::DeviceGuard;

const char* op_name(int op) {
  switch (op) {
    case kOpLayout:
      return "layout";
    case kOpNotify:
      return "notify";
    case kOpDispatch:
      return "dispatch";
    case kOpCachedDispatch:
      return "cached dispatch";
    case kOpCombine:
      return "combine";
    case kOpBarrier:
      return "barrier";
    case kOpAllToAll:
      return "all_to_all";
    default:
      return "op";
  }
}

BufferLayout make_layout(const NvlinkConfig& c, int num_ranks) {
  BufferLayout l{};
  l.num_ranks = num_ranks;
  l.max_tokens = c.max_tokens_per_rank;
  l.max_local_experts = c.max_local_experts;
  size_t off = sizeof(ControlBlock);
  l.entered_offset = off;
  l.arrivals_offset = off + sizeof(uint64_t) * kMaxRanks;
  off = align_up(l.arrivals_offset + sizeof(uint64_t) * kMaxRanks, 128);
  l.notify_offset = off;
  off = align_up(off + sizeof(uint64_t) * 2 * num_ranks * l.notify_slot_words(), 128);
  const DispatchRow drow = DispatchRow::make(c.max_hidden_bytes, c.max_scales, c.max_topk);
  const CombineRow crow = CombineRow::make(c.max_hidden_bytes, c.max_topk);
  const int regions = std::max(num_ranks - 1, 1);
  l.dispatch_offset = off;
  l.dispatch_region_bytes = align_up(size_t(drow.stride) * c.max_tokens_per_rank, 128);
  off += l.dispatch_region_bytes * regions;
  l.combine_offset = off;
  l.combine_region_bytes = align_up(size_t(crow.stride) * c.max_tokens_per_rank, 128);
  off += l.combine_region_bytes * regions;
  l.dispatch_flags_offset = off;
  off = align_up(off + sizeof(uint64_t) * regions * size_t(c.max_tokens_per_rank), 128);
  l.combine_flags_offset = off;
  off = align_up(off + sizeof(uint64_t) * regions * size_t(c.max_tokens_per_rank), 128);
  l.a2a_lanes = a2a_lanes(num_ranks);
  const size_t lanes = size_t(l.a2a_lanes);
  l.a2a_private_offset = off;
  off = align_up(off + 2 * sizeof(uint64_t), 128);
  l.a2a_announce_offset = off;
  off = align_up(off + sizeof(uint64_t) * 2 * num_ranks * (1 + kA2AMaxLocalExperts), 128);
  l.a2a_credit_offset = off;
  off = align_up(off + sizeof(uint64_t) * num_ranks * lanes, 128);
  l.a2a_flags_offset = off;
  off = align_up(off + sizeof(uint64_t) * regions * lanes * kA2ASlots, 128);
  l.a2a_staging_offset = off;
  off += size_t(regions) * lanes * kA2ASlots * kA2AMaxChunkBytes;
  l.a2a_lines_offset = off;
  l.a2a_lines_region_bytes = align_up(a2a_lines_region_bytes(l.a2a_lanes), 128);
  off += size_t(regions) * l.a2a_lines_region_bytes;
  l.total_bytes = align_up(off, 4096);
  return l;
}

}  // namespace

void NvlinkRuntime::set_timeout_seconds(double seconds) {
  kChecks.require(seconds > 0, "timeout_seconds must be > 0");
  config_.timeout_seconds = seconds;
  // clock64 runs at (at most) the peak SM clock, so this is at least timeout_seconds.
  timeout_cycles_ = static_cast<long long>(seconds * clock_khz_ * 1000.0);
}

size_t NvlinkRuntime::buffer_bytes(const NvlinkConfig& config, int num_ranks) {
  return make_layout(config, num_ranks).total_bytes;
}

NvlinkRuntime::NvlinkRuntime(int rank, int num_ranks, int device, const NvlinkConfig& config)
    : rank_(rank), num_ranks_(num_ranks), device_(device), config_(config) {
  kChecks.require(num_ranks >= 1 && num_ranks <= kMaxRanks, "num_ranks must be in [1, 8]");
  kChecks.require(rank >= 0 && rank < num_ranks, "rank out of range");
  kChecks.require(config.max_tokens_per_rank >= 1, "max_tokens_per_rank must be >= 1");
  kChecks.require(config.max_hidden_bytes >= 16 && config.max_hidden_bytes % 16 == 0,
                  "max_hidden_bytes must be a positive multiple of 16");
  kChecks.require(config.max_topk >= 1 && config.max_topk <= kMaxTopk,
                  "max_topk must be in [1, 32]");
  kChecks.require(config.max_scales >= 0, "max_scales must be >= 0");
  kChecks.require(config.max_local_experts >= 1, "max_local_experts must be >= 1");
  kChecks.require(config.timeout_seconds > 0, "timeout_seconds must be > 0");
  kChecks.require(config.num_sms >= 1, "num_sms must be >= 1");
  set_send_warps(config.dispatch_send_warps, config.combine_send_warps,
                 config.small_row_dispatch_send_warps, config.slab_dispatch_send_warps,
                 config.one_rank_send_warps, config.combine_send_warps_many_ranks);

  DeviceGuard guard(device_);
  // Load every kernel now (see preload_* in nvlink_kernels.hpp: lazy loading can deadlock).
  kChecks.cuda(preload_nvlink_layout(), "loading the layout kernel");
  kChecks.cuda(preload_nvlink_notify(), "loading the notify kernel");
  kChecks.cuda(preload_nvlink_dispatch(), "loading the dispatch kernel");
  kChecks.cuda(preload_nvlink_combine(), "loading the combine kernels");
  kChecks.cuda(preload_nvlink_barrier(), "loading the barrier kernel");
  kChecks.cuda(preload_nvlink_all_to_all(), "loading the all-to-all kernel");
  layout_ = make_layout(config_, num_ranks_);
  kChecks.cuda(cudaMalloc(reinterpret_cast<void**>(&buffer_), layout_.total_bytes),
               "cudaMalloc(buffer)");
  // Zero everything: stale bytes could otherwise look like a current flag or sequence number.
  kChecks.cuda(cudaMemset(buffer_, 0, layout_.total_bytes), "cudaMemset(buffer)");
  kChecks.cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");

  runtime::allocMappedHost(kChecks, "error", sizeof(ErrorRecord), &error_host_, &error_dev_);
  const size_t counter_bytes = sizeof(HostCounters) + sizeof(int) * config_.max_local_experts;
  runtime::allocMappedHost(kChecks, "counters", counter_bytes, &counters_host_, &counters_dev_);

  kChecks.cuda(cudaDeviceGetAttribute(&clock_khz_, cudaDevAttrClockRate, device_),
               "cudaDeviceGetAttribute(clock)");
  if (clock_khz_ <= 0) clock_khz_ = 2000000;
  set_timeout_seconds(config_.timeout_seconds);

  peers_.assign(num_ranks_, nullptr);
  peer_opened_.assign(num_ranks_, false);
  peers_[rank_] = buffer_;

  kChecks.require(config_.recv_slabs >= 0 && config_.recv_slabs <= 64,
                  "recv_slabs must be in [0, 64]");
  peer_slabs_.assign(num_ranks_, nullptr);
  peer_slabs_opened_.assign(num_ranks_, false);
  if (config_.recv_slabs > 0) {
    const size_t rows = size_t(num_ranks_) * config_.max_tokens_per_rank;
    slab_bytes_ = align_up(
        SlabLayout::make(rows, config_.max_hidden_bytes, config_.max_scales, config_.max_topk, 8)
            .total,
        4096);
    char* raw = nullptr;
    kChecks.cuda(cudaMalloc(reinterpret_cast<void**>(&raw), slab_bytes_ * config_.recv_slabs),
                 "cudaMalloc(receive slabs)");
    const int dev = device_;
    slabs_ = std::shared_ptr<char>(raw, [dev](char* ptr) {
      int previous = 0;
      cudaGetDevice(&previous);
      cudaSetDevice(dev);
      cudaFree(ptr);
      cudaSetDevice(previous);
    });
    peer_slabs_[rank_] = raw;
  }
}

char* NvlinkRuntime::recv_slab(int i) const {
  kChecks.require(slabs_ != nullptr && i >= 0 && i < config_.recv_slabs, "recv_slab: no such slab");
  return slabs_.get() + size_t(i) * slab_bytes_;
}

SlabLayout NvlinkRuntime::recv_slab_layout(int hidden_bytes, int num_scales, int num_topk,
                                           int idx_bytes) const {
  return SlabLayout::make(size_t(num_ranks_) * config_.max_tokens_per_rank, hidden_bytes,
                          num_scales, num_topk, idx_bytes);
}

NvlinkRuntime::~NvlinkRuntime() {
  try {
    destroy();
  } catch (...) {
  }
}

void NvlinkRuntime::destroy() {
  if (buffer_ == nullptr && error_host_ == nullptr) return;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device_);
  cudaDeviceSynchronize();
  for (int r = 0; r < static_cast<int>(peers_.size()); ++r)
    if (peer_opened_[r]) cudaIpcCloseMemHandle(peers_[r]);
  for (int r = 0; r < static_cast<int>(peer_slabs_.size()); ++r)
    if (peer_slabs_opened_[r]) cudaIpcCloseMemHandle(peer_slabs_[r]);
  peers_.clear();
  peer_opened_.clear();
  peer_slabs_.clear();
  peer_slabs_opened_.clear();
  slabs_.reset();  // freed here unless dispatch outputs still view a slab
  if (buffer_ != nullptr) cudaFree(buffer_);
  if (error_host_ != nullptr) cudaFreeHost(error_host_);
  if (counters_host_ != nullptr) cudaFreeHost(counters_host_);
  buffer_ = nullptr;
  error_host_ = error_dev_ = nullptr;
  counters_host_ = counters_dev_ = nullptr;
  connected_ = false;
  cudaSetDevice(previous);
}

std::vector<char> NvlinkRuntime::ipc_handle() const {
  kChecks.require(buffer_ != nullptr, "runtime destroyed");
  DeviceGuard guard(device_);
  cudaIpcMemHandle_t h[2];
  kChecks.cuda(cudaIpcGetMemHandle(&h[0], buffer_), "cudaIpcGetMemHandle");
  if (slabs_ != nullptr)
    kChecks.cuda(cudaIpcGetMemHandle(&h[1], slabs_.get()), "cudaIpcGetMemHandle(slabs)");
  const char* p = reinterpret_cast<const char*>(h);
  return std::vector<char>(p, p + sizeof(cudaIpcMemHandle_t) * (slabs_ != nullptr ? 2 : 1));
}

void NvlinkRuntime::connect(const std::vector<std::vector<char>>& all_handles) {
  kChecks.require(!connected_, "already connected");
  kChecks.require(static_cast<int>(all_handles.size()) == num_ranks_, "need one handle per rank");
  DeviceGuard guard(device_);
  for (int r = 0; r < num_ranks_; ++r) {
    if (r == rank_) continue;
    const size_t count = slabs_ != nullptr ? 2 : 1;  // every rank has the same config
    kChecks.require(all_handles[r].size() == sizeof(cudaIpcMemHandle_t) * count,
                    "bad IPC handle size");
    cudaIpcMemHandle_t h[2];
    std::memcpy(h, all_handles[r].data(), sizeof(cudaIpcMemHandle_t) * count);
    void* p = nullptr;
    kChecks.cuda(cudaIpcOpenMemHandle(&p, h[0], cudaIpcMemLazyEnablePeerAccess),
                 "cudaIpcOpenMemHandle");
    peers_[r] = static_cast<char*>(p);
    peer_opened_[r] = true;
    if (count == 2) {
      kChecks.cuda(cudaIpcOpenMemHandle(&p, h[1], cudaIpcMemLazyEnablePeerAccess),
                   "cudaIpcOpenMemHandle(slabs)");
      peer_slabs_[r] = static_cast<char*>(p);
      peer_slabs_opened_[r] = true;
    }
  }
  connected_ = true;
}

void NvlinkRuntime::connect_local(const std::vector<void*>& peer_buffers,
                                  const std::vector<void*>& peer_slabs) {
  kChecks.require(!connected_, "already connected");
  kChecks.require(static_cast<int>(peer_buffers.size()) == num_ranks_, "need one buffer per rank");
  kChecks.require(slabs_ == nullptr || static_cast<int>(peer_slabs.size()) == num_ranks_,
                  "need one slab array per rank (config.recv_slabs > 0)");
  for (int r = 0; r < num_ranks_; ++r) {
    kChecks.require(peer_buffers[r] != nullptr, "null peer buffer");
    if (r != rank_) peers_[r] = static_cast<char*>(peer_buffers[r]);
    if (slabs_ != nullptr && r != rank_) {
      kChecks.require(peer_slabs[r] != nullptr, "null peer slab array");
      peer_slabs_[r] = static_cast<char*>(peer_slabs[r]);
    }
  }
  connected_ = true;
}

void NvlinkRuntime::check_ready(const char* op) const {
  kChecks.require(buffer_ != nullptr, op, "runtime destroyed");
  kChecks.require(connected_, op, "runtime not connected");
  if (failed()) throw std::runtime_error(check_error());
}

void NvlinkRuntime::check_no_dispatch_due(const char* op) const {
  if (dispatch_due_)
    throw std::logic_error(std::string(op) +
                           ": the previous notify was told a dispatch follows it, and none was "
                           "launched (the runtime's sequence numbers are now out of step)");
}

CommContext NvlinkRuntime::comm_context() const {
  CommContext c{};
  for (int r = 0; r < num_ranks_; ++r) {
    c.buffers.ptr[r] = peers_[r];
    c.slabs.ptr[r] = peer_slabs_[r];
  }
  c.slabs.slab_bytes = slab_bytes_;
  c.slabs.count = config_.recv_slabs;
  c.layout = layout_;
  c.error = error_dev_;
  c.timeout_cycles = timeout_cycles_;
  c.rank = rank_;
  c.num_ranks = num_ranks_;
  return c;
}

void NvlinkRuntime::layout(const void* topk_idx, int idx_bytes, int num_tokens, int num_topk,
                           int num_experts, int* num_tokens_per_rank, int* num_tokens_per_expert,
                           bool* is_token_in_rank, int* send_pos, cudaStream_t stream,
                           void* workspace) {
  kChecks.require(buffer_ != nullptr, "layout: runtime destroyed");
  kChecks.require(idx_bytes == 4 || idx_bytes == 8, "layout: topk_idx must be int32 or int64");
  kChecks.require(num_tokens >= 0, "layout: num_tokens must be >= 0");
  kChecks.require(num_topk >= 1 && num_topk <= kMaxTopk, "layout: K must be in [1, 32]");
  kChecks.require(num_experts >= num_ranks_ && num_experts % num_ranks_ == 0,
                  "layout: num_experts must be a positive multiple of the number of ranks");
  kChecks.require(num_tokens == 0 ||
                      (topk_idx != nullptr && is_token_in_rank != nullptr && send_pos != nullptr),
                  "layout: null pointer");
  kChecks.require(num_tokens_per_rank != nullptr && num_tokens_per_expert != nullptr,
                  "layout: null pointer");
  LayoutParams p{};
  p.topk_idx = topk_idx;
  p.idx_bytes = idx_bytes;
  p.num_tokens = num_tokens;
  p.num_topk = num_topk;
  p.num_experts = num_experts;
  p.num_ranks = num_ranks_;
  p.num_tokens_per_rank = num_tokens_per_rank;
  p.num_tokens_per_expert = num_tokens_per_expert;
  p.is_token_in_rank = is_token_in_rank;
  p.send_pos = send_pos;
  p.ctrl = reinterpret_cast<ControlBlock*>(buffer_);
  p.error = error_dev_;
  p.rank = rank_;
  p.workspace = workspace;
  DeviceGuard guard(device_);
  kChecks.cuda(launch_nvlink_layout(p, stream), "layout launch");
}

int NvlinkRuntime::notify(const int* num_tokens_per_rank, const int* num_tokens_per_expert,
                          int num_experts, int expert_alignment, int num_worst_tokens,
                          int* recv_counts, int* recv_prefix, int* num_recv_tokens_per_expert,
                          bool host_counters, cudaStream_t stream,
                          const LayoutErrorRef* layout_error, bool dispatch_follows, int lend_slab,
                          int* dest_slabs) {
  check_ready("notify");
  kChecks.require(lend_slab >= -1 && lend_slab < config_.recv_slabs,
                  "notify: no such receive slab");
  kChecks.require(lend_slab < 0 || dispatch_follows || host_counters,
                  "notify: a lent slab is for the dispatch that follows");
  check_no_dispatch_due("notify");
  kChecks.require(num_experts >= num_ranks_ && num_experts % num_ranks_ == 0,
                  "notify: num_experts must be a positive multiple of the number of ranks");
  kChecks.require(num_experts / num_ranks_ <= config_.max_local_experts,
                  "notify: num_experts / num_ranks exceeds config.max_local_experts");
  kChecks.require(expert_alignment >= 1, "notify: expert_alignment must be >= 1");
  kChecks.require(num_worst_tokens >= 0, "notify: num_worst_tokens must be >= 0");
  kChecks.require(num_tokens_per_rank && num_tokens_per_expert && recv_counts && recv_prefix &&
                      num_recv_tokens_per_expert,
                  "notify: null pointer");
  NotifyParams p{};
  p.comm = comm_context();
  p.num_tokens_per_rank = num_tokens_per_rank;
  p.num_tokens_per_expert = num_tokens_per_expert;
  p.experts_per_rank = num_experts / num_ranks_;
  p.expert_alignment = expert_alignment;
  p.num_worst_tokens = num_worst_tokens;
  p.recv_counts = recv_counts;
  p.recv_prefix = recv_prefix;
  p.num_recv_tokens_per_expert = num_recv_tokens_per_expert;
  if (layout_error != nullptr) {
    kChecks.require(layout_error->record != nullptr && layout_error->lock != nullptr,
                    "notify: layout_error needs its record and its lock");
    p.layout_error = layout_error->record;
    p.layout_error_lock = layout_error->lock;
  }
  p.dispatch_follows = dispatch_follows ? 1 : 0;
  p.lend_slab = lend_slab;
  p.dest_slabs = dest_slabs;
  int ticket = 0;
  if (host_counters) {
    ticket = ++next_ticket_;
    if (ticket <= 0) ticket = next_ticket_ = 1;  // wrapped
    p.host = counters_dev_;
    p.host_per_expert = reinterpret_cast<int*>(counters_dev_ + 1);
    p.host_ticket = ticket;
    host_num_local_experts_ = p.experts_per_rank;
  }
  DeviceGuard guard(device_);
  kChecks.cuda(launch_nvlink_notify(p, stream), "notify launch");
  dispatch_due_ = dispatch_follows;
  dispatch_due_stream_ = stream;
  due_experts_per_rank_ = p.experts_per_rank;
  due_rejects_ = host_counters;
  return ticket;
}

bool NvlinkRuntime::recv_counts_ready(int ticket) const {
  return counters_host_ != nullptr && counters_host_->ready_ticket == ticket;
}

namespace {
std::chrono::microseconds host_wait_spin() {
  static const std::chrono::microseconds spin{
      [] { return env::integer<env::kHostWaitSpinUs>(20000); }()};
  return spin;
}
}  // namespace

NvlinkRecvCounts NvlinkRuntime::wait_recv_counts(int ticket) {
  kChecks.require(ticket > 0, "wait_recv_counts: notify was not called with host_counters");
  kChecks.require(counters_host_ != nullptr, "wait_recv_counts: the runtime was destroyed");
  const auto start = std::chrono::steady_clock::now();
  const auto limit = std::chrono::duration<double>(config_.timeout_seconds);
  // The kernels time out on their own clock (cycles at the device's peak clock rate), later in
  // wall time than `limit` when the GPU runs below its peak: past `limit`, the host waits up to
  // `grace` more for their record, which names the peer they waited for, before raising without.
  const auto grace = 0.5 * limit + std::chrono::duration<double>(1.0);
  for (uint64_t iter = 0; counters_host_->ready_ticket != ticket; ++iter) {
    if ((iter & 1023) == 0) {
      if (error_host_->code != kErrorNone && failed()) throw std::runtime_error(check_error());
      if (std::chrono::steady_clock::now() - start > limit + grace) {
        std::ostringstream os;
        os << "ep notify: rank " << rank_ << " timed out after " << config_.timeout_seconds
           << " s waiting for the receive counts on the host";
        std::string err = check_error();
        if (!err.empty()) os << " (" << err << ")";
        throw std::runtime_error(os.str());
      }
      // Spin for the first EP_HOST_WAIT_SPIN_US (default 20 ms): a yield on a busy host can
      // keep this thread off its core for longer than the GPU needs to finish the dispatch
      // behind the wait.
      if (std::chrono::steady_clock::now() - start > host_wait_spin()) std::this_thread::yield();
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  NvlinkRecvCounts out;
  out.num_recv_tokens = counters_host_->num_recv_tokens;
  out.rejected_ranks = counters_host_->rejected_ranks;
  out.per_rank.resize(num_ranks_);
  out.sent_per_rank.resize(num_ranks_);
  for (int r = 0; r < num_ranks_; ++r) {
    out.per_rank[r] = counters_host_->num_recv_tokens_per_rank[r];
    out.sent_per_rank[r] = counters_host_->num_send_tokens_per_rank[r];
  }
  const volatile int* pe = reinterpret_cast<const volatile int*>(counters_host_ + 1);
  out.per_expert.resize(host_num_local_experts_);
  for (int e = 0; e < host_num_local_experts_; ++e) out.per_expert[e] = pe[e];
  return out;
}

void NvlinkRuntime::launch_dispatch(const NvlinkDispatchArgs& a, bool cached, cudaStream_t stream) {
  const char* op = cached ? "cached_dispatch" : "dispatch";
  check_ready(op);
  // A cached dispatch may follow a notify only to get receive slabs (its routing is known).
  if (cached && a.dest_slabs == nullptr) check_no_dispatch_due(op);
  kChecks.require(!dispatch_due_ || stream == dispatch_due_stream_,
                  "dispatch: must run on the stream of the notify it follows");
  kChecks.require(a.num_tokens >= 0 && a.num_tokens <= config_.max_tokens_per_rank, op,
                  "num_tokens exceeds config.max_tokens_per_rank");
  kChecks.require(a.hidden_bytes > 0 && a.hidden_bytes % 16 == 0, op,
                  "hidden bytes (H * element size) must be a positive multiple of 16");
  kChecks.require(a.hidden_bytes <= config_.max_hidden_bytes, op,
                  "hidden bytes exceed config.max_hidden_bytes");
  kChecks.require(a.num_scales >= 0 && a.num_scales <= config_.max_scales, op,
                  "number of scales exceeds config.max_scales");
  kChecks.require((a.num_scales == 0) == (a.x_scales == nullptr) || a.num_tokens == 0, op,
                  "x_scales and num_scales must be given together");
  kChecks.require(a.num_worst_tokens >= 0, op, "num_worst_tokens must be >= 0");
  kChecks.require(a.send_pos != nullptr || a.num_tokens == 0, op, "send_pos is null");
  kChecks.require(a.recv_prefix != nullptr, op, "recv_prefix is null");
  kChecks.require(a.recv_x != nullptr && aligned16(a.recv_x), op, "recv_x must be 16-byte aligned");
  kChecks.require(a.num_tokens == 0 || (a.x != nullptr && aligned16(a.x)), op,
                  "x must be 16-byte aligned");
  kChecks.require(a.num_scales == 0 || a.recv_x_scales != nullptr, op, "recv_x_scales is null");
  DispatchParams p{};
  p.comm = comm_context();
  p.x = a.x;
  p.hidden_bytes = a.hidden_bytes;
  p.scales = a.num_scales > 0 ? a.x_scales : nullptr;
  p.num_scales = a.num_scales;
  p.num_tokens = a.num_tokens;
  p.send_pos = a.send_pos;
  p.recv_prefix = a.recv_prefix;
  p.recv_x = a.recv_x;
  p.recv_scales = a.num_scales > 0 ? a.recv_x_scales : nullptr;
  p.num_worst_tokens = a.num_worst_tokens;
  p.num_send_warps = dispatch_send_warps(a.hidden_bytes, a.num_scales, a.own_slab);
  if (!cached) {
    kChecks.require(a.idx_bytes == 4 || a.idx_bytes == 8, op, "topk_idx must be int32 or int64");
    kChecks.require(a.num_topk >= 1 && a.num_topk <= config_.max_topk, op,
                    "K must be in [1, config.max_topk]");
    kChecks.require(a.num_experts >= num_ranks_ && a.num_experts % num_ranks_ == 0, op,
                    "num_experts must be a positive multiple of the number of ranks");
    kChecks.require(a.topk_idx != nullptr || a.num_tokens == 0, op, "topk_idx is null");
    kChecks.require(a.recv_topk_idx != nullptr, op, "recv_topk_idx is null");
    // A non-null marker keeps the kernel in metadata mode on ranks without tokens.
    static const long long kEmpty = 0;
    p.topk_idx = a.topk_idx != nullptr ? a.topk_idx : &kEmpty;
    p.idx_bytes = a.idx_bytes;
    p.topk_weights = a.topk_weights;
    p.num_topk = a.num_topk;
    p.experts_per_rank = a.num_experts / num_ranks_;
    p.recv_topk_idx = a.recv_topk_idx;
    p.recv_topk_weights = a.recv_topk_weights;
    p.recv_src_idx = a.recv_src_idx;
    p.recv_src_rank = a.recv_src_rank;
  }
  if (cached && a.dest_slabs != nullptr) {
    kChecks.require(dispatch_due_, op, "receive slabs need the notify launched right before it");
    p.experts_per_rank = due_experts_per_rank_;  // the layout of that notify's slots
  }
  if (a.dest_slabs != nullptr) {
    p.dest_slabs = a.dest_slabs;
    p.slab = cached ? cached_slab_layout(a.hidden_bytes, a.num_scales)
                    : recv_slab_layout(a.hidden_bytes, a.num_scales, a.num_topk, a.idx_bytes);
    kChecks.require(slabs_ != nullptr && p.slab.total <= slab_bytes_, op,
                    "receive slabs are missing or too small for this row shape");
    p.own_slab = a.own_slab ? 1 : 0;
    // In our own slab the receive warps do nothing, so nobody would write padding rows.
    kChecks.require(!a.own_slab || a.num_worst_tokens == 0, op,
                    "own_slab needs num_worst_tokens 0");
  } else {
    kChecks.require(!a.own_slab, op, "own_slab needs dest_slabs");
  }
  p.after_notify = dispatch_due_ ? 1 : 0;
  if (dispatch_due_) {
    // The senders may read notify's slots, laid out for its number of local experts.
    kChecks.require(p.experts_per_rank == due_experts_per_rank_, op,
                    "num_experts differs from the notify it follows");
    p.notify_rejects = due_rejects_ ? 1 : 0;
  }
  p.staged = a.hidden_bytes <= kStagedRowBytes ? 1 : 0;
  const int num_sms = a.num_sms > 0 ? a.num_sms : config_.num_sms;
  DeviceGuard guard(device_);
  kChecks.cuda(launch_nvlink_dispatch(p, num_sms, stream), "dispatch launch");
  dispatch_due_ = false;
}

void NvlinkRuntime::dispatch(const NvlinkDispatchArgs& args, cudaStream_t stream) {
  launch_dispatch(args, false, stream);
}

void NvlinkRuntime::cached_dispatch(const NvlinkDispatchArgs& args, cudaStream_t stream) {
  launch_dispatch(args, true, stream);
}

void NvlinkRuntime::combine(const NvlinkCombineArgs& a, cudaStream_t stream) {
  check_ready("combine");
  check_no_dispatch_due("combine");
  kChecks.require(a.elem == CombineElem::kBFloat16 || a.elem == CombineElem::kFloat16 ||
                      a.elem == CombineElem::kFloat32 || a.elem == CombineElem::kFloat64,
                  "combine: elements must be bfloat16, float16, float32 or float64");
  const long long hidden_bytes = static_cast<long long>(a.hidden) * combine_elem_bytes(a.elem);
  kChecks.require(a.hidden > 0 && hidden_bytes % 16 == 0,
                  "combine: hidden bytes (H * element size) must be a positive multiple of 16");
  kChecks.require(hidden_bytes <= config_.max_hidden_bytes, "combine: hidden bytes exceed config");
  kChecks.require(a.num_tokens >= 0 && a.num_tokens <= config_.max_tokens_per_rank,
                  "combine: num_tokens exceeds config.max_tokens_per_rank");
  kChecks.require(a.num_recv_rows >= 0, "combine: num_recv_rows must be >= 0");
  kChecks.require(a.num_topk >= 0 && a.num_topk <= config_.max_topk, "combine: K exceeds config");
  // K (agreed by every rank) decides the row layout, never the pointer: a rank that received
  // no rows has an empty topk_weights, whose data pointer may be null.
  kChecks.require(a.topk_weights == nullptr || a.num_topk >= 1, "combine: weights need K >= 1");
  kChecks.require(a.num_topk == 0 || a.topk_weights != nullptr || a.num_recv_rows == 0,
                  "combine: K > 0 needs topk_weights for the received rows");
  kChecks.require(a.out_topk_weights == nullptr || a.num_topk >= 1,
                  "combine: out_topk_weights needs K >= 1");
  kChecks.require(a.recv_prefix != nullptr, "combine: recv_prefix is null");
  kChecks.require(
      a.num_tokens == 0 || (a.send_pos != nullptr && a.out != nullptr && aligned16(a.out)),
      "combine: send_pos/out missing or out not 16-byte aligned");
  kChecks.require(a.num_recv_rows == 0 || (a.x != nullptr && aligned16(a.x)),
                  "combine: x must be 16-byte aligned");
  kChecks.require(aligned16(a.bias0) && aligned16(a.bias1),
                  "combine: bias must be 16-byte aligned");
  kChecks.require(
      !a.bias_f32 || a.elem == CombineElem::kBFloat16 || a.elem == CombineElem::kFloat16,
      "combine: float32 biases are for 16-bit elements (others take the element type)");
  CombineParams p{};
  p.comm = comm_context();
  p.x = a.x;
  p.elem = a.elem;
  p.hidden = a.hidden;
  p.topk_weights = a.topk_weights;
  p.num_topk = a.num_topk;
  p.recv_prefix = a.recv_prefix;
  p.num_recv_capacity = a.num_recv_rows;
  p.num_tokens = a.num_tokens;
  p.send_pos = a.send_pos;
  p.bias0 = a.bias0;
  p.bias1 = a.bias1;
  p.bias_f32 = a.bias_f32 ? 1 : 0;
  p.out = a.out;
  p.out_topk_weights = a.out_topk_weights;
  p.num_send_warps = combine_send_warps();
  const int num_sms = a.num_sms > 0 ? a.num_sms : config_.num_sms;
  DeviceGuard guard(device_);
  kChecks.cuda(launch_nvlink_combine(p, num_sms, stream), "combine launch");
}

int NvlinkRuntime::dispatch_send_warps(int hidden_bytes, int num_scales, bool own_slab) const {
  // One rank: all but the publisher and one receiver send (nothing comes from peers).
  if (num_ranks_ == 1 && config_.one_rank_send_warps) return kNvlinkMaxSendWarps;
  if (own_slab && config_.slab_dispatch_send_warps > 0) return config_.slab_dispatch_send_warps;
  return hidden_bytes + 4 * num_scales <= kSmallDispatchRowBytes
             ? config_.small_row_dispatch_send_warps
             : config_.dispatch_send_warps;
}

int NvlinkRuntime::combine_send_warps() const {
  // One rank: one sender (it has no rows to send; the owner-side reduce takes the other warps).
  if (num_ranks_ == 1 && config_.one_rank_send_warps) return 1;
  if (num_ranks_ >= 3 && config_.combine_send_warps_many_ranks > 0)
    return config_.combine_send_warps_many_ranks;
  return config_.combine_send_warps;
}

void NvlinkRuntime::set_send_warps(int dispatch_send_warps, int combine_send_warps,
                                   int small_row_dispatch_send_warps, int slab_dispatch_send_warps,
                                   bool one_rank_send_warps, int combine_send_warps_many_ranks) {
  const int limit = kNvlinkMaxSendWarps;
  if (small_row_dispatch_send_warps < 0) small_row_dispatch_send_warps = dispatch_send_warps;
  for (int warps : {dispatch_send_warps, combine_send_warps, small_row_dispatch_send_warps})
    kChecks.require(warps >= 1 && warps <= limit,
                    "send warps must be in [1, " + std::to_string(limit) +
                        "] (a block also needs a publisher and a receiver warp)");
  kChecks.require(combine_send_warps_many_ranks <= limit,
                  "combine send warps from 3 ranks must be at most " + std::to_string(limit));
  kChecks.require(slab_dispatch_send_warps <= limit,
                  "slab send warps must be at most " + std::to_string(limit));
  config_.dispatch_send_warps = dispatch_send_warps;
  config_.small_row_dispatch_send_warps = small_row_dispatch_send_warps;
  config_.slab_dispatch_send_warps = slab_dispatch_send_warps;
  config_.combine_send_warps = combine_send_warps;
  config_.combine_send_warps_many_ranks = combine_send_warps_many_ranks;
  config_.one_rank_send_warps = one_rank_send_warps;
}

void NvlinkRuntime::barrier(cudaStream_t stream) {
  check_ready("barrier");
  check_no_dispatch_due("barrier");
  BarrierParams p{};
  p.comm = comm_context();
  DeviceGuard guard(device_);
  kChecks.cuda(launch_nvlink_barrier(p, stream), "barrier launch");
}

void NvlinkRuntime::all_to_all(const AllToAllParams& args, cudaStream_t stream) {
  check_ready("all_to_all");
  check_no_dispatch_due("all_to_all");
  kChecks.require(args.input != nullptr || args.output != nullptr || num_ranks_ >= 1,
                  "all_to_all: no tensors");
  AllToAllParams p = args;
  if (p.splits == nullptr) {
    for (int r = 0; r < num_ranks_; ++r) {
      kChecks.require(p.send_bytes[r] >= 0 && p.recv_bytes[r] >= 0 && p.send_offset[r] >= 0 &&
                          p.recv_offset[r] >= 0,
                      "all_to_all: sizes and offsets must be >= 0");
    }
    p.num_local_experts = 1;
  } else {
    kChecks.require(p.num_local_experts >= 1 && p.num_local_experts <= kA2AMaxLocalExperts,
                    "all_to_all: num_local_experts must be in [1, 256]");
    kChecks.require(p.row_bytes > 0, "all_to_all: row_bytes must be > 0");
    kChecks.require(p.input_rows >= 0 && p.capacity_rows >= 0, "all_to_all: rows must be >= 0");
    kChecks.require(p.recv_splits != nullptr && p.recv_offsets != nullptr,
                    "all_to_all: recv_splits and recv_offsets are required with device splits");
  }
  p.comm = comm_context();
  DeviceGuard guard(device_);
  kChecks.cuda(launch_nvlink_all_to_all(p, stream), "all_to_all launch");
}

ErrorRecord NvlinkRuntime::error_record() const {
  ErrorRecord r{};
  if (error_host_ == nullptr) return r;
  const volatile ErrorRecord* e = error_host_;
  r.code = e->code;
  std::atomic_thread_fence(std::memory_order_acquire);
  r.op = e->op;
  r.rank = e->rank;
  r.peer = e->peer;
  r.value_a = e->value_a;
  r.value_b = e->value_b;
  return r;
}

std::string NvlinkRuntime::check_error() const {
  if (error_host_ == nullptr) return "";
  const volatile ErrorRecord* e = error_host_;
  const int code = e->code;
  if (code == kErrorNone) return "";
  std::atomic_thread_fence(std::memory_order_acquire);
  std::ostringstream os;
  os << "ep " << op_name(e->op) << ": rank " << e->rank;
  switch (code) {
    case kErrorTimeout:
      if (e->op == kOpLayout) {  // blocks of one kernel on this GPU, not a peer
        os << " timed out: a layout block waited for block " << e->value_a << ", which never ran";
        break;
      }
      os << " timed out after " << config_.timeout_seconds << " s waiting for rank " << e->peer;
      break;
    case kErrorCapacity:
      if (e->op == kOpAllToAll) {
        os << " would receive " << e->value_a << " rows, more than the output's capacity of "
           << e->value_b << " rows (nothing was written to the output)";
        break;
      }
      os << " would receive " << e->value_a << " rows, more than num_worst_tokens=" << e->value_b;
      break;
    case kErrorInvalidTopkIdx:
      os << " got topk_idx value " << e->value_a << " at flat position " << e->value_b
         << ", outside [-1, num_experts)";
      break;
    case kErrorInvalidSplits:
      if (e->value_a < 0) {
        os << " got a negative split (" << e->value_a << ")";
      } else {
        os << " was asked to send " << e->value_a << " rows (the sum of its splits), more than "
           << "its input's " << e->value_b << " rows";
      }
      os << "; nothing was sent";
      break;
    case kErrorSplitMismatch:
      os << " expected " << e->value_b << " bytes from rank " << e->peer << ", which sent "
         << e->value_a << " (its input split sizes disagree with this rank's output split "
         << "sizes); nothing from rank " << e->peer << " was written to the output";
      break;
    default:
      os << " failed with error code " << code;
  }
  return os.str();
}

bool NvlinkRuntime::failed() const {
  return error_host_ != nullptr && error_host_->code == kErrorTimeout;
}

void NvlinkRuntime::clear_error() {
  kChecks.require(!failed(), "clear_error: a timeout is fatal, rebuild the runtime");
  if (error_host_ == nullptr) return;
  DeviceGuard guard(device_);
  ControlBlock* ctrl = reinterpret_cast<ControlBlock*>(buffer_);
  kChecks.cuda(cudaMemset(&ctrl->error_lock, 0, sizeof(int)), "cudaMemset(error_lock)");
  kChecks.cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  std::memset(static_cast<void*>(error_host_), 0, sizeof(ErrorRecord));
}

}  // namespace ep
