#!/usr/bin/env bash
# The all-to-all checks on a GPU machine (2-4 GPUs of one host): the GPU tests of
# tests/test_all_to_all_gpu.py (ep's NVLink kernel vs NCCL, bitwise; async; graph capture; device
# splits) and the bench (benchmarks/all_to_all.py, plot to bench_all_to_all.png). Assumes the
# package is built for this torch (tools/gpu_check.sh builds it).
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python -m pytest -q -x tests/test_all_to_all_gpu.py tests/test_all_to_all_cpu.py
python benchmarks/all_to_all.py --iters ${A2A_ITERS:-20} --png bench_all_to_all.png
