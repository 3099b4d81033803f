#!/usr/bin/env bash
# The NVLink all-to-all kernel's tuning constants A/B'd in one GPU run: builds the package once
# per variant (compile definitions through CMake's EP_VARIANT_DEFINES, host and device code alike,
# in a copy of this checkout each), then runs benchmarks/all_to_all.py with each, interleaved over
# rounds (base, a, b, base, a, b, ...: a shared host drifts). Issue #42's large-message target.
#
# Usage: bash benchmarks/a2a_variants.sh "name[@DIR]=DEFINE[;DEFINE...]" ...
#   "name@DIR=": the sources of another tree (e.g. a branch exported with
#   `git archive BRANCH | tar x -C DIR`) instead of this checkout's working tree
#   e.g. "base=" "chunk256k=EP_A2A_CHUNK_BYTES=262144" "send48=EP_A2A_SEND_BLOCKS=48"
#        "both=EP_A2A_CHUNK_BYTES=262144;EP_A2A_SEND_BLOCKS=48"
#   (macros: EP_A2A_CHUNK_BYTES, EP_A2A_SLOTS, EP_A2A_SEND_BLOCKS, EP_A2A_LINES_MAX_BYTES;
#   nvlink_common.hpp)
#   A patched tree, e.g. benchmarks/a2a_all_destinations.patch (every sender block serves every
#   destination in turn; correct with 2-4 ranks, never timed):
#     d=/tmp/alldest; rm -rf $d; mkdir -p $d
#     git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t $d
#     (cd $d && patch -p1 <benchmarks/a2a_all_destinations.patch)
#     bash benchmarks/a2a_variants.sh "base=" "alldest@$d="
#   RANKS (default: every GPU), ITERS (default 20), ROUNDS (default 2); logs under $OUT (./out).
#   QUICK_MIB="64,256": time only those per-peer sizes, ep against the push limit
#   (benchmarks/a2a_quick.py, a few seconds a size), instead of the whole all_to_all.py table.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$PWD/out}
RANKS=${RANKS:-$(nvidia-smi -L | wc -l)}
ITERS=${ITERS:-20}
ROUNDS=${ROUNDS:-2}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT"
[ $# -gt 0 ] || { echo "usage: $0 \"name=DEFINES\" ..." >&2; exit 2; }
pids=()
for v in "$@"; do
  name=${v%%=*}
  src=""
  if [[ $name == *@* ]]; then src=${name#*@}; name=${name%%@*}; fi
  dir=/tmp/ep_a2a_variant_$name
  rm -rf "$dir" && mkdir -p "$dir"
  if [ -n "$src" ]; then
    cp -r "$src"/. "$dir"
  else
    # The source files as they are in the working tree (uncommitted changes and new files
    # included; a copy whose git index is older than its files still lists them), not the
    # ignored build outputs.
    (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$dir")
  fi
  (cd "$dir" && EP_WITH_CUDA=1 EP_BUILD_DIR="$dir/.build" TORCH_CUDA_ARCH_LIST=9.0a \
    EP_CMAKE_ARGS="-DEP_VARIANT_DEFINES=${v#*=}" python setup.py build_ext --inplace) \
    >"$OUT/a2a_variant_$name.build.log" 2>&1 &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
[ "$status" = 0 ] || { tail -20 "$OUT"/a2a_variant_*.build.log; echo "VARIANT BUILD FAILED"; exit 1; }
for ((round = 1; round <= ROUNDS; ++round)); do
  for v in "$@"; do
    name=${v%%=*}
    name=${name%%@*}
    echo "== variant $name (round $round): ${v#*=}"
    # PYTHONPATH: the copy's ep_backend, not an installed one (the script's own folder would
    # come first on sys.path otherwise).
    if [ -n "${QUICK_MIB:-}" ]; then
      (cd "/tmp/ep_a2a_variant_$name" && PYTHONPATH=$PWD timeout 300 python \
        "$ROOT/benchmarks/a2a_quick.py" --ranks "$RANKS" --mib "$QUICK_MIB") 2>&1 |
        tee "$OUT/a2a_variant_$name.$round.log" | grep -E "^R=|Error" || status=1
    else
      (cd "/tmp/ep_a2a_variant_$name" && PYTHONPATH=$PWD timeout 300 python benchmarks/all_to_all.py \
        --ranks "$RANKS" --iters "$ITERS") 2>&1 | tee "$OUT/a2a_variant_$name.$round.log" |
        grep -E "KiB|transport|targets" || status=1
    fi
  done
done
exit "$status"
