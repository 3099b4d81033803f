#!/usr/bin/env bash
# Builds the low-latency (NVSHMEM) kernels + runtime + 2-process harness with nvcc alone (no
# CMake, no torch) and runs the harness. NVSHMEM comes from the nvidia-nvshmem-cu13 Python wheel
# of $PYTHON (default: python), or from NVSHMEM_HOME (its include/ and lib/).
# (The binary keeps its name ll_test: scripts/gpu_check.sh runs it.)
# Usage: tests/native/build_ll_and_run.sh [harness args...]   e.g. --timeout-test, --no-p2p, --quick
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Both ranks run on this host: bootstrap over loopback unless told otherwise.
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo}
PYTHON=${PYTHON:-python}
if [[ -z "${NVSHMEM_HOME:-}" ]]; then
  NVSHMEM_HOME=$("$PYTHON" -c 'import nvidia.nvshmem as m, os; print(list(m.__path__)[0])' 2>/dev/null || true)
fi
if [[ -z "$NVSHMEM_HOME" || ! -e "$NVSHMEM_HOME/lib/libnvshmem_device.a" ]]; then
  echo "NVSHMEM not found: pip install nvidia-nvshmem-cu13, or set NVSHMEM_HOME" >&2
  exit 2
fi
NVCC=${NVCC:-nvcc}
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v "$NVCC")")")}
CCCL=$CUDA_HOME/include/cccl
[[ -d $CCCL ]] || CCCL=$CUDA_HOME/targets/x86_64-linux/include/cccl
BUILD=${BUILD:-build/native_ll_test}
mkdir -p "$BUILD"
FLAGS=(-arch=sm_90a -std=c++17 -O3 -rdc=true -lineinfo -Xcompiler -ffp-contract=off
  -Inative -I"$NVSHMEM_HOME/include" -I"$CCCL")
# Per-stage kernel timeline in the harness's latency report (LL_TIMELINE=0 builds without it).
if [[ "${LL_TIMELINE:-1}" == 1 ]]; then FLAGS+=(-DEP_LL_TIMELINE); fi
# Extra nvcc flags (e.g. -D switches of a kernel variant being measured).
if [[ -n "${LL_EXTRA_FLAGS:-}" ]]; then read -r -a extra <<<"$LL_EXTRA_FLAGS"; FLAGS+=("${extra[@]}"); fi
objs=()
pids=()
for src in native/transports/nvshmem/cuda/nvshmem_dispatch.cu \
  native/transports/nvshmem/cuda/nvshmem_combine.cu \
  native/transports/nvshmem/cuda/nvshmem_runtime.cpp tests/native/nvshmem_test.cu; do
  obj="$BUILD/$(basename "$src").o"
  if [[ $src == *.cpp ]]; then lang=(-x cu); else lang=(); fi
  "$NVCC" "${FLAGS[@]}" "${lang[@]}" -c "$src" -o "$obj" &
  pids+=($!)
  objs+=("$obj")
done
for pid in "${pids[@]}"; do wait "$pid"; done  # set -e: any failed compile stops here
# Device link includes libnvshmem_device.a; host side links libnvshmem_host.so.3.
"$NVCC" -arch=sm_90a -rdc=true -o "$BUILD/ll_test" "${objs[@]}" \
  -L"$NVSHMEM_HOME/lib" -lnvshmem_device -l:libnvshmem_host.so.3 -lpthread \
  -Xlinker -rpath -Xlinker "$NVSHMEM_HOME/lib"
export LD_LIBRARY_PATH="$NVSHMEM_HOME/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [[ "${BUILD_ONLY:-0}" == 1 ]]; then exit 0; fi
"$BUILD/ll_test" "$@"
