"""Findings of a new user's review of ``extract`` (directory sink, one server or a router's
workers): each test states what a user expects.

The server is tests/integration/test_client.py's ``FakeServer`` (real files written through
``sglang_ext.format``); what the client should do comes from docs/client.md and docs/fleet.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

from test_client import FakeServer, rows, write_jsonl

from sglang_ext import format as fmt
from sglang_ext.client.extract import EXIT_ABORTED, EXIT_BAD_INPUT
from sglang_ext.client.manifest import MANIFEST_NAME

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _extract(*argv):
    from sglang_ext.__main__ import main  # noqa: PLC0415

    return main(["extract", "--no-progress", *map(str, argv)])


def test_a_summary_path_that_cannot_be_written_is_refused_before_any_request(tmp_path, capsys):
    """``--summary`` into a directory that does not exist: exit 2 with one sentence before
    a request is sent, as for an ``--out`` that cannot be written (not the whole dataset
    sent, then the summary lost)."""
    server = FakeServer(tmp_path / "dump")
    try:
        rc = _extract("--endpoint", server.url, "--data", write_jsonl(tmp_path / "d.jsonl", rows(4)),
                      "--out", tmp_path / "out", "--summary", tmp_path / "no-such-dir" / "summary.json")
        sent = sum(server.counts.values())
    finally:
        server.close()
    err = capsys.readouterr().err
    assert rc == EXIT_BAD_INPUT, f"exit {rc}, {sent} request(s) sent; stderr: {err[-500:]}"
    assert sent == 0, f"{sent} request(s) sent before --summary was refused"
    assert "--summary" in err


def test_a_summary_path_naming_data_or_a_file_extract_writes_is_refused(tmp_path, capsys):
    """``--summary`` is written last, renamed over whatever has its name: before, a summary
    named as DATA replaced the dataset, one named as OUT's manifest or an ``hs_<i>``
    replaced it with JSON (a final name holding no sample). Now exit 2 before any request,
    the file unchanged; a summary file of its own, in OUT too, is written and rewritten."""
    server = FakeServer(tmp_path / "dump")
    data = write_jsonl(tmp_path / "d.jsonl", rows(3))
    out = tmp_path / "out"
    args = ("--endpoint", server.url, "--data", data, "--out", out)
    try:
        assert _extract(*args, "--summary", out / "summary.json") == 0
        assert _extract(*args, "--summary", out / "summary.json") == 0  # its own earlier summary
        assert json.loads((out / "summary.json").read_text())["resumed"] == 3
        capsys.readouterr()
        sent = sum(server.counts.values())
        for target, says in ((data, "exists and is not an extract summary"),
                             (out / MANIFEST_NAME, "is a name extract writes in --out"),
                             (out / "hs_1.safetensors", "is a name extract writes in --out"),
                             (out / "hs_7.safetensors", "is a name extract writes in --out")):
            before = {p: p.read_bytes() for p in [tmp_path / "d.jsonl", *out.iterdir()]}
            rc = _extract(*args, "--summary", target)
            err = capsys.readouterr().err
            assert rc == EXIT_BAD_INPUT, f"--summary {target}: exit {rc}; {err[-500:]}"
            assert err == f"error: --summary {target} {says}: the summary would replace it; name another file\n"
            assert {p: p.read_bytes() for p in [tmp_path / "d.jsonl", *out.iterdir()]} == before, target
        assert sum(server.counts.values()) == sent, "a row was sent"
    finally:
        server.close()


def test_an_answer_in_a_visible_directory_missing_from_dump_dir_stops_the_run(tmp_path, capsys):
    """A router's worker writes to a directory this machine sees but ``--dump-dir`` does not
    name (one server's directory forgotten): the run stops (exit 3) with one sentence
    naming the directory to add with ``--dump-dir``, as it does for a directory this
    machine does not see, instead of retrying every such row and leaving a file per try in
    the server's directory (RAM under /dev/shm); the rerun with it added sweeps what the
    stopped run's tries left."""
    given, other = tmp_path / "s0", tmp_path / "s1"
    given.mkdir()
    server = FakeServer(other)
    data = write_jsonl(tmp_path / "d.jsonl", rows(3))
    try:
        rc = _extract("--endpoint", server.url, "--data", data, "--concurrency", "2",
                      "--out", tmp_path / "out", "--dump-dir", given, "--max-retries", "2",
                      "--backoff", "0.01", "--max-backoff", "0.01")
        err = capsys.readouterr().err
        left = [n for n in os.listdir(other) if n.endswith(fmt.SUFFIX)]
        assert rc == EXIT_ABORTED, f"exit {rc}; {len(left)} file(s) left in {other}; stderr: {err[-500:]}"
        assert f"--dump-dir {other}" in err, err[-500:]
        # no retries: only first tries (rid extract-<row>-0-...) sent before the stop left a file
        assert all(n.split("-")[2] == "0" for n in left), f"retried tries left files in {other}: {left}"
        # the sentence's fix: the rerun with the directory added removes them and finishes
        rc = _extract("--endpoint", server.url, "--data", data, "--out", tmp_path / "out",
                      "--dump-dir", given, "--dump-dir", other)
    finally:
        server.close()
    assert rc == 0, capsys.readouterr().err[-500:]
    assert not [n for n in os.listdir(other) if n.endswith(fmt.SUFFIX)]


def test_two_runs_on_one_out_and_rank_do_not_both_write_the_manifest(tmp_path):
    """One run per rank and --out at a time: of two runs started together (a requeued
    Slurm job whose first copy still runs, a Job pod restarted beside its predecessor) the
    second refuses (exit 3, one sentence) while the first holds OUT, and the manifest has
    one line per row (not every index twice)."""
    server = FakeServer(tmp_path / "dump")
    server.delay = 0.02
    data = rows(60)
    path = write_jsonl(tmp_path / "d.jsonl", data)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "sglang_ext", "extract", "--endpoint", server.url, "--data", path,
           "--out", str(out), "--no-progress", "--concurrency", "2"]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(2)]
        results = [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    finally:
        server.close()
    codes = sorted(r[2] for r in results)
    with open(out / MANIFEST_NAME) as f:
        counts = Counter(json.loads(line)["index"] for line in f)
    twice = sorted(i for i, c in counts.items() if c > 1)
    assert not twice, f"{len(twice)} of {len(data)} rows in the manifest more than once (exits {codes})"
    assert codes == [0, EXIT_ABORTED], codes
    assert any("one run per rank and --out at a time" in r[1] for r in results), [r[1][-300:] for r in results]
