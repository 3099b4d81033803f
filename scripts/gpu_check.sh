#!/usr/bin/env bash
# Builds ep_backend with CUDA against the installed torch, runs the GPU tests and the benchmark.
# Usage (on a machine with GPUs): bash scripts/gpu_check.sh [extra pytest args]
# SKIP_TESTS=1 / SKIP_BENCH=1 skip parts; RUN_NATIVE=1 also runs the torch-free intranode kernel
# harness, RUN_LL=1 the torch-free NVSHMEM low-latency harness (2 GPUs).
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
if ! python -m pip install --no-build-isolation --no-deps --no-index -e . >"$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"
  echo "BUILD FAILED"
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s"

rc=0
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  python -m pytest -q -p no:cacheprovider -m gpu "$@" tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
  rc=${PIPESTATUS[0]}
  grep -E "^[0-9]+ (passed|failed)|passed|failed" "$OUT/gpu_tests.log" | tail -1
fi
if [ "${RUN_NATIVE:-0}" = "1" ]; then  # the torch-free kernel harness (correctness + kernel timings)
  timeout 400 bash tests/native/build_and_run.sh 2>&1 | tee "$OUT/native_harness.log" | tail -30
  rc=$(( rc | PIPESTATUS[0] ))
fi
if [ "${RUN_LL:-0}" = "1" ]; then  # NVSHMEM low-latency kernels (correctness, soak, latency)
  export PYTHON=$(command -v python) NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo}
  ll=build/native_ll_test/ll_test
  { BUILD_ONLY=1 bash tests/native/build_ll_and_run.sh &&
    timeout 330 "$ll" --no-recreate &&                               # the whole suite + latency
    timeout 90 "$ll" --quick --no-bench --no-recreate --no-p2p &&    # NVSHMEM put path
    timeout 40 "$ll" --timeout-test &&                               # a stalled peer is named
    timeout 60 "$ll" --quick --no-bench --soak 0 --graph 0; } 2>&1 |  # runtime re-creation
    tee "$OUT/ll_harness.log" | tail -60
  rc=$(( rc | PIPESTATUS[0] ))
fi
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  python -m ep_backend.bench --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -60
  rc=$(( rc | PIPESTATUS[0] ))
fi
exit $rc
