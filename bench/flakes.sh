#!/usr/bin/env bash
# Run each pytest selection N times in a row (one pytest process per run) while busy loops keep every core loaded,
# and print one line per selection: passed, failed, seconds. A selection is one argument, a node id or a path with
# pytest options, shell-quoted: "tests/x.py -k 'stop or hang'". A failed run's output is kept in $LOGS.
#
#   OMP_NUM_THREADS=1 bench/flakes.sh 30 tests/runtime/test_local_watchdog.py
#
# LOAD_PROCS (default: the number of cores) sets how many busy loops run; LOGS (default: a fresh temporary
# directory) where failed runs' output goes; PYTHON (default: .venv/bin/python of this checkout) which interpreter.
set -u
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "${TEST_ROOT:-$root}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
py="${PYTHON:-$root/.venv/bin/python}"
n_runs="$1"; shift
n="${LOAD_PROCS:-$(getconf _NPROCESSORS_ONLN)}"  # not nproc: it reads OMP_NUM_THREADS
logs="${LOGS:-$(mktemp -d)}"; mkdir -p "$logs"
pids=()
for _ in $(seq "$n"); do
  python3 -c 'while True: pass' &
  pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
echo "# $(date -u) | $(getconf _NPROCESSORS_ONLN) cores, $n busy loops | failed runs' output in $logs"
for t in "$@"; do
  ok=0; bad=0; t0=$(date +%s); tag="$(echo "$t" | tr -c 'A-Za-z0-9_.\n-' '_')"
  eval "args=($t)"
  for i in $(seq "$n_runs"); do
    if "$py" -m pytest -q -p no:cacheprovider "${args[@]}" > "$logs/run.log" 2>&1; then ok=$((ok + 1))
    else bad=$((bad + 1)); cp "$logs/run.log" "$logs/fail_${tag}_$i.log"; fi
  done
  echo "$t: $ok passed, $bad failed of $n_runs ($(( $(date +%s) - t0 )) s; load $(cut -d' ' -f1 /proc/loadavg))"
done
