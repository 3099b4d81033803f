// Host side of the low-latency runtime: NVSHMEM bootstrap, the symmetric region, argument
// checks, launches, error records. Must be linked into the same shared object as the kernels
// and libnvshmem_device.a: nvshmemx_init_attr (inline) initialises the device state of the
// module it is compiled into.
#include "transports/nvshmem/cuda/nvshmem_runtime.hpp"

#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>

#include "common/runtime_util.hpp"
#include "common/str_cat.hpp"
#include "transports/nvshmem/cuda/nvshmem_kernels.hpp"

namespace ep {
namespace {

// The process's NVSHMEM session (NvshmemRuntime::start_session): started at most once, never
// finalised (see the header). Guarded by g_session_mutex.
std::mutex g_session_mutex;
bool g_session_started = false;
int g_session_pe = -1;
int g_session_pes = 0;
int g_session_device = -1;

constexpr runtime::Checks kChecks{"ep low_latency"};

using runtime::aligned16;
using runtime::DeviceGuard;

const char* op_name(int op) {
  switch (op) {
    case nvshmem::kOpDispatch:
      return "low_latency_dispatch";
    case nvshmem::kOpCombine:
      return "low_latency_combine";
    default:
      return "low_latency";
  }
}

struct PrivateLayout {
  size_t send_route_offset;   // [2][M * max_topk] int32
  size_t recv_tokens_offset;  // [2][R] int32
  size_t bytes;
  static PrivateLayout make(const NvshmemConfig& c, int num_ranks) {
    PrivateLayout l{};
    l.send_route_offset = sizeof(nvshmem::ControlBlock);
    const size_t route = size_t(c.max_tokens_per_rank) * c.max_topk * sizeof(int);
    l.recv_tokens_offset = align_up(l.send_route_offset + 2 * route, 128);
    l.bytes = align_up(l.recv_tokens_offset + 2 * size_t(num_ranks) * sizeof(int), 128);
    return l;
  }
};

void require_phases(int phases, const char* op) {
  kChecks.require(phases == nvshmem::kPhaseSend || phases == nvshmem::kPhaseRecv ||
                      phases == nvshmem::kPhaseBoth,
                  op, "phases must be SEND (1), RECV (2) or both (3)");
}

// Ranks a config's buffers are sized for (an upper bound when the config does not say).
int sized_ranks(const NvshmemConfig& c) {
  return c.num_ranks > 0 ? c.num_ranks : std::max(1, c.num_experts);
}

nvshmem::BufferLayout buffer_layout(const NvshmemConfig& c) {
  return nvshmem::BufferLayout::make(c.max_tokens_per_rank, c.max_hidden, c.num_experts, c.max_topk,
                                     sized_ranks(c));
}

}  // namespace

void NvshmemRuntime::set_environment(const NvshmemConfig& config) {
  // Never NVLink multicast. Size the heap for our region unless the user chose a size.
  setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
  static bool we_set_size = false;
  if (std::getenv("NVSHMEM_SYMMETRIC_SIZE") == nullptr || we_set_size) {
    const size_t heap =
        symmetric_bytes(config) + config.extra_symmetric_bytes + (size_t(256) << 20);
    setenv("NVSHMEM_SYMMETRIC_SIZE", std::to_string(heap).c_str(), 1);
    we_set_size = true;
  }
}

std::vector<uint8_t> NvshmemRuntime::unique_id(const NvshmemConfig& config) {
  set_environment(config);
  return unique_id();
}

std::vector<uint8_t> NvshmemRuntime::unique_id() {
  setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (nvshmemx_get_uniqueid(&id) != 0)
    throw std::runtime_error("ep low_latency: nvshmemx_get_uniqueid failed");
  const uint8_t* p = reinterpret_cast<const uint8_t*>(&id);
  return std::vector<uint8_t>(p, p + sizeof(id));
}

size_t NvshmemRuntime::symmetric_bytes(const NvshmemConfig& c) {
  return 2 * buffer_layout(c).bytes;
}

void NvshmemRuntime::start_session(int rank, int num_ranks, int device,
                                   const std::vector<uint8_t>& uid, const NvshmemConfig& config) {
  kChecks.require(num_ranks >= 1 && num_ranks <= nvshmem::kMaxExperts,
                  "num_ranks must be in [1, 1024]");
  kChecks.require(rank >= 0 && rank < num_ranks, "rank out of range");
  kChecks.require(uid.size() == sizeof(nvshmemx_uniqueid_t), "the unique id must be 128 bytes");
  std::lock_guard<std::mutex> lock(g_session_mutex);
  if (g_session_started) {
    throw std::runtime_error(runtime::strCat(
        "ep low_latency: this process started its NVSHMEM session already (PE ", g_session_pe,
        " of ", g_session_pes,
        "); NVSHMEM cannot be initialised again in a process (after nvshmem_finalize it keeps "
        "the first bootstrap and ignores a new unique id)"));
  }
  DeviceGuard guard(device);
  kChecks.cuda(cudaSetDevice(device), "cudaSetDevice");
  NvshmemConfig sized = config;
  sized.num_ranks = num_ranks;
  set_environment(sized);
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, uid.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (nvshmemx_set_attr_uniqueid_args(rank, num_ranks, &id, &attr) != 0)
    throw std::runtime_error("ep low_latency: nvshmemx_set_attr_uniqueid_args failed");
  // nvshmemx_init_attr exits the process on failure (NVSHMEM's NONZERO_EXIT).
  nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
  // Recorded before the check below: NVSHMEM is initialised now, whatever it says, and must not
  // be initialised again.
  g_session_started = true;
  g_session_pe = nvshmem_my_pe();
  g_session_pes = nvshmem_n_pes();
  g_session_device = device;
  if (g_session_pe != rank || g_session_pes != num_ranks) {
    throw std::runtime_error(runtime::strCat("ep low_latency: NVSHMEM says PE ", g_session_pe,
                                             " of ", g_session_pes, ", expected rank ", rank,
                                             " of ", num_ranks));
  }
}

bool NvshmemRuntime::session(int* pe, int* num_pes, int* device) {
  std::lock_guard<std::mutex> lock(g_session_mutex);
  if (pe != nullptr) *pe = g_session_pe;
  if (num_pes != nullptr) *num_pes = g_session_pes;
  if (device != nullptr) *device = g_session_device;
  return g_session_started;
}

NvshmemRuntime::NvshmemRuntime(int rank, int num_ranks, int device, const NvshmemConfig& config)
    : rank_(rank), num_ranks_(num_ranks), device_(device), config_(config) {
  kChecks.require(config.num_ranks == 0 || config.num_ranks == num_ranks,
                  "config.num_ranks must be 0 or the number of ranks");
  config_.num_ranks = num_ranks;
  kChecks.require(num_ranks >= 1 && num_ranks <= nvshmem::kMaxExperts,
                  "num_ranks must be in [1, 1024]");
  kChecks.require(rank >= 0 && rank < num_ranks, "rank out of range");
  kChecks.require(config.max_tokens_per_rank >= 1, "max_tokens_per_rank must be >= 1");
  kChecks.require(config.max_hidden >= nvshmem::kGroupSize &&
                      config.max_hidden % nvshmem::kGroupSize == 0 &&
                      config.max_hidden <= nvshmem::kMaxHidden,
                  "max_hidden must be a multiple of 128 in [128, 8192]");
  kChecks.require(config.max_topk >= 1 && config.max_topk <= nvshmem::kMaxTopk,
                  "max_topk must be in [1, 32]");
  kChecks.require(config.num_experts >= num_ranks && config.num_experts % num_ranks == 0 &&
                      config.num_experts <= nvshmem::kMaxExperts,
                  "num_experts must be a multiple of the number of ranks, at most 1024");
  kChecks.require(config.timeout_seconds > 0, "timeout_seconds must be > 0");
  kChecks.require(config.num_sms >= 0, "num_sms must be >= 0");
  {
    int pe = -1, pes = 0, dev = -1;
    kChecks.require(session(&pe, &pes, &dev),
                    "no NVSHMEM session in this process (start_session first)");
    if (pe != rank || pes != num_ranks || dev != device) {
      kChecks.require(false, runtime::strCat("the process's NVSHMEM session is PE ", pe, " of ",
                                             pes, " on device ", dev, ", not rank ", rank, " of ",
                                             num_ranks, " on device ", device));
    }
  }

  try {
    DeviceGuard guard(device_);
    kChecks.cuda(cudaSetDevice(device_), "cudaSetDevice");
    // Preloads both kernels (lazy loading could wait for a spinning kernel) and sizes grids.
    int dmax = 0, cmax = 0;
    kChecks.cuda(nvshmem::max_dispatch_blocks(&dmax), "querying the dispatch kernel");
    kChecks.cuda(nvshmem::max_combine_blocks(&cmax), "querying the combine kernel");
    int sms = 0;
    kChecks.cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_),
                 "cudaDeviceGetAttribute(SMs)");
    const int want = config_.num_sms > 0 ? config_.num_sms : sms;
    dispatch_blocks_ = std::max(1, std::min(want, dmax));
    combine_blocks_ = std::max(1, std::min(want, cmax));

