#!/usr/bin/env bash
# Builds the nvlink (high-throughput) benchmark once per kernel variant (nvcc -D switches, through
# CMake) and prints each variant's kernel times (nvlink_bench: dispatch send-warp sweep, defaults,
# combine), for comparing kernel changes in one GPU session.
# Usage: bash benchmarks/ht_variants.sh "name=-DFLAG ..." ["name2=" ...]   ("base=": no extra flags;
# "name@DIR=..." builds the sources under DIR instead: an exported commit with the CMake harness
# targets). Needs 2 GPUs
# (HT_BENCH_ONE_GPU=1: both ranks on one GPU, a same-session A/B only, not NVLink figures).
# HT_COMBINE_WARPS="3,4,6" sweeps those combine send-warp splits instead of 4 and 5.
# HT_VARIANT_ROUNDS=n runs the variants n times, interleaved (base, a, b, base, a, b, ...), so
# drift between runs shows; HT_BENCH_QUICK=1 keeps each run to the default configuration's rows.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source benchmarks/variants_build.sh
build_variants nvlink_bench ht_variant "$@"
for ((round = 1; round <= ${HT_VARIANT_ROUNDS:-1}; ++round)); do
  for v in "$@"; do
    name=$(variant_name "$v")
    echo "== variant $name (round $round): ${v#*=}"
    timeout 300 "build/ht_variant_$name/nvlink_bench" |
      grep -E "kernel|dispatch|combine|FAIL" | grep -v "^[A-Z0-9]* dispatch (num_sms"
  done
done
