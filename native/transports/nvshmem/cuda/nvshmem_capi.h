// C entry points of libep_nvshmem.so (see nvshmem_capi.cpp); the function pointer types below
// are what ep_backend._C looks up with dlsym. Bump EP_NVSHMEM_ABI_VERSION when any of them changes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

// 6: the NVSHMEM session split from the buffers (ep_nvshmem_session_start, ep_nvshmem_session;
//    ep_nvshmem_create takes no unique id and never initialises NVSHMEM).
// 8: ep_nvshmem_create makes this rank's part only; ep_nvshmem_connect (collective) the symmetric
//    region; ep_nvshmem_abandon frees a failed setup's buffers with no collective.
#define EP_NVSHMEM_ABI_VERSION 9

namespace ep {
struct NvshmemConfig;
struct NvshmemDispatchArgs;
struct NvshmemCombineArgs;
struct NvshmemBufferView;
}  // namespace ep

extern "C" {
typedef int (*ep_nvshmem_abi_version_fn)();
typedef int (*ep_nvshmem_unique_id_fn)(const ep::NvshmemConfig*, uint8_t*, size_t, size_t*, char*,
                                       size_t);
typedef int (*ep_nvshmem_session_start_fn)(int, int, int, const uint8_t*, size_t,
                                           const ep::NvshmemConfig*, char*, size_t);
typedef int (*ep_nvshmem_session_fn)(int*, int*, int*);
typedef int (*ep_nvshmem_create_fn)(int, int, int, const ep::NvshmemConfig*, void**, char*, size_t);
typedef int (*ep_nvshmem_dispatch_fn)(void*, const ep::NvshmemDispatchArgs*, cudaStream_t, int*,
                                      char*, size_t);
typedef int (*ep_nvshmem_combine_fn)(void*, const ep::NvshmemCombineArgs*, cudaStream_t, char*,
                                     size_t);
typedef int (*ep_nvshmem_combine_buffer_fn)(void*, int, int, int, ep::NvshmemBufferView*, char*,
                                            size_t);
typedef int (*ep_nvshmem_config_fn)(void*, ep::NvshmemConfig*);
typedef int (*ep_nvshmem_check_error_fn)(void*, char*, size_t, int*);
typedef int (*ep_nvshmem_clear_error_fn)(void*, char*, size_t);
typedef int (*ep_nvshmem_destroy_fn)(void*, char*, size_t);
typedef int (*ep_nvshmem_connect_fn)(void*, char*, size_t);
typedef void (*ep_nvshmem_abandon_fn)(void*);
}
