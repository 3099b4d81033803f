// The all-to-all on the NVLink runtime (cuda/nvlink_all_to_all.cu): dist.all_to_all_single with
// host split sizes, and ep_backend.all_to_all_v(_2d) with device splits. Only built with
// EP_WITH_CUDA.
#ifdef EP_WITH_CUDA

#include <ATen/core/ivalue.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

#include "backend/ep_process_group.hpp"
#include "backend/host_stages.hpp"
#include "backend/stream_capture.hpp"
#include "backend/stream_order.hpp"
#include "transports/nvlink/nvlink_capacity.hpp"
#include "transports/nvlink/nvlink_group_state.hpp"
#include "transports/nvlink/nvlink_pending_error.hpp"
#include "transports/nvlink/nvlink_transport.hpp"

namespace ep::nvlink {
namespace {

// Bytes of one row (dim 0 slice) of a tensor of at least one dimension.
int64_t rowBytes(const at::Tensor& t) {
  int64_t n = static_cast<int64_t>(t.element_size());
  for (int64_t d = 1; d < t.dim(); ++d) n *= t.size(d);
  return n;
}

// The split sizes of one side: given, or equal (rows / R, which must divide).
std::vector<int64_t> splitsOf(const std::vector<int64_t>& given, int64_t rows, int num_ranks,
                              const char* side) {
  std::vector<int64_t> splits = given;
  if (splits.empty()) {
    TORCH_CHECK(rows % num_ranks == 0, "ep all_to_all_single: the ", side, " has ", rows,
                " rows, not divisible by the group size ", num_ranks,
                "; pass split sizes for unequal splits");
    splits.assign(num_ranks, rows / num_ranks);
  }
  TORCH_CHECK(static_cast<int>(splits.size()) == num_ranks, "ep all_to_all_single: ", side,
              " split sizes has ", splits.size(), " entries, expected one per rank (", num_ranks,
              ")");
  int64_t sum = 0;
  for (int64_t s : splits) {
    TORCH_CHECK(s >= 0, "ep all_to_all_single: ", side, " split sizes must be >= 0, got ", s);
    sum += s;
  }
  TORCH_CHECK(sum == rows, "ep all_to_all_single: ", side, " split sizes sum to ", sum,
              ", but the ", side, " has ", rows, " rows");
  return splits;
}

// The runtime an all-to-all launches on, built at the group's first call if no MoE op built it.
// Null while a CUDA graph is captured before the group has a runtime (it cannot be built then).
NvlinkRuntime* runtimeFor(EPProcessGroup& pg, GroupState& st, const at::Device& device,
                          bool capture) {
  if (capture && !st.runtime) return nullptr;
  return &ensureRuntime(pg, st, device, Needs{}, "all_to_all", capture, -1);
}

// The error an earlier kernel left (an overflow, invalid splits) is raised only after this
// call's kernel is launched: the all-to-all has no agreement step, so a rank raising before its
// launch would leave its peers waiting in theirs.
void raiseAfterLaunch(const std::string& pending) {
  TORCH_CHECK(pending.empty(), pending);
}

// Communicating kernels of a rank run one at a time: a call on another stream than the previous
// one waits for it (an event recorded only when the stream changes; inside a capture the graph's
// own dependencies order it).
void orderBehindLast(GroupState& st, const c10::cuda::CUDAStream& stream, bool capture) {
  if (st.a2a_last_stream.has_value() && *st.a2a_last_stream != stream && !capture) {
    streamWaits(stream.stream(), st.a2a_last_stream->stream(), st.a2a_order);
  }
  st.a2a_last_stream = stream;
}

// The comm stream and events of async calls, made at the group's first all-to-all whatever its
// kind: made at the first async call instead, they held that call's host until the work queued
// before it on the caller's stream had ended.
void prepareAsync(GroupState& st, const at::Device& device) {
  if (!st.a2a_comm_stream.has_value()) {
    st.a2a_comm_stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device.index());
  }
  orderingEventCreated(st.a2a_comm_ready);
  orderingEventCreated(st.a2a_order);
}

// The type of the futures' value (made once: creating a type allocates).
const c10::TypePtr& tensorListType() {
  static const c10::TypePtr type = c10::ListType::create(c10::TensorType::get());
  return type;
}

// The Work of a call made without async_op: done when returned (its kernel is queued on the
// caller's stream, which is NCCL's meaning of a completed synchronous call). One allocation, where
// a Future-backed Work makes several: this is on the host path of every small all-to-all. The
// Future is made only if someone asks for it.
class CompletedWork : public c10d::Work {
 public:
  explicit CompletedWork(at::Tensor output)
      : c10d::Work(-1, c10d::OpType::ALLTOALL_BASE), output_(std::move(output)) {
    finish();
  }
  bool isCompleted() override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
  void synchronize() override {}
  std::vector<at::Tensor> result() override { return {output_}; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto future = c10::make_intrusive<c10::ivalue::Future>(tensorListType());
    future->markCompleted(c10::IValue(std::vector<at::Tensor>{output_}));
    return future;
  }

 private:
  at::Tensor output_;
};

c10::intrusive_ptr<c10d::Work> completedWork(const at::Tensor& output) {
  return c10::make_intrusive<CompletedWork>(output);
}

}  // namespace

