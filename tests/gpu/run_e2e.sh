#!/usr/bin/env bash
# The GPU suite (pytest tests/gpu) on the offline device host (H200 image: Python 3.12,
# torch 2.11+cu130), staged as ../shared/gpu-lab describes. On a GPU box with network,
# skip this script: see tests/gpu/README.md.
#
# Here: ../shared/gpu-lab/stage-wheels.sh .whl and bash tests/gpu/stage-extras.sh (.whl/d:
# pytest, speculators, py-spy). There, one call per folder, back to back on one warm host:
#   bash tests/gpu/run_e2e.sh install a      (carry .whl/a)
#   bash tests/gpu/run_e2e.sh install b      (carry .whl/b)
#   bash tests/gpu/run_e2e.sh run [pytest args]   (carry .whl/c and .whl/d)
# `run` installs c and d, applies the series into the staged site-packages, then runs
#   python -m pytest tests/gpu -m "gpu and not multi_gpu" --junitxml $OUT/e2e-junit.xml
#       --results-json $OUT/e2e-results.json --server-log-dir $OUT [pytest args]
# Later arguments win: `run -m multi_gpu` runs the TP group (2 GPUs), `run --models llama`
# one model, `run -k faults` one group. A server starts per model and module (64-150 s
# each on the H200), so within the 10-minute call limit run one model per call:
# `run --models llama`, then `run --models deepseek`, then `run --models kimi`. The fleet
# group (three servers behind SGLang's router) needs .whl/r installed first, in a call of
# its own carrying .whl/r (30 MiB): `bash -c 'source tests/gpu/stage.sh; install_router'`;
# then `run --models llama -k fleet` (carry .whl/c, .whl/d) on the same warm host. Commit $OUT/e2e-results.json as
# tests/gpu/results-<date>-<gpu>-<group or model>.json, replacing the older file of that kind.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=tests/gpu/stage.sh
source tests/gpu/stage.sh
case "${1:-run}" in
  install) install_folder "$2" ;;
  run)
    prepare_run
    out=${OUT:-/tmp/e2e-out}
    mkdir -p "$out"
    python3 -m pytest tests/gpu -p no:cacheprovider -v -m "gpu and not multi_gpu" \
      --junitxml "$out/e2e-junit.xml" -o junit_family=xunit1 --results-json "$out/e2e-results.json" --server-log-dir "$out" \
      "${@:2}"
    ;;
  *) echo "usage: $0 install a|b|c | run [pytest args, e.g. --models llama, -m multi_gpu, -k core]" >&2; exit 2 ;;
esac
