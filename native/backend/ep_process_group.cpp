#include "backend/ep_process_group.hpp"
#include "backend/transport.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <map>
#include <mutex>
#include <numeric>
#include <sstream>

#include "backend/moe_validation.hpp"

namespace ep {
namespace {

bool isComposedReduction(const c10d::ReduceOp& op) {
  return op.op_ == c10d::ReduceOp::AVG || op.op_ == c10d::ReduceOp::PREMUL_SUM;
}

void checkFloatingForAvg(const at::Tensor& t, const char* op) {
  TORCH_CHECK(at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()), "ep: ", op,
              " with ReduceOp.AVG needs floating-point tensors, got ", t.scalar_type());
}

// Multiplies `t` in place by the PREMUL_SUM factor of `op` (no-op for other reductions).
void premultiply(at::Tensor& t, const c10d::ReduceOp& op) {
  if (op.op_ != c10d::ReduceOp::PREMUL_SUM) {
    return;
  }
  auto* supplement = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK(supplement != nullptr, "ep: PREMUL_SUM reduction without a factor");
  if (supplement->tensor_factor.defined()) {
    t.mul_(supplement->tensor_factor.to(t.device(), t.scalar_type()));
  } else {
    t.mul_(supplement->double_factor);
  }
}

// A copy of `t` pre-scaled for PREMUL_SUM, so user inputs are never modified.
at::Tensor stagedInput(const at::Tensor& t, const c10d::ReduceOp& op) {
  if (op.op_ != c10d::ReduceOp::PREMUL_SUM) {
    return t;
  }
  at::Tensor copy = t.clone();
  premultiply(copy, op);
  return copy;
}

c10d::ReduceOp sumOp() {
  return c10d::ReduceOp(c10d::ReduceOp::SUM);
}

// Wraps an inner Work and applies `post` (e.g. AVG's division) exactly once after it finished,
// before wait() returns or is_completed() reports true, so callers never see a partial result.
// Not every Gloo work offers a future, so this cannot be a plain future chain.
class PostProcessWork : public c10d::Work {
 public:
  PostProcessWork(c10::intrusive_ptr<c10d::Work> inner, std::function<void()> post)
      : c10d::Work(-1, c10d::OpType::UNKNOWN), inner_(std::move(inner)), post_(std::move(post)) {}

  bool isCompleted() override {
    if (!inner_->isCompleted()) {
      return false;
    }
    if (inner_->isSuccess()) {
      runPost();
    }
    return true;
  }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  bool wait(std::chrono::milliseconds timeout) override {
    const bool ok = inner_->wait(timeout);
    runPost();
    return ok;
  }
  void synchronize() override {
    inner_->synchronize();
    runPost();
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto future = inner_->getFuture();
    auto self = c10::intrusive_ptr<PostProcessWork>::reclaim_copy(this);
    return future->then(
        [self](c10::ivalue::Future& done) -> c10::IValue {
          if (done.hasError()) {
            std::rethrow_exception(done.exception_ptr());
          }
          self->runPost();
          return done.value();
        },
        future->elementType());
  }

 private:
  void runPost() { std::call_once(post_once_, post_); }

  c10::intrusive_ptr<c10d::Work> inner_;
  std::function<void()> post_;
  std::once_flag post_once_;
};

c10::intrusive_ptr<c10d::Work> thenApply(const c10::intrusive_ptr<c10d::Work>& inner,
                                         std::function<void()> post) {
  if (!inner) {  // a synchronous NCCL op returns no Work: it is already queued on the stream
    post();
    return inner;
  }
  return c10::make_intrusive<PostProcessWork>(inner, std::move(post));
}

void divideBy(const std::vector<at::Tensor>& tensors, int size) {
  for (const auto& t : tensors) {
    const_cast<at::Tensor&>(t).div_(size);
  }
}

// allreduce / allreduce_coalesced: `reduce(opts)` on the routed backend, unless that is the CPU
// backend (`on_cpu`) and the reduction one it lacks (AVG, PREMUL_SUM): then the tensors are
// scaled in place, summed by `reduce(sum_opts)`, and divided by `size` for AVG. The result
// overwrites the tensors on every rank, so scaling them in place is safe.
template <typename Options, typename Reduce>
c10::intrusive_ptr<c10d::Work> allreduceInPlace(std::vector<at::Tensor>& tensors,
                                                const Options& opts, const char* op, bool on_cpu,
                                                int size, Reduce reduce) {
  if (!on_cpu || !isComposedReduction(opts.reduceOp)) {
    return reduce(opts);
  }
  for (auto& t : tensors) {
    if (opts.reduceOp.op_ == c10d::ReduceOp::AVG) {
      checkFloatingForAvg(t, op);
    }
    premultiply(t, opts.reduceOp);
  }
  Options sum_opts = opts;
  sum_opts.reduceOp = sumOp();
  auto work = reduce(sum_opts);
  if (opts.reduceOp.op_ != c10d::ReduceOp::AVG) {
    return work;
  }
  return thenApply(work, [tensors, size] { divideBy(tensors, size); });
}

}  // namespace

