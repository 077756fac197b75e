#!/usr/bin/env bash
# `python -m bench` on the offline device host, staged as tests/gpu/run_e2e.sh is (make
# .whl/{a,b,c} with ../shared/gpu-lab/stage-wheels.sh .whl, then one call per folder on the
# same warm host):
#   bash bench/run_bench.sh install a      (carry .whl/a)
#   bash bench/run_bench.sh install b      (carry .whl/b)
#   bash bench/run_bench.sh run --quick    (carry .whl/c: installs, applies the series, runs)
# The store modes (dump_store, dump_store_early) need mooncake in /tmp/site-m:
#   bash bench/run_bench.sh install m      (carry .whl/m, tests/gpu/stage-extras.sh; or carry it with run)
# vLLM's servers (the peer's modes) get KIMI_BENCH_VLLM_PYTHONPATH / _LD_LIBRARY_PATH /
# _PYTHON, by default from tests/gpu/stage-stack.sh's vLLM stack when it is staged.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=tests/gpu/stage.sh
source tests/gpu/stage.sh
case "${1:-run}" in
  install) if [ "$2" = m ]; then install_store; else install_folder "$2"; fi ;;
  run)
    prepare_run
    df -h /dev/shm | tail -1
    python3 -c 'import psutil' 2>/dev/null || echo "no psutil: host memory from the writer log only"
    python3 -c 'import mooncake, mooncake.store; print("mooncake for the store modes:", mooncake.__file__)' 2>/dev/null \
      || echo "mooncake for the store modes: not importable (carry .whl/m: tests/gpu/stage-extras.sh)"
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
    # KIMI_BENCH_TIMEOUT=S: SIGTERM after S s (it stops the servers, keeps the results so far)
    guard=()
    if [ -n "${KIMI_BENCH_TIMEOUT:-}" ]; then guard=(timeout --kill-after=30 "$KIMI_BENCH_TIMEOUT"); fi
    "${guard[@]}" python3 -m bench --out "${OUT:-/tmp/kimi-bench-out}" "${@:2}"
    ;;
  *) echo "usage: $0 install a|b|c|m | run [python -m bench args, e.g. --quick]" >&2; exit 2 ;;
esac
