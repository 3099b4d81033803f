// A dispatch handle's routing as the kernels read it (send positions, receive prefix) and as the
// cross-rank check reads it (counts): remembered from the dispatch that made the handle, or
// computed again from the handle. Used by cached dispatch and combine. Only built with
// EP_WITH_CUDA.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "backend/moe_types.hpp"
#include "backend/routing_memory.hpp"

namespace ep::nvlink {

// The send positions and receive prefix of a handle for kernels on `stream`: the remembered
// ones (marked as used on `stream`, so the allocator never hands their memory to another stream
// while these kernels read it) or freshly computed ones (the prefix only `with_prefix`).
std::pair<at::Tensor, at::Tensor> routingFor(const KernelRouting* known, const DispatchRouting& r,
                                             const c10::cuda::CUDAStream& stream,
                                             bool with_prefix = true);

// A handle's counts (routingCounts() order) for the cross-rank check, whether they are known,
// and this rank's error about them. Not known while capturing a graph, for a worst-case handle
// (its dispatch never had them on the host; no host step is the point of that mode), or for a
// handle that failed validation (the agreement raises anyway): those skip the check. Only a
// handle this process's dispatch did not make (or one modified since) is read back, a stream
// sync, and checked against its send map (`error`, with `op`'s name).
struct HandleCounts {
  std::vector<int64_t> counts;
  bool known = false;
  std::string error;
};
HandleCounts handleCounts(const KernelRouting* known, const DispatchRouting& r, int64_t num_ranks,
                          bool capture, bool valid, const char* op);

}  // namespace ep::nvlink
