// The internode transport: high-throughput dispatch, cached dispatch and combine of a group that
// spans several nodes (real hosts, or nodes emulated with Options.ranks_per_node), through the
// hierarchical kernels of cuda/internode_kernels.cu (RDMA leg by NVSHMEM puts to the rank with
// the same local index on each node, NVLink leg inside the node; docs/internode.md).
//
// First version: the counts are agreed on the host (the group's agreement all-gather over Gloo,
// the same step the ATen path takes), not yet notified on the GPU, so the ops are not
// graph-capturable; every rank then knows every source's row counts and computes the final
// position of each of its rows at each receiver. The kernels run in libep_nvshmem.so (dlsym'd
// here) on the NVSHMEM session of the group's low-latency runtime.
#include "transports/internode/internode_transport.hpp"

#ifdef EP_WITH_CUDA

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "backend/dispatch_layout.hpp"
#include "backend/ep_process_group.hpp"
#include "backend/group_state.hpp"
#include "backend/moe_validation.hpp"
#include "backend/per_group_transport.hpp"
#include "backend/received_rows.hpp"
#include "backend/store_exchange.hpp"
#include "backend/stream_capture.hpp"
#include "common/env.hpp"
#include "transports/aten/aten_transport.hpp"
#include "transports/internode/cuda/internode_capi.h"
#include "transports/internode/cuda/internode_runtime.hpp"
#include "transports/internode/internode_plan.hpp"
#include "transports/nvshmem/nvshmem_transport.hpp"

namespace ep::internode {
namespace {

// ---- the runtime's C entry points in libep_nvshmem.so -------------------------------------

struct Library {
  bool ok = false;
  std::string error;
  ep_internode_symmetric_bytes_fn symmetric_bytes = nullptr;
  ep_internode_create_fn create = nullptr;
  ep_internode_connect_fn connect = nullptr;
  ep_internode_abandon_fn abandon = nullptr;
  ep_internode_dispatch_fn dispatch = nullptr;
  ep_internode_combine_fn combine = nullptr;
  ep_internode_check_error_fn check_error = nullptr;
  ep_internode_destroy_fn destroy = nullptr;
  ep_internode_progress_fn progress = nullptr;
};

const Library& library() {
  static const Library lib = [] {
    using nvshmem::librarySymbol;
    Library l;
    ep_internode_abi_version_fn version = nullptr;
    if (!librarySymbol("ep_internode_abi_version", version, l.error)) return l;
    if (version() != EP_INTERNODE_ABI_VERSION) {
      l.error = "libep_nvshmem.so was built for another version of the internode transport";
      return l;
    }
    l.ok = librarySymbol("ep_internode_symmetric_bytes", l.symmetric_bytes, l.error) &&
           librarySymbol("ep_internode_create", l.create, l.error) &&
           librarySymbol("ep_internode_connect", l.connect, l.error) &&
           librarySymbol("ep_internode_abandon", l.abandon, l.error) &&
           librarySymbol("ep_internode_dispatch", l.dispatch, l.error) &&
           librarySymbol("ep_internode_combine", l.combine, l.error) &&
           librarySymbol("ep_internode_check_error", l.check_error, l.error) &&
           librarySymbol("ep_internode_destroy", l.destroy, l.error) &&
           librarySymbol("ep_internode_progress", l.progress, l.error);
    return l;
  }();
  return lib;
}

void check(int rc, const char* what, const char* err) {
  TORCH_CHECK(rc == 0, "ep ", what, ": ", err);
}

// ---- per-group state -----------------------------------------------------------------------

struct GroupState {
  GroupVerdict usability;
  void* runtime = nullptr;
  Capacity capacity;           // of `runtime`
  std::vector<int> node_rank;  // [num_nodes * ranks_per_node]: global rank of (node, local)
  at::Tensor node_rank_index;  // the same, int64 on the device (column gathers)
  int num_nodes = 0;
  int ranks_per_node = 0;
  std::string failure;  // a timeout's message: the transport is unusable from then on
  // Recorded after the kernels of every call: the next call waits for it with a deadline
  // (waitForKernels) before anything else touches the GPU, so that no host wait of this
  // transport is unbounded, even where a kernel hangs in an NVSHMEM call that has no timeout.
  cudaEvent_t done = nullptr;
  std::chrono::steady_clock::time_point launched;
  const char* launched_op = "";
  uint64_t builds = 0;    // runtimes built so far (the rendezvous key of the next build)
  uint64_t launches = 0;  // kernel calls on `runtime`: its sequence number, agreed every call
  uint64_t calls = 0;     // ops of this group on this transport (EP_INTERNODE_TRACE)
};

// ---- diagnosis: EP_INTERNODE_TRACE=1 prints each op's host stages to stderr ----------------

bool tracing() {
  static const bool on = env::equals<env::kInternodeTrace>("1");
  return on;
}

void trace(EPProcessGroup& pg, const GroupState& st, const char* op, const std::string& what) {
  if (!tracing()) return;
  static const auto start = std::chrono::steady_clock::now();
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "[ep internode r%d %9.3fs] #%llu %s: %s\n", pg.getRank(), t,
               static_cast<unsigned long long>(st.calls), op, what.c_str());
  std::fflush(stderr);
}

// Seconds a host waits for the kernels of a call, from their launch: their own waits give up
// after kernel_timeout_s, so beyond this they hang somewhere that has no timeout.
double hostWaitLimit(EPProcessGroup& pg) {
  return 1.5 * pg.options()->kernel_timeout_s + 10.0;
}

void recordLaunch(GroupState& st, cudaStream_t stream, const char* op) {
  if (st.done == nullptr) {
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&st.done, cudaEventDisableTiming));
  }
  C10_CUDA_CHECK(cudaEventRecord(st.done, stream));
  st.launched = std::chrono::steady_clock::now();
  st.launched_op = op;
}

