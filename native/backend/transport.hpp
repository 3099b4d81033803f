// The transport interface: what serves a group's MoE collectives on CUDA tensors. Each transport
// lives in its own folder under native/transports/ and implements this class; the registry
// (transport_registry.cpp) lists them fastest first, with ATen last, and the ops ask it for the
// first one that can serve the group. Adding a transport: its folder, plus one line in
// transport_registry.cpp.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backend/moe_types.hpp"

namespace ep {

class EPProcessGroup;

// One name per transport, in native code and in Python (ep_backend._C.TransportKind).
enum class TransportKind : int8_t {
  kUndecided = 0,  // the group has not made its first call of that family on CUDA yet
  kNvlink = 1,     // native/transports/nvlink: CUDA IPC peer buffers, one host, <= 8 GPUs
  kNvshmem = 2,    // native/transports/nvshmem: NVSHMEM symmetric heap (low-latency ops)
  kAten = 3,       // native/transports/aten: ATen + the inner Gloo/NCCL group, serves every call
  kInternode = 4,  // native/transports/internode: NVSHMEM puts between nodes + NVLink inside
};

const char* transportName(TransportKind kind);

// The two op families a transport may serve.
enum class OpFamily : int8_t {
  kHighThroughput = 0,  // layout, dispatch, cached dispatch, combine, reserve
  kLowLatency = 1,      // low_latency_dispatch / low_latency_combine
  kAllToAll = 2,        // all_to_all_single / all_to_all / all_to_all_v on CUDA tensors
};
constexpr size_t kNumOpFamilies = 3;

// Which transport serves a family of a group's ops, and why: `reason` says why a faster
// transport does not serve it (empty when the first transport does); `requested` when that is
// because the user asked for ATen (EP_HIGH_THROUGHPUT=aten / EP_LOW_LATENCY=aten).
struct TransportChoice {
  TransportKind kind = TransportKind::kUndecided;
  std::string reason;
  bool requested = false;
  // As the Python properties high_throughput_transport / low_latency_transport read:
  // "nvlink", "nvshmem", "undecided" or "aten: <reason>".
  std::string describe() const;
};

// A transport's answer to "can you serve this group?": yes (empty), or why not.
struct Verdict {
  std::string why_not;
  bool requested_aten = false;  // the user asked for the ATen fallback
  bool yes() const { return why_not.empty(); }
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual TransportKind kind() const = 0;
  virtual bool serves(OpFamily family) const = 0;
  // The largest group the transport's layout kernel serves (larger groups: the ATen layout).
  virtual int64_t maxLayoutRanks() const { return 0; }

  // Whether this transport serves `pg`'s calls on tensors of `device`. Collective the first time
  // (every rank reaches the same verdict), remembered for the group after.
  virtual Verdict usable(EPProcessGroup& pg, const at::Device& device) = 0;
  // The verdict so far, without deciding: nullopt before the group's first call.
  virtual std::optional<Verdict> verdict(EPProcessGroup& pg) = 0;

  // High-throughput ops (OpFamily::kHighThroughput).
  virtual LayoutTensors layout(const at::Tensor& topk_idx, int64_t num_experts, int64_t num_ranks);
  // The layout of a routing whose out-of-range ids (outside [-1, E)) the caller counts and
  // raises itself: they count as -1 here, and nothing records or raises them. The default masks
  // them with ATen, then takes layout().
  virtual LayoutTensors layoutIgnoringInvalid(const at::Tensor& topk_idx, int64_t num_experts,
                                              int64_t num_ranks);
  virtual DispatchResult dispatch(EPProcessGroup& pg, const DispatchArgs& args,
                                  DeferredCounts* deferred);
  virtual std::pair<at::Tensor, std::optional<at::Tensor>> cachedDispatch(
      EPProcessGroup& pg, const at::Tensor& x, const std::optional<at::Tensor>& x_scales,
      const DispatchRouting& routing);
  virtual std::pair<at::Tensor, std::optional<at::Tensor>> combine(EPProcessGroup& pg,
                                                                   const CombineArgs& args);