    layout_ = buffer_layout(config_);
    // Every allocation of this rank alone comes before the collective one (connect): a rank that
    // fails here fails before its peers wait for it in nvshmem_malloc, which has no timeout.
    const PrivateLayout pl = PrivateLayout::make(config_, num_ranks_);
    kChecks.cuda(cudaMalloc(reinterpret_cast<void**>(&private_), pl.bytes), "cudaMalloc(private)");
    kChecks.cuda(cudaMemset(private_, 0, pl.bytes), "cudaMemset(private)");
    kChecks.cuda(
        cudaMalloc(reinterpret_cast<void**>(&peer_table_), sizeof(char*) * 2 * size_t(num_ranks_)),
        "cudaMalloc(peer table)");
    runtime::allocMappedHost(kChecks, "error", sizeof(nvshmem::ErrorRecord), &error_host_,
                             &error_dev_);
    kChecks.cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  } catch (...) {
    abandon();
    throw;
  }
}

void NvshmemRuntime::connect() {
  kChecks.require(private_ != nullptr, "connect: runtime destroyed");
  kChecks.require(symmetric_ == nullptr, "connect: already connected");
  DeviceGuard guard(device_);
  const size_t bytes = 2 * layout_.bytes;
  symmetric_ = static_cast<char*>(nvshmem_malloc(bytes));  // collective
  if (symmetric_ == nullptr) {
    throw std::runtime_error(runtime::strCat(
        "ep low_latency: nvshmem_malloc(", bytes,
        ") failed: the symmetric heap cannot hold it. The heap grows on demand only with CUDA "
        "VMM (leave NVSHMEM_DISABLE_CUDA_VMM unset) up to NVSHMEM_MAX_MEMORY_PER_GPU; without "
        "VMM it is NVSHMEM_SYMMETRIC_SIZE, fixed when the process's session started"));
  }
  initialized_ = true;
  kChecks.cuda(cudaMemset(symmetric_, 0, bytes), "cudaMemset(symmetric)");

  peer_base_.assign(num_ranks_, nullptr);
  std::vector<char*> table(2 * size_t(num_ranks_), nullptr);
  for (int pe = 0; pe < num_ranks_; ++pe) {
    char* base = static_cast<char*>(nvshmem_ptr(symmetric_, pe));
    if (!config_.p2p_fast_path) base = nullptr;
    const int k = config_.emulated_ranks_per_node;
    if (k > 0 && pe / k != rank_ / k) base = nullptr;  // another (emulated) node: put path
    peer_base_[pe] = base;
    for (int b = 0; b < 2; ++b)
      table[size_t(b) * num_ranks_ + pe] = base != nullptr ? base + b * layout_.bytes : nullptr;
  }
  // Known once here rather than on every launch (context() runs per kernel).
  all_p2p_ =
      std::all_of(peer_base_.begin(), peer_base_.end(), [](char* base) { return base != nullptr; });
  kChecks.cuda(
      cudaMemcpy(peer_table_, table.data(), sizeof(char*) * table.size(), cudaMemcpyHostToDevice),
      "cudaMemcpy(peer table)");
  // Zeroed on the device before this returns: the caller's agreement that every rank connected
  // is then also the barrier before any rank signals into a peer's region.
  kChecks.cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

NvshmemRuntime::~NvshmemRuntime() {
  try {
    destroy();
  } catch (...) {
  }
}

void NvshmemRuntime::abandon() noexcept {
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device_);
  cudaDeviceSynchronize();
  // The symmetric region, if any, stays in the session's heap: nvshmem_free would wait for every
  // PE, and some PE of a failed setup never calls it.
  symmetric_ = nullptr;
  release_local();
  cudaSetDevice(previous);
}

