#ifdef EP_WITH_CUDA

#include "transports/nvlink/nvlink_layout_errors.hpp"

#include <c10/cuda/CUDAException.h>

#include <cstring>
#include <map>
#include <mutex>

namespace ep::nvlink {

LayoutErrorState& layoutErrorState(int device, cudaStream_t stream) {
  static std::mutex mutex;
  static auto* states = new std::map<int, LayoutErrorState>();
  std::lock_guard<std::mutex> lock(mutex);
  LayoutErrorState& st = (*states)[device];
  if (st.ctrl == nullptr) {
    // The first use may come while a CUDA graph is being captured: allocations are refused in
    // the default capture mode, so they run in relaxed mode, and the control block is zeroed on
    // the stream (in a graph, at each replay: harmless, it only resets the error lock).
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    C10_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    C10_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&st.ctrl), sizeof(ControlBlock)));
    C10_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&st.host), sizeof(ErrorRecord),
                                 cudaHostAllocMapped));
    C10_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    std::memset(static_cast<void*>(st.host), 0, sizeof(ErrorRecord));
    C10_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&st.dev), st.host, 0));
    C10_CUDA_CHECK(cudaMemsetAsync(st.ctrl, 0, sizeof(ControlBlock), stream));
  }
  return st;
}

ErrorRecord takeLayoutError(int device, cudaStream_t stream) {
  LayoutErrorState& err = layoutErrorState(device, stream);
  const ErrorRecord record = *const_cast<const ErrorRecord*>(err.host);
  std::memset(static_cast<void*>(err.host), 0, sizeof(ErrorRecord));
  C10_CUDA_CHECK(cudaMemsetAsync(&err.ctrl->error_lock, 0, sizeof(int), stream));
  return record;
}

}  // namespace ep::nvlink

#endif  // EP_WITH_CUDA
