"""SGLang's real router (``sglang-router`` 0.3.2, requirements/fleet.txt) in front of fake dump
servers that run as their own processes, so that a test can SIGKILL one mid-run
(tests/integration/test_fleet.py).

``Router`` starts ``python -m sglang_router.launch_router --worker-urls ...`` on a free port
and waits for its ``/health``; ``DumpServer`` starts ``python tests/router_fixture.py serve DIR``:
tests/integration/test_client.py's ``FakeServer`` (files written through ``sglang_ext.format``'s
real reserve -> write -> complete path, values from its ``reference``) in a process of its own,
printing its URL. ``needs_router`` skips a test where the router is not importable, except
under tests/run.sh (``KIMI_SGLANG_NEED_ROUTER``), where that is an error.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
HAVE_ROUTER = importlib.util.find_spec("sglang_router") is not None
if not HAVE_ROUTER and os.environ.get("KIMI_SGLANG_NEED_ROUTER"):  # set by tests/run.sh
    raise ImportError("sglang_router is not importable in the test venv: "
                      "pip install -r requirements/fleet.txt")
needs_router = pytest.mark.skipif(
    not HAVE_ROUTER, reason="sglang_router not importable: pip install -r requirements/fleet.txt")

# The router flags the fleet recipe (docs/fleet.md) uses, at test speed: a dead worker is
# taken out after 2 failed health checks 1 s apart or 3 failed requests (circuit breaker),
# and a request that failed on one worker is sent again to another (router retries).
ROUTER_FLAGS = ["--policy", "round_robin", "--health-check-interval-secs", "1",
                "--health-failure-threshold", "2", "--cb-failure-threshold", "3",
                "--retry-max-retries", "3", "--retry-initial-backoff-ms", "20",
                "--log-level", "warn"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    path = os.pathsep.join([str(REPO), str(TESTS), str(TESTS / "integration")])
    return dict(os.environ, PYTHONPATH=path + os.pathsep + os.environ.get("PYTHONPATH", ""))


class DumpServer:
    """A fake dump server (test_client's ``FakeServer``) in its own process, writing into
    ``dump_dir``; ``delay`` seconds before each answer. ``url`` once ``started()``
    returned (start several, then wait for each: each imports torch). ``kill()``: SIGKILL."""

    def __init__(self, dump_dir: Path, log: Path, delay: float = 0.0):
        self.dump_dir = dump_dir
        self.log = log
        dump_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve", str(dump_dir), str(delay)], env=_env(),
            stdout=subprocess.PIPE, stderr=log.open("ab"), text=True)
        self.url = ""

    def started(self) -> "DumpServer":
        line = self.proc.stdout.readline()
        assert line.startswith("http://"), f"fake server did not start: {self.log.read_text()[-2000:]}"
        self.url = line.strip()
        return self

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


class Router:
    """``sglang_router.launch_router`` on a free port in front of ``workers``; ``url``."""

    def __init__(self, workers, log: Path, *flags: str):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *workers,
             "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
             *(flags or ROUTER_FLAGS)],
            stdout=log.open("ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"router exited: {log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"router did not answer /health: {log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _serve(dump_dir: str, delay: str) -> None:
    from test_client import FakeServer  # noqa: PLC0415 - only in the server's own process

    server = FakeServer(dump_dir)
    server.delay = float(delay)
    print(server.url, flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        _serve(*sys.argv[2:4])
