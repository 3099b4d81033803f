# Torch-free CUDA kernels + intranode runtime: STATIC library `ep_kernels`.
# Included by the top-level CMakeLists.txt when EP_WITH_CUDA (after enable_language(CUDA) and
# find_package(CUDAToolkit)); CMAKE_CUDA_ARCHITECTURES comes from EP_CUDA_ARCHITECTURES (90a).
set(EP_KERNELS_DIR "${CMAKE_CURRENT_LIST_DIR}")
set(EP_RUNTIME_DIR "${CMAKE_CURRENT_LIST_DIR}/../runtime")
file(GLOB EP_KERNELS_SOURCES CONFIGURE_DEPENDS
  "${EP_KERNELS_DIR}/*.cu"
  "${EP_RUNTIME_DIR}/*.cu"
  "${EP_RUNTIME_DIR}/*.cpp")
# The NVSHMEM low-latency sources build separately (ll.cmake: -rdc, shared library).
list(FILTER EP_KERNELS_SOURCES EXCLUDE REGEX "/(ll_[^/]*|nvshmem_[^/]*)\\.(cu|cpp)$")

add_library(ep_kernels STATIC ${EP_KERNELS_SOURCES})
set_target_properties(ep_kernels PROPERTIES
  POSITION_INDEPENDENT_CODE ON
  CUDA_STANDARD 17
  CUDA_STANDARD_REQUIRED ON
  CUDA_SEPARABLE_COMPILATION OFF)
target_compile_options(ep_kernels PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:-O3 -lineinfo>
  $<$<COMPILE_LANGUAGE:CXX>:-O3>)
target_include_directories(ep_kernels PUBLIC "${EP_KERNELS_DIR}" "${EP_RUNTIME_DIR}")
target_link_libraries(ep_kernels PUBLIC CUDA::cudart)
