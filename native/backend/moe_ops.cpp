// TORCH_LIBRARY(ep): the MoE collectives as custom ops taking a group name, so they compose with
// torch.compile and autograd (fake kernels and autograd formulas live in ep_backend/moe.py).
// Absent optional outputs come back as empty tensors; the Python layer maps them to None.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "backend/ep_process_group.hpp"
#include "backend/moe_ops.hpp"
#include "backend/moe_validation.hpp"
#include "backend/transport.hpp"
#include "transports/aten/aten_transport.hpp"

namespace ep {
namespace {

using Tensors2 = std::tuple<at::Tensor, at::Tensor>;

// The group's backend, alive: a call on a destroyed (shut down) group raises here, on every rank
// alike, before any exchange (its agreement step would wait for peers that raised).
c10::intrusive_ptr<EPProcessGroup> resolveGroup(const std::string& group_name, const char* op) {
  auto ep = EPProcessGroup::byGroupName(group_name);
  if (!ep) {
    auto pg = c10d::resolve_process_group(group_name);
    auto backend = pg->getBackend(c10::DeviceType::CPU);
    ep = c10::dynamic_intrusive_pointer_cast<EPProcessGroup>(backend);
    TORCH_CHECK(ep != nullptr, "ep ", op, ": group '", group_name,
                "' does not use the \"ep\" backend (it uses '", backend->getBackendName(),
                "'); create it with backend=\"ep\"");
  }
  TORCH_CHECK(!ep->isShutdown(), "ep: ", op, " called on a process group that was shut down");
  return ep;
}

at::Tensor orEmpty(const std::optional<at::Tensor>& t, const at::Tensor& like) {
  return t.has_value() ? *t : at::empty({0}, like.options());
}

DispatchRouting routingOf(const at::Tensor& is_token_in_rank, const at::Tensor& num_tokens_per_rank,
                          const at::Tensor& num_recv_tokens_per_rank,
                          const at::Tensor& recv_src_idx, const at::Tensor& recv_src_rank) {
  return DispatchRouting{is_token_in_rank, num_tokens_per_rank, num_recv_tokens_per_rank,
                         recv_src_idx, recv_src_rank};
}

LayoutTensors dispatchLayoutOp(const at::Tensor& topk_idx, int64_t num_experts, int64_t num_ranks) {
  Transport& t = topk_idx.is_cuda() ? layoutTransport(num_ranks) : atenTransport();
  return t.layout(topk_idx, num_experts, num_ranks);
}

// With a layout passed in, is_token_in_rank and num_tokens_per_rank are those inputs: they come
// back empty (an op output may not alias an input) and the Python layer uses the layout's.
DispatchOutputs packDispatch(const DispatchResult& r, const at::Tensor& x, bool given_layout) {
  const at::Tensor& in_rank = r.routing.is_token_in_rank;
  return {r.recv_x,
          orEmpty(r.recv_x_scales, x),
          r.recv_topk_idx,
          orEmpty(r.recv_topk_weights, x),
          r.num_recv_tokens_per_expert,
          given_layout ? at::empty({0, in_rank.size(1)}, in_rank.options()) : in_rank,
          given_layout ? at::empty({0}, r.routing.num_tokens_per_rank.options())
                       : r.routing.num_tokens_per_rank,
          r.routing.num_recv_tokens_per_rank,
          r.routing.recv_src_idx,
          r.routing.recv_src_rank,
          r.num_recv_tokens_per_expert_host};
}

void rejectOp(const std::string& op, const std::string& message, const std::string& group_name) {
  auto pg = resolveGroup(group_name, op.c_str());
  rejectCollectively(*pg, op.c_str(), message);
}

Tensors2 quantizeFp8Op(const at::Tensor& x, bool round_scale, bool use_ue8m0) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 128 == 0,
              "ep quantize_fp8: H must be a multiple of 128");
  TORCH_CHECK(!use_ue8m0 || (round_scale && x.size(-1) % 512 == 0),
              "ep quantize_fp8: use_ue8m0 needs round_scale and H % 512 == 0");
  auto [q, s] = aten::quantizeFp8Per128(x, round_scale, use_ue8m0);
  return {q, s};
}

// The transport for a call on `x`: CUDA tensors ask the registry, CPU tensors take ATen.
// The kernels read x_scales row by row: a strided view (DeepEP's FP8 callers pass column-major
// scales) is copied to row-major first, as every transport sees it.
std::optional<at::Tensor> rowMajor(const std::optional<at::Tensor>& scales) {
  if (scales.has_value() && !scales->is_contiguous()) {
    return scales->contiguous();
  }
  return scales;
}

