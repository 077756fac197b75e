"""Tests of ``python -m sglang_ext patches`` against the real v0.5.17 series and wheel.

Expectations are computed independently of sglang_ext.tools.patchtool: added lines
and hunk starts are read straight from the diff text, file lists from the
wheel's zip, per-patch outcomes from running git apply directly.
"""

from __future__ import annotations

import filecmp
import hashlib
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sglang_ext.__main__ import main

from conftest import REPO, SERIES_DIR, assert_rows_ready_at_hook, assert_warmup_named_before_post, fetch_wheel_or_skip

SCHED = "python/sglang/srt/managers/scheduler.py"


def cli(capsys, *args: str) -> tuple[int, str]:
    """Run the CLI in-process; return (exit code, stdout + stderr)."""
    capsys.readouterr()
    rc = main(["patches", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out + out.err


def cli_json(capsys, *args: str) -> tuple[int, dict]:
    """Run the CLI with --json; parse stdout alone (notes go to stderr)."""
    capsys.readouterr()
    rc = main(["patches", *map(str, args), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def git(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=check)


def tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under root (except .git)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and ".git" not in p.parts}


def diff_sections(diff: Path) -> dict[str, str]:
    """Map 'python/sglang/...' -> that file's part of a diff (plain regex split)."""
    parts = re.split(r"^diff --git a/(\S+) b/\S+$", diff.read_text(), flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def added_lines(diff: Path) -> dict[str, list[str]]:
    return {f: [ln[1:] for ln in body.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
            for f, body in diff_sections(diff).items()}


def hunk_starts(diff: Path, file: str) -> list[int]:
    return [int(m) for m in re.findall(r"^@@ -(\d+)", diff_sections(diff)[file], flags=re.M)]


def patch_files() -> list[Path]:
    return [SERIES_DIR / n for n in (SERIES_DIR / "series").read_text().split()]


def assert_series_in(root: Path, strip_python: bool) -> None:
    """Every line the series adds is present in the patched file."""
    for diff in patch_files():
        for file, lines in added_lines(diff).items():
            rel = file.removeprefix("python/") if strip_python else file
            text = (root / rel).read_text()
            for line in lines:
                assert line in text, f"{diff.name}: {line!r} missing from {rel}"


def clone(pristine: Path, dest: Path) -> Path:
    git(dest.parent, "clone", "-q", str(pristine), str(dest))
    return dest


def site_packages(wheel_path: Path, dest: Path) -> Path:
    """Fake site-packages: the wheel extracted by `python -m zipfile -e`."""
    subprocess.run([sys.executable, "-m", "zipfile", "-e", str(wheel_path), str(dest)], check=True)
    return dest


# ---------------------------------------------------------------- checkout

def test_checkout_is_wheel_sources_in_one_commit(capsys, wheel, tmp_path):
    dest = tmp_path / "co"
    rc, out = cli(capsys, "checkout", "--wheel", wheel.path, dest)
    assert rc == 0, out
    assert "matches base.toml" in out
    with zipfile.ZipFile(wheel.path) as zf:
        want = {"python/" + n for n in zf.namelist()
                if n.startswith("sglang/") and not n.endswith((".so", "/"))
                and "__pycache__" not in n}
        server_args = zf.read("sglang/srt/server_args.py")
    tracked = set(git(dest, "ls-files", "-z").stdout.split("\0")) - {""}
    assert tracked == want
    assert not list(dest.rglob("*.so"))
    assert (dest / "python/sglang/srt/server_args.py").read_bytes() == server_args
    log = git(dest, "log", "--format=%s").stdout.splitlines()
    assert log == ["SGLang v0.5.17 (PyPI wheel sources)"]


def test_checkout_refuses_wheel_with_wrong_sha(capsys, wheel, tmp_path):
    bad = tmp_path / wheel.path.name  # same name, so base.toml's pin applies
    data = bytearray(wheel.path.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    rc, out = cli(capsys, "checkout", "--wheel", bad, tmp_path / "co")
    assert rc != 0
    assert "sha256 mismatch" in out
    assert not (tmp_path / "co").exists()


@pytest.mark.parametrize("layout", ["new-dir-and-parent", "existing-empty-dir"])
def test_interrupted_checkout_leaves_nothing_it_made(capsys, wheel, tmp_path, monkeypatch, layout):
    """Ctrl-C while git commits the sources (KeyboardInterrupt from run_git, as a SIGINT
    would raise it there): exit 130 and only what was there before is left."""
    from sglang_ext.tools.patchtool import wheel as wheel_mod

    real = wheel_mod.run_git

    def interrupted(args, *a, **kw):
        if args[0] == "commit":
            raise KeyboardInterrupt
        return real(args, *a, **kw)

    monkeypatch.setattr(wheel_mod, "run_git", interrupted)
    if layout == "existing-empty-dir":
        dest = tmp_path / "co"
        dest.mkdir()
    else:
        dest = tmp_path / "made" / "co"
    rc, out = cli(capsys, "checkout", "--wheel", wheel.path, dest)
    assert rc == 130 and "interrupted" in out, out
    if layout == "existing-empty-dir":
        assert dest.is_dir() and list(dest.iterdir()) == []
    else:
        assert not (tmp_path / "made").exists()
    monkeypatch.setattr(wheel_mod, "run_git", real)
    rc, out = cli(capsys, "checkout", "--wheel", wheel.path, dest)  # the rerun makes it whole
    assert rc == 0, out
    assert git(dest, "log", "--format=%s").stdout.splitlines() == ["SGLang v0.5.17 (PyPI wheel sources)"]


def test_a_git_repo_without_commits_is_refused_by_checkout_and_import(capsys, wheel, tmp_path):
    """What an interrupted checkout of an older version left: .git, no commit, sources."""
    dest = tmp_path / "co"
    (dest / "python" / "sglang").mkdir(parents=True)
    (dest / "python" / "sglang" / "__init__.py").write_text("")
    git(dest, "init", "-q")
    for verb in (["checkout", "--wheel", wheel.path], ["import"]):
        rc, out = cli(capsys, *verb, dest)
        assert rc == 2, out
        assert f"error: {dest} is a git repository without commits (an interrupted checkout?)" in out
        assert "Traceback" not in out
    assert git(dest, "tag").stdout == ""  # checkout added no base tag
    (tmp_path / "afile").write_text("x")
    rc, out = cli(capsys, "checkout", "--wheel", wheel.path, tmp_path / "afile")
    assert rc == 2 and f"error: {tmp_path / 'afile'} exists and is not an empty directory" in out


# ---------------------------------------------------------------- check / apply

def test_series_checks_clean_and_applies_to_checkout(capsys, pristine, tmp_path):
    co = clone(pristine, tmp_path / "co")
    rc, report = cli_json(capsys, "check", "--series", SERIES_DIR, "--target", co)
    assert rc == 0, report
    assert report["state"] == "clean"
    assert [p["status"] for p in report["patches"]] == ["clean"] * len(patch_files())
    assert git(co, "status", "--porcelain").stdout == ""  # check changed nothing
    rc, out = cli(capsys, "check", "--series", SERIES_DIR, "--target", co)
    # an unpatched tree: the series would apply, it is not applied (it said CLEAN)
    assert rc == 0, out
    assert out.splitlines()[0].endswith(": APPLIES CLEANLY (not applied)"), out

    rc, out = cli(capsys, "apply", "--series", SERIES_DIR, "--target", co)
    assert rc == 0, out
    assert "dump_hidden_states_dir" in (co / "python/sglang/srt/server_args.py").read_text()
    assert_series_in(co, strip_python=False)
    changed = set(git(co, "diff", "--name-only").stdout.split())
    assert changed == {f for d in patch_files() for f in diff_sections(d)}


def test_series_applies_to_site_packages_and_twice_is_noop(capsys, wheel, tmp_path):
    sp = site_packages(wheel.path, tmp_path / "site-packages")
    rc, out = cli(capsys, "apply", "--series", SERIES_DIR, "--target", sp)
    assert rc == 0, out
    assert "dump_hidden_states_dir" in (sp / "sglang/srt/server_args.py").read_text()
    assert_series_in(sp, strip_python=True)
    assert_rows_ready_at_hook(sp / "sglang/srt/managers/scheduler_components/batch_result_processor.py")
    assert_warmup_named_before_post(sp / "sglang/srt/entrypoints/http_server.py")

    before = tree_hashes(sp)
    rc, out = cli(capsys, "apply", "--series", SERIES_DIR, "--target", sp)
    assert rc == 0, out
    assert "already applied" in out
    assert tree_hashes(sp) == before
    rc, report = cli_json(capsys, "check", "--series", SERIES_DIR, "--target", sp)
    assert rc == 0 and report["state"] == "applied"


def test_broken_tree_names_patch_file_hunk_and_changes_nothing(capsys, wheel, tmp_path):
    sp = site_packages(wheel.path, tmp_path / "sp")
    diff = next(d for d in patch_files() if d.name.startswith("0004-"))
    # Break the line that 0004's second scheduler.py hunk replaces.
    removed = [ln[1:] for ln in diff_sections(diff)[SCHED].splitlines()
               if ln.startswith("-") and not ln.startswith("---")]
    assert removed == ["            if batch.return_logprob or batch.return_hidden_states:"]
    target = sp / SCHED.removeprefix("python/")
    text = target.read_text()
    assert text.count(removed[0]) == 1
    target.write_text(text.replace(removed[0], removed[0] + "  # edited locally"))
    before = tree_hashes(sp)

    rc, report = cli_json(capsys, "check", "--series", SERIES_DIR, "--target", sp)
    assert rc == 1
    assert report["state"] == "conflict"
    statuses = {p["patch"][:4]: p for p in report["patches"]}
    others = [k for k in statuses if k != "0004"]
    assert len(others) == len(patch_files()) - 1
    assert [statuses[k]["status"] for k in others] == ["clean"] * len(others)
    fail = statuses["0004"]
    assert fail["status"] == "fails"
    line_of_hunk2 = hunk_starts(diff, SCHED)[1]
    assert [(f["file"], f["hunk"], f["line"]) for f in fail["failures"]] == [(SCHED, 2, line_of_hunk2)]

    rc, out = cli(capsys, "apply", "--series", SERIES_DIR, "--target", sp)
    assert rc == 1
    assert "0004" in out and "hunk 2 of " + SCHED in out
    assert tree_hashes(sp) == before  # not even 0001-0003 went in
    assert "dump_hidden_states_dir" not in (sp / "sglang/srt/server_args.py").read_text()


def test_partially_applied_series_is_reported(capsys, pristine, tmp_path):
    co = clone(pristine, tmp_path / "co")
    for d in patch_files()[:2]:
        git(co, "apply", str(d))
    before = tree_hashes(co)
    rc, report = cli_json(capsys, "apply", "--series", SERIES_DIR, "--target", co)
    assert rc == 1
    assert report["state"] == "partial"
    n = len(patch_files())
    assert [p["status"] for p in report["patches"]] == ["applied"] * 2 + ["not-applied"] * (n - 2)
    assert tree_hashes(co) == before


def newest_series_name() -> str:
    """The newest patches/v* by numeric version (computed here, not by the tool)."""
    names = [d.name for d in (SERIES_DIR.parent).glob("v*") if (d / "series").is_file()]
    return max(names, key=lambda n: tuple(int(x) for x in re.findall(r"\d+", n)))


def test_check_without_series_picks_the_targets_version(capsys, wheel, tmp_path):
    sp = site_packages(wheel.path, tmp_path / "sp")
    version = re.match(r"sglang-([\d.]+)-", wheel.path.name).group(1)  # from the file name
    assert version == "0.5.17" and newest_series_name() != "v0.5.17"  # so "newest" would be wrong
    rc, report = cli_json(capsys, "check", "--target", sp)
    assert rc == 0, report
    assert report["series"] == "v0.5.17" and report["state"] == "clean"
    assert report["notes"][0] == ("series v0.5.17 picked: it is made for sglang 0.5.17, "
                                  "the target's version (--series picks another)")
    rc, out = cli(capsys, "apply", "--target", sp)  # apply picks the same way
    assert rc == 0 and "series v0.5.17 picked" in out
    assert "dump_hidden_states_dir" in (sp / "sglang/srt/server_args.py").read_text()
    rc, report = cli_json(capsys, "check", "--target", sp)
    assert rc == 0 and report["state"] == "applied" and report["series"] == "v0.5.17"


def test_check_without_series_on_an_unknown_version_says_it_took_the_newest(capsys, wheel, tmp_path):
    sp = site_packages(wheel.path, tmp_path / "sp")
    version_py = sp / "sglang" / "_version.py"
    version_py.write_text(version_py.read_text().replace("'0.5.17'", "'9.9.9'"))
    for info in sp.glob("sglang-*.dist-info"):
        info.rename(sp / "not-a-dist-info")
    rc, report = cli_json(capsys, "check", "--target", sp)
    newest = newest_series_name()
    assert report["series"] == newest
    assert report["notes"][0].startswith("no series is made for sglang 9.9.9 (known: ")
    assert report["notes"][0].endswith(f"; checked the newest series, {newest}")
    assert rc == 1 and report["state"] == "conflict"  # 0.5.17 sources against the newest series


def test_check_without_anything_uses_the_installed_sglang(capsys):
    import importlib.metadata

    installed = importlib.metadata.version("sglang").split("+")[0]
    rc, report = cli_json(capsys, "check")
    assert report["target"].endswith("(site-packages, -p2)")
    picked = f"series v{installed} picked: it is made for sglang {installed}"
    assert report["notes"][0].startswith(picked)


def run_without_sglang(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """The CLI in a Python that cannot see any site-packages (python -S): no sglang, whatever
    this test process has installed; the project comes from PYTHONPATH; a series name
    (``vX.Y.Z``) is looked for in ``cwd``/patches."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(cwd),
           "KIMI_SGLANG_PATCHES": str(cwd / "patches")}
    return subprocess.run([sys.executable, "-S", "-m", "sglang_ext", "patches", *map(str, args)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("verb", ["apply", "revert", "check"])
def test_a_wrong_series_is_named_before_the_missing_sglang(tmp_path, verb):
    """A wrong --series is the user's first mistake: it is the one sentence (exit 2), also
    where SGLang is not installed (before, each said 'sglang is not installed')."""
    no_series = tmp_path / "not-a-series"
    no_series.mkdir()
    missing_diff = tmp_path / "missing-diff"
    missing_diff.mkdir()
    (missing_diff / "series").write_text("0001-gone.diff\n")
    bad_toml = tmp_path / "bad-toml"
    bad_toml.mkdir()
    (bad_toml / "series").write_text("")
    (bad_toml / "base.toml").write_text("[base]\nimage = 'x'\n")
    binary_series = tmp_path / "binary-series"  # not UTF-8: before, the decoder's words alone
    binary_series.mkdir()
    (binary_series / "series").write_bytes(b"0001-a.diff\n\xff\n")
    binary_diff = tmp_path / "binary-diff"
    binary_diff.mkdir()
    (binary_diff / "series").write_text("0001-a.diff\n")
    (binary_diff / "0001-a.diff").write_bytes(b"\x00\xff\xfe")
    empty = tmp_path / "empty"  # before: check said APPLIES CLEANLY, apply 'applied 0 patches', exit 0
    empty.mkdir()
    (empty / "series").write_text("# nothing yet\n\n")
    patches = tmp_path / "patches"  # KIMI_SGLANG_PATCHES: where a vX.Y.Z name is looked for
    (patches / "v9.9.9").mkdir(parents=True)
    cases = {
        "patches/nope": "error: series folder 'patches/nope' not found",
        "v9.9.9": f"error: {patches}/v9.9.9 is not a patch series folder: it has no `series` file",
        "9.9.9": f"error: {patches}/v9.9.9 is not a patch series folder: it has no `series` file",
        "nope": "error: series 'nope' not found under ",
        str(no_series): f"error: {no_series} is not a patch series folder: it has no `series` file",
        str(missing_diff): f"error: {missing_diff}/series lists 0001-gone.diff, which does not exist",
        str(bad_toml): f"error: {bad_toml}/base.toml: [base] version missing",
        str(binary_series): f"error: cannot read {binary_series}/series: 'utf-8' codec can't decode byte 0xff",
        str(binary_diff): f"error: cannot read patch {binary_diff}/0001-a.diff: 'utf-8' codec can't decode",
        str(empty): f"error: {empty}/series lists no patch",
    }
    for spec, sentence in cases.items():
        r = run_without_sglang(tmp_path, verb, "--series", spec)
        assert r.returncode == 2 and r.stderr.startswith(sentence), (spec, r.returncode, r.stderr)
        assert len(r.stderr.splitlines()) == 1 and "not installed" not in r.stderr, (spec, r.stderr)
    # The same Python with the real series: it is SGLang that is missing (the env lacks it).
    r = run_without_sglang(tmp_path, verb, "--series", SERIES_DIR)
    assert r.returncode == 2 and r.stderr == ("error: sglang is not installed in this Python "
                                              "(find_spec('sglang') is None)\n"), r.stderr


def test_partial_tree_offers_revert_and_revert_restores_the_release(capsys, pristine, tmp_path):
    co = clone(pristine, tmp_path / "co")
    for d in patch_files()[:2]:
        git(co, "apply", str(d))
    assert git(co, "status", "--porcelain").stdout != ""
    rc, out = cli(capsys, "check", "--target", co)
    assert rc == 1 and ": PARTIAL" in out
    assert f"note: to take the applied patches out again: python -m sglang_ext patches revert --series v0.5.17 --target {co}" in out
    assert f"note: or restore it with git: git -C {co} checkout -- python/sglang" in out

    rc, report = cli_json(capsys, "revert", "--target", co)
    assert rc == 0, report
    assert report["state"] == "clean" and report["changed"] is True
    assert report["notes"][1] == f"reverted 2 patches in {co} (0001, 0002)"
    assert git(co, "status", "--porcelain").stdout == ""  # byte-identical to the release again

    rc, out = cli(capsys, "revert", "--target", co)  # nothing left to take out
    assert rc == 0 and "nothing to revert" in out
    assert git(co, "status", "--porcelain").stdout == ""


def test_revert_of_one_patch_says_patch(capsys, pristine, tmp_path):
    co = clone(pristine, tmp_path / "co")
    git(co, "apply", str(patch_files()[0]))
    rc, out = cli(capsys, "revert", "--series", SERIES_DIR, "--target", co)
    assert rc == 0, out
    assert f"note: reverted 1 patch in {co} (0001)" in out, out  # was "1 patches"
    assert git(co, "status", "--porcelain").stdout == ""


def test_revert_of_a_fully_applied_site_packages(capsys, wheel, tmp_path):
    sp = site_packages(wheel.path, tmp_path / "sp")
    release = tree_hashes(sp)
    rc, out = cli(capsys, "apply", "--series", SERIES_DIR, "--target", sp)
    assert rc == 0, out
    assert tree_hashes(sp) != release
    rc, out = cli(capsys, "revert", "--series", SERIES_DIR, "--target", sp)
    assert rc == 0, out
    n = len(patch_files())
    assert f"reverted {n} patches" in out and ": APPLIES CLEANLY (not applied)" in out
    assert tree_hashes(sp) == release


def test_revert_refuses_a_conflicting_tree_and_changes_nothing(capsys, wheel, tmp_path):
    sp = site_packages(wheel.path, tmp_path / "sp")
    rc, _ = cli(capsys, "apply", "--series", SERIES_DIR, "--target", sp)
    assert rc == 0
    target = sp / "sglang/srt/server_args.py"
    text = target.read_text()
    line = next(ln for ln in text.splitlines() if "dump_hidden_states_dir" in ln)
    target.write_text(text.replace(line, line + "  # edited locally"))
    before = tree_hashes(sp)
    rc, out = cli(capsys, "revert", "--series", SERIES_DIR, "--target", sp)
    assert rc == 1 and ": CONFLICT" in out and "not reverted" in out
    assert tree_hashes(sp) == before


# ---------------------------------------------------------------- history

def test_import_then_export_is_byte_identical(capsys, pristine, tmp_path):
    co = clone(pristine, tmp_path / "co")
    git(co, "fetch", "-q", "--tags")
    rc, out = cli(capsys, "import", "--series", SERIES_DIR, co)
    assert rc == 0, out
    assert len(git(co, "rev-list", "sglang-v0.5.17..HEAD").stdout.split()) == len(patch_files())

    out_dir = tmp_path / "export"
    rc, out = cli(capsys, "export", co, "--base-ref", "sglang-v0.5.17", "--out", out_dir)
    assert rc == 0, out
    names = sorted(p.name for p in out_dir.iterdir())
    assert names == sorted(p.name for p in SERIES_DIR.iterdir() if p.name != "base.toml")
    match, mismatch, errors = filecmp.cmpfiles(SERIES_DIR, out_dir, names, shallow=False)
    assert (mismatch, errors) == ([], [])

    # The imported commits, read as a git ref, are the whole series: "applied".
    rc, report = cli_json(capsys, "check", "--series", SERIES_DIR, "--against", "HEAD", "--repo", co)
    assert rc == 0 and report["state"] == "applied"
    rc, report = cli_json(capsys, "check", "--series", SERIES_DIR, "--against", "HEAD~3", "--repo", co)
    assert rc == 1
    n = len(patch_files())
    assert [p["status"] for p in report["patches"]] == ["applied"] * (n - 3) + ["not-applied"] * 3


def test_import_without_series_picks_the_checkouts_version_and_twice_says_so(capsys, pristine,
                                                                             tmp_path):
    co = clone(pristine, tmp_path / "co")
    git(co, "fetch", "-q", "--tags")
    assert newest_series_name() != "v0.5.17"  # so "newest" would be wrong
    rc, out = cli(capsys, "import", co)
    assert rc == 0, out
    assert ("note: series v0.5.17 picked: it is made for sglang 0.5.17, the target's version "
            "(--series picks another)") in out
    subjects = git(co, "log", "--format=%s", "sglang-v0.5.17..HEAD").stdout.splitlines()[::-1]
    want = [re.search(r"^Subject: \[PATCH[^\]]*\] (.*)$", p.read_text(), re.M).group(1)
            for p in patch_files()]
    assert subjects == want
    head = git(co, "rev-parse", "HEAD").stdout
    rc, out = cli(capsys, "import", co)
    assert rc == 0, out
    assert f"series v0.5.17 is already imported on {co}: nothing committed" in out.splitlines()
    assert git(co, "rev-parse", "HEAD").stdout == head


def test_import_that_git_am_cannot_apply_exits_1_without_gits_continue_advice(capsys, pristine,
                                                                                tmp_path):
    co = clone(pristine, tmp_path / "co")
    first = patch_files()[0]
    target = next(iter(diff_sections(first)))  # a file the first patch changes
    (co / target).write_text("replaced\n")
    git(co, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "clash")
    head = git(co, "rev-parse", "HEAD").stdout
    rc, out = cli(capsys, "import", "--series", SERIES_DIR, co)
    assert rc == 1, out
    assert (f"error: git am stopped on {first.name}; the import was undone (git am --abort), "
            f"{co} is back at {head[:12]}") in out
    assert "--continue" not in out and "--skip" not in out and "hint:" not in out
    assert git(co, "rev-parse", "HEAD").stdout == head
    assert git(co, "status", "--porcelain").stdout == ""


def test_rebase_onto_identical_base_then_export_unchanged(capsys, pristine, tmp_path):
    co = clone(pristine, tmp_path / "co")
    git(co, "fetch", "-q", "--tags")
    assert cli(capsys, "import", "--series", SERIES_DIR, co)[0] == 0
    # A second base commit with the same tree but no shared history.
    new = git(co, "-c", "user.name=t", "-c", "user.email=t@t", "commit-tree",
              "sglang-v0.5.17^{tree}", "-m", "same sources").stdout.strip()
    git(co, "tag", "newbase", new)
    rc, out = cli(capsys, "rebase", co, "--onto", "newbase")
    assert rc == 0, out
    assert git(co, "rev-list", "--max-parents=0", "HEAD").stdout.strip() == new
    out_dir = tmp_path / "export"
    assert cli(capsys, "export", co, "--base-ref", "newbase", "--out", out_dir)[0] == 0
    names = [n for n in (SERIES_DIR / "series").read_text().split()] + ["series"]
    assert filecmp.cmpfiles(SERIES_DIR, out_dir, names, shallow=False)[1:] == ([], [])


# ---------------------------------------------------------------- neighbouring release (PyPI)

NEIGHBOUR = "0.5.16"


@pytest.fixture(scope="module")
def neighbour_wheel(cache_dir):
    """sglang NEIGHBOUR from PyPI; skips only when the registry cannot be reached."""
    return fetch_wheel_or_skip(NEIGHBOUR, None, cache_dir)


def git_apply_series_directly(tree: Path) -> dict[str, tuple[str, set]]:
    """Per patch, what plain `git apply --check -v` says on `tree` when the patches are
    applied in order and failing ones left out: (status, {(file, hunk)})."""
    out = {}
    for diff in patch_files():
        proc = git(tree, "apply", "--check", "-v", str(diff), check=False)
        failed = set()
        for file, line in re.findall(r"^error: patch failed: (\S+):(\d+)$", proc.stderr, flags=re.M):
            failed.add((file, hunk_starts(diff, file).index(int(line)) + 1))
        if proc.returncode == 0:
            git(tree, "apply", str(diff))
            status = "offset" if "(offset " in proc.stdout + proc.stderr else "clean"
        else:
            status = "fails"
        out[diff.name] = (status, failed)
    return out


@pytest.mark.network
def test_check_against_neighbouring_release_matches_git(capsys, neighbour_wheel, tmp_path):
    rc, report = cli_json(capsys, "check", "--series", SERIES_DIR, "--against", NEIGHBOUR)
    got = {p["patch"]: (p["status"], {(f["file"], f["hunk"]) for f in p["failures"]})
           for p in report["patches"]}

    tree = tmp_path / "plain"  # the wheel's sources, laid out without the tool
    with zipfile.ZipFile(neighbour_wheel.path) as zf:
        for n in zf.namelist():
            if n.startswith("sglang/") and not n.endswith("/") and not n.endswith(".so"):
                dest = tree / "python" / n
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(zf.read(n))
    git(tree, "init", "-q")  # so git apply treats paths relative to this directory
    want = git_apply_series_directly(tree)

    assert got == want
    any_fail = any(s == "fails" for s, _ in want.values())
    assert rc == (1 if any_fail else 0)
    if any_fail:
        assert report["state"] in ("conflict", "partial")


@pytest.mark.network
def test_rebase_onto_neighbour_stops_on_conflict(capsys, pristine, neighbour_wheel, tmp_path):
    co = clone(pristine, tmp_path / "co")
    git(co, "fetch", "-q", "--tags")
    assert cli(capsys, "import", "--series", SERIES_DIR, co)[0] == 0
    head = git(co, "rev-parse", "HEAD").stdout
    rc, out = cli(capsys, "checkout", "--wheel", neighbour_wheel.path, co)
    assert rc == 0, out
    assert git(co, "rev-parse", "HEAD").stdout == head  # only a tag was added
    tag = f"sglang-v{NEIGHBOUR}"
    rc, out = cli(capsys, "rebase", co, "--onto", tag)
    # Independent: where does git itself stop? (rebase state files + unmerged paths)
    unmerged = set(git(co, "diff", "--name-only", "--diff-filter=U").stdout.split())
    if rc == 0:
        assert not unmerged
        return
    assert rc == 1
    assert unmerged and all(f in out for f in unmerged)
    subject = git(co, "log", "-1", "--format=%s", "REBASE_HEAD").stdout.strip()
    assert f'patch "{subject}"' in out
    assert "git rebase --continue" in out
    git(co, "rebase", "--abort")
    assert git(co, "rev-parse", "HEAD").stdout == head


def test_a_downloaded_wheel_the_pins_refuse_is_not_cached(tmp_path, monkeypatch, series):
    """pip picks the wheel of the running Python; when base.toml does not pin that file
    the download is refused and removed, so the next run downloads again (a cached refused
    wheel would fail every later run the same way). A pinned download is kept."""
    import subprocess as sp

    from sglang_ext.tools.patchtool import wheel as wheel_mod
    from sglang_ext.tools.patchtool.wheel import WheelError, fetch_wheel

    payload = b"not the pinned bytes"
    calls = []

    def fake_pip(cmd, **kw):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / f"sglang-{series.base.version}-cp399-cp399-manylinux_2_34_x86_64.whl").write_bytes(payload)
        return sp.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(wheel_mod.subprocess, "run", fake_pip)
    for _ in range(2):
        with pytest.raises(WheelError, match="pins sglang .* but not this file"):
            fetch_wheel(series.base.version, series.base, tmp_path)
        assert list((tmp_path / "wheels").iterdir()) == []  # neither the wheel nor the temp dir
    assert len(calls) == 2  # downloaded again: nothing refused was cached
    unpinned = fetch_wheel(series.base.version, None, tmp_path)  # nothing pins: kept
    assert not unpinned.pinned and unpinned.path.parent == tmp_path / "wheels" and unpinned.path.read_bytes() == payload
