#!/usr/bin/env bash
# Runs one pytest selection with Python's fault handler on; if it is still running after
# WATCHDOG_S seconds, sends SIGABRT to every python process below it, so each prints every
# thread's Python stack (PYTHONFAULTHANDLER) before it dies: where a hung test waits.
# Usage: WATCHDOG_S=200 bash tools/soak_watchdog.sh tests/test_x.py -k name
set -uo pipefail
export PYTHONFAULTHANDLER=1
python -m pytest -s -v -p no:cacheprovider -m gpu "$@" &
top=$!
descendants() { local p; for p in $(pgrep -P "$1"); do echo "$p"; descendants "$p"; done; }
for ((t = 0; t < ${WATCHDOG_S:-200}; ++t)); do
  kill -0 "$top" 2>/dev/null || break
  sleep 1
done
if kill -0 "$top" 2>/dev/null; then
  echo "== watchdog: still running after ${WATCHDOG_S:-200} s; SIGABRT to every descendant"
  ps -o pid,ppid,etime,args --ppid "$top" --forest || true
  for p in $(descendants "$top"); do  # each thread's state, and native stacks where gdb exists
    echo "== pid $p: $(tr '\0' ' ' </proc/"$p"/cmdline | cut -c1-100)"
    ps -L -o tid,pcpu,stat,wchan:32,comm -p "$p" || true
    if command -v gdb >/dev/null; then
      timeout 60 gdb -p "$p" -batch -ex "thread apply all bt 25" 2>/dev/null | grep -E "^#|^Thread" || true
    fi
  done
  for p in $(descendants "$top"); do kill -ABRT "$p" 2>/dev/null; done
  sleep 5
  kill -ABRT "$top" 2>/dev/null
fi
wait "$top"
