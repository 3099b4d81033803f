// The "ep" c10d backend: one instance serves CPU and CUDA tensors of a process group.
//
// Standard collectives are routed by the device of their tensors: CPU tensors go to an internal
// Gloo backend, CUDA tensors to an internal NCCL backend (both built by the Python creator and
// handed in). Reductions Gloo lacks (AVG, PREMUL_SUM) are composed here from SUM.
#pragma once

#include <array>
#include <atomic>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "backend/topology.hpp"

namespace ep {

class Transport;

constexpr std::chrono::milliseconds kEPDefaultTimeout = std::chrono::minutes(30);

// Options of an "ep" group: pass an instance as `pg_options` to init_process_group/new_group.
struct EPOptions : c10d::Backend::Options {
  explicit EPOptions(std::chrono::milliseconds timeout = kEPDefaultTimeout)
      : c10d::Backend::Options("ep", timeout) {}
  EPOptions(const EPOptions&) = default;

  // SMs the high-throughput MoE kernels may use, so compute can overlap with communication.
  int64_t num_sms = 24;
  // Seconds a kernel spin-wait may stall before the op fails naming the stalled peer.
  double kernel_timeout_s = 60.0;
  // Dispatch (without num_worst_tokens) launches its kernel before the host waits for the
  // receive counts, so the wait overlaps the transfer; its outputs are then views of storage
  // sized for the worst case (every token of every rank). False: exact storage, and the kernel
  // starts only after the host has the counts.
  bool overlap_dispatch_host_wait = true;
  // Receive slabs per GPU for the nvlink dispatch: peer-mapped memory the senders write a
  // dispatch's outputs into directly (no copy out of the receive buffer). Each holds one
  // dispatch's outputs at the largest shape seen (every token of every rank); a slab is lent
  // again once every output tensor viewing it is freed, and a dispatch finding none free writes
  // its outputs to ordinary tensors. 0: never.
  int64_t recv_slabs = 2;
  // Ranks per node for emulated internode runs: 0 (default) finds the nodes from the ranks'
  // hosts; k in 1..8 splits each host's ranks into nodes of k consecutive ranks, so the legs
  // between them take the internode path. EP_RANKS_PER_NODE sets it where this is 0.
  int64_t ranks_per_node = 0;
  // low_latency_combine rounds each expert rank's sum of a token's entries (when the rank holds
  // more than one of them) to BF16 before the token side adds the ranks' sums: on the NVSHMEM
  // kernels those sums then cross the link in half the bytes; every transport gives the same
  // bits (reference.low_latency_combine(per_rank_partials=torch.bfloat16)).
  bool low_latency_combine_bf16_partials = false;
};

class EPProcessGroup : public c10d::Backend {
 public:
  // Makes the child backend of a split: (store, this rank in the child, child size, options).
  using SplitFactory = std::function<c10::intrusive_ptr<c10d::Backend>(
      const c10::intrusive_ptr<c10d::Store>&, int, int, const c10::intrusive_ptr<EPOptions>&)>;

  EPProcessGroup(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                 c10::intrusive_ptr<EPOptions> options,
                 c10::intrusive_ptr<c10d::Backend> cpu_backend,
                 c10::intrusive_ptr<c10d::Backend> cuda_backend);
  ~EPProcessGroup() override;
  // Called when the last strong reference goes (weak references, as in the group-name registry,
  // delay the destructor): releases the inner backends and transports right away.
  void release_resources() override;

  const std::string getBackendName() const override { return "ep"; }
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override { return options_; }
  const c10::intrusive_ptr<EPOptions>& options() const { return options_; }
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }
  // Number of the next MoE call on this group (the same on every rank that calls in order).
  uint64_t nextMoeCall() { return moe_seq_++; }
  // Test hook: moves this rank's MoE call counter by `delta`, as if it had made (or skipped)
  // calls its peers did not; the next agreement then names both calls.
  void shiftMoeCalls(int64_t delta) { moe_seq_ += static_cast<uint64_t>(delta); }

  // Why this group's MoE calls can no longer run on this rank ("" while they can): set once a
  // call's agreement timed out here (the ranks' calls are out of step from then on) or the group
  // was aborted. Later MoE calls raise this reason at once instead of waiting for a timeout.
  void markMoeUnusable(const std::string& why);
  std::string moeUnusableReason() const;
  bool moeUsable() const { return !moe_unusable_.load(std::memory_order_acquire); }

  // Makes this backend findable by its process group's name (see byGroupName).
  void registerGroupName(const std::string& group_name);
  // The "ep" backend of the group named `group_name`, or null. Works also when torch wraps the
  // backend (TORCH_DISTRIBUTED_DEBUG=DETAIL), where the group's backend is the wrapper.
  static c10::intrusive_ptr<EPProcessGroup> byGroupName(const std::string& group_name);

