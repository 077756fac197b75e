"""Fleet group (issue 38; docs/fleet.md): three patched servers of the tiny Llama on one GPU
(``--mem-fraction-static 0.2`` each) behind SGLang's router (sglang-router 0.3.2), 2,000
prompts through ``sglang_ext extract``; one server's process group is SIGKILLed mid-run.

Checked: extract exits 0, every row is in the manifest exactly once and has its
``hs_<i>``, a sample of the files (40, spread over the three servers) equals HF's float32
forward (``testing/reference.py``, ``testing/checks.py``'s tolerances), the killed server
wrote fewer samples than each survivor. Recorded (results json, ``record_property``): the
rows/s of one server alone (500 prompts, straight to it) and of the fleet through the
router (the 2,000, kill included), their ratio, per-worker samples and failed tries. The
tiny model leaves the GPU idle most of the time: the ratio measures the router's and the
client's overhead and the kill's cost, not the three-GPU speed-up of a real model.

Needs the router importable (``.whl/r``, tests/gpu/README.md); skipped with the reason
otherwise. Fits one 10-minute device call: three servers start at once (~2-3 min), the
runs take well under a minute each.
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

from testing.checks import TOL_BLOCK, Problems, Worst, compare_file
from testing.server import ServerOptions, launch, server_command
from test_gpu_core import rand_ids

pytestmark = [pytest.mark.gpu, pytest.mark.models("llama")]

PORTS = (30021, 30022, 30023)
MEM_FRACTION = "0.2"
N_FLEET, N_ONE = 2000, 500
KILL_AT = 700  # rows in OUT when the second server is SIGKILLed
# The recipe's router flags (docs/fleet.md), faster health checks for a short run.
ROUTER_FLAGS = ["--policy", "round_robin", "--health-check-interval-secs", "2",
                "--health-failure-threshold", "2", "--cb-failure-threshold", "3",
                "--retry-max-retries", "3", "--log-level", "warn"]


def _router_or_skip():
    try:
        import sglang_router  # noqa: F401
    except ImportError as e:
        pytest.skip(f"sglang_router not importable ({e}): stage .whl/r (tests/gpu/README.md) "
                    f"or pip install sglang-router==0.3.2")


def _extract(url, data, out, summary, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "sglang_ext", "extract", "--endpoint", url, "--data", str(data),
         "--out", out, "--concurrency", "48", "--no-progress", "--backoff", "0.5", "--max-backoff", "4",
         "--timeout", "120", "--summary", summary, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_router(proc, url, log, timeout=120):
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited: {open(log).read()[-2000:]}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"router did not answer /health: {open(log).read()[-2000:]}")


def _manifest(out):
    with open(os.path.join(out, "manifest.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_three_servers_behind_the_router_one_killed(tiny_model, reference, rng, record_property,
                                                    server_log_dir, scratch_dir, tmp_path):
    _router_or_skip()
    from sglang_ext import format as fmt

    problems, worst = Problems(), Worst()
    servers, router = [], None
    try:
        for k, port in enumerate(PORTS):
            cmd = server_command(tiny_model.path, os.path.join(scratch_dir, f"dump{k}"),
                                 tiny_model.spec.layers_flag, "direct", ServerOptions(), port)
            cmd[cmd.index("--mem-fraction-static") + 1] = MEM_FRACTION
            os.makedirs(os.path.join(scratch_dir, f"dump{k}"))
            if servers:  # SGLang sizes its KV pool from the memory free at its start: one after
                last = servers[-1]  # the other, or one sees the other's pool appear under it
                last.wait_until(lambda: "Memory pool end" in last.log_text() or last.healthy())
            servers.append(launch(cmd, os.path.join(server_log_dir, f"server-fleet-{k}.log"),
                                  dump_dir=os.path.join(scratch_dir, f"dump{k}")))
        t0 = time.monotonic()
        for s in servers:
            s.wait_healthy()
        record_property("servers_startup_s", round(time.monotonic() - t0, 1))

        prompts = [rand_ids(rng, rng.randrange(16, 400)) for _ in range(N_FLEET)]
        data = tmp_path / "fleet.jsonl"
        data.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in prompts))
        one = tmp_path / "one.jsonl"
        one.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in prompts[:N_ONE]))

        # One server alone, straight to it: today's rate.
        p = _extract(servers[0].url, one, os.path.join(scratch_dir, "out-one"), str(tmp_path / "one.json"))
        _, err = p.communicate(timeout=300)
        if p.returncode != 0:
            problems.add(f"extract against one server exited with {p.returncode}: {err[-400:]}")
        one_summary = json.loads((tmp_path / "one.json").read_text()) if p.returncode == 0 else {}
        record_property("one_server_rows_per_s", one_summary.get("rows_per_s"))

        router_port = 30030
        router_log = os.path.join(server_log_dir, "router-fleet.log")
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls",
             *[s.url for s in servers], "--host", "127.0.0.1", "--port", str(router_port),
             "--prometheus-port", "30031", *ROUTER_FLAGS],
            stdout=open(router_log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{router_port}"
        _wait_router(router, url, router_log)

        out = os.path.join(scratch_dir, "out-fleet")
        p = _extract(url, data, out, str(tmp_path / "fleet.json"))
        killed_at = None
        deadline = time.monotonic() + 400
        while p.poll() is None and time.monotonic() < deadline:
            n = len([x for x in os.listdir(out) if x.startswith("hs_")]) if os.path.isdir(out) else 0
            if killed_at is None and n >= KILL_AT:
                os.killpg(servers[1].proc.pid, signal.SIGKILL)  # the server and its schedulers
                killed_at = n
            time.sleep(0.05)
        _, err = p.communicate(timeout=60)
        record_property("killed_at_rows", killed_at)
        if killed_at is None:
            problems.add(f"the run ended before {KILL_AT} rows were in OUT: nothing was killed")
        if p.returncode != 0:
            problems.add(f"extract through the router exited with {p.returncode}: {err[-600:]}")
        fleet = json.loads((tmp_path / "fleet.json").read_text()) if os.path.exists(tmp_path / "fleet.json") else {}
        record_property("fleet_rows_per_s", fleet.get("rows_per_s"))
        record_property("fleet_tokens_per_s", fleet.get("tokens_per_s"))
        record_property("fleet_workers", json.dumps(fleet.get("workers")))
        record_property("fleet_retries", fleet.get("retries"))
        if one_summary.get("rows_per_s") and fleet.get("rows_per_s"):
            record_property("fleet_vs_one_server", round(fleet["rows_per_s"] / one_summary["rows_per_s"], 2))

        lines = _manifest(out) if os.path.exists(os.path.join(out, "manifest.jsonl")) else []
        counts = Counter(rec["index"] for rec in lines)
        if sorted(counts) != list(range(N_FLEET)):
            problems.add(f"manifest: {N_FLEET - len(counts)} rows missing")
        twice = [i for i, c in counts.items() if c > 1]
        if twice:
            problems.add(f"manifest: rows more than once, e.g. {twice[:5]}")
        files = {x for x in os.listdir(out) if x.startswith("hs_")} if os.path.isdir(out) else set()
        if files != {f"hs_{i}.safetensors" for i in range(N_FLEET)}:
            problems.add(f"{len(files)} hs_ files for {N_FLEET} rows")
        came_from = Counter(os.path.basename(os.path.dirname(rec["source"] or "")) for rec in lines)
        record_property("samples_per_dump_dir", json.dumps(came_from))
        if not came_from["dump1"] < min(came_from["dump0"], came_from["dump2"]):
            problems.add(f"the killed server wrote as many samples as a survivor: {dict(came_from)}")
        # 40 files against HF: spread over the servers (by where they came from).
        by_dir = {}
        for rec in lines:
            by_dir.setdefault(os.path.basename(os.path.dirname(rec["source"] or "")), []).append(rec["index"])
        picked = []
        for idx in by_dir.values():
            picked += rng.sample(idx, min(len(idx), 14))
        for i in picked[:40]:
            path = os.path.join(out, f"hs_{i}.safetensors")
            if os.path.exists(path):
                problems.extend(compare_file(fmt.load(path), prompts[i], tiny_model.layer_ids,
                                             tiny_model.hidden_size, reference(prompts[i], tiny_model.layer_ids),
                                             f"hs_{i}", worst))
    finally:
        if router is not None and router.poll() is None:
            os.killpg(router.pid, signal.SIGTERM)
            router.wait(30)
        for s in servers:
            s.stop()
    worst.record(record_property)
    problems.extend(worst.problems(TOL_BLOCK, tol_token=None))
    problems.check("three servers behind the router, one killed")