c10::intrusive_ptr<c10d::Work> allToAll(EPProcessGroup& pg, at::Tensor& output,
                                        const at::Tensor& input,
                                        const std::vector<int64_t>& output_split_sizes,
                                        const std::vector<int64_t>& input_split_sizes,
                                        bool async_op) {
  const at::Device device = input.device();
  // What the inner backend reports best (a CPU output, another device, a dtype mismatch, a
  // 0-d tensor) goes there.
  if (!output.is_cuda() || output.device() != device || input.dim() == 0 || output.dim() == 0 ||
      output.scalar_type() != input.scalar_type()) {
    return nullptr;
  }
  HostStages stages("all_to_all");
  auto st = stateOf(pg);
  const bool capture = streamCapturing();
  const c10::cuda::CUDAGuard guard(device);
  NvlinkRuntime* rt = runtimeFor(pg, *st, device, capture);
  if (rt == nullptr) return nullptr;
  if (!capture) prepareAsync(*st, device);
  const std::string pending = takePendingError(*st, "all_to_all");
  stages.mark("runtime");
  const int R = pg.getSize();
  const int64_t row_bytes = rowBytes(input);
  TORCH_CHECK(rowBytes(output) == row_bytes,
              "ep all_to_all_single: input and output rows differ in size (", row_bytes, " and ",
              rowBytes(output), " bytes)");
  const std::vector<int64_t> send = splitsOf(input_split_sizes, input.size(0), R, "input");
  const std::vector<int64_t> recv = splitsOf(output_split_sizes, output.size(0), R, "output");
  AllToAllParams p{};
  int64_t send_at = 0, recv_at = 0;
  for (int r = 0; r < R; ++r) {
    p.send_offset[r] = send_at * row_bytes;
    p.send_bytes[r] = send[r] * row_bytes;
    p.recv_offset[r] = recv_at * row_bytes;
    p.recv_bytes[r] = recv[r] * row_bytes;
    send_at += send[r];
    recv_at += recv[r];
  }
  TORCH_CHECK(p.send_bytes[pg.getRank()] == p.recv_bytes[pg.getRank()],
              "ep all_to_all_single: this rank sends itself ", send[pg.getRank()],
              " rows but expects ", recv[pg.getRank()], " from itself");
  stages.mark("splits");
  // Non-contiguous tensors: the kernel moves contiguous bytes, so a copy goes in (and the
  // result is copied out), on the stream of the call.
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device.index());
  c10::cuda::CUDAStream stream = current;
  if (async_op) {
    if (!st->a2a_comm_stream.has_value()) prepareAsync(*st, device);  // (first call captured)
    stream = *st->a2a_comm_stream;
    streamWaits(stream.stream(), current.stream(), st->a2a_comm_ready);
  }
  const c10::cuda::CUDAStreamGuard on_stream(stream);
  const at::Tensor in = input.contiguous();
  at::Tensor out =
      output.is_contiguous() ? output : at::empty_like(output, at::MemoryFormat::Contiguous);
  p.input = static_cast<const char*>(in.data_ptr());
  p.output = static_cast<char*>(out.data_ptr());
  orderBehindLast(*st, stream, capture);
  stages.mark("streams");
  rt->all_to_all(p, stream.stream());
  stages.mark("launch");
  raiseAfterLaunch(pending);
  if (!out.is_same(output)) output.copy_(out);
  if (!async_op) return completedWork(output);
  // NCCL's lifetime rule: the tensors stay alive (their memory not reused) until the comm
  // stream is done with them; Work.wait() makes the waiting stream wait for it.
  const std::vector<const at::Tensor*> used = {&input, &in, &output, &out};
  for (const at::Tensor* t : used) {
    if (t->defined() && t->storage().data_ptr().get() != nullptr) {
      c10::cuda::CUDACachingAllocator::recordStream(t->storage().data_ptr(), stream);
    }
  }
  auto future =
      c10::make_intrusive<c10::ivalue::Future>(tensorListType(), std::vector<c10::Device>{device});
  future->markCompleted(c10::IValue(std::vector<at::Tensor>{output}));  // event on `stream`
  return c10d::Work::create_from_future(future);
}

bool allToAllDeviceSplits(EPProcessGroup& pg, const at::Tensor& input, const at::Tensor& splits,
                          const at::Tensor& output, int64_t num_local_experts,
                          const at::Tensor& recv_splits, const at::Tensor& recv_offsets) {
  const at::Device device = input.device();
  const int64_t row_bytes = rowBytes(input);
  if (row_bytes == 0 || num_local_experts > kA2AMaxLocalExperts) return false;
  auto st = stateOf(pg);
  const bool capture = streamCapturing();
  const c10::cuda::CUDAGuard guard(device);
  TORCH_CHECK(!capture || st->runtime,
              "ep all_to_all_v: the NVLink transport of this group is "
              "set up at its first eager call; make one eager all_to_all_v (or any all-to-all or "
              "MoE call) before capturing a CUDA graph");
  NvlinkRuntime& rt = *runtimeFor(pg, *st, device, capture);
  const std::string pending = takePendingError(*st, "all_to_all_v");
  AllToAllParams p{};
  p.input = static_cast<const char*>(input.data_ptr());
  p.output = static_cast<char*>(output.data_ptr());
  p.splits = reinterpret_cast<const long long*>(splits.data_ptr<int64_t>());
  p.num_local_experts = static_cast<int>(num_local_experts);
  p.row_bytes = row_bytes;
  p.input_rows = input.size(0);
  p.capacity_rows = output.size(0);
  p.recv_splits = reinterpret_cast<long long*>(recv_splits.data_ptr<int64_t>());
  p.recv_offsets = reinterpret_cast<long long*>(recv_offsets.data_ptr<int64_t>());
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device.index());
  orderBehindLast(*st, stream, capture);
  rt.all_to_all(p, stream.stream());
  raiseAfterLaunch(pending);
  return true;
}

}  // namespace ep::nvlink

#endif  // EP_WITH_CUDA
