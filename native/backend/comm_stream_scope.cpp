#include "backend/comm_stream_scope.hpp"

#include <c10/util/Exception.h>

#include "backend/moe_ops.hpp"

#ifdef EP_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <vector>

#include "backend/stream_order.hpp"
#endif

namespace ep {

#ifdef EP_WITH_CUDA

namespace {

// This thread's ordering event on `device` (null until its first use there), kept for the
// thread's life.
cudaEvent_t& orderingEvent(c10::DeviceIndex device) {
  thread_local std::vector<cudaEvent_t> events;
  if (static_cast<size_t>(device) >= events.size()) {
    events.resize(static_cast<size_t>(device) + 1, nullptr);
  }
  return events[static_cast<size_t>(device)];
}

}  // namespace

c10::Stream enterCommStream(const c10::Stream& comm, bool wait_current) {
  const c10::cuda::CUDAStream comm_stream(comm);
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(comm.device_index());
  if (wait_current && current != comm_stream) {
    cudaEvent_t& event = orderingEvent(comm.device_index());
    if (event == nullptr) {
      const c10::cuda::CUDAGuard guard(comm.device_index());  // an event records on its device
      orderingEventCreated(event);
    }
    streamWaits(comm_stream.stream(), current.stream(), event);
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
