"""The patched ``sglang.srt.server_args`` imports and parses the new flags.

The series is applied with the project's own tool to the pinned wheel's sources laid out
as a site-packages folder; SGLang's real argument parser (``prepare_server_args``) runs in
a subprocess that imports that patched copy first.
"""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, sys
from sglang.srt.server_args import prepare_server_args
import sglang.srt.server_args as sa
results = []
for args in json.loads(sys.argv[1]):
    out = {"file": sa.__file__}
    try:
        a = prepare_server_args(["--model-path", "dummy"] + args)
        out.update(ok=True, dir=a.dump_hidden_states_dir, layers=a.dump_hidden_states_layers,
                   max_mb=a.dump_hidden_states_max_host_mb, dtype=a.dump_hidden_states_dtype,
                   radix_off=a.disable_radix_cache,
                   prefill_graph_off=a.disable_prefill_cuda_graph)
    except (Exception, SystemExit) as e:
        out.update(ok=False, error=f"{type(e).__name__}: {e}")
    results.append(out)
print("RESULT " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def patched_site(wheel, tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel.path) as z:
        z.extractall(site)
    subprocess.run(
        [sys.executable, "-m", "sglang_ext", "patches", "apply", "--series",
         str(REPO / "patches" / "v0.5.17"), "--target", str(site)],
        check=True, cwd=REPO, capture_output=True,
    )
    return site


def parse_many(site, arg_lists):
    """Run SGLang's parser on each argument list in one subprocess (imports are slow)."""
    env = {"PYTHONPATH": f"{site}:{REPO}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(arg_lists)], env=env,
                          capture_output=True, text=True, timeout=900)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, f"probe crashed:\n{proc.stderr[-3000:]}"
    results = json.loads(line[-1][7:])
    for out in results:
        assert out["file"].startswith(str(site)), "imported an unpatched sglang"
    return results


@pytest.fixture(scope="module")
def parsed(patched_site, tmp_path_factory):
    """{case name: parse result} for every case below, from one subprocess."""
    good = tmp_path_factory.mktemp("hs")
    cases = {
        "good": ["--dump-hidden-states-dir", str(good), "--dump-hidden-states-layers", "2,16,29,32",
                 "--dump-hidden-states-max-host-mb", "512"],
        "fp8": ["--dump-hidden-states-dir", str(good), "--dump-hidden-states-dtype", "fp8"],
        "off": [],
    }
    for i, (args, _) in enumerate(BAD):
        if "--dump-hidden-states-dir" not in args:
            args = ["--dump-hidden-states-dir", str(good)] + args
        cases[f"bad{i}"] = args
    results = parse_many(patched_site, list(cases.values()))
    return {"dir": str(good), **dict(zip(cases, results))}


BAD = [
    (["--dump-hidden-states-dir", "/nonexistent/hs"], "does not exist; create it first"),
    (["--dump-hidden-states-layers", "2,2"], "duplicate layer ids [2]"),
    (["--dump-hidden-states-layers=-1,3"], "out of range"),
    (["--dump-hidden-states-layers", "0,3"], "out of range"),
    (["--dump-hidden-states-layers", "two"], "'two' is not an integer"),
    (["--dump-hidden-states-max-host-mb", "0"], "must be a positive integer"),
    (["--enable-return-hidden-states"], "cannot be combined with --enable-return-hidden-states"),
    (["--dump-hidden-states-dtype", "fp16"], "--dump-hidden-states-dtype: 'fp16' is not one of auto, bf16, fp8"),
]


def test_flags_parse_and_dumping_turns_off_radix_cache(parsed):
    out = parsed["good"]
    assert out["ok"], out
    assert out["dir"] == parsed["dir"] and out["layers"] == "2,16,29,32"
    assert out["max_mb"] == 512 and out["radix_off"] is True and out["prefill_graph_off"] is True
    assert out["dtype"] == "auto"  # the default: the model's dtype, as before the flag


def test_dtype_flag_parses(parsed):
    out = parsed["fp8"]
    assert out["ok"], out
    assert out["dtype"] == "fp8" and out["radix_off"] is True


def test_without_the_flag_nothing_changes(parsed):
    out = parsed["off"]
    assert out["ok"], out
    assert out["dir"] is None and out["radix_off"] is False


@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_values_give_clear_errors(parsed, i):
    out, message = parsed[f"bad{i}"], BAD[i][1]
    assert not out["ok"] and message in out["error"], out