void NvshmemRuntime::destroy() {
  if (!initialized_ && symmetric_ == nullptr && private_ == nullptr && error_host_ == nullptr &&
      peer_table_ == nullptr) {
    return;
  }
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device_);
  cudaDeviceSynchronize();
  // Never nvshmem_finalize here: a session cannot be started again in this process (header).
  if (symmetric_ != nullptr) nvshmem_free(symmetric_);  // collective, includes a barrier
  symmetric_ = nullptr;
  release_local();
  cudaSetDevice(previous);
}

void NvshmemRuntime::release_local() noexcept {
  if (private_ != nullptr) cudaFree(private_);
  if (peer_table_ != nullptr) cudaFree(peer_table_);
  if (error_host_ != nullptr) cudaFreeHost(error_host_);
  private_ = nullptr;
  peer_table_ = nullptr;
  error_host_ = error_dev_ = nullptr;
  peer_base_.clear();
  all_p2p_ = false;
  initialized_ = false;
}

bool NvshmemRuntime::peer_is_p2p(int pe) const {
  kChecks.require(pe >= 0 && pe < num_ranks_, "peer_is_p2p: rank out of range");
  return !peer_base_.empty() && peer_base_[pe] != nullptr;
}

void NvshmemRuntime::require_num_experts(int num_experts, const char* op) const {
  kChecks.require(
      num_experts >= num_ranks_ && num_experts % num_ranks_ == 0 &&
          num_experts <= config_.num_experts,
      op, "num_experts must be a multiple of the number of ranks, at most config.num_experts");
}

