#ifdef EP_WITH_CUDA

#include "transports/nvlink/nvlink_transport.hpp"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>

#include "backend/ep_process_group.hpp"
#include "backend/gpu_identity.hpp"
#include "backend/group_state.hpp"
#include "backend/kernel_image.hpp"
#include "backend/moe_validation.hpp"
#include "backend/per_group_transport.hpp"
#include "backend/routing_memory.hpp"
#include "backend/store_exchange.hpp"
#include "backend/stream_capture.hpp"
#include "common/env.hpp"
#include "transports/nvlink/cuda/nvlink_kernels.hpp"
#include "transports/nvlink/cuda/nvlink_runtime.hpp"

namespace ep::nvlink {
namespace {

// The receive slabs of one runtime (NvlinkConfig::recv_slabs): which are lent, and for a
// returned one the events recorded when its last output tensor was freed, one on each stream
// its outputs were used on (the dispatch's, and those named by recordSlabStream). Thread-safe:
// tensors are freed on any thread (autograd's too).
class SlabPool {
 public:
  SlabPool(int count, int device, std::shared_ptr<char> memory)
      : device_(device),
        memory_(std::move(memory)),
        lent_(count, false),
        returned_(count),
        counts_(count, 0) {}
  ~SlabPool() {
    for (auto& events : returned_)
      for (cudaEvent_t e : events) cudaEventDestroy(e);
  }
  SlabPool(const SlabPool&) = delete;
  SlabPool& operator=(const SlabPool&) = delete;

  // A free slab for a dispatch on `stream` (-1: none free). The stream first waits for the work
  // queued on the returning outputs' streams when they were freed, as the caching allocator
  // orders a block's reuse; not when that work is done (a wait queued ahead of notify may delay
  // its start), and only for events not yet complete.
  int lend(cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int i = 0; i < static_cast<int>(lent_.size()); ++i) {
      if (lent_[i]) continue;
      for (int k = 0; k < counts_[i]; ++k) {
        const cudaError_t done = cudaEventQuery(returned_[i][k]);
        if (done == cudaErrorNotReady) {
          (void)cudaGetLastError();  // "not ready" is an answer, not an error to keep
          C10_CUDA_CHECK(cudaStreamWaitEvent(stream, returned_[i][k], 0));
        } else {
          C10_CUDA_CHECK(done);
        }
      }
      lent_[i] = true;
      return i;
    }
    return -1;
  }
  // Slab i's outputs are all freed: records an event on each of `streams`. If one cannot be
  // recorded (CUDA gone at exit, a destroyed stream) the slab stays lent: its next lend could
  // not be ordered after that stream's work.
  void give_back(int i, const std::vector<cudaStream_t>& streams) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    int previous = 0;
    if (cudaGetDevice(&previous) != cudaSuccess || cudaSetDevice(device_) != cudaSuccess) return;
    std::vector<cudaEvent_t>& events = returned_[i];
    bool recorded = true;
    size_t k = 0;
    for (; k < streams.size() && recorded; ++k) {
      if (k == events.size()) {
        cudaEvent_t e = nullptr;
        if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
          recorded = false;
          break;
        }
        events.push_back(e);
      }
      recorded = cudaEventRecord(events[k], streams[k]) == cudaSuccess;
    }
    if (!recorded) (void)cudaGetLastError();  // ours to clear, not the caller's to find later
    cudaSetDevice(previous);
    if (!recorded) return;
    counts_[i] = static_cast<int>(k);  // events past k belong to an earlier return: ignored
    lent_[i] = false;
  }

 private:
  std::mutex mutex_;
  int device_;
  std::shared_ptr<char> memory_;  // keeps the slabs mapped while outputs view them
  std::vector<bool> lent_;
  std::vector<std::vector<cudaEvent_t>> returned_;  // per slab, reused across returns
  std::vector<int> counts_;  // per slab: events of its last return (the first counts_[i])
};

// One dispatch's hold on a slab: every output tensor viewing it shares this (through a
// SlabView); the last one freed gives the slab back, ordered after every stream named here.
class SlabLease {
 public:
  SlabLease(std::shared_ptr<SlabPool> p, int i, cudaStream_t s)
      : pool_(std::move(p)), index_(i), streams_{s} {}
  SlabLease(const SlabLease&) = delete;  // exactly one lease gives the slab back
  SlabLease& operator=(const SlabLease&) = delete;
  ~SlabLease() { pool_->give_back(index_, streams_); }
  int index() const { return index_; }
  void add_stream(cudaStream_t s) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (std::find(streams_.begin(), streams_.end(), s) == streams_.end()) streams_.push_back(s);
  }

 private:
  const std::shared_ptr<SlabPool> pool_;
  const int index_;
  std::mutex mutex_;
  std::vector<cudaStream_t> streams_;
};

// The context of one output tensor's storage in a lent slab (its DataPtr's deleter is
// releaseSlabView, which is how recordSlabStream recognises such tensors).
struct SlabView {
  std::shared_ptr<SlabLease> lease;
};
void releaseSlabView(void* ctx) {
  delete static_cast<SlabView*>(ctx);
}

// A slab of the group's pool for outputs on `stream` (null: none free, or the group has none).
std::shared_ptr<SlabLease> lendSlab(const std::shared_ptr<SlabPool>& pool, cudaStream_t stream) {
  if (pool == nullptr) return nullptr;
  const int i = pool->lend(stream);
  return i >= 0 ? std::make_shared<SlabLease>(pool, i, stream) : nullptr;
}

// An output array at `offset` of the lent slab (a view that keeps the lease), else a fresh tensor.
at::Tensor slabOutput(NvlinkRuntime& rt, const std::shared_ptr<SlabLease>& lease, size_t offset,
                      at::IntArrayRef sizes, const at::TensorOptions& opts) {
  if (!lease) return at::empty(sizes, opts);
  return at::for_blob(rt.recv_slab(lease->index()) + offset, sizes)
      .options(opts)
      .context(new SlabView{lease}, &releaseSlabView)  // the last view freed gives it back
      .make_tensor();
}

// Per-group transport state; created on a group's first CUDA MoE call, freed at its shutdown.
struct GroupState {
  GroupVerdict usability;  // whether the group's CUDA calls run here, or why they take ATen
  int generation = 0;
  std::unique_ptr<NvlinkRuntime> runtime;
  std::shared_ptr<SlabPool> slabs;  // the runtime's receive slabs (null: none)
  RoutingMemory routings;           // of the dispatch handles still alive
  // A CUDA graph was captured with kernels on this transport: rebuilding it would free buffers
  // those graphs replay into, so from then on it never grows (an agreed field of every call).
  bool graph_captured = false;
};

std::shared_ptr<GroupState> stateOf(EPProcessGroup& pg) {
  static auto* states = new GroupStates<GroupState>([](EPProcessGroup*, GroupState& state) {
    if (state.runtime) {
      cudaDeviceSynchronize();
      state.runtime->destroy();
    }
  });
  return states->of(pg);
}

std::string keyPrefix(EPProcessGroup& pg) {
  return "ep_nvlink/" + pg.options()->group_name + "/";
}

bool profilingHost() {
  return env::isSet<env::kProfileHost>();
}

// EP_PROFILE_HOST=trace: also one line per stage as it ends, flushed (where a stuck call stands).
bool tracingHost() {
  static const bool on = env::equals<env::kProfileHost>("trace");
  return on;
}

// One flushed line "ep trace pid P: what[ detail]" when tracing.
void traceHost(const char* what, const char* detail = nullptr) {
  if (tracingHost()) {
    std::fprintf(stderr, "ep trace pid %d: %s%s%s\n", static_cast<int>(getpid()), what,
                 detail != nullptr ? " " : "", detail != nullptr ? detail : "");
    std::fflush(stderr);
  }
}

