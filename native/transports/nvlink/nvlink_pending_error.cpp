#ifdef EP_WITH_CUDA

#include "transports/nvlink/nvlink_pending_error.hpp"

#include <c10/util/Exception.h>

namespace ep::nvlink {

std::string takePendingError(GroupState& st, const char* op) {
  if (!st.runtime) {
    return "";
  }
  std::string error = st.runtime->check_error();
  if (error.empty()) {
    return "";
  }
  if (!st.runtime->failed()) {
    st.runtime->clear_error();
  }
  return error + " (reported by the next call, " + op + ")";
}

std::string pendingErrorToAgree(GroupState& st, const char* op) {
  std::string error = takePendingError(st, op);
  TORCH_CHECK(error.empty() || !st.runtime->failed(), error);
  return error;
}

}  // namespace ep::nvlink

#endif  // EP_WITH_CUDA
