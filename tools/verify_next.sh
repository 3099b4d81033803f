#!/usr/bin/env bash
# One pass on a machine with several GPUs (every visible GPU, or GPUS=N): builds once with
# CUDA, then runs, each step with its own timeout, the GPU tests that need 2+ GPUs by area
# (rank masking, the low-latency kernels with BF16 partials,
# the all-to-all's call sequences and shared-GPU ranks, reliability, NVSHMEM session, internode,
# bench, Megatron), then the bench once (no sweep); gpu_moe and gpu_rest cover the rest of the
# GPU suite. Sized for a 10-minute command limit: every timeout is cut to what is left of BUDGET_S
# (540 s from the start); a step that runs out of time is reported as TIMED OUT, one never
# reached as NOT RUN. The full README test command is run separately.
# Usage: OUT=/some/dir bash tools/verify_next.sh     (default ./out)
# $OUT gets two files, since the device tool returns only a few: summary.txt and logs.tgz (every
# step's log with its slowest tests, the build log, the bench's output). Step limits are sized
# for 2 GPUs and scaled with the GPU count (the CPU references of the GPU tests grow with it).
# A second call on the same warm machine can finish what the budget cut, without rebuilding:
#   SKIP_BUILD=1 STEPS="internode bench" bash tools/verify_next.sh
# GPUS=2 keeps a run on the first two GPUs of a larger machine.
# (steps: rank_mask ll_call_tags adversarial malformed_gpu moe_low_latency all_to_all bench_gpu
# megatron_alltoall nvshmem_session peer_killed internode bench; gpu_moe and gpu_rest only when
# named).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PIP_NO_INDEX=1
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo}
export PYTHONUNBUFFERED=1 EP_WITH_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=${MAX_JOBS:-16}
export EP_BUILD_DIR=${EP_BUILD_DIR:-$PWD/.build-gpu}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
LOGS=$(mktemp -d)
trap 'tar czf "$OUT/logs.tgz" --exclude=.push_limit -C "$LOGS" . 2>/dev/null' EXIT
cd "$(dirname "$0")/.."
start=$(date +%s)
# Every step's timeout is cut to what is left of this budget, so that the whole script ends
# before the machine's 10-minute command limit.
BUDGET_S=${BUDGET_S:-540}
deadline=$((start + BUDGET_S))
summary="$OUT/summary.txt"
: >"$summary"

note() { echo "$*" | tee -a "$summary"; }

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$summary"
# (The device copies the working tree; its .git may name another commit than the files'.)
echo "git HEAD here: $(git rev-parse --short HEAD 2>/dev/null || echo '?')" | tee -a "$summary"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
# GPUS=N runs every step on the first N GPUs only (e.g. 2 on a 4-GPU machine).
if [ -n "${GPUS:-}" ] && [ "$GPUS" -lt "$gpus" ]; then
  export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((GPUS - 1)))
  gpus=$GPUS
fi
note "GPUs used: $gpus"
scale_pct=$((gpus > 2 ? 50 * gpus : 100))

if [ "${SKIP_BUILD:-0}" = "1" ]; then
  note "build: skipped (SKIP_BUILD=1)"
elif ! timeout 330 python -m pip install -v --no-build-isolation --no-deps -e . >"$LOGS/build.log" 2>&1; then
  tail -60 "$LOGS/build.log"
  note "BUILD FAILED (build.log in logs.tgz)"
  exit 1
