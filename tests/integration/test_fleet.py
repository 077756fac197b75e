"""``extract`` through SGLang's real router (sglang-router 0.3.2) in front of three fake dump
servers, each a process of its own writing real files into its own directory (one filesystem,
shared with the client): one server is SIGKILLed mid-run, then the client itself.

The servers are tests/integration/test_client.py's ``FakeServer`` (files written through
``sglang_ext.format``'s reserve -> write -> complete), run by tests/router_fixture.py. What
each ``hs_<i>`` must hold comes from test_client's ``reference`` (token id, position, layer
slot, channel), never from the client. The router's flags are ``router_fixture.ROUTER_FLAGS``
(the recipe's health checks, circuit breaker and retries, at test speed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from router_fixture import ROUTER_FLAGS, DumpServer, Router, needs_router
from test_client import FakeServer, assert_file, hs_indices, rows, write_jsonl

from sglang_ext import format as fmt
from sglang_ext.client.extract import EXIT_ABORTED
from sglang_ext.client.manifest import MANIFEST_NAME

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 300


def _three_behind_a_router(tmp_path, *flags):
    """Three fake servers (dump dirs ``dumps/s<k>``, 20 ms per answer) behind the router
    (``flags``: its command line, ``ROUTER_FLAGS`` when none); yields (router, servers)."""
    servers = [DumpServer(tmp_path / "dumps" / f"s{k}", tmp_path / f"server{k}.log", delay=0.02)
               for k in range(3)]
    router = None
    try:
        for s in servers:
            s.started()
        router = Router([s.url for s in servers], tmp_path / "router.log", *flags)
        yield router, servers
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            s.kill()


@pytest.fixture
def fleet_one(tmp_path):
    """Three fake servers behind the router with ``ROUTER_FLAGS``."""
    yield from _three_behind_a_router(tmp_path)


def extract_cmd(url, data, out, *extra):
    return [sys.executable, "-m", "sglang_ext", "extract", "--endpoint", url, "--data", str(data),
            "--out", str(out), "--no-progress", "--concurrency", "6", "--backoff", "0.2",
            "--max-backoff", "1", "--timeout", "30", *map(str, extra)]


def run_until(cmd, out, n_files, act, timeout=120):
    """Start ``cmd``; once OUT holds ``n_files`` results call ``act(proc)``; returns the
    finished process' (returncode, stdout, stderr)."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and len(hs_indices(out)) >= n_files:
            act(proc)
            break
        time.sleep(0.01)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"extract did not finish: {stderr[-3000:]}")
    return proc.returncode, stdout, stderr


def assert_exact(out, data, journal_ok=False):
    """Every row once: one manifest line per index, one hs_<i> per row holding that row's
    reference values, nothing else left in OUT (no temporary file; no journal of pending
    server files unless ``journal_ok``: requests a dead server never answered stay in it
    for the next run's sweep, as sglang_ext.client.pending says)."""
    with open(out / MANIFEST_NAME) as f:
        lines = [json.loads(line) for line in f]
    counts = Counter(rec["index"] for rec in lines)
    assert sorted(counts) == list(range(len(data))), "rows missing from the manifest"
    assert [i for i, c in counts.items() if c > 1] == [], "rows in the manifest more than once"
    assert hs_indices(out) == set(range(len(data)))
    for i, ids in enumerate(data):
        assert_file(out / f"hs_{i}.safetensors", ids)
    left = [n for n in os.listdir(out) if n.startswith(".")]
    assert left == ([".extract-pending-rank0.jsonl"] if journal_ok and left else []), left
    return lines


@pytest.fixture(params=["router-retries", "client-retries"])
def fleet(request, tmp_path):
    """Three fake servers (dump dirs ``dumps/s<k>``, 20 ms per answer) behind the router:
    with its retries (a request that failed on a dead worker goes to another one) or
    without (``--disable-retries``: extract's own retries through the router do it)."""
    flags = ROUTER_FLAGS + (["--disable-retries"] if request.param == "client-retries" else [])
    for router, servers in _three_behind_a_router(tmp_path, *flags):
        router.client_retries = request.param == "client-retries"
        yield router, servers


