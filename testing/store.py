"""The Mooncake Store pieces of the GPU suite (tests/gpu/test_gpu_store.py) and the
benchmark's store modes (bench/store.py): a ``mooncake_master`` (``MasterProcess``), a
store node that lends the memory (``StoreNode``), hs-connectors' reader, and a sample read
from the store turned into the record ``checks.compare_file`` takes.

The test suites' master (tests/mooncake_fixture.py's ``Master``) is a ``MasterProcess``
too (RuntimeError with the log's tail when it does not start).
Nothing here imports mooncake or hs-connectors at import time: without them the GPU module
is collected and skipped with the reason (``missing_reason``).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional


MiB = 1 << 20
MANIFEST = "hidden_states_manifest"

# A store node: a Mooncake client that mounts a segment of argv[2] bytes and stays
# (docs/store.md: with store nodes, the server lends none, global_segment_size=0).
STORE_NODE = """
import sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", "P2PHANDSHAKE", int(sys.argv[2]), 16 << 20, "tcp", "", sys.argv[1])
print("mounted", rc, flush=True)
time.sleep(86400)
"""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A TCP port free on 127.0.0.1 now whose next one is free too (a master and its
    metrics port, as the benchmark's ``--mooncake-port`` takes them): both bound at once,
    then let go."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two free TCP ports in a row on 127.0.0.1 after 100 tries")


def master_binary() -> str:
    """The ``mooncake_master`` the mooncake wheel ships in its package folder, else the
    one on ``PATH`` (the name itself when there is none: starting it then says so)."""
    import mooncake  # noqa: PLC0415

    inside = Path(mooncake.__file__).parent / "mooncake_master"
    return str(inside) if inside.is_file() else (shutil.which("mooncake_master") or "mooncake_master")


def listening(port: int, timeout: float = 0.2) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:``port``."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=timeout).close()
        return True
    except OSError:
        return False


class MasterProcess:
    """A real ``mooncake_master`` on ``port`` (0: a free one) with its metrics port
    ``metrics_port`` (0: a free one), its output in ``log_path``, plus ``flags``; ``stop()``
    kills it. Raises RuntimeError (with the log's tail) when it exits or does not listen
    within ``timeout`` s, or when ``port`` is taken already (another master would answer)."""

    def __init__(self, log_path: str, port: int = 0, metrics_port: int = 0, *flags: str, timeout: float = 20):
        self.port = port or free_port()
        self.log_path = log_path
        if listening(self.port):
            raise RuntimeError(f"port {self.port} is taken: another mooncake_master (or something else) listens there")
        argv = [master_binary(), f"--port={self.port}", f"--metrics_port={metrics_port or free_port()}", *flags]
        with open(log_path, "a") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not listening(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_master did not listen on port {self.port} "
                                   f"(exit status {self.proc.returncode}): {self.log_tail()}")
            time.sleep(0.05)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def missing_reason() -> Optional[str]:
    """None when mooncake (its ``store`` module) and hs-connectors import, else why not
    (one sentence naming the staging that provides them)."""
    for module, where in (("mooncake.store", ".whl/m (tests/gpu/stage-extras.sh; tests/gpu/README.md)"),
                          ("hs_connectors.transfer", ".whl/d (tests/gpu/stage-extras.sh)")):
        try:
            __import__(module)
        except Exception as e:  # noqa: BLE001 - an ImportError or a missing shared library
            return f"{module} is not importable ({type(e).__name__}: {e}); stage {where}"
    return None


class StoreNode:
    """A process that mounts a ``segment_bytes`` segment into the master at
    ``master_address`` ("HOST:PORT") and stays until ``stop()``. Raises RuntimeError when
    it does not report a successful mount within ``timeout`` s (with its output)."""

    def __init__(self, master_address: str, segment_bytes: int, log_path: str, timeout: float = 60):
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", STORE_NODE, master_address, str(segment_bytes)],
                                         stdout=subprocess.PIPE, stderr=log, text=True)
        line = ""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            line = self.proc.stdout.readline()
            if line:
                break
        if line.split() != ["mounted", "0"]:
            self.stop()
            with open(log_path, errors="replace") as f:
                tail = f.read()[-2000:]
            raise RuntimeError(f"store node did not mount its segment (said {line.strip()!r}): {tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def reader(master_address: str, buffer_bytes: int = 64 * MiB):
    """hs-connectors' trainer-side ``MooncakeTransfer`` (what speculators' trainer calls),
    over a client of its own that lends no memory; its buffer must hold the largest sample."""
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig
    from hs_connectors.transfer import MooncakeTransfer

    t = MooncakeTransfer(MooncakeHiddenStatesStore(MooncakeStoreConfig.from_dict({
        "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "master_server_address": master_address,
        "global_segment_size": 0, "local_buffer_size": buffer_bytes, "protocol": "tcp", "device_name": ""})))
    t.setup()
    return t


def sample_problems(sample: dict, manifest: dict, n_tokens: int, fp8: bool, where: str) -> List[str]:
    """The layout of one sample as ``get_generated`` returns it: the manifest's version
    (1) and tensor names; ``hidden_states`` bfloat16 (``fp8``: float8_e4m3fn with float32
    ``hidden_states_scales`` [T, L, 1] and metadata ``scale_layout``), ``token_ids`` int64
    [T]. Shapes against the model are ``compare_file``'s."""
    import torch

    problems = []
    want = {"hidden_states", "token_ids"} | ({"hidden_states_scales"} if fp8 else set())
    if manifest.get("version") != 1 or set(manifest.get("tensors", {})) != want or set(sample) != want:
        return [f"{where}: manifest version {manifest.get('version')!r}, tensors "
                f"{sorted(manifest.get('tensors', {}))}, sample {sorted(sample)}; want {sorted(want)}"]
    hs, ids = sample["hidden_states"], sample["token_ids"]
    if hs.dtype != (torch.float8_e4m3fn if fp8 else torch.bfloat16):
        problems.append(f"{where}: hidden_states {hs.dtype}")
    if ids.dtype != torch.int64 or tuple(ids.shape) != (n_tokens,):
        problems.append(f"{where}: token_ids {ids.dtype} {tuple(ids.shape)}")
    if manifest["metadata"].get("num_tokens") != n_tokens:
        problems.append(f"{where}: manifest num_tokens {manifest['metadata'].get('num_tokens')}")
    if fp8:
        sc = sample["hidden_states_scales"]
        if sc.dtype != torch.float32 or tuple(sc.shape) != (*hs.shape[:2], 1):
            problems.append(f"{where}: hidden_states_scales {sc.dtype} {tuple(sc.shape)}")
        if manifest["metadata"].get("scale_layout") != "per_token_per_layer":
            problems.append(f"{where}: metadata {manifest['metadata']}")
    return problems


def sample_record(sample: dict, layer_ids):
    """The file-like record (``sglang_ext.format.DumpRecord``) of a sample read from the
    store, for ``checks.compare_file``: fp8 dequantized with its scales to float32
    (``quant.dequantize``, as ``format.load(dequantize=True)``). A store object carries no
    layer ids (the trainer's config names them): ``layer_ids`` are the server's."""
    from sglang_ext import format as fmt
    from sglang_ext import quant

    hs = sample["hidden_states"]
    if "hidden_states_scales" in sample:
        hs = quant.dequantize(hs, sample["hidden_states_scales"])
    return fmt.DumpRecord(hidden_states=hs, token_ids=sample["token_ids"],
                          metadata={"layer_ids": json.dumps(list(layer_ids))})
