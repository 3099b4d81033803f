#ifdef EP_WITH_CUDA

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "backend/aligned_rows.hpp"
#include "backend/carved_tensors.hpp"
#include "backend/ep_process_group.hpp"
#include "backend/host_stages.hpp"
#include "backend/moe_validation.hpp"
#include "backend/stream_capture.hpp"
#include "transports/nvlink/cuda/nvlink_kernels.hpp"
#include "transports/nvlink/nvlink_capacity.hpp"
#include "transports/nvlink/nvlink_layout_errors.hpp"
#include "transports/nvlink/nvlink_pending_error.hpp"
#include "transports/nvlink/nvlink_slab_pool.hpp"
#include "transports/nvlink/nvlink_transport.hpp"
#include "transports/nvlink/nvlink_tuning.hpp"

namespace ep::nvlink {
namespace {

// What the dispatch kernel reads besides the call's own tensors: the routing the layout and
// notify kernels fill, the receive slab lent for the outputs, and the call's index shape.
struct DispatchKernelInputs {
  int64_t topk = 0;
  int idx_bytes = 0;
  at::TensorOptions i32;
  at::Tensor per_rank, per_expert, in_rank, send_pos, recv_prefix, dest_slabs;
  at::Tensor recv_counts, recv_per_expert;
  bool slabs = false;  // the group has receive slabs: the kernels get dest_slabs
  std::shared_ptr<SlabLease> lease;
};

// Waits for notify's counts and raises, on every rank alike, when some rank's topk_idx was
// rejected. Holds what it needs by value: in a deferred dispatch it runs after dispatch()
// returned.
struct CountWait {
  std::shared_ptr<GroupState> st;
  const NvlinkRuntime* built;  // the runtime notify ran on
  int generation;
  int ticket;
  bool given_layout;  // the layout came from get_dispatch_layout (its own error record)
  c10::DeviceIndex device_index;
  cudaStream_t stream;
  int rank;
  int64_t num_experts;
  int64_t topk;

  NvlinkRecvCounts operator()() const {
    TORCH_CHECK(st->runtime.get() == built && st->generation == generation,
                "ep dispatch: the group's transport was shut down or rebuilt before this "
                "dispatch's receive counts were read");
    NvlinkRuntime& runtime = *st->runtime;
    NvlinkRecvCounts counts = runtime.wait_recv_counts(ticket);
    if (counts.rejected_ranks != 0) raiseRejectedTopk(runtime, counts.rejected_ranks);
    return counts;
  }

  // Returns (and clears) the error record of the layout that found the invalid value.
  ErrorRecord takeRejectingRecord(NvlinkRuntime& runtime) const {
    if (given_layout) {
      return takeLayoutError(device_index, stream);
    }
    const ErrorRecord record = runtime.error_record();
    runtime.clear_error();
    return record;
  }