void NvshmemRuntime::check_ready(const char* op) const {
  kChecks.require(symmetric_ != nullptr, op, "runtime destroyed");
  if (failed()) throw std::runtime_error(check_error());
}

nvshmem::Context NvshmemRuntime::context(int buffer, double timeout_seconds) {
  last_timeout_seconds_ = timeout_seconds > 0 ? timeout_seconds : config_.timeout_seconds;
  const PrivateLayout pl = PrivateLayout::make(config_, num_ranks_);
  nvshmem::Context c{};
  c.local = symmetric_ + size_t(buffer) * layout_.bytes;
  c.peer = peer_table_ + size_t(buffer) * num_ranks_;
  c.layout = layout_;
  c.ctrl = reinterpret_cast<nvshmem::ControlBlock*>(private_);
  c.error = error_dev_;
  c.send_route = reinterpret_cast<int*>(private_ + pl.send_route_offset) +
                 size_t(buffer) * config_.max_tokens_per_rank * config_.max_topk;
  c.recv_tokens =
      reinterpret_cast<int*>(private_ + pl.recv_tokens_offset) + size_t(buffer) * num_ranks_;
  c.timeout_ns = static_cast<long long>(last_timeout_seconds_ * 1e9);
  c.buffer = buffer;
  c.rank = rank_;
  c.num_ranks = num_ranks_;
  c.max_tokens = config_.max_tokens_per_rank;
  c.all_p2p = all_p2p_ ? 1 : 0;
  return c;
}