// EP_PROFILE_HOST=1: one line per call on stderr with the host time of each stage (µs), to find
// where a call's host time goes.
class HostStages {
 public:
  explicit HostStages(const char* op) : op_(op), on_(enabled()), last_(now()), first_(last_) {
    if (on_) traceHost(op_, "begins");
  }
  void mark(const char* stage) {
    if (!on_) {
      return;
    }
    traceHost(op_, stage);  // the stage has ended
    const auto t = now();
    line_ += std::string(" ") + stage + "=" +
             std::to_string(std::chrono::duration<double, std::micro>(t - last_).count());
    last_ = t;
  }
  ~HostStages() {
    if (on_) {
      const double total = std::chrono::duration<double, std::micro>(now() - first_).count();
      // start_ns: CLOCK_MONOTONIC (Python's time.monotonic_ns), to line stages up with others.
      const long long start_ns =
          std::chrono::duration_cast<std::chrono::nanoseconds>(first_.time_since_epoch()).count();
      std::fprintf(stderr, "ep %s host us:%s total=%.1f start_ns=%lld\n", op_, line_.c_str(), total,
                   start_ns);
    }
  }

 private:
  static bool enabled() { return profilingHost(); }
  static std::chrono::steady_clock::time_point now() { return std::chrono::steady_clock::now(); }
  const char* op_;
  bool on_;
  std::chrono::steady_clock::time_point last_, first_;
  std::string line_;
};

// The reason recorded when the user asked for the ATen path.
constexpr const char* kAskedAten = "EP_HIGH_THROUGHPUT=aten";

// Every rank decides with the same inputs (all ranks' host names, GPUs and peer-access verdicts):
// "" when the NVLink kernels can serve the group, else why not (this rank's words; the verdict
// itself is the same on every rank).
std::string decideUsable(EPProcessGroup& pg, const at::Device& device) {
  const int num_ranks = pg.getSize();
  const int rank = pg.getRank();
  // A group of one rank (EP=1 beside TP/DP) runs the kernels too: its dispatch is a local
  // permutation, which the ATen path did with host syncs at ~1 ms per call.
  if (num_ranks > kMaxRanks) {
    return "the group has " + std::to_string(num_ranks) +
           " ranks; the NVLink kernels serve at most " + std::to_string(kMaxRanks);
  }
  const bool asked_aten = env::equals<env::kHighThroughput>("aten");
  const std::string prefix = keyPrefix(pg) + "topology/";
  const std::vector<std::string> posted = allGatherStrings(
      pg, prefix, GpuPlace::of(device.index()).str(), "ep dispatch (transport setup)");
  std::vector<GpuPlace> places(num_ranks);
  for (int r = 0; r < num_ranks; ++r) places[r] = GpuPlace::parse(posted[r]);
  const GpuPlace& mine = places[rank];
  std::string why =
      asked_aten ? kAskedAten : kernelImageMissing(device.index(), &preload_nvlink_layout);
  for (int r = 0; r < num_ranks && why.empty(); ++r) {
    if (places[r].host != places[0].host) {
      why = "ranks 0 and " + std::to_string(r) + " are on different hosts (" + places[0].host +
            ", " + places[r].host + "); the NVLink kernels need every rank on one host";
      continue;
    }
    // The same GPU (ranks sharing one: CUDA IPC within the device) needs no peer access.
    if (r == rank || places[r].sameGpu(mine)) continue;
    // The peer's GPU as this process numbers it (indices differ between processes where
    // CUDA_VISIBLE_DEVICES does); invisible here: nothing to ask, CUDA IPC maps its memory all
    // the same.
    int local = places[r].index;
    if (places[r].knownBus() &&
        cudaDeviceGetByPCIBusId(&local, places[r].bus.c_str()) != cudaSuccess) {
      cudaGetLastError();  // not sticky
      continue;
    }
    int can = 0;
    cudaDeviceCanAccessPeer(&can, device.index(), local);
    if (!can) {
      why = "GPU " + std::to_string(mine.index) + " (" + mine.bus +
            ") has no peer access to rank " + std::to_string(r) + "'s GPU (" + places[r].bus + ")";
    }
  }
  bool all = true;
  int first_refusing = -1;
  const std::vector<std::string> verdicts = allGatherStrings(
      pg, prefix + "ok/", why.empty() ? "1" : "0", "ep dispatch (transport setup)");
  for (int r = 0; r < num_ranks; ++r) {
    if (verdicts[r] != "1" && first_refusing < 0) first_refusing = r;
    all = all && verdicts[r] == "1";
  }
  if (all) return "";
  return why.empty() ? "rank " + std::to_string(first_refusing) +
                           " cannot use them (see its high_throughput_transport)"
                     : why;
}

int roundUpPow2(int v, int floor) {
  int p = floor;
  while (p < v) {
    p *= 2;
  }
  return p;
}

struct Needs {
  int64_t tokens = 0;
  int64_t hidden_bytes = 0;
  int64_t topk = 0;
  int64_t scales = 0;
  int64_t local_experts = 0;
};

// Send warps per block set by hand (sweeps, the GPU tests' other splits), read when a group
// builds its transport. EP_DISPATCH_SEND_WARPS alone sets the dispatch's warps for every row
// size, slab or not; a count set by hand is used in a group of one rank too (no one-rank rule).
void applySendWarpOverrides(NvlinkConfig& cfg) {
  const bool dispatch_set = env::isSet<env::kDispatchSendWarps>();
  const bool combine_set = env::isSet<env::kCombineSendWarps>();
  if (dispatch_set) {
    cfg.dispatch_send_warps = static_cast<int>(env::integer<env::kDispatchSendWarps>(0));
    cfg.small_row_dispatch_send_warps = cfg.dispatch_send_warps;
    cfg.slab_dispatch_send_warps = 0;
  }
  if (env::isSet<env::kDispatchSendWarpsSmallRows>()) {
    cfg.small_row_dispatch_send_warps =
        static_cast<int>(env::integer<env::kDispatchSendWarpsSmallRows>(0));
  }
  if (env::isSet<env::kDispatchSendWarpsSlab>()) {
    cfg.slab_dispatch_send_warps = static_cast<int>(env::integer<env::kDispatchSendWarpsSlab>(0));
  }
  if (combine_set)
    cfg.combine_send_warps = static_cast<int>(env::integer<env::kCombineSendWarps>(0));
  if (dispatch_set || combine_set) cfg.one_rank_send_warps = false;
}

// Options.recv_slabs, or EP_RECV_SLABS (for A/B timings); every rank must agree on it.
int recvSlabs(EPProcessGroup& pg) {
  static const int env = [] {  // read once: this runs on every dispatch
    return static_cast<int>(env::integer<env::kRecvSlabs>(-1));
  }();
  return env >= 0 ? env : static_cast<int>(pg.options()->recv_slabs);
}

bool fits(const NvlinkConfig& c, const Needs& n) {
  return n.tokens <= c.max_tokens_per_rank && n.hidden_bytes <= c.max_hidden_bytes &&
         n.topk <= c.max_topk && n.scales <= c.max_scales && n.local_experts <= c.max_local_experts;
}

std::string describe(const Needs& n) {
  std::ostringstream os;
  os << n.tokens << " tokens per rank, " << n.hidden_bytes << " bytes per row, top-" << n.topk
     << ", " << n.scales << " scales per row, " << n.local_experts << " experts per rank";
  return os.str();
}