EPProcessGroup::EPProcessGroup(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                               c10::intrusive_ptr<EPOptions> options,
                               c10::intrusive_ptr<c10d::Backend> cpu_backend,
                               c10::intrusive_ptr<c10d::Backend> cuda_backend)
    : c10d::Backend(rank, size),
      store_(std::move(store)),
      options_(std::move(options)),
      cpu_(std::move(cpu_backend)),
      cuda_(std::move(cuda_backend)) {
  TORCH_CHECK(options_ != nullptr, "ep: options must not be None");
  TORCH_CHECK(cpu_ != nullptr, "ep: the group needs an internal CPU backend");
  topology_ = Topology::singleNode(size);
  init();
}

void EPProcessGroup::setTopology(Topology topology) {
  const int n = getSize();
  TORCH_CHECK(static_cast<int>(topology.node_of_rank.size()) == n &&
                  static_cast<int>(topology.local_rank.size()) == n,
              "ep: a topology must name the node and local index of each of the ", n, " ranks");
  TORCH_CHECK(topology.num_nodes >= 1 && topology.num_nodes <= n, "ep: a topology of ", n,
              " ranks cannot have ", topology.num_nodes, " nodes");
  for (int r = 0; r < n; ++r) {
    TORCH_CHECK(topology.node_of_rank[r] >= 0 && topology.node_of_rank[r] < topology.num_nodes,
                "ep: rank ", r, "'s node ", topology.node_of_rank[r], " is outside [0, ",
                topology.num_nodes, ")");
  }
  TORCH_CHECK(chosen_transports_[0] == nullptr && chosen_transports_[1] == nullptr,
              "ep: the topology is fixed once a transport has been chosen");
  topology_ = std::move(topology);
}

namespace {
std::mutex& namesMutex() {
  static std::mutex m;
  return m;
}
// Leaked on purpose: destroying it at process exit would run backend destructors (weak
// references keep them) after the libraries they use are gone.
std::map<std::string, c10::weak_intrusive_ptr<EPProcessGroup>>& names() {
  static auto* n = new std::map<std::string, c10::weak_intrusive_ptr<EPProcessGroup>>();
  return *n;
}
}  // namespace

void EPProcessGroup::registerGroupName(const std::string& group_name) {
  std::lock_guard<std::mutex> lock(namesMutex());
  names().insert_or_assign(group_name, c10::weak_intrusive_ptr<EPProcessGroup>(
                                           c10::intrusive_ptr<EPProcessGroup>::reclaim_copy(this)));
}

c10::intrusive_ptr<EPProcessGroup> EPProcessGroup::byGroupName(const std::string& group_name) {
  std::lock_guard<std::mutex> lock(namesMutex());
  auto it = names().find(group_name);
  if (it == names().end()) {
    return nullptr;
  }
  auto strong = it->second.lock();
  if (!strong) {
    names().erase(it);
  }
  return strong;
}

EPProcessGroup::~EPProcessGroup() {
  runShutdownHooks();
}

void EPProcessGroup::release_resources() {
  runShutdownHooks();
  {
    std::lock_guard<std::mutex> lock(split_mutex_);
    split_factory_ = nullptr;
    split_children_.clear();
  }
  cpu_.reset();
  cuda_.reset();
  store_.reset();
}

