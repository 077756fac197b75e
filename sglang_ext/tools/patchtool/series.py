"""A series folder (``patches/vX.Y.Z/``): the ``series`` order, ``base.toml`` and each diff's hunks.

Only what the other modules need is parsed out of the diffs: which files a
patch touches and where each hunk starts, so that git's "patch failed:
FILE:LINE" can be named as "hunk N of FILE".
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")

# How far a series is verified (``[series] status`` in its base.toml), strongest first:
# "gpu-verified": the GPU end-to-end suite passed with it (``evidence`` names the record);
# "apply-checked": it applies to its pinned wheel and passes the CPU tests, never run on a GPU.
STATUSES = ("gpu-verified", "apply-checked")
GPU_VERIFIED = STATUSES[0]


class SeriesError(ValueError):
    """A series folder or one of its files is missing or malformed."""


@dataclass(frozen=True)
class Hunk:
    """One ``@@ -old_start,old_len +new_start,new_len @@`` block (1-based ``index`` in its file)."""

    index: int
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    header: str


@dataclass(frozen=True)
class FileDiff:
    """The part of a patch for one file; paths are as git prints them (``a/``/``b/`` removed).

    ``old_path`` is None for a created file, ``new_path`` None for a deleted one.
    """

    old_path: str | None
    new_path: str | None
    hunks: tuple[Hunk, ...]

    @property
    def path(self) -> str:
        """The file's path in the tree the patch applies to (the new path for a created file)."""
        return self.old_path or self.new_path  # type: ignore[return-value]


@dataclass(frozen=True)
class Patch:
    """One ``NNNN-topic.diff`` file of a series."""

    name: str
    path: Path
    files: tuple[FileDiff, ...]

    def touched_paths(self) -> list[str]:
        """Every path (old and new) the patch reads or writes, ``python/sglang/...`` form."""
        out: list[str] = []
        for f in self.files:
            for p in (f.old_path, f.new_path):
                if p and p not in out:
                    out.append(p)
        return out

    def file_diff(self, path: str) -> FileDiff | None:
        """Return the FileDiff for ``path``, matching it also when git printed it with fewer
        leading components (``-p2`` strips ``python/``); None when the patch has no such file."""
        for f in self.files:
            for p in (f.old_path, f.new_path):
                if p and (p == path or p.endswith("/" + path)):
                    return f
        return None

    def hunk_at(self, path: str, line: int) -> Hunk | None:
        """The hunk of ``path`` that git reports as failing at ``line`` (its old start line).

        git prints the hunk's old start; if no hunk starts exactly there, the last
        hunk starting at or before ``line`` is returned. None if ``path`` is unknown.
        """
        f = self.file_diff(path)
        if f is None or not f.hunks:
            return None
        for h in f.hunks:
            if h.old_start == line:
                return h
        before = [h for h in f.hunks if h.old_start <= line]
        return before[-1] if before else f.hunks[0]


@dataclass(frozen=True)
class Base:
    """The ``[base]`` table of ``base.toml``: the SGLang release a series is made against."""

    version: str
    image: str | None = None
    git_tag: str | None = None
    wheels: dict[str, str] = field(default_factory=dict)  # wheel file name -> sha256
    series_version: str | None = None
    status: str | None = None  # ``[series] status``: one of STATUSES (None when absent)
    evidence: str | None = None  # ``[series] evidence``: where the verification is recorded


@dataclass(frozen=True)
class Series:
    """A series folder: patches in application order plus its base (None without base.toml)."""

    directory: Path
    patches: tuple[Patch, ...]
    base: Base | None

    @property
    def name(self) -> str:
        """The folder's name, e.g. ``v0.5.17``."""
        return self.directory.name


def _strip_prefix(path: str) -> str | None:
    if path == "/dev/null":
        return None
    path = path.split("\t", 1)[0]
    if path.startswith(("a/", "b/")):
        return path[2:]
    return path


