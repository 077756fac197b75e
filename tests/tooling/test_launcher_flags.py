"""Every SGLang command line the GPU suite and the benchmark start parses with SGLang's
own argument parser (``ServerArgs.add_cli_args``) of each series' patched release.
Argument parsing only: what follows (``ServerArgs.__post_init__``) wants an accelerator
for these command lines, and the dump flags' checks have their own tests
(test_server_args.py, test_nightly.py).

The launcher spells some flags by the installed release (``--cuda-graph-max-bs`` became an
ambiguous prefix in 0.5.22), so the command lines are built inside the probe, where the
patched copy of that release is the importable ``sglang``. A flag a release does not
know fails here, on the CPU, not at a GPU server's start-up.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SERIES_DIRS

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from testing import server as gpu_server
from bench import cli, servers
import argparse, contextlib, io
from sglang.srt.server_args import ServerArgs
import sglang.srt.server_args as sa

lines = {}
for tag, opts in [("suite-tp1", gpu_server.ServerOptions()),
                  ("suite-tp2-dpattn-eager-fp8",
                   gpu_server.ServerOptions(tp=2, dp_attention=True, cuda_graph=False, dump_dtype="fp8"))]:
    lines[tag] = gpu_server.server_command("/m", sys.argv[2] + "/d", "1,3,4", "direct", opts, python="py")
args = cli.build_parser().parse_args(["--models", "llama-mid", "--modes", "nodump,dump,dump_fp8,json",
                                      "--dump-root", sys.argv[2]])
for which in ("A", "B", "D"):
    lines[f"bench-{which}"] = servers.server_cmd(args, "llama-mid", which)
out = {"file": sa.__file__, "results": {}}
for tag, cmd in lines.items():
    assert cmd[1:3] == ["-m", "sglang.launch_server"] or cmd[1:3] == ["-m", "sglang_ext.tools.entrypoint"], cmd
    argv = cmd[3:]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            a = parser.parse_args(argv)
        out["results"][tag] = {"ok": True, "argv": argv, "dump_dir": a.dump_hidden_states_dir}
    except SystemExit:
        out["results"][tag] = {"ok": False, "argv": argv, "error": err.getvalue().strip().splitlines()[-1]}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("series_dir", SERIES_DIRS, ids=lambda d: d.name)
def test_suite_and_bench_command_lines_parse(series_dir, patched_site, tmp_path):
    site = patched_site(series_dir)
    env = {"PYTHONPATH": f"{site}:{REPO}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", PROBE, str(REPO), str(tmp_path)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, f"probe crashed:\n{proc.stderr[-3000:]}"
    out = json.loads(line[-1][7:])
    assert out["file"].startswith(str(site)), "imported an unpatched sglang"
    results = out["results"]
    assert len(results) == 5
    bad = {tag: r["error"] for tag, r in results.items() if not r["ok"]}
    assert not bad, bad
    assert results["suite-tp1"]["dump_dir"] == str(tmp_path / "d")
    assert results["bench-A"]["dump_dir"] is None and results["bench-B"]["dump_dir"]
    graph_flag = "--cuda-graph-max-bs-decode" if (site / "sglang" / "srt" / "arg_groups" /
                                                  "cuda_graph_hook.py").is_file() else "--cuda-graph-max-bs"
    assert graph_flag in results["suite-tp1"]["argv"] and graph_flag in results["bench-B"]["argv"]