@needs_router
def test_a_server_killed_mid_run_loses_no_row(fleet, tmp_path):
    """SIGKILL one of three servers after 100 of 300 rows: its in-flight rows are sent
    again (by the router, or without its retries by extract through it: those tries count
    as failed ones), the router stops sending it new ones, the run ends with every row
    exactly once; the per-worker counts match where files came from."""
    router, servers = fleet
    data = rows(N)
    path = write_jsonl(tmp_path / "d.jsonl", data)
    out = tmp_path / "out"
    summary_path = tmp_path / "summary.json"
    rc, stdout, stderr = run_until(extract_cmd(router.url, path, out, "--summary", summary_path),
                                   out, 100, lambda proc: servers[1].kill())
    assert rc == 0, stderr[-3000:]
    assert servers[1].proc.returncode == -signal.SIGKILL
    lines = assert_exact(out, data, journal_ok=router.client_retries)
    summary = json.loads(summary_path.read_text())
    assert summary == json.loads(stdout.split("extract summary: ")[1])
    assert summary["extracted"] == N and summary["failed"] == 0
    # Where each sample came from (the manifest's source: a server's own directory).
    came_from = Counter(os.path.dirname(rec["source"]) for rec in lines)
    dirs = [str(s.dump_dir) for s in servers]
    assert set(came_from) <= set(dirs)
    assert all(came_from[d] > 0 for d in dirs), came_from  # all three served before the kill
    assert came_from[dirs[1]] < min(came_from[dirs[0]], came_from[dirs[2]]), came_from
    workers = summary["workers"]
    assert {d: workers[d]["samples"] for d in dirs} == {d: came_from[d] for d in dirs}
    assert sum(w["failed_tries"] for w in workers.values()) == summary["retries"]
    if router.client_retries:  # the rows in flight on the killed server: 5xx from the router
        assert workers["(no answer)"]["failed_tries"] >= 1, (workers, stderr[-3000:])
    assert summary["rows_per_s"] > 0 and summary["tokens_per_s"] > 0
    # The survivors' directories hold nothing left: every file was taken.
    for d in (dirs[0], dirs[2]):
        assert not [n for n in os.listdir(d) if n.endswith(fmt.SUFFIX)], os.listdir(d)


@needs_router
def test_client_killed_through_the_router_resumes_exactly(fleet_one, tmp_path):
    """SIGKILL extract itself after 80 rows, run the same command again: rows finished
    before the kill are kept (resumed), the rest extracted once, the manifest exact."""
    router, servers = fleet_one
    data = rows(200, seed=3)
    path = write_jsonl(tmp_path / "d.jsonl", data)
    out = tmp_path / "out"
    cmd = extract_cmd(router.url, path, out)
    rc, _, _ = run_until(cmd, out, 80, lambda proc: proc.send_signal(signal.SIGKILL))
    assert rc == -signal.SIGKILL
    done_at_kill = hs_indices(out)
    assert 80 <= len(done_at_kill) < 200, "the kill came too late to test anything"
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.split("extract summary: ")[1])
    assert summary["resumed"] >= len(done_at_kill)
    assert summary["resumed"] + summary["extracted"] == 200
    assert_exact(out, data)
    for s in servers:  # what the killed client left in the servers' directories was swept
        assert not [n for n in os.listdir(s.dump_dir) if n.endswith(fmt.SUFFIX)]


def test_an_answer_in_a_directory_this_machine_does_not_see_stops_the_run(tmp_path, capsys):
    """The directory sink needs a shared filesystem: a server (behind a router or not) that
    names a directory missing here stops the run with one sentence, exit 3."""
    server = FakeServer(tmp_path / "server")
    try:
        server.dump = lambda ids, rid, early=False, extra=None: {
            "id": rid, "hidden_states_path": f"/nonexistent-node7/dump/{fmt.safe_stem(rid)}{fmt.SUFFIX}"}
        from sglang_ext.__main__ import main

        rc = main(["extract", "--endpoint", server.url, "--data",
                   write_jsonl(tmp_path / "d.jsonl", rows(3)), "--out", str(tmp_path / "out"),
                   "--no-progress", "--max-retries", "0"])
    finally:
        server.close()
    err = capsys.readouterr().err
    assert rc == EXIT_ABORTED, err
    assert "/nonexistent-node7/dump, which does not exist on this machine" in err
    assert "shared" in err and "Traceback" not in err
    assert not list((tmp_path / "out").glob("hs_*"))
