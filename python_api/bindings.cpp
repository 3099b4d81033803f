// pybind11 module `ep_backend._C`, built against torch's bundled pybind11 so that our classes
// derive from torch's own `Backend` and `Backend.Options` Python types.
#include <pybind11/chrono.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "backend/all_to_all_v.hpp"
#include "backend/comm_stream_scope.hpp"
#include "backend/ep_process_group.hpp"
#include "backend/moe_op_calls.hpp"
#include "backend/moe_ops.hpp"
#include "backend/moe_validation.hpp"
#include "backend/rank_mask.hpp"
#include "backend/row_gather.hpp"
#include "backend/store_row_gather.hpp"
#include "backend/transport.hpp"
#include "transports/internode/internode_plan.hpp"
#include "transports/nvshmem/nvshmem_session_plan.hpp"
#include "transports/nvshmem/nvshmem_transport.hpp"
#ifdef EP_WITH_CUDA
#include "backend/kernel_image.hpp"
#endif

namespace py = pybind11;

namespace ep {
// Holder of Python-owned backends: drops its reference with the GIL released. Destroying a group
// joins its Gloo worker threads, and a worker may need the GIL to finish (freeing a tensor whose
// Python object it owns); with the GIL held that deadlocked. Same layout as c10::intrusive_ptr,
// which pybind11 relies on when it adopts an intrusive_ptr<Backend> returned by torch.
template <typename T>
class NoGilReleasePtr {
 public:
  NoGilReleasePtr() = default;
  NoGilReleasePtr(const NoGilReleasePtr&) = default;
  NoGilReleasePtr(NoGilReleasePtr&&) noexcept = default;
  NoGilReleasePtr& operator=(const NoGilReleasePtr&) = default;
  NoGilReleasePtr& operator=(NoGilReleasePtr&&) noexcept = default;
  explicit NoGilReleasePtr(c10::intrusive_ptr<T> ptr) : ptr_(std::move(ptr)) {}
  explicit NoGilReleasePtr(T* raw) : ptr_(c10::intrusive_ptr<T>::unsafe_steal_from_new(raw)) {}
  ~NoGilReleasePtr() {
    if (ptr_ && PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      ptr_.reset();
    }
  }
  T* get() const noexcept { return ptr_.get(); }
  T& operator*() const noexcept { return *ptr_; }
  T* operator->() const noexcept { return ptr_.get(); }
  operator c10::intrusive_ptr<T>() const { return ptr_; }  // NOLINT: pybind11 converts through it

 private:
  c10::intrusive_ptr<T> ptr_;
};
}  // namespace ep

PYBIND11_DECLARE_HOLDER_TYPE(T, ep::NoGilReleasePtr<T>, true);

