// The way from Python into the device-split all-to-all (ep_backend.all_to_all_v / _2d) and its
// error check: EPProcessGroup methods, since they belong to a group and take the tensors the
// Python wrapper validated and allocated.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace ep {

class EPProcessGroup;

// Runs the device-split all-to-all on the group's all-to-all transport when that is one of ep's
// kernels (CUDA tensors; the first call decides the transport, collectively): input [N, ...]
// contiguous, splits [R * E] int64 (rows per destination rank and local expert), output
// [capacity, ...] contiguous, recv_splits / recv_offsets [E, R] int64, all on one device. False
// when not served here (the Python path over the inner backend then runs it).
bool allToAllDeviceSplits(EPProcessGroup& pg, const at::Tensor& input, const at::Tensor& splits,
                          const at::Tensor& output, int64_t num_local_experts,
                          const at::Tensor& recv_splits, const at::Tensor& recv_offsets);

// The error an earlier all-to-all kernel of the group left (a capacity overflow, invalid splits,
// a timeout naming the stalled peer), taken: "" when none. Reads host-mapped memory; the caller
// synchronizes first to see the latest call's.
std::string takeAllToAllError(EPProcessGroup& pg);

}  // namespace ep
