#!/usr/bin/env bash
# The bench's host rows ("call", "host", and the host-first dispatch), this checkout against BASE
# (default: main), back to back on the same GPUs: base, head, base, head (a shared host drifts, so
# each side runs twice, interleaved). With PROFILE=1, then one EP_PROFILE_HOST=1 run per side: the
# medians of each native stage (validate, agree, runtime, layout+notify, count_wait, ...), to say
# where a difference lies. Issue #43 item 3 / #39's 3% budget.
#
# Usage: bash benchmarks/host_rows_ab.sh [BASE]
#   RANKS (default 2) GPUs, ITERS (default 20) samples per row; logs under $OUT (default ./out).
#   SKIP_BUILD=1 reuses the builds of an earlier call (BASE's worktree stays in $BASE_DIR).
set -uo pipefail
BASE=${1:-main}
RANKS=${RANKS:-2}
ITERS=${ITERS:-20}
OUT=${OUT:-$PWD/out}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BASE_DIR=${BASE_DIR:-/tmp/ep_ab_base}
mkdir -p "$OUT"
devices=$(seq -s, 0 $((RANKS - 1)))

if [ ! -d "$BASE_DIR" ]; then
  git -C "$ROOT" worktree add --detach "$BASE_DIR" "$BASE" >/dev/null || exit 1
elif [ "$(git -C "$BASE_DIR" rev-parse HEAD)" != "$(git -C "$ROOT" rev-parse "$BASE")" ]; then
  # A worktree of an earlier call: moved to BASE (and rebuilt), never benched as it was.
  git -C "$BASE_DIR" checkout -q --detach "$(git -C "$ROOT" rev-parse "$BASE")" || exit 1
  if [ -n "${SKIP_BUILD:-}" ]; then
    echo "$BASE_DIR was at another commit than $BASE: run without SKIP_BUILD to rebuild it"
    exit 1
  fi
fi
build() {  # build <checkout> <build dir> <log>
  (cd "$1" && EP_WITH_CUDA=1 EP_BUILD_DIR="$2" TORCH_CUDA_ARCH_LIST=9.0a \
    python setup.py build_ext --inplace >"$3" 2>&1) || { echo "build of $1 failed: $3"; exit 1; }
}
if [ -z "${SKIP_BUILD:-}" ]; then
  build "$ROOT" /tmp/ep_ab_build_head "$OUT/build_head.log" &
  head_build=$!
  build "$BASE_DIR" /tmp/ep_ab_build_base "$OUT/build_base.log" &
  base_build=$!
  wait $head_build && wait $base_build || exit 1
fi

bench() {  # bench <side> <checkout> <tag> [env...]: the HT rows only, no sweep
  local side=$1 dir=$2 tag=$3
  shift 3
  # Append mode: the ranks' EP_PROFILE_HOST lines then stay whole (stage_medians.py lines them up).
  : >"$OUT/$side.$tag.log"
  (cd "$dir" && env CUDA_VISIBLE_DEVICES="$devices" "$@" python -m ep_backend.bench --no-sweep --no-all-to-all \
    --no-low-latency --iters "$ITERS" --out "$OUT/$side.$tag") >>"$OUT/$side.$tag.log" 2>&1
}
status=0  # 1 once any bench run failed (the script ends with it)
for round in 1 2; do
  for side in base head; do
    dir=$ROOT
    [ "$side" = base ] && dir=$BASE_DIR
    if ! bench "$side" "$dir" "$round"; then
      echo "bench $side round $round failed: $OUT/$side.$round.log"
      status=1
    fi
    echo "== $side ($(git -C "$dir" rev-parse --short HEAD)), round $round"
    grep -E "^op |^ep (dispatch|cached|combine|layout|loop)|^floor" "$OUT/$side.$round.log" |
      cut -c1-110
  done
done
[ -n "${PROFILE:-}" ] || exit "$status"
for side in base head; do
  dir=$ROOT
  [ "$side" = base ] && dir=$BASE_DIR
  bench "$side" "$dir" profile EP_PROFILE_HOST=1 || status=1
  echo "== $side: native host stages (EP_PROFILE_HOST=1, every timed and untimed call)"
  python "$ROOT/benchmarks/stage_medians.py" "$OUT/$side.profile.log" || status=1
done
exit "$status"
