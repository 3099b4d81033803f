// ep_backend.record_stream: tensors a transport lent go to that transport, others to
// Tensor.record_stream.
#include <c10/util/Exception.h>

#include "backend/moe_ops.hpp"
#include "backend/transport.hpp"

namespace ep {

bool recordLentStream(const at::Tensor& tensor, const c10::Stream& stream) {
  return recordStreamOnTransports(tensor, stream);
}

void recordStreams(const std::vector<at::Tensor>& tensors, const c10::Stream& stream) {
#ifdef EP_WITH_CUDA
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.is_cuda() && !recordStreamOnTransports(t, stream)) {
      t.record_stream(stream);
    }
  }
#else
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(!t.defined() || !t.is_cuda(), "ep: CUDA tensors need the CUDA build");
  }
  (void)stream;
#endif
}

}  // namespace ep
