// Error state of the standalone layout kernel (get_dispatch_layout), one per device, kept for
// the process: a dispatch that takes such a layout reads and raises what that kernel recorded.
// Only built with EP_WITH_CUDA.
#pragma once

#include <cuda_runtime_api.h>

#include "transports/nvlink/cuda/nvlink_common.hpp"

namespace ep::nvlink {

// The kernel's error lock (device memory) and its error record (host-mapped, read by the next
// call).
struct LayoutErrorState {
  ControlBlock* ctrl = nullptr;
  ErrorRecord* host = nullptr;
  ErrorRecord* dev = nullptr;
};

// The state of `device`, made at its first use (zeroed on `stream`).
LayoutErrorState& layoutErrorState(int device, cudaStream_t stream);

// Returns and clears the error a standalone layout kernel recorded on `device` (a dispatch that
// took that layout is raising it).
ErrorRecord takeLayoutError(int device, cudaStream_t stream);

}  // namespace ep::nvlink