  // The internal backend serving `device_type`; throws if the group has none for it.
  c10::intrusive_ptr<c10d::Backend> innerBackend(c10::DeviceType device_type, const char* op) const;
  bool hasCudaBackend() const { return cuda_ != nullptr; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& output_tensors,
                                           std::vector<at::Tensor>& input_tensors,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& input_list,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& output_tensors,
                                        std::vector<at::Tensor>& input_tensors,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& output_tensors,
                                         std::vector<std::vector<at::Tensor>>& input_tensors,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& output_tensors,
                                                std::vector<std::vector<at::Tensor>>& input_tensors,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& output_tensors,
                                          std::vector<at::Tensor>& input_tensors,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // Gloo's monitored barrier, over the internal CPU backend: raises on rank 0 naming the ranks
  // that did not arrive within opts.timeout (all of them with `wait_all_ranks`).
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;

  void setTimeout(std::chrono::milliseconds timeout) override;
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;

  // Coalescing (batch_isend_irecv, _coalescing_manager with a device): CUDA ops are grouped by
  // the NCCL backend; CPU ops run as issued and the coalesced Work waits for all of them.
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  bool supportsSplitting() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> split(
      const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
      const c10::intrusive_ptr<c10d::Backend::Options>& opts) override;
  void setSplitFactory(SplitFactory factory) { split_factory_ = std::move(factory); }
  void eagerConnectSingleDevice(at::Device device) override;

  void abort() override;
  void shutdown() override;
  // Runs `hook` once when the group shuts down (or is destroyed): frees transport resources.
  void addShutdownHook(std::function<void()> hook);
  bool isShutdown() const { return shutdown_.load(); }

  // The transport serving each op family (backend/transport.hpp, indexed by OpFamily), chosen
  // at the family's first call on CUDA tensors; null before.
  std::array<Transport*, 3>& chosenTransports() { return chosen_transports_; }

  // The group's nodes (backend/topology.hpp): set once at group creation by the Python creator
  // (ep_backend/topology.py), before any MoE call; one node of every rank until then.
  const Topology& topology() const { return topology_; }
  void setTopology(Topology topology);

 private:
  // all_to_all_single on ep's kernels (the group's all-to-all transport): null when they do not
  // serve the call, which then goes to the inner backend.
  c10::intrusive_ptr<c10d::Work> kernelAlltoall(at::Tensor& output, const at::Tensor& input,
                                                const std::vector<int64_t>& output_split_sizes,
                                                const std::vector<int64_t>& input_split_sizes,
                                                const c10d::AllToAllOptions& opts);
  c10::intrusive_ptr<c10d::Backend> route(const at::Tensor& tensor, const char* op);
  c10::intrusive_ptr<c10d::Backend> route(const std::vector<at::Tensor>& tensors, const char* op);
  void checkAlive(const char* op) const;
  // Records `work` for endCoalescing while coalescing CPU ops; returns it unchanged.
  c10::intrusive_ptr<c10d::Work> track(c10::intrusive_ptr<c10d::Work> work);

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<EPOptions> options_;
  c10::intrusive_ptr<c10d::Backend> cpu_;
  // Whether the inner Gloo has a list all_to_all (torch >= 2.13); learnt at the first call.
  std::atomic<bool> cpuHasListAlltoall_{true};
  c10::intrusive_ptr<c10d::Backend> cuda_;
  SplitFactory split_factory_;
  std::mutex split_mutex_;
  // splitGroup may ask each device type of a group to split; both must get the same child.
  std::map<std::string, c10::intrusive_ptr<c10d::Backend>> split_children_;
  std::atomic<uint64_t> seq_{0};
  std::atomic<uint64_t> moe_seq_{0};
  std::atomic<bool> moe_unusable_{false};
  mutable std::mutex moe_unusable_mutex_;
  std::string moe_unusable_reason_;
  // shutdown() ran its hooks (abort() alone does not: kernels may still be running).
  std::atomic<bool> shutdown_hooks_ran_{false};
  bool coalescing_ = false;
  bool cuda_coalescing_started_ = false;
  std::vector<c10::intrusive_ptr<c10d::Work>> coalesced_cpu_works_;
  std::atomic<bool> shutdown_{false};
  std::mutex hooks_mutex_;
  std::vector<std::function<void()>> shutdown_hooks_;
  void runShutdownHooks();
  std::array<Transport*, 3> chosen_transports_{};
  Topology topology_;
};

}  // namespace ep
