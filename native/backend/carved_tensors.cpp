#include "backend/carved_tensors.hpp"

#include <c10/core/TensorImpl.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/Exception.h>

namespace ep {
namespace {

int64_t roundUp(int64_t n, int64_t to) {
  return (n + to - 1) / to * to;
}

int64_t bytesOf(const CarvedShape& s) {
  int64_t n = 1;
  for (const int64_t d : s.sizes) {
    TORCH_CHECK(d >= 0, "ep carveTensors: negative size ", d);
    n *= d;
  }
  return n * static_cast<int64_t>(c10::elementSize(s.dtype));
}

}  // namespace

std::vector<at::Tensor> carveTensors(const at::Device& device, c10::ArrayRef<CarvedShape> shapes) {
  std::vector<int64_t> offsets;  // bytes
  offsets.reserve(shapes.size());
  int64_t total = 0;
  for (const CarvedShape& s : shapes) {
    offsets.push_back(total);
    total += roundUp(bytesOf(s), kCarveAlignment);
  }
  // One allocation; its storage is then shared by tensors built directly on it (what at::empty
  // does for a fresh storage), with no dispatcher call per tensor.
  const at::Tensor block = at::empty({total}, at::TensorOptions().dtype(at::kByte).device(device));
  const c10::Storage& storage = block.storage();
  std::vector<at::Tensor> out;
  out.reserve(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    const CarvedShape& s = shapes[i];
    const c10::DispatchKeySet keys(c10::computeDispatchKey(s.dtype, at::kStrided, device));
    at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage), keys,
                                                            c10::scalarTypeToTypeMeta(s.dtype));
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    impl->set_sizes_contiguous(s.sizes);
    impl->set_storage_offset(offsets[i] / static_cast<int64_t>(c10::elementSize(s.dtype)));
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace ep
