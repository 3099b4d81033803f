#!/usr/bin/env bash
# Rank masking, handles and threads on a GPU machine (2-4 GPUs of one host; one rank per GPU):
# tests/test_rank_mask.py (the NVSHMEM kernels go on without a stopped rank, explicit and
# auto-masked, against ep_backend.reference with mask), the low-latency GPU tests (no
# regression of the unmasked kernels: every launch now reads the device mask),
# tests/test_ll_call_tags_gpu.py (replays of different kinds time out naming the peer) and the CPU
# reliability tests that cover the same code paths. Assumes the package is built for this torch
# (tools/gpu_check.sh builds it: SKIP_TESTS=1 SKIP_BENCH=1 bash tools/gpu_check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo}
python -c 'import ep_backend, pathlib; print("nvshmem lib:", (pathlib.Path(ep_backend.__file__).parent / "libep_nvshmem.so").exists())'
python -m pytest -q -rs tests/test_rank_mask.py tests/test_ll_call_tags_gpu.py tests/test_adversarial.py \
  "tests/test_moe_gpu.py::test_low_latency_on_cuda_match_reference" \
  "tests/test_moe_gpu.py::test_low_latency_cuda_graph_replay_with_new_data" \
  tests/test_moe_low_latency_api.py "$@"
