// Host side of kernels with dynamic shared memory: the opt-in a launch needs.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>

namespace ep {

// Lets `kernel` launch with `bytes` of dynamic shared memory on the current device. Without the
// opt-in a launch may use only 48 KB less the kernel's static shared memory, so any non-zero size
// opts in (once per device and size reached: `allowed`, one per kernel, holds the largest so far).
template <typename Kernel>
cudaError_t allow_dynamic_smem(Kernel* kernel, size_t bytes, std::atomic<size_t> (&allowed)[64]) {
  if (bytes == 0) return cudaSuccess;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  if (device < 64 && allowed[device].load() >= bytes) return cudaSuccess;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(bytes));
  if (e == cudaSuccess && device < 64) allowed[device].store(bytes);
  return e;
}

}  // namespace ep
