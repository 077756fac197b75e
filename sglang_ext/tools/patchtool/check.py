"""Check and apply a series with ``git apply``, all or nothing.

Every check runs on a temporary copy of only the files the series touches:
patch k is checked (``git apply --check -v``) against the copy as patches
1..k-1 left it, then applied to the copy. The target changes only when every
patch passed. git apply never fuzzes: a hunk either matches its full context
(possibly at another line: "offset", which ``-v`` reports as "Hunk #N
succeeded at L (offset K lines)") or fails; we report exactly what git says.

States of a whole series against a tree:

- ``clean``    every patch applies (``apply`` then applies them);
- ``applied``  every patch reverse-applies (``git apply --reverse --check``,
  last to first): already applied, nothing to do;
- ``partial``  each patch is either in or cleanly out, but not all alike;
- ``conflict`` some patch neither applies nor reverse-applies.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .git import run_git
from .series import Patch, Series
from .tree import Tree

_FAILED_RE = re.compile(r"^error: patch failed: (.+):(\d+)$")
_OFFSET_RE = re.compile(r"^Hunk #(\d+) succeeded at (\d+) \(offset (-?\d+) lines?\)\.$")
_CHECKING_RE = re.compile(r"^Checking patch (.+)\.\.\.$")
_ERROR_RE = re.compile(r"^error: (.+?): (.+)$")


@dataclass
class HunkFailure:
    """A hunk git could not place: ``file`` (series path), 1-based ``hunk`` in that file
    (None when the error is about the whole file, e.g. it does not exist)."""

    file: str
    hunk: int | None
    line: int | None
    message: str


@dataclass
class HunkOffset:
    """A hunk git placed at another line than the diff says."""

    file: str
    hunk: int
    line: int
    offset: int


@dataclass
class PatchResult:
    """Outcome for one patch.

    status: ``clean`` | ``offset`` | ``fails`` (forward check), ``applied`` |
    ``not-applied`` (partial-state analysis).
    """

    patch: str
    status: str
    failures: list[HunkFailure] = field(default_factory=list)
    offsets: list[HunkOffset] = field(default_factory=list)
    note: str = ""

    def detail(self) -> str:
        """Human-readable details for the table."""
        bits = [f"fails at hunk {f.hunk} of {f.file}" + (f" (line {f.line})" if f.line else "")
                if f.hunk else f"{f.file}: {f.message}" for f in self.failures]
        bits += [f"hunk {o.hunk} of {o.file} at line {o.line} (offset {o.offset:+d})"
                 for o in self.offsets]
        if self.note:
            bits.append(self.note)
        return "; ".join(bits)


@dataclass
class SeriesReport:
    """A series against one tree: overall ``state`` plus one PatchResult per patch."""

    series: str
    target: str
    state: str
    patches: list[PatchResult]
    notes: list[str] = field(default_factory=list)
    changed: bool = False  # True when apply modified the target

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self)

    @property
    def ok(self) -> bool:
        """True for ``clean`` and ``applied`` (the states that exit 0)."""
        return self.state in ("clean", "applied")


def _touched(series: Series) -> list[str]:
    out: list[str] = []
    for p in series.patches:
        for path in p.touched_paths():
            if path not in out:
                out.append(path)
    return out


def _parse_apply_output(patch: Patch, output: str) -> tuple[list[HunkFailure], list[HunkOffset]]:
    """Turn ``git apply --check -v`` output into failures and offsets, naming hunks by
    index from the diff (git prints the failing hunk's old start line)."""
    failures: list[HunkFailure] = []
    offsets: list[HunkOffset] = []
    current: str | None = None
    failed_files: set[str] = set()

    def series_path(local: str) -> str:
        f = patch.file_diff(local)
        return f.path if f else local

    for line in output.splitlines():
        m = _CHECKING_RE.match(line)
        if m:
            current = series_path(m.group(1))
            continue
        m = _OFFSET_RE.match(line)
        if m and current:
            offsets.append(HunkOffset(current, int(m.group(1)), int(m.group(2)), int(m.group(3))))
            continue
        m = _FAILED_RE.match(line)
        if m:
            path, lineno = series_path(m.group(1)), int(m.group(2))
            hunk = patch.hunk_at(path, lineno)
            failures.append(HunkFailure(path, hunk.index if hunk else None, lineno,
                                        f"patch failed at line {lineno}"))
            failed_files.add(path)
            continue
        if not line.startswith("error: ") or line.startswith("error: while searching for"):
            continue
        m = _ERROR_RE.match(line)
        if m and patch.file_diff(m.group(1)) is not None:
            path = series_path(m.group(1))
            if path not in failed_files:  # "F: patch does not apply" follows "patch failed"
                failures.append(HunkFailure(path, None, None, m.group(2)))
                failed_files.add(path)
        else:
            failures.append(HunkFailure(current or "?", None, None, line[len("error: "):]))
    return failures, offsets


def _git_apply(tree: Tree, workdir: Path, patch: Patch, *, check: bool, reverse: bool = False):
    args = ["apply", f"-p{tree.strip}", "-v"]
    if check:
        args.append("--check")
    if reverse:
        args.append("--reverse")
    args.append(str(patch.path.resolve()))
    return run_git(args, workdir, check=False, isolate=True)


def forward_check(series: Series, tree: Tree, patches: list[Patch] | None = None) -> list[PatchResult]:
    """Check each patch against the tree as the previous ones leave it (on a temp copy).

    A failing patch is left out and the later ones are checked against the tree
    without it (their PatchResult says so). Never changes ``tree``.
    """
    patches = list(series.patches if patches is None else patches)
    results: list[PatchResult] = []
    skipped: list[str] = []
    with tempfile.TemporaryDirectory(prefix="sglang-series-") as tmp:
        work = Path(tmp) / "tree"
        work.mkdir()
        tree.copy_into(_touched(series), work)
        for patch in patches:
            proc = _git_apply(tree, work, patch, check=True)
            failures, offsets = _parse_apply_output(patch, proc.stdout + proc.stderr)
            if proc.returncode != 0:
                if not failures:
                    failures = [HunkFailure("?", None, None, (proc.stderr or proc.stdout).strip())]
                res = PatchResult(patch.name, "fails", failures, offsets)
            else:
                _git_apply(tree, work, patch, check=False)
                res = PatchResult(patch.name, "offset" if offsets else "clean", [], offsets)
            if skipped:
                res.note = "checked without " + ", ".join(skipped)
            if res.status == "fails":
                skipped.append(patch.name[:4])
            results.append(res)
    return results


def reverse_check(series: Series, tree: Tree) -> bool:
    """True when the whole series reverse-applies (last patch first) to ``tree``: it is in."""
    with tempfile.TemporaryDirectory(prefix="sglang-series-") as tmp:
        work = Path(tmp) / "tree"
        work.mkdir()
        tree.copy_into(_touched(series), work)
        for patch in reversed(series.patches):
            if _git_apply(tree, work, patch, check=True, reverse=True).returncode != 0:
                return False
            _git_apply(tree, work, patch, check=False, reverse=True)
    return True


def _single(tree: Tree, patch: Patch, *, reverse: bool) -> bool:
    with tempfile.TemporaryDirectory(prefix="sglang-patch-") as tmp:
        work = Path(tmp) / "tree"
        work.mkdir()
        tree.copy_into(patch.touched_paths(), work)
        return _git_apply(tree, work, patch, check=True, reverse=reverse).returncode == 0


def check_series(series: Series, tree: Tree) -> SeriesReport:
    """Classify ``series`` against ``tree`` (see the module doc for the states). Read-only."""
    forward = forward_check(series, tree)
    report = SeriesReport(series.name, tree.describe(), "clean", forward)
    if all(r.status != "fails" for r in forward):
        return report
    if reverse_check(series, tree):
        report.state = "applied"
        report.patches = [PatchResult(p.name, "applied") for p in series.patches]
        report.notes.append("series already applied; nothing to do")
        return report
    # Each patch on its own: is it in (reverse applies) or out (applies)?
    individual = []
    for patch, fwd in zip(series.patches, forward):
        if _single(tree, patch, reverse=True):
            individual.append(PatchResult(patch.name, "applied"))
        elif _single(tree, patch, reverse=False):
            individual.append(PatchResult(patch.name, "not-applied", offsets=fwd.offsets))
        else:
            individual.append(fwd)
    if all(r.status in ("applied", "not-applied") for r in individual):
        report.state = "partial"
        report.patches = individual
        inn = [r.patch[:4] for r in individual if r.status == "applied"]
        out = [r.patch[:4] for r in individual if r.status == "not-applied"]
        report.notes.append(f"series partially applied: in {', '.join(inn)}; not in {', '.join(out)}")
    else:
        report.state = "conflict"
        first = next(r for r in forward if r.status == "fails")
        report.notes.append(f"{first.patch} does not apply; nothing was changed")
    return report


def apply_series(series: Series, tree: Tree) -> SeriesReport:
    """Apply every patch of ``series`` to ``tree`` if (and only if) all of them check clean.

    Returns the report; ``changed`` tells whether files were written. An already
    applied series is left alone (state ``applied``). Raises ValueError for a
    read-only tree (git ref).
    """
    if tree.ref:
        raise ValueError("cannot apply to a git ref; check out the ref first")
    report = check_series(series, tree)
    if report.state != "clean":
        return report
    done: list[Patch] = []
    for patch in series.patches:
        proc = _git_apply(tree, tree.root, patch, check=False)
        if proc.returncode != 0:  # should not happen after the check; undo what we did
            for p in reversed(done):
                _git_apply(tree, tree.root, p, check=False, reverse=True)
            report.state = "conflict"
            report.notes.append(f"{patch.name} failed while applying (rolled back): "
                                f"{proc.stderr.strip()}")
            return report
        done.append(patch)
    report.changed = True
    report.notes.append(f"applied {len(done)} patches to {tree.root}")
    return report


def revert_series(series: Series, tree: Tree) -> SeriesReport:
    """Take every patch of ``series`` that is in ``tree`` out again (``git apply --reverse``,
    last patch first), all or nothing: the way back from ``applied`` or ``partial``.

    The reversal is first rehearsed on a temporary copy; the tree changes only when
    every reversal passed. Afterwards the report is the tree's new state (``clean``)
    with ``changed`` True. A tree without any patch of the series is left alone
    (state ``clean``, nothing to do); one with a patch that neither applies nor
    reverse-applies is left alone too (state ``conflict``). Raises ValueError for
    a read-only tree (git ref).
    """
    if tree.ref:
        raise ValueError("cannot revert in a git ref; check out the ref first")
    report = check_series(series, tree)
    if report.state == "clean":
        report.notes.append("no patch of the series is in the tree; nothing to revert")
        return report
    if report.state == "conflict":
        report.notes.append("not reverted: a patch neither applies nor reverse-applies; "
                            "nothing was changed")
        return report
    names = {r.patch for r in report.patches if r.status == "applied"}
    todo = [p for p in reversed(series.patches) if p.name in names]
    with tempfile.TemporaryDirectory(prefix="sglang-series-") as tmp:
        work = Path(tmp) / "tree"
        work.mkdir()
        tree.copy_into(_touched(series), work)
        for patch in todo:
            proc = _git_apply(tree, work, patch, check=False, reverse=True)
            if proc.returncode != 0:
                report.state = "conflict"
                report.notes.append(f"{patch.name} does not reverse-apply after the later "
                                    f"patches were taken out: {proc.stderr.strip()}; "
                                    "nothing was changed")
                return report
    done: list[Patch] = []
    for patch in todo:
        proc = _git_apply(tree, tree.root, patch, check=False, reverse=True)
        if proc.returncode != 0:  # should not happen after the rehearsal; put them back
            for p in reversed(done):
                _git_apply(tree, tree.root, p, check=False)
            report.state = "conflict"
            report.notes.append(f"{patch.name} failed while reverting (rolled back): "
                                f"{proc.stderr.strip()}")
            return report
        done.append(patch)
    after = check_series(series, tree)
    after.changed = True
    after.notes.insert(0, f"reverted {len(done)} patch{'' if len(done) == 1 else 'es'} in {tree.root} "
                          f"({', '.join(p.name[:4] for p in reversed(done))})")
    return after
