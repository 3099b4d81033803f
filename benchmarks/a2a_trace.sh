#!/usr/bin/env bash
# A per-block timeline of the NVLink all-to-all kernel (issue 42's large sizes): copies the
# tracked tree to a scratch folder, instruments its kernel there (benchmarks/a2a_trace.patch: a
# %globaltimer stamp per block at each wait and copy, written to mapped host memory; never in a
# production build), builds it, traces one call per setting and prints where the blocks wait
# (benchmarks/a2a_trace.py report).
#
# Usage: bash benchmarks/a2a_trace.sh "R MIB" ...      e.g. "4 256" "4 64" "2 256"
#   (default: "4 256" "2 256"); traces and logs under $OUT (./out)/a2a_trace.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$PWD/out}/a2a_trace
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ $# -gt 0 ] || set -- "4 256" "2 256"
dir=/tmp/ep_a2a_trace
rm -rf "$dir" && mkdir -p "$dir" "$OUT"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$dir")
(cd "$dir" && patch -p1 -s <benchmarks/a2a_trace.patch)
(cd "$dir" && EP_WITH_CUDA=1 EP_BUILD_DIR="$dir/.build" TORCH_CUDA_ARCH_LIST=9.0a \
  python setup.py build_ext --inplace) >"$OUT/build.log" 2>&1 ||
  { tail -20 "$OUT/build.log"; echo "TRACE BUILD FAILED"; exit 1; }
for setting in "$@"; do
  read -r ranks mib <<<"$setting"
  echo "== R = $ranks, $mib MiB a peer"
  # PYTHONPATH: the instrumented copy's ep_backend, not an installed one.
  (cd "$dir" && PYTHONPATH=$PWD timeout 120 python benchmarks/a2a_trace.py run "$ranks" "$mib" \
    "$OUT/r${ranks}_${mib}") >"$OUT/r${ranks}_${mib}.log" 2>&1 || { tail -20 "$OUT/r${ranks}_${mib}.log"; exit 1; }
  python "$ROOT/benchmarks/a2a_trace.py" report "$OUT/r${ranks}_${mib}"
done