def parse_patch(path: Path) -> Patch:
    """Parse the files and hunks of one git-style diff (format-patch output or plain diff).

    Raises SeriesError when the file cannot be read or has no file diffs.
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:  # not UTF-8: a binary file, not a diff
        raise SeriesError(f"cannot read patch {path}: {exc}") from exc
    files: list[FileDiff] = []
    old: str | None = None
    new: str | None = None
    hunks: list[Hunk] = []
    in_file = False
    remaining_old = remaining_new = 0

    def flush() -> None:
        nonlocal hunks, in_file
        if in_file:
            files.append(FileDiff(old, new, tuple(hunks)))
        hunks = []
        in_file = False

    i = 0
    while i < len(lines):
        line = lines[i]
        if remaining_old > 0 or remaining_new > 0:
            # Inside a hunk: count lines so "--- x" content is not taken for a header.
            if line.startswith("\\"):
                pass
            elif line.startswith("-"):
                remaining_old -= 1
            elif line.startswith("+"):
                remaining_new -= 1
            else:
                remaining_old -= 1
                remaining_new -= 1
            i += 1
            continue
        if line.startswith("diff --git "):
            flush()
            m = re.match(r"^diff --git (a/\S+) (b/\S+)$", line)
            old = _strip_prefix(m.group(1)) if m else None
            new = _strip_prefix(m.group(2)) if m else None
            in_file = True
        elif in_file and line.startswith("--- "):
            old = _strip_prefix(line[4:])
        elif in_file and line.startswith("+++ "):
            new = _strip_prefix(line[4:])
        elif in_file and line.startswith("new file mode"):
            old = None
        elif in_file and line.startswith("deleted file mode"):
            new = None
        elif in_file and line.startswith("@@ "):
            m = _HUNK_RE.match(line)
            if not m:
                raise SeriesError(f"{path.name}: bad hunk header {line!r}")
            old_len = int(m.group(2)) if m.group(2) is not None else 1
            new_len = int(m.group(4)) if m.group(4) is not None else 1
            hunks.append(
                Hunk(len(hunks) + 1, int(m.group(1)), old_len, int(m.group(3)), new_len, line)
            )
            remaining_old, remaining_new = old_len, new_len
        i += 1
    flush()
    if not files:
        raise SeriesError(f"{path}: no file diffs found")
    return Patch(path.name, path, tuple(files))


def load_base(path: Path) -> Base:
    """Read ``base.toml`` (tomllib). Raises SeriesError if it lacks ``[base] version`` or
    has a ``[series] status`` outside STATUSES."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SeriesError(f"cannot read {path}: {exc}") from exc
    base = data.get("base") or {}
    if "version" not in base:
        raise SeriesError(f"{path}: [base] version missing")
    series = data.get("series") or {}
    status = series.get("status")
    if status is not None and status not in STATUSES:
        raise SeriesError(f"{path}: [series] status is {status!r}; expected one of "
                          f"{', '.join(STATUSES)}")
    return Base(
        version=str(base["version"]),
        image=base.get("image"),
        git_tag=base.get("git_tag"),
        wheels={str(k): str(v) for k, v in (base.get("wheels") or {}).items()},
        series_version=series.get("version"),
        status=status,
        evidence=series.get("evidence"),
    )


def read_series_names(directory: Path) -> list[str]:
    """File names listed in ``directory/series`` (blank lines and ``#`` comments skipped)."""
    path = directory / "series"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SeriesError(f"cannot read {path}: {exc}") from exc
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def load_series(directory: Path | str) -> Series:
    """Load a series folder. Raises SeriesError if ``series`` names a missing file, or
    none (a series of no patch would check as applying cleanly and apply as nothing)."""
    directory = Path(directory)
    patches = []
    for name in read_series_names(directory):
        p = directory / name
        if not p.is_file():
            raise SeriesError(f"{directory}/series lists {name}, which does not exist")
        patches.append(parse_patch(p))
    base_toml = directory / "base.toml"
    base = load_base(base_toml) if base_toml.is_file() else None
    if not patches:
        raise SeriesError(f"{directory}/series lists no patch")
    return Series(directory, tuple(patches), base)


