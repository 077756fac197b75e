"""A real ``mooncake_master`` for the store tests (tests/integration/test_store.py, test_store_sink.py, test_client_store.py).

``Master`` starts one on a free port (its metrics port free too) and kills it (the
``master`` fixture, in tests/conftest.py, is one per module); ``master_config`` the ``mooncake://``
address a sink or server uses with it. ``needs_mooncake`` skips a test where the wheel
is not importable, except under tests/run.sh (``KIMI_SGLANG_NEED_MOONCAKE``), where that
is an error.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

# Mooncake's clients (in this process, the writer processes it starts, the master) log
# every set-up step at glog INFO to stderr; MC_LOG_LEVEL (Mooncake's ApplyGlogEnvironment:
# TRACE/INFO/WARNING/ERROR) keeps warnings and errors. Set before mooncake is imported;
# MC_LOG_LEVEL=INFO in the environment brings the INFO lines back.
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

try:
    import mooncake.store  # noqa: F401
    HAVE_MOONCAKE = True
except ImportError:
    HAVE_MOONCAKE = False

if not HAVE_MOONCAKE and os.environ.get("KIMI_SGLANG_NEED_MOONCAKE"):  # set by tests/run.sh
    raise ImportError("mooncake is not importable in the test venv: pip install -r requirements/store.txt")
needs_mooncake = pytest.mark.skipif(
    not HAVE_MOONCAKE, reason="mooncake not importable: pip install -r requirements/store.txt")

MiB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _master_binary() -> str:
    import mooncake  # noqa: PLC0415

    inside = Path(mooncake.__file__).parent / "mooncake_master"
    return str(inside) if inside.is_file() else (shutil.which("mooncake_master") or "mooncake_master")


class Master:
    """A real ``mooncake_master`` on a free port (its metrics port free too)."""

    def __init__(self, tmp: Path, *flags: str):
        self.flags = flags  # more mooncake_master flags, e.g. --eviction_ratio=0
        self.port = _free_port()
        self.log = tmp / f"master-{self.port}.log"
        self._start()

    def restart(self) -> None:
        """Kill it and start a new one on the same port (it knows no objects)."""
        self.kill()
        self._start()

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [_master_binary(), f"--port={self.port}", f"--metrics_port={_free_port()}", *self.flags],
            stdout=self.log.open("a"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"mooncake_master exited: {self.log.read_text()[-2000:]}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"mooncake_master did not listen on {self.port}")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def master_config(master: "Master", segment: int = 64 * MiB, buffer: str = "16MiB") -> str:
    """The ``mooncake://`` address of ``master`` with a ``segment``-byte segment (TCP, local host)."""
    return (f"mooncake://{master.address}?protocol=tcp&global_segment_size={segment}"
            f"&local_buffer_size={buffer}&local_hostname=127.0.0.1")
