// C entry points of libep_nvshmem.so (see nvshmem_capi.cpp); the function pointer types below
// are what ep_backend._C looks up with dlsym. Bump EP_LL_ABI_VERSION when any of them changes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#define EP_LL_ABI_VERSION 1

namespace ep {
struct LowLatencyConfig;
struct LowLatencyDispatchArgs;
struct LowLatencyCombineArgs;
struct LowLatencyBufferView;
}  // namespace ep

extern "C" {
typedef int (*ep_ll_abi_version_fn)();
typedef int (*ep_ll_unique_id_fn)(const ep::LowLatencyConfig*, uint8_t*, size_t, size_t*, char*,
                                  size_t);
typedef int (*ep_ll_create_fn)(int, int, int, const uint8_t*, size_t, const ep::LowLatencyConfig*,
                               void**, char*, size_t);
typedef int (*ep_ll_dispatch_fn)(void*, const ep::LowLatencyDispatchArgs*, cudaStream_t, int*,
                                 char*, size_t);
typedef int (*ep_ll_combine_fn)(void*, const ep::LowLatencyCombineArgs*, cudaStream_t, char*,
                                size_t);
typedef int (*ep_ll_combine_buffer_fn)(void*, int, int, int, ep::LowLatencyBufferView*, char*,
                                       size_t);
typedef int (*ep_ll_config_fn)(void*, ep::LowLatencyConfig*);
typedef int (*ep_ll_check_error_fn)(void*, char*, size_t, int*);
typedef void (*ep_ll_clear_error_fn)(void*);
typedef int (*ep_ll_destroy_fn)(void*, char*, size_t);
}
