// Input validation of the MoE collectives, and the agreement step that makes every rank raise
// together: a rank that rejects its input must not leave its peers waiting in an exchange.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "moe_types.hpp"

namespace ep {

// Each returns "" when the call is valid on this rank, else a message for the user.
std::string validateDispatch(const DispatchArgs& args, int64_t num_ranks);
std::string validateRouting(const DispatchRouting& routing, int64_t num_ranks, int64_t num_tokens);
std::string validateCachedDispatch(
    const at::Tensor& x,
    const std::optional<at::Tensor>& x_scales,
    const DispatchRouting& routing,
    int64_t num_ranks);
std::string validateCombine(const CombineArgs& args, int64_t num_ranks);
std::string validateLowLatencyDispatch(const LowLatencyDispatchArgs& args, int64_t num_ranks);
std::string validateLowLatencyCombine(const LowLatencyCombineArgs& args, int64_t num_ranks);

// One named integer every rank must agree on (e.g. the hidden size).
struct AgreedField {
  const char* name;
  int64_t value;
};

// All-gathers, over the group's CPU backend, [error flag, fields..., payload...] from every rank.
// Throws on every rank if any rank had an error or the fields differ; otherwise returns the
// gathered payloads as int64 [R, payload.size()].
at::Tensor agreeAcrossRanks(
    EPProcessGroup& pg,
    const char* op,
    const std::string& local_error,
    const std::vector<AgreedField>& fields,
    const std::vector<int64_t>& payload);

} // namespace ep
