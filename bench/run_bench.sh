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
# `run` applies the series into the staged site-packages and runs `python3 -m bench` with the
# remaining arguments (see bench/README.md). Results: $OUT/<date>-<gpu>-<profile>.json and
# .md, and the server logs; make the PNG here with `python -m bench.plot`.
# The peer's modes (vllm_nodump, vllm_dump) start vLLM 0.33 with
#   KIMI_BENCH_VLLM_PYTHONPATH       the whole PYTHONPATH of vLLM's servers (its staged site)
#   KIMI_BENCH_VLLM_LD_LIBRARY_PATH  their LD_LIBRARY_PATH (the staged NCCL)
#   KIMI_BENCH_VLLM_PYTHON           their interpreter (default: python3, as the bench's)
# while our servers keep the SGLang stack staged below. Unset, the first two come from
# tests/gpu/stage-stack.sh's vLLM stack when it is staged (its `env vllm`, evaluated
# without our PYTHONPATH), else from this environment (vLLM must then import from it).
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
    if [ -z "${KIMI_BENCH_VLLM_PYTHONPATH:-}" ] && [ -d "${KIMI_STACK_ROOT:-/tmp}/stack-vllm" ]; then
      vllm_env=$(bash tests/gpu/stage-stack.sh env vllm)
      KIMI_BENCH_VLLM_PYTHONPATH=$(PYTHONPATH='' bash -c "$vllm_env"'; echo "$PYTHONPATH"')
      export KIMI_BENCH_VLLM_PYTHONPATH
      if [ -z "${KIMI_BENCH_VLLM_LD_LIBRARY_PATH:-}" ]; then
        KIMI_BENCH_VLLM_LD_LIBRARY_PATH=$(bash -c "$vllm_env"'; echo "$LD_LIBRARY_PATH"')
        export KIMI_BENCH_VLLM_LD_LIBRARY_PATH
      fi
      # FlashInfer staged without its JIT sources: vLLM's sampler set to PyTorch's (SGLang ignores it)
      if grep -q VLLM_USE_FLASHINFER_SAMPLER <<<"$vllm_env"; then export VLLM_USE_FLASHINFER_SAMPLER=0; fi
    fi
    echo "vLLM's PYTHONPATH: ${KIMI_BENCH_VLLM_PYTHONPATH:-this one}"
    PYTHONPATH="${KIMI_BENCH_VLLM_PYTHONPATH:-$PYTHONPATH}" \
      LD_LIBRARY_PATH="${KIMI_BENCH_VLLM_LD_LIBRARY_PATH:-${LD_LIBRARY_PATH:-}}" "${KIMI_BENCH_VLLM_PYTHON:-python3}" -c \
      'from importlib.metadata import version; print("vLLM for the peer modes:", version("vllm"))' 2>/dev/null \
      || echo "vLLM for the peer modes: not importable (stage it: tests/gpu/stage-stack.sh; or set KIMI_BENCH_VLLM_PYTHONPATH)"
    # KIMI_BENCH_TIMEOUT=S: stop the bench after S seconds (SIGTERM: it stops the servers
    # and keeps the results so far); its own deadline normally ends it first.
    guard=()
    if [ -n "${KIMI_BENCH_TIMEOUT:-}" ]; then guard=(timeout --kill-after=30 "$KIMI_BENCH_TIMEOUT"); fi
    "${guard[@]}" python3 -m bench --out "${OUT:-/tmp/kimi-bench-out}" "${@:2}"
    ;;
  *) echo "usage: $0 install a|b|c | run [python -m bench args, e.g. --quick]" >&2; exit 2 ;;
esac
