# shellcheck shell=bash
# Sourced by tests/gpu/run_e2e.sh and bench/run_bench.sh: the staged SGLang on the device
# host (../shared/gpu-lab recipe; the release of the newest GPU-verified series, see
# `python3 -m sglang_ext patches list`), installed one carried folder per call, then that
# series applied with the project's own tool. KIMI_SGLANG_SERIES=vX.Y.Z applies another.
install_folder() {  # install .whl/$1 into /tmp/site-$1 once per machine
  if [ -f "/tmp/site-$1/.kimi-installed" ]; then echo "site-$1 already installed"; return; fi
  bash .whl/install.sh .whl "$1"
  touch "/tmp/site-$1/.kimi-installed"
}

prepare_run() {  # last folder, environment, series; then print the GPU
  if [ -d .whl/c ]; then install_folder c; fi
  # d (optional, carried with c): speculators, hs-connectors, datasets, multiprocess, py-spy
  if [ -d .whl/d ]; then install_folder d; fi
  export PYTHONPATH="/tmp/site-c:/tmp/site-b:/tmp/site-a:$PWD:/tmp/site-d"
  export PATH="$PATH:/tmp/site-d/bin"
  export PYTHONUNBUFFERED=1
  local series=${KIMI_SGLANG_SERIES:-}
  if [ -z "$series" ]; then
    series=$(python3 -m sglang_ext patches list --status gpu-verified --newest --names)
  fi
  python3 -m sglang_ext patches list | awk -v s="$series" '$1 == s { print "series: " $0 }'
  python3 -m sglang_ext patches apply --series "patches/$series" --site-packages
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
}