int NvshmemRuntime::dispatch(const NvshmemDispatchArgs& a, cudaStream_t stream) {
  check_ready("dispatch");
  const char* const op = "dispatch";
  require_phases(a.phases, op);
  // The messages with numbers are built only when their check fails (this runs per call).
  if (a.num_tokens < 0 || a.num_tokens > config_.max_tokens_per_rank) {
    kChecks.require(false, std::string(op) + ": num_tokens (T=" + std::to_string(a.num_tokens) +
                               ") must be in [0, max_tokens_per_rank=" +
                               std::to_string(config_.max_tokens_per_rank) + "]");
  }
  if (a.hidden < nvshmem::kGroupSize || a.hidden % nvshmem::kGroupSize != 0 ||
      a.hidden > config_.max_hidden) {
    kChecks.require(false, std::string(op) + ": H=" + std::to_string(a.hidden) +
                               " must be a multiple of 128 in [128, " +
                               std::to_string(config_.max_hidden) + "]");
  }
  if (a.num_topk < 1 || a.num_topk > config_.max_topk) {
    kChecks.require(false, std::string(op) + ": K must be in [1, max_topk=" +
                               std::to_string(config_.max_topk) + "]");
  }
  kChecks.require(a.idx_bytes == 4 || a.idx_bytes == 8, op, "topk_idx must be int32 or int64");
  require_num_experts(a.num_experts, op);
  kChecks.require(!a.use_ue8m0 || (a.use_fp8 && a.round_scale), op,
                  "use_ue8m0 requires use_fp8 and round_scale");
  kChecks.require(!a.use_ue8m0 || a.hidden % (4 * nvshmem::kGroupSize) == 0, op,
                  "use_ue8m0 needs H % 512 == 0");
  kChecks.require(!a.round_scale || a.use_fp8, op, "round_scale requires use_fp8");
  if (a.phases & nvshmem::kPhaseSend) {
    kChecks.require(
        a.num_tokens == 0 || (a.x != nullptr && aligned16(a.x) && a.topk_idx != nullptr), op,
        "x (16-byte aligned) and topk_idx are required");
  }
  if (a.phases & nvshmem::kPhaseRecv) {
    kChecks.require(a.recv_x != nullptr && aligned16(a.recv_x), op,
                    "recv_x must be 16-byte aligned");
    kChecks.require(!a.use_fp8 || a.recv_x_scales != nullptr, op,
                    "recv_x_scales is required with FP8");
    kChecks.require(a.recv_count != nullptr && a.src_info != nullptr && a.layout_range != nullptr,
                    op, "recv_count, src_info and layout_range are required");
  }
  int buffer = a.buffer_index;
  if (a.phases == nvshmem::kPhaseRecv) {
    kChecks.require(buffer == 0 || buffer == 1, op, "the RECV phase needs the SEND's buffer_index");
  } else {
    kChecks.require(buffer >= -1 && buffer <= 1, op, "buffer_index must be -1, 0 or 1");
    if (buffer < 0) buffer = next_buffer_;
    next_buffer_ = buffer ^ 1;
  }
  nvshmem::DispatchParams p{};
  p.ctx = context(buffer, a.timeout_seconds);
  p.ctx.rank_mask = a.rank_mask;
  p.x = static_cast<const uint16_t*>(a.x);
  static const long long kEmpty = -1;
  p.topk_idx = a.topk_idx != nullptr ? a.topk_idx : &kEmpty;
  p.idx_bytes = a.idx_bytes;
  p.num_tokens = a.num_tokens;
  p.num_topk = a.num_topk;
  p.hidden = a.hidden;
  p.num_experts = a.num_experts;
  p.fp8 = a.use_fp8;
  p.round_scale = a.round_scale;
  p.ue8m0 = a.use_ue8m0;
  p.phases = a.phases;
  p.recv_x = a.recv_x;
  p.recv_scales = a.recv_x_scales;
  p.recv_count = a.recv_count;
  p.src_info = a.src_info;
  p.layout_range = reinterpret_cast<long long*>(a.layout_range);
  p.cumulative_stats = a.cumulative_local_expert_recv_stats;
  p.zero_padding = a.zero_padding;
  DeviceGuard guard(device_);
  kChecks.cuda(nvshmem::launch_dispatch(p, dispatch_blocks_, stream),
               "low_latency_dispatch launch");
  return buffer;
}

void NvshmemRuntime::combine(const NvshmemCombineArgs& a, cudaStream_t stream) {
  check_ready("combine");
  const char* const op = "combine";
  require_phases(a.phases, op);
  kChecks.require(a.buffer_index == 0 || a.buffer_index == 1, op,
                  "buffer_index must be the dispatch's (0 or 1)");
  kChecks.require(a.hidden >= nvshmem::kGroupSize && a.hidden % nvshmem::kGroupSize == 0 &&
                      a.hidden <= config_.max_hidden,
                  op, "H must be a multiple of 128 in [128, max_hidden]");
  require_num_experts(a.num_experts, op);
  kChecks.require(a.num_tokens >= 0 && a.num_tokens <= config_.max_tokens_per_rank, op,
                  "num_tokens must be in [0, max_tokens_per_rank]");
  kChecks.require(a.num_topk >= 1 && a.num_topk <= config_.max_topk, op,
                  "K must be in [1, max_topk]");
  const nvshmem::Context ctx = context(a.buffer_index, a.timeout_seconds);
  const uint16_t* x = static_cast<const uint16_t*>(a.x);
  if (a.phases & nvshmem::kPhaseSend) {
    kChecks.require(a.layout_range != nullptr, op, "layout_range of the dispatch is required");
    if (a.zero_copy) {
      x = reinterpret_cast<const uint16_t*>(ctx.local + layout_.comb_send_offset);
    } else {
      kChecks.require(a.x != nullptr && aligned16(a.x), op, "x must be 16-byte aligned");
    }
  }
  if (a.phases & nvshmem::kPhaseRecv) {
    kChecks.require(a.num_tokens == 0 || (a.out != nullptr && aligned16(a.out)), op,
                    "out (16-byte aligned) is required");
  }
  nvshmem::CombineParams p{};
  p.ctx = ctx;
  p.ctx.rank_mask = a.rank_mask;
  p.x = x;
  p.layout_range = reinterpret_cast<const long long*>(a.layout_range);
  p.topk_weights = a.topk_weights;
  p.num_tokens = a.num_tokens;
  p.num_topk = a.num_topk;
  p.hidden = a.hidden;
  p.phases = a.phases;
  p.out = static_cast<uint16_t*>(a.out);
  p.bf16_partials = a.bf16_partials ? 1 : 0;
  DeviceGuard guard(device_);
  kChecks.cuda(nvshmem::launch_combine(p, combine_blocks_, stream), "low_latency_combine launch");
}