// "" once the kernels of the latest launch have finished; else, after waiting until
// hostWaitLimit past their launch, what they never got past (the runtime's stage marks).
std::string waitForKernels(EPProcessGroup& pg, GroupState& st, const char* op) {
  if (st.done == nullptr) return "";
  const auto limit = std::chrono::duration<double>(hostWaitLimit(pg));
  const auto spin_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(2);
  for (;;) {
    const cudaError_t e = cudaEventQuery(st.done);
    if (e == cudaSuccess) return "";
    if (e != cudaErrorNotReady) {
      (void)cudaGetLastError();
      return std::string("ep ") + op + ": the internode kernels of an earlier " + st.launched_op +
             " failed: " + cudaGetErrorString(e);
    }
    const auto now = std::chrono::steady_clock::now();
    if (now - st.launched > limit) {
      char where[1024] = {0};  // stage marks and the latest wait (InternodeRuntime::progress)
      if (st.runtime != nullptr) library().progress(st.runtime, where, sizeof(where));
      const Topology& t = pg.topology();
      std::ostringstream os;
      os << "ep " << op << ": rank " << pg.getRank() << " (node " << t.node_of_rank[pg.getRank()]
         << ") timed out waiting for its own internode kernels: those of its " << st.launched_op
         << " have not finished " << static_cast<long long>(limit.count())
         << " s after their launch (kernel_timeout_s=" << pg.options()->kernel_timeout_s
         << " bounds every wait for a peer): " << (where[0] != 0 ? where : "no stage recorded")
         << ". A stage that waits for no peer hangs (an NVSHMEM put or nvshmem_quiet, or the GPU)";
      return os.str();
    }
    if (now < spin_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

// Collective (NVSHMEM): frees the runtime's symmetric buffers.
void releaseRuntime(GroupState& st) {
  if (st.runtime == nullptr) return;
  char err[512] = {0};
  cudaDeviceSynchronize();
  if (library().destroy(st.runtime, err, sizeof(err)) != 0) {
    TORCH_WARN("ep: releasing the internode buffers: ", err);
  }
  st.runtime = nullptr;
  st.capacity = Capacity{};
  st.launches = 0;
}

std::shared_ptr<GroupState> stateOf(EPProcessGroup& pg, bool create = true) {
  static auto* states = new GroupStates<GroupState>([](EPProcessGroup*, GroupState& state) {
    if (state.runtime != nullptr) {
      // Parked, not freed here: nvshmem_free waits for every PE with no timeout, and a peer may
      // be dead (ep_backend.abort). The NVSHMEM transport's teardown frees the parked buffers if
      // every rank joins its vote (this hook runs first where this transport set up first),
      // else the next group over the same PEs does (nvshmem::parkCollectiveFree).
      nvshmem::parkCollectiveFree([rt = state.runtime] {
        char err[512] = {0};
        cudaDeviceSynchronize();
        if (library().destroy(rt, err, sizeof(err)) != 0) {
          TORCH_WARN("ep: freeing the internode buffers of a destroyed group: ", err);
        }
      });
      state.runtime = nullptr;
    }
    if (state.done != nullptr) {
      cudaEventDestroy(state.done);
      state.done = nullptr;
    }
  });
  return create ? states->of(pg) : states->find(pg);
}

Verdict decide(EPProcessGroup& pg, GroupState& st, const at::Device& device) {
  const Topology& topology = pg.topology();
  std::string why;
  if (env::equals<env::kHighThroughput>("aten")) {
    return Verdict{"EP_HIGH_THROUGHPUT=aten", true};
  }
  if (topology.num_nodes <= 1) {
    why = "the group is one node (the NVLink transport serves it)";
  } else if (!topology.problem.empty()) {
    why = topology.problem;
  } else if (topology.num_nodes > kMaxNodes) {
    why = "the group spans " + std::to_string(topology.num_nodes) +
          " nodes; the internode kernels serve at most " + std::to_string(kMaxNodes);
  }
  if (why.empty() && !env::equals<env::kHighThroughput>("internode")) {
    // Opt-in until the transport has passed its GPU tests: groups of several nodes keep the
    // ATen path by default.
    why =
        "the internode transport is experimental (not yet validated on GPUs); set "
        "EP_HIGH_THROUGHPUT=internode on every rank to use it";
  }
  if (!why.empty()) {
    return Verdict{why, false};  // topology and environment: the same on every rank
  }
  // The NVSHMEM session is the low-latency transport's: usable only where it is (collective).
  const Verdict ll = nvshmemTransport().usable(pg, device);
  if (!ll.yes()) {
    return Verdict{"NVSHMEM is not usable for this group (" + ll.why_not + ")", false};
  }
  const std::string local = library().ok ? "" : library().error;
  const std::vector<std::string> posted =
      allGatherStrings(pg, "ep_internode/" + pg.options()->group_name + "/decide/",
                       local.empty() ? "1" : "0", "ep dispatch (internode transport setup)");
  for (const std::string& p : posted) {
    if (p != "1") {
      why = local.empty() ? "another rank cannot load the internode kernels" : local;
    }
  }
  if (!why.empty()) return Verdict{why, false};
  st.num_nodes = topology.num_nodes;
  st.ranks_per_node = topology.ranks_per_node;
  st.node_rank.assign(static_cast<size_t>(pg.getSize()), -1);
  for (int r = 0; r < pg.getSize(); ++r) {
    st.node_rank[static_cast<size_t>(topology.node_of_rank[r] * topology.ranks_per_node +
                                     topology.local_rank[r])] = r;
  }
  st.node_rank_index =
      at::tensor(std::vector<int64_t>(st.node_rank.begin(), st.node_rank.end()), at::kLong)
          .to(device);
  return Verdict{};
}

// The error a kernel of an earlier call left ("" when none). Any kernel error is fatal here (a
// timeout leaves peers in unknown states; a capacity error is a bug: the host sized the buffers).
std::string pendingError(GroupState& st, const char* op) {
  if (!st.failure.empty()) return st.failure;
  if (st.runtime == nullptr) return "";
  char msg[1024] = {0};
  int failed = 0;
  if (library().check_error(st.runtime, msg, sizeof(msg), &failed) == 0) return "";
  st.failure = std::string(msg) + " (seen by " + op +
               "; the group's internode transport is unusable from now on: destroy and re-create "
               "the group)";
  return st.failure;
}

// The error an earlier call left, after waiting (bounded) for its kernels: this runs before the
// op touches the GPU (its count copy would wait for them without a deadline).
std::string previousCallError(EPProcessGroup& pg, GroupState& st, const char* op) {
  if (!st.failure.empty()) return st.failure;
  const std::string stuck = waitForKernels(pg, st, op);
  if (!stuck.empty()) {
    st.failure = stuck +
                 " (the group's internode transport is unusable from now on: destroy and "
                 "re-create the group)";
    std::fprintf(stderr, "%s\n", st.failure.c_str());  // the GPU may be hung: say it now
    std::fflush(stderr);
    return st.failure;
  }
  return pendingError(st, op);
}

// The kernels match a call's signals across ranks by the runtime's sequence number (and read
// the buffers of the same runtime generation): each call agrees on both, so that a rank whose
// count went astray raises on every rank instead of reading another call's signals.
void appendSequence(std::vector<int64_t>& payload, const GroupState& st) {
  payload.push_back(static_cast<int64_t>(st.builds));
  payload.push_back(static_cast<int64_t>(st.launches));
}

void checkSequenceAgrees(const at::Tensor& gathered, int64_t column, GroupState& st, const char* op,
                         int64_t rank) {
  auto g = gathered.accessor<int64_t, 2>();
  for (int64_t r = 0; r < gathered.size(0); ++r) {
    if (g[r][column] != static_cast<int64_t>(st.builds) ||
        g[r][column + 1] != static_cast<int64_t>(st.launches)) {
      std::ostringstream os;
      os << "ep " << op << ": the internode kernels are out of step across ranks (rank " << rank
         << ": buffers #" << st.builds << ", call " << st.launches << "; rank " << r
         << ": buffers #" << g[r][column] << ", call " << g[r][column + 1]
         << "); no data moved, and the group's internode transport is unusable from now on (a "
            "bug: report it)";
      st.failure = os.str();
      TORCH_CHECK(false, st.failure);
    }
  }
}

// The counts of this version are agreed on the host (Gloo): nothing of it can be captured. A
// local error, so that the agreement raises it on every rank.
std::string captureError(const char* op) {
  return streamCapturing() ? std::string("ep ") + op +
                                 ": the internode transport cannot run under CUDA graph capture "
                                 "yet (its counts are agreed on the host; docs/internode.md)"
                           : "";
}

// The start of every op of this transport: counts it (EP_INTERNODE_TRACE) and returns the error
// an earlier call left or a CUDA graph capture ("" when none): the op adds its own validation and
// raises the result on every rank through agreeInStep.
std::string beginOp(EPProcessGroup& pg, GroupState& st, const char* op) {
  ++st.calls;
  std::string error = previousCallError(pg, st, op);
  if (error.empty()) error = captureError(op);
  return error;
}

// The op's agreement (agreeAcrossRanks: raises `error` of any rank on every rank) with the
// runtime's build and call number appended to `payload` and checked to match on every rank.
// `what` names the agreement in the trace.
at::Tensor agreeInStep(EPProcessGroup& pg, GroupState& st, const char* op, const std::string& error,
                       const std::vector<AgreedField>& fields, std::vector<int64_t> payload,
                       const std::string& what = "agreeing") {
  const int64_t column = static_cast<int64_t>(payload.size());
  appendSequence(payload, st);
  trace(pg, st, op, what);
  at::Tensor gathered = agreeAcrossRanks(pg, op, error, fields, payload);
  checkSequenceAgrees(gathered, column, st, op, pg.getRank());
  trace(pg, st, op, "agreed");
  return gathered;
}

// Collective: a runtime whose buffers hold `need` (every input agreed across the ranks, so every
// rank decides alike). Growing frees the old buffers, then allocates the new ones, in the
// process's NVSHMEM session (never restarted: nvshmem_session_plan.hpp). The NVSHMEM calls of a
// build (free, malloc) have no timeout: the ranks first meet in the store (bounded by the group's
// timeout, naming a rank that never comes) and check that they build the same buffers, and the
// setup agrees again after each of its steps (nvshmem::agreedSetup), so that a rank never waits
// alone in one of them.
void* ensureRuntime(EPProcessGroup& pg, GroupState& st, const at::Device& device,
                    const Capacity& need, const char* op) {
  if (st.runtime != nullptr && holds(st.capacity, need)) return st.runtime;
  const Capacity cap = grownCapacity(st.capacity, need);
  const std::string mine = describe(cap);
  trace(pg, st, op, "building the internode buffers: " + mine);
  const std::vector<std::string> wanted = allGatherStrings(
      pg,
      "ep_internode/" + pg.options()->group_name + "/build/" + std::to_string(st.builds++) + "/",
      mine, std::string("ep ") + op + " (building the internode buffers)");
  for (size_t r = 0; r < wanted.size(); ++r) {
    TORCH_CHECK(wanted[r] == mine, "ep ", op, ": ranks disagree on the internode buffers (rank ",
                pg.getRank(), ": ", mine, "; rank ", r, ": ", wanted[r],
                "); no data moved (a bug: the sizes come from agreed values)");
  }
  releaseRuntime(st);  // free before malloc: the heap can reuse the space
  const size_t bytes = library().symmetric_bytes(st.num_nodes, st.ranks_per_node, &cap);
  nvshmem::ensureSession(pg, device, bytes);
  InternodeSetup setup;
  setup.rank = pg.getRank();
  setup.num_ranks = pg.getSize();
  setup.device = device.index();
  setup.num_nodes = st.num_nodes;
  setup.ranks_per_node = st.ranks_per_node;
  setup.node_rank = st.node_rank.data();
  setup.capacity = cap;
  setup.num_blocks = static_cast<int>(pg.options()->num_sms);
  // Each rank makes its own buffers, and the ranks agree that all did before any calls
  // nvshmem_malloc (no timeout there); a failure on one rank makes every rank raise.
  const Library& lib = library();
  void* rt = nvshmem::agreedSetup(
      pg,
      "ep_internode/" + pg.options()->group_name + "/setup/" + std::to_string(st.builds - 1) + "/",
      "internode setup", "the next call sets the buffers up again",
      [&](void** made, char* err, size_t err_len) {
        return lib.create(&setup, made, err, err_len);
      },
      lib.connect, lib.abandon);
  st.runtime = rt;
  st.capacity = cap;
  trace(pg, st, op, "built");
  return rt;
}

// Columns [offset, offset + bytes) of the received records as a [rows, bytes / elem] tensor of
// `dtype` (a copy: the records are reused by a later call).
at::Tensor field(const at::Tensor& records, int64_t offset, int64_t bytes, at::ScalarType dtype) {
  if (records.size(0) == 0) {
    return at::empty({0, bytes / static_cast<int64_t>(c10::elementSize(dtype))},
                     records.options().dtype(dtype));
  }
  // clone, not contiguous(): one row is contiguous already, and would stay a view of the buffer.
  return records.narrow(1, offset, bytes).clone(at::MemoryFormat::Contiguous).view(dtype);
}

int64_t maxColumn(const at::Tensor& gathered, int64_t column) {
  return gathered.select(1, column).max().item<int64_t>();
}

int64_t elementBytes(const at::Tensor& t) {
  return static_cast<int64_t>(t.element_size());
}

// Runs the kernels of one (cached) dispatch; returns the received records [rows, n_bytes].
at::Tensor moveRows(EPProcessGroup& pg, GroupState& st, const at::Tensor& x,
                    const std::optional<at::Tensor>& x_scales, const at::Tensor& topk_idx64,
                    const std::optional<at::Tensor>& topk_weights, const Plan& plan,
                    int64_t experts_per_rank, int64_t recv_rows, const at::Tensor& gathered_t,
                    int64_t max_recv, bool cached, InternodeRecvView* view_out) {
  const char* op = cached ? "cached dispatch" : "dispatch";
  const at::Device device = x.device();
  const int64_t x_bytes = x.size(1) * elementBytes(x);
  const int64_t scale_bytes = x_scales ? x_scales->size(1) * elementBytes(*x_scales) : 0;
  const int64_t topk = cached ? 0 : topk_idx64.size(1);
  const Capacity need = dispatchNeed(maxColumn(gathered_t, 0), max_recv, x.size(1), x_bytes,
                                     scale_bytes, topk, st.ranks_per_node);
  void* rt = ensureRuntime(pg, st, device, need, op);
  if (tracing()) {  // the sizes of an empty rank's call, beside its peers' (no string otherwise)
    trace(pg, st, op,
          "buffers #" + std::to_string(st.builds) + " ready; launching call " +
              std::to_string(st.launches + 1) + " (tokens " + std::to_string(x.size(0)) +
              ", rows to receive " + std::to_string(recv_rows) + ", most any rank receives " +
              std::to_string(max_recv) + ")");
  }
  InternodeDispatchArgs a;
  a.x = x.data_ptr();
  a.x_bytes = x_bytes;
  a.x_scales = x_scales ? x_scales->data_ptr() : nullptr;
  a.scale_bytes = scale_bytes;
  a.topk_idx = cached ? nullptr : topk_idx64.data_ptr<int64_t>();
  a.topk_weights = topk_weights ? topk_weights->data_ptr<float>() : nullptr;
  a.topk = static_cast<int>(topk);
  a.dest_slot = plan.dest_slot.data_ptr<int>();
  a.node_pos = plan.node_pos.data_ptr<int>();
  a.node_count = plan.node_count.data_ptr<int>();
  a.num_tokens = static_cast<int>(x.size(0));
  a.experts_per_rank = static_cast<int>(experts_per_rank);
  a.recv_rows = recv_rows;
  a.timeout_seconds = pg.options()->kernel_timeout_s;
  a.cached = cached;
  char err[1024] = {0};
  InternodeRecvView view;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  check(library().dispatch(rt, &a, stream, &view, err, sizeof(err)), op, err);
  ++st.launches;
  recordLaunch(st, stream, op);
  trace(pg, st, op, "launched");
  // A dispatch reads its outputs on the host next (the per-expert counts): it waits here, with a
  // deadline, and raises its own kernel error (a timeout names the stalled peer) rather than the
  // next call. A cached dispatch returns while its kernels run, as a combine does: the next op
  // waits for them (previousCallError).
  if (!cached) {
    const std::string stuck = waitForKernels(pg, st, op);
    if (!stuck.empty()) {
      st.failure = stuck + " (the group's internode transport is unusable from now on)";
      std::fprintf(stderr, "%s\n", st.failure.c_str());  // the GPU may be hung: say it now
      std::fflush(stderr);
      TORCH_CHECK(false, st.failure);
    }
    const std::string failed = pendingError(st, op);
    TORCH_CHECK(failed.empty(), failed);
    trace(pg, st, op, "kernels done");
  }
  *view_out = view;
  return at::from_blob(const_cast<char*>(view.rows), {recv_rows, view.layout.n_bytes},
                       x.options().dtype(at::kByte));
}

// Rows, T and the [src, dst] count matrix agreed, with every rank's T in column R.
at::Tensor countMatrix(const at::Tensor& gathered, int64_t R) {
  return gathered.narrow(1, 0, R).contiguous();
}

}  // namespace

DispatchResult dispatch(EPProcessGroup& pg, const DispatchArgs& a) {
  const int64_t R = pg.getSize();
  const int64_t rank = pg.getRank();
  auto st = stateOf(pg);
  std::string error = beginOp(pg, *st, "dispatch");
  if (error.empty()) error = validateDispatch(a, R);
  if (error.empty() && a.topk_idx.size(1) > kMaxTopk) {
    error = "ep dispatch: the internode kernels take top-k <= 32";
  }
  const bool ok = error.empty();
  at::Tensor is_token_in_rank, send_pos;
  std::vector<int64_t> payload(static_cast<size_t>(R) + 1, 0);
  if (ok) {
    // validateDispatch leaves the values of CUDA topk_idx to the kernels, and these trust them:
    // out-of-range ids are counted here (with the send counts: one copy to the host) and raised on
    // every rank through the agreement; the layout below sees them as -1 (an id >= 2E would index
    // past its columns).
    const at::Tensor invalid = a.topk_idx.lt(-1).logical_or(a.topk_idx.ge(a.num_experts));
    if (a.layout.empty()) {
      LayoutTensors l =
          computeDispatchLayout(a.topk_idx.masked_fill(invalid, -1), a.num_experts, R);
      is_token_in_rank = std::get<2>(l);
      send_pos = std::get<3>(l);
    } else {
      is_token_in_rank = a.layout[2];
      send_pos = a.layout[3];
    }
    std::vector<int64_t> counts =
        toVector(at::cat({is_token_in_rank.sum(0).to(at::kLong), invalid.sum().view({1})}));
    std::copy(counts.begin(), counts.begin() + R, payload.begin());
    payload[static_cast<size_t>(R)] = a.x.size(0);
    if (const int64_t bad = counts[static_cast<size_t>(R)]; bad > 0) {
      const at::Tensor flat = invalid.flatten();
      const int64_t first = flat.to(at::kByte).argmax().item<int64_t>();
      error = "ep dispatch: topk_idx has " + std::to_string(bad) +
              " value(s) outside [-1, num_experts=" + std::to_string(a.num_experts) +
              "), the first " + std::to_string(a.topk_idx.flatten()[first].item<int64_t>()) +
              " at flat position " + std::to_string(first);
    }
  }
  at::Tensor gathered =
      agreeInStep(pg, *st, "dispatch", error, dispatchFields(a, ok), std::move(payload),
                  "agreeing (tokens " + std::to_string(ok ? a.x.size(0) : -1) + ")");
  at::Tensor matrix = countMatrix(gathered, R);
  std::vector<int64_t> recv_counts(R);
  auto m = matrix.accessor<int64_t, 2>();
  for (int64_t s = 0; s < R; ++s) recv_counts[s] = m[s][rank];
  const int64_t num_recv = std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0});
  const int64_t max_recv = maxReceived(matrix);
  TORCH_CHECK(a.num_worst_tokens == 0 || max_recv <= a.num_worst_tokens,
              "ep dispatch: num_worst_tokens=", a.num_worst_tokens,
              " is smaller than the rows a rank receives (up to ", max_recv,
              "); nothing was exchanged");

  const at::Device device = a.x.device();
  c10::cuda::CUDAGuard guard(device);
  const int64_t experts_per_rank = a.num_experts / R;
  const Plan p = makePlan(is_token_in_rank, send_pos, receiveOffsets(matrix, rank),
                          st->node_rank_index, st->num_nodes, st->ranks_per_node);
  const at::Tensor x = a.x.contiguous();
  const std::optional<at::Tensor> scales =
      a.x_scales ? std::optional<at::Tensor>(a.x_scales->contiguous()) : std::nullopt;
  const at::Tensor topk64 = a.topk_idx.to(at::kLong).contiguous();
  const std::optional<at::Tensor> weights =
      a.topk_weights ? std::optional<at::Tensor>(a.topk_weights->contiguous()) : std::nullopt;
  InternodeRecvView view;
  at::Tensor records = moveRows(pg, *st, x, scales, topk64, weights, p, experts_per_rank, num_recv,
                                gathered.narrow(1, R, 1), max_recv, false, &view);
  const RecordLayout& rec = view.layout;
  const int64_t K = a.topk_idx.size(1);
  ReceivedRows rows;
  rows.x = field(records, rec.n_x, rec.x_bytes, x.scalar_type());
  if (scales) rows.x_scales = field(records, rec.n_scales, rec.scale_bytes, scales->scalar_type());
  rows.topk_local = field(records, rec.n_topk, 8 * K, at::kLong);
  if (weights) rows.topk_weights = field(records, rec.n_weights, 4 * K, at::kFloat);
  rows.src_idx = field(records, rec.n_src, 4, at::kInt).reshape({num_recv});
  rows.src_rank = segmentIds(recv_counts, x.options().dtype(at::kInt));
  return finishDispatch(a, std::move(rows), experts_per_rank, is_token_in_rank,
                        toVector(matrix.select(0, rank)),  // what this rank sent, as agreed
                        recv_counts);
}