Needs capacityOf(const NvlinkConfig& c) {
  return Needs{c.max_tokens_per_rank, c.max_hidden_bytes, c.max_topk, c.max_scales,
               c.max_local_experts};
}

// The agreed field that keeps every rank's decision on growing the transport alike.
AgreedField graphCapturedField(const GroupState& st) {
  return {"a CUDA graph captured on the NVLink transport", st.graph_captured ? 1 : 0};
}

// Makes sure a connected runtime big enough for `needs` (the max over ranks) exists. Collective:
// every rank calls it with the same `needs` and graph_captured (an agreed field). It refuses to
// build or grow the transport while a graph is captured, or once one was: that graph's kernels
// keep the buffers' addresses, which a rebuild frees. `capture`: streamCapturing(), which the
// caller has already asked.
NvlinkRuntime& ensureRuntime(EPProcessGroup& pg, GroupState& st, const at::Device& device,
                             Needs needs, const char* op, bool capture) {
  if (st.runtime && fits(st.runtime->config(), needs)) {
    st.graph_captured = st.graph_captured || capture;
    return *st.runtime;
  }
  const char* how =
      " Size it before capturing: ep_backend.reserve(num_tokens, hidden, num_topk, num_experts) "
      "with the largest shapes, or run the largest call once first.";
  TORCH_CHECK(
      !capture, "ep ", op, ": the NVLink transport cannot be ", st.runtime ? "grown" : "set up",
      " while a CUDA graph is captured (this call needs ", describe(needs),
      st.runtime ? "; it holds " + describe(capacityOf(st.runtime->config())) : std::string(),
      "). Nothing was exchanged.", how);
  TORCH_CHECK(!st.graph_captured, "ep ", op, ": this call needs ", describe(needs),
              ", more than the NVLink transport holds (",
              describe(capacityOf(st.runtime->config())),
              "), and a CUDA graph captured earlier replays kernels on it: growing it would free "
              "the buffers that graph uses. Nothing was exchanged.",
              how);
  NvlinkConfig cfg;
  if (st.runtime) {
    const auto& old = st.runtime->config();
    needs.tokens = std::max<int64_t>(needs.tokens, old.max_tokens_per_rank);
    needs.hidden_bytes = std::max<int64_t>(needs.hidden_bytes, old.max_hidden_bytes);
    needs.topk = std::max<int64_t>(needs.topk, old.max_topk);
    needs.scales = std::max<int64_t>(needs.scales, old.max_scales);
    needs.local_experts = std::max<int64_t>(needs.local_experts, old.max_local_experts);
    if (profilingHost()) {
      std::fprintf(stderr,
                   "ep nvlink: rebuilding the transport (needs %lld tokens, %lld "
                   "hidden bytes, top-%lld, %lld scales, %lld local experts)\n",
                   static_cast<long long>(needs.tokens), static_cast<long long>(needs.hidden_bytes),
                   static_cast<long long>(needs.topk), static_cast<long long>(needs.scales),
                   static_cast<long long>(needs.local_experts));
    }
    // Peers may still run kernels on the old buffers: drain, then agree, then free. The barrier
    // goes through the store, not Gloo: both ranks of a 2-rank soak sometimes waited in Gloo's
    // barrier for the whole group timeout (one H100, ranks sharing it; cause not found).
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    traceHost("rebuild: device synchronized");
    allGatherStrings(pg, keyPrefix(pg) + "rebuild/" + std::to_string(st.generation) + "/", "",
                     std::string("ep ") + op + ": rebuilding the NVLink transport");
    traceHost("rebuild: barrier passed");
    st.runtime->destroy();
    st.runtime.reset();
    st.slabs.reset();  // outputs still viewing an old slab keep its memory
    traceHost("rebuild: old transport freed");
  }
  cfg.max_tokens_per_rank = roundUpPow2(static_cast<int>(needs.tokens), 1024);
  cfg.max_hidden_bytes = static_cast<int>(std::max<int64_t>(needs.hidden_bytes, 16));
  cfg.max_topk = static_cast<int>(std::max<int64_t>(needs.topk, 8));
  cfg.max_scales = static_cast<int>(std::max<int64_t>(needs.scales, 1));
  cfg.max_local_experts = static_cast<int>(std::max<int64_t>(needs.local_experts, 1));
  cfg.timeout_seconds = pg.options()->kernel_timeout_s;
  cfg.num_sms = static_cast<int>(pg.options()->num_sms);
  applySendWarpOverrides(cfg);
  cfg.recv_slabs = recvSlabs(pg);
  st.runtime = std::make_unique<NvlinkRuntime>(pg.getRank(), pg.getSize(), device.index(), cfg);
  traceHost("transport: buffers allocated");
  if (cfg.recv_slabs > 0) {
    st.slabs =
        std::make_shared<SlabPool>(cfg.recv_slabs, device.index(), st.runtime->recv_slab_owner());
  }
  const std::string prefix = keyPrefix(pg) + "ipc/" + std::to_string(++st.generation) + "/";
  auto handle = st.runtime->ipc_handle();
  pg.store()->set(prefix + std::to_string(pg.getRank()),
                  std::vector<uint8_t>(handle.begin(), handle.end()));
  std::vector<std::vector<char>> all(pg.getSize());
  for (int r = 0; r < pg.getSize(); ++r) {
    auto v = pg.store()->get(prefix + std::to_string(r));
    all[r] = std::vector<char>(v.begin(), v.end());
  }
  traceHost("transport: handles exchanged");
  st.runtime->connect(all);
  traceHost("transport: peers mapped");
  return *st.runtime;
}

// A kernel error of an earlier call (a timeout naming the stalled peer, a capacity overflow)
// surfaces at the next call on this group.
// takePendingError returns it ("" when none; reported once unless the transport failed).
std::string takePendingError(GroupState& st, const char* op) {
  if (!st.runtime) {
    return "";
  }
  std::string error = st.runtime->check_error();
  if (error.empty()) {
    return "";
  }
  if (!st.runtime->failed()) {
    st.runtime->clear_error();
  }
  return error + " (reported by the next call, " + op + ")";
}

void raisePendingError(GroupState& st, const char* op) {
  const std::string error = takePendingError(st, op);
  TORCH_CHECK(error.empty(), error);
}

Needs maxNeeds(const at::Tensor& gathered) {
  // gathered [R, >=5]: tokens, hidden bytes, top-k, scales, local experts. A plain loop: an ATen
  // reduction here woke the intra-op thread pool and cost milliseconds per call on the GPU host.
  auto g = gathered.accessor<int64_t, 2>();
  int64_t m[5] = {0, 0, 0, 0, 0};
  for (int64_t r = 0; r < g.size(0); ++r) {
    for (int c = 0; c < 5; ++c) {
      m[c] = std::max(m[c], g[r][c]);
    }
  }
  Needs n;
  n.tokens = m[0];
  n.hidden_bytes = m[1];
  n.topk = m[2];
  n.scales = m[3];
  n.local_experts = m[4];
  return n;
}

// The most rows a dispatch can deliver to one rank: every token of every rank (column 0 of the
// agreed payload), each received at most once.
int64_t worstCaseRows(const at::Tensor& gathered) {
  auto g = gathered.accessor<int64_t, 2>();
  int64_t rows = 0;
  for (int64_t r = 0; r < g.size(0); ++r) {
    rows += g[r][0];
  }
  return rows;
}

