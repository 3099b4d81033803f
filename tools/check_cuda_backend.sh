#!/usr/bin/env bash
# Usage: bash tools/check_cuda_backend.sh [FILE...]
# Syntax-checks the torch-bound C++ (native/backend, native/transports/*/*.cpp, python_api) as the CUDA build compiles it
# (EP_WITH_CUDA=1), against the installed torch's headers and the CUDA toolkit's: works with a
# CPU-only torch and no GPU, so an error in the CUDA paths of the backend cannot land unseen in
# CI (tools/compile_kernels.sh does the same for the kernels). A CPU torch wheel lacks one
# generated header of c10/cuda; a stand-in with the CUDA build's content is supplied for it.
set -euo pipefail
cd "$(dirname "$0")/.."
CXX=${CXX:-g++}
NVCC=${NVCC:-nvcc}
# The toolkit's headers: where nvcc itself looks (it may be a wrapper script elsewhere).
cuda_inc=${CUDA_HOME:+$CUDA_HOME/include}
if [ -z "$cuda_inc" ] || [ ! -e "$cuda_inc/cuda_runtime.h" ]; then
  cuda_inc=$("$NVCC" --dryrun -c -x cu /dev/null -o /dev/null 2>&1 |
    sed -n 's/^#\$ INCLUDES="-I\([^"]*\)".*/\1/p' | head -1 | tr -d ' ')
fi
[ -e "$cuda_inc/cuda_runtime.h" ] || { echo "no cuda_runtime.h (set CUDA_HOME)" >&2; exit 1; }
torch_inc=$(python -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))')
py_inc=$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
abi=$(python -c 'import torch; print(int(torch.compiled_with_cxx11_abi()))')
stub=$(mktemp -d)
trap 'rm -rf "$stub"' EXIT
if [ ! -e "$torch_inc/c10/cuda/impl/cuda_cmake_macros.h" ]; then
  mkdir -p "$stub/c10/cuda/impl"
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$stub/c10/cuda/impl/cuda_cmake_macros.h"
fi
# As CMakeLists.txt compiles them (C++20); third-party headers as system headers (no warnings).
flags=(-std=c++20 -fsyntax-only -DEP_WITH_CUDA=1 "-D_GLIBCXX_USE_CXX11_ABI=$abi" -isystem "$stub"
  -isystem "$torch_inc" -isystem "$torch_inc/torch/csrc/api/include" -isystem "$cuda_inc"
  -isystem "$py_inc" -I native)
# Files named on the command line, else every backend source; at most JOBS (default: the CPU
# count) compilers at once, so that a small machine does not thrash.
if [ $# -gt 0 ]; then files=("$@"); else files=(native/backend/*.cpp native/transports/*/*.cpp python_api/*.cpp); fi
export CXX
if ! printf '%s\0' "${files[@]}" |
  xargs -0 -n 1 -P "${JOBS:-$(nproc)}" "$CXX" "${flags[@]}"; then
  echo "CUDA backend syntax check FAILED" >&2
  exit 1
fi
echo "syntax-checked ${#files[@]} backend sources with EP_WITH_CUDA=1"
