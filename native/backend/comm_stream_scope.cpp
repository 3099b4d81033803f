#include "backend/comm_stream_scope.hpp"

#include <c10/util/Exception.h>

#include "backend/moe_ops.hpp"

#ifdef EP_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace ep {

#ifdef EP_WITH_CUDA

c10::Stream enterCommStream(const c10::Stream& comm, bool wait_current) {
  const c10::cuda::CUDAStream comm_stream(comm);
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(comm.device_index());
  if (wait_current && current != comm_stream) {
    at::cuda::CUDAEvent queued;  // freed by CUDA once the wait no longer needs it
    queued.record(current);
    queued.block(comm_stream);
  }
  c10::cuda::setCurrentCUDAStream(comm_stream);
  return current.unwrap();
}

void exitCommStream(const c10::Stream& previous, const c10::Stream& comm,
                    const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs) {
  c10::cuda::setCurrentCUDAStream(c10::cuda::CUDAStream(previous));
  recordStreams(inputs, comm);
  recordStreams(outputs, previous);
}

#else

c10::Stream enterCommStream(const c10::Stream&, bool) {
  TORCH_CHECK(false, "ep: async_op on CUDA tensors needs the CUDA build");
}

void exitCommStream(const c10::Stream&, const c10::Stream&, const std::vector<at::Tensor>&,
                    const std::vector<at::Tensor>&) {
  TORCH_CHECK(false, "ep: async_op on CUDA tensors needs the CUDA build");
}

#endif

}  // namespace ep