NvshmemBufferView NvshmemRuntime::combine_buffer(int buffer_index, int num_experts,
                                                 int hidden) const {
  kChecks.require(symmetric_ != nullptr, "combine_buffer: runtime destroyed");
  kChecks.require(buffer_index == 0 || buffer_index == 1,
                  "combine_buffer: buffer_index must be 0 or 1");
  kChecks.require(num_experts >= num_ranks_ && num_experts % num_ranks_ == 0 &&
                      num_experts <= config_.num_experts,
                  "combine_buffer: bad num_experts");
  kChecks.require(hidden >= nvshmem::kGroupSize && hidden % nvshmem::kGroupSize == 0 &&
                      hidden <= config_.max_hidden,
                  "combine_buffer: bad hidden");
  NvshmemBufferView v;
  v.ptr = symmetric_ + size_t(buffer_index) * layout_.bytes + layout_.comb_send_offset;
  v.shape[0] = num_experts / num_ranks_;
  v.shape[1] = int64_t(num_ranks_) * config_.max_tokens_per_rank;
  v.shape[2] = hidden;
  return v;
}

void NvshmemRuntime::barrier() {
  kChecks.require(symmetric_ != nullptr, "barrier: runtime destroyed");
  DeviceGuard guard(device_);
  kChecks.cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  nvshmem_barrier_all();
}

std::string NvshmemRuntime::check_error() const {
  if (error_host_ == nullptr) return "";
  const volatile nvshmem::ErrorRecord* e = error_host_;
  const int code = e->code;
  if (code == nvshmem::kErrorNone) return "";
  std::atomic_thread_fence(std::memory_order_acquire);
  std::string msg = runtime::strCat("ep ", op_name(e->op), ": rank ", e->rank);
  switch (code) {
    case nvshmem::kErrorTimeout:
      msg += runtime::strCat(" timed out after ", last_timeout_seconds_, " s waiting for rank ",
                             e->peer);
      break;
    case nvshmem::kErrorCapacity:
      msg +=
          runtime::strCat(" would send ", e->value_a,
                          " rows to one expert, more than M=", e->value_b, " (extra rows dropped)");
      break;
    case nvshmem::kErrorInvalidTopkIdx:
      msg += runtime::strCat(" got topk_idx value ", e->value_a, " at flat position ", e->value_b,
                             ", outside [-1, num_experts)");
      break;
    default:
      msg += runtime::strCat(" failed with error code ", code);
  }
  return msg;
}

bool NvshmemRuntime::failed() const {
  return error_host_ != nullptr && error_host_->code == nvshmem::kErrorTimeout;
}

void NvshmemRuntime::clear_error() {
  kChecks.require(!failed(), "clear_error: a timeout is fatal, rebuild the runtime");
  if (error_host_ == nullptr) return;
  DeviceGuard guard(device_);
  nvshmem::ControlBlock* ctrl = reinterpret_cast<nvshmem::ControlBlock*>(private_);
  kChecks.cuda(cudaMemset(&ctrl->error_lock, 0, sizeof(int)), "cudaMemset(error_lock)");
  kChecks.cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  std::memset(static_cast<void*>(error_host_), 0, sizeof(nvshmem::ErrorRecord));
}

}  // namespace ep