void EPProcessGroup::addShutdownHook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(hooks_mutex_);
  shutdown_hooks_.push_back(std::move(hook));
}

void EPProcessGroup::runShutdownHooks() {
  std::vector<std::function<void()>> hooks;
  {
    std::lock_guard<std::mutex> lock(hooks_mutex_);
    hooks.swap(shutdown_hooks_);
  }
  for (auto& hook : hooks) {
    try {
      hook();
    } catch (const std::exception& e) {
      TORCH_WARN("ep: error while releasing group resources: ", e.what());
    }
  }
}

void EPProcessGroup::markMoeUnusable(const std::string& why) {
  std::lock_guard<std::mutex> lock(moe_unusable_mutex_);
  if (moe_unusable_reason_.empty()) {  // the first cause is the one worth reporting
    moe_unusable_reason_ = why;
  }
  moe_unusable_.store(true, std::memory_order_release);
}

std::string EPProcessGroup::moeUnusableReason() const {
  std::lock_guard<std::mutex> lock(moe_unusable_mutex_);
  return moe_unusable_reason_;
}

void EPProcessGroup::checkAlive(const char* op) const {
  TORCH_CHECK(!shutdown_.load(), "ep: ", op, " called on a process group that was shut down");
}

c10::intrusive_ptr<c10d::Backend> EPProcessGroup::innerBackend(c10::DeviceType device_type,
                                                               const char* op) const {
  checkAlive(op);
  if (device_type == c10::DeviceType::CPU) {
    return cpu_;
  }
  if (device_type == c10::DeviceType::CUDA) {
    TORCH_CHECK(cuda_ != nullptr, "ep: ", op,
                " got CUDA tensors but this group has no CUDA backend (was it created on a machine "
                "without GPUs, or with a CPU-only torch?)");
    return cuda_;
  }
  TORCH_CHECK(false, "ep: ", op, " does not support tensors on device type ", device_type);
}

