// Every EP_* environment override the native code reads, in one place, each a named constant (as
// ProcessGroupNCCL.hpp keeps TORCH_NCCL_*). Torch-free, header only, so the CUDA runtimes use it
// too. A user setting belongs in ep_backend.Options; what stays here is either a user's switch of
// transport or library path, or an override for experiments and diagnosis (docs/api.md lists
// them). A process-scoped variable is read once, at its first use; a group-scoped one each time a
// group sets up (so a process can make groups with and without it, as the tests do).
#pragma once

#include <cstdlib>
#include <cstring>
#include <string>

namespace ep::env {

enum class Scope : char {
  kProcess,  // read once per process, at the first use
  kGroup,    // read at each group's setup (transport choice, host exchange)
};

struct Variable {
  const char* name;
  Scope scope;
};

// Users: "aten" runs a group's high-throughput / low-latency CUDA calls on the ATen fallback.
inline constexpr Variable kHighThroughput{"EP_HIGH_THROUGHPUT", Scope::kGroup};
inline constexpr Variable kLowLatency{"EP_LOW_LATENCY", Scope::kGroup};
// Users: the path of libep_nvshmem.so (default: next to _C).
inline constexpr Variable kNvshmemLib{"EP_NVSHMEM_LIB", Scope::kProcess};
// Diagnosis: "gloo" sends the per-call agreement through Gloo instead of shared memory.
inline constexpr Variable kHostExchange{"EP_HOST_EXCHANGE", Scope::kGroup};
// Diagnosis: "1" prints each NVLink op's host time per stage; "trace" also a flushed line per
// stage.
inline constexpr Variable kProfileHost{"EP_PROFILE_HOST", Scope::kProcess};
// Experiments: overrides Options.recv_slabs (every rank must agree).
inline constexpr Variable kRecvSlabs{"EP_RECV_SLABS", Scope::kProcess};
// Experiments (sweeps, GPU tests): send warps of the NVLink kernels, read when a group builds its
// transport.
inline constexpr Variable kDispatchSendWarps{"EP_DISPATCH_SEND_WARPS", Scope::kGroup};
inline constexpr Variable kDispatchSendWarpsSmallRows{"EP_DISPATCH_SEND_WARPS_SMALL_ROWS",
                                                      Scope::kGroup};
inline constexpr Variable kDispatchSendWarpsSlab{"EP_DISPATCH_SEND_WARPS_SLAB", Scope::kGroup};
inline constexpr Variable kCombineSendWarps{"EP_COMBINE_SEND_WARPS", Scope::kGroup};
// Diagnosis: µs the host's wait for a dispatch's receive counts spins before it yields its core.
inline constexpr Variable kHostWaitSpinUs{"EP_HOST_WAIT_SPIN_US", Scope::kProcess};
// Diagnosis: "1" prints a flushed line to stderr per host stage of each internode op
// (agreement, buffer builds, launch, kernels done).
inline constexpr Variable kInternodeTrace{"EP_INTERNODE_TRACE", Scope::kProcess};

// The raw value, or nullptr when unset. Process-scoped variables are read once and kept (one
// static per variable: no lock after the first read); group-scoped ones are read now.
template <const Variable& V>
const char* raw() {
  if constexpr (V.scope == Scope::kProcess) {
    static const char* const value = [] {
      const char* v = std::getenv(V.name);
      return v != nullptr ? (new std::string(v))->c_str() : nullptr;  // kept for the process
    }();
    return value;
  } else {
    return std::getenv(V.name);
  }
}

template <const Variable& V>
bool isSet() {
  return raw<V>() != nullptr;
}

template <const Variable& V>
bool equals(const char* text) {
  const char* v = raw<V>();
  return v != nullptr && std::strcmp(v, text) == 0;
}

// The value as an integer, or `fallback` when unset.
template <const Variable& V>
long long integer(long long fallback) {
  const char* v = raw<V>();
  return v != nullptr ? std::atoll(v) : fallback;
}

}  // namespace ep::env
