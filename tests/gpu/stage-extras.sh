#!/usr/bin/env bash
# Stage .whl/d: what the GPU runs need beyond ../shared/gpu-lab's a, b, c, for the device
# image (Python 3.12; it already has pandas, pyarrow, fsspec, xxhash, typer, tqdm):
# pytest for tests/gpu, speculators' own generator and reader for its clients group
# (issue 6), and py-spy for the bench's profiles (python -m bench) (issue 7). About 8 MiB: carry it
# together with .whl/c in the `run` call. Usage: bash tests/gpu/stage-extras.sh [.whl]
set -euo pipefail
root=${1:-.whl}
mkdir -p "$root/d"
python3 -m pip download -q --no-deps --dest "$root/d" --python-version 3.12 --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 \
  --platform any \
  speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 multiprocess==0.70.19 py-spy==0.4.3 \
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 Pygments==2.21.0
ls -la "$root/d"