namespace {

// A torch.Stream as Python passes it (stream_id, device_index, device_type).
c10::Stream unpackStream(int64_t stream_id, int64_t device_index, int64_t device_type) {
  return c10::Stream::unpack3(stream_id, static_cast<c10::DeviceIndex>(device_index),
                              static_cast<c10::DeviceType>(device_type));
}

void bindOptions(py::module_& m) {
  py::class_<ep::EPOptions, c10d::Backend::Options, c10::intrusive_ptr<ep::EPOptions>>(
      m, "Options",
      R"(Options of an ``"ep"`` process group; pass as ``pg_options`` to
``init_process_group``/``new_group``. On a live group, ``get_backend().options`` is the group's
own: a field set there applies from the next call on (``recv_slabs`` from the next dispatch, which
rebuilds the NVLink transport; not once a CUDA graph was captured on it), except
``ranks_per_node``, read once at the group's creation. Every rank must set the same values.

Args:
    timeout: collective timeout (``datetime.timedelta``), default 30 minutes.
    num_sms: blocks (one per SM) of the high-throughput dispatch, cached dispatch and combine
        kernels (default 24). A dispatch's count exchange (one block) runs just before it and
        overlaps its first few microseconds, when ``num_sms + 1`` SMs are busy.
    kernel_timeout_s: seconds a kernel may wait for a peer before failing (default 60).
    overlap_dispatch_host_wait: a dispatch without ``num_worst_tokens`` launches its kernel
        before the host waits for the receive counts (default True), so the wait overlaps the
        transfer; its outputs are then views of storage sized for the worst case (the sum of
        all ranks' tokens rows). False: storage of the exact size, kernel after the host wait.
    recv_slabs: receive slabs per GPU (default 2; 0: none). The nvlink dispatch (without
        ``num_worst_tokens``, outside CUDA-graph capture) lends one to its peers, which write
        its outputs there directly instead of into a buffer the GPU then copies them out of;
        the outputs are views of the slab, which is lent again once all of them are freed
        (a dispatch finding no free slab returns ordinary tensors). Each slab holds the
        outputs of the largest shape seen (every token of every rank): about
        ``R * T * (H * elem + 4 * S + 12 * K + 8)`` bytes. Reuse is ordered after the work
        queued on the dispatch's stream when the last view was freed, and on the streams named
        by ``ep_backend.record_stream`` (``Tensor.record_stream`` is not honoured for these
        views).
    ranks_per_node: 0 (default): the nodes are found from the ranks' hosts at group creation.
        k in 1..8: each host's ranks are split into nodes of k consecutive ranks (emulated
        nodes: the legs between them take the internode path); k must divide the group size.
        ``EP_RANKS_PER_NODE`` sets it where this is 0.
    low_latency_combine_bf16_partials: False (default): ``low_latency_combine`` adds a token's
        products in float32 throughout. True: the sum of a token's entries held by one expert
        rank (where it holds more than one) is rounded to BF16 before the ranks' sums are added,
        one more rounding per output that halves those sums' bytes on the NVSHMEM kernels (most
        of the low-latency combine's link traffic whenever a token has several entries on one
        rank); every transport gives the bits of
        ``reference.low_latency_combine(per_rank_partials=torch.bfloat16)``.)")
      .def(py::init([](std::chrono::milliseconds timeout, int64_t num_sms, double kernel_timeout_s,
                       bool overlap_dispatch_host_wait, int64_t recv_slabs, int64_t ranks_per_node,
                       bool low_latency_combine_bf16_partials) {
             TORCH_CHECK(num_sms > 0, "ep.Options: num_sms must be positive, got ", num_sms);
             TORCH_CHECK(recv_slabs >= 0 && recv_slabs <= 64,
                         "ep.Options: recv_slabs must be in [0, 64], got ", recv_slabs);
             TORCH_CHECK(kernel_timeout_s > 0,
                         "ep.Options: kernel_timeout_s must be positive, got ", kernel_timeout_s);
             auto opts = c10::make_intrusive<ep::EPOptions>(timeout);
             opts->num_sms = num_sms;
             opts->kernel_timeout_s = kernel_timeout_s;
             opts->overlap_dispatch_host_wait = overlap_dispatch_host_wait;
             opts->recv_slabs = recv_slabs;
             TORCH_CHECK(ranks_per_node >= 0 && ranks_per_node <= 8,
                         "ep.Options: ranks_per_node must be 0 (find the nodes from the hosts) or "
                         "in [1, 8], got ",
                         ranks_per_node);
             opts->ranks_per_node = ranks_per_node;
             opts->low_latency_combine_bf16_partials = low_latency_combine_bf16_partials;
             return opts;
           }),
           py::arg("timeout") = ep::kEPDefaultTimeout, py::arg("num_sms") = 24,
           py::arg("kernel_timeout_s") = 60.0, py::arg("overlap_dispatch_host_wait") = true,
           py::arg("recv_slabs") = 2, py::arg("ranks_per_node") = 0,
           py::arg("low_latency_combine_bf16_partials") = false)
      .def_readwrite("num_sms", &ep::EPOptions::num_sms)
      .def_readwrite("kernel_timeout_s", &ep::EPOptions::kernel_timeout_s)
      .def_readwrite("overlap_dispatch_host_wait", &ep::EPOptions::overlap_dispatch_host_wait)
      .def_readwrite("low_latency_combine_bf16_partials",
                     &ep::EPOptions::low_latency_combine_bf16_partials)
      .def_property(
          "recv_slabs", [](const ep::EPOptions& o) { return o.recv_slabs; },
          [](ep::EPOptions& o, int64_t n) {
            TORCH_CHECK(n >= 0 && n <= 64, "ep.Options: recv_slabs must be in [0, 64], got ", n);
            o.recv_slabs = n;
          })
      .def_property(
          "ranks_per_node", [](const ep::EPOptions& o) { return o.ranks_per_node; },
          [](ep::EPOptions& o, int64_t k) {
            TORCH_CHECK(k >= 0 && k <= 8,
                        "ep.Options: ranks_per_node must be 0 (find the nodes from the hosts) or "
                        "in [1, 8], got ",
                        k);
            o.ranks_per_node = k;
          })
      .def_readwrite("group_name", &c10d::Backend::Options::group_name)
      .def_readwrite("global_ranks_in_group", &c10d::Backend::Options::global_ranks_in_group)
      .def_property(
          "timeout", [](const ep::EPOptions& o) { return o.timeout; },
          [](ep::EPOptions& o, std::chrono::milliseconds t) { o.timeout = t; })
      .def("__copy__", [](const ep::EPOptions& o) { return c10::make_intrusive<ep::EPOptions>(o); })
      .def("__deepcopy__",
           [](const ep::EPOptions& o, py::dict) { return c10::make_intrusive<ep::EPOptions>(o); })
      .def("__repr__", [](const ep::EPOptions& o) {
        return "ep_backend.Options(timeout=" + std::to_string(o.timeout.count()) +
               "ms, num_sms=" + std::to_string(o.num_sms) +
               ", kernel_timeout_s=" + std::to_string(o.kernel_timeout_s) +
               ", overlap_dispatch_host_wait=" + (o.overlap_dispatch_host_wait ? "True" : "False") +
               ", recv_slabs=" + std::to_string(o.recv_slabs) +
               ", ranks_per_node=" + std::to_string(o.ranks_per_node) +
               ", low_latency_combine_bf16_partials=" +
               (o.low_latency_combine_bf16_partials ? "True" : "False") + ")";
      });
}

