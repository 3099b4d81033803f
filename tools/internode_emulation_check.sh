#!/usr/bin/env bash
# Builds ep_backend with CUDA and runs the emulated-node tests (issue #40) on a GPU machine:
# 2 GPUs as 2 nodes x 1; with 4 GPUs also 2 x 2 and 4 x 1 (EP_RANKS_PER_NODE, set per test),
# plus the CPU tests of the topology and the per-node layout counts, and the intranode GPU tests
# of dispatch (a group of one node keeps the NVLink path), and the internode transport against the
# spec (bitwise copies, combine in its node order), a bad input, and a soak.
# Usage: bash tools/internode_emulation_check.sh [extra pytest args]. Logs go to $OUT (./out).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 EP_WITH_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0a
export EP_BUILD_DIR=${EP_BUILD_DIR:-$PWD/.build-gpu} MAX_JOBS=${MAX_JOBS:-16}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpus.txt"
if ! python -m pip install -v --no-build-isolation --no-deps --no-index -e . >"$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"
  echo "BUILD FAILED"
  exit 1
fi
python -m pytest -q -p no:cacheprovider -rs "$@" \
  tests/test_internode_emulation_gpu.py tests/test_topology.py tests/test_layout_per_node.py \
  tests/test_reference_combine_by_node.py \
  tests/test_intranode_gpu.py tests/test_moe_gpu.py 2>&1 | tee "$OUT/internode_emulation.log" | tail -40
exit "${PIPESTATUS[0]}"
