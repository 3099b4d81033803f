# Torch-free kernel harnesses (option EP_BUILD_NATIVE_TESTS, default OFF; needs EP_WITH_CUDA).
# Included by the top-level CMakeLists.txt after the transports' cmake files:
#   nvlink_test   correctness of the nvlink runtime (R = 1, 2, 4, 8 ranks in one process)
#   nvlink_bench  kernel timings and send-warp sweeps of the nvlink runtime (2 GPUs)
#   nvshmem_test  2-process correctness, soak and latency of the NVSHMEM runtime (--bench-only:
#                 latency only); built when the NVSHMEM library is (EP_HAS_NVSHMEM)
# Build: cmake -S . -B build/native -DEP_WITH_CUDA=ON -DEP_BUILD_NATIVE_TESTS=ON
#          -DEP_CUDA_ARCHITECTURES=90a -DPython3_EXECUTABLE=$(which python)
#        cmake --build build/native --target nvlink_test nvlink_bench nvshmem_test
# EP_NATIVE_TEST_FLAGS: extra nvcc flags for the kernels and harnesses of these targets (e.g. the
# -D switch of a kernel variant being measured: benchmarks/ht_variants.sh, ll_variants.sh).
set(EP_NATIVE_TEST_FLAGS "" CACHE STRING "Extra nvcc flags of the native harness targets")
separate_arguments(_ep_native_test_flags UNIX_COMMAND "${EP_NATIVE_TEST_FLAGS}")
set(EP_NATIVE_TESTS_DIR "${CMAKE_CURRENT_LIST_DIR}")

# The flags go to the transports' own kernel libraries too: a variant's build directory builds
# only these targets (and the libraries they link), never the package.
if(_ep_native_test_flags)
  target_compile_options(ep_kernels PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${_ep_native_test_flags}>)
  if(EP_HAS_NVSHMEM)
    target_compile_options(ep_nvshmem PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${_ep_native_test_flags}>)
  endif()
endif()
find_package(Threads REQUIRED)

foreach(_ep_harness nvlink_test nvlink_bench)
  add_executable(${_ep_harness} "${EP_NATIVE_TESTS_DIR}/${_ep_harness}.cu")
  set_target_properties(${_ep_harness} PROPERTIES CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON)
  target_compile_options(${_ep_harness} PRIVATE -O3 -lineinfo ${_ep_native_test_flags})
  # Harness sources include "tests/native/..." (repository root) and "transports/..." (native/).
  target_include_directories(${_ep_harness} PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}")
  target_link_libraries(${_ep_harness} PRIVATE ep_kernels Threads::Threads)
endforeach()

if(EP_HAS_NVSHMEM)
  # Links the library the product's glue loads at run time (dlopen), with NVSHMEM's device state.
  add_executable(nvshmem_test "${EP_NATIVE_TESTS_DIR}/nvshmem_test.cu")
  set_target_properties(nvshmem_test PROPERTIES
    CUDA_STANDARD 17
    CUDA_STANDARD_REQUIRED ON
    BUILD_RPATH "${EP_NVSHMEM_HOME}/lib")
  # The CPU reference rounds as the spec does: no fused multiply-adds on the host.
  target_compile_options(nvshmem_test PRIVATE -O3 -lineinfo -Xcompiler=-ffp-contract=off
                                              ${_ep_native_test_flags})
  target_include_directories(nvshmem_test PRIVATE "${EP_NVSHMEM_HOME}/include"
                                                  "${CUDAToolkit_INCLUDE_DIRS}/cccl")
  target_link_libraries(nvshmem_test PRIVATE ep_nvshmem "${EP_NVSHMEM_HOME}/lib/libnvshmem_host.so.3"
                                             Threads::Threads)
endif()
