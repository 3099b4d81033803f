// Tensors whose rows the kernels read as 16-byte vectors.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace ep {

// `t` when its data starts on a 16-byte boundary, else a copy: a contiguous view may start
// anywhere, the caching allocator's blocks do not. The copy is made on the current stream, so its
// memory is not handed out again before the kernels queued there have read it.
inline at::Tensor alignedTo16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone();
}

}  // namespace ep
