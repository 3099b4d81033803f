// C entry points of the internode runtime in libep_nvshmem.so (internode_capi.cpp); the pointer
// types below are what ep_backend._C looks up with dlsym (transports/internode/
// internode_transport.cpp). Bump EP_INTERNODE_ABI_VERSION when any of them changes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#define EP_INTERNODE_ABI_VERSION 8

namespace ep {
struct InternodeSetup;
struct InternodeNotifyArgs;
struct InternodeDispatchArgs;
struct InternodeCombineArgs;
struct RowExchangeSetup;
namespace internode {
struct Capacity;
}
}  // namespace ep

extern "C" {
typedef int (*ep_internode_abi_version_fn)();
typedef size_t (*ep_internode_symmetric_bytes_fn)(int, int, const ep::internode::Capacity*);
typedef int (*ep_internode_create_fn)(const ep::InternodeSetup*, void**, char*, size_t);
typedef int (*ep_internode_connect_fn)(void*, char*, size_t);
typedef void (*ep_internode_abandon_fn)(void*);
typedef int (*ep_internode_notify_fn)(void*, const ep::InternodeNotifyArgs*, cudaStream_t,
                                      uint64_t*, char*, size_t);
typedef int (*ep_internode_notify_counts_fn)(void*, uint64_t, int64_t*, int64_t*, int);
typedef void (*ep_internode_take_rejection_fn)(void*, char*, size_t);
typedef int (*ep_internode_dispatch_fn)(void*, const ep::InternodeDispatchArgs*, cudaStream_t,
                                        char*, size_t);
typedef int (*ep_internode_combine_fn)(void*, const ep::InternodeCombineArgs*, cudaStream_t, char*,
                                       size_t);
typedef int (*ep_internode_check_error_fn)(void*, char*, size_t, int*);
typedef int (*ep_internode_destroy_fn)(void*, char*, size_t);
typedef void (*ep_internode_progress_fn)(void*, char*, size_t);
// The agreement's row exchange (row_exchange.hpp).
typedef size_t (*ep_row_exchange_symmetric_bytes_fn)(int);
typedef int (*ep_row_exchange_create_fn)(const ep::RowExchangeSetup*, void**, char*, size_t);
typedef int (*ep_row_exchange_connect_fn)(void*, char*, size_t);
typedef void (*ep_row_exchange_abandon_fn)(void*);
typedef int (*ep_row_exchange_gather_fn)(void*, const int64_t*, int, double, int64_t*, char*,
                                         size_t, char*, size_t);
typedef int (*ep_row_exchange_destroy_fn)(void*, char*, size_t);
}
