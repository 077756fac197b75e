#!/usr/bin/env bash
# Apply a kimi-sglang patch series to the SGLang that `python3` imports.
#
#   docker/apply-series.sh SERIES_DIR      e.g. docker/apply-series.sh patches/v0.5.23
#
# Env: PYTHON (default python3). Run from the repository root (or anywhere
# `python -m sglang_ext` resolves). Used by the Dockerfile and by the build
# rehearsal test (tests/tooling/test_container.py), which points PYTHONPATH at an
# unpacked wheel.
#
# Where the sglang package lives decides how the series is applied:
#   .../python/sglang  (upstream images install /sgl-workspace/sglang editable)
#                      -> `patches apply --target <checkout root>`
#   anything else      (a wheel in site-packages)
#                      -> `patches apply --site-packages`
# importlib.util.find_spec locates the package without running sglang's
# __init__ (which pulls in torch/transformers).
set -euo pipefail

if [[ $# -ne 1 || "$1" == -h || "$1" == --help ]]; then
    sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
    [[ $# -eq 1 ]] && exit 0 || exit 2
fi
series=$1
py=${PYTHON:-python3}

if [[ ! -f "$series/series" ]]; then
    echo "apply-series: $series/series not found (is $series a patch series folder?)" >&2
    exit 2
fi

pkg_dir=$("$py" -c '
import importlib.util, os, sys
spec = importlib.util.find_spec("sglang")
if spec is None or not spec.origin:
    sys.exit("apply-series: sglang is not importable by " + sys.executable)
print(os.path.dirname(os.path.realpath(spec.origin)))
')
echo "apply-series: sglang package at $pkg_dir"

case "$pkg_dir" in
    */python/sglang)
        target=${pkg_dir%/python/sglang}
        echo "apply-series: checkout layout; applying to $target"
        "$py" -m sglang_ext patches apply --series "$series" --target "$target"
        ;;
    *)
        echo "apply-series: site-packages layout"
        "$py" -m sglang_ext patches apply --series "$series" --site-packages
        ;;
esac

# Cheap sanity check that patch 0001 landed where the server will read it:
# server_args.py (0.5.17) or the field declarations under arg_groups/ (0.5.2x).
if ! grep -rqs --include='*.py' "dump_hidden_states_dir" "$pkg_dir/srt/server_args.py" "$pkg_dir/srt/arg_groups"; then
    echo "apply-series: neither $pkg_dir/srt/server_args.py nor $pkg_dir/srt/arg_groups declares dump_hidden_states_dir after applying $series" >&2
    exit 1
fi
echo "apply-series: $series applied to $pkg_dir"
