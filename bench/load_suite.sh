#!/usr/bin/env bash
# Run a pytest selection while every core is kept busy by a background load (one busy-loop process per core, nice
# 0), and append the outcome to bench/results/load_suite.md. Tests that pass on an idle box but fail here depend
# on timing (a proxy dying with a busy parent, a fixed timeout).
#
#   OMP_NUM_THREADS=1 RAY_AUTH_MODE=disabled bench/load_suite.sh tests/runtime/test_e2e.py -k resume
#
# LOAD_PROCS (default: the number of cores) sets how many busy loops run; RESULTS the file appended to.
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
n="${LOAD_PROCS:-$(getconf _NPROCESSORS_ONLN)}"  # not nproc: it reads OMP_NUM_THREADS
results="${RESULTS:-bench/results/load_suite.md}"
pids=()
for _ in $(seq "$n"); do
  python3 -c 'while True: pass' &
  pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
log="$(mktemp)"
t0=$(date +%s)
.venv/bin/python -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
t1=$(date +%s)
kill "${pids[@]}" 2>/dev/null
summary="$(grep -E '^(FAILED|ERROR)|[0-9]+ (passed|failed|error)' "$log" | tail -20)"
{
  [ -s "$results" ] || printf '# Tests under load\n\n`bench/load_suite.sh`: a pytest selection while every core runs a busy loop.\n'
  printf '\n## %s\n\nMachine: %s, %s cores (%s busy loops at nice 0; other users may share the box). Command:\n\n' \
    "$(date '+%Y-%m-%d %H:%M')" "$(hostname)" "$(getconf _NPROCESSORS_ONLN)" "$n"
  printf '    bench/load_suite.sh %s\n\nResult: exit %s after %s s.\n\n```\n%s\n```\n' "$*" "$rc" "$((t1 - t0))" "$summary"
} >> "$results"
exit "$rc"
