#!/usr/bin/env bash
# The benchmark of issue #7 on the device host (H200 image: Python 3.12, torch 2.11+cu130).
#
# Staging: the same as tests/gpu/run_e2e.sh (../shared/gpu-lab recipe). Make .whl/{a,b,c}
# here with  ../shared/gpu-lab/stage-wheels.sh .whl  then, on the device, one call per
# folder, back to back on the same warm host (each call carries one folder):
#   bash bench/run_bench.sh install a      (carry .whl/a)
#   bash bench/run_bench.sh install b      (carry .whl/b)
#   bash bench/run_bench.sh run --quick    (carry .whl/c and .whl/d: installs, applies, runs)
# .whl/d (py-spy for the profiles): bash tests/gpu/stage-extras.sh
# A host that already ran tests/gpu/run_e2e.sh has a, b and c installed (same /tmp/site-*).
# `run` applies the series into the staged site-packages and runs bench/bench.py with the
# remaining arguments (see bench/README.md). Results: $OUT/<date>-<gpu>-<profile>.json and
# .md, and the server logs; make the PNG here with bench/plot.py.
# The peer's modes (vllm_nodump, vllm_dump) start vLLM 0.33 with
#   KIMI_BENCH_VLLM_PYTHONPATH  the whole PYTHONPATH of vLLM's servers (its staged site);
#                               unset: this environment's (then vLLM must import from it)
#   KIMI_BENCH_VLLM_PYTHON      their interpreter (default: python3, as bench.py's)
# while our servers keep the SGLang stack staged below.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=tests/gpu/stage.sh
source tests/gpu/stage.sh
case "${1:-run}" in
  install) install_folder "$2" ;;
  run)
    prepare_run
    df -h /dev/shm | tail -1
    python3 -c 'import psutil' 2>/dev/null || echo "no psutil: host memory from the writer log only"
    # the vLLM that servers V and W would run (only the peer's modes start them)
    PYTHONPATH="${KIMI_BENCH_VLLM_PYTHONPATH:-$PYTHONPATH}" "${KIMI_BENCH_VLLM_PYTHON:-python3}" -c \
      'from importlib.metadata import version; print("vLLM for the peer modes:", version("vllm"))' 2>/dev/null \
      || echo "vLLM for the peer modes: not importable (set KIMI_BENCH_VLLM_PYTHONPATH)"
    # KIMI_BENCH_TIMEOUT=S: stop bench.py after S seconds (SIGTERM: it stops the servers
    # and keeps the results so far); bench.py's own deadline normally ends it first.
    guard=()
    if [ -n "${KIMI_BENCH_TIMEOUT:-}" ]; then guard=(timeout --kill-after=30 "$KIMI_BENCH_TIMEOUT"); fi
    "${guard[@]}" python3 bench/bench.py --out "${OUT:-/tmp/kimi-bench-out}" "${@:2}"
    ;;
  *) echo "usage: $0 install a|b|c | run [bench.py args, e.g. --quick]" >&2; exit 2 ;;
esac
