#!/usr/bin/env bash
# Megatron-Core on ep, on the GPU machine (no network): installs the carried wheels, then runs
# tests/test_megatron_gpu.py (MoELayer flex-on-ep vs alltoall-on-NCCL; MoE GPT and FSDP2 training
# on an "ep" world vs a NCCL world) at 2 ranks and, with 4+ GPUs, at one rank per GPU; then
# benchmarks/megatron_moe_step.py. Under 4 minutes on 4 GPUs.
# Usage, from the repository root: bash tools/megatron_gpu_check.sh
#   WHEELS: the folder of carried wheels (default .devrun/wheels: megatron-core 0.19.2 cp312,
#   einops, packaging; fetched with `pip download --no-deps --python-version 3.12
#   --only-binary=:all: --platform manylinux_2_28_x86_64 megatron-core==0.19.2 einops packaging`).
#   Logs go to $OUT (default ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WHEELS=${WHEELS:-.devrun/wheels}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
start=$(date +%s)
elapsed() { echo "$(( $(date +%s) - start )) s"; }
status=0

# 1. megatron-core and the pure-Python modules it imports, unless already importable
if ! python -c 'import megatron.core, einops, packaging' 2>/dev/null; then
  shopt -s nullglob
  wheels=("$WHEELS"/*.whl)
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "megatron_gpu_check: megatron-core is not installed and $WHEELS holds no wheels" >&2
    exit 1
  fi
  python -m pip install -q --no-index --no-deps "${wheels[@]}" || exit 1
fi
python -c 'import triton' 2>/dev/null || echo "megatron_gpu_check: note: triton is missing (Megatron imports it where present)"
python - <<'PY' || exit 1
import warnings
warnings.simplefilter("ignore")
import megatron.core, torch
print("megatron-core", megatron.core.__version__, "| torch", torch.__version__, "| GPUs", torch.cuda.device_count())
PY

# 2. ep_backend with CUDA (as tools/gpu_check.sh builds it), unless already built
if ! python -c 'import sys, ep_backend._C as c; sys.exit(not c.built_with_cuda)' 2>/dev/null; then
  export EP_WITH_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
  export EP_BUILD_DIR=${EP_BUILD_DIR:-$PWD/.build-gpu} MAX_JOBS=${MAX_JOBS:-16}
  if ! python -m pip install -v --no-build-isolation --no-deps --no-index -e . >"$OUT/megatron_build.log" 2>&1; then
    tail -40 "$OUT/megatron_build.log"; echo "BUILD FAILED"; exit 1
  fi
  echo "build done after $(elapsed)"
fi

# 3. the GPU tests: 2 ranks, then one per GPU where there are 4 or more
gpus=$(python -c 'import torch; print(torch.cuda.device_count())')
worlds=(2)
[ "$gpus" -ge 4 ] && worlds+=("$gpus")
for world in "${worlds[@]}"; do
  EP_TEST_WORLD_SIZE=$world timeout 100 python -m pytest -q -p no:cacheprovider -rs \
    tests/test_megatron_gpu.py >"$OUT/megatron_gpu_$world.log" 2>&1
  rc=$?
  tail -6 "$OUT/megatron_gpu_$world.log"
  echo "megatron GPU tests, $world ranks: rc=$rc after $(elapsed)"
  [ "$rc" -eq 0 ] || status=1
  grep -q " skipped" "$OUT/megatron_gpu_$world.log" && { echo "a GPU test was skipped: not a pass"; status=1; }
done

# 4. the bench row
timeout 60 python benchmarks/megatron_moe_step.py --steps 20 2>&1 | grep -v -i warn | tee "$OUT/megatron_moe_step.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "megatron_gpu_check finished after $(elapsed), status $status"
exit $status