c10::intrusive_ptr<c10d::Backend> EPProcessGroup::route(const at::Tensor& tensor, const char* op) {
  TORCH_CHECK(tensor.defined(), "ep: ", op, " got an undefined tensor");
  ++seq_;
  auto backend = innerBackend(tensor.device().type(), op);
  if (coalescing_ && backend == cuda_ && !cuda_coalescing_started_) {
    cuda_->startCoalescing();
    cuda_coalescing_started_ = true;
  }
  return backend;
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::track(c10::intrusive_ptr<c10d::Work> work) {
  if (coalescing_ && work && !cuda_coalescing_started_) {
    coalesced_cpu_works_.push_back(work);
  }
  return work;
}

namespace {
// The Work of a coalesced group of CPU ops: done when every member is done.
class CoalescedWork : public c10d::Work {
 public:
  explicit CoalescedWork(std::vector<c10::intrusive_ptr<c10d::Work>> works)
      : c10d::Work(-1, c10d::OpType::COALESCED), works_(std::move(works)) {}
  bool isCompleted() override {
    for (auto& w : works_) {
      if (!w->isCompleted()) {
        return false;
      }
    }
    return true;
  }
  bool wait(std::chrono::milliseconds timeout) override {
    bool ok = true;
    for (auto& w : works_) {
      ok = w->wait(timeout) && ok;
    }
    return ok;
  }
  std::vector<at::Tensor> result() override {
    std::vector<at::Tensor> all;
    for (auto& w : works_) {
      auto r = w->result();
      all.insert(all.end(), r.begin(), r.end());
    }
    return all;
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};
}  // namespace

void EPProcessGroup::startCoalescing() {
  checkAlive("start_coalescing");
  TORCH_CHECK(!coalescing_, "ep: start_coalescing called twice without end_coalescing");
  coalescing_ = true;
  cuda_coalescing_started_ = false;
  coalesced_cpu_works_.clear();
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::endCoalescing() {
  TORCH_CHECK(coalescing_, "ep: end_coalescing called without start_coalescing");
  coalescing_ = false;
  if (cuda_coalescing_started_) {
    cuda_coalescing_started_ = false;
    TORCH_CHECK(coalesced_cpu_works_.empty(), "ep: a coalesced group mixed CPU and CUDA tensors");
    return cuda_->endCoalescing();
  }
  auto works = std::move(coalesced_cpu_works_);
  coalesced_cpu_works_.clear();
  return c10::make_intrusive<CoalescedWork>(std::move(works));
}

c10::intrusive_ptr<c10d::Backend> EPProcessGroup::route(const std::vector<at::Tensor>& tensors,
                                                        const char* op) {
  TORCH_CHECK(!tensors.empty(), "ep: ", op, " needs at least one tensor");
  const auto device_type = tensors.front().device().type();
  for (const auto& t : tensors) {
    TORCH_CHECK(t.defined(), "ep: ", op, " got an undefined tensor");
    TORCH_CHECK(t.device().type() == device_type, "ep: ", op,
                " got tensors on different device types (", device_type, " and ", t.device().type(),
                ")");
  }
  return route(tensors.front(), op);
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::broadcast(std::vector<at::Tensor>& tensors,
                                                         const c10d::BroadcastOptions& opts) {
  return track(route(tensors, "broadcast")->broadcast(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::allreduce(std::vector<at::Tensor>& tensors,
                                                         const c10d::AllreduceOptions& opts) {
  auto backend = route(tensors, "allreduce");
  return track(allreduceInPlace(
      tensors, opts, "allreduce", backend == cpu_, getSize(),
      [&](const c10d::AllreduceOptions& o) { return backend->allreduce(tensors, o); }));
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  auto backend = route(tensors, "allreduce_coalesced");
  return track(allreduceInPlace(tensors, opts, "allreduce_coalesced", backend == cpu_, getSize(),
                                [&](const c10d::AllreduceCoalescedOptions& o) {
                                  return backend->allreduce_coalesced(tensors, o);
                                }));
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::reduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::ReduceOptions& opts) {
  auto backend = route(tensors, "reduce");
  if (backend != cpu_ || !isComposedReduction(opts.reduceOp)) {
    return track(backend->reduce(tensors, opts));
  }
  // Reduce into scaled copies: non-root tensors must keep their values.
  std::vector<at::Tensor> staged;
  for (auto& t : tensors) {
    if (opts.reduceOp.op_ == c10d::ReduceOp::AVG) {
      checkFloatingForAvg(t, "reduce");
    }
    staged.push_back(opts.reduceOp.op_ == c10d::ReduceOp::PREMUL_SUM ? stagedInput(t, opts.reduceOp)
                                                                     : t.clone());
  }
  c10d::ReduceOptions sum_opts = opts;
  sum_opts.reduceOp = sumOp();
  auto work = backend->reduce(staged, sum_opts);
  const bool is_root = getRank() == static_cast<int>(opts.rootRank);
  const bool avg = opts.reduceOp.op_ == c10d::ReduceOp::AVG;
  const int size = getSize();
  return track(thenApply(work, [tensors, staged, is_root, avg, size] {
    if (!is_root) {
      return;
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      at::Tensor result = avg ? staged[i].div(size) : staged[i];
      const_cast<at::Tensor&>(tensors[i]).copy_(result);
    }
  }));
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::allgather(
    std::vector<std::vector<at::Tensor>>& output_tensors, std::vector<at::Tensor>& input_tensors,
    const c10d::AllgatherOptions& opts) {
  return track(route(input_tensors, "allgather")->allgather(output_tensors, input_tensors, opts));
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::_allgather_base(at::Tensor& output,
                                                               at::Tensor& input,
                                                               const c10d::AllgatherOptions& opts) {
  return track(route(input, "all_gather_into_tensor")->_allgather_base(output, input, opts));
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& input_list,
    const c10d::AllgatherOptions& opts) {
  return track(route(input_list, "allgather_coalesced")
                   ->allgather_coalesced(output_lists, input_list, opts));
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return track(route(inputs, "allgather_into_tensor_coalesced")
                   ->allgather_into_tensor_coalesced(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::gather(
    std::vector<std::vector<at::Tensor>>& output_tensors, std::vector<at::Tensor>& input_tensors,
    const c10d::GatherOptions& opts) {
  return track(route(input_tensors, "gather")->gather(output_tensors, input_tensors, opts));
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::scatter(
    std::vector<at::Tensor>& output_tensors, std::vector<std::vector<at::Tensor>>& input_tensors,
    const c10d::ScatterOptions& opts) {
  return track(route(output_tensors, "scatter")->scatter(output_tensors, input_tensors, opts));
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::reduce_scatter(
    std::vector<at::Tensor>& output_tensors, std::vector<std::vector<at::Tensor>>& input_tensors,
    const c10d::ReduceScatterOptions& opts) {
  auto backend = route(output_tensors, "reduce_scatter");
  if (backend != cpu_ || !isComposedReduction(opts.reduceOp)) {
    return track(backend->reduce_scatter(output_tensors, input_tensors, opts));
  }
  std::vector<std::vector<at::Tensor>> staged(input_tensors.size());
  for (size_t i = 0; i < input_tensors.size(); ++i) {
    for (auto& t : input_tensors[i]) {
      if (opts.reduceOp.op_ == c10d::ReduceOp::AVG) {
        checkFloatingForAvg(t, "reduce_scatter");
      }
      staged[i].push_back(stagedInput(t, opts.reduceOp));
    }
  }
  c10d::ReduceScatterOptions sum_opts = opts;
  sum_opts.reduceOp = sumOp();
  auto work = backend->reduce_scatter(output_tensors, staged, sum_opts);
  if (opts.reduceOp.op_ != c10d::ReduceOp::AVG) {
    return track(thenApply(work, [staged] {}));  // keeps the staged inputs alive until completion
  }
  const int size = getSize();
  return track(thenApply(work, [output_tensors, staged, size] { divideBy(output_tensors, size); }));
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  auto backend = route(input, "reduce_scatter_tensor");
  if (backend != cpu_ || !isComposedReduction(opts.reduceOp)) {
    return track(backend->_reduce_scatter_base(output, input, opts));
  }
  if (opts.reduceOp.op_ == c10d::ReduceOp::AVG) {
    checkFloatingForAvg(input, "reduce_scatter_tensor");
  }
  at::Tensor staged = stagedInput(input, opts.reduceOp);
  c10d::ReduceScatterOptions sum_opts = opts;
  sum_opts.reduceOp = sumOp();
  auto work = backend->_reduce_scatter_base(output, staged, sum_opts);
  const bool avg = opts.reduceOp.op_ == c10d::ReduceOp::AVG;
  const int size = getSize();
  std::vector<at::Tensor> outputs{output};
  return track(thenApply(work, [outputs, staged, avg, size] {
    if (avg) {
      divideBy(outputs, size);
    }
  }));
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  auto backend = route(inputs, "reduce_scatter_tensor_coalesced");
  if (backend != cpu_ || !isComposedReduction(opts.reduceOp)) {
    return track(backend->reduce_scatter_tensor_coalesced(outputs, inputs, opts));
  }
  std::vector<at::Tensor> staged;
  for (auto& t : inputs) {
    if (opts.reduceOp.op_ == c10d::ReduceOp::AVG) {
      checkFloatingForAvg(t, "reduce_scatter_tensor_coalesced");
    }
    staged.push_back(stagedInput(t, opts.reduceOp));
  }
  c10d::ReduceScatterOptions sum_opts = opts;
  sum_opts.reduceOp = sumOp();
  auto work = backend->reduce_scatter_tensor_coalesced(outputs, staged, sum_opts);
  const bool avg = opts.reduceOp.op_ == c10d::ReduceOp::AVG;
  const int size = getSize();
  return track(thenApply(work, [outputs, staged, avg, size] {
    if (avg) {
      divideBy(outputs, size);
    }
  }));
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& opts) {
  if (auto work = kernelAlltoall(output, input, output_split_sizes, input_split_sizes, opts)) {
    return work;
  }
  return track(route(input, "all_to_all_single")
                   ->alltoall_base(output, input, output_split_sizes, input_split_sizes, opts));
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::kernelAlltoall(
    at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& output_split_sizes,
    const std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& opts) {
  // CUDA tensors on a group whose all-to-all transport is ep's kernels (decided collectively at
  // the group's first CUDA all-to-all); coalesced calls stay with NCCL's group.
  if (!input.is_cuda() || coalescing_ || cuda_ == nullptr) return nullptr;
  checkAlive("all_to_all_single");
  Transport& transport = transportFor(*this, OpFamily::kAllToAll, input.device());
  return transport.allToAll(*this, output, input, output_split_sizes, input_split_sizes,
                            opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::alltoall(std::vector<at::Tensor>& output_tensors,
                                                        std::vector<at::Tensor>& input_tensors,
                                                        const c10d::AllToAllOptions& opts) {
  auto backend = route(input_tensors, "all_to_all");
  // ep's kernels serve the list form as one all_to_all_single of the flattened tensors.
  const bool on_kernels =
      backend == cuda_ && !coalescing_ &&
      transportFor(*this, OpFamily::kAllToAll, input_tensors.front().device()).kind() !=
          TransportKind::kAten;
  if (!on_kernels && (backend != cpu_ || cpuHasListAlltoall_)) {
    try {
      return track(backend->alltoall(output_tensors, input_tensors, opts));
    } catch (const c10::Error& e) {
      // Gloo of torch < 2.13 has no list all_to_all (only all_to_all_single): send the list as
      // one all_to_all_single below. Any other error is the caller's.
      if (backend != cpu_ ||
          std::string(e.what_without_backtrace()).find("does not support alltoall") ==
              std::string::npos) {
        throw;
      }
      cpuHasListAlltoall_ = false;
    }
  }
  TORCH_CHECK(static_cast<int>(input_tensors.size()) == getSize() &&
                  static_cast<int>(output_tensors.size()) == getSize(),
              "ep all_to_all: expected ", getSize(), " input and output tensors, got ",
              input_tensors.size(), " and ", output_tensors.size());
  std::vector<at::Tensor> flat_inputs;
  std::vector<int64_t> input_splits, output_splits;
  for (const auto& t : input_tensors) {
    TORCH_CHECK(t.scalar_type() == input_tensors.front().scalar_type(),
                "ep all_to_all: every input tensor must have one dtype");
    flat_inputs.push_back(t.reshape({-1}));
    input_splits.push_back(t.numel());
  }
  for (const auto& t : output_tensors) {
    TORCH_CHECK(t.scalar_type() == input_tensors.front().scalar_type(),
                "ep all_to_all: output tensors must have the inputs' dtype");
    output_splits.push_back(t.numel());
  }
  at::Tensor input = at::cat(flat_inputs);
  at::Tensor output = at::empty(
      {std::accumulate(output_splits.begin(), output_splits.end(), int64_t{0})}, input.options());
  // alltoall_base may move from the split vectors it is given (Gloo does): it gets copies.
  std::vector<int64_t> send_splits = input_splits, recv_splits = output_splits;
  c10::intrusive_ptr<c10d::Work> work =
      on_kernels ? kernelAlltoall(output, input, recv_splits, send_splits, opts) : nullptr;
  if (!work) work = backend->alltoall_base(output, input, recv_splits, send_splits, opts);
  std::vector<at::Tensor> outputs = output_tensors;
  return track(thenApply(work, [output, outputs, output_splits] {
    int64_t offset = 0;
    for (size_t i = 0; i < outputs.size(); ++i) {
      const_cast<at::Tensor&>(outputs[i])
          .copy_(output.narrow(0, offset, output_splits[i]).view(outputs[i].sizes()));
      offset += output_splits[i];
    }
  }));
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::send(std::vector<at::Tensor>& tensors, int dst_rank,
                                                    int tag) {
  return track(route(tensors, "send")->send(tensors, dst_rank, tag));
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::recv(std::vector<at::Tensor>& tensors, int src_rank,
                                                    int tag) {
  return track(route(tensors, "recv")->recv(tensors, src_rank, tag));
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::recvAnysource(std::vector<at::Tensor>& tensors,
                                                             int tag) {
  return track(route(tensors, "recv_anysource")->recvAnysource(tensors, tag));
}

c10::intrusive_ptr<c10d::Work> EPProcessGroup::barrier(const c10d::BarrierOptions& opts) {
  checkAlive("barrier");
  ++seq_;
  const bool on_cuda =
      (opts.device.has_value() && opts.device->is_cuda()) || !opts.device_ids.empty();
  if (on_cuda && cuda_ != nullptr) {
    return track(cuda_->barrier(opts));
  }
  c10d::BarrierOptions cpu_opts = opts;
  cpu_opts.device_ids.clear();
  cpu_opts.device = std::nullopt;
  return track(cpu_->barrier(cpu_opts));
}

void EPProcessGroup::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  checkAlive("monitored_barrier");
  ++seq_;
  c10d::BarrierOptions cpu_opts = opts;
  cpu_opts.device_ids.clear();
  cpu_opts.device = std::nullopt;
  cpu_->monitoredBarrier(cpu_opts, wait_all_ranks);
}

void EPProcessGroup::setTimeout(std::chrono::milliseconds timeout) {
  options_->timeout = timeout;
  cpu_->setTimeout(timeout);
  if (cuda_ != nullptr) {
    try {
      cuda_->setTimeout(timeout);
    } catch (const c10::Error&) {
      // Older NCCL backends keep their construction-time timeout; ours is still updated.
    }
  }
}

void EPProcessGroup::setSequenceNumberForGroup() {
  seq_.store(0);
}

uint64_t EPProcessGroup::getSequenceNumberForGroup() {
  return seq_.load();
}

c10::intrusive_ptr<c10d::Backend> EPProcessGroup::split(
    const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
    const c10::intrusive_ptr<c10d::Backend::Options>& opts) {
  checkAlive("split");
  auto it = std::find(ranks.begin(), ranks.end(), getRank());
  if (it == ranks.end()) {
    return nullptr;
  }
  TORCH_CHECK(split_factory_, "ep: this group was created without a split factory");
  auto child_opts = c10::make_intrusive<EPOptions>(*options_);
  if (auto ep_opts = c10::dynamic_intrusive_pointer_cast<EPOptions>(opts)) {
    child_opts = c10::make_intrusive<EPOptions>(*ep_opts);
  } else if (opts) {
    child_opts->timeout = opts->timeout;
    child_opts->group_name = opts->group_name;
    child_opts->group_desc = opts->group_desc;
  }
  child_opts->global_ranks_in_group.clear();
  for (int r : ranks) {
    child_opts->global_ranks_in_group.push_back(
        options_->global_ranks_in_group.empty()
            ? static_cast<uint64_t>(r)
            : options_->global_ranks_in_group.at(static_cast<size_t>(r)));
  }
  std::ostringstream key;
  key << child_opts->group_name << '|';
  for (int r : ranks) {
    key << r << ',';
  }
  std::lock_guard<std::mutex> lock(split_mutex_);
  auto cached = split_children_.find(key.str());
  if (cached != split_children_.end()) {
    return cached->second;
  }
  auto child = split_factory_(store, static_cast<int>(it - ranks.begin()),
                              static_cast<int>(ranks.size()), child_opts);
  split_children_[key.str()] = child;
  return child;
}

void EPProcessGroup::eagerConnectSingleDevice(at::Device device) {
  if (device.is_cuda() && cuda_ != nullptr) {
    cuda_->setBoundDeviceId(device);
    cuda_->eagerConnectSingleDevice(device);
  }
}

void EPProcessGroup::abort() {
  // Peers still calling MoE collectives on this group learn it at their next agreement (on one
  // host, at once) instead of waiting for their timeout.
  markMoeUnusable("the group was aborted on this rank (ep_backend.abort)");
  abandonMoeAgreement(*this);
  // Kernels may still be running: transport buffers are released by shutdown() or at
  // destruction, not here.
  shutdown_.store(true);
  cpu_->abort();
  if (cuda_ != nullptr) {
    cuda_->abort();
  }
}

void EPProcessGroup::shutdown() {
  shutdown_.store(true);
  if (shutdown_hooks_ran_.exchange(true)) {
    return;
  }
  runShutdownHooks();
  {
    std::lock_guard<std::mutex> lock(split_mutex_);
    split_factory_ = nullptr;  // drops the Python callable while the interpreter still runs
  }
  cpu_->shutdown();
  if (cuda_ != nullptr) {
    cuda_->shutdown();
  }
}

}  // namespace ep
