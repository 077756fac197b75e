"""A series as commits on a base checkout: import (git am), export (git format-patch), rebase.

The series is the export of ``BASE..HEAD``; editing a patch means editing its
commit (``git commit --amend``, ``git rebase -i``) and exporting again.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .git import GitError, identity_args, run_git
from .series import Series, read_series_names

# The exact flags the committed series was made with; re-exporting unchanged
# commits with them reproduces the files byte for byte.
FORMAT_PATCH_FLAGS = ["-n", "--zero-commit", "--no-signature", "--suffix=.diff"]
# Config pinned so the output does not depend on repository size (core.abbrev
# would otherwise grow the "index" lines in a big upstream clone) or on diff
# settings; user and system config are ignored altogether (FORMAT_PATCH_ENV).
FORMAT_PATCH_CONFIG = [
    "-c", "core.abbrev=7", "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false",
    "-c", "diff.algorithm=myers", "-c", "diff.renames=true",
]
FORMAT_PATCH_ENV = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}


class HistoryError(RuntimeError):
    """import/export/rebase could not finish; the message says what to do next."""


@dataclass
class RebaseResult:
    """Outcome of ``rebase``: ``ok`` or stopped at ``conflict_patch`` with conflicted files."""

    ok: bool
    onto: str
    conflict_patch: str | None = None
    conflict_files: list[str] = field(default_factory=list)
    message: str = ""


def _require_clean(repo: Path) -> None:
    st = run_git(["status", "--porcelain", "--untracked-files=no"], repo).stdout
    if st.strip():
        raise HistoryError(f"{repo} has uncommitted changes; commit or stash them first")
    for marker in ("rebase-merge", "rebase-apply"):
        git_dir = Path(run_git(["rev-parse", "--absolute-git-dir"], repo).stdout.strip())
        if (git_dir / marker).exists():
            raise HistoryError(f"{repo} is in the middle of a rebase/am; finish or abort it first")


class ImportStopped(HistoryError):
    """``git am`` stopped on a patch; the import was undone (the branch is as before)."""


# git am's advice on how to go on; printed after we have already run ``git am --abort``.
_AM_ADVICE = ("git am --continue", "git am --skip", "git am --abort", "--show-current-patch",
              "advice.mergeConflict")


def _without_am_advice(text: str) -> str:
    return "\n".join(ln for ln in text.splitlines()
                     if ln.strip() and not ln.startswith("hint:")
                     and not any(a in ln for a in _AM_ADVICE))


def import_series(series: Series, repo: Path) -> list[tuple[str, str | None]]:
    """Commit each patch of ``series`` on ``repo``'s current branch with ``git am -3``.

    Returns ``(patch name, new commit id)`` per patch, in series order; the commit is
    None when ``git am`` made none because HEAD already holds the patch (already imported).
    On failure runs ``git am --abort``, resets the branch to where it was and raises
    ``ImportStopped`` naming the patch, with git's own messages but not its advice to
    continue (the am is no longer in progress). Raises HistoryError if ``repo`` is not clean.
    """
    _require_clean(repo)
    before = run_git(["rev-parse", "HEAD"], repo).stdout.strip()
    ident = identity_args(repo)
    done: list[tuple[str, str | None]] = []
    head = before
    for patch in series.patches:
        proc = run_git([*ident, "am", "-3", "--quiet", str(patch.path.resolve())], repo, check=False)
        if proc.returncode != 0:
            run_git(["am", "--abort"], repo, check=False)
            run_git(["reset", "--hard", "--quiet", before], repo, check=False)
            detail = _without_am_advice(proc.stdout + "\n" + proc.stderr)
            raise ImportStopped(f"git am stopped on {patch.name}; the import was undone "
                                f"(git am --abort), {repo} is back at {before[:12]}"
                                + (f":\n{detail}" if detail else ""))
        new = run_git(["rev-parse", "HEAD"], repo).stdout.strip()
        done.append((patch.name, new if new != head else None))
        head = new
    return done


def export_series(repo: Path, base_ref: str, out_dir: Path) -> list[str]:
    """Write ``base_ref..HEAD`` of ``repo`` as ``NNNN-topic.diff`` files plus ``series``
    into ``out_dir`` (``git format-patch`` with FORMAT_PATCH_FLAGS).

    Diff files of the previous ``series`` in ``out_dir`` that are not produced again
    are removed; other files (``base.toml``) are kept. Returns the new file names.
    Raises HistoryError if the range is empty.
    """
    count = int(run_git(["rev-list", "--count", f"{base_ref}..HEAD"], repo).stdout.strip())
    if count == 0:
        raise HistoryError(f"no commits in {base_ref}..HEAD of {repo}")
    out_dir.mkdir(parents=True, exist_ok=True)
    old = read_series_names(out_dir) if (out_dir / "series").is_file() else []
    with tempfile.TemporaryDirectory(prefix="sglang-export-") as tmp:
        proc = run_git([*FORMAT_PATCH_CONFIG, "format-patch", *FORMAT_PATCH_FLAGS,
                        "-o", tmp, f"{base_ref}..HEAD"], repo, env=FORMAT_PATCH_ENV)
        names = [Path(line).name for line in proc.stdout.split()]
        for name in old:
            if name not in names and (out_dir / name).is_file():
                (out_dir / name).unlink()
        for name in names:
            shutil.copyfile(Path(tmp) / name, out_dir / name)
    (out_dir / "series").write_text("".join(n + "\n" for n in names), encoding="utf-8")
    return names


def rebase_series(repo: Path, onto: str, base_ref: str) -> RebaseResult:
    """``git rebase --onto ONTO BASE_REF`` (merge backend: 3-way merges) on ``repo``.

    On a conflict git's rebase is left in progress for a human to resolve; the
    result names the patch (commit subject) and the conflicted files. Hunks are
    never edited by this function. Raises HistoryError if the repo is not clean.
    """
    _require_clean(repo)
    ident = identity_args(repo)
    proc = run_git([*ident, "rebase", "--merge", "--onto", onto, base_ref], repo, check=False)
    if proc.returncode == 0:
        return RebaseResult(True, onto, message=proc.stdout.strip() or proc.stderr.strip())
    head = run_git(["rev-parse", "--verify", "--quiet", "REBASE_HEAD"], repo, check=False)
    subject = None
    if head.returncode == 0:
        subject = run_git(["log", "-1", "--format=%s", "REBASE_HEAD"], repo).stdout.strip()
    files = run_git(["diff", "--name-only", "--diff-filter=U"], repo).stdout.split()
    return RebaseResult(False, onto, subject, files, (proc.stdout + proc.stderr).strip())


def default_base_ref(repo: Path) -> str:
    """The nearest ``sglang-v*`` tag below HEAD (what ``checkout`` creates).
    Raises HistoryError when there is none."""
    try:
        return run_git(["describe", "--tags", "--abbrev=0", "--match", "sglang-v*", "HEAD"],
                       repo).stdout.strip()
    except GitError as exc:
        raise HistoryError(f"no sglang-v* tag below HEAD in {repo}; pass --base-ref") from exc
