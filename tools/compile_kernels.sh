#!/usr/bin/env bash
# Compiles every CUDA source of native/ for EP_CUDA_ARCH (default sm_90a), compile only (works without a GPU).
# NVSHMEM headers come from the nvidia-nvshmem-cu13 wheel (installed here if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v "$NVCC")")")}
# NVSHMEM_HOME (a dir with include/ and lib/) overrides the wheel lookup.
nvshmem_inc=${NVSHMEM_HOME:+$NVSHMEM_HOME/include}
[ -n "$nvshmem_inc" ] || nvshmem_inc=$(python - <<'PY' 2>/dev/null || true
import importlib.util, os
spec = importlib.util.find_spec("nvidia.nvshmem")
if spec and spec.submodule_search_locations:
    print(os.path.join(list(spec.submodule_search_locations)[0], "include"))
PY
)
if [ -z "$nvshmem_inc" ] && compgen -G "native/**/*nvshmem*" >/dev/null; then
  if python -m pip install -q nvidia-nvshmem-cu13; then
    nvshmem_inc=$(python -c 'import nvidia.nvshmem, os; print(os.path.join(list(nvidia.nvshmem.__path__)[0], "include"))')
  else
    echo "WARNING: the nvidia-nvshmem-cu13 wheel could not be installed: NVSHMEM sources NOT compiled" >&2
  fi
fi
# EP_CUDA_ARCH: the architectures, ";"-separated (as setup.py takes it), e.g. "90a;100a".
archs=()
IFS=";" read -r -a _archs <<<"${EP_CUDA_ARCH:-90a}"
for a in "${_archs[@]}"; do archs+=("-gencode=arch=compute_${a},code=sm_${a}"); done
flags=(-std=c++17 -O3 "${archs[@]}" -I native -I "$CUDA_HOME/include/cccl")
[ -n "$nvshmem_inc" ] && flags+=(-I "$nvshmem_inc")
n=0
skipped=0
# .cu files, plus the torch-free host runtimes beside them (compiled as CUDA; -rdc where they
# include NVSHMEM headers).
for f in native/transports/*/cuda/*.cu native/transports/*/cuda/*.cpp; do
  [ -e "$f" ] || continue
  rdc=()
  lang=()
  if grep -qi nvshmem "$f"; then
    rdc=(-rdc=true)
    if [ -z "$nvshmem_inc" ]; then
      skipped=$((skipped + 1))
      continue
    fi
  fi
  [[ $f == *.cpp ]] && lang=(-x cu)
  "$NVCC" "${flags[@]}" "${rdc[@]}" "${lang[@]}" -c "$f" -o /dev/null
  n=$((n + 1))
done
echo "compiled $n CUDA sources for sm_${EP_CUDA_ARCH:-90a}${skipped:+}$([ "$skipped" -gt 0 ] && echo "; SKIPPED $skipped NVSHMEM sources (no NVSHMEM headers)")"