// Per-token send positions and receive prefix of a handle (the kernels' view of the routing);
// the prefix is left undefined unless `with_prefix`.
std::pair<at::Tensor, at::Tensor> kernelRouting(const DispatchRouting& r, bool with_prefix) {
  at::Tensor in_rank = r.is_token_in_rank.to(at::kInt);
  at::Tensor send_pos =
      at::where(r.is_token_in_rank, in_rank.cumsum(0, at::kInt) - 1, -1).to(at::kInt).contiguous();
  if (!with_prefix) {
    return {send_pos, at::Tensor()};
  }
  at::Tensor prefix = at::zeros({r.num_recv_tokens_per_rank.numel() + 1},
                                r.num_recv_tokens_per_rank.options().dtype(at::kInt));
  prefix.narrow(0, 1, r.num_recv_tokens_per_rank.numel())
      .copy_(r.num_recv_tokens_per_rank.cumsum(0, at::kInt));
  return {send_pos, prefix};
}

// The send positions and receive prefix of a handle for kernels on `stream`: the remembered
// ones (marked as used on `stream`, so the allocator never hands their memory to another stream
// while these kernels read it) or freshly computed ones (the prefix only `with_prefix`).
std::pair<at::Tensor, at::Tensor> routingFor(const KernelRouting* known, const DispatchRouting& r,
                                             const c10::cuda::CUDAStream& stream,
                                             bool with_prefix = true) {
  if (known == nullptr) {
    return kernelRouting(r, with_prefix);
  }
  for (const at::Tensor* t : {&known->send_pos, &known->recv_prefix}) {
    c10::cuda::CUDACachingAllocator::recordStream(t->storage().data_ptr(), stream);
  }
  return {known->send_pos, known->recv_prefix};
}

// A handle's counts (routingCounts() order) for the cross-rank check, and whether they are
// known: not while capturing a graph, nor for a worst-case handle (its dispatch never had them
// on the host; no host step is the point of that mode), which skip the check. Only a handle this
// process's dispatch did not make (or one modified since) is read back: a stream sync.
std::pair<std::vector<int64_t>, bool> handleCounts(const KernelRouting* known,
                                                   const DispatchRouting& r, int64_t num_ranks,
                                                   bool capture) {
  if (capture || (known != nullptr && known->host_counts.empty())) {
    return {std::vector<int64_t>(2 * num_ranks, 0), false};
  }
  if (known != nullptr) {
    return {known->host_counts, true};
  }
  return {routingCounts(r, num_ranks), true};
}

// Some rank's layout found a topk_idx value outside [-1, E) and notify told every rank: all raise
// here, before the dispatch kernel, so nothing moves and the transport stays in step. Worst-case
// mode has no such host step: there the layout treats the values as -1 and the next call raises.
// `take_record` returns (and clears) the error record of the layout that found the value.
template <typename TakeRecord>
[[noreturn]] void raiseRejectedTopk(TakeRecord take_record, int rejected_ranks, int64_t rank,
                                    int64_t num_experts, int64_t topk) {
  if ((rejected_ranks >> rank) & 1) {
    const ErrorRecord record = take_record();
    TORCH_CHECK(false, "ep dispatch: topk_idx values must be in [-1, num_experts=", num_experts,
                "), got ", record.value_a, " at token ", record.value_b / topk, ", slot ",
                record.value_b % topk, " (rank ", rank, "; nothing was exchanged)");
  }
  std::vector<int64_t> bad_ranks;
  for (int r = 0; r < kMaxRanks; ++r) {
    if ((rejected_ranks >> r) & 1) {
      bad_ranks.push_back(r);
    }
  }
  raiseRejectedBy("dispatch", bad_ranks);
}

// Scratch of the layout kernel's blocks (undefined when one block does it all). Stream-ordered
// like any tensor; its contents do not matter.
at::Tensor layoutWorkspace(int64_t num_tokens, int64_t num_experts, const at::Device& device) {
  const size_t bytes =
      nvlink_layout_workspace_bytes(static_cast<int>(num_tokens), static_cast<int>(num_experts));
  if (bytes == 0) {
    return at::Tensor();
  }
  return at::empty({static_cast<int64_t>(bytes)},
                   at::TensorOptions().dtype(at::kByte).device(device));
}

// A dispatch's outputs, made for the worst case (every rank's tokens) when the host wait overlaps
// the kernel: their first n rows, in place. Nothing else holds them yet (a deferred dispatch's
// caller has not used them), so the row count is set on the tensors themselves: no dispatcher
// call, unlike narrow, on the host's critical path between the count wait and the return.
void keepRows(DispatchResult& r, int64_t n) {
  TORCH_INTERNAL_ASSERT(n <= r.recv_x.size(0), "ep dispatch: ", n, " rows received, more than the ",
                        r.recv_x.size(0), " every rank's tokens add up to");
  const auto keep = [n](at::Tensor& t) {
    std::vector<int64_t> sizes = t.sizes().vec();
    sizes[0] = n;
    t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  };
  keep(r.recv_x);
  if (r.recv_x_scales.has_value()) {
    keep(*r.recv_x_scales);
  }
  keep(r.recv_topk_idx);
  if (r.recv_topk_weights.has_value()) {
    keep(*r.recv_topk_weights);
  }
  keep(r.routing.recv_src_idx);
  keep(r.routing.recv_src_rank);
}

// The counts a later combine of this routing checks across ranks, in routingCounts() order.
std::vector<int64_t> hostRoutingCounts(const NvlinkRecvCounts& counts) {
  std::vector<int64_t> out(counts.sent_per_rank.begin(), counts.sent_per_rank.end());
  out.insert(out.end(), counts.per_rank.begin(), counts.per_rank.end());
  return out;
}

// The notify kernel's per-expert counts as a CPU int64 tensor (no device read).
at::Tensor hostCounts(const std::vector<int>& counts) {
  at::Tensor t =
      at::empty({static_cast<int64_t>(counts.size())}, at::TensorOptions().dtype(at::kLong));
  std::copy(counts.begin(), counts.end(), t.data_ptr<int64_t>());
  return t;
}

}  // namespace

bool recordSlabStream(const at::Tensor& tensor, const c10::Stream& stream) {
  if (!tensor.defined() || !tensor.has_storage()) return false;
  const c10::DataPtr& data = tensor.storage().data_ptr();
  if (data.get_deleter() != &releaseSlabView) return false;
  TORCH_CHECK(stream.device() == tensor.device(), "ep record_stream: the stream is on ",
              stream.device(), ", the tensor on ", tensor.device());
  const c10::cuda::CUDAStream cuda_stream(stream);  // checks that it is a CUDA stream
  static_cast<SlabView*>(data.get_context())->lease->add_stream(cuda_stream.stream());
  return true;
}

namespace {

// Error state of the standalone layout kernel, one per device, kept for the process: the
// kernel's error lock (device memory) and its error record (host-mapped, read by the next call).
struct LayoutErrorState {
  ControlBlock* ctrl = nullptr;
  ErrorRecord* host = nullptr;
  ErrorRecord* dev = nullptr;
};

LayoutErrorState& layoutErrorState(int device, cudaStream_t stream) {
  static std::mutex mutex;
  static auto* states = new std::map<int, LayoutErrorState>();
  std::lock_guard<std::mutex> lock(mutex);
  LayoutErrorState& st = (*states)[device];
  if (st.ctrl == nullptr) {
    // The first use may come while a CUDA graph is being captured: allocations are refused in
    // the default capture mode, so they run in relaxed mode, and the control block is zeroed on
    // the stream (in a graph, at each replay: harmless, it only resets the error lock).
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    C10_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    C10_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&st.ctrl), sizeof(ControlBlock)));
    C10_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&st.host), sizeof(ErrorRecord),
                                 cudaHostAllocMapped));
    C10_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    std::memset(static_cast<void*>(st.host), 0, sizeof(ErrorRecord));
    C10_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&st.dev), st.host, 0));
    C10_CUDA_CHECK(cudaMemsetAsync(st.ctrl, 0, sizeof(ControlBlock), stream));
  }
  return st;
}