std::pair<at::Tensor, std::optional<at::Tensor>> cachedDispatch(
    EPProcessGroup& pg, const at::Tensor& x_in, const std::optional<at::Tensor>& x_scales,
    const DispatchRouting& routing) {
  const int64_t R = pg.getSize();
  const int64_t rank = pg.getRank();
  auto st = stateOf(pg);
  std::string error = beginOp(pg, *st, "cached dispatch");
  if (error.empty()) error = validateCachedDispatch(x_in, x_scales, routing, R);
  const bool ok = error.empty();
  std::vector<int64_t> payload =
      ok ? routingCounts(routing, R) : std::vector<int64_t>(static_cast<size_t>(2 * R), 0);
  payload.push_back(ok ? x_in.size(0) : 0);
  at::Tensor gathered = agreeInStep(pg, *st, "cached dispatch", error,
                                    cachedDispatchFields(x_in, x_scales, ok), std::move(payload));
  checkRoutingAgrees("cached dispatch", gathered, 0, rank);
  at::Tensor matrix = countMatrix(gathered, R);
  std::vector<int64_t> recv_counts(R);
  auto m = matrix.accessor<int64_t, 2>();
  for (int64_t s = 0; s < R; ++s) recv_counts[s] = m[s][rank];
  const int64_t num_recv = std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0});

  const at::Device device = x_in.device();
  c10::cuda::CUDAGuard guard(device);
  const at::Tensor& in_rank = routing.is_token_in_rank;
  at::Tensor send_pos =
      at::where(in_rank, in_rank.to(at::kInt).cumsum(0) - 1, -1).to(at::kInt).contiguous();
  const Plan p = makePlan(in_rank.contiguous(), send_pos, receiveOffsets(matrix, rank),
                          st->node_rank_index, st->num_nodes, st->ranks_per_node);
  const at::Tensor x = x_in.contiguous();
  const std::optional<at::Tensor> scales =
      x_scales ? std::optional<at::Tensor>(x_scales->contiguous()) : std::nullopt;
  InternodeRecvView view;
  at::Tensor records = moveRows(pg, *st, x, scales, at::Tensor(), std::nullopt, p, 1, num_recv,
                                gathered.narrow(1, 2 * R, 1), maxReceived(matrix), true, &view);
  const RecordLayout& rec = view.layout;
  const int64_t cap = routing.recv_src_idx.size(0);
  at::Tensor recv_x = padRows(field(records, rec.n_x, rec.x_bytes, x.scalar_type()), cap, 0);
  std::optional<at::Tensor> recv_scales;
  if (scales) {
    recv_scales =
        padRows(field(records, rec.n_scales, rec.scale_bytes, scales->scalar_type()), cap, 0);
  }
  return {recv_x, recv_scales};
}