  // ep_backend.reserve, after its agreement step (`gathered`, see moe_reserve.hpp): builds or
  // grows the transport for calls up to those shapes (the max over ranks), so that later calls
  // and CUDA graph captures do not. Collective. Returns the capacity it holds (tokens per rank,
  // bytes per row, top-k, scales per row, experts per rank, receive slabs), or nullopt where the
  // transport has nothing to reserve (ATen).
  virtual std::optional<std::vector<int64_t>> reserve(EPProcessGroup& pg, const at::Device& device,
                                                      const at::Tensor& gathered);
  // The error a kernel of an earlier call left (a timeout naming the stalled peer, an overflow),
  // taken so that the next call reports it: "" when none.
  virtual std::string takePendingError(EPProcessGroup& pg, const char* op);
  // Whether a CUDA graph was captured with kernels on this group's buffers (which then never
  // grow); every call agrees on it across ranks.
  virtual bool graphCaptured(EPProcessGroup& pg);

  // Tensor.record_stream for a tensor whose storage this transport lent (the caching allocator
  // does not own it): true when the tensor was the transport's, false (nothing done) otherwise.
  virtual bool recordStream(const at::Tensor& tensor, const c10::Stream& stream);

  // All-to-all (OpFamily::kAllToAll). allToAll: dist.all_to_all_single with host split sizes
  // (rows of dim 0; empty: equal), CUDA tensors of one device, output written in place. Returns
  // the call's Work, or null when this transport does not serve it (the inner NCCL backend then
  // runs it). allToAllDeviceSplits: ep_backend.all_to_all_v(_2d) into `output` (capacity rows),
  // writing recv_splits / recv_offsets [E, R] int64; false when not served (the Python path over
  // the inner backend runs it).
  virtual c10::intrusive_ptr<c10d::Work> allToAll(EPProcessGroup& pg, at::Tensor& output,
                                                  const at::Tensor& input,
                                                  const std::vector<int64_t>& output_split_sizes,
                                                  const std::vector<int64_t>& input_split_sizes,
                                                  bool async_op);
  virtual bool allToAllDeviceSplits(EPProcessGroup& pg, const at::Tensor& input,
                                    const at::Tensor& splits, const at::Tensor& output,
                                    int64_t num_local_experts, const at::Tensor& recv_splits,
                                    const at::Tensor& recv_offsets);

  // Low-latency ops (OpFamily::kLowLatency). lowLatencyCombine: nullopt hands the call to the
  // next transport (the handle came from it).
  virtual LowLatencyDispatchResult lowLatencyDispatch(EPProcessGroup& pg,
                                                      const LowLatencyDispatchInputs& args,
                                                      bool send_only);
  virtual std::optional<at::Tensor> lowLatencyCombine(EPProcessGroup& pg,
                                                      const LowLatencyCombineInputs& args);
};

// The ATen transport: serves every call (CPU tensors always take it).
Transport& atenTransport();

// The transport that serves `pg`'s `family` ops on tensors of `device` (CUDA): the first of the
// registry whose usable() says yes, ATen last. Decided at the group's first call of the family
// (collectively), then one pointer read per call.
Transport& transportFor(EPProcessGroup& pg, OpFamily family, const at::Device& device);

// The transport asked first for `family` (the fastest registered): the one whose pending error
// and graph pin ep_backend.reserve agrees on before the group's transport is decided.
Transport& firstTransport(OpFamily family);

// Each transport's recordStream in turn, until one owns the tensor.
bool recordStreamOnTransports(const at::Tensor& tensor, const c10::Stream& stream);

// The transport whose layout kernel serves a group of `num_ranks` ranks on CUDA tensors (the
// layout op takes no group: the first transport whose maxLayoutRanks() admits it).
Transport& layoutTransport(int64_t num_ranks);

// What serves the family, and why (without deciding).
TransportChoice transportChoice(EPProcessGroup& pg, OpFamily family);

}  // namespace ep
