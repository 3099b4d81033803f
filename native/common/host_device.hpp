// EP_HOST_DEVICE: a function both the kernels and their host-side launchers call (buffer and row
// layouts). Under nvcc it is an inlined __host__ __device__ function; elsewhere a plain inline one,
// so the headers that use it stay includable from torch-bound C++.
#pragma once

#include <cstddef>

#if defined(__CUDACC__)
#define EP_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define EP_HOST_DEVICE inline
#endif

namespace ep {

// v rounded up to a multiple of a.
EP_HOST_DEVICE size_t align_up(size_t v, size_t a) {
  return (v + a - 1) / a * a;
}

}  // namespace ep
