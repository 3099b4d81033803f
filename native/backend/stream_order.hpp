// One stream waiting for the work queued so far on another, through an ordering event: the
// async_op stream switch (comm_stream_scope.cpp) and the all-to-all's stream changes
// (transports/nvlink/nvlink_all_to_all_op.cpp). CUDA builds only.
#pragma once

#ifdef EP_WITH_CUDA

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

namespace ep {

// `event` made if it is still null (no timing: ordering only), on the current device.
inline cudaEvent_t orderingEventCreated(cudaEvent_t& event) {
  if (event == nullptr) {
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  }
  return event;
}

// `waiter` waits for the work queued on `on` so far. One event serves any number of calls:
// cudaStreamWaitEvent waits for the record made just before it, and a later record does not
// change what an earlier wait waits for.
inline void streamWaits(cudaStream_t waiter, cudaStream_t on, cudaEvent_t& event) {
  C10_CUDA_CHECK(cudaEventRecord(orderingEventCreated(event), on));
  C10_CUDA_CHECK(cudaStreamWaitEvent(waiter, event, 0));
}

}  // namespace ep

#endif  // EP_WITH_CUDA
