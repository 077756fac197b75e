#!/usr/bin/env bash
# One GPU end-to-end run on the device host (H200 image: Python 3.12, torch 2.11+cu130).
#
# Staging (../shared/gpu-lab recipe): make .whl/{a,b,c} here with
#   ../shared/gpu-lab/stage-wheels.sh .whl
# then, on the device, one call per folder, back to back (each call carries one folder):
#   bash tests/gpu/run_e2e.sh install a      (carry .whl/a)
#   bash tests/gpu/run_e2e.sh install b      (carry .whl/b)
#   bash tests/gpu/run_e2e.sh run            (carry .whl/c and .whl/d: installs them, applies, runs)
# .whl/d (speculators for the clients group, py-spy for bench/): bash tests/gpu/stage-extras.sh
# `run` applies the series with the project's own tool into the staged site-packages,
# starts the patched server per model and compares every dumped file with HF's forward.
# Results: $OUT/e2e-results.json (commit it as tests/gpu/results-<date>-h200.json).
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=tests/gpu/stage.sh
source tests/gpu/stage.sh
case "${1:-run}" in
  install) install_folder "$2" ;;
  run)
    prepare_run
    python3 tests/gpu/e2e.py --out "${OUT:-/tmp/e2e-out}" "${@:2}"
    ;;
  *) echo "usage: $0 install a|b|c | run [--models llama,deepseek] [--groups core,clients,faults] [--tp N] [--no-cuda-graph]" >&2; exit 2 ;;
esac
