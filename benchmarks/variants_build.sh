# Sourced by ll_variants.sh / ht_variants.sh: builds one harness per variant in parallel.
# build_variants BUILD_SCRIPT FLAGS_VAR PREFIX VARIANT...: for each "name=flags" (or
# "name@DIR=flags": the sources under DIR), runs BUILD_SCRIPT with BUILD=build/PREFIX_name,
# FLAGS_VAR=flags and BUILD_ONLY=1, logging to build/PREFIX_name.log. Exits on any failure.
# variant_name VARIANT: the name alone.
variant_name() {
  local name=${1%%=*}
  echo "${name%%@*}"
}

build_variants() {
  local script=$1 flags_var=$2 prefix=$3
  shift 3
  local root=$PWD pids=() v name src rc=0 p
  mkdir -p build
  for v in "$@"; do
    name=${v%%=*}
    src=.
    if [[ $name == *@* ]]; then src=${name#*@}; name=${name%%@*}; fi
    (cd "$src" && env BUILD="$root/build/${prefix}_$name" "$flags_var=${v#*=}" BUILD_ONLY=1 \
      bash "$script") >"build/${prefix}_$name.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  [[ $rc == 0 ]] || { tail -20 build/"${prefix}"_*.log; echo "VARIANT BUILD FAILED"; exit 1; }
}
