#!/usr/bin/env bash
# Issue 43's bench rows on the GPU machine: builds with CUDA, runs the bench's GPU tests, then the
# bench at EP2 and (with 4+ GPUs) EP4: the push limit, "% limit", the loop rows and the SM sweep.
# Usage: bash benchmarks/issue43_bench.sh        (logs and JSON under $OUT, default ./out)
set -uo pipefail
OUT=${OUT:-$PWD/out}
cd "$(dirname "$0")/.."
export OUT
# build + tests/test_bench_gpu.py (probe rows land where they should; bench rows come out)
SKIP_BENCH=1 bash tools/gpu_check.sh tests/test_bench_gpu.py -k "bench" || exit 1
gpus=$(python -c 'import torch; print(torch.cuda.device_count())') || exit 1
status=0  # the first failing bench's exit status (the script ends with it)
for ranks in 2 4 8; do
  [ "$gpus" -ge "$ranks" ] || continue
  devices=$(seq -s, 0 $((ranks - 1)))
  mkdir -p "$OUT/ep$ranks/ll"
  echo "== EP$ranks: HT with the SM sweep"
  CUDA_VISIBLE_DEVICES=$devices python -m ep_backend.bench --no-sweep --no-all-to-all --no-low-latency --sm-sweep \
    --out "$OUT/ep$ranks" 2>&1 | tee "$OUT/ep$ranks/bench_ht.log" | tail -60
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    echo "EP$ranks HT bench failed (rc=$rc)"
    [ "$status" -ne 0 ] || status=$rc
  fi
  echo "== EP$ranks: LL (E = 8 x ranks, as the issue's EP4 runs: top-8 of 32)"
  CUDA_VISIBLE_DEVICES=$devices python -m ep_backend.bench --no-sweep --no-all-to-all --no-high-throughput \
    --ll-experts $((8 * ranks)) --out "$OUT/ep$ranks/ll" 2>&1 | tee "$OUT/ep$ranks/bench_ll.log" | tail -30
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    echo "EP$ranks LL bench failed (rc=$rc)"
    [ "$status" -ne 0 ] || status=$rc
  fi
done
exit "$status"
