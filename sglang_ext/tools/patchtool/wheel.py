"""Base trees from PyPI wheels: fetch (pip), verify (sha256 from base.toml), lay out as a git checkout.

The SGLang wheel ships its Python sources; a base tree is those sources at
``python/sglang/...`` (upstream's repository layout, so the series' paths
apply), without compiled ``*.so`` modules and ``__pycache__``.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

from .git import TOOL_EMAIL, TOOL_NAME, run_git
from .series import Base


class WheelError(RuntimeError):
    """A wheel could not be downloaded, failed its sha256 pin, or is not an SGLang wheel."""


@dataclass(frozen=True)
class WheelInfo:
    """A wheel on disk and what was verified about it."""

    path: Path
    version: str
    sha256: str
    pinned: bool  # True when base.toml pins this file and the sha256 matched


def cache_root() -> Path:
    """``$KIMI_SGLANG_CACHE`` or ``~/.cache/kimi-sglang``; wheels live in ``wheels/``,
    base checkouts built for ``check --against`` in ``checkouts/``."""
    env = os.environ.get("KIMI_SGLANG_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kimi-sglang"


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def wheel_version(path: Path) -> str:
    """The version in an ``sglang-<version>-...whl`` file name. Raises WheelError otherwise."""
    m = re.match(r"^sglang-([^-]+)-.*\.whl$", path.name)
    if not m:
        raise WheelError(f"{path.name} is not an sglang wheel file name")
    return m.group(1)


def verify_wheel(path: Path, base: Base | None) -> WheelInfo:
    """Check ``path`` against the sha256 pins of ``base`` (if it pins this version).

    Raises WheelError on a sha256 mismatch, or when the base pins this version but
    not this file name. Returns pinned=False when nothing pins the version.
    """
    version = wheel_version(path)
    digest = sha256_of(path)
    if base is None or base.version != version or not base.wheels:
        return WheelInfo(path, version, digest, pinned=False)
    want = base.wheels.get(path.name)
    if want is None:
        raise WheelError(
            f"{path.name}: base.toml pins sglang {version} but not this file "
            f"(pinned: {', '.join(sorted(base.wheels))})"
        )
    if want.lower() != digest:
        raise WheelError(
            f"sha256 mismatch for {path}: got {digest}, base.toml pins {want}. "
            "Delete the file and download again, or check the pin."
        )
    return WheelInfo(path, version, digest, pinned=True)


def pip_error(stderr: str, newest: int = 5) -> str:
    """pip's failure in a few lines: its ``ERROR:`` lines (all of stderr when it has none),
    with the "(from versions: ...)" list of every release cut to the ``newest`` last ones."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.startswith("ERROR:")] or stderr.strip().splitlines()

    def cut(m):
        versions = [v.strip() for v in m.group(1).split(",") if v.strip()]
        if len(versions) <= newest:
            return m.group(0)
        return f"(newest: {', '.join(versions[-newest:])}; {len(versions)} versions in all)"

    return "\n".join(re.sub(r"\(from versions: ([^)]*)\)", cut, ln) for ln in lines)