Transport& transportOf(EPProcessGroup& pg, OpFamily family, const at::Tensor& x) {
  return x.is_cuda() ? transportFor(pg, family, x.device()) : atenTransport();
}

DispatchOutputs dispatchOp(const at::Tensor& x, const std::optional<at::Tensor>& x_scales,
                           const at::Tensor& topk_idx,
                           const std::optional<at::Tensor>& topk_weights, int64_t num_experts,
                           int64_t expert_alignment, int64_t num_worst_tokens,
                           const std::string& group_name, at::TensorList layout) {
  auto pg = resolveGroup(group_name, "dispatch");
  DispatchArgs args{x,           rowMajor(x_scales), topk_idx,         topk_weights,
                    num_experts, expert_alignment,   num_worst_tokens, layout.vec()};
  Transport& t = transportOf(*pg, OpFamily::kHighThroughput, x);
  return packDispatch(t.dispatch(*pg, args, nullptr), x, !layout.empty());
}

}  // namespace

std::pair<DispatchOutputs, DeferredCounts> dispatchDeferred(
    const at::Tensor& x, const std::optional<at::Tensor>& x_scales, const at::Tensor& topk_idx,
    const std::optional<at::Tensor>& topk_weights, int64_t num_experts, int64_t expert_alignment,
    int64_t num_worst_tokens, const std::string& group_name,
    const std::vector<at::Tensor>& layout) {
  RECORD_FUNCTION("ep::dispatch", std::vector<c10::IValue>());  // as the op shows in a profile
  DeferredCounts second;
  auto pg = resolveGroup(group_name, "dispatch");
  DispatchArgs args{x,           rowMajor(x_scales), topk_idx,         topk_weights,
                    num_experts, expert_alignment,   num_worst_tokens, layout};
  Transport& t = transportOf(*pg, OpFamily::kHighThroughput, x);
  DispatchOutputs outputs = packDispatch(t.dispatch(*pg, args, &second), x, !layout.empty());
  return {std::move(outputs), std::move(second)};
}

namespace {

Tensors2 cachedDispatchOp(const at::Tensor& x, const std::optional<at::Tensor>& x_scales,
                          const at::Tensor& is_token_in_rank, const at::Tensor& num_tokens_per_rank,
                          const at::Tensor& num_recv_tokens_per_rank,
                          const at::Tensor& recv_src_idx, const at::Tensor& recv_src_rank,
                          const std::string& group_name) {
  auto pg = resolveGroup(group_name, "cached dispatch");
  Transport& t = transportOf(*pg, OpFamily::kHighThroughput, x);
  auto [recv_x, recv_scales] =
      t.cachedDispatch(*pg, x, rowMajor(x_scales),
                       routingOf(is_token_in_rank, num_tokens_per_rank, num_recv_tokens_per_rank,
                                 recv_src_idx, recv_src_rank));
  return {recv_x, orEmpty(recv_scales, x)};
}

Tensors2 combineOp(const at::Tensor& x, const std::optional<at::Tensor>& topk_weights,
                   const std::optional<at::Tensor>& bias0, const std::optional<at::Tensor>& bias1,
                   const at::Tensor& is_token_in_rank, const at::Tensor& num_tokens_per_rank,
                   const at::Tensor& num_recv_tokens_per_rank, const at::Tensor& recv_src_idx,
                   const at::Tensor& recv_src_rank, const std::string& group_name) {
  auto pg = resolveGroup(group_name, "combine");
  CombineArgs args{x, topk_weights, bias0, bias1,
                   routingOf(is_token_in_rank, num_tokens_per_rank, num_recv_tokens_per_rank,
                             recv_src_idx, recv_src_rank)};
  auto [combined, weights] = transportOf(*pg, OpFamily::kHighThroughput, x).combine(*pg, args);
  return {combined, orEmpty(weights, x)};
}

// Low-latency ops: on CUDA the NVSHMEM kernels where the group can use them (see
// nvshmem_transport.hpp), else ATen + NCCL; results are identical either way.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> lowLatencyDispatchOp(
    const at::Tensor& x, const at::Tensor& topk_idx, int64_t num_max_dispatch_tokens_per_rank,
    int64_t num_experts, bool use_fp8, bool round_scale, bool use_ue8m0,
    const std::string& group_name, bool send_only) {
  auto pg = resolveGroup(group_name, "low_latency_dispatch");
  LowLatencyDispatchInputs args{
      x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0};
  auto r = transportOf(*pg, OpFamily::kLowLatency, x).lowLatencyDispatch(*pg, args, send_only);
  return {r.recv_x, orEmpty(r.recv_x_scales, x), r.recv_count, r.src_info, r.layout_range};
}

