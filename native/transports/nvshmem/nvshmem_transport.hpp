// Low-latency dispatch/combine on CUDA tensors through the NVSHMEM kernels of libep_nvshmem.so
// (cuda/nvshmem_runtime.hpp), which _C loads at run time (dlopen), never links: where
// the library or NVSHMEM is missing the ops keep the ATen + NCCL path.
//
// A group uses the kernels when, at its first low-latency call on CUDA, every rank has loaded the
// library, this build has a kernel image for every rank's GPU, no other group of the process owns
// NVSHMEM (it is process-global: one group per process), every rank has a GPU of its own, no rank
// has an NVSHMEM session or every rank's is this group's (same ranks, GPUs and order; NVSHMEM is
// initialised once per process, nvshmem_session_plan.hpp), and EP_LOW_LATENCY is not "aten" —
// decided
// collectively through the group's store, so all ranks take the same path.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <optional>
#include <string>
#include <tuple>

#include "backend/moe_types.hpp"
#include "backend/transport.hpp"

namespace ep {
class EPProcessGroup;

namespace nvshmem {

// Where to write the expert outputs of the dispatch with `layout_range` for a zero-copy combine:
// a BF16 [E_loc, R*M, H] view of the kernels' send buffer for that dispatch (combine then skips
// its copy-in), or a fresh tensor of that shape where the kernels are not in use. The view is
// valid until the group's low-latency transport is rebuilt (a call with another M, or larger
// H, K or E).
at::Tensor combineBuffer(EPProcessGroup& pg, const at::Tensor& layout_range,
                         int64_t num_max_dispatch_tokens_per_rank, int64_t num_experts,
                         int64_t hidden);

// The receive phase of the send-only dispatch whose handle has `layout_range` (see dispatch
// below); a no-op where the group's low-latency ops do not use the kernels (their exchange is
// complete when the dispatch returns).
void receive(EPProcessGroup& pg, const at::Tensor& layout_range);

// This process's NVSHMEM session: (started, PE, PE count); (false, -1, 0) where none runs (or
// the build has no NVSHMEM). One per process, never restarted (nvshmem_session_plan.hpp).
std::tuple<bool, int64_t, int64_t> sessionInfo();

// Test hook: this process's next NVSHMEM buffer setup (low-latency or internode, agreedSetup)
// fails on this rank after it made its own buffers (as a failed allocation would), so that a test
// can check that every rank raises naming it and that the next call sets the buffers up. A no-op
// in builds without CUDA.
void failNextSetupForTest();

#ifdef EP_WITH_CUDA
// Same contract as the ATen transport's lowLatencyDispatch / lowLatencyCombine (bitwise equal
// results). send_only: only the send phase runs now; the outputs are complete once receive() has
// run on the stream (the Python recv hook). At most two dispatches may await their receive. combine
// returns nullopt, on every rank alike, when the handle's dispatch state is no longer in the
// kernels' buffers (not one of the group's last two kernel dispatches, or already combined): the
// caller then runs the ATen path, which gives the same result.
LowLatencyDispatchResult dispatch(EPProcessGroup& pg, const LowLatencyDispatchInputs& a,
                                  bool send_only);
std::optional<at::Tensor> combine(EPProcessGroup& pg, const LowLatencyCombineInputs& a);
#endif  // EP_WITH_CUDA

}  // namespace nvshmem

#ifdef EP_WITH_CUDA
// The NVSHMEM transport (registered in backend/transport_registry.cpp).
Transport& nvshmemTransport();

namespace nvshmem {
// ---- for the internode transport (transports/internode), which shares this transport's library
// and NVSHMEM session ----
// A symbol of libep_nvshmem.so: null, with *error set, where the library is not usable.
void* librarySymbol(const char* name, std::string* error);
// The same, typed: `fn` set to the symbol of `name`; false, with `error` set, where it is missing.
template <typename Fn>
bool librarySymbol(const char* name, Fn& fn, std::string& error) {
  fn = reinterpret_cast<Fn>(librarySymbol(name, &error));
  return fn != nullptr;
}
// Collective (every rank, the group's low-latency transport usable): makes sure the process's
// NVSHMEM session runs (one started here sizes its initial heap with `extra_symmetric_bytes`
// for the caller; the heap grows on nvshmem_malloc where CUDA VMM is on). The session outlives
// every group: it is never finalised or restarted (nvshmem_session_plan.hpp).
void ensureSession(EPProcessGroup& pg, const at::Device& device, size_t extra_symmetric_bytes);
// For a group's shutdown: `free_buffers` (collective: nvshmem_free) runs later, on every PE
// together, when the next group over the session's PEs has shown every PE present; never where
// no such group comes (the process exit reclaims the memory). A shutdown thereby never waits in
// NVSHMEM for a peer that may be dead.
void parkCollectiveFree(std::function<void()> free_buffers);
// Collective: a runtime in the session, set up in two steps the ranks agree on through the store
// (bounded by the group's timeout). `make` (a C entry point: 0, or -1 with a message) makes this
// rank's own buffers (no collective); once every rank made them, `connect` makes the symmetric
// ones (nvshmem_malloc, which waits for every PE with no timeout), and the second agreement is
// the barrier before any rank signals into a peer's region. Where a step failed on any rank,
// every rank `abandon`s its runtime (no collective: nvshmem_free would wait for that rank too)
// and raises naming the failed ranks; `retry` says what a next call does. `prefix` must be new
// per attempt, alike on every rank.
void* agreedSetup(EPProcessGroup& pg, const std::string& prefix, const char* op, const char* retry,
                  const std::function<int(void**, char*, size_t)>& make,
                  const std::function<int(void*, char*, size_t)>& connect,
                  const std::function<void(void*)>& abandon);
}  // namespace nvshmem
#endif

}  // namespace ep
