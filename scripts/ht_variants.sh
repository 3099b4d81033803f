#!/usr/bin/env bash
# Builds the intranode (high-throughput) harness once per kernel variant (nvcc -D switches) and
# prints each variant's kernel times (intranode_test --bench-only: dispatch send-warp sweep,
# defaults, combine), for comparing kernel changes in one GPU session.
# Usage: bash scripts/ht_variants.sh "name=-DFLAG ..." ["name2=" ...]   ("base=": no extra flags;
# "name@DIR=..." builds the sources under DIR instead, e.g. an exported older commit). Needs 2 GPUs.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p build
root=$PWD
pids=()
for v in "$@"; do
  name=${v%%=*}
  src=.
  if [[ $name == *@* ]]; then src=${name#*@}; name=${name%%@*}; fi
  (cd "$src" && BUILD="$root/build/ht_variant_$name" HT_EXTRA_FLAGS="${v#*=}" BUILD_ONLY=1 \
    bash tests/native/build_and_run.sh) >"build/ht_variant_$name.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
[[ $rc == 0 ]] || { tail -20 build/ht_variant_*.log; echo "VARIANT BUILD FAILED"; exit 1; }
for v in "$@"; do
  name=${v%%=*}
  name=${name%%@*}
  echo "== variant $name: ${v#*=}"
  timeout 300 "build/ht_variant_$name/intranode_test" --bench-only |
    grep -E "kernel|dispatch|combine|FAIL" | grep -v "^[A-Z0-9]* dispatch (num_sms"
done
