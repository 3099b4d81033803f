#ifdef EP_WITH_CUDA

#include "transports/nvlink/nvlink_slab_pool.hpp"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "transports/nvlink/nvlink_transport.hpp"

namespace ep::nvlink {
namespace {

// The context of one output tensor's storage in a lent slab (its DataPtr's deleter is
// releaseSlabView, which is how recordSlabStream recognises such tensors).
struct SlabView {
  std::shared_ptr<SlabLease> lease;
};
void releaseSlabView(void* ctx) {
  delete static_cast<SlabView*>(ctx);
}

}  // namespace

SlabPool::SlabPool(int count, int device, std::shared_ptr<char> memory)
    : device_(device),
      memory_(std::move(memory)),
      lent_(count, false),
      returned_(count),
      counts_(count, 0) {}

SlabPool::~SlabPool() {
  for (auto& events : returned_)
    for (cudaEvent_t e : events) cudaEventDestroy(e);
}

int SlabPool::lend(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int i = 0; i < static_cast<int>(lent_.size()); ++i) {
    if (lent_[i]) continue;
    for (int k = 0; k < counts_[i]; ++k) {
      const cudaError_t done = cudaEventQuery(returned_[i][k]);
      if (done == cudaErrorNotReady) {
        (void)cudaGetLastError();  // "not ready" is an answer, not an error to keep
        C10_CUDA_CHECK(cudaStreamWaitEvent(stream, returned_[i][k], 0));
      } else {
        C10_CUDA_CHECK(done);
      }
    }
    lent_[i] = true;
    return i;
  }
  return -1;
}

void SlabPool::give_back(int i, const std::vector<cudaStream_t>& streams) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess || cudaSetDevice(device_) != cudaSuccess) return;
  std::vector<cudaEvent_t>& events = returned_[i];
  bool recorded = true;
  size_t k = 0;
  for (; k < streams.size() && recorded; ++k) {
    if (k == events.size()) {
      cudaEvent_t e = nullptr;
      if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
        recorded = false;
        break;
      }
      events.push_back(e);
    }
    recorded = cudaEventRecord(events[k], streams[k]) == cudaSuccess;
  }
  if (!recorded) (void)cudaGetLastError();  // ours to clear, not the caller's to find later
  cudaSetDevice(previous);
  if (!recorded) return;
  counts_[i] = static_cast<int>(k);  // events past k belong to an earlier return: ignored
  lent_[i] = false;
}

void SlabLease::add_stream(cudaStream_t s) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (std::find(streams_.begin(), streams_.end(), s) == streams_.end()) streams_.push_back(s);
}

std::shared_ptr<SlabLease> lendSlab(const std::shared_ptr<SlabPool>& pool, cudaStream_t stream) {
  if (pool == nullptr) return nullptr;
  const int i = pool->lend(stream);
  return i >= 0 ? std::make_shared<SlabLease>(pool, i, stream) : nullptr;
}

at::Tensor slabOutput(NvlinkRuntime& rt, const std::shared_ptr<SlabLease>& lease, size_t offset,
                      at::IntArrayRef sizes, const at::TensorOptions& opts) {
  if (!lease) return at::empty(sizes, opts);
  return at::for_blob(rt.recv_slab(lease->index()) + offset, sizes)
      .options(opts)
      .context(new SlabView{lease}, &releaseSlabView)  // the last view freed gives it back
      .make_tensor();
}

bool recordSlabStream(const at::Tensor& tensor, const c10::Stream& stream) {
  if (!tensor.defined() || !tensor.has_storage()) return false;
  const c10::DataPtr& data = tensor.storage().data_ptr();
  if (data.get_deleter() != &releaseSlabView) return false;
  TORCH_CHECK(stream.device() == tensor.device(), "ep record_stream: the stream is on ",
              stream.device(), ", the tensor on ", tensor.device());
  const c10::cuda::CUDAStream cuda_stream(stream);  // checks that it is a CUDA stream
  static_cast<SlabView*>(data.get_context())->lease->add_stream(cuda_stream.stream());
  return true;
}

}  // namespace ep::nvlink

#endif  // EP_WITH_CUDA
