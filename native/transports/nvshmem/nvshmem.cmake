# NVSHMEM transport, torch-free part: low-latency (decode) kernels + NVSHMEM runtime, SHARED
# library `ep_nvshmem`. The torch-bound glue (nvshmem_*.cpp beside this file) is part of
# ep_backend_impl and loads this library at run time (dlopen).
# Included by the top-level CMakeLists.txt when EP_WITH_CUDA; needs EP_WITH_NVSHMEM (auto|ON|OFF):
# auto builds it when the nvidia-nvshmem-cu13 wheel is importable from Python3_EXECUTABLE.
# Device code is relocatable (-rdc) and device-linked here against libnvshmem_device.a
# (CUDA_RESOLVE_DEVICE_SYMBOLS), so NVSHMEM's device state lives in this .so; nvshmemx_init_attr
# in nvshmem_runtime.cpp initialises exactly that state. Host side: libnvshmem_host.so.3.
set(EP_WITH_NVSHMEM "auto" CACHE STRING "Build the NVSHMEM low-latency library: auto, ON or OFF")
set_property(CACHE EP_WITH_NVSHMEM PROPERTY STRINGS auto ON OFF)
set(EP_HAS_NVSHMEM OFF)

if(NOT EP_WITH_NVSHMEM STREQUAL "OFF")
  if(NOT EP_NVSHMEM_HOME)
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" -c
              "import nvidia.nvshmem as m; print(list(m.__path__)[0])"
      OUTPUT_VARIABLE EP_NVSHMEM_HOME OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE _ep_nvshmem_rc ERROR_QUIET)
    if(NOT _ep_nvshmem_rc EQUAL 0)
      set(EP_NVSHMEM_HOME "")
    endif()
  endif()
  if(EP_NVSHMEM_HOME AND EXISTS "${EP_NVSHMEM_HOME}/lib/libnvshmem_device.a"
     AND EXISTS "${EP_NVSHMEM_HOME}/lib/libnvshmem_host.so.3")
    set(EP_HAS_NVSHMEM ON)
  elseif(EP_WITH_NVSHMEM STREQUAL "ON")
    message(FATAL_ERROR "EP_WITH_NVSHMEM=ON but the nvidia-nvshmem-cu13 wheel was not found "
                        "(pip install nvidia-nvshmem-cu13, or pass -DEP_NVSHMEM_HOME=<dir with include/ lib/>)")
  else()
    message(STATUS "ep: NVSHMEM wheel not found, skipping the low-latency library")
  endif()
endif()

if(EP_HAS_NVSHMEM)
  message(STATUS "ep: NVSHMEM from ${EP_NVSHMEM_HOME}")
  set(EP_NVSHMEM_DIR "${CMAKE_CURRENT_LIST_DIR}/cuda")
  add_library(ep_nvshmem SHARED
    "${EP_NVSHMEM_DIR}/nvshmem_dispatch.cu"
    "${EP_NVSHMEM_DIR}/nvshmem_combine.cu"
    "${EP_NVSHMEM_DIR}/nvshmem_runtime.cpp"
    "${EP_NVSHMEM_DIR}/nvshmem_capi.cpp")
  set_target_properties(ep_nvshmem PROPERTIES
    POSITION_INDEPENDENT_CODE ON
    CUDA_STANDARD 17
    CUDA_STANDARD_REQUIRED ON
    CUDA_SEPARABLE_COMPILATION ON
    CUDA_RESOLVE_DEVICE_SYMBOLS ON
    BUILD_RPATH "${EP_NVSHMEM_HOME}/lib"
    INSTALL_RPATH "$ORIGIN;${EP_NVSHMEM_HOME}/lib")
  target_compile_options(ep_nvshmem PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-O3 -lineinfo>
    $<$<COMPILE_LANGUAGE:CXX>:-O3>)
  target_include_directories(ep_nvshmem
    PUBLIC "${EP_NATIVE_DIR}"
    PRIVATE "${EP_NVSHMEM_HOME}/include" "${CUDAToolkit_INCLUDE_DIRS}"
            "${CUDAToolkit_INCLUDE_DIRS}/cccl")
  target_link_libraries(ep_nvshmem
    PRIVATE "${EP_NVSHMEM_HOME}/lib/libnvshmem_device.a"
            "${EP_NVSHMEM_HOME}/lib/libnvshmem_host.so.3"
    PUBLIC CUDA::cudart)
endif()
