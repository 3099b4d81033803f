// ep_backend.reserve: one agreement step, then the group's high-throughput transport sizes itself.
#include <c10/util/Exception.h>

#include "backend/ep_process_group.hpp"
#include "backend/moe_ops.hpp"
#include "backend/moe_validation.hpp"
#include "backend/transport.hpp"

namespace ep {

std::optional<std::vector<int64_t>> reserve(EPProcessGroup& pg, int64_t device_index,
                                            int64_t num_tokens, int64_t hidden_bytes, int64_t topk,
                                            int64_t num_scales, int64_t num_experts) {
  std::string error =
      validateReserve(num_tokens, hidden_bytes, topk, num_scales, num_experts, pg.getSize());
  const bool ok = error.empty();
  // The transport asked first: its pending error and graph pin are agreed before the group's
  // transport is decided (collectively, below), so every rank raises or proceeds alike.
  Transport& first = firstTransport(OpFamily::kHighThroughput);
  const std::string pending = first.takePendingError(pg, "reserve");
  if (ok && !pending.empty()) error = pending;
  const std::vector<AgreedField> fields{
      {"a CUDA device", device_index >= 0 ? 1 : 0},
      {"a CUDA graph captured on the transport", first.graphCaptured(pg) ? 1 : 0},
  };
  const at::Tensor gathered =
      agreeAcrossRanks(pg, "reserve", error, fields,
                       {ok ? num_tokens : 0, ok ? hidden_bytes : 0, ok ? topk : 0,
                        ok ? num_scales : 0, ok ? num_experts / pg.getSize() : 0});
  if (device_index < 0) return std::nullopt;
  const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index));
  return transportFor(pg, OpFamily::kHighThroughput, device).reserve(pg, device, gathered);
}

}  // namespace ep
