// Rank masking of the low-latency ops (serving with a peer gone): per group, the ranks this rank
// treats as absent. A masked rank's experts are skipped (entries routed to them count as -1), it
// is sent nothing and waited for by nobody, and rows it would have sent are absent. The spec is
// ep_backend.reference.low_latency_dispatch / low_latency_combine with `mask`.
//
// The mask is this rank's own view (setting it exchanges nothing, as in DeepEP): every live rank
// must mask the same ranks before its next low-latency call (the agreement then checks it). With
// auto-masking on, a peer that does not join a low-latency call's agreement within the auto-mask
// timeout is added to the mask instead of failing the call.
//
// The kernels read a device copy (int32 [R], 1 = masked) through a pointer that never changes for
// the group's life, so CUDA graphs captured before a change see it at replay.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

namespace ep {

class EPProcessGroup;

// A consistent copy of one group's mask, taken once per call.
struct RankMaskSnapshot {
  std::vector<uint8_t> masked;  // [R], 1 = masked
  bool auto_mask = false;
  std::chrono::milliseconds auto_timeout{0};
  // The p2p agreement and exchange among live ranks replace the all-rank ones.
  bool live_only() const;
  // Some rank is masked now (live_only() without auto-masking's "every call might mask").
  bool any_masked() const;
  bool is_masked(int64_t rank) const { return masked[static_cast<size_t>(rank)] != 0; }
  // The same on ranks that mask the same ranks with auto-masking alike on or off.
  int64_t fingerprint() const;
};

RankMaskSnapshot rankMask(EPProcessGroup& pg);
// Masks (`masked` true) or unmasks `rank`; this rank itself cannot be masked.
void updateRankMask(EPProcessGroup& pg, int64_t rank, bool masked);
void cleanRankMask(EPProcessGroup& pg);
// Auto-masking on a low-latency agreement that a peer misses for `timeout` (nullopt: off).
void setAutoMask(EPProcessGroup& pg, std::optional<std::chrono::milliseconds> timeout);
// int32 [R] on `device` (1 = masked), allocated once per group and device; its address is stable.
at::Tensor rankMaskDevice(EPProcessGroup& pg, const at::Device& device);

}  // namespace ep
