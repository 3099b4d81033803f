# NVLink transport, torch-free part: kernels + runtime, STATIC library `ep_kernels`.
# Included by the top-level CMakeLists.txt when EP_WITH_CUDA (after enable_language(CUDA) and
# find_package(CUDAToolkit)); CMAKE_CUDA_ARCHITECTURES comes from EP_CUDA_ARCHITECTURES.
# The torch-bound glue (nvlink_*.cpp beside this file) is part of ep_backend_impl.
set(EP_NVLINK_CUDA_DIR "${CMAKE_CURRENT_LIST_DIR}/cuda")
file(GLOB EP_KERNELS_SOURCES CONFIGURE_DEPENDS
  "${EP_NVLINK_CUDA_DIR}/*.cu"
  "${EP_NVLINK_CUDA_DIR}/*.cpp")

add_library(ep_kernels STATIC ${EP_KERNELS_SOURCES})
set_target_properties(ep_kernels PROPERTIES
  POSITION_INDEPENDENT_CODE ON
  CUDA_STANDARD 17
  CUDA_STANDARD_REQUIRED ON
  CUDA_SEPARABLE_COMPILATION OFF)
target_compile_options(ep_kernels PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:-O3 -lineinfo>
  $<$<COMPILE_LANGUAGE:CXX>:-O3>)
target_include_directories(ep_kernels PUBLIC "${EP_NATIVE_DIR}")
target_link_libraries(ep_kernels PUBLIC CUDA::cudart)