// Holds a Python callable for C++ code that may outlive the interpreter (backends destroyed at
// process exit): the reference is dropped under the GIL while Python lives, leaked afterwards.
ep::EPProcessGroup::SplitFactory wrapSplitFactory(py::function factory) {
  std::shared_ptr<py::object> fn(new py::object(std::move(factory)), [](py::object* p) {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      delete p;
    }
  });
  return [fn](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
              const c10::intrusive_ptr<ep::EPOptions>& opts) {
    py::gil_scoped_acquire gil;
    return (*fn)(store, rank, size, opts).cast<c10::intrusive_ptr<c10d::Backend>>();
  };
}

// The transport choice of a group's op family, as the properties *_transport_choice return it.
void bindTransportChoice(py::module_& m) {
  py::enum_<ep::TransportKind>(m, "TransportKind", "Which transport serves an op family.")
      .value("undecided", ep::TransportKind::kUndecided)
      .value("nvlink", ep::TransportKind::kNvlink)
      .value("nvshmem", ep::TransportKind::kNvshmem)
      .value("aten", ep::TransportKind::kAten)
      .value("internode", ep::TransportKind::kInternode);
  py::class_<ep::TransportChoice>(m, "TransportChoice",
                                  "Which transport serves an op family of a group, and why.")
      .def_readonly("kind", &ep::TransportChoice::kind)
      .def_readonly("reason", &ep::TransportChoice::reason,
                    "Why a faster transport does not serve it ('' when none was passed over).")
      .def_readonly("requested", &ep::TransportChoice::requested,
                    "The user asked for ATen (EP_HIGH_THROUGHPUT=aten / EP_LOW_LATENCY=aten).")
      .def("__str__", &ep::TransportChoice::describe);
}

