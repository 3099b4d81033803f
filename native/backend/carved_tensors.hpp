// Several tensors of one call over a single device allocation.
//
// Every allocation through the caching allocator costs microseconds of host time, several times
// more on a host that has idled between calls; an op that returns a handful of small tensors paid
// that once per tensor. carveTensors makes one allocation and lays the tensors out in it.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/SmallVector.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace ep {

// Byte boundary each carved tensor starts at: enough for the kernels' 16-byte vector accesses and
// a whole cache line.
inline constexpr int64_t kCarveAlignment = 128;

struct CarvedShape {
  c10::SmallVector<int64_t, 3> sizes;
  at::ScalarType dtype;
};

// One contiguous tensor per shape, all in one allocation on `device`, each starting at a
// kCarveAlignment-byte boundary. Each is a tensor of its own, not a view of the others: it has its
// own version counter (an in-place write to one never bumps another's) and its own TensorImpl
// (`is_same` tells them apart). They share one storage, so the memory goes back to the caching
// allocator when the last of them is freed; carve only tensors of comparable lifetimes (the small
// outputs of one call), never a small tensor together with a large one a user may drop first.
// A 0-byte shape (e.g. an unused workspace) gets an empty tensor; do not use its data pointer.
std::vector<at::Tensor> carveTensors(const at::Device& device, c10::ArrayRef<CarvedShape> shapes);

template <size_t N>
std::array<at::Tensor, N> carveTensors(const at::Device& device,
                                       const std::array<CarvedShape, N>& shapes) {
  std::vector<at::Tensor> v = carveTensors(device, c10::ArrayRef<CarvedShape>(shapes));
  std::array<at::Tensor, N> out;
  for (size_t i = 0; i < N; ++i) out[i] = std::move(v[i]);
  return out;
}

}  // namespace ep
