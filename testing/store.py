"""The GPU suite's Mooncake Store pieces (tests/gpu/test_gpu_store.py): a store node that
lends the memory, hs-connectors' reader, the server started with a ``mooncake://`` address,
and a sample read from the store turned into the record ``checks.compare_file`` takes.

The master itself is tests/mooncake_fixture.py's ``Master`` (the CPU suite's). Nothing here
imports mooncake or hs-connectors at import time: without them the GPU module is collected
and skipped with the reason (``missing_reason``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
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