def fetch_wheel(version: str, base: Base | None, cache: Path | None = None) -> WheelInfo:
    """Return a verified ``sglang==version`` wheel, downloading it into ``cache/wheels`` if needed.

    Download: ``pip download sglang==V --no-deps --only-binary=:all:``. A cached
    wheel that base.toml pins is preferred. Raises WheelError if pip fails or the
    sha256 does not match the pin.
    """
    wheels = (cache or cache_root()) / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    cached = sorted(wheels.glob(f"sglang-{version}-*.whl"))
    if base is not None and base.version == version and base.wheels:
        cached = [w for w in cached if w.name in base.wheels] or cached
    if cached:
        return verify_wheel(cached[0], base)
    # Downloaded beside the cache and moved in only once verified: a wheel the pins refuse
    # (e.g. another Python's) must not stay cached and fail every later run the same way.
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=wheels))
    try:
        cmd = [sys.executable, "-m", "pip", "download", f"sglang=={version}",
               "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "-q", "-d", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise WheelError(f"pip download sglang=={version} failed:\n{pip_error(proc.stderr)}")
        got = sorted(tmp.glob(f"sglang-{version}-*.whl"))
        if not got:
            raise WheelError(f"pip download sglang=={version} left no wheel in {tmp}")
        info = verify_wheel(got[0], base)
        final = wheels / got[0].name
        os.replace(got[0], final)
        return replace(info, path=final)  # same bytes: no second sha256 of a ~100 MB wheel
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def extract_sources(wheel: Path, dest: Path) -> int:
    """Write the wheel's ``sglang/`` files to ``dest/python/sglang/`` (no ``*.so``,
    ``*.pyc``, ``__pycache__``). Returns the number of files written."""
    n = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if info.is_dir() or not name.startswith("sglang/"):
                continue
            parts = name.split("/")
            if "__pycache__" in parts or name.endswith((".so", ".pyc", ".pyd")):
                continue
            out = dest / "python" / name
            out.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
            n += 1
    if n == 0:
        raise WheelError(f"{wheel} has no sglang/ sources")
    return n


def base_commit_message(version: str) -> str:
    """The message of a base commit, e.g. ``SGLang v0.5.17 (PyPI wheel sources)``."""
    return f"SGLang v{version} (PyPI wheel sources)"


def base_tag(version: str) -> str:
    """The tag a base commit gets, e.g. ``sglang-v0.5.17``."""
    return f"sglang-v{version}"


_IDENTITY_ENV = {
    "GIT_AUTHOR_NAME": TOOL_NAME, "GIT_AUTHOR_EMAIL": TOOL_EMAIL,
    "GIT_COMMITTER_NAME": TOOL_NAME, "GIT_COMMITTER_EMAIL": TOOL_EMAIL,
}


def create_checkout(wheel: WheelInfo, dest: Path) -> str:
    """Make ``dest`` (absent or empty) a git repo with one commit holding the wheel's sources.

    The commit is tagged ``sglang-v<version>`` and the branch is ``main``.
    Returns the commit id. Raises FileExistsError if ``dest`` is not a directory or not
    empty. On any failure or interrupt (KeyboardInterrupt included) what this call made
    is removed before the exception goes on: ``dest`` and any parent it created, or the
    contents of an empty ``dest`` that was there before.
    """
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise FileExistsError(f"{dest} exists and is not an empty directory")
    made = None  # the topmost directory this call creates
    if not dest.exists():
        made = dest.absolute()
        while not made.parent.exists():
            made = made.parent
    dest.mkdir(parents=True, exist_ok=True)
    try:
        extract_sources(wheel.path, dest)
        run_git(["init", "-q", "-b", "main"], dest)
        run_git(["add", "-A", "python"], dest)
        run_git(["commit", "-q", "--no-verify", "-m", base_commit_message(wheel.version)],
                dest, env=_IDENTITY_ENV)
        run_git(["tag", base_tag(wheel.version)], dest)
        return run_git(["rev-parse", "HEAD"], dest).stdout.strip()
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        else:
            for child in list(dest.iterdir()):
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
        raise


def has_commits(repo: Path) -> bool:
    """True when ``repo``'s HEAD names a commit (False in a ``git init`` with no commit)."""
    return run_git(["rev-parse", "--verify", "--quiet", "HEAD^{commit}"], repo,
                   check=False).returncode == 0


def add_base_to_repo(wheel: WheelInfo, repo: Path) -> str:
    """Add the wheel's sources to an existing repo as a parentless commit tagged
    ``sglang-v<version>``, without touching its working tree, index or branches
    (use it as ``rebase --onto`` target). Returns the commit id.
    Raises GitError if the tag already exists."""
    with tempfile.TemporaryDirectory(prefix="sglang-base-") as tmp:
        tmp_path = Path(tmp)
        extract_sources(wheel.path, tmp_path)
        index = tmp_path / ".index"
        env = {"GIT_INDEX_FILE": str(index), "GIT_WORK_TREE": str(tmp_path), **_IDENTITY_ENV}
        git_dir = run_git(["rev-parse", "--absolute-git-dir"], repo).stdout.strip()
        env["GIT_DIR"] = git_dir
        run_git(["add", "-A", "python"], tmp_path, env=env)
        tree = run_git(["write-tree"], tmp_path, env=env).stdout.strip()
        commit = run_git(["commit-tree", tree, "-m", base_commit_message(wheel.version)],
                         tmp_path, env=env).stdout.strip()
    run_git(["tag", base_tag(wheel.version), commit], repo)
    return commit


def cached_checkout(wheel: WheelInfo, cache: Path | None = None) -> Path:
    """A base checkout of ``wheel`` under ``cache/checkouts/``, built on first use.

    Keyed by version and the first 12 hex digits of the wheel's sha256, so a
    different wheel never reuses another's tree. A half-built directory (no commit)
    is rebuilt.
    """
    root = (cache or cache_root()) / "checkouts"
    dest = root / f"sglang-{wheel.version}-{wheel.sha256[:12]}"
    if dest.is_dir():
        ok = run_git(["rev-parse", "--verify", "--quiet", base_tag(wheel.version)], dest,
                     check=False, isolate=True)
        if ok.returncode == 0:
            return dest
        shutil.rmtree(dest)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=root))
    try:
        create_checkout(wheel, tmp / "co")
        (tmp / "co").rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
