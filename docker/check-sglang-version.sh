#!/usr/bin/env bash
# Fail unless the SGLang installed for `python3` is the release a patch
# series was made against.
#
#   docker/check-sglang-version.sh EXPECTED     e.g. 0.5.17
#
# Reads the distribution metadata (no `import sglang`). A local version
# suffix (0.5.17+cu130) counts as the same release.
set -euo pipefail
expected=${1:?usage: check-sglang-version.sh EXPECTED_VERSION}
py=${PYTHON:-python3}
"$py" - "$expected" <<'PY'
import importlib.metadata as md
import sys

expected = sys.argv[1]
try:
    found = md.version("sglang")
except md.PackageNotFoundError:
    sys.exit(f"check-sglang-version: sglang is not installed for {sys.executable}; "
             f"the patch series needs sglang {expected}")
if found.split("+", 1)[0] != expected:
    sys.exit(
        f"check-sglang-version: the base image has sglang {found}, but the patch series "
        f"is made against {expected}. Build with the matching series "
        f"(./build.sh --base v{found.split('+', 1)[0]}) or the image named in its base.toml."
    )
print(f"check-sglang-version: sglang {found} matches the series base {expected}")
PY
