"""What a series is applied to or checked against.

- a checkout of SGLang (has ``python/sglang``): patches apply with ``-p1``;
- a directory holding ``sglang/`` (site-packages, an extracted wheel): ``-p2``,
  which drops the ``python/`` component of the series' paths;
- a git ref in a checkout (read-only, ``check`` only): files come from ``git show``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .git import run_git


class TargetError(ValueError):
    """The given target is not an SGLang tree."""


@dataclass(frozen=True)
class Tree:
    """A tree of SGLang sources: ``root`` is where ``git apply -p<strip>`` runs.

    kind: ``checkout`` | ``site-packages`` | ``git-ref`` (then ``ref`` is set and the
    files are read from that commit of the repository at ``root``).
    """

    root: Path
    strip: int
    kind: str
    ref: str | None = None
    installed: bool = False  # the sglang this Python imports (installed_tree)

    def describe(self) -> str:
        """A one-line description for reports."""
        if self.ref:
            return f"{self.root} @ {self.ref} (git ref)"
        return f"{self.root} ({self.kind}, -p{self.strip})"

    def local_path(self, series_path: str) -> str:
        """Map a series path (``python/sglang/x.py``) to a path relative to ``root``."""
        parts = series_path.split("/")
        return "/".join(parts[self.strip - 1:])

    def read(self, series_path: str) -> bytes | None:
        """The content of a series path in this tree; None if it does not exist."""
        rel = self.local_path(series_path)
        if self.ref:
            proc = run_git(["cat-file", "-e", f"{self.ref}:{rel}"], self.root, check=False)
            if proc.returncode != 0:
                return None
            return subprocess.run(["git", "show", f"{self.ref}:{rel}"], cwd=self.root,
                                  capture_output=True, check=True).stdout
        p = self.root / rel
        return p.read_bytes() if p.is_file() else None

    def copy_into(self, series_paths: list[str], dest: Path) -> None:
        """Copy the given series paths (those that exist) to ``dest`` with the same layout
        relative to ``dest`` as to ``root``, so ``git apply -p<strip>`` runs there alike."""
        for sp in series_paths:
            data = self.read(sp)
            if data is None:
                continue
            out = dest / self.local_path(sp)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)


_VERSION_ASSIGN_RE = re.compile(r"""^(?:__version__|version)\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)
_TOML_VERSION_RE = re.compile(r"""^version\s*=\s*['"]([^'"]+)['"]""", re.M)


def sglang_version(tree: Tree) -> str | None:
    """The SGLang release a tree holds (``0.5.17``; a local ``+cu130`` suffix dropped), or None.

    Read, first found wins: the installed distribution's metadata (for the
    installed tree), ``sglang/_version.py`` (setuptools-scm, in wheels and
    installs), ``sglang/version.py``, a ``sglang-X.dist-info`` beside the
    package, ``python/pyproject.toml``'s ``version``. Never imports sglang.
    """
    found: str | None = None
    if tree.installed:
        try:
            found = importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            found = None
    for name in ("python/sglang/_version.py", "python/sglang/version.py"):
        if found:
            break
        data = tree.read(name)
        m = _VERSION_ASSIGN_RE.search(data.decode("utf-8", "replace")) if data else None
        found = m.group(1) if m else None
    if not found and not tree.ref and tree.strip == 2:
        infos = sorted(tree.root.glob("sglang-*.dist-info"))
        if infos:
            found = infos[0].name[len("sglang-"):-len(".dist-info")]
    if not found:
        data = tree.read("python/pyproject.toml")
        m = _TOML_VERSION_RE.search(data.decode("utf-8", "replace")) if data else None
        found = m.group(1) if m else None
    return found.split("+", 1)[0] if found else None


def tree_for_dir(path: Path | str) -> Tree:
    """Classify a directory: a checkout (``python/sglang``), a dir holding ``sglang/``,
    or the ``sglang`` package dir itself. Raises TargetError otherwise."""
    path = Path(path).resolve()
    if (path / "python" / "sglang").is_dir():
        return Tree(path, 1, "checkout")
    if (path / "sglang").is_dir():
        return Tree(path, 2, "site-packages")
    if path.name == "sglang" and (path / "__init__.py").is_file():
        return Tree(path.parent, 2, "site-packages")
    raise TargetError(f"{path} holds neither python/sglang nor sglang/")


def installed_tree() -> Tree:
    """The installed ``sglang`` package (``importlib.util.find_spec``), as a site-packages tree.

    Does not import sglang. Raises TargetError when it is not installed.
    """
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        raise TargetError("sglang is not installed in this Python (find_spec('sglang') is None)")
    locations = list(spec.submodule_search_locations or [])
    if not locations and spec.origin:
        locations = [str(Path(spec.origin).parent)]
    if not locations:
        raise TargetError("cannot locate the installed sglang package")
    return Tree(Path(locations[0]).resolve().parent, 2, "site-packages", installed=True)


def tree_for_ref(repo: Path | str, ref: str) -> Tree:
    """A read-only view of ``ref`` in the checkout ``repo``. Raises TargetError if the ref
    does not resolve to a commit holding ``python/sglang``."""
    repo = Path(repo).resolve()
    proc = run_git(["rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], repo, check=False)
    if proc.returncode != 0:
        raise TargetError(f"{ref!r} is not a commit in {repo}")
    if run_git(["cat-file", "-e", f"{ref}:python/sglang"], repo, check=False).returncode != 0:
        raise TargetError(f"{ref} in {repo} has no python/sglang")
    return Tree(repo, 1, "git-ref", ref=ref)