fi
note "build: $(($(date +%s) - start)) s"
# Megatron-Core for the megatron_alltoall step: the device has no package index, so wheels
# carried in WHEELS_DIR (default .devrun/wheels, git-ignored) are installed when present.
wheels_dir=${WHEELS_DIR:-.devrun/wheels}
if ls "$wheels_dir"/megatron_core-*.whl >/dev/null 2>&1 && ! python -c 'import megatron.core' 2>/dev/null; then
  python -m pip install -q --no-index --no-deps "$wheels_dir"/*.whl >"$LOGS/wheels.log" 2>&1
  note "megatron wheels from $wheels_dir: rc=$?"
fi
python -c 'import ep_backend, pathlib; print("nvshmem lib:", (pathlib.Path(ep_backend.__file__).parent / "libep_nvshmem.so").exists())' | tee -a "$summary"

# step NAME SECONDS [ENV=VALUE ...] -- PYTEST ARGS: one pytest run with a timeout; its log in
# logs.tgz as NAME.log, with pytest's 15 slowest durations (the 3 slowest also in the summary);
# the limit scales with the GPU count. Prints the pytest summary line, FAILED/ERROR lines and a
# timeout if any.
step() {
  local name=$1 limit=$2
  shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return; fi
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  limit=$((limit * scale_pct / 100))
  local t0=$(date +%s)
  local left=$((deadline - t0))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 15 ]; then
    note "== $name: NOT RUN (the script's ${BUDGET_S} s budget is spent)"
    return
  fi
  # SIGINT first: pytest then names the test it was in and prints its durations.
  env "${envs[@]}" timeout -s INT -k 15 "$limit" python -m pytest -v -p no:cacheprovider -rfEs --durations=15 "$@" \
    >"$LOGS/$name.log" 2>&1
  local rc=$?
  local line
  line=$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)|no tests ran' "$LOGS/$name.log" | tail -1)
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    line="TIMED OUT after $limit s in $(grep -oE '^tests/[^ ]+::[^ ]+' "$LOGS/$name.log" | tail -1) ($line)"
  fi
  note "== $name: rc=$rc, $(($(date +%s) - t0)) s: ${line:-no summary line (see $name.log in logs.tgz)}"
  grep -E '^(FAILED|ERROR) ' "$LOGS/$name.log" | head -20 | tee -a "$summary"
  grep -A3 -E '^=+ slowest' "$LOGS/$name.log" | grep -E '^[0-9.]+s ' | sed 's/^/   /' | tee -a "$summary"
}

# rel44 (issue #44): rank masking, LL call tags, handle group checks.
step rank_mask 180 -- tests/test_rank_mask.py
step ll_call_tags 60 -- tests/test_ll_call_tags_gpu.py
step adversarial 60 -- tests/test_adversarial.py
# The malformed-call suite's CUDA subset (issue #44 item 6): over 120 cases, each followed by a valid
# round trip checked against the reference.
# -s: each case prints one line per rank (its round trip's outcome), and a case stuck for 20 s
# every rank's Python stacks, into the step's log.
step malformed_gpu 120 -- -s tests/test_malformed_calls_gpu.py
# The low-latency kernels against the reference, BF16 partials bitwise against its model.
step moe_low_latency 90 -- tests/test_moe_gpu.py -k low_latency
# The all-to-all against NCCL (its sequence of calls through every ring mode) and with ranks
# sharing GPUs (3 and 4 ranks on fewer GPUs).
step all_to_all 150 -- tests/test_all_to_all_gpu.py tests/test_all_to_all_shared_gpu.py
# bench43 (issue #43): push-limit and loop-of-steps rows.
step bench_gpu 60 -- tests/test_bench_gpu.py
# meg42: Megatron's alltoall dispatcher on an "ep" group (skipped where Megatron is missing).
step megatron_alltoall 60 -- tests/test_megatron_gpu.py -k alltoall
# session40 (issues #40, #44): one NVSHMEM session per process; low-latency buffers grown twice
# (M, 2M, 2H) by free + malloc in it; abort + re-created groups reuse it, a group over other
# ranks is refused (ATen path, with the reason).
step nvshmem_session 90 -- tests/test_nvshmem_session_gpu.py tests/test_nvshmem_session_cpu.py
# kill44 (issue #44, item 3): a rank killed with SIGKILL mid-dispatch (NVLink and NVSHMEM): the
# survivors raise naming it, no kernel spins, abort, a new group of the survivors is exact, and
# they exit 0. Plus the CPU versions (2 and 3 Gloo ranks). About 1-2 min.
step peer_killed 180 -- -rP tests/test_peer_killed_gpu.py tests/test_peer_killed_cpu.py tests/test_recovery.py
# inter40b (issue #40): the internode transport on emulated nodes, with its stage trace (last:
# a hang here costs the most; its soak is cut to 50 calls, EP_INTERNODE_SOAK_CALLS overrides).
step internode 200 EP_INTERNODE_TRACE=1 \
  EP_INTERNODE_SOAK_CALLS="${EP_INTERNODE_SOAK_CALLS:-50}" -- tests/test_internode_emulation_gpu.py

# The rest of the GPU suite, in two parts that each fit one 10-minute command at 4 GPUs; run only
# when STEPS names them (STEPS="gpu_moe" then STEPS="gpu_rest"): with the steps above they cover
# every GPU test (`-m gpu`).
stepped=(test_rank_mask.py test_ll_call_tags_gpu.py test_adversarial.py test_malformed_calls_gpu.py
  test_all_to_all_gpu.py test_all_to_all_shared_gpu.py test_bench_gpu.py test_nvshmem_session_gpu.py test_peer_killed_gpu.py test_recovery.py
  test_internode_emulation_gpu.py test_moe_gpu.py)
if [[ " ${STEPS:-} " == *" gpu_moe "* ]]; then
  step gpu_moe 400 -- -m gpu tests/test_moe_gpu.py
fi
if [[ " ${STEPS:-} " == *" gpu_rest "* ]]; then
  step gpu_rest 450 -- -n 2 -m gpu tests "${stepped[@]/#/--ignore=tests/}"
fi

if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" bench "* ]]; then
  echo "==== summary ($(($(date +%s) - start)) s in all) ===="
  cat "$summary"
  ! grep -q -E 'FAILED|ERROR |TIMED OUT|NOT RUN|rc=[1-9]' "$summary"
  exit
fi
t0=$(date +%s)
bench_limit=$((deadline - t0))
[ "$bench_limit" -gt 90 ] && bench_limit=90
[ "$bench_limit" -lt 15 ] && bench_limit=15
timeout -k 10 "$bench_limit" python -m ep_backend.bench --no-sweep --no-all-to-all --out "$LOGS/bench" >"$LOGS/bench.log" 2>&1
rc=$?
note "== bench: rc=$rc, $(($(date +%s) - t0)) s (bench.log in logs.tgz)"
tail -40 "$LOGS/bench.log"
echo
echo "==== summary ($(($(date +%s) - start)) s in all) ===="
cat "$summary"
grep -q -E 'FAILED|ERROR |TIMED OUT|NOT RUN|rc=[1-9]' "$summary" && exit 1
exit 0