at::Tensor lowLatencyCombineOp(const at::Tensor& x, const at::Tensor& topk_idx,
                               const at::Tensor& topk_weights, const at::Tensor& src_info,
                               const at::Tensor& layout_range,
                               int64_t num_max_dispatch_tokens_per_rank,
                               const std::string& group_name) {
  auto pg = resolveGroup(group_name, "low_latency_combine");
  LowLatencyCombineInputs args{x,        topk_idx,     topk_weights,
                               src_info, layout_range, num_max_dispatch_tokens_per_rank};
  if (auto out = transportOf(*pg, OpFamily::kLowLatency, x).lowLatencyCombine(*pg, args)) {
    return *out;
  }
  return *atenTransport().lowLatencyCombine(*pg, args);  // the handle came from ATen
}

}  // namespace

TORCH_LIBRARY(ep, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  m.def(
      "dispatch_layout(Tensor topk_idx, int num_experts, int num_ranks) -> (Tensor, Tensor, "
      "Tensor, Tensor)",
      tags);
  m.def(
      "dispatch(Tensor x, Tensor? x_scales, Tensor topk_idx, Tensor? topk_weights, int "
      "num_experts, "
      "int expert_alignment, int num_worst_tokens, str group_name, Tensor[] layout) -> "
      "(Tensor recv_x, "
      "Tensor recv_x_scales, Tensor recv_topk_idx, Tensor recv_topk_weights, "
      "Tensor num_recv_tokens_per_expert, Tensor is_token_in_rank, Tensor num_tokens_per_rank, "
      "Tensor num_recv_tokens_per_rank, Tensor recv_src_idx, Tensor recv_src_rank, "
      "Tensor num_recv_tokens_per_expert_host)",
      tags);
  m.def(
      "cached_dispatch(Tensor x, Tensor? x_scales, Tensor is_token_in_rank, "
      "Tensor num_tokens_per_rank, Tensor num_recv_tokens_per_rank, Tensor recv_src_idx, "
      "Tensor recv_src_rank, str group_name) -> (Tensor recv_x, Tensor recv_x_scales)",
      tags);
  m.def(
      "combine(Tensor x, Tensor? topk_weights, Tensor? bias0, Tensor? bias1, "
      "Tensor is_token_in_rank, Tensor num_tokens_per_rank, Tensor num_recv_tokens_per_rank, "
      "Tensor recv_src_idx, Tensor recv_src_rank, str group_name) -> (Tensor combined_x, "
      "Tensor combined_topk_weights)",
      tags);
  m.def(
      "low_latency_dispatch(Tensor x, Tensor topk_idx, int num_max_dispatch_tokens_per_rank, "
      "int num_experts, bool use_fp8, bool round_scale, bool use_ue8m0, str group_name, "
      "bool send_only=False) -> "
      "(Tensor recv_x, Tensor recv_x_scales, Tensor recv_count, Tensor src_info, "
      "Tensor layout_range)",
      tags);
  m.def(
      "low_latency_combine(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor src_info, "
      "Tensor layout_range, int num_max_dispatch_tokens_per_rank, str group_name) -> Tensor",
      tags);
  m.def("quantize_fp8(Tensor x, bool round_scale, bool use_ue8m0) -> (Tensor, Tensor)", tags);
  // The agreement step of a rank whose arguments the Python layer rejected: its peers raise
  // instead of waiting for it (it always raises; see moe_validation.hpp, rejectCollectively).
  m.def("reject(str op, str message, str group_name) -> ()", &rejectOp);
}

TORCH_LIBRARY_IMPL(ep, CompositeExplicitAutograd, m) {
  m.impl("dispatch_layout", &dispatchLayoutOp);
  m.impl("quantize_fp8", &quantizeFp8Op);
}

namespace {

// CPU and CUDA tensors alike: each op asks the registry (transportOf) which transport serves it;
// CPU tensors always take ATen. Every result is identical whichever transport runs.
void implementTransportOps(torch::Library& m) {
  m.impl("dispatch", &dispatchOp);
  m.impl("cached_dispatch", &cachedDispatchOp);
  m.impl("combine", &combineOp);
  m.impl("low_latency_dispatch", &lowLatencyDispatchOp);
  m.impl("low_latency_combine", &lowLatencyCombineOp);
}

}  // namespace

TORCH_LIBRARY_IMPL(ep, CUDA, m) {
  implementTransportOps(m);
}

TORCH_LIBRARY_IMPL(ep, CPU, m) {
  implementTransportOps(m);
}

}  // namespace ep
