"""Running git: one helper that runs a git command and raises a readable error."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Mapping, Sequence

# Identity used for commits this tool makes itself (base checkouts, git am
# when the repository has no identity configured).
TOOL_NAME = "kimi-sglang"
TOOL_EMAIL = "maintainers@kimi-sglang.invalid"


class GitError(RuntimeError):
    """A git command exited non-zero; ``stderr`` holds git's own message."""

    def __init__(self, args: Sequence[str], returncode: int, stdout: str, stderr: str):
        self.args_list = list(args)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(
            f"git {' '.join(args)} failed ({returncode}): {stderr.strip() or stdout.strip()}"
        )


def run_git(
    args: Sequence[str],
    cwd: Path | str,
    *,
    check: bool = True,
    env: Mapping[str, str] | None = None,
    isolate: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``git ARGS`` in ``cwd`` and return the completed process (text output).

    ``env`` adds variables to the environment. ``isolate=True`` stops git from
    discovering a repository above ``cwd`` (``GIT_CEILING_DIRECTORIES``), so that
    ``git apply`` in a plain directory (site-packages inside a venv inside some
    repository) treats paths relative to ``cwd``. Messages are forced to English
    (``LC_ALL=C``) because callers parse them.

    Raises ``GitError`` when ``check`` is true and git exits non-zero.
    """
    full_env = dict(os.environ)
    full_env["LC_ALL"] = "C"
    full_env["LANGUAGE"] = "C"
    if isolate:
        full_env["GIT_CEILING_DIRECTORIES"] = str(Path(cwd).resolve().parent)
    if env:
        full_env.update(env)
    proc = subprocess.run(
        ["git", *args],
        cwd=str(cwd),
        env=full_env,
        capture_output=True,
        text=True,
    )
    if check and proc.returncode != 0:
        raise GitError(args, proc.returncode, proc.stdout, proc.stderr)
    return proc


def identity_args(repo: Path) -> list[str]:
    """Return ``-c user.name=... -c user.email=...`` when ``repo`` has no identity set.

    Lets git am / commit work on a fresh machine without changing anyone's config.
    """
    have = run_git(["config", "user.email"], repo, check=False).stdout.strip()
    if have:
        return []
    return ["-c", f"user.name={TOOL_NAME}", "-c", f"user.email={TOOL_EMAIL}"]


def is_git_toplevel(path: Path) -> bool:
    """True when ``path`` is the top directory of a git working tree."""
    proc = run_git(["rev-parse", "--show-toplevel"], path, check=False)
    return proc.returncode == 0 and Path(proc.stdout.strip()).resolve() == path.resolve()
