"""Drift checks: every series against its pinned base, and v0.5.23 against a neighbour.

- Each ``patches/v*/`` series applies cleanly (no offsets) to the sources of the wheel
  its base.toml pins (sha256-checked), and base.toml is complete.
- The v0.5.23 series checked against the neighbouring release 0.5.22 by the tool
  (``patches check --against 0.5.22 --json``) reports per patch exactly what plain
  ``git apply --check -v`` says on the wheel's sources laid out by hand.
- SGLang 0.5.23 with the series applied: its real argument parser and resolution
  pipeline parse the new flags and take our decisions (radix cache, prefill graph).

Wheels (~35-40 MB each) are downloaded once into ``$KIMI_SGLANG_CACHE/wheels``
(default ~/.cache/kimi-sglang), and base checkouts are built once into
``checkouts/`` there, so later runs are offline and take seconds. Tests marked
``network`` skip only when PyPI cannot be reached.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sglang_ext.__main__ import main
from sglang_ext.tools.patchtool.series import load_series
from sglang_ext.tools.patchtool.wheel import sha256_of

from conftest import assert_rows_ready_at_hook, assert_warmup_named_before_post, fetch_wheel_or_skip

REPO = Path(__file__).resolve().parents[2]
# Read at import time: conftest's session fixture points KIMI_SGLANG_CACHE at a
# temporary folder later; these downloads should persist between runs.
CACHE = Path(os.environ.get("KIMI_SGLANG_CACHE") or Path.home() / ".cache" / "kimi-sglang")
SERIES_DIRS = sorted(p for p in (REPO / "patches").glob("v*") if (p / "series").is_file())
V23 = REPO / "patches" / "v0.5.23"
NEIGHBOUR = "0.5.22"
# The neighbour is pinned by no base.toml; pin it here so the drift test's input is fixed.
NEIGHBOUR_SHA256 = {
    "sglang-0.5.22-cp311-cp311-manylinux_2_34_x86_64.whl":
        "cc9a0f15bd8f877a0584fdb7a1702240177a1f1cc8d17c978715161717b9037b",
    "sglang-0.5.22-cp312-cp312-manylinux_2_34_x86_64.whl":
        "3505e3744366201296f94d244b3e7d3b0bb91b69726dc15e994070adb338ea2f",
}


@pytest.fixture
def persistent_cache(monkeypatch):
    monkeypatch.setenv("KIMI_SGLANG_CACHE", str(CACHE))
    return CACHE


def get_wheel(version, base):
    return fetch_wheel_or_skip(version, base, CACHE)


def cli_json(capsys, *args) -> tuple[int, dict]:
    capsys.readouterr()
    rc = main(["patches", *map(str, args), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def git(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=check)


def plain_tree(wheel: Path, dest: Path) -> Path:
    """The wheel's sglang/ sources under dest/python/, laid out without the tool."""
    with zipfile.ZipFile(wheel) as zf:
        for n in zf.namelist():
            if n.startswith("sglang/") and not n.endswith(("/", ".so")) and "__pycache__" not in n:
                out = dest / "python" / n
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(zf.read(n))
    git(dest, "init", "-q")
    return dest


def hunk_starts(diff: Path, file: str) -> list[int]:
    parts = re.split(r"^diff --git a/(\S+) b/\S+$", diff.read_text(), flags=re.M)
    body = dict(zip(parts[1::2], parts[2::2]))[file]
    return [int(m) for m in re.findall(r"^@@ -(\d+)", body, flags=re.M)]


def git_apply_each(series_dir: Path, tree: Path) -> dict[str, tuple[str, set]]:
    """Per patch, in order, what `git apply --check -v` says; failing ones are left out."""
    out = {}
    for name in (series_dir / "series").read_text().split():
        diff = series_dir / name
        proc = git(tree, "apply", "--check", "-v", str(diff), check=False)
        failed = {(f, hunk_starts(diff, f).index(int(line)) + 1)
                  for f, line in re.findall(r"^error: patch failed: (\S+):(\d+)$", proc.stderr, flags=re.M)}
        if proc.returncode == 0:
            git(tree, "apply", str(diff))
            status = "offset" if "(offset " in proc.stdout + proc.stderr else "clean"
        else:
            status = "fails"
        out[name] = (status, failed)
    return out


