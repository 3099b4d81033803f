#!/usr/bin/env bash
# Builds the nvlink kernels + runtime + harness with nvcc alone (no CMake, no torch) and runs
# the harness. Usage: tests/native/build_and_run.sh [harness args...]   (OUT=dir for logs)
# HT_EXTRA_FLAGS adds nvcc flags (e.g. -DEP_HT_TIMELINE: the bench prints each kernel's timeline;
# give such builds their own BUILD directory); BUILD_ONLY=1 stops after the build.
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUILD=${BUILD:-build/native_test}
mkdir -p "$BUILD"
NVCC_FLAGS=(-arch=sm_90a -std=c++17 -O3 -Inative -lineinfo ${HT_EXTRA_FLAGS:-})
objs=()
pids=()
for src in native/transports/nvlink/cuda/*.cu native/transports/nvlink/cuda/*.cpp \
  tests/native/nvlink_test.cu; do
  obj="$BUILD/$(basename "$src").o"
  if [[ $src == *.cpp ]]; then lang=(-x cu); else lang=(); fi
  nvcc "${NVCC_FLAGS[@]}" "${lang[@]}" -c "$src" -o "$obj" &
  pids+=($!)
  objs+=("$obj")
done
for pid in "${pids[@]}"; do wait "$pid"; done  # set -e: any failed compile stops here
nvcc -arch=sm_90a -o "$BUILD/nvlink_test" "${objs[@]}" -lpthread
if [[ "${BUILD_ONLY:-0}" == 1 ]]; then exit 0; fi
"$BUILD/nvlink_test" "$@"