std::pair<at::Tensor, std::optional<at::Tensor>> combine(EPProcessGroup& pg, const CombineArgs& a) {
  const int64_t R = pg.getSize();
  const int64_t rank = pg.getRank();
  auto st = stateOf(pg);
  std::string error = beginOp(pg, *st, "combine");
  if (error.empty()) error = validateCombine(a, R);
  if (error.empty() && a.topk_weights && a.topk_weights->size(1) > kMaxTopk) {
    error = "ep combine: the internode kernels take top-k <= 32";
  }
  const bool ok = error.empty();
  const bool kernel_dtype =
      ok && (a.x.scalar_type() == at::kBFloat16 || a.x.scalar_type() == at::kFloat);
  std::vector<int64_t> payload =
      ok ? routingCounts(a.routing, R) : std::vector<int64_t>(static_cast<size_t>(2 * R), 0);
  payload.push_back(ok ? a.routing.is_token_in_rank.size(0) : 0);
  payload.push_back(kernel_dtype ? 1 : 0);
  at::Tensor gathered =
      agreeInStep(pg, *st, "combine", error, combineFields(a, ok), std::move(payload));
  checkRoutingAgrees("combine", gathered, 0, rank);
  // x dtype is an agreed field: every rank takes the same path. Other dtypes (float64, half):
  // the ATen path, whose own agreement step every rank then runs too.
  if (gathered.select(1, 2 * R + 1).min().item<int64_t>() == 0) {
    return aten::combine(pg, a);
  }
  const at::Device device = a.x.device();
  c10::cuda::CUDAGuard guard(device);
  const int64_t num_tokens = a.routing.is_token_in_rank.size(0);
  const int64_t hidden = a.x.size(1);
  const int64_t K = a.topk_weights ? a.topk_weights->size(1) : 0;
  // Rows this rank holds: what every source sent it (checkRoutingAgrees tied both ends).
  const int64_t num_valid = countMatrix(gathered, R).select(1, rank).sum().item<int64_t>();
  const int64_t elem = a.x.scalar_type() == at::kBFloat16 ? 2 : 4;
  const Capacity need = combineNeed(maxColumn(gathered, 2 * R), hidden, elem, K);
  void* rt = ensureRuntime(pg, *st, device, need, "combine");
  if (tracing()) {
    trace(pg, *st, "combine",
          "buffers #" + std::to_string(st->builds) + " ready; launching call " +
              std::to_string(st->launches + 1) + " (tokens " + std::to_string(num_tokens) +
              ", rows held " + std::to_string(num_valid) + ")");
  }

  const at::Tensor x = a.x.narrow(0, 0, num_valid).contiguous();
  const std::optional<at::Tensor> weights =
      a.topk_weights
          ? std::optional<at::Tensor>(a.topk_weights->narrow(0, 0, num_valid).contiguous())
          : std::nullopt;
  const at::Tensor src_rank =
      a.routing.recv_src_rank.narrow(0, 0, num_valid).to(at::kInt).contiguous();
  const at::Tensor src_idx =
      a.routing.recv_src_idx.narrow(0, 0, num_valid).to(at::kInt).contiguous();
  const at::Tensor in_rank = a.routing.is_token_in_rank.contiguous();
  // Biases are added in float32 (the reference casts them to its float32 accumulator).
  std::optional<at::Tensor> b0, b1;
  if (a.bias0) b0 = a.bias0->to(device, at::kFloat).contiguous();
  if (a.bias1) b1 = a.bias1->to(device, at::kFloat).contiguous();
  at::Tensor out = at::empty({num_tokens, hidden}, a.x.options());
  std::optional<at::Tensor> out_w;
  if (weights) out_w = at::empty({num_tokens, K}, a.x.options().dtype(at::kFloat));

  InternodeCombineArgs c;
  c.x = x.data_ptr();
  c.x_dtype = elem == 2 ? 0 : 1;
  c.hidden = static_cast<int>(hidden);
  c.num_rows = static_cast<int>(num_valid);
  c.topk_weights = weights ? weights->data_ptr<float>() : nullptr;
  c.topk = static_cast<int>(K);
  c.recv_src_rank = src_rank.data_ptr<int>();
  c.recv_src_idx = src_idx.data_ptr<int>();
  c.is_token_in_rank = in_rank.data_ptr<bool>();
  c.num_tokens = static_cast<int>(num_tokens);
  c.bias0 = b0 ? b0->data_ptr<float>() : nullptr;
  c.bias1 = b1 ? b1->data_ptr<float>() : nullptr;
  c.out = out.data_ptr();
  c.out_weights = out_w ? out_w->data_ptr<float>() : nullptr;
  c.timeout_seconds = pg.options()->kernel_timeout_s;
  char err[1024] = {0};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  check(library().combine(rt, &c, stream, err, sizeof(err)), "combine", err);
  ++st->launches;
  // No host wait here (combine returns while its kernels run): the next op waits for them.
  recordLaunch(*st, stream, "combine");
  trace(pg, *st, "combine", "launched");
  return {out, out_w};
}

