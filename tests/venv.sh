#!/usr/bin/env bash
# Create a cached virtual environment once, safely when several runs start at once.
#
#   bash tests/venv.sh DEST PYTHON [PIP_ARGS ...]
#
# Each PIP_ARGS is one `pip install` call's arguments (split on spaces), run in order,
# e.g. "--upgrade pip" "-r requirements/ci.txt". DEST/.complete marks a finished venv;
# a DEST without it (a killed build) is removed and built again. The build holds an
# exclusive flock on DEST.lock, so a second run waits for the first and then reuses its
# venv instead of deleting it mid-install. The venv is built at DEST itself, not renamed
# into place: a venv's scripts (ruff, pytest, ...) carry its absolute path in their
# first line. Exit status: pip's, when an install fails (its output is shown then).
set -euo pipefail
dest=$1
py=$2
shift 2
[ -f "$dest/.complete" ] && exit 0
mkdir -p "$(dirname "$dest")"
exec 9>"$dest.lock"
if ! flock -n 9; then
  echo "== waiting for another run that is creating $dest"
  flock 9
fi
[ -f "$dest/.complete" ] && exit 0  # built by the run we waited for
quiet() {  # run a command; show its output only if it fails
  local log
  log=$(mktemp)
  if ! "$@" >"$log" 2>&1; then grep -v "^WARNING: Location" "$log" >&2; rm -f "$log"; return 1; fi
  rm -f "$log"
}
echo "== creating venv $dest ($("$py" --version 2>&1))"
rm -rf "$dest"
"$py" -m venv "$dest"
for args in "$@"; do
  # shellcheck disable=SC2086  # one string of pip arguments per step, split on purpose
  quiet "$dest/bin/python" -m pip install --disable-pip-version-check $args
done
touch "$dest/.complete"
