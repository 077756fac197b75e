# shellcheck shell=bash
# Sourced by tests/gpu/run_e2e.sh and bench/run_bench.sh: the staged SGLang on the device
# host, installed one carried folder per call (../shared/gpu-lab recipe: a release that
# runs on the image's own torch), then the series made for that release applied with the
# project's own tool. KIMI_SGLANG_SERIES=vX.Y.Z names another series; naming the release
# of the stack tests/gpu/stage-stack.sh staged (with its newer torch) switches to it.
install_folder() {  # install .whl/$1 into /tmp/site-$1 once per machine
  if [ -f "/tmp/site-$1/.kimi-installed" ]; then echo "site-$1 already installed"; return; fi
  bash .whl/install.sh .whl "$1"
  touch "/tmp/site-$1/.kimi-installed"
}

install_store() {  # .whl/m (stage-extras.sh) into /tmp/site-m once per machine
  # The mooncake wheel (--target, like the others), the staged Debian libraries unpacked
  # into $dest/debs, and the ones the wheel's binaries need that the image lacks copied
  # into $dest/lib (tests/gpu/store_libs.py; it fails naming what stays missing).
  local src=${1:-.whl/m} dest=${2:-/tmp/site-m}
  if [ -f "$dest/.kimi-installed" ]; then echo "${dest##*/} already installed"; return; fi
  [ -d "$src" ] || { echo "install_store: no $src (bash tests/gpu/stage-extras.sh, carry $src)" >&2; return 1; }
  rm -rf "$dest"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$dest" "$src"/*.whl || return 1
  mkdir -p "$dest/debs"
  tar -xzf "$src/mooncake-libs.tar.gz" -C "$dest/debs" || return 1
  local bins=()
  mapfile -t bins < <(find "$dest/mooncake" -maxdepth 1 -type f \( -name '*.so' -o -name mooncake_master \))
  python3 tests/gpu/store_libs.py "$dest/lib" "$dest/debs" "${bins[@]}" || return 1
  touch "$dest/.kimi-installed"
}

install_router() {  # .whl/r (stage-extras.sh): sglang-router into /tmp/site-r once per machine
  local src=${1:-.whl/r} dest=${2:-/tmp/site-r}
  if [ -f "$dest/.kimi-installed" ]; then echo "${dest##*/} already installed"; return; fi
  [ -d "$src" ] || { echo "install_router: no $src (bash tests/gpu/stage-extras.sh .whl r, carry $src)" >&2; return 1; }
  rm -rf "$dest"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$dest" "$src"/*.whl || return 1
  touch "$dest/.kimi-installed"
}

store_env() {  # an installed /tmp/site-m: last on PYTHONPATH, its lib first on LD_LIBRARY_PATH
  local dest=${1:-/tmp/site-m}
  [ -f "$dest/.kimi-installed" ] || return 0
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$dest"
  export LD_LIBRARY_PATH="$dest/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

stack_release() {  # the SGLang release installed by tests/gpu/stage-stack.sh, if any
  local d
  for d in "${KIMI_STACK_ROOT:-/tmp}"/stack-sgl/sglang-*.dist-info; do
    [ -d "$d" ] && { d=${d##*/sglang-}; echo "${d%.dist-info}"; return; }
  done
}

series_release() {  # the SGLang release series $1 is made against (its base.toml)
  python3 -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["base"]["version"])' \
    "patches/$1/base.toml"
}

prepare_run() {  # last folder, environment, series; then print the GPU
  # KIMI_SGLANG_SERIES naming the series of the release in the staged stack (stage-stack.sh):
  # that stack's PYTHONPATH (its NCCL, torch, SGLang), .whl/d after it; else the .whl folders.
  if [ -n "${KIMI_SGLANG_SERIES:-}" ] && [ -n "$(stack_release)" ] \
     && [ "$(stack_release)" = "$(series_release "$KIMI_SGLANG_SERIES")" ]; then
    if [ -d .whl/d ] && [ ! -f /tmp/site-d/.kimi-installed ]; then  # carried alone, no install.sh
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-d .whl/d/*.whl
      touch /tmp/site-d/.kimi-installed
    fi
    eval "$(bash tests/gpu/stage-stack.sh env sglang)"
    export PYTHONPATH="$PYTHONPATH:$PWD:/tmp/site-d"
    echo "stack: SGLang $(stack_release) from ${KIMI_STACK_ROOT:-/tmp}/stack-sgl"
  else
    if [ -d .whl/c ]; then install_folder c; fi
    # d (optional, carried with c): speculators, hs-connectors, datasets, multiprocess (+ py-spy)
    if [ -d .whl/d ]; then install_folder d; fi
    export PYTHONPATH="/tmp/site-c:/tmp/site-b:/tmp/site-a:$PWD:/tmp/site-d"
  fi
  # m (optional, its own call or carried here): mooncake for test_gpu_store.py
  if [ -d .whl/m ]; then install_store; fi
  store_env
  # r (optional, carried with the run): SGLang's router for test_gpu_fleet.py, last on PYTHONPATH
  if [ -d .whl/r ]; then install_router; fi
  if [ -f /tmp/site-r/.kimi-installed ]; then export PYTHONPATH="$PYTHONPATH:/tmp/site-r"; fi
  export PATH="$PATH:/tmp/site-d/bin"
  export PYTHONUNBUFFERED=1
  # Without KIMI_SGLANG_SERIES, `apply` takes the series made for the staged release
  # (.whl's SGLang, which need not be the newest gpu-verified one) and says which.
  local series=()
  if [ -n "${KIMI_SGLANG_SERIES:-}" ]; then
    python3 -m sglang_ext patches list | awk -v s="$KIMI_SGLANG_SERIES" '$1 == s { print "series: " $0 }'
    series=(--series "patches/$KIMI_SGLANG_SERIES")
  fi
  python3 -m sglang_ext patches apply "${series[@]}" --site-packages
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
}
