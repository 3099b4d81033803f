// Whether the current CUDA stream is being captured into a graph (CUDA builds only). While it is,
// no device value may be read on the host, and transport buffers may not be built or freed: the
// captured kernels keep their addresses.
#pragma once

#include <c10/cuda/CUDAGraphsC10Utils.h>

namespace ep {

inline bool streamCapturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

}  // namespace ep
