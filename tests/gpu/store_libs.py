"""The shared libraries the Mooncake wheel's binaries need that the offline H200 image
lacks, taken from staged Debian packages (tests/gpu/stage-extras.sh: libibverbs1,
ibverbs-providers, libnuma1, libcurl4, libgssapi-krb5-2 and what they need) and copied into
one folder that goes on LD_LIBRARY_PATH (tests/gpu/stage.sh's ``install_store``).

Only what ``ldd`` reports "not found" is copied, repeated until nothing more can be found
(a copied library may need others): the image's own libraries are never shadowed. Besides
the staged folder, the Python ``nvidia`` packages' ``lib`` folders are searched (the
image's torch brings ``libcudart.so.13``, which mooncake's ``_store`` module needs and a
process that has not imported torch, the store node, would not find).

Usage: python3 store_libs.py LIB_DIR STAGED_DIR FILE...  (exit 1 when something stays
missing, with its names)."""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
from typing import Dict, Iterable, List, Tuple


def not_found(files: Iterable[str], lib_dir: str) -> List[str]:
    """The sonames ``ldd`` cannot resolve for any of ``files`` with ``lib_dir`` first on
    LD_LIBRARY_PATH (sorted, distinct). Raises RuntimeError when ``ldd`` itself fails on a
    file that is not a dynamic ELF object."""
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(
        p for p in (lib_dir, os.environ.get("LD_LIBRARY_PATH", "")) if p))
    missing = set()
    for f in files:
        r = subprocess.run(["ldd", f], capture_output=True, text=True, env=env)
        if r.returncode != 0 and "not found" not in r.stdout:
            raise RuntimeError(f"ldd {f} failed: {(r.stderr or r.stdout).strip()}")
        for line in r.stdout.splitlines():
            name, _, where = line.strip().partition(" => ")
            if where.strip() == "not found":
                missing.add(name.strip())
    return sorted(missing)


def nvidia_lib_dirs() -> List[str]:
    """The ``lib`` folders of the importable ``nvidia.*`` wheels (CUDA runtime, NCCL, ...)."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
    return sorted(d for r in roots for d in glob.glob(os.path.join(r, "*", "lib")) + glob.glob(
        os.path.join(r, "*", "*", "lib")) if os.path.isdir(d))


def index(dirs: Iterable[str]) -> Dict[str, str]:
    """{file name: path} of the shared libraries in ``dirs`` and their subfolders (first wins)."""
    found: Dict[str, str] = {}
    for d in dirs:
        for root, _, names in os.walk(d):
            for n in sorted(names):
                if ".so" in n:
                    found.setdefault(n, os.path.join(root, n))
    return found


def link_missing(files: List[str], search: List[str], lib_dir: str) -> Tuple[List[str], List[str]]:
    """Copy into ``lib_dir`` every library ``files`` need that the system lacks and
    ``search`` (folders) holds, until nothing more resolves. Returns (copied names,
    names still missing), both sorted."""
    os.makedirs(lib_dir, exist_ok=True)
    have = index(search)
    copied: List[str] = []
    while True:
        checked = list(files) + [os.path.join(lib_dir, n) for n in copied]
        missing = not_found(checked, lib_dir)
        new = [n for n in missing if n in have and n not in copied]
        if not new:
            return sorted(copied), missing
        for n in new:
            shutil.copy2(have[n], os.path.join(lib_dir, n))  # follows the packages' symlinks
            copied.append(n)


def main(argv: List[str]) -> int:
    if len(argv) < 3:
        print(__doc__.strip().splitlines()[-2], file=sys.stderr)
        return 2
    lib_dir, staged, files = argv[0], argv[1], argv[2:]
    copied, missing = link_missing(files, [staged, *nvidia_lib_dirs()], lib_dir)
    print(f"store libs: copied {len(copied)} into {lib_dir}: {' '.join(copied) or '-'}")
    if missing:
        print(f"store libs: still missing (neither the system nor the staged packages have them): "
              f"{' '.join(missing)}", file=sys.stderr)
        return 1
    print("store libs: every library resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