# ---------------------------------------------------------------- pinned bases

@pytest.mark.parametrize("series_dir", SERIES_DIRS, ids=lambda p: p.name)
def test_base_toml_is_complete(series_dir):
    base = load_series(series_dir).base
    v = base.version
    assert series_dir.name == f"v{v}"
    assert base.image == f"lmsysorg/sglang:v{v}-cu130" and base.git_tag == f"v{v}"
    pinned = lambda tags: {f"sglang-{v}-cp{t}-cp{t}-manylinux_2_34_x86_64.whl" for t in tags}  # noqa: E731
    # 3.11 (CI, the stand-in image) and 3.12 (the GPU image) always; 3.13 where SGLang ships it
    assert pinned((311, 312)) <= set(base.wheels) <= pinned((311, 312, 313))
    assert all(re.fullmatch(r"[0-9a-f]{64}", s) for s in base.wheels.values())
    assert base.series_version


@pytest.mark.network
@pytest.mark.parametrize("series_dir", SERIES_DIRS, ids=lambda p: p.name)
def test_series_applies_cleanly_to_its_pinned_base(capsys, persistent_cache, series_dir):
    assert_applies_cleanly(capsys, series_dir)


def assert_applies_cleanly(capsys, series_dir) -> None:
    """``patches check --against`` the series' pinned wheel (sha256 checked): every patch clean."""
    series = load_series(series_dir)
    info = get_wheel(series.base.version, series.base)
    assert info.pinned, "the wheel used must match base.toml's sha256"
    rc, report = cli_json(capsys, "check", "--series", series_dir, "--against", series.base.version)
    assert rc == 0 and report["state"] == "clean", report
    assert [p["status"] for p in report["patches"]] == ["clean"] * len(series.patches)


# ---------------------------------------------------------------- neighbour release

@pytest.mark.network
def test_v0523_against_neighbour_matches_git(capsys, persistent_cache, tmp_path):
    info = get_wheel(NEIGHBOUR, None)
    assert NEIGHBOUR_SHA256.get(info.path.name) == info.sha256 == sha256_of(info.path)
    rc, report = cli_json(capsys, "check", "--series", V23, "--against", NEIGHBOUR)
    got = {p["patch"]: (p["status"], {(f["file"], f["hunk"]) for f in p["failures"]})
           for p in report["patches"]}
    want = git_apply_each(V23, plain_tree(info.path, tmp_path / "plain"))
    assert got == want

    # What 0.5.22 is known to give (a fixed release, so this is stable): 0.5.23 grew
    # the aux-capture fields next to which 0001 declares ours, and reordered
    # model_runner's imports; 0002/0004/0005 apply at offsets. 0.5.23 also grew
    # http_server's imports (uvicorn's Multiprocess, load_pointer_head) around 0007's, and
    # serving_chat's imports around 0008's.
    failing = {k[:4]: v[1] for k, v in want.items() if v[0] == "fails"}
    assert failing == {
        "0001": {("python/sglang/srt/arg_groups/fields/exec_.py", 1),
                 ("python/sglang/srt/arg_groups/pipeline.py", 1)},
        "0003": {("python/sglang/srt/model_executor/model_runner.py", 1)},
        "0007": {("python/sglang/srt/entrypoints/http_server.py", 1)},
        "0008": {("python/sglang/srt/entrypoints/openai/serving_chat.py", 1)},
    }
    assert rc == 1 and report["state"] == "conflict"
    assert report["patches"][2]["note"] == "checked without 0001"


# ---------------------------------------------------------------- SGLang 0.5.23 parses the flags

