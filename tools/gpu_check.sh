#!/usr/bin/env bash
# Builds ep_backend with CUDA against the installed torch, runs the GPU tests and the benchmark.
# Usage (on a machine with GPUs): bash tools/gpu_check.sh [extra pytest args]
# SKIP_TESTS=1 / SKIP_BENCH=1 skip parts, BENCH_ARGS adds bench flags; RUN_NATIVE=1 also runs
# the torch-free nvlink kernel harnesses (nvlink_test, then nvlink_bench), RUN_LL=1 the torch-free
# NVSHMEM low-latency harness (nvshmem_test; 2 GPUs; LL_QUICK=1: short suite). Both are built by
# CMake (tests/native/native_tests.cmake) into build/native.
# The GPU tests run one rank per GPU (EP4 on 4 GPUs); EP_TEST_WORLD_SIZE=N sets the rank count.
# Logs go to $OUT (default ./out). Repeat the figures in docs/performance.md with this script.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 EP_WITH_CUDA=${EP_WITH_CUDA:-1} TORCH_CUDA_ARCH_LIST=9.0a
export EP_BUILD_DIR=${EP_BUILD_DIR:-$PWD/.build-gpu} MAX_JOBS=${MAX_JOBS:-16}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' | tee -a "$OUT/gpus.txt"

start=$(date +%s)
native_targets=()
[ "${RUN_NATIVE:-0}" = "1" ] && native_targets+=(nvlink_test nvlink_bench)
[ "${RUN_LL:-0}" = "1" ] && native_targets+=(nvshmem_test)
if [ ${#native_targets[@]} -gt 0 ]; then  # build the torch-free harnesses alongside the package
  export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo}
  {
    cmake -S . -B build/native -DEP_WITH_CUDA=ON -DEP_BUILD_NATIVE_TESTS=ON \
      -DEP_CUDA_ARCHITECTURES=90a -DPython3_EXECUTABLE="$(command -v python)" &&
      cmake --build build/native -j "$MAX_JOBS" --target "${native_targets[@]}"
  } >"$OUT/native_build.log" 2>&1 &
  native_build=$!
fi
if ! python -m pip install -v --no-build-isolation --no-deps --no-index -e . >"$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"
  echo "BUILD FAILED"
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
# Optional: nvshmem4py and its cuda-python wheels (no network on the GPU machine; carry them in
# .whl312/ for Python 3.12). tests/test_nvshmem4py_gpu.py runs only where it is installed.
if ls .whl312/nvshmem4py*.whl >/dev/null 2>&1; then
  python -c "import numpy" 2>/dev/null || python -m pip install -q --no-deps --no-index .whl312/numpy*.whl
  python -m pip install -q --no-deps --no-index $(ls .whl312/*.whl | grep -v numpy) >"$OUT/nvshmem4py_install.log" 2>&1 \
    && echo "nvshmem4py installed from .whl312/" || echo "WARNING: nvshmem4py install failed (see nvshmem4py_install.log)"
fi
if [ "$EP_WITH_CUDA" = "1" ] && [ ! -e ep_backend/libep_nvshmem.so ]; then
  echo "WARNING: ep_backend/libep_nvshmem.so is missing: the low-latency ops will use ATen"
  grep -A16 "libep_nvshmem.so not built" "$OUT/build.log" | head -20
fi

rc=0
if [ "${RUN_LL:-0}" = "1" ]; then  # NVSHMEM low-latency kernels (correctness, soak, latency)
  wait "$native_build" || { echo "NATIVE HARNESS BUILD FAILED"; tail -30 "$OUT/native_build.log"; rc=1; }
  native_build_waited=1
  ll=build/native/nvshmem_test
  run_ll() {  # run_ll SECONDS ARGS...: one harness run, logged; a failure does not stop the rest
    local t=$1; shift
    echo "== nvshmem_test $*"
    timeout "$t" "$ll" "$@"
    local r=$?; echo "== nvshmem_test $* -> rc=$r"; return $r
  }
  if [ -x "$ll" ]; then
    if [ "${LL_QUICK:-0}" = "1" ]; then  # short suite + latency only
      run_ll 150 --quick --no-recreate 2>&1 | tee "$OUT/ll_harness.log" | grep -v "^ok "
      rc=$(( rc | PIPESTATUS[0] ))
    else {
      run_ll "${LL_SUITE_S:-240}" --no-recreate; r1=$?                   # the whole suite + latency
      run_ll 90 --quick --no-bench --no-recreate --no-p2p; r2=$?         # NVSHMEM put path
      run_ll 40 --timeout-test; r3=$?                                    # a stalled peer is named
      run_ll 60 --quick --no-bench --soak 0 --graph 0; r4=$?             # runtime re-creation
      exit $(( r1 | r2 | r3 | r4 ))
    } 2>&1 | tee "$OUT/ll_harness.log" | grep -vE "^\s*$" | tail -60
    rc=$(( rc | PIPESTATUS[0] ))
    fi
  fi
fi
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  python -m pytest -q -p no:cacheprovider -m gpu "$@" tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
  rc=$(( rc | PIPESTATUS[0] ))
  grep -E "^[0-9]+ (passed|failed)|passed|failed" "$OUT/gpu_tests.log" | tail -1
fi
if [ "${RUN_NATIVE:-0}" = "1" ]; then  # the torch-free nvlink harnesses (correctness, then kernel timings)
  if [ "${native_build_waited:-0}" != "1" ]; then
    wait "$native_build" || { echo "NATIVE HARNESS BUILD FAILED"; tail -30 "$OUT/native_build.log"; rc=1; }
  fi
  if [ -x build/native/nvlink_test ]; then
    timeout 300 build/native/nvlink_test 2>&1 | tee "$OUT/native_harness.log" | tail -30
    rc=$(( rc | PIPESTATUS[0] ))
    timeout 300 build/native/nvlink_bench 2>&1 | tee "$OUT/native_bench.log" | tail -30
    rc=$(( rc | PIPESTATUS[0] ))
  fi
fi
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  python -m ep_backend.bench --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -60
  rc=$(( rc | PIPESTATUS[0] ))
fi
exit $rc