def default_patches_root() -> Path:
    """The project's ``patches/`` folder: ``$KIMI_SGLANG_PATCHES`` if set (the image sets
    it), else next to the package in a checkout, else ``./patches``."""
    env = os.environ.get("KIMI_SGLANG_PATCHES")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parents[3] / "patches"  # <checkout>/sglang_ext/tools/patchtool/
    return here if here.is_dir() else Path.cwd() / "patches"


def _version_key(name: str) -> tuple:
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"[.\-]", name.lstrip("v")))


def resolve_series_dir(spec: str | None) -> Path:
    """Turn ``--series``/``--base`` into a folder: a path, or ``vX.Y.Z``/``X.Y.Z`` under
    ``patches/``; None means the newest ``patches/v*``. Raises SeriesError if not found, or
    when the folder has no ``series`` file."""
    root = default_patches_root()
    if spec is None:
        dirs = sorted((d for d in root.glob("v*") if (d / "series").is_file()),
                      key=lambda d: _version_key(d.name))
        if not dirs:
            raise SeriesError(f"no series folder under {root}")
        return dirs[-1]
    p = Path(spec)
    if not p.is_dir() and "/" in spec:  # a path that is not there
        raise SeriesError(f"series folder {spec!r} not found")
    if not p.is_dir():  # a name under patches/
        p = root / (spec if spec.startswith("v") else f"v{spec}")
    if p.is_dir():
        if not (p / "series").is_file():
            raise SeriesError(f"{p} is not a patch series folder: it has no `series` file")
        return p
    known = ", ".join(sorted(d.name for d in root.glob("v*") if (d / "series").is_file()))
    raise SeriesError(f"series {spec!r} not found under {root} (known: {known})")


def known_series() -> list[Path]:
    """Every series folder under ``patches/`` (has a ``series`` file), oldest first."""
    root = default_patches_root()
    return sorted((d for d in root.glob("v*") if (d / "series").is_file()),
                  key=lambda d: _version_key(d.name))


def series_for_version(version: str) -> Path | None:
    """The series folder made against SGLang ``version`` (its base.toml ``[base] version``;
    a ``+local`` suffix is ignored), or None when no series is."""
    version = version.split("+", 1)[0]
    for d in reversed(known_series()):
        toml = d / "base.toml"
        try:
            base = load_base(toml) if toml.is_file() else None
        except SeriesError:
            base = None
        if base is not None and base.version == version:
            return d
    return None


def pinned_base_for_version(version: str) -> Base | None:
    """The ``base.toml`` under ``patches/`` that pins ``version``, if any."""
    root = default_patches_root()
    for toml in sorted(root.glob("*/base.toml")):
        try:
            base = load_base(toml)
        except SeriesError:
            continue
        if base.version == version:
            return base
    return None


def series_status(directory: Path | str) -> str:
    """How far the series in ``directory`` is verified: its base.toml's ``[series] status``,
    one of STATUSES. The one reader of that field (CLI ``patches list``, build.sh, the test
    and staging scripts go through it). Raises SeriesError when base.toml is missing, has
    no status, or an unknown one."""
    toml = Path(directory) / "base.toml"
    if not toml.is_file():
        raise SeriesError(f"{toml} not found: a series needs a base.toml with [series] status")
    base = load_base(toml)
    if base.status is None:
        raise SeriesError(f"{toml}: [series] status missing (one of {', '.join(STATUSES)})")
    return base.status


def newest_series(status: str | None = None) -> Path:
    """The newest series folder under ``patches/`` (version order, v0.5.9 < v0.5.17), only
    among those whose ``series_status`` is ``status`` when given. Raises SeriesError when
    none is, or when ``status`` is not one of STATUSES."""
    if status is not None and status not in STATUSES:
        raise SeriesError(f"unknown status {status!r}; expected one of {', '.join(STATUSES)}")
    found = [d for d in known_series() if status is None or series_status(d) == status]
    if not found:
        what = f"{status} series" if status else "series"
        raise SeriesError(f"no {what} under {default_patches_root()}")
    return found[-1]
