// C entry points of libep_nvshmem.so, for ep_backend._C to load with dlopen: _C never links
// NVSHMEM, so `import ep_backend` works where NVSHMEM is missing or cannot initialise, and the
// low-latency ops fall back to the ATen path there. Structs cross the boundary by pointer; both
// sides are built from the same headers by the same build.
//
// Every function returns 0 on success, or -1 with a message in `err` (NUL-terminated, at most
// `err_len` bytes); no C++ exception crosses the boundary.
#include <cstring>
#include <stdexcept>
#include <vector>

#include "common/c_entry_point.hpp"
#include "transports/nvshmem/cuda/nvshmem_capi.h"
#include "transports/nvshmem/cuda/nvshmem_runtime.hpp"

namespace {

using ep::capi::cEntryPoint;
using ep::capi::copyMessage;

ep::NvshmemRuntime* runtime(void* handle) {
  return static_cast<ep::NvshmemRuntime*>(handle);
}

}  // namespace

extern "C" {

int ep_nvshmem_abi_version() {
  return EP_NVSHMEM_ABI_VERSION;
}

int ep_nvshmem_unique_id(const ep::NvshmemConfig* config, uint8_t* out, size_t out_len,
                         size_t* written, char* err, size_t err_len) {
  return cEntryPoint(err, err_len, [&] {
    const std::vector<uint8_t> id = ep::NvshmemRuntime::unique_id(*config);
    if (id.size() > out_len) {
      throw std::invalid_argument("unique id buffer too small");
    }
    std::memcpy(out, id.data(), id.size());
    *written = id.size();
  });
}

// Collective, once per process: NVSHMEM initialised as PE `rank` of `num_ranks`.
int ep_nvshmem_session_start(int rank, int num_ranks, int device, const uint8_t* uid,
                             size_t uid_len, const ep::NvshmemConfig* config, char* err,
                             size_t err_len) {
  return cEntryPoint(err, err_len, [&] {
    std::vector<uint8_t> id(uid, uid + uid_len);
    ep::NvshmemRuntime::start_session(rank, num_ranks, device, id, *config);
  });
}

// 1 with the session's PE, PE count and device when this process started one, else 0.
int ep_nvshmem_session(int* pe, int* num_pes, int* device) {
  return ep::NvshmemRuntime::session(pe, num_pes, device) ? 1 : 0;
}

// Collective over the session's PEs: new low-latency buffers (nvshmem_malloc).
int ep_nvshmem_create(int rank, int num_ranks, int device, const ep::NvshmemConfig* config,
                      void** out, char* err, size_t err_len) {
  return cEntryPoint(err, err_len,
                     [&] { *out = new ep::NvshmemRuntime(rank, num_ranks, device, *config); });
}

// Collective: the symmetric region, once every rank's ep_nvshmem_create succeeded.
int ep_nvshmem_connect(void* handle, char* err, size_t err_len) {
  return cEntryPoint(err, err_len, [&] { runtime(handle)->connect(); });
}

// No collective: frees a failed setup's buffers (the symmetric region stays in the heap) and the
// object.
void ep_nvshmem_abandon(void* handle) {
  runtime(handle)->abandon();
  delete runtime(handle);
}

int ep_nvshmem_dispatch(void* handle, const ep::NvshmemDispatchArgs* args, cudaStream_t stream,
                        int* buffer_index, char* err, size_t err_len) {
  return cEntryPoint(err, err_len,
                     [&] { *buffer_index = runtime(handle)->dispatch(*args, stream); });
}

int ep_nvshmem_combine(void* handle, const ep::NvshmemCombineArgs* args, cudaStream_t stream,
                       char* err, size_t err_len) {
  return cEntryPoint(err, err_len, [&] { runtime(handle)->combine(*args, stream); });
}

int ep_nvshmem_combine_buffer(void* handle, int buffer_index, int num_experts, int hidden,
                              ep::NvshmemBufferView* out, char* err, size_t err_len) {
  return cEntryPoint(err, err_len, [&] {
    *out = runtime(handle)->combine_buffer(buffer_index, num_experts, hidden);
  });
}

int ep_nvshmem_config(void* handle, ep::NvshmemConfig* out) {
  *out = runtime(handle)->config();
  return 0;
}

// 1 with the kernels' error in `msg` (and `failed` when the runtime cannot be used again), 0
// when there is none. Building the message cannot throw across: a failure there is an error too.
int ep_nvshmem_check_error(void* handle, char* msg, size_t msg_len, int* failed) {
  return ep::capi::checkErrorEntry(runtime(handle), msg, msg_len, failed);
}

// Clears a reported error so the runtime can be used again; -1 (e.g. a sticky CUDA error) if
// that failed.
int ep_nvshmem_clear_error(void* handle, char* err, size_t err_len) {
  return cEntryPoint(err, err_len, [&] { runtime(handle)->clear_error(); });
}

int ep_nvshmem_destroy(void* handle, char* err, size_t err_len) {
  return ep::capi::destroyEntry(runtime(handle), err, err_len);
}

}  // extern "C"

// The definitions above must match the pointer types _C casts dlsym's results to.
#include <type_traits>
static_assert(std::is_same_v<decltype(&ep_nvshmem_abi_version), ep_nvshmem_abi_version_fn>);
static_assert(std::is_same_v<decltype(&ep_nvshmem_unique_id), ep_nvshmem_unique_id_fn>);
static_assert(std::is_same_v<decltype(&ep_nvshmem_session_start), ep_nvshmem_session_start_fn>);
static_assert(std::is_same_v<decltype(&ep_nvshmem_session), ep_nvshmem_session_fn>);
static_assert(std::is_same_v<decltype(&ep_nvshmem_create), ep_nvshmem_create_fn>);
static_assert(std::is_same_v<decltype(&ep_nvshmem_dispatch), ep_nvshmem_dispatch_fn>);
static_assert(std::is_same_v<decltype(&ep_nvshmem_combine), ep_nvshmem_combine_fn>);
static_assert(std::is_same_v<decltype(&ep_nvshmem_combine_buffer), ep_nvshmem_combine_buffer_fn>);
static_assert(std::is_same_v<decltype(&ep_nvshmem_config), ep_nvshmem_config_fn>);
static_assert(std::is_same_v<decltype(&ep_nvshmem_check_error), ep_nvshmem_check_error_fn>);
static_assert(std::is_same_v<decltype(&ep_nvshmem_clear_error), ep_nvshmem_clear_error_fn>);
static_assert(std::is_same_v<decltype(&ep_nvshmem_destroy), ep_nvshmem_destroy_fn>);
static_assert(std::is_same_v<decltype(&ep_nvshmem_connect), ep_nvshmem_connect_fn>);
static_assert(std::is_same_v<decltype(&ep_nvshmem_abandon), ep_nvshmem_abandon_fn>);
