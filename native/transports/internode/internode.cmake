# Internode transport, torch-free part: the hierarchical kernels and their runtime, compiled into
# libep_nvshmem.so (they use the NVSHMEM device state that library holds, and the session its
# low-latency runtime starts). The torch-bound glue (internode_transport.cpp beside this file) is
# part of ep_backend_impl and reaches them through dlsym (cuda/internode_capi.h).
# Included by the top-level CMakeLists.txt when the ep_nvshmem target exists.
set(EP_INTERNODE_DIR "${CMAKE_CURRENT_LIST_DIR}/cuda")
target_sources(ep_nvshmem PRIVATE
  "${EP_INTERNODE_DIR}/internode_kernels.cu"
  "${EP_INTERNODE_DIR}/internode_runtime.cpp"
  "${EP_INTERNODE_DIR}/row_exchange.cu"
  "${EP_INTERNODE_DIR}/internode_capi.cpp")
