#!/usr/bin/env bash
# Probe (not part of the bench): every 0.5 s for $1 seconds, set nice 19 on every thread
# of every dump writer process (found by its command line), logging each change to $2.
# Used to test whether the writer's CPU use costs the scheduler when the writer is
# only deprioritized instead of moved to CPUs of its own (docs/performance.md).
set -u
end=$((SECONDS + ${1:-500})); log=${2:-/dev/stderr}
while [ "$SECONDS" -lt "$end" ]; do
  for p in $(pgrep -f 'sglang_ext[.]writer_process import main'); do
    for t in /proc/"$p"/task/*; do
      renice -n 19 -p "${t##*/}" 2>&1 | grep -v 'old priority 19,' >>"$log"
    done
  done
  sleep 0.5
done
