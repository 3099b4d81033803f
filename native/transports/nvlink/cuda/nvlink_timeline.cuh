// Optional timeline of the nvlink dispatch and combine kernels (-DEP_HT_TIMELINE builds only:
// the harness prints where a kernel's time goes). Each block stamps %globaltimer per warp when the
// warp's role starts its first real work and when the role ends, plus the block's start and end.
// Default builds compile every stamp out.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "transports/nvlink/cuda/nvlink_timeline.hpp"

namespace ep {

#ifdef EP_HT_TIMELINE
__device__ __forceinline__ uint64_t ht_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Stamps `slot` of this block (the caller picks one lane).
#define EP_HT_STAMP(timeline, slot)                                             \
  do {                                                                          \
    if (blockIdx.x < kHtTimelineBlocks)                                         \
      (timeline)[blockIdx.x * kHtTimelineSlots + (slot)] = ::ep::ht_timer_ns(); \
  } while (0)
// Copies a kernel file's timeline buffer to the host (a read_nvlink_*_timeline body).
#define EP_HT_READ_TIMELINE(timeline, out) cudaMemcpyFromSymbol((out), (timeline), sizeof(timeline))
#else
#define EP_HT_STAMP(timeline, slot) \
  do {                              \
  } while (0)
// Not a timeline build: the buffer does not exist.
#define EP_HT_READ_TIMELINE(timeline, out) ((void)(out), cudaErrorNotSupported)
#endif

}  // namespace ep
