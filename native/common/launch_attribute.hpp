// Host side of kernel launches that carry one launch attribute (cudaLaunchKernelEx): a launch
// behind the previous kernel of the stream (programmatic stream serialization) or a cooperative
// launch.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace ep {

// Launches `kernel(p)` on `stream` with `grid` x `block` threads, `smem` bytes of dynamic shared
// memory and the attribute `attr`.
template <typename Params>
cudaError_t launch_with_attribute(void (*kernel)(Params), const Params& p, dim3 grid, dim3 block,
                                  size_t smem, cudaStream_t stream, cudaLaunchAttribute attr) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, p);
}

}  // namespace ep