PROBE = r"""
import json, sys
from sglang.srt.server_args import prepare_server_args
import sglang.srt.server_args as sa
out = {"file": sa.__file__}
try:
    a = prepare_server_args(["--model-path", "dummy"] + json.loads(sys.argv[1]))
    a.resolve_once()
    r = a.resolved_dict()
    out.update(ok=True, dir=r["dump_hidden_states_dir"], layers=r["dump_hidden_states_layers"],
               max_mb=r["dump_hidden_states_max_host_mb"], dtype=r["dump_hidden_states_dtype"],
               radix_off=r["disable_radix_cache"],
               prefill_graph_off=r["disable_prefill_cuda_graph"], raw_radix=a.disable_radix_cache)
except Exception as e:
    out.update(ok=False, error=f"{type(e).__name__}: {e}")
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def site23(tmp_path_factory):
    base = load_series(V23).base
    info = get_wheel(base.version, base)
    site = tmp_path_factory.mktemp("site23")
    with zipfile.ZipFile(info.path) as z:
        z.extractall(site)
    proc = subprocess.run([sys.executable, "-m", "sglang_ext", "patches", "apply", "--series", str(V23),
                           "--target", str(site)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return site


def parse23(site, args):
    env = {"PYTHONPATH": f"{site}:{REPO}", "PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, f"probe crashed:\n{proc.stderr[-3000:]}"
    out = json.loads(line[-1][7:])
    assert out["file"].startswith(str(site)), "imported another sglang"
    return out


@pytest.mark.network
def test_v0523_hook_sees_finished_rows(site23):
    assert_rows_ready_at_hook(site23 / "sglang/srt/managers/scheduler_components/batch_result_processor.py")


@pytest.mark.network
def test_v0523_warmup_request_is_named_before_it_is_sent(site23):
    assert_warmup_named_before_post(site23 / "sglang/srt/entrypoints/http_server.py")


@pytest.mark.network
def test_v0523_flags_parse_and_resolution_takes_our_decisions(site23, tmp_path):
    out = parse23(site23, ["--dump-hidden-states-dir", str(tmp_path), "--dump-hidden-states-layers",
                           "2,16,29,32", "--dump-hidden-states-max-host-mb", "512",
                           "--dump-hidden-states-dtype", "fp8"])
    assert out["ok"], out
    assert out["dir"] == str(tmp_path) and out["layers"] == "2,16,29,32" and out["max_mb"] == 512
    assert out["dtype"] == "fp8"
    # Declared through declare_resolution: resolved on, the operator's input untouched.
    assert out["radix_off"] is True and out["prefill_graph_off"] is True and out["raw_radix"] is False


@pytest.mark.network
def test_v0523_without_the_flag_nothing_changes(site23):
    out = parse23(site23, [])
    assert out["ok"], out
    assert out["dir"] is None and out["radix_off"] is False


@pytest.mark.network
@pytest.mark.parametrize("args, message", [
    (["--dump-hidden-states-dir", "/nonexistent/hs"], "does not exist; create it first"),
    (["--dump-hidden-states-layers", "2,2"], "duplicate layer ids [2]"),
    (["--dump-hidden-states-dtype", "fp16"], "--dump-hidden-states-dtype: 'fp16' is not one of"),
    (["--enable-return-hidden-states"], "cannot be combined with --enable-return-hidden-states"),
    (["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3"],
     ", --enable-return-aux-hidden-states (not supported"),
])
def test_v0523_bad_values_give_clear_errors(site23, tmp_path, args, message):
    if "--dump-hidden-states-dir" not in args:
        args = ["--dump-hidden-states-dir", str(tmp_path)] + args
    out = parse23(site23, args)
    assert not out["ok"] and message in out["error"], out


def test_a_failed_download_says_why_in_a_few_lines():
    """pip's "(from versions: ...)" lists every release of SGLang (160 of them): the error
    keeps pip's ERROR lines with the newest five versions and the count."""
    from sglang_ext.tools.patchtool.wheel import pip_error

    versions = ", ".join(f"0.{i // 10}.{i % 10}" for i in range(40))
    stderr = ("WARNING: Location 'file:///opt/pypi/simple/sglang/' is ignored\n"
              f"ERROR: Could not find a version that satisfies the requirement sglang==9.9.99 (from versions: {versions})\n"
              "ERROR: No matching distribution found for sglang==9.9.99\n")
    assert pip_error(stderr) == (
        "ERROR: Could not find a version that satisfies the requirement sglang==9.9.99 "
        "(newest: 0.3.5, 0.3.6, 0.3.7, 0.3.8, 0.3.9; 40 versions in all)\n"
        "ERROR: No matching distribution found for sglang==9.9.99")
    assert pip_error("network down\n") == "network down"
    short = "ERROR: Could not find a version that satisfies the requirement x (from versions: 1.0, 1.1)"
    assert pip_error(short) == short
