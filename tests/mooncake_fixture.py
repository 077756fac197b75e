"""A real ``mooncake_master`` for the store tests (tests/integration/test_store.py, test_store_sink.py, test_client_store.py).

``Master`` starts one on a free port (its metrics port free too) and kills it (the
``master`` fixture, in tests/conftest.py, is one per module); ``master_config`` the ``mooncake://``
address a sink or server uses with it. ``needs_mooncake`` skips a test where the wheel
is not importable, except under tests/run.sh (``KIMI_SGLANG_NEED_MOONCAKE``), where that
is an error.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from testing.store import MasterProcess, free_port

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


# The master process and its ports are testing/store.py's (the GPU suite and the bench
# start the same one); the names below keep the store tests' imports.
_free_port = free_port


class Master:
    """A real ``mooncake_master`` on a free port (its metrics port free too):
    ``testing.store.MasterProcess``, which ``restart`` replaces on the same port."""

    def __init__(self, tmp: Path, *flags: str):
        self.flags = flags  # more mooncake_master flags, e.g. --eviction_ratio=0
        self.port = free_port()
        self.log = tmp / f"master-{self.port}.log"
        self._start()

    def restart(self) -> None:
        """Kill it and start a new one on the same port (it knows no objects)."""
        self.kill()
        self._start()

    def _start(self) -> None:
        self.process = MasterProcess(str(self.log), self.port, 0, *self.flags)

    @property
    def address(self) -> str:
        return self.process.address

    def kill(self) -> None:
        self.process.stop()


def master_config(master: "Master", segment: int = 64 * MiB, buffer: str = "16MiB") -> str:
    """The ``mooncake://`` address of ``master`` with a ``segment``-byte segment (TCP, local host)."""
    return (f"mooncake://{master.address}?protocol=tcp&global_segment_size={segment}"
            f"&local_buffer_size={buffer}&local_hostname=127.0.0.1")


class SilentMaster:
    """A TCP server that accepts connections and never answers: a hung ``mooncake_master``,
    or an address that names another service (its HTTP metrics port, by typo). ``address``
    is ``127.0.0.1:PORT``; ``close`` ends it."""

    def __init__(self):
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.held = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)  # read nothing, answer nothing

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()
