#!/usr/bin/env bash
# Builds the low-latency harness once per kernel variant (nvcc -D switches, CMake) and prints each
# variant's latency (nvshmem_test --bench-only), for comparing kernel changes in one GPU session.
# Usage: bash benchmarks/ll_variants.sh "name=-DFLAG ..." ["name2=" ...] ("base=" builds without
# extra flags; "name@DIR=..." builds the sources under DIR instead: an exported commit with the
# CMake harness targets). Needs 2 GPUs and the nvidia-nvshmem-cu13 wheel.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo}
source benchmarks/variants_build.sh
build_variants nvshmem_test ll_variant "$@"
for round in 1 2; do  # twice, alternating, so host drift shows
  for v in "$@"; do
    name=$(variant_name "$v")
    echo "== variant $name (round $round): ${v#*=}"
    timeout 120 "build/ll_variant_$name/nvshmem_test" --bench-only | grep -E "^(bench|FAIL)|FAILED"
  done
done