// Returns and clears the error a standalone layout kernel recorded on `device` (a dispatch that
// took that layout is raising it).
ErrorRecord takeLayoutError(int device, cudaStream_t stream) {
  LayoutErrorState& err = layoutErrorState(device, stream);
  const ErrorRecord record = *const_cast<const ErrorRecord*>(err.host);
  std::memset(static_cast<void*>(err.host), 0, sizeof(ErrorRecord));
  C10_CUDA_CHECK(cudaMemsetAsync(&err.ctrl->error_lock, 0, sizeof(int), stream));
  return record;
}

// The combine kernels' element type of a payload dtype (validation admitted only these).
CombineElem combineElem(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16:
      return CombineElem::kBFloat16;
    case at::kHalf:
      return CombineElem::kFloat16;
    case at::kFloat:
      return CombineElem::kFloat32;
    case at::kDouble:
      return CombineElem::kFloat64;
    default:
      TORCH_CHECK(false, "ep combine: no kernel sums ", t, " rows");
  }
}

}  // namespace

LayoutTensors dispatchLayout(const at::Tensor& topk_idx, int64_t num_experts, int64_t num_ranks) {
  HostStages stages("layout");
  const char* op = "ep get_dispatch_layout: ";
  checkDispatchLayoutArgs(topk_idx, num_experts, num_ranks);
  TORCH_CHECK(num_ranks <= kMaxRanks, op, "the CUDA layout kernel serves 1..", kMaxRanks,
              " ranks, got ", num_ranks);
  TORCH_CHECK(num_experts <= (1 << 14), op, "num_experts=", num_experts, " exceeds 16384");
  TORCH_CHECK(topk_idx.size(0) <= std::numeric_limits<int>::max() / num_ranks, op,
              "too many tokens");
  const at::Device device = topk_idx.device();
  c10::cuda::CUDAGuard guard(device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  LayoutErrorState& err = layoutErrorState(device.index(), stream);
  if (const volatile ErrorRecord* e = err.host; e->code != kErrorNone) {
    const ErrorRecord record = takeLayoutError(device.index(), stream);
    const long long value = record.value_a, flat = record.value_b;
    TORCH_CHECK(record.code != kErrorTimeout, op, "an earlier call on ", device,
                " timed out: a block of the layout kernel waited for block ", value,
                ", which never ran (its outputs are wrong; reported by the next call)");
    TORCH_CHECK(false, op, "an earlier call on ", device, " got topk_idx value ", value,
                " at flat position ", flat,
                ", outside [-1, num_experts) (counted as -1 there; "
                "reported by the next call)");
  }
  stages.mark("checks");
  const at::Tensor idx = topk_idx.contiguous();
  const auto i32 = idx.options().dtype(at::kInt);
  at::Tensor per_rank = at::empty({num_ranks}, i32);
  at::Tensor per_expert = at::empty({num_experts}, i32);
  at::Tensor in_rank = at::empty({idx.size(0), num_ranks}, idx.options().dtype(at::kBool));
  at::Tensor send_pos = at::empty({idx.size(0), num_ranks}, i32);
  LayoutParams p{};
  p.topk_idx = idx.data_ptr();
  p.idx_bytes = static_cast<int>(idx.element_size());
  p.num_tokens = static_cast<int>(idx.size(0));
  p.num_topk = static_cast<int>(idx.size(1));
  p.num_experts = static_cast<int>(num_experts);
  p.num_ranks = static_cast<int>(num_ranks);
  p.num_tokens_per_rank = per_rank.data_ptr<int>();
  p.num_tokens_per_expert = per_expert.data_ptr<int>();
  p.is_token_in_rank = in_rank.data_ptr<bool>();
  p.send_pos = send_pos.data_ptr<int>();
  p.ctrl = err.ctrl;
  p.error = err.dev;
  p.rank = -1;
  const at::Tensor ws = layoutWorkspace(idx.size(0), num_experts, device);
  p.workspace = ws.defined() ? ws.data_ptr() : nullptr;
  stages.mark("alloc");
  C10_CUDA_CHECK(launch_nvlink_layout(p, stream));
  stages.mark("launch");
  return {per_rank, per_expert, in_rank, send_pos};
}

DispatchResult dispatch(EPProcessGroup& pg, const DispatchArgs& a, DeferredCounts* deferred) {
  HostStages stages("dispatch");
  const int64_t num_ranks = pg.getSize();
  auto st = stateOf(pg);
  raisePendingError(*st, "dispatch");
  // Values of topk_idx are never read on the host (a stream sync): the layout kernel checks them
  // and notify tells every rank, which all raise before the dispatch kernel (see below).
  const std::string error = validateDispatch(a, num_ranks, false);
  stages.mark("validate");
  const bool ok = error.empty();
  const bool has_scales = a.x_scales.has_value();
  const bool has_weights = a.topk_weights.has_value();
  std::vector<AgreedField> fields = dispatchFields(a, ok);
  // Ranks that disagree would diverge on a rejected routing (one launches the kernel, one not).
  fields.push_back(
      {"Options.overlap_dispatch_host_wait", pg.options()->overlap_dispatch_host_wait});
  fields.push_back({"Options.recv_slabs (or EP_RECV_SLABS)", recvSlabs(pg)});
  fields.push_back(graphCapturedField(*st));
  std::vector<int64_t> payload{
      ok ? a.x.size(0) : 0, ok ? a.x.size(1) * a.x.element_size() : 0, ok ? a.topk_idx.size(1) : 0,
      ok && has_scales ? a.x_scales->size(1) : 0, ok ? a.num_experts / num_ranks : 0};
  at::Tensor gathered = agreeAcrossRanks(pg, "dispatch", error, fields, payload);
  stages.mark("agree");

  const at::Device device = a.x.device();
  c10::cuda::CUDAGuard guard(device);
  stages.mark("guard");
  const Needs needs = maxNeeds(gathered);
  stages.mark("needs");
  const bool capture = streamCapturing();
  NvlinkRuntime& rt = ensureRuntime(pg, *st, device, needs, "dispatch", capture);
  stages.mark("runtime");
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();

  const int64_t num_tokens = a.x.size(0);
  const int64_t topk = a.topk_idx.size(1);
  const int64_t experts_per_rank = a.num_experts / num_ranks;
  const auto i32 = a.x.options().dtype(at::kInt);
  const int idx_bytes = static_cast<int>(a.topk_idx.element_size());
  const auto align4 = [](int64_t n) { return (n + 3) / 4 * 4; };
  // A layout computed earlier (get_dispatch_layout) replaces the layout kernel; its error record
  // tells notify whether it found an invalid topk_idx value.
  const bool given_layout = !a.layout.empty();
  LayoutErrorRef given_layout_error{};
  const LayoutErrorRef* layout_error = nullptr;
  at::Tensor per_rank, per_expert, in_rank, send_pos, recv_prefix, dest_slabs;
  if (given_layout) {
    per_rank = a.layout[0];
    per_expert = a.layout[1];
    in_rank = a.layout[2];
    send_pos = a.layout[3];
    at::Tensor small = at::empty({align4(num_ranks + 1) + 2 * num_ranks}, i32);
    recv_prefix = small.narrow(0, 0, num_ranks + 1);
    dest_slabs = small.narrow(0, align4(num_ranks + 1), 2 * num_ranks);
    const LayoutErrorState& err = layoutErrorState(device.index(), stream);
    given_layout_error = {err.dev, &err.ctrl->error_lock};
    layout_error = &given_layout_error;
  } else {
    // Order matters for latency: the GPU idles until the layout launch, so only the layout's
    // tensors come first; the rest is allocated while the layout and notify kernels run.
    per_rank = at::empty({num_ranks}, i32);
    per_expert = at::empty({a.num_experts}, i32);
    in_rank = at::empty({num_tokens, num_ranks}, a.x.options().dtype(at::kBool));
    // One allocation for the kernels' own int32 arrays: send positions [T, R], the receive
    // prefix [R + 1], the lent slabs [2R] and the layout kernel's scratch, each 16-byte aligned.
    const int64_t prefix_at = align4(num_tokens * num_ranks);
    const int64_t slabs_at = prefix_at + align4(num_ranks + 1);
    const int64_t scratch_at = slabs_at + align4(2 * num_ranks);
    const size_t layout_ws_bytes = nvlink_layout_workspace_bytes(static_cast<int>(num_tokens),
                                                                 static_cast<int>(a.num_experts));
    at::Tensor internal =
        at::empty({scratch_at + align4(static_cast<int64_t>((layout_ws_bytes + 3) / 4))}, i32);
    send_pos = internal.narrow(0, 0, num_tokens * num_ranks).view({num_tokens, num_ranks});
    recv_prefix = internal.narrow(0, prefix_at, num_ranks + 1);
    dest_slabs = internal.narrow(0, slabs_at, 2 * num_ranks);
    void* layout_ws = layout_ws_bytes > 0 ? internal.data_ptr<int>() + scratch_at : nullptr;
    rt.layout(a.topk_idx.data_ptr(), idx_bytes, static_cast<int>(num_tokens),
              static_cast<int>(topk), static_cast<int>(a.num_experts), per_rank.data_ptr<int>(),
              per_expert.data_ptr<int>(), in_rank.data_ptr<bool>(), send_pos.data_ptr<int>(),
              stream, layout_ws);
  }
  at::Tensor recv_counts = at::empty({num_ranks}, i32);
  at::Tensor recv_per_expert = at::empty({experts_per_rank}, i32);
  const bool host_counts = a.num_worst_tokens == 0;
  // Output rows: num_worst_tokens; else, when the host wait overlaps the kernel, storage for
  // the most any rank can receive (every token of every rank), narrowed once the counts are in.
  const bool overlap = host_counts && pg.options()->overlap_dispatch_host_wait;
  // Without a host wait between notify and the dispatch launch, the dispatch kernel starts
  // behind notify while it runs (programmatic dependent launch).
  const bool dispatch_follows = !host_counts || overlap;
  // A receive slab for the outputs: the senders then write them in place (none in worst-case
  // mode, whose outputs a CUDA graph may keep, nor while capturing).
  const bool slabs = st->slabs != nullptr;
  std::shared_ptr<SlabLease> lease;
  if (host_counts && !capture) lease = lendSlab(st->slabs, stream);
  const int ticket = rt.notify(
      per_rank.data_ptr<int>(), per_expert.data_ptr<int>(), static_cast<int>(a.num_experts),
      static_cast<int>(a.expert_alignment), static_cast<int>(a.num_worst_tokens),
      recv_counts.data_ptr<int>(), recv_prefix.data_ptr<int>(), recv_per_expert.data_ptr<int>(),
      host_counts, stream, layout_error, dispatch_follows, lease ? lease->index() : -1,
      slabs ? dest_slabs.data_ptr<int>() : nullptr);
  stages.mark("layout+notify");

  int64_t rows = a.num_worst_tokens;
  if (overlap) {
    rows = worstCaseRows(gathered);
  }
  DispatchResult out;
  at::Tensor src_idx, src_rank;
  const auto allocate_and_launch = [&] {
    // Outputs: views of the lent slab (each keeps the lease), else fresh tensors.
    const int hidden_bytes = static_cast<int>(a.x.size(1) * a.x.element_size());
    const int num_scales = has_scales ? static_cast<int>(a.x_scales->size(1)) : 0;
    const SlabLayout slab =
        rt.recv_slab_layout(hidden_bytes, num_scales, static_cast<int>(topk), idx_bytes);
    const auto output = [&](size_t offset, at::IntArrayRef sizes, const at::TensorOptions& opts) {
      return slabOutput(rt, lease, offset, sizes, opts);
    };
    out.recv_x = output(slab.x, {rows, a.x.size(1)}, a.x.options());
    if (has_scales) {
      out.recv_x_scales = output(slab.scales, {rows, a.x_scales->size(1)}, a.x_scales->options());
    }
    out.recv_topk_idx = output(slab.topk_idx, {rows, topk}, a.topk_idx.options());
    if (has_weights) {
      out.recv_topk_weights = output(slab.topk_weights, {rows, topk}, a.topk_weights->options());
    }
    src_idx = output(slab.src_idx, {rows}, i32);
    src_rank = output(slab.src_rank, {rows}, i32);

    NvlinkDispatchArgs args;
    args.x = a.x.data_ptr();
    args.num_tokens = static_cast<int>(num_tokens);
    args.hidden_bytes = static_cast<int>(a.x.size(1) * a.x.element_size());
    args.x_scales = has_scales ? static_cast<const float*>(a.x_scales->data_ptr()) : nullptr;
    args.num_scales = has_scales ? static_cast<int>(a.x_scales->size(1)) : 0;
    args.topk_idx = a.topk_idx.data_ptr();
    args.idx_bytes = idx_bytes;
    args.topk_weights = has_weights ? a.topk_weights->data_ptr<float>() : nullptr;
    args.num_topk = static_cast<int>(topk);
    args.num_experts = static_cast<int>(a.num_experts);
    args.send_pos = send_pos.data_ptr<int>();
    args.recv_prefix = recv_prefix.data_ptr<int>();
    args.recv_x = out.recv_x.data_ptr();
    args.recv_x_scales = has_scales ? static_cast<float*>(out.recv_x_scales->data_ptr()) : nullptr;
    args.recv_topk_idx = out.recv_topk_idx.data_ptr();
    args.recv_topk_weights = has_weights ? out.recv_topk_weights->data_ptr<float>() : nullptr;
    args.recv_src_idx = src_idx.data_ptr<int>();
    args.recv_src_rank = src_rank.data_ptr<int>();
    // Only worst-case mode pads; the overlapped launch leaves the rows past the count unwritten.
    args.num_worst_tokens = overlap ? 0 : static_cast<int>(a.num_worst_tokens);
    args.dest_slabs = slabs ? dest_slabs.data_ptr<int>() : nullptr;
    args.own_slab = lease != nullptr;
    rt.dispatch(args, stream);
    lease.reset();  // the outputs hold it now
    out.num_recv_tokens_per_expert = recv_per_expert;
    out.routing = {in_rank, per_rank, recv_counts, src_idx, src_rank};
  };
  if (overlap) {
    // The kernel reads the receive prefix notify leaves on the device; a rejected routing
    // (an invalid topk_idx on some rank) makes it move nothing, on every rank alike.
    allocate_and_launch();
    stages.mark("alloc+launch");
  }
  st->routings.prune();
  // Waits for notify's counts and raises, on every rank alike, when some rank's topk_idx was
  // rejected. Holds what it needs by value: with `deferred` it runs after dispatch() returned.
  const NvlinkRuntime* const built = &rt;
  const auto wait_counts = [st, built, generation = st->generation, ticket, given_layout,
                            device_index = device.index(), stream, rank = pg.getRank(),
                            num_experts = a.num_experts, topk] {
    TORCH_CHECK(st->runtime.get() == built && st->generation == generation,
                "ep dispatch: the group's transport was shut down or rebuilt before this "
                "dispatch's receive counts were read");
    NvlinkRuntime& runtime = *st->runtime;
    NvlinkRecvCounts counts = runtime.wait_recv_counts(ticket);
    if (counts.rejected_ranks != 0) {
      const auto take_record = [&]() -> ErrorRecord {
        if (given_layout) {
          return takeLayoutError(device_index, stream);
        }
        const ErrorRecord record = runtime.error_record();
        runtime.clear_error();
        return record;
      };
      raiseRejectedTopk(take_record, counts.rejected_ranks, rank, num_experts, topk);
    }
    return counts;
  };
  if (overlap && deferred != nullptr) {
    // The count wait and what follows it run when the caller calls *deferred, so that it can
    // build its own result objects while the GPU still runs notify.
    out.num_recv_tokens_per_expert_host = at::empty({0}, at::TensorOptions().dtype(at::kLong));
    *deferred = [wait_counts, res = out, st, send_pos, recv_prefix]() mutable {
      HostStages finish_stages("dispatch finish");
      const NvlinkRecvCounts counts = wait_counts();
      finish_stages.mark("count_wait");
      keepRows(res, counts.num_recv_tokens);
      st->routings.remember(res.routing, send_pos, recv_prefix, hostRoutingCounts(counts));
      finish_stages.mark("remember");
      return std::vector<int64_t>(counts.per_expert.begin(), counts.per_expert.end());
    };
    stages.mark("deferred");
    return out;
  }
  std::vector<int64_t> host_routing_counts;  // routingCounts() order, for later combines
  at::Tensor host_per_expert = at::empty({0}, at::TensorOptions().dtype(at::kLong));
  if (host_counts) {
    const NvlinkRecvCounts counts = wait_counts();
    stages.mark("count_wait");  // the rest is the host's work after the counts arrived
    host_routing_counts = hostRoutingCounts(counts);
    host_per_expert = hostCounts(counts.per_expert);
    if (overlap) {
      keepRows(out, counts.num_recv_tokens);
    } else {
      rows = counts.num_recv_tokens;
    }
  }
  stages.mark("wait_counts");
  if (!overlap) {
    allocate_and_launch();
    stages.mark("alloc+launch");
  }
  out.num_recv_tokens_per_expert_host = host_per_expert;
  st->routings.remember(out.routing, send_pos, recv_prefix, std::move(host_routing_counts));
  stages.mark("remember");
  return out;
}

std::vector<int64_t> reserve(EPProcessGroup& pg, const at::Device& device,
                             const at::Tensor& gathered) {
  auto st = stateOf(pg);
  c10::cuda::CUDAGuard guard(device);
  const NvlinkConfig& cfg =
      ensureRuntime(pg, *st, device, maxNeeds(gathered), "reserve", streamCapturing()).config();
  return {cfg.max_tokens_per_rank, cfg.max_hidden_bytes,  cfg.max_topk,
          cfg.max_scales,          cfg.max_local_experts, cfg.recv_slabs};
}

std::pair<at::Tensor, std::optional<at::Tensor>> cachedDispatch(
    EPProcessGroup& pg, const at::Tensor& x, const std::optional<at::Tensor>& x_scales,
    const DispatchRouting& routing) {
  const int64_t num_ranks = pg.getSize();
  auto st = stateOf(pg);
  raisePendingError(*st, "cached dispatch");
  const std::string error = validateCachedDispatch(x, x_scales, routing, num_ranks);
  const bool ok = error.empty();
  std::vector<AgreedField> fields = cachedDispatchFields(x, x_scales, ok);
  // Whether the peers write our rows into a receive slab is decided alike on every rank (a
  // notify runs first then, a collective kernel).
  const bool capture = streamCapturing();
  fields.push_back({"Options.recv_slabs (or EP_RECV_SLABS)", recvSlabs(pg)});
  fields.push_back({"CUDA graph capture", capture ? 1 : 0});
  fields.push_back(graphCapturedField(*st));
  // One local expert: the notify that lends slabs announces one (dummy) count per rank.
  std::vector<int64_t> payload{ok ? x.size(0) : 0, ok ? x.size(1) * x.element_size() : 0, 0,
                               ok && x_scales ? x_scales->size(1) : 0, 1};
  const std::shared_ptr<const KernelRouting> known = st->routings.recall(routing);
  const auto [counts, counts_known] = handleCounts(known.get(), routing, num_ranks, capture);
  payload.insert(payload.end(), counts.begin(), counts.end());
  const int64_t rows = ok ? routing.recv_src_idx.size(0) : 0;
  payload.push_back(rows);
  payload.push_back(counts_known ? 1 : 0);
  at::Tensor gathered = agreeAcrossRanks(pg, "cached dispatch", error, fields, payload);
  const int64_t known_column = 5 + 2 * num_ranks + 1;
  checkRoutingAgrees("cached dispatch", gathered, 5, pg.getRank(), known_column);

  const at::Device device = x.device();
  c10::cuda::CUDAGuard guard(device);
  NvlinkRuntime& rt =
      ensureRuntime(pg, *st, device, maxNeeds(gathered), "cached dispatch", capture);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  // Receive slabs as in dispatch (peers write the outputs in place, no copy out of the buffer),
  // which takes a notify to lend them: not while capturing, and not for a num_worst_tokens handle
  // with padding rows (nobody writes those in a slab). Every rank reads the same gathered table.
  bool via_slabs = st->slabs != nullptr && !capture;
  {
    auto g = gathered.accessor<int64_t, 2>();
    for (int64_t r = 0; r < num_ranks && via_slabs; ++r) {
      int64_t received = 0;
      for (int64_t s = 0; s < num_ranks; ++s) received += g[r][5 + num_ranks + s];
      via_slabs = g[r][known_column] == 1 && g[r][5 + 2 * num_ranks] == received;
    }
  }
  // Behind a slab-lending notify the kernel reads that notify's prefix, not the handle's.
  auto [send_pos, recv_prefix] =
      routingFor(known.get(), routing, c10::cuda::getCurrentCUDAStream(device.index()), !via_slabs);
  std::shared_ptr<SlabLease> lease;
  at::Tensor dest_slabs;
  if (via_slabs) {
    lease = lendSlab(st->slabs, stream);
    // The handle's counts announced again (per expert: unused, one dummy expert per rank); the
    // notify's prefix equals the handle's and is what the kernel reads behind it.
    const at::Tensor per_rank = routing.num_tokens_per_rank.to(at::kInt).contiguous();
    const auto align4 = [](int64_t n) { return (n + 3) / 4 * 4; };
    at::Tensor small =
        at::empty({align4(num_ranks + 1) + align4(2 * num_ranks) + align4(num_ranks) + 4},
                  per_rank.options());
    recv_prefix = small.narrow(0, 0, num_ranks + 1);
    dest_slabs = small.narrow(0, align4(num_ranks + 1), 2 * num_ranks);
    at::Tensor recv_counts =
        small.narrow(0, align4(num_ranks + 1) + align4(2 * num_ranks), num_ranks);
    at::Tensor per_expert_out = small.narrow(0, small.numel() - 4, 1);
    rt.notify(per_rank.data_ptr<int>(), per_rank.data_ptr<int>(), static_cast<int>(num_ranks), 1, 0,
              recv_counts.data_ptr<int>(), recv_prefix.data_ptr<int>(),
              per_expert_out.data_ptr<int>(), /*host_counters=*/false, stream, nullptr,
              /*dispatch_follows=*/true, lease ? lease->index() : -1, dest_slabs.data_ptr<int>());
  }
  const int hidden_bytes = static_cast<int>(x.size(1) * x.element_size());
  const int num_scales = x_scales ? static_cast<int>(x_scales->size(1)) : 0;
  const SlabLayout slab = rt.cached_slab_layout(hidden_bytes, num_scales);
  at::Tensor recv_x = slabOutput(rt, lease, slab.x, {rows, x.size(1)}, x.options());
  std::optional<at::Tensor> recv_scales;
  if (x_scales) {
    recv_scales =
        slabOutput(rt, lease, slab.scales, {rows, x_scales->size(1)}, x_scales->options());
  }
  NvlinkDispatchArgs args;
  args.x = x.data_ptr();
  args.num_tokens = static_cast<int>(x.size(0));
  args.hidden_bytes = hidden_bytes;
  args.x_scales = x_scales ? static_cast<const float*>(x_scales->data_ptr()) : nullptr;
  args.num_scales = num_scales;
  args.send_pos = send_pos.data_ptr<int>();
  args.recv_prefix = recv_prefix.data_ptr<int>();
  args.recv_x = recv_x.data_ptr();
  args.recv_x_scales = recv_scales ? static_cast<float*>(recv_scales->data_ptr()) : nullptr;
  // Rows past the valid count (a num_worst_tokens handle) are written as padding.
  args.num_worst_tokens = via_slabs ? 0 : static_cast<int>(rows);
  args.dest_slabs = via_slabs ? dest_slabs.data_ptr<int>() : nullptr;
  args.own_slab = lease != nullptr;
  rt.cached_dispatch(args, stream);
  return {recv_x, recv_scales};
}

std::pair<at::Tensor, std::optional<at::Tensor>> combine(EPProcessGroup& pg, const CombineArgs& a) {
  HostStages stages("combine");
  const int64_t num_ranks = pg.getSize();
  auto st = stateOf(pg);
  raisePendingError(*st, "combine");
  const std::string error = validateCombine(a, num_ranks);
  stages.mark("validate");
  const bool ok = error.empty();
  const bool has_weights = a.topk_weights.has_value();
  std::vector<AgreedField> fields = combineFields(a, ok);
  fields.push_back(graphCapturedField(*st));
  const auto& r = a.routing;
  std::vector<int64_t> payload{ok ? r.is_token_in_rank.size(0) : 0,
                               ok ? a.x.size(1) * a.x.element_size() : 0,
                               ok && has_weights ? a.topk_weights->size(1) : 0, 0, 0};
  const std::shared_ptr<const KernelRouting> known = st->routings.recall(r);
  const bool capture = streamCapturing();
  const auto [counts, counts_known] = handleCounts(known.get(), r, num_ranks, capture);
  stages.mark("handle_counts");
  payload.insert(payload.end(), counts.begin(), counts.end());
  payload.push_back(counts_known ? 1 : 0);
  at::Tensor gathered = agreeAcrossRanks(pg, "combine", error, fields, payload);
  checkRoutingAgrees("combine", gathered, 5, pg.getRank(), 5 + 2 * num_ranks);
  stages.mark("agree");

  const at::Device device = a.x.device();
  c10::cuda::CUDAGuard guard(device);
  NvlinkRuntime& rt = ensureRuntime(pg, *st, device, maxNeeds(gathered), "combine", capture);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  auto [send_pos, recv_prefix] =
      routingFor(known.get(), r, c10::cuda::getCurrentCUDAStream(device.index()));
  stages.mark("routing");
  const int64_t num_tokens = r.is_token_in_rank.size(0);
  at::Tensor out = at::empty({num_tokens, a.x.size(1)}, a.x.options());
  std::optional<at::Tensor> out_w;
  if (has_weights) {
    out_w = at::empty({num_tokens, a.topk_weights->size(1)}, a.topk_weights->options());
  }
  NvlinkCombineArgs args;
  args.x = a.x.data_ptr();
  args.elem = combineElem(a.x.scalar_type());
  args.hidden = static_cast<int>(a.x.size(1));
  args.num_recv_rows = static_cast<int>(a.x.size(0));
  args.topk_weights = has_weights ? a.topk_weights->data_ptr<float>() : nullptr;
  args.num_topk = has_weights ? static_cast<int>(a.topk_weights->size(1)) : 0;
  args.recv_prefix = recv_prefix.data_ptr<int>();
  args.send_pos = send_pos.data_ptr<int>();
  args.num_tokens = static_cast<int>(num_tokens);
  args.bias0 = a.bias0 ? a.bias0->data_ptr() : nullptr;
  args.bias1 = a.bias1 ? a.bias1->data_ptr() : nullptr;
  args.out = out.data_ptr();
  args.out_topk_weights = out_w ? out_w->data_ptr<float>() : nullptr;
  rt.combine(args, stream);
  stages.mark("alloc+launch");
  return {out, out_w};
}

}  // namespace ep::nvlink