namespace {

// The internode transport behind the Transport interface (backend/transport.hpp).
class InternodeTransport final : public PerGroupTransport<GroupState> {
 public:
  TransportKind kind() const override { return TransportKind::kInternode; }
  bool serves(OpFamily family) const override { return family == OpFamily::kHighThroughput; }
  // The layout op takes no group: the NVLink transport's layout kernel (up to its rank limit)
  // or ATen's serve every group; this transport adds none.
  DispatchResult dispatch(EPProcessGroup& pg, const DispatchArgs& args, DeferredCounts*) override {
    return internode::dispatch(pg, args);
  }
  std::pair<at::Tensor, std::optional<at::Tensor>> cachedDispatch(
      EPProcessGroup& pg, const at::Tensor& x, const std::optional<at::Tensor>& x_scales,
      const DispatchRouting& routing) override {
    return internode::cachedDispatch(pg, x, x_scales, routing);
  }
  std::pair<at::Tensor, std::optional<at::Tensor>> combine(EPProcessGroup& pg,
                                                           const CombineArgs& args) override {
    return internode::combine(pg, args);
  }
  std::string takePendingError(EPProcessGroup& pg, const char* op) override {
    return pendingError(*internode::stateOf(pg), op);
  }

 private:
  std::shared_ptr<GroupState> stateOf(EPProcessGroup& pg) override {
    return internode::stateOf(pg);
  }
  std::shared_ptr<GroupState> findState(EPProcessGroup& pg) override {
    return internode::stateOf(pg, /*create=*/false);
  }
  Verdict decide(EPProcessGroup& pg, GroupState& st, const at::Device& device) override {
    return internode::decide(pg, st, device);
  }
};

}  // namespace
}  // namespace ep::internode

namespace ep {

Transport& internodeTransport() {
  static internode::InternodeTransport transport;
  return transport;
}

}  // namespace ep

#endif  // EP_WITH_CUDA
