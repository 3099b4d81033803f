// The way from Python into the device-split all-to-all (ep_backend.all_to_all_v / _2d) and its
// error check: EPProcessGroup methods, since they belong to a group and take the tensors the
// Python wrapper validated and allocated.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

namespace ep {

class EPProcessGroup;

// Runs the device-split all-to-all on the group's all-to-all transport when that is one of ep's
// kernels (CUDA tensors; the first call decides the transport, collectively): input [N, ...]
// contiguous, splits [R * E] int64 (rows per destination rank and local expert), output
// [capacity, ...] contiguous, all on one device. Returns the rows received from each source per
// local expert and their first output rows, int64 [E, R] each ([R] with `flat`, the 1-D
// all_to_all_v), made here in one allocation; nullopt when not served here (the Python path over
// the inner backend then runs it).
std::optional<std::tuple<at::Tensor, at::Tensor>> allToAllV(EPProcessGroup& pg,
                                                            const at::Tensor& input,
                                                            const at::Tensor& splits,
                                                            const at::Tensor& output,
                                                            int64_t num_local_experts, bool flat);

// The error an earlier all-to-all kernel of the group left (a capacity overflow, invalid splits,
// a timeout naming the stalled peer), taken: "" when none. Reads host-mapped memory; the caller
// synchronizes first to see the latest call's.
std::string takeAllToAllError(EPProcessGroup& pg);

}  // namespace ep