namespace ep {
namespace {

// The NVLink transport behind the Transport interface (backend/transport.hpp).
class NvlinkTransport final : public PerGroupTransport<nvlink::GroupState> {
 public:
  TransportKind kind() const override { return TransportKind::kNvlink; }
  bool serves(OpFamily family) const override { return family == OpFamily::kHighThroughput; }
  int64_t maxLayoutRanks() const override { return kMaxRanks; }
  LayoutTensors layout(const at::Tensor& topk_idx, int64_t num_experts,
                       int64_t num_ranks) override {
    return nvlink::dispatchLayout(topk_idx, num_experts, num_ranks);
  }
  DispatchResult dispatch(EPProcessGroup& pg, const DispatchArgs& args,
                          DeferredCounts* deferred) override {
    return nvlink::dispatch(pg, args, deferred);
  }
  std::pair<at::Tensor, std::optional<at::Tensor>> cachedDispatch(
      EPProcessGroup& pg, const at::Tensor& x, const std::optional<at::Tensor>& x_scales,
      const DispatchRouting& routing) override {
    return nvlink::cachedDispatch(pg, x, x_scales, routing);
  }
  std::pair<at::Tensor, std::optional<at::Tensor>> combine(EPProcessGroup& pg,
                                                           const CombineArgs& args) override {
    return nvlink::combine(pg, args);
  }
  std::optional<std::vector<int64_t>> reserve(EPProcessGroup& pg, const at::Device& device,
                                              const at::Tensor& gathered) override {
    return nvlink::reserve(pg, device, gathered);
  }
  std::string takePendingError(EPProcessGroup& pg, const char* op) override {
    return nvlink::takePendingError(*nvlink::stateOf(pg), op);
  }
  bool graphCaptured(EPProcessGroup& pg) override { return nvlink::stateOf(pg)->graph_captured; }
  bool recordStream(const at::Tensor& tensor, const c10::Stream& stream) override {
    return nvlink::recordSlabStream(tensor, stream);
  }

 private:
  std::shared_ptr<nvlink::GroupState> stateOf(EPProcessGroup& pg) override {
    return nvlink::stateOf(pg);
  }
  Verdict decide(EPProcessGroup& pg, nvlink::GroupState&, const at::Device& device) override {
    std::string why = nvlink::decideUsable(pg, device);
    const bool requested = why == nvlink::kAskedAten;
    return Verdict{std::move(why), requested};
  }
};

}  // namespace

Transport& nvlinkTransport() {
  static NvlinkTransport transport;
  return transport;
}

}  // namespace ep

#endif  // EP_WITH_CUDA
