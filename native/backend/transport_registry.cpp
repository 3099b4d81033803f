// The transports, fastest first, ATen last (it serves every call). Adding a transport: one line
// here, plus its folder under native/transports/.
#include <c10/util/Exception.h>

#include <array>
#include <vector>

#include "backend/ep_process_group.hpp"
#include "backend/transport.hpp"
#include "transports/aten/aten_transport.hpp"
#include "transports/internode/internode_transport.hpp"
#include "transports/nvlink/nvlink_transport.hpp"
#include "transports/nvshmem/nvshmem_transport.hpp"

namespace ep {
namespace {

const std::vector<Transport*>& registry() {
  static const std::vector<Transport*> transports = {
#ifdef EP_WITH_CUDA
      &nvlinkTransport(),
      &internodeTransport(),  // groups of several nodes (the NVLink transport declines them)
      &nvshmemTransport(),
#endif
      &atenTransport(),
  };
  return transports;
}

}  // namespace

const char* transportName(TransportKind kind) {
  switch (kind) {
    case TransportKind::kNvlink:
      return "nvlink";
    case TransportKind::kNvshmem:
      return "nvshmem";
    case TransportKind::kAten:
      return "aten";
    case TransportKind::kInternode:
      return "internode";
    case TransportKind::kUndecided:
      break;
  }
  return "undecided";
}

std::string TransportChoice::describe() const {
  if (kind == TransportKind::kAten) return "aten: " + reason;
  return transportName(kind);
}

Transport& transportFor(EPProcessGroup& pg, OpFamily family, const at::Device& device) {
  Transport*& chosen = pg.chosenTransports()[static_cast<size_t>(family)];
  if (chosen != nullptr) return *chosen;
  for (Transport* t : registry()) {
    if (!t->serves(family)) continue;
    if (t->kind() == TransportKind::kAten || t->usable(pg, device).yes()) {
      chosen = t;
      break;
    }
  }
  return *chosen;
}

Transport& firstTransport(OpFamily family) {
  for (Transport* t : registry()) {
    if (t->serves(family)) return *t;
  }
  return atenTransport();
}

bool recordStreamOnTransports(const at::Tensor& tensor, const c10::Stream& stream) {
  for (Transport* t : registry()) {
    if (t->recordStream(tensor, stream)) return true;
  }
  return false;
}

Transport& layoutTransport(int64_t num_ranks) {
  for (Transport* t : registry()) {
    if (t->serves(OpFamily::kHighThroughput) && num_ranks <= t->maxLayoutRanks()) return *t;
  }
  return atenTransport();
}

TransportChoice transportChoice(EPProcessGroup& pg, OpFamily family) {
  TransportChoice choice{TransportKind::kAten, "built without CUDA", false};
  bool first = true;
  for (Transport* t : registry()) {
    if (!t->serves(family) || t->kind() == TransportKind::kAten) continue;
    const std::optional<Verdict> v = t->verdict(pg);
    if (!v.has_value()) return {TransportKind::kUndecided, "", false};
    if (v->yes()) return {t->kind(), first ? "" : choice.reason, false};
    if (first) choice = {TransportKind::kAten, v->why_not, v->requested_aten};
    first = false;
  }
  return choice;
}

// An op a transport does not serve: the registry never hands it such a call.
namespace {
[[noreturn]] void notServed(const Transport& t, const char* op) {
  TORCH_CHECK(false, "ep: the ", transportName(t.kind()), " transport does not serve ", op);
}
}  // namespace

LayoutTensors Transport::layout(const at::Tensor&, int64_t, int64_t) {
  notServed(*this, "dispatch_layout");
}
LayoutTensors Transport::layoutIgnoringInvalid(const at::Tensor& topk_idx, int64_t num_experts,
                                               int64_t num_ranks) {
  const at::Tensor invalid = topk_idx.lt(-1).logical_or(topk_idx.ge(num_experts));
  return layout(topk_idx.masked_fill(invalid, -1), num_experts, num_ranks);
}
DispatchResult Transport::dispatch(EPProcessGroup&, const DispatchArgs&, DeferredCounts*) {
  notServed(*this, "dispatch");
}
std::pair<at::Tensor, std::optional<at::Tensor>> Transport::cachedDispatch(
    EPProcessGroup&, const at::Tensor&, const std::optional<at::Tensor>&, const DispatchRouting&) {
  notServed(*this, "cached dispatch");
}
std::pair<at::Tensor, std::optional<at::Tensor>> Transport::combine(EPProcessGroup&,
                                                                    const CombineArgs&) {
  notServed(*this, "combine");
}
std::optional<std::vector<int64_t>> Transport::reserve(EPProcessGroup&, const at::Device&,
                                                       const at::Tensor&) {
  return std::nullopt;
}
std::string Transport::takePendingError(EPProcessGroup&, const char*) {
  return "";
}
bool Transport::graphCaptured(EPProcessGroup&) {
  return false;
}
bool Transport::recordStream(const at::Tensor&, const c10::Stream&) {
  return false;
}
c10::intrusive_ptr<c10d::Work> Transport::allToAll(EPProcessGroup&, at::Tensor&, const at::Tensor&,
                                                   const std::vector<int64_t>&,
                                                   const std::vector<int64_t>&, bool) {
  return nullptr;
}
bool Transport::allToAllDeviceSplits(EPProcessGroup&, const at::Tensor&, const at::Tensor&,
                                     const at::Tensor&, int64_t, const at::Tensor&,
                                     const at::Tensor&) {
  return false;
}
LowLatencyDispatchResult Transport::lowLatencyDispatch(EPProcessGroup&,
                                                       const LowLatencyDispatchInputs&, bool) {
  notServed(*this, "low_latency_dispatch");
}
std::optional<at::Tensor> Transport::lowLatencyCombine(EPProcessGroup&,
                                                       const LowLatencyCombineInputs&) {
  notServed(*this, "low_latency_combine");
}

}  // namespace ep
