// The internode transport: high-throughput dispatch, cached dispatch and combine of a group that
// spans several nodes (real hosts, or nodes emulated with Options.ranks_per_node), through the
// hierarchical kernels of cuda/internode_kernels.cu (RDMA leg by NVSHMEM puts to the rank with
// the same local index on each node, NVLink leg inside the node; docs/internode.md).
//
// Per call: the host agreement (validation, shapes, call numbers) all-gathers its rows on the GPU
// once the group's buffers exist (cuda/row_exchange.hpp, installed as the group's RowGather: no
// TCP round trip per call); a dispatch's counts are notified on the GPU, and the host reads them
// only to size its outputs (never with num_worst_tokens, which is graph-capturable). The kernels
// run in libep_nvshmem.so (dlsym'd here) on the NVSHMEM session of the group's low-latency
// runtime.
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
#include "backend/row_gather.hpp"
#include "backend/store_exchange.hpp"
#include "backend/stream_capture.hpp"
#include "common/env.hpp"
#include "transports/aten/aten_transport.hpp"
#include "transports/internode/cuda/internode_capi.h"
#include "transports/internode/cuda/internode_runtime.hpp"
#include "transports/internode/cuda/row_exchange.hpp"
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
  ep_internode_notify_fn notify = nullptr;
  ep_internode_notify_counts_fn notify_counts = nullptr;
  ep_internode_take_rejection_fn take_rejection = nullptr;
  ep_internode_dispatch_fn dispatch = nullptr;
  ep_internode_combine_fn combine = nullptr;
  ep_internode_check_error_fn check_error = nullptr;
  ep_internode_destroy_fn destroy = nullptr;
  ep_internode_progress_fn progress = nullptr;
  ep_row_exchange_symmetric_bytes_fn exchange_bytes = nullptr;
  ep_row_exchange_create_fn exchange_create = nullptr;
  ep_row_exchange_connect_fn exchange_connect = nullptr;
  ep_row_exchange_abandon_fn exchange_abandon = nullptr;
  ep_row_exchange_gather_fn exchange_gather = nullptr;
  ep_row_exchange_destroy_fn exchange_destroy = nullptr;
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
           librarySymbol("ep_internode_notify", l.notify, l.error) &&
           librarySymbol("ep_internode_notify_counts", l.notify_counts, l.error) &&
           librarySymbol("ep_internode_take_rejection", l.take_rejection, l.error) &&
           librarySymbol("ep_internode_dispatch", l.dispatch, l.error) &&
           librarySymbol("ep_internode_combine", l.combine, l.error) &&
           librarySymbol("ep_internode_check_error", l.check_error, l.error) &&
           librarySymbol("ep_internode_destroy", l.destroy, l.error) &&
           librarySymbol("ep_internode_progress", l.progress, l.error) &&
           librarySymbol("ep_row_exchange_symmetric_bytes", l.exchange_bytes, l.error) &&
           librarySymbol("ep_row_exchange_create", l.exchange_create, l.error) &&
           librarySymbol("ep_row_exchange_connect", l.exchange_connect, l.error) &&
           librarySymbol("ep_row_exchange_abandon", l.exchange_abandon, l.error) &&
           librarySymbol("ep_row_exchange_gather", l.exchange_gather, l.error) &&
           librarySymbol("ep_row_exchange_destroy", l.exchange_destroy, l.error);
    return l;
  }();
  return lib;
}

void check(int rc, const char* what, const char* err) {
  TORCH_CHECK(rc == 0, "ep ", what, ": ", err);
}

// ---- the agreement's rows on the GPU --------------------------------------------------------

// The group's row exchange (null until made, and again once the group is torn down).
struct ExchangeHandle {
  void* exchange = nullptr;
};

