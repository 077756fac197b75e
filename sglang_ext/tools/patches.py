"""``python -m sglang_ext patches <verb>``: the patch series against SGLang.

Verbs: list, checkout, check, apply, revert, import, export, rebase, summary (see
docs/patches.md).
check, apply, revert and import without --series take the series made for the
target's SGLang version (and say so); with no such series, the newest.
The work is done in ``sglang_ext.tools.patchtool``; this module parses arguments,
calls it and prints the results. Every verb returns 0 on success, 1 when the
series does not fit / git stopped, 2 on bad input.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

from .patchtool.check import SeriesReport, apply_series, check_series, revert_series
from .patchtool.git import GitError, is_git_toplevel
from .patchtool.history import (HistoryError, ImportStopped, default_base_ref,
                                export_series, import_series, rebase_series)
from .patchtool.report import format_json, format_markdown, format_table
from .patchtool.series import (STATUSES, Series, SeriesError, default_patches_root,
                               known_series, load_base, load_series, newest_series,
                               pinned_base_for_version, resolve_series_dir, series_for_version,
                               series_status)
from .patchtool.tree import (Tree, TargetError, installed_tree, sglang_version, tree_for_dir,
                             tree_for_ref)
from .patchtool.wheel import (WheelError, WheelInfo, add_base_to_repo, base_tag,
                              cached_checkout, create_checkout, fetch_wheel, has_commits,
                              verify_wheel, wheel_version)

_VERSION_RE = re.compile(r"^v?\d+\.\d+(\.\d+)?([.\-+]?\w+)*$")


def _err(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)


def _wheel_from_args(args: argparse.Namespace) -> WheelInfo:
    """--wheel PATH | --version V | --base SERIES -> a verified wheel (downloaded if needed)."""
    if args.wheel:
        path = Path(args.wheel)
        if not path.is_file():
            raise WheelError(f"{path} does not exist")
        info = verify_wheel(path, pinned_base_for_version(wheel_version(path)))
    elif args.version:
        version = args.version.lstrip("v")
        info = fetch_wheel(version, pinned_base_for_version(version))
    else:
        series = load_series(resolve_series_dir(args.base))
        if series.base is None:
            raise SeriesError(f"{series.directory} has no base.toml; use --version or --wheel")
        info = fetch_wheel(series.base.version, series.base)
    if info.pinned:
        print(f"{info.path.name}: sha256 {info.sha256} matches base.toml")
    else:
        print(f"{info.path.name}: sglang {info.version} is not pinned by any base.toml; "
              f"sha256 {info.sha256} NOT verified")
    return info


def _cmd_list(args: argparse.Namespace) -> int:
    if not known_series():
        raise SeriesError(f"no patch series under {default_patches_root()} (a folder v<release> "
                          "holding a `series` file): run from a clone of the repository, or set "
                          "KIMI_SGLANG_PATCHES to its patches/ folder")
    if args.newest:
        dirs = [newest_series(args.status)]
    else:
        dirs = [d for d in known_series() if args.status is None or series_status(d) == args.status]
    for d in dirs:
        if args.names:
            print(d.name)
            continue
        base = load_base(d / "base.toml")
        evidence = f"  ({base.evidence})" if base.evidence else ""
        print(f"{d.name:<10} sglang {base.version:<8} s{base.series_version or '?':<4} "
              f"{series_status(d)}{evidence}")
    return 0


def _cmd_checkout(args: argparse.Namespace) -> int:
    info = _wheel_from_args(args)
    dest = Path(args.dir)
    if dest.is_dir() and is_git_toplevel(dest):
        if not has_commits(dest):
            raise WheelError(f"{dest} is a git repository without commits (an interrupted "
                             f"checkout?): remove it and run checkout again, or pass a new "
                             f"directory")
        commit = add_base_to_repo(info, dest)
        print(f"added base commit {commit[:12]} as tag {base_tag(info.version)} to {dest} "
              "(working tree untouched)")
    else:
        commit = create_checkout(info, dest)
        print(f"created {dest}: commit {commit[:12]} \"SGLang v{info.version} (PyPI wheel "
              f"sources)\", tag {base_tag(info.version)}")
    return 0


def _target(args: argparse.Namespace) -> Tree:
    if getattr(args, "against", None):
        return _against_tree(args.against, getattr(args, "repo", None))
    if args.target:
        return tree_for_dir(args.target)
    return installed_tree()


def _against_tree(spec: str, repo: str | None) -> Tree:
    """--against: a git ref (with --repo), a wheel file, a source dir, or a PyPI version."""
    if repo:
        if not Path(repo, ".git").exists():
            raise SeriesError(f"--repo {repo}: not a git checkout")
        return tree_for_ref(repo, spec)
    path = Path(spec)
    if path.is_file() and path.suffix == ".whl":
        info = verify_wheel(path, pinned_base_for_version(wheel_version(path)))
        return tree_for_dir(cached_checkout(info))
    if path.is_dir():
        return tree_for_dir(path)
    if _VERSION_RE.match(spec):
        version = spec.lstrip("v")
        base = pinned_base_for_version(version)
        info = fetch_wheel(version, base)
        if not info.pinned:
            print(f"note: sglang {version} is not pinned by any base.toml; sha256 not verified",
                  file=sys.stderr)
        return tree_for_dir(cached_checkout(info))
    raise TargetError(f"--against {spec!r}: not a wheel, directory or version "
                      "(for a git ref pass --repo CHECKOUT)")


def _print(report: SeriesReport, as_json: bool) -> None:
    print(format_json(report) if as_json else format_table(report))


def _pick_series(args: argparse.Namespace, tree: Tree) -> tuple[Series, str | None]:
    """--series if given; else the series made for the tree's SGLang version, else the
    newest. Returns the series and a note saying which was picked and why (None for --series)."""
    if args.series:
        return load_series(resolve_series_dir(args.series)), None
    version = sglang_version(tree)
    found = series_for_version(version) if version else None
    if found is not None:
        return load_series(found), (f"series {found.name} picked: it is made for sglang {version}, "
                                    "the target's version (--series picks another)")
    newest = resolve_series_dir(None)
    if version:
        known = ", ".join(d.name for d in known_series())
        why = f"no series is made for sglang {version} (known: {known})"
    else:
        why = "the target's sglang version is unknown"
    return load_series(newest), f"{why}; checked the newest series, {newest.name}"


def _series_arg(series: Series) -> str:
    d = series.directory
    if d.parent.resolve() == default_patches_root().resolve():
        return d.name
    return shlex.quote(str(d))


def _target_args(args: argparse.Namespace) -> str:
    if args.target:
        return f" --target {shlex.quote(args.target)}"
    if args.site_packages:
        return " --site-packages"
    return ""


def _way_back(args: argparse.Namespace, series: Series, tree: Tree) -> list[str]:
    """Notes on how to get a half-applied (or broken) tree back to the release."""
    notes = [f"to take the applied patches out again: python -m sglang_ext patches revert "
             f"--series {_series_arg(series)}{_target_args(args)}"]
    version = sglang_version(tree)
    if version and tree.installed:
        notes.append(f"or reinstall the release: {shlex.quote(sys.executable)} -m pip install "
                     f"--force-reinstall --no-deps sglang=={version}")
    elif tree.kind == "checkout" and (tree.root / ".git").exists():
        notes.append(f"or restore it with git: git -C {shlex.quote(str(tree.root))} checkout -- python/sglang")
    return notes


def _run_verb(args: argparse.Namespace, verb) -> int:
    # --series is read before the target is looked for: a wrong series path is named as
    # such (exit 2), also where SGLang is not installed.
    given = load_series(resolve_series_dir(args.series)) if args.series else None
    tree = _target(args)
    series, picked = (given, None) if given else _pick_series(args, tree)
    report = verb(series, tree)
    if picked:
        report.notes.insert(0, picked)
    if getattr(args, "against", None) and report.state in ("partial", "conflict"):
        report.notes.append("a failing patch is left out; later patches were checked "
                            "against the tree without it")
    if report.state == "partial" and not tree.ref:
        report.notes += _way_back(args, series, tree)
    _print(report, args.json)
    return 0 if report.ok else 1


def _cmd_check(args: argparse.Namespace) -> int:
    return _run_verb(args, check_series)


def _cmd_apply(args: argparse.Namespace) -> int:
    return _run_verb(args, apply_series)


def _cmd_revert(args: argparse.Namespace) -> int:
    return _run_verb(args, revert_series)


def _cmd_import(args: argparse.Namespace) -> int:
    repo = Path(args.dir)
    if not repo.is_dir() or not is_git_toplevel(repo):
        raise HistoryError(f"{repo} is not the top of a git checkout (make one with "
                           f"patches checkout)")
    if not has_commits(repo):
        raise HistoryError(f"{repo} is a git repository without commits (an interrupted "
                           f"checkout?): remove it and run patches checkout again")
    series, picked = _pick_series(args, None if args.series else tree_for_dir(repo))
    if picked:
        print(f"note: {picked.replace('checked the newest', 'imports the newest')}",
              file=sys.stderr)
    try:
        done = import_series(series, repo)
    except ImportStopped as exc:
        _err(str(exc))
        return 1
    for name, commit in done:
        print(f"{commit[:12] if commit else 'unchanged   '}  {name}")
    if all(commit is None for _, commit in done):
        print(f"series {series.name} is already imported on {repo}: nothing committed")
    elif any(commit is None for _, commit in done):
        print("the patches marked unchanged were already in HEAD (git am made no commit)")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    repo = Path(args.dir)
    base_ref = args.base_ref or default_base_ref(repo)
    names = export_series(repo, base_ref, Path(args.out))
    print(f"wrote {len(names)} patches ({base_ref}..HEAD) and series to {args.out}")
    for n in names:
        print(f"  {n}")
    if not (Path(args.out) / "base.toml").is_file():
        print(f"note: {args.out}/base.toml missing; add one pinning the base release")
    return 0


def _cmd_rebase(args: argparse.Namespace) -> int:
    repo = Path(args.dir)
    base_ref = args.base_ref or default_base_ref(repo)
    result = rebase_series(repo, args.onto, base_ref)
    if result.ok:
        print(f"rebased {base_ref}..HEAD onto {args.onto}; export with:\n"
              f"  python -m sglang_ext patches export {repo} --base-ref {args.onto} --out patches/vX")
        return 0
    print(f"rebase stopped: patch \"{result.conflict_patch}\" conflicts in:")
    for f in result.conflict_files:
        print(f"  {f}")
    if not result.conflict_files:
        print(result.message)
    print(f"resolve in {repo} with git (edit, git add, git rebase --continue) "
          "or give up with git rebase --abort")
    return 1


def _cmd_summary(args: argparse.Namespace) -> int:
    import json

    try:
        data = json.loads(Path(args.report).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SeriesError(f"cannot read report {args.report}: {exc}") from exc
    if not isinstance(data, dict) or "state" not in data:
        raise SeriesError(f"{args.report} is not a `patches check --json` report")
    print(format_markdown(data), end="")
    return 0 if data["state"] in ("clean", "applied") else 1


def _guard(func):
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except (SeriesError, TargetError, WheelError, HistoryError, FileExistsError,
                ValueError) as exc:
            _err(str(exc))
            return 2
        except GitError as exc:
            _err(str(exc))
            return 1
    return run


def add_parser(subparsers) -> None:
    """Add ``patches`` and its verbs to the top-level CLI's subparsers."""
    p = subparsers.add_parser("patches", help="check/apply/maintain the SGLang patch series",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = p.add_subparsers(dest="verb", required=True)

    ls = verbs.add_parser(
        "list", help="the series under patches/, oldest first, with their verification status",
        description="One line per series: folder, SGLang version, series version, status "
        f"({', '.join(STATUSES)}) and where its verification is recorded. Exit 2 when a "
        "base.toml lacks [series] status, or --newest finds no series with --status.")
    ls.add_argument("--status", choices=STATUSES, help="only the series with this status")
    ls.add_argument("--newest", action="store_true",
                    help="only the newest (version order) of those listed")
    ls.add_argument("--names", action="store_true",
                    help="folder names only (v0.5.17), one a line: for scripts")
    ls.set_defaults(func=_guard(_cmd_list))

    co = verbs.add_parser("checkout", help="make a git checkout of a pinned SGLang wheel's sources")
    src = co.add_mutually_exclusive_group()
    src.add_argument("--base", help="series folder or vX.Y.Z under patches/ (default: newest)")
    src.add_argument("--version", help="PyPI version (sha256 checked if a base.toml pins it)")
    src.add_argument("--wheel", help="a local sglang wheel")
    co.add_argument("dir", help="new directory; or an existing checkout to add the base as a tag")
    co.set_defaults(func=_guard(_cmd_checkout))

    for name, helptext, func in (
        ("check", "check the series against a tree (changes nothing)", _cmd_check),
        ("apply", "apply the whole series, or nothing", _cmd_apply),
        ("revert", "take the series' applied patches out again (git apply --reverse), "
                   "all or nothing; exit 0 when the tree ends without them", _cmd_revert),
    ):
        v = verbs.add_parser(name, help=helptext)
        v.add_argument("--series", help="series folder or vX.Y.Z (default: the series made for "
                       "the target's SGLang version, else the newest patches/v*)")
        where = v.add_mutually_exclusive_group()
        where.add_argument("--target", help="SGLang checkout, or directory holding sglang/")
        where.add_argument("--site-packages", action="store_true",
                           help="the installed sglang package (default)")
        if name == "check":
            where.add_argument("--against", help="PyPI version, wheel path, source dir, "
                               "or git ref (with --repo); base checkouts are cached")
            v.add_argument("--repo", help="checkout in which --against names a git ref")
        v.add_argument("--json", action="store_true", help="machine-readable output")
        v.set_defaults(func=_guard(func), against=None)

    im = verbs.add_parser("import", help="commit the series on a checkout (git am -3)")
    im.add_argument("--series", help="series folder or vX.Y.Z (default: the series made for "
                    "DIR's SGLang version, else the newest patches/v*)")
    im.add_argument("dir", help="a checkout made by patches checkout (clean, with commits)")
    im.set_defaults(func=_guard(_cmd_import))

    ex = verbs.add_parser("export", help="write BASE..HEAD as a series (git format-patch)")
    ex.add_argument("dir")
    ex.add_argument("--base-ref", help="the base commit (default: nearest sglang-v* tag)")
    ex.add_argument("--out", required=True, help="series folder to (re)write")
    ex.set_defaults(func=_guard(_cmd_export))

    sm = verbs.add_parser("summary", help="markdown summary of a `check --json` report "
                          "(exit 1 unless it is clean/applied)")
    sm.add_argument("report", help="JSON file written by check --json")
    sm.set_defaults(func=_guard(_cmd_summary))

    rb = verbs.add_parser("rebase", help="rebase the series commits onto a new base (3-way)")
    rb.add_argument("dir")
    rb.add_argument("--onto", required=True, help="new base ref (e.g. sglang-v0.5.18)")
    rb.add_argument("--base-ref", help="current base (default: nearest sglang-v* tag)")
    rb.set_defaults(func=_guard(_cmd_rebase))
