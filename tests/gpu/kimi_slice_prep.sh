#!/usr/bin/env bash
# Issue 48, on the device host once the SGLang stack is staged (stage-stack.sh put p01-p17,
# p24): start tests/gpu/prebuild_marlin.py in the background (its own session, so it
# outlives this call; log /tmp/marlin-prebuild.log, "marlin moe prebuilt" when done), then
# build the 4-layer slice where test_gpu_kimi_slice.py looks for it (KIMI_SLICE_DIR,
# /tmp/kimi-slice, with its .complete marker) and, with `bench`, kimi-slice-2 for
# `python -m bench --workdir /tmp/kimi-bench` (on disk: three servers starting from a
# model in /dev/shm beside the kept files ran the 128 GiB host out of memory).
#   bash tests/gpu/kimi_slice_prep.sh [bench]
#   bash tests/gpu/kimi_slice_prep.sh wait      (until the prebuild's log says done or failed)
set -euo pipefail
cd "$(dirname "$0")/../.."
eval "$(bash tests/gpu/stage-stack.sh env sglang)"
export PYTHONPATH="$PYTHONPATH:$PWD" PYTHONUNBUFFERED=1
log=/tmp/marlin-prebuild.log
running() { pgrep -f prebuild_marlin.py >/dev/null; }
if [ "${1:-}" = wait ]; then
  [ -f "$log" ] || { echo "no prebuild started (run this script without 'wait' first)" >&2; exit 1; }
  until grep -q "prebuilt in\|Traceback" "$log" || ! running; do sleep 5; done
  cat "$log"; exit 0
fi
if ! running && ! grep -q "prebuilt in" "$log" 2>/dev/null; then  # never started, or failed: (re)start
  setsid nohup python3 tests/gpu/prebuild_marlin.py >"$log" 2>&1 < /dev/null &
fi
python3 -m testing.kimi_slice "${KIMI_SLICE_DIR:-/tmp/kimi-slice}" "${KIMI_SLICE_LAYERS:-4}"  # once per machine
if [ "${1:-}" = bench ]; then python3 -m bench.models kimi-slice-2 /tmp/kimi-bench/kimi-slice-2; fi
df -h /tmp /dev/shm | tail -2
tail -3 "$log"