// The group's agreement rows through its row exchange (backend/row_gather.hpp).
class DeviceRowGather final : public RowGather {
 public:
  explicit DeviceRowGather(std::shared_ptr<ExchangeHandle> handle) : handle_(std::move(handle)) {}
  const char* name() const override { return "nvshmem"; }
  bool fits(int64_t width) const override { return width <= RowExchange::kMaxWidth; }
  std::string gather(const std::vector<int64_t>& row, int64_t* out,
                     std::chrono::milliseconds timeout) override {
    TORCH_CHECK(handle_->exchange != nullptr, "the group's agreement exchange was released");
    char missing[256] = {0};
    char err[1024] = {0};
    const double seconds = static_cast<double>(timeout.count()) / 1000.0;
    TORCH_CHECK(
        library().exchange_gather(handle_->exchange, row.data(), static_cast<int>(row.size()),
                                  seconds, out, missing, sizeof(missing), err, sizeof(err)) == 0,
        err);
    return missing;
  }

 private:
  std::shared_ptr<ExchangeHandle> handle_;
};

// ---- per-group state -----------------------------------------------------------------------

struct GroupState {
  GroupVerdict usability;
  void* runtime = nullptr;
  Capacity capacity;           // of `runtime`
  std::vector<int> node_rank;  // [num_nodes * ranks_per_node]: global rank of (node, local)
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
  // A CUDA graph captured this transport's kernels on `runtime`: its buffers may not be freed
  // or moved from then on (the graph keeps their addresses).
  bool captured = false;
  // The agreement's row exchange, made with the first buffers (null: not made, or its setup
  // failed on some rank and the agreement stays on Gloo).
  std::shared_ptr<ExchangeHandle> exchange;
  bool exchange_tried = false;
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
  std::fprintf(stderr, "[ep internode r%d %11.6fs] #%llu %s: %s\n", pg.getRank(), t,
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
    if (state.exchange != nullptr && state.exchange->exchange != nullptr) {
      nvshmem::parkCollectiveFree([ex = state.exchange->exchange] {
        char err[512] = {0};
        if (library().exchange_destroy(ex, err, sizeof(err)) != 0) {
          TORCH_WARN("ep: freeing the internode agreement exchange of a destroyed group: ", err);
        }
      });
      state.exchange->exchange = nullptr;
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

// A worst-case call the notify rejected (its kernels moved nothing, its outputs are padding):
// every rank's notify saw the same counts, so every rank raises it at its next op. "" when none.
std::string takeRejection(GroupState& st, const char* op) {
  if (st.runtime == nullptr) return "";
  char msg[512] = {0};
  library().take_rejection(st.runtime, msg, sizeof(msg));
  if (msg[0] == 0) return "";
  return std::string("ep ") + op +
         ": an earlier worst-case internode dispatch (num_worst_tokens) moved nothing and returned "
         "padding only: " +
         msg + " (reported by the next call; the group stays usable)";
}

// A dispatch without num_worst_tokens sizes its outputs on the host from the counts: it cannot
// be captured. A local error, so that the agreement raises it on every rank.
std::string captureError(const char* op, bool host_sized) {
  return host_sized && streamCapturing()
             ? std::string("ep ") + op +
                   ": under CUDA graph capture the internode transport needs num_worst_tokens "
                   "(without it the outputs are sized on the host from the counts)"
             : "";
}

// The start of every op of this transport: counts it (EP_INTERNODE_TRACE) and returns the error
// an earlier call left, a rejected worst-case call, or a capture it cannot serve ("" when none):
// the op adds its own validation and raises the result on every rank through agreeInStep.
std::string beginOp(EPProcessGroup& pg, GroupState& st, const char* op, bool host_sized = false) {
  ++st.calls;
  // While capturing, nothing may wait for the GPU; a capture follows eager calls (the buffers
  // must exist), whose kernels the first call after the capture waits for.
  std::string error = streamCapturing() ? pendingError(st, op) : previousCallError(pg, st, op);
  if (error.empty()) error = takeRejection(st, op);
  if (error.empty()) error = captureError(op, host_sized);
  return error;
}

// After the launches of an op: a captured op's kernels are the graph's (no event to wait for).
void launched(GroupState& st, cudaStream_t stream, const char* op) {
  ++st.launches;
  if (streamCapturing()) {
    st.captured = true;
  } else {
    recordLaunch(st, stream, op);
  }
}

AgreedField captureField() {
  return {"CUDA graph capture of the call", streamCapturing() ? 1 : 0};
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

// The agreement of an op on a dispatch's handle (combine, cached dispatch): `extra` after the
// handle's counts ([2R]: what this rank sent to and received from each rank), checked to match
// across ranks. The counts are read on the host (a stream sync) except while capturing, where
// nothing may be read and the kernels trust the handle.
at::Tensor agreeOnHandle(EPProcessGroup& pg, GroupState& st, const char* op,
                         const std::string& error, std::vector<AgreedField> fields,
                         const DispatchRouting& routing, const std::vector<int64_t>& extra) {
  const int64_t R = pg.getSize();
  const bool capturing = streamCapturing();
  std::vector<int64_t> payload = error.empty() && !capturing
                                     ? routingCounts(routing, R)
                                     : std::vector<int64_t>(static_cast<size_t>(2 * R), 0);
  payload.insert(payload.end(), extra.begin(), extra.end());
  fields.push_back(captureField());
  at::Tensor gathered = agreeInStep(pg, st, op, error, fields, std::move(payload));
  if (!capturing) checkRoutingAgrees(op, gathered, 0, pg.getRank());
  return gathered;
}

// Collective, once per group, after its first buffers: the row exchange that carries the group's
// agreements from then on. A setup that fails on some rank fails on every rank alike
// (agreedSetup), and the agreement then stays on Gloo.
void ensureExchange(EPProcessGroup& pg, GroupState& st, const at::Device& device) {
  if (st.exchange_tried) return;
  st.exchange_tried = true;
  RowExchangeSetup setup;
  setup.rank = pg.getRank();
  setup.num_ranks = pg.getSize();
  setup.device = device.index();
  const Library& lib = library();
  void* ex = nullptr;
  try {
    ex = nvshmem::agreedSetup(
        pg, "ep_internode/" + pg.options()->group_name + "/exchange/", "internode agreement setup",
        "the per-call agreement goes through Gloo",
        [&](void** made, char* err, size_t err_len) {
          return lib.exchange_create(&setup, made, err, err_len);
        },
        lib.exchange_connect, lib.exchange_abandon);
  } catch (const std::exception& e) {
    TORCH_WARN(
        "ep: the internode agreement exchange could not be set up; the per-call "
        "agreement goes through Gloo: ",
        e.what());
    return;
  }
  st.exchange = std::make_shared<ExchangeHandle>(ExchangeHandle{ex});
  useRowGather(pg, std::make_shared<DeviceRowGather>(st.exchange));
  trace(pg, st, "setup", "the agreement goes through the GPU from now on");
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
  // Every input of `need` is agreed: every rank raises alike.
  TORCH_CHECK(!streamCapturing() && !st.captured, "ep ", op,
              ": the internode buffers must grow (to ", mine, ") but ",
              streamCapturing() ? "the stream is being captured into a CUDA graph"
                                : "a CUDA graph holds their addresses",
              "; run the largest call once eagerly before capturing. Nothing was exchanged");
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
  const size_t exchange_bytes = st.exchange_tried ? 0 : library().exchange_bytes(pg.getSize());
  nvshmem::ensureSession(pg, device, bytes + exchange_bytes);
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
  ensureExchange(pg, st, device);
  return rt;
}

int64_t maxColumn(const at::Tensor& gathered, int64_t column) {
  return gathered.select(1, column).max().item<int64_t>();
}

int64_t elementBytes(const at::Tensor& t) {
  return static_cast<int64_t>(t.element_size());
}

// What a notify leaves on the device (int32): offsets [R] (rows of lower source ranks at each
// receiver), recv_counts [R], num_recv [1], and the plan of this rank's rows.
struct Notified {
  at::Tensor offsets;
  at::Tensor recv_counts;
  at::Tensor num_recv;
  at::Tensor recv_per_expert;  // a dispatch's: int32 [E / R], rows per local expert, aligned
  Plan plan;
  uint64_t ticket = 0;
};

// The routing a dispatch's notify checks and counts: int64 [T, K] global expert ids and the
// layout's tokens per expert (int32 [E]), E and the expert alignment (undefined tensors for a
// cached dispatch, whose handle was checked when it was made).
struct Routing {
  at::Tensor topk_idx64;
  at::Tensor per_expert;
  int64_t num_experts = 0;
  int64_t expert_alignment = 1;
};

// Enqueues the count exchange of a (cached) dispatch on `rt`, and the plan of this rank's rows
// behind it. per_rank: int32 [R] rows this rank sends to each rank; in_rank: bool [T, R] and
// send_pos: int32 [T, R] (contiguous) of the layout; the notify counts `routing`'s out-of-range
// ids into its row; limit > 0 rejects a call where a rank receives more rows (recorded for the
// next op when `report`).
Notified notify(EPProcessGroup& pg, GroupState& st, void* rt, const at::Tensor& per_rank,
                const at::Tensor& in_rank, const at::Tensor& send_pos, const Routing& routing,
                int64_t num_tokens, int64_t limit, bool report, cudaStream_t stream,
                const char* op) {
  const int64_t R = pg.getSize();
  const auto i32 = per_rank.options().dtype(at::kInt);
  at::Tensor words = at::empty({2 * R + 1}, i32);
  Notified n;
  n.offsets = words.narrow(0, 0, R);
  n.recv_counts = words.narrow(0, R, R);
  n.num_recv = words.narrow(0, 2 * R, 1);
  n.plan.dest_slot = at::empty({num_tokens, R}, i32);
  n.plan.node_pos = at::empty({num_tokens, st.num_nodes}, i32);
  n.plan.node_count = at::empty({st.num_nodes}, i32);
  const at::Tensor sent = per_rank.to(at::kInt).contiguous();
  InternodeNotifyArgs a;
  a.per_rank = sent.data_ptr<int>();
  a.is_token_in_rank = in_rank.data_ptr<bool>();
  a.send_pos = send_pos.data_ptr<int>();
  a.dest_slot = n.plan.dest_slot.data_ptr<int>();
  a.node_pos = n.plan.node_pos.data_ptr<int>();
  a.node_count = n.plan.node_count.data_ptr<int>();
  if (routing.topk_idx64.defined()) {
    a.topk_idx = routing.topk_idx64.data_ptr<int64_t>();
    a.num_topk = static_cast<int>(routing.topk_idx64.size(1));
    a.num_experts = static_cast<int>(routing.num_experts);
    n.recv_per_expert = at::empty({routing.num_experts / R}, i32);
    a.per_expert = routing.per_expert.data_ptr<int>();
    a.experts_per_rank = static_cast<int>(routing.num_experts / R);
    a.expert_alignment = static_cast<int>(routing.expert_alignment);
    a.recv_per_expert = n.recv_per_expert.data_ptr<int>();
  }
  a.num_tokens = static_cast<int>(num_tokens);
  a.limit = limit;
  a.report_rejection = report;
  a.offsets = n.offsets.data_ptr<int>();
  a.recv_counts = n.recv_counts.data_ptr<int>();
  a.num_recv = n.num_recv.data_ptr<int>();
  a.timeout_seconds = pg.options()->kernel_timeout_s;
  char err[1024] = {0};
  check(library().notify(rt, &a, stream, &n.ticket, err, sizeof(err)), op, err);
  trace(pg, st, op, "notify launched");
  return n;
}

// The [R, R + 2] count rows of the notify `ticket` (count_columns), and into `per_expert` the rows
// this rank receives per local expert, after a wait bounded as the kernels' (a failed notify
// finishes too; its error is raised here).
std::vector<int64_t> waitForCounts(EPProcessGroup& pg, GroupState& st, uint64_t ticket,
                                   std::vector<int64_t>& per_expert, const char* op) {
  const int64_t R = pg.getSize();
  std::vector<int64_t> rows(static_cast<size_t>(R * count_columns(R)));
  const auto start = std::chrono::steady_clock::now();
  const auto limit = std::chrono::duration<double>(hostWaitLimit(pg));
  const auto spin_until = start + std::chrono::milliseconds(2);
  while (library().notify_counts(st.runtime, ticket, rows.data(), per_expert.data(),
                                 static_cast<int>(per_expert.size())) == 0) {
    const auto now = std::chrono::steady_clock::now();
    if (now - start > limit) {
      char where[1024] = {0};
      library().progress(st.runtime, where, sizeof(where));
      st.failure = std::string("ep ") + op + ": rank " + std::to_string(pg.getRank()) +
                   " timed out waiting for its internode count exchange: " +
                   (where[0] != 0 ? where : "no stage recorded") +
                   " (the group's internode transport is unusable from now on)";
      std::fprintf(stderr, "%s\n", st.failure.c_str());
      std::fflush(stderr);
      TORCH_CHECK(false, st.failure);
    }
    if (now < spin_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  const std::string failed = pendingError(st, op);
  TORCH_CHECK(failed.empty(), failed);
  trace(pg, st, op, "counts read");
  return rows;
}

// Outputs of one (cached) dispatch, written by the unpack kernel: `rows` rows, the received ones
// then padding.
struct Outputs {
  at::Tensor x;
  std::optional<at::Tensor> x_scales;
  at::Tensor topk_local;  // int64 [rows, K] (not for a cached dispatch)
  std::optional<at::Tensor> topk_weights;
  at::Tensor src_idx;   // int32 [rows]
  at::Tensor src_rank;  // int32 [rows]
};

// Runs the kernels of one (cached) dispatch after its notify, into fresh outputs of `rows` rows.
Outputs moveRows(EPProcessGroup& pg, GroupState& st, void* rt, const at::Tensor& x,
                 const std::optional<at::Tensor>& x_scales, const at::Tensor& topk_idx64,
                 const std::optional<at::Tensor>& topk_weights, const Plan& plan,
                 const Notified& counts, int64_t experts_per_rank, int64_t rows, bool cached,
                 cudaStream_t stream) {
  const char* op = cached ? "cached dispatch" : "dispatch";
  const int64_t K = cached ? 0 : topk_idx64.size(1);
  Outputs out;
  out.x = at::empty({rows, x.size(1)}, x.options());
  if (x_scales) out.x_scales = at::empty({rows, x_scales->size(1)}, x_scales->options());
  if (!cached) {
    out.topk_local = at::empty({rows, K}, x.options().dtype(at::kLong));
    if (topk_weights) out.topk_weights = at::empty({rows, K}, x.options().dtype(at::kFloat));
    out.src_idx = at::empty({rows}, x.options().dtype(at::kInt));
    out.src_rank = at::empty({rows}, x.options().dtype(at::kInt));
  }
  if (tracing()) {
    trace(pg, st, op,
          "buffers #" + std::to_string(st.builds) + " ready; launching call " +
              std::to_string(st.launches + 1) + " (tokens " + std::to_string(x.size(0)) +
              ", output rows " + std::to_string(rows) + ")");
  }
  InternodeDispatchArgs a;
  a.x = x.data_ptr();
  a.x_bytes = x.size(1) * elementBytes(x);
  a.x_scales = x_scales ? x_scales->data_ptr() : nullptr;
  a.scale_bytes = x_scales ? x_scales->size(1) * elementBytes(*x_scales) : 0;
  a.topk_idx = cached ? nullptr : topk_idx64.data_ptr<int64_t>();
  a.topk_weights = topk_weights ? topk_weights->data_ptr<float>() : nullptr;
  a.topk = static_cast<int>(K);
  a.dest_slot = plan.dest_slot.data_ptr<int>();
  a.node_pos = plan.node_pos.data_ptr<int>();
  a.node_count = plan.node_count.data_ptr<int>();
  a.num_tokens = static_cast<int>(x.size(0));
  a.experts_per_rank = static_cast<int>(experts_per_rank);
  a.recv_counts = counts.recv_counts.data_ptr<int>();
  a.num_recv = counts.num_recv.data_ptr<int>();
  a.out_rows = rows;
  a.out_x = out.x.data_ptr();
  a.out_scales = out.x_scales ? out.x_scales->data_ptr() : nullptr;
  if (!cached) {
    a.out_topk = out.topk_local.data_ptr<int64_t>();
    a.out_weights = out.topk_weights ? out.topk_weights->data_ptr<float>() : nullptr;
    a.out_src_idx = out.src_idx.data_ptr<int>();
    a.out_src_rank = out.src_rank.data_ptr<int>();
  }
  a.timeout_seconds = pg.options()->kernel_timeout_s;
  a.num_blocks = static_cast<int>(pg.options()->num_sms);  // per call: settable live
  a.cached = cached;
  char err[1024] = {0};
  check(library().dispatch(rt, &a, stream, err, sizeof(err)), op, err);
  launched(st, stream, op);
  trace(pg, st, op, "launched");
  return out;
}

// The out-of-range top-k ids of this rank, as the message it raises.
std::string invalidIdsMessage(const at::Tensor& topk_idx, int64_t num_experts) {
  const at::Tensor flat = topk_idx.lt(-1).logical_or(topk_idx.ge(num_experts)).flatten();
  const int64_t bad = flat.sum().item<int64_t>();
  const int64_t first = flat.to(at::kByte).argmax().item<int64_t>();
  return "ep dispatch: topk_idx has " + std::to_string(bad) +
         " value(s) outside [-1, num_experts=" + std::to_string(num_experts) + "), the first " +
         std::to_string(topk_idx.flatten()[first].item<int64_t>()) + " at flat position " +
         std::to_string(first) + "; nothing was exchanged";
}

}  // namespace

DispatchResult dispatch(EPProcessGroup& pg, const DispatchArgs& a) {
  const int64_t R = pg.getSize();
  const int64_t rank = pg.getRank();
  const int64_t cols = count_columns(R);
  const bool worst = a.num_worst_tokens > 0;
  auto st = stateOf(pg);
  std::string error = beginOp(pg, *st, "dispatch", /*host_sized=*/!worst);
  if (error.empty()) error = validateDispatch(a, R);
  if (error.empty() && a.topk_idx.size(1) > kMaxTopk) {
    error = "ep dispatch: the internode kernels take top-k <= 32";
  }
  std::vector<AgreedField> fields = dispatchFields(a, error.empty());
  fields.push_back(captureField());
  at::Tensor gathered =
      agreeInStep(pg, *st, "dispatch", error, fields, {error.empty() ? a.x.size(0) : 0},
                  "agreeing (tokens " + std::to_string(error.empty() ? a.x.size(0) : -1) + ")");
  const at::Device device = a.x.device();
  c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  // The kernels trust topk_idx: out-of-range ids count as -1 in the layout, and the notify
  // counts them and rejects the call on every rank if any rank had one.
  at::Tensor per_rank, per_expert, is_token_in_rank, send_pos;
  if (a.layout.empty()) {
    LayoutTensors l = layoutTransport(R).layoutIgnoringInvalid(a.topk_idx, a.num_experts, R);
    per_rank = std::get<0>(l);
    per_expert = std::get<1>(l);
    is_token_in_rank = std::get<2>(l);
    send_pos = std::get<3>(l);
  } else {
    per_rank = a.layout[0];
    per_expert = a.layout[1].to(at::kInt).contiguous();
    is_token_in_rank = a.layout[2].contiguous();
    send_pos = a.layout[3].contiguous();
  }
  const int64_t experts_per_rank = a.num_experts / R;
  const int64_t max_tokens = maxColumn(gathered, 0);
  const int64_t K = a.topk_idx.size(1);
  const at::Tensor x = a.x.contiguous();
  const std::optional<at::Tensor> scales =
      a.x_scales ? std::optional<at::Tensor>(a.x_scales->contiguous()) : std::nullopt;
  const int64_t x_bytes = x.size(1) * elementBytes(x);
  const int64_t scale_bytes = scales ? scales->size(1) * elementBytes(*scales) : 0;
  // Received rows the buffers hold: num_worst_tokens; else what they hold already, at least
  // T x min(R, K) (a balanced routing's), grown below if the counts need more.
  const int64_t first_guess = std::max(st->capacity.max_recv_rows, max_tokens * std::min(R, K));
  Capacity need = dispatchNeed(max_tokens, worst ? a.num_worst_tokens : first_guess, x.size(1),
                               x_bytes, scale_bytes, K, st->ranks_per_node, experts_per_rank);
  void* rt = ensureRuntime(pg, *st, device, need, "dispatch");
  const at::Tensor topk64 = a.topk_idx.to(at::kLong).contiguous();
  const Routing routing{topk64, per_expert, a.num_experts, a.expert_alignment};
  Notified counts = notify(pg, *st, rt, per_rank, is_token_in_rank, send_pos, routing, a.x.size(0),
                           worst ? a.num_worst_tokens : 0, worst, stream, "dispatch");
  std::vector<int64_t> expert_counts(static_cast<size_t>(experts_per_rank));
  int64_t rows = a.num_worst_tokens;
  if (!worst) {
    std::vector<int64_t> m = waitForCounts(pg, *st, counts.ticket, expert_counts, "dispatch");
    // Every rank read the same rows: every rank raises alike, and no kernel moved anything.
    std::vector<int64_t> bad;
    for (int64_t s = 0; s < R; ++s) {
      if (m[static_cast<size_t>(s * cols + R + kCountInvalid)] > 0) bad.push_back(s);
    }
    if (!bad.empty()) {
      ++st->launches;  // the notify ran on every rank
      if (std::find(bad.begin(), bad.end(), rank) != bad.end()) {
        TORCH_CHECK(false, invalidIdsMessage(a.topk_idx, a.num_experts));
      }
      raiseRejectedBy("dispatch", bad);
    }
    const at::Tensor matrix = at::from_blob(m.data(), {R, cols}, at::kLong).narrow(1, 0, R);
    rows = 0;
    for (int64_t s = 0; s < R; ++s) rows += m[static_cast<size_t>(s * cols + rank)];
    if (const int64_t max_recv = maxReceived(matrix); max_recv > st->capacity.max_recv_rows) {
      // Larger receive buffers (every rank saw the same counts: the same rebuild), and the
      // exchange again on them: the same results, under the new buffers' call number. No host
      // wait for it: a failed notify makes the kernels move nothing and the next op raise.
      need.max_recv_rows = max_recv;
      rt = ensureRuntime(pg, *st, device, need, "dispatch");
      counts = notify(pg, *st, rt, per_rank, is_token_in_rank, send_pos, routing, a.x.size(0), 0,
                      false, stream, "dispatch");
    }
  }
  const std::optional<at::Tensor> weights =
      a.topk_weights ? std::optional<at::Tensor>(a.topk_weights->contiguous()) : std::nullopt;
  Outputs out = moveRows(pg, *st, rt, x, scales, topk64, weights, counts.plan, counts,
                         experts_per_rank, rows, false, stream);
  ReceivedRows received;
  received.x = std::move(out.x);
  received.x_scales = std::move(out.x_scales);
  received.topk_local = std::move(out.topk_local);
  received.topk_weights = std::move(out.topk_weights);
  received.src_idx = std::move(out.src_idx);
  received.src_rank = std::move(out.src_rank);
  // The per-expert counts came with the notify: the host returns while the kernels run (the next
  // op of this transport waits for them with a deadline, and raises their error if any).
  ExpertCounts per_local_expert;
  per_local_expert.device = counts.recv_per_expert;
  if (!worst) per_local_expert.host = at::tensor(expert_counts, at::kLong);
  // The routing's counts are the device's (copies: per_rank may be the caller's layout,
  // recv_counts a view of the notify's words): a copy from the host would wait for the kernels.
  DispatchResult result = finishDispatch(a, std::move(received), is_token_in_rank, per_rank.clone(),
                                         counts.recv_counts.clone(), std::move(per_local_expert));
  trace(pg, *st, "dispatch", "outputs ready");
  return result;
}

std::pair<at::Tensor, std::optional<at::Tensor>> cachedDispatch(
    EPProcessGroup& pg, const at::Tensor& x_in, const std::optional<at::Tensor>& x_scales,
    const DispatchRouting& routing) {
  const int64_t R = pg.getSize();
  auto st = stateOf(pg);
  std::string error = beginOp(pg, *st, "cached dispatch");
  if (error.empty()) error = validateCachedDispatch(x_in, x_scales, routing, R);
  const bool ok = error.empty();
  const at::Tensor gathered =
      agreeOnHandle(pg, *st, "cached dispatch", error, cachedDispatchFields(x_in, x_scales, ok),
                    routing, {ok ? x_in.size(0) : 0, ok ? routing.recv_src_idx.size(0) : 0});

  const at::Device device = x_in.device();
  c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const at::Tensor x = x_in.contiguous();
  const std::optional<at::Tensor> scales =
      x_scales ? std::optional<at::Tensor>(x_scales->contiguous()) : std::nullopt;
  const int64_t x_bytes = x.size(1) * elementBytes(x);
  const int64_t scale_bytes = scales ? scales->size(1) * elementBytes(*scales) : 0;
  const Capacity need = dispatchNeed(maxColumn(gathered, 2 * R), maxColumn(gathered, 2 * R + 1),
                                     x.size(1), x_bytes, scale_bytes, 0, st->ranks_per_node, 0);
  void* rt = ensureRuntime(pg, *st, device, need, "cached dispatch");
  const at::Tensor in_rank = routing.is_token_in_rank.contiguous();
  const at::Tensor send_pos = positionsInColumns(in_rank);
  const Notified counts = notify(pg, *st, rt, routing.num_tokens_per_rank, in_rank, send_pos,
                                 Routing{}, x.size(0), 0, false, stream, "cached dispatch");
  // The handle's rows: the received ones, then padding (a num_worst_tokens handle).
  Outputs out = moveRows(pg, *st, rt, x, scales, at::Tensor(), std::nullopt, counts.plan, counts, 1,
                         routing.recv_src_idx.size(0), true, stream);
  return {out.x, out.x_scales};
}

std::pair<at::Tensor, std::optional<at::Tensor>> combine(EPProcessGroup& pg, const CombineArgs& a) {
  const int64_t R = pg.getSize();
  auto st = stateOf(pg);
  std::string error = beginOp(pg, *st, "combine");
  if (error.empty()) error = validateCombine(a, R);
  if (error.empty() && a.topk_weights && a.topk_weights->size(1) > kMaxTopk) {
    error = "ep combine: the internode kernels take top-k <= 32";
  }
  const bool ok = error.empty();
  const bool kernel_dtype =
      ok && (a.x.scalar_type() == at::kBFloat16 || a.x.scalar_type() == at::kFloat);
  const at::Tensor gathered =
      agreeOnHandle(pg, *st, "combine", error, combineFields(a, ok), a.routing,
                    {ok ? a.routing.is_token_in_rank.size(0) : 0, kernel_dtype ? 1 : 0});
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
  // Every row of the handle: a worst-case handle's padding rows (source -1) are skipped by the
  // kernel, so nothing here reads a count on the host.
  const int64_t num_rows = std::min(a.x.size(0), a.routing.recv_src_rank.size(0));
  const int64_t elem = a.x.scalar_type() == at::kBFloat16 ? 2 : 4;
  const Capacity need = combineNeed(maxColumn(gathered, 2 * R), hidden, elem, K);
  void* rt = ensureRuntime(pg, *st, device, need, "combine");
  if (tracing()) {
    trace(pg, *st, "combine",
          "buffers #" + std::to_string(st->builds) + " ready; launching call " +
              std::to_string(st->launches + 1) + " (tokens " + std::to_string(num_tokens) +
              ", rows held " + std::to_string(num_rows) + ")");
  }

  const at::Tensor x = a.x.narrow(0, 0, num_rows).contiguous();
  const std::optional<at::Tensor> weights =
      a.topk_weights
          ? std::optional<at::Tensor>(a.topk_weights->narrow(0, 0, num_rows).contiguous())
          : std::nullopt;
  const at::Tensor src_rank =
      a.routing.recv_src_rank.narrow(0, 0, num_rows).to(at::kInt).contiguous();
  const at::Tensor src_idx =
      a.routing.recv_src_idx.narrow(0, 0, num_rows).to(at::kInt).contiguous();
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
  c.num_rows = static_cast<int>(num_rows);
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
  c.num_blocks = static_cast<int>(pg.options()->num_sms);  // per call: settable live
  char err[1024] = {0};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  check(library().combine(rt, &c, stream, err, sizeof(err)), "combine", err);
  // No host wait here (combine returns while its kernels run): the next op waits for them.
  launched(*st, stream, "combine");
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