void bindProcessGroup(py::module_& m) {
  bindTransportChoice(m);
  py::class_<ep::EPProcessGroup, c10d::Backend, ep::NoGilReleasePtr<ep::EPProcessGroup>>(
      m, "EPProcessGroup", "The C++ backend behind a torch.distributed group of backend \"ep\".")
      .def(py::init<c10::intrusive_ptr<c10d::Store>, int, int, c10::intrusive_ptr<ep::EPOptions>,
                    c10::intrusive_ptr<c10d::Backend>, c10::intrusive_ptr<c10d::Backend>>(),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("options"),
           py::arg("cpu_backend"), py::arg("cuda_backend") = py::none())
      .def_property_readonly("options", &ep::EPProcessGroup::options)
      .def_property_readonly("store", &ep::EPProcessGroup::store)
      .def_property_readonly("has_cuda_backend", &ep::EPProcessGroup::hasCudaBackend)
      .def(
          "_set_topology",
          [](ep::EPProcessGroup& self, int num_nodes, int ranks_per_node,
             std::vector<int> node_of_rank, std::vector<int> local_rank, bool emulated,
             std::string problem) {
            ep::Topology t;
            t.num_nodes = num_nodes;
            t.ranks_per_node = ranks_per_node;
            t.node_of_rank = std::move(node_of_rank);
            t.local_rank = std::move(local_rank);
            t.emulated = emulated;
            t.problem = std::move(problem);
            self.setTopology(std::move(t));
          },
          py::arg("num_nodes"), py::arg("ranks_per_node"), py::arg("node_of_rank"),
          py::arg("local_rank"), py::arg("emulated"), py::arg("problem"),
          "Sets the group's nodes (ep_backend/topology.py calls it at group creation).")
      .def(
          "_topology",
          [](const ep::EPProcessGroup& self) {
            const ep::Topology& t = self.topology();
            return py::make_tuple(t.num_nodes, t.ranks_per_node, t.node_of_rank, t.local_rank,
                                  t.emulated, t.problem);
          },
          "(num_nodes, ranks_per_node, node_of_rank, local_rank, emulated, problem).")
      .def_property_readonly("is_shutdown", &ep::EPProcessGroup::isShutdown)
      .def(
          "inner_backend",
          [](const ep::EPProcessGroup& self, const std::string& device_type) {
            return self.innerBackend(c10::Device(device_type).type(), "inner_backend");
          },
          py::arg("device_type"),
          "The internal backend that serves tensors of ``device_type`` ('cpu' or 'cuda').")
      .def_property_readonly(
          "moe_agreement_transport",
          [](ep::EPProcessGroup& self) { return ep::moeAgreementTransport(self); },
          "How the MoE collectives' per-call cross-rank check travels: 'shared memory' (all ranks "
          "on one host), 'nvshmem' (a group of several nodes once the internode transport's "
          "buffers exist: all-gathered on the GPU), 'gloo' (else, or EP_HOST_EXCHANGE=gloo), "
          "'none (one rank)' for a group of one rank, 'undecided' before the first.")
      .def(
          "_use_store_row_gather",
          [](ep::EPProcessGroup& self) {
            ep::useRowGather(self, std::make_shared<ep::StoreRowGather>(self));
          },
          "Test hook, collective (every rank before the same MoE call): the group's per-call "
          "agreement goes through its store, by the transport-gather path the internode "
          "transport's GPU exchange takes (moe_agreement_transport then reads 'store').")
      .def_property_readonly(
          "high_throughput_transport",
          [](ep::EPProcessGroup& self) {
            return ep::transportChoice(self, ep::OpFamily::kHighThroughput).describe();
          },
          "How layout, dispatch, cached dispatch and combine run on CUDA tensors: 'nvlink' (the "
          "NVLink kernels), 'aten: <why not>', or 'undecided' before the group's first such call "
          "on CUDA. (CPU tensors always take the ATen + Gloo path.)")
      .def_property_readonly(
          "low_latency_transport",
          [](ep::EPProcessGroup& self) {
            return ep::transportChoice(self, ep::OpFamily::kLowLatency).describe();
          },
          "How the low-latency ops run on CUDA tensors: 'nvshmem' (the NVSHMEM kernels), "
          "'aten: <why not>', or 'undecided' before the group's first low-latency call on CUDA.")
      .def_property_readonly(
          "high_throughput_transport_choice",
          [](ep::EPProcessGroup& self) {
            return ep::transportChoice(self, ep::OpFamily::kHighThroughput);
          },
          "high_throughput_transport as a TransportChoice (kind, reason, requested).")
      .def_property_readonly(
          "low_latency_transport_choice",
          [](ep::EPProcessGroup& self) {
            return ep::transportChoice(self, ep::OpFamily::kLowLatency);
          },
          "low_latency_transport as a TransportChoice (kind, reason, requested).")
      .def_property_readonly(
          "all_to_all_transport",
          [](ep::EPProcessGroup& self) {
            return ep::transportChoice(self, ep::OpFamily::kAllToAll).describe();
          },
          "How all_to_all_single / all_to_all / all_to_all_v run on CUDA tensors: 'nvlink' (ep's "
          "NVLink kernels), 'aten: <why not>' (the inner NCCL group), or 'undecided' before the "
          "group's first all-to-all on CUDA.")
      .def_property_readonly(
          "all_to_all_transport_choice",
          [](ep::EPProcessGroup& self) {
            return ep::transportChoice(self, ep::OpFamily::kAllToAll);
          },
          "all_to_all_transport as a TransportChoice (kind, reason, requested).")
      .def("_all_to_all_v", &ep::allToAllV, py::arg("input"), py::arg("splits"), py::arg("output"),
           py::arg("num_local_experts"), py::arg("flat"), py::call_guard<py::gil_scoped_release>(),
           "See ep_backend.all_to_all_v (collective at the first call): (recv_splits, "
           "recv_offsets), or None when the group's all-to-all does not run on ep's kernels.")
      .def("_take_all_to_all_error", &ep::takeAllToAllError,
           "The error an earlier all-to-all kernel left ('' when none), taken.")
      .def("_low_latency_receive", &ep::nvshmem::receive, py::arg("layout_range"),
           "The receive phase of a low_latency_dispatch(return_recv_hook=True) (its hook).")
      .def("_low_latency_combine_buffer", &ep::nvshmem::combineBuffer, py::arg("layout_range"),
           py::arg("num_max_dispatch_tokens_per_rank"), py::arg("num_experts"), py::arg("hidden"),
           "See ep_backend.get_low_latency_combine_buffer.")
      .def(
          "_low_latency_update_mask",
          [](ep::EPProcessGroup& self, int64_t rank, bool masked) {
            ep::updateRankMask(self, rank, masked);
          },
          py::arg("rank"), py::arg("masked"), "See ep_backend.low_latency_update_mask.")
      .def(
          "_low_latency_mask",
          [](ep::EPProcessGroup& self) {
            std::vector<int64_t> masked;
            const auto snap = ep::rankMask(self);
            for (size_t r = 0; r < snap.masked.size(); ++r) {
              if (snap.masked[r] != 0) masked.push_back(static_cast<int64_t>(r));
            }
            return masked;
          },
          "The ranks this rank masks in low-latency calls, ascending.")
      .def(
          "_low_latency_clean_mask", [](ep::EPProcessGroup& self) { ep::cleanRankMask(self); },
          "See ep_backend.low_latency_clean_mask.")
      .def(
          "_low_latency_auto_mask",
          [](ep::EPProcessGroup& self, std::optional<double> timeout_s) {
            std::optional<std::chrono::milliseconds> t;
            if (timeout_s) {
              TORCH_CHECK_VALUE(*timeout_s > 0,
                                "ep low_latency_auto_mask: timeout must be "
                                "positive, got ",
                                *timeout_s);
              t = std::chrono::milliseconds(static_cast<int64_t>(*timeout_s * 1000.0 + 0.5));
            }
            ep::setAutoMask(self, t);
          },
          py::arg("timeout_s"), "See ep_backend.low_latency_auto_mask.")
      .def("_low_latency_mask_tensor", &ep::rankMaskDevice, py::arg("device"),
           "The int32 [R] device copy of the mask the kernels read (1 = masked).")
      .def("_reserve", &ep::reserve, py::arg("device_index"), py::arg("num_tokens"),
           py::arg("hidden_bytes"), py::arg("topk"), py::arg("num_scales"), py::arg("num_experts"),
           py::call_guard<py::gil_scoped_release>(),
           "See ep_backend.reserve (collective; peers' threads may need the GIL). None when the "
           "group's high-throughput ops do not use a CUDA transport.")
      .def("_shift_moe_calls", &ep::EPProcessGroup::shiftMoeCalls, py::arg("delta"),
           "Test hook: moves this rank's MoE call counter by ``delta`` (as if it had made or "
           "skipped calls its peers did not).")
      .def_property_readonly(
          "moe_unusable_reason", &ep::EPProcessGroup::moeUnusableReason,
          "Why this group's MoE calls raise at once on this rank ('' while they can run): an "
          "earlier call timed out or failed out of step here, or the group was aborted.")
      .def("_register_group_name", &ep::EPProcessGroup::registerGroupName, py::arg("group_name"),
           "Makes the MoE ops find this backend by its group's name.")
      .def(
          "_set_split_factory",
          [](ep::EPProcessGroup& self, py::function factory) {
            self.setSplitFactory(wrapSplitFactory(std::move(factory)));
          },
          py::arg("factory"),
          "Sets the callable (store, rank, size, options) -> Backend used by split_group.")
      .def(
          "perform_nocolor_split",
          [](ep::EPProcessGroup&, const at::Device&) {
            // Children are built fresh over the split store, so non-members have nothing to do.
          },
          py::arg("device"));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Native core of ep_backend: the \"ep\" c10d backend and MoE collectives.";
  // What this build holds (CI checks that a CUDA build really happened; errors name the archs).
#ifdef EP_WITH_CUDA
  m.attr("built_with_cuda") = true;
  m.attr("cpu_build_reason") = "";
  m.attr("cuda_architectures") = ep::builtCudaArchitectures();
#else
  m.attr("built_with_cuda") = false;
  m.attr("cuda_architectures") = "";
  m.attr("cpu_build_reason") = EP_CPU_BUILD_REASON;
#endif
  bindOptions(m);
  bindProcessGroup(m);
#ifdef EP_WITH_CUDA
  m.attr("cuda_enabled") = true;
#else
  m.attr("cuda_enabled") = false;
#endif
  m.def(
      "_record_slab_stream",
      [](const at::Tensor& tensor, int64_t stream_id, int64_t device_index, int64_t device_type) {
        return ep::recordLentStream(tensor, unpackStream(stream_id, device_index, device_type));
      },
      py::arg("tensor"), py::arg("stream_id"), py::arg("device_index"), py::arg("device_type"),
      "record_stream for dispatch outputs viewing a receive slab; False for any other tensor.");
  m.def("_fail_next_nvshmem_setup", &ep::nvshmem::failNextSetupForTest,
        "Test hook: this process's next NVSHMEM buffer setup (low-latency or internode) fails "
        "on this rank, after its own buffers were made.");
  m.def("_set_test_count_inflation", &ep::setTestCountInflation, py::arg("rows"),
        "Test hook: rows this process adds to every send count a dispatch announces to its "
        "peers (an adversarial peer); 0 restores normal behaviour.");
  // Test hooks of the internode transport's host planning (internode_plan.hpp), reachable in CPU
  // builds: tests/test_internode_plan_cpu.py checks them with empty ranks.
  m.def(
      "_internode_plan",
      [](const at::Tensor& is_token_in_rank, const at::Tensor& send_pos, const at::Tensor& matrix,
         int64_t rank, const std::vector<int64_t>& node_rank, int64_t num_nodes,
         int64_t ranks_per_node) {
        const ep::internode::Plan p = ep::internode::makePlan(
            is_token_in_rank, send_pos, ep::internode::receiveOffsets(matrix, rank),
            at::tensor(node_rank, at::kLong), num_nodes, ranks_per_node);
        return std::make_tuple(p.dest_slot, p.node_pos, p.node_count);
      },
      py::arg("is_token_in_rank"), py::arg("send_pos"), py::arg("matrix"), py::arg("rank"),
      py::arg("node_rank"), py::arg("num_nodes"), py::arg("ranks_per_node"),
      "Test hook: the internode dispatch plan of source `rank` (dest_slot [T, R], node_pos "
      "[T, N], node_count [N]) from its layout and the agreed [src, dst] count matrix.");
  m.def(
      "_internode_capacity",
      [](const std::vector<int64_t>& have, const std::string& op, int64_t max_tokens,
         int64_t max_recv_rows, int64_t hidden, int64_t element_bytes, int64_t scale_bytes,
         int64_t topk, int64_t num_nodes, int64_t ranks_per_node, int64_t local_experts) {
        TORCH_CHECK(have.empty() || have.size() == 7, "have: [] or the 7 capacity fields");
        TORCH_CHECK(op == "dispatch" || op == "combine", "op: dispatch or combine");
        ep::internode::Capacity h;
        if (!have.empty()) h = {have[0], have[1], have[2], have[3], have[4], have[5], have[6]};
        const ep::internode::CapacityDecision d = ep::internode::decideCapacity(
            have.empty() ? nullptr : &h, op == "combine", max_tokens, max_recv_rows, hidden,
            element_bytes, scale_bytes, topk, num_nodes, ranks_per_node, local_experts);
        const ep::internode::Capacity& c = d.capacity;
        return std::make_tuple(
            d.rebuild,
            std::vector<int64_t>{c.max_tokens, c.max_recv_rows, c.max_record, c.max_out_record,
                                 c.max_combine_row, c.max_partial_row, c.max_local_experts},
            d.symmetric_bytes);
      },
      py::arg("have"), py::arg("op"), py::arg("max_tokens"), py::arg("max_recv_rows"),
      py::arg("hidden"), py::arg("element_bytes"), py::arg("scale_bytes"), py::arg("topk"),
      py::arg("num_nodes"), py::arg("ranks_per_node"), py::arg("local_experts") = 0,
      "Test hook: whether internode buffers of capacity `have` ([] for none; fields in the order "
      "of internode::Capacity) are rebuilt for a call, the capacity they then have (same order) "
      "and the symmetric bytes of that capacity.");
  m.def("_set_test_exchange_delay", &ep::setTestExchangeDelay, py::arg("milliseconds"),
        "Test hook: milliseconds this process sleeps after each MoE call's agreement, before its "
        "data exchange on the ATen path (to kill it there in a test); 0 restores normal "
        "behaviour.");
  // Test hook of the NVSHMEM transport's session decision (nvshmem_session_plan.hpp), reachable
  // in CPU builds: tests/test_nvshmem_session_cpu.py.
  m.def(
      "_nvshmem_session_decision",
      [](const std::vector<std::string>& sessions, const std::vector<std::string>& places) {
        namespace nv = ep::nvshmem;
        TORCH_CHECK(sessions.size() == places.size(), "one session post and one place per rank");
        std::vector<nv::SessionPost> posts;
        for (const std::string& s : sessions) {
          try {
            posts.push_back(nv::decodeSession(s));
          } catch (const std::invalid_argument& e) {
            TORCH_CHECK_VALUE(false, e.what());
          }
        }
        const nv::SessionDecision d = nv::decideSession(posts, nv::placesFingerprint(places));
        const char* action = d.action == nv::SessionAction::kStart   ? "start"
                             : d.action == nv::SessionAction::kReuse ? "reuse"
                                                                     : "refuse";
        return std::make_tuple(std::string(action), d.why);
      },
      py::arg("sessions"), py::arg("places"),
      "Test hook: what a group whose ranks post `sessions` (encodeSession texts: \"-\" or "
      "\"pe:num_pes:parked:fingerprint\") and sit at `places` (\"host|index|bus\", rank order) "
      "does "
      "with NVSHMEM: (\"start\" | \"reuse\" | \"refuse\", the why-not).");
  m.def("_nvshmem_session", &ep::nvshmem::sessionInfo,
        "This process's NVSHMEM session: (started, PE, PE count), (False, -1, 0) without one. "
        "Started once per process by the first group that uses NVSHMEM; never restarted.");
  m.def(
      "_nvshmem_places_fingerprint",
      [](const std::vector<std::string>& places) { return ep::nvshmem::placesFingerprint(places); },
      py::arg("places"), "Test hook: the session fingerprint of ranks at `places` (rank order).");
  // Both halves run with the GIL released, as torch.ops calls do: the agreement and the count
  // wait block on peers, and the group's Gloo worker threads may need the GIL meanwhile (to drop
  // a tensor whose Python object they own); holding it there deadlocked the agreement.
  m.def(
      "_dispatch_deferred",
      [](const at::Tensor& x, const std::optional<at::Tensor>& x_scales, const at::Tensor& topk_idx,
         const std::optional<at::Tensor>& topk_weights, int64_t num_experts,
         int64_t expert_alignment, int64_t num_worst_tokens, const std::string& group_name,
         const std::vector<at::Tensor>& layout) {
        std::pair<ep::DispatchOutputs, ep::DeferredCounts> result;
        {
          py::gil_scoped_release no_gil;
          result = ep::dispatchDeferred(x, x_scales, topk_idx, topk_weights, num_experts,
                                        expert_alignment, num_worst_tokens, group_name, layout);
        }
        py::object finish = py::none();
        if (result.second) {
          finish =
              py::cpp_function(std::move(result.second), py::call_guard<py::gil_scoped_release>());
        }
        return py::make_tuple(py::cast(std::move(result.first)), std::move(finish));
      },
      py::arg("x"), py::arg("x_scales"), py::arg("topk_idx"), py::arg("topk_weights"),
      py::arg("num_experts"), py::arg("expert_alignment"), py::arg("num_worst_tokens"),
      py::arg("group_name"), py::arg("layout"),
      "ep::dispatch with the count wait deferred: (outputs, finish or None); see moe_ops.hpp. "
      "Releases the GIL in both.");
  // The ops through the typed dispatcher (moe_op_calls.hpp), with the GIL released as torch.ops
  // releases it: the agreement blocks on peers, and their Gloo threads may need the GIL.
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("_call_dispatch_layout", &ep::callDispatchLayout, no_gil,
        "torch.ops.ep.dispatch_layout.default without Python's argument boxing.");
  m.def("_call_dispatch", &ep::callDispatch, no_gil,
        "torch.ops.ep.dispatch.default without Python's argument boxing.");
  m.def("_call_cached_dispatch", &ep::callCachedDispatch, no_gil,
        "torch.ops.ep.cached_dispatch.default without Python's argument boxing.");
  m.def("_call_combine", &ep::callCombine, no_gil,
        "torch.ops.ep.combine.default without Python's argument boxing.");
  m.def("_call_low_latency_dispatch", &ep::callLowLatencyDispatch, no_gil,
        "torch.ops.ep.low_latency_dispatch.default without Python's argument boxing.");
  m.def("_call_low_latency_combine", &ep::callLowLatencyCombine, no_gil,
        "torch.ops.ep.low_latency_combine.default without Python's argument boxing.");
  // The async_op path's stream switch (comm_stream_scope.hpp); streams as (id, device index,
  // device type), as torch.Stream packs them.
  m.def(
      "_enter_comm_stream",
      [](int64_t stream_id, int64_t device_index, int64_t device_type, bool wait_current) {
        const c10::Stream previous =
            ep::enterCommStream(unpackStream(stream_id, device_index, device_type), wait_current);
        return std::make_tuple(previous.id(), static_cast<int64_t>(previous.device_index()),
                               static_cast<int64_t>(previous.device_type()));
      },
      py::arg("stream_id"), py::arg("device_index"), py::arg("device_type"),
      py::arg("wait_current"),
      "Makes the stream current on its device (after it waits for the current one, with "
      "wait_current); returns the replaced stream as (stream_id, device_index, device_type).");
  m.def(
      "_exit_comm_stream",
      [](const std::tuple<int64_t, int64_t, int64_t>& previous,
         const std::tuple<int64_t, int64_t, int64_t>& comm, const std::vector<at::Tensor>& inputs,
         const std::vector<at::Tensor>& outputs) {
        const auto [pid, pidx, ptype] = previous;
        const auto [cid, cidx, ctype] = comm;
        ep::exitCommStream(unpackStream(pid, pidx, ptype), unpackStream(cid, cidx, ctype), inputs,
                           outputs);
      },
      py::arg("previous"), py::arg("comm"), py::arg("inputs"), py::arg("outputs"),
      "Restores `previous` as current, then record_stream: inputs on `comm`, outputs on "
      "`previous`.");
}