  // Some rank's layout found a topk_idx value outside [-1, E) and notify told every rank: all raise
  // here, before the dispatch kernel, so nothing moves and the transport stays in step. Worst-case
  // mode has no such host step: there the layout treats the values as -1 and the next call raises.
  [[noreturn]] void raiseRejectedTopk(NvlinkRuntime& runtime, int rejected_ranks) const {
    if ((rejected_ranks >> rank) & 1) {
      const ErrorRecord record = takeRejectingRecord(runtime);
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
};

// Sets the row count of a tensor nobody else holds yet, in place: its first n rows.
void keepFirstRows(at::Tensor& t, int64_t n) {
  std::vector<int64_t> sizes = t.sizes().vec();
  sizes[0] = n;
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
}

// A dispatch's outputs, made for the worst case (every rank's tokens) when the host wait overlaps
// the kernel: their first n rows, in place. Nothing else holds them yet (a deferred dispatch's
// caller has not used them), so the row count is set on the tensors themselves: no dispatcher
// call, unlike narrow, on the host's critical path between the count wait and the return.
void keepRows(DispatchResult& r, int64_t n) {
  TORCH_INTERNAL_ASSERT(n <= r.recv_x.size(0), "ep dispatch: ", n, " rows received, more than the ",
                        r.recv_x.size(0), " every rank's tokens add up to");
  keepFirstRows(r.recv_x, n);
  if (r.recv_x_scales.has_value()) {
    keepFirstRows(*r.recv_x_scales, n);
  }
  keepFirstRows(r.recv_topk_idx, n);
  if (r.recv_topk_weights.has_value()) {
    keepFirstRows(*r.recv_topk_weights, n);
  }
  keepFirstRows(r.routing.recv_src_idx, n);
  keepFirstRows(r.routing.recv_src_rank, n);
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

// Allocates a dispatch's outputs (`rows` rows: views of the lent slab, each keeping the lease,
// else fresh tensors) and launches the dispatch kernel into them.
void allocateAndLaunch(NvlinkRuntime& rt, const DispatchArgs& a, DispatchKernelInputs& k,
                       int64_t rows, bool overlap, int num_sms, cudaStream_t stream,
                       DispatchResult& out) {
  const int64_t num_tokens = a.x.size(0);
  const bool has_scales = a.x_scales.has_value();
  const bool has_weights = a.topk_weights.has_value();
  const int hidden_bytes = static_cast<int>(a.x.size(1) * a.x.element_size());
  const int num_scales = has_scales ? static_cast<int>(a.x_scales->size(1)) : 0;
  const SlabLayout slab =
      rt.recv_slab_layout(hidden_bytes, num_scales, static_cast<int>(k.topk), k.idx_bytes);
  const std::shared_ptr<SlabLease>& lease = k.lease;
  out.recv_x = slabOutput(rt, lease, slab.x, {rows, a.x.size(1)}, a.x.options());
  if (has_scales) {
    out.recv_x_scales =
        slabOutput(rt, lease, slab.scales, {rows, a.x_scales->size(1)}, a.x_scales->options());
  }
  out.recv_topk_idx = slabOutput(rt, lease, slab.topk_idx, {rows, k.topk}, a.topk_idx.options());
  if (has_weights) {
    out.recv_topk_weights =
        slabOutput(rt, lease, slab.topk_weights, {rows, k.topk}, a.topk_weights->options());
  }
  const at::Tensor src_idx = slabOutput(rt, lease, slab.src_idx, {rows}, k.i32);
  const at::Tensor src_rank = slabOutput(rt, lease, slab.src_rank, {rows}, k.i32);

  const at::Tensor x = alignedTo16(a.x);
  NvlinkDispatchArgs args;
  args.x = x.data_ptr();
  args.num_tokens = static_cast<int>(num_tokens);
  args.hidden_bytes = static_cast<int>(a.x.size(1) * a.x.element_size());
  args.x_scales = has_scales ? static_cast<const float*>(a.x_scales->data_ptr()) : nullptr;
  args.num_scales = has_scales ? static_cast<int>(a.x_scales->size(1)) : 0;
  args.topk_idx = a.topk_idx.data_ptr();
  args.idx_bytes = k.idx_bytes;
  args.topk_weights = has_weights ? a.topk_weights->data_ptr<float>() : nullptr;
  args.num_topk = static_cast<int>(k.topk);
  args.num_experts = static_cast<int>(a.num_experts);
  args.send_pos = k.send_pos.data_ptr<int>();
  args.recv_prefix = k.recv_prefix.data_ptr<int>();
  args.recv_x = out.recv_x.data_ptr();
  args.recv_x_scales = has_scales ? static_cast<float*>(out.recv_x_scales->data_ptr()) : nullptr;
  args.recv_topk_idx = out.recv_topk_idx.data_ptr();
  args.recv_topk_weights = has_weights ? out.recv_topk_weights->data_ptr<float>() : nullptr;
  args.recv_src_idx = src_idx.data_ptr<int>();
  args.recv_src_rank = src_rank.data_ptr<int>();
  // Only worst-case mode pads; the overlapped launch leaves the rows past the count unwritten.
  args.num_worst_tokens = overlap ? 0 : static_cast<int>(a.num_worst_tokens);
  args.dest_slabs = k.slabs ? k.dest_slabs.data_ptr<int>() : nullptr;
  args.own_slab = lease != nullptr;
  args.num_sms = num_sms;
  rt.dispatch(args, stream);
  k.lease.reset();  // the outputs hold it now
  out.num_recv_tokens_per_expert = k.recv_per_expert;
  out.routing = {k.in_rank, k.per_rank, k.recv_counts, src_idx, src_rank};
}

// The rest of a deferred dispatch, run when its caller calls the DeferredCounts: the count wait,
// the outputs cut to the rows received, the routing remembered for later combines.
struct FinishDeferredDispatch {
  CountWait wait_counts;
  DispatchResult res;
  std::shared_ptr<GroupState> st;
  at::Tensor send_pos, recv_prefix;

  std::vector<int64_t> operator()() {
    HostStages finish_stages("dispatch finish");
    const NvlinkRecvCounts counts = wait_counts();
    finish_stages.mark("count_wait");
    keepRows(res, counts.num_recv_tokens);
    st->routings.remember(res.routing, send_pos, recv_prefix, hostRoutingCounts(counts));
    finish_stages.mark("remember");
    return std::vector<int64_t>(counts.per_expert.begin(), counts.per_expert.end());
  }
};

}  // namespace

DispatchResult dispatch(EPProcessGroup& pg, const DispatchArgs& a, DeferredCounts* deferred) {
  HostStages stages("dispatch");
  const int64_t num_ranks = pg.getSize();
  auto st = stateOf(pg);
  const std::string pending = pendingErrorToAgree(*st, "dispatch");
  // Values of topk_idx are never read on the host (a stream sync): the layout kernel checks them
  // and notify tells every rank, which all raise before the dispatch kernel (see below).
  const std::string input_error = validateDispatch(a, num_ranks, false);
  stages.mark("validate");
  const bool ok = input_error.empty();
  const std::string& error = pending.empty() ? input_error : pending;
  const bool has_scales = a.x_scales.has_value();
  std::vector<AgreedField> fields = dispatchFields(a, ok);
  // Ranks that disagree would diverge on a rejected routing (one launches the kernel, one not).
  fields.push_back(
      {"Options.overlap_dispatch_host_wait", pg.options()->overlap_dispatch_host_wait});
  fields.push_back({"Options.recv_slabs (or EP_RECV_SLABS)", recvSlabs(pg)});
  fields.push_back(graphCapturedField(*st));
  std::vector<int64_t> payload{
      ok ? a.x.size(0) : 0, ok ? a.x.size(1) * a.x.element_size() : 0, ok ? a.topk_idx.size(1) : 0,
      ok && has_scales ? a.x_scales->size(1) : 0, ok ? a.num_experts / num_ranks : 0};
  const AgreedRows gathered = agreeRowsAcrossRanks(pg, "dispatch", error, fields, payload);
  stages.mark("agree");
  stages.note("agree_wait", lastAgreementWaitUs());  // of "agree": waiting for the peers' rows

  const at::Device device = a.x.device();
  c10::cuda::CUDAGuard guard(device);
  stages.mark("guard");
  const Needs needs = maxNeeds(gathered);
  stages.mark("needs");
  const bool capture = streamCapturing();
  NvlinkRuntime& rt = ensureRuntime(pg, *st, device, needs, "dispatch", capture, recvSlabs(pg));
  stages.mark("runtime");
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();

  const int64_t num_tokens = a.x.size(0);
  const int64_t experts_per_rank = a.num_experts / num_ranks;
  DispatchKernelInputs k;
  k.topk = a.topk_idx.size(1);
  k.i32 = a.x.options().dtype(at::kInt);
  k.idx_bytes = static_cast<int>(a.topk_idx.element_size());
  // A layout computed earlier (get_dispatch_layout) replaces the layout kernel; its error record
  // tells notify whether it found an invalid topk_idx value.
  const bool given_layout = !a.layout.empty();
  LayoutErrorRef given_layout_error{};
  const LayoutErrorRef* layout_error = nullptr;
  // One allocation for every small tensor of the call: the receive prefix [R + 1], the lent
  // slabs [2R], the receive counts [R] and per local expert, and without a given layout the
  // layout's outputs, its send positions [T, R] and its kernel's scratch.
  const CarvedShape recv_prefix{{num_ranks + 1}, at::kInt};
  const CarvedShape dest_slabs{{2 * num_ranks}, at::kInt};
  const CarvedShape recv_counts{{num_ranks}, at::kInt};
  const CarvedShape recv_per_expert{{experts_per_rank}, at::kInt};
  if (given_layout) {
    k.per_rank = a.layout[0];
    k.per_expert = a.layout[1];
    k.in_rank = a.layout[2];
    k.send_pos = a.layout[3];
    auto t = carveTensors<4>(device, {recv_prefix, dest_slabs, recv_counts, recv_per_expert});
    k.recv_prefix = t[0];
    k.dest_slabs = t[1];
    k.recv_counts = t[2];
    k.recv_per_expert = t[3];
    const LayoutErrorState& err = layoutErrorState(device.index(), stream);
    given_layout_error = {err.dev, &err.ctrl->error_lock};
    layout_error = &given_layout_error;
  } else {
    const std::array<CarvedShape, 5> layout =
        layoutCarvedShapes(num_tokens, num_ranks, a.num_experts);
    auto t = carveTensors<9>(device, {layout[0], layout[1], layout[2], layout[3], layout[4],
                                      recv_prefix, dest_slabs, recv_counts, recv_per_expert});
    k.per_rank = t[0];
    k.per_expert = t[1];
    k.in_rank = t[2];
    k.send_pos = t[3];
    const at::Tensor& layout_ws = t[4];
    k.recv_prefix = t[5];
    k.dest_slabs = t[6];
    k.recv_counts = t[7];
    k.recv_per_expert = t[8];
    rt.layout(a.topk_idx.data_ptr(), k.idx_bytes, static_cast<int>(num_tokens),
              static_cast<int>(k.topk), static_cast<int>(a.num_experts), k.per_rank.data_ptr<int>(),
              k.per_expert.data_ptr<int>(), k.in_rank.data_ptr<bool>(), k.send_pos.data_ptr<int>(),
              stream, layout_ws.numel() > 0 ? layout_ws.data_ptr() : nullptr);
  }
  const bool host_counts = a.num_worst_tokens == 0;
  // Output rows: num_worst_tokens; else, when the host wait overlaps the kernel, storage for
  // the most any rank can receive (every token of every rank), narrowed once the counts are in.
  const bool overlap = host_counts && pg.options()->overlap_dispatch_host_wait;
  // Without a host wait between notify and the dispatch launch, the dispatch kernel starts
  // behind notify while it runs (programmatic dependent launch).
  const bool dispatch_follows = !host_counts || overlap;
  // A receive slab for the outputs: the senders then write them in place (none in worst-case
  // mode, whose outputs a CUDA graph may keep, nor while capturing).
  k.slabs = st->slabs != nullptr;
  if (host_counts && !capture) k.lease = lendSlab(st->slabs, stream);
  const int ticket = rt.notify(
      k.per_rank.data_ptr<int>(), k.per_expert.data_ptr<int>(), static_cast<int>(a.num_experts),
      static_cast<int>(a.expert_alignment), static_cast<int>(a.num_worst_tokens),
      k.recv_counts.data_ptr<int>(), k.recv_prefix.data_ptr<int>(),
      k.recv_per_expert.data_ptr<int>(), host_counts, stream, layout_error, dispatch_follows,
      k.lease ? k.lease->index() : -1, k.slabs ? k.dest_slabs.data_ptr<int>() : nullptr);
  stages.mark("layout+notify");

  int64_t rows = a.num_worst_tokens;
  if (overlap) {
    rows = worstCaseRows(gathered);
  }
  DispatchResult out;
  // Read per call: Options.num_sms may change on a live group.
  const int num_sms = static_cast<int>(pg.options()->num_sms);
  if (overlap) {
    // The kernel reads the receive prefix notify leaves on the device; a rejected routing
    // (an invalid topk_idx on some rank) makes it move nothing, on every rank alike.
    allocateAndLaunch(rt, a, k, rows, overlap, num_sms, stream, out);
    stages.mark("alloc+launch");
  }
  st->routings.prune();
  const CountWait wait_counts{
      st,     &rt,          st->generation, ticket, given_layout, device.index(),
      stream, pg.getRank(), a.num_experts,  k.topk};
  if (overlap && deferred != nullptr) {
    // The count wait and what follows it run when the caller calls *deferred, so that it can
    // build its own result objects while the GPU still runs notify.
    out.num_recv_tokens_per_expert_host = at::empty({0}, at::TensorOptions().dtype(at::kLong));
    *deferred = FinishDeferredDispatch{wait_counts, out, st, k.send_pos, k.recv_prefix};
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
    allocateAndLaunch(rt, a, k, rows, overlap, num_sms, stream, out);
    stages.mark("alloc+launch");
  }
  out.num_recv_tokens_per_expert_host = host_per_expert;
  st->routings.remember(out.routing, k.send_pos, k.recv_prefix, std::move(host_routing_counts));
  stages.mark("remember");
  return out;
}

}  // namespace ep::nvlink

#endif  // EP_WITH_CUDA
