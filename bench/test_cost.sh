#!/usr/bin/env bash
# What test files cost: wall time and the CPU time of every process they start (pytest, spawned or forked
# ranks, torchrun and its workers), read from a cgroup v1 cpuacct group of their own.  CPU time is the
# number to compare on a shared machine (wall time there depends on the others' load); on a quiet 2-core
# machine a spawn-heavy file's wall time is about its CPU time / 2.
#
#   bench/test_cost.sh ROOT FILE...      # e.g. before/after a change, back to back:
#   git archive <rev> | tar -x -C /tmp/before && bench/test_cost.sh /tmp/before tests/test_pipeline_training.py
#   bench/test_cost.sh . tests/test_pipeline_training.py
#
# Prints one line per file: file, exit code, wall s, CPU s, load average at the start, pytest's summary.
# Needs root (a directory under /sys/fs/cgroup/cpuacct).
set -u
root=$1
shift
group=/sys/fs/cgroup/cpuacct/megalm_test_cost_$$
for file in "$@"; do
  mkdir -p "$group"
  log=$(mktemp)
  load=$(cut -d' ' -f1 /proc/loadavg)
  start=$(date +%s.%N)
  (
    echo "$BASHPID" >"$group/cgroup.procs"
    cd "$root" && exec python3 -m pytest -q -p no:randomly "$file" >"$log" 2>&1
  )
  rc=$?
  end=$(date +%s.%N)
  cpu_ns=$(cat "$group/cpuacct.usage")
  for _ in $(seq 30); do # processes that outlive pytest (none should) keep the group
    [ -z "$(cat "$group/cgroup.procs")" ] && break
    sleep 1
  done
  rmdir "$group" 2>/dev/null || echo "warning: processes left in $group" >&2
  printf "%s rc=%s wall=%.1f cpu=%.1f load=%s | %s\n" "$file" "$rc" "$(echo "$end - $start" | bc)" \
    "$(echo "$cpu_ns / 1000000000" | bc -l)" "$load" "$(tail -1 "$log")"
  rm -f "$log"
done
