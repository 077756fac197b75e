#!/usr/bin/env bash
# The test command (README, CI): CPU only; installs what it needs into a cached venv.
#
#   bash tests/run.sh [pytest args]
#
# Venv: $KIMI_SGLANG_VENV (default ~/.cache/kimi-sglang/venv-<hash of requirements/ci.txt>),
# reused while requirements/ci.txt is unchanged. It holds the pinned test deps, SGLang's
# wheel installed --no-deps (plus only what importing its server args needs: see
# requirements/ci.txt), the trainer packages of requirements/ci-nodeps.txt (--no-deps)
# (the project itself is put on PYTHONPATH). Downloads are cached by pip.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
req=requirements/ci.txt
sglang_version=$("$py" -c "import tomllib;print(tomllib.load(open('patches/v0.5.17/base.toml','rb'))['base']['version'])")
nodeps=requirements/ci-nodeps.txt
hash=$(cat "$req" "$nodeps" patches/v0.5.17/base.toml | sha256sum | cut -c1-12)
venv=${KIMI_SGLANG_VENV:-$HOME/.cache/kimi-sglang/venv-$hash}
quiet() {  # run a pip command; show its output only if it fails
  local log
  log=$(mktemp)
  if ! "$@" >"$log" 2>&1; then grep -v "^WARNING: Location" "$log" >&2; rm -f "$log"; return 1; fi
  rm -f "$log"
}
if [ ! -f "$venv/.complete" ]; then
  echo "== creating test venv $venv (first run: several minutes, torch is large)"
  rm -rf "$venv"
  "$py" -m venv "$venv"
  quiet "$venv/bin/python" -m pip install --upgrade pip
  quiet "$venv/bin/python" -m pip install -r "$req"
  quiet "$venv/bin/python" -m pip install --no-deps "sglang==$sglang_version"
  quiet "$venv/bin/python" -m pip install --no-deps -r "$nodeps"
  touch "$venv/.complete"
fi
# The project itself comes from this checkout through PYTHONPATH, not an install into the
# shared venv (an editable install there would point every other checkout at this one).
if [ -n "$(ls "$venv"/lib/python*/site-packages/__editable__*sglang_ext* 2>/dev/null)" ]; then
  quiet "$venv/bin/python" -m pip uninstall -y sglang-ext
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$venv/bin:$PATH"
echo "== ruff"
ruff check sglang_ext tests --select F,E9
echo "== pytest"
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  # pytest: "no tests were collected". With a filter that can be intended; a full run
  # that collects nothing is a broken suite.
  if [ "$#" -gt 0 ]; then echo "no test matched the selection"; exit 0; fi
  echo "ERROR: pytest collected no tests"; exit 1
fi
exit "$rc"
