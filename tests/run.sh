#!/usr/bin/env bash
# The test command (README, CI): CPU only; installs what it needs into cached venvs.
#
#   bash tests/run.sh [pytest args]
#
# 1. The main venv: $KIMI_SGLANG_VENV (default ~/.cache/kimi-sglang/venv-<hash of
#    requirements/ci.txt, ci-nodeps.txt, store.txt, fleet.txt and the SGLang version of the
#    newest GPU-verified series, `sglang_ext patches list --status gpu-verified`>), reused
#    while those are unchanged. It holds the pinned test deps, SGLang's wheel installed --no-deps (plus
#    only what importing its server args needs: see requirements/ci.txt) and the trainer
#    packages of requirements/ci-nodeps.txt (--no-deps), Mooncake Store's wheel
#    (requirements/store.txt; Debian's libibverbs1 librdmacm1 libnuma1 are apt-installed
#    when missing and running as root) and SGLang's router (requirements/fleet.txt). First
#    run: ~6.5 GB on disk (torch and its CUDA libraries), several minutes. Every test runs here (pytest args apply).
# 2. The Python 3.10 venv (default ~/.cache/kimi-sglang/venv310-<hash of
#    requirements/ci-py310.txt>, ~120 MB): the tests marked `py310` (clients and CLI, no
#    torch) run again under Python 3.10 after a full run (no pytest args). Python 3.10 is
#    $KIMI_SGLANG_PYTHON310, else python3.10 on PATH, else pyenv's ~/.pyenv/versions/3.10.*;
#    none found: an error under CI=true, a warning otherwise.
# 3. The GPU stack's transformers (requirements/gpu-transformers.txt, installed --no-deps into
#    ~/.cache/kimi-sglang/overlay-<hash>, put before the main venv's): after a full run,
#    tests/tooling/test_kimi_slice.py again, as the device runs that reference.
# Venvs are created by tests/venv.sh, under a lock (concurrent runs wait, never collide).
# The project itself is put on PYTHONPATH. Downloads are cached by pip.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
cache=${KIMI_SGLANG_VENV_ROOT:-$HOME/.cache/kimi-sglang}
req=requirements/ci.txt
# The venv's SGLang: the newest GPU-verified series' (base.toml [series] status).
series=$(KIMI_SGLANG_PATCHES="$root/patches" "$py" -m sglang_ext patches list --status gpu-verified --newest --names)
sglang_version=$("$py" -c "import sys,tomllib;print(tomllib.load(open(sys.argv[1],'rb'))['base']['version'])" "patches/$series/base.toml")
nodeps=requirements/ci-nodeps.txt
store=requirements/store.txt
fleet=requirements/fleet.txt
hash=$(printf 'sglang==%s\n' "$sglang_version" | cat "$req" "$nodeps" "$store" "$fleet" - | sha256sum | cut -c1-12)
venv=${KIMI_SGLANG_VENV:-$cache/venv-$hash}
req310=requirements/ci-py310.txt
venv310=${KIMI_SGLANG_VENV310:-$cache/venv310-$(sha256sum <"$req310" | cut -c1-12)}

find_python310() {
  local cand
  for cand in "${KIMI_SGLANG_PYTHON310:-}" python3.10 "$HOME"/.pyenv/versions/3.10.*/bin/python3.10; do
    [ -n "$cand" ] || continue
    if "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 10)' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  return 1
}

if [ ! -f "$venv/.complete" ]; then
  echo "== first run: installing the test venv (~6.5 GB: torch with its CUDA libraries; several minutes)"
fi
# Mooncake Store (tests/integration/test_store.py runs a real mooncake_master): its wheel links
# Debian's RDMA and NUMA libraries even for TCP.
debs=(libibverbs1 librdmacm1 libnuma1)
missing=()
for d in "${debs[@]}"; do dpkg -s "$d" >/dev/null 2>&1 || missing+=("$d"); done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    echo "== installing ${missing[*]} (Mooncake Store's libraries)"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "ERROR: tests/integration/test_store.py needs Debian's ${missing[*]}: apt-get install -y ${missing[*]}" >&2; exit 1
  fi
fi
bash tests/venv.sh "$venv" "$py" "--upgrade pip" "-r $req" "--no-deps sglang==$sglang_version" "--no-deps -r $nodeps" \
  "-r $store" "-r $fleet"
# tests/integration/test_store.py fails (never skips) without Mooncake when run from here, and
# tests/integration/test_fleet.py without SGLang's router (requirements/fleet.txt).
export KIMI_SGLANG_NEED_MOONCAKE=1 KIMI_SGLANG_NEED_ROUTER=1
# The project itself comes from this checkout through PYTHONPATH, not an install into the
# shared venv (an editable install there would point every other checkout at this one).
if [ -n "$(ls "$venv"/lib/python*/site-packages/__editable__*sglang_ext* 2>/dev/null)" ]; then
  "$venv/bin/python" -m pip uninstall -q -y sglang-ext
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
echo "== ruff"
"$venv/bin/ruff" check sglang_ext tests bench testing --select F,E9
echo "== pytest"
set +e
PATH="$venv/bin:$PATH" python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  # pytest: "no tests were collected". With a filter that can be intended; a full run
  # that collects nothing is a broken suite.
  if [ "$#" -gt 0 ]; then echo "no test matched the selection"; exit 0; fi
  echo "ERROR: pytest collected no tests"; exit 1
fi
# Python 3.10: only on a full run (a selection is for iterating on one test); it runs
# whatever the main run gave, and the exit status is the worse of the two.
for arg in "$@"; do case $arg in -*) ;; *) exit "$rc" ;; esac; done
if ! py310=$(find_python310); then
  msg="Python 3.10 not found (set KIMI_SGLANG_PYTHON310): the py310 tests did not run"
  if [ "${CI:-}" = true ]; then echo "ERROR: $msg"; exit 1; fi
  echo "WARNING: $msg"; exit "$rc"
fi
bash tests/venv.sh "$venv310" "$py310" "--upgrade pip" "-r $req310"
mapfile -t files < <(grep -rl --include="test_*.py" --exclude-dir=gpu "pytest.mark.py310" tests | sort)
echo "== pytest, Python 3.10 ($py310): ${files[*]}"
set +e
PATH="$venv310/bin:$PATH" python -m pytest -q -m py310 -p no:cacheprovider "${files[@]}"
rc310=$?
set -e
overlay_req=requirements/gpu-transformers.txt
overlay=$cache/overlay-$(sha256sum <"$overlay_req" | cut -c1-12)
if [ ! -f "$overlay/.complete" ]; then
  rm -rf "$overlay.tmp"
  "$venv/bin/python" -m pip install -q --no-deps --target "$overlay.tmp" -r "$overlay_req"
  touch "$overlay.tmp/.complete"
  rm -rf "$overlay" && mv "$overlay.tmp" "$overlay"
fi
echo "== pytest, the GPU stack's transformers ($overlay_req): tests/tooling/test_kimi_slice.py"
set +e
KIMI_SGLANG_EXPECT_TRANSFORMERS=$(sed -n 's/^transformers==//p' "$overlay_req") \
  PYTHONPATH="$overlay:$PYTHONPATH" PATH="$venv/bin:$PATH" python -m pytest -q -p no:cacheprovider \
  tests/tooling/test_kimi_slice.py
rcgpu=$?
set -e
if [ "$rc" -ne 0 ]; then exit "$rc"; fi
if [ "$rc310" -ne 0 ]; then exit "$rc310"; fi
exit "$rcgpu"
