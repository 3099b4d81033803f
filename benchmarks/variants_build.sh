# Sourced by ll_variants.sh / ht_variants.sh: builds one harness per kernel variant in parallel,
# through CMake (tests/native/native_tests.cmake; EP_NATIVE_TEST_FLAGS carries the variant's
# nvcc flags).
# build_variants TARGET PREFIX VARIANT...: for each "name=flags" (or "name@DIR=flags": the sources
# under DIR, a tree with the same CMake layout, e.g. an exported other commit), configures
# build/PREFIX_name and builds TARGET there, logging to build/PREFIX_name.log. Exits on any
# failure. PYTHON (default: python) is the interpreter CMake imports torch from.
# variant_name VARIANT: the name alone.
variant_name() {
  local name=${1%%=*}
  echo "${name%%@*}"
}

build_variants() {
  local target=$1 prefix=$2
  shift 2
  local root=$PWD pids=() v name src rc=0 p python
  python=$(command -v "${PYTHON:-python}")
  mkdir -p build
  for v in "$@"; do
    name=${v%%=*}
    src=.
    if [[ $name == *@* ]]; then src=${name#*@}; name=${name%%@*}; fi
    (cmake -S "$src" -B "$root/build/${prefix}_$name" -DEP_WITH_CUDA=ON -DEP_BUILD_NATIVE_TESTS=ON \
      -DEP_CUDA_ARCHITECTURES=90a -DPython3_EXECUTABLE="$python" \
      -DEP_NATIVE_TEST_FLAGS="${v#*=}" &&
      cmake --build "$root/build/${prefix}_$name" -j "${MAX_JOBS:-8}" --target "$target") \
      >"build/${prefix}_$name.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  [[ $rc == 0 ]] || { tail -20 build/"${prefix}"_*.log; echo "VARIANT BUILD FAILED"; exit 1; }
}
