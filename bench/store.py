"""The store modes' Mooncake Store (``dump_store``, ``dump_store_early``): a
``mooncake_master`` and a store node that lends the memory, started by the benchmark
itself (testing/store.py's, as the GPU suite's store module starts them), server S's
``mooncake://`` address (it lends none), and the trainer's side: a client of the
benchmark's own that waits until a sample is visible and deletes what a cell put.

"Visible" is what a trainer sees: ``is_exist(handle)`` true (Mooncake makes a key visible
once its put is whole), polled every ``POLL_S`` (the client's response-to-visible has that
resolution; the trace's forward-end-to-visible has none); ``<handle>:error`` every
``MARKER_EVERY`` polls fails the request with the marker's sentence.
"""

from __future__ import annotations

import json
import os
import time
from typing import Iterable, List, Tuple

from bench import report

MiB = 1 << 20
MANIFEST = "hidden_states_manifest"  # the store sink's answer (docs/store.md)
POLL_S = 0.002  # between look-ups of one handle
MARKER_EVERY = 25  # look for <handle>:error every this many look-ups (~50 ms)
WAIT_TIMEOUT_S = 120.0  # hs-connectors' reader's timeout
# Server S's client staging buffer: a chunked-prefill request's sample is put as bytes
# through it (docs/store.md); 8 writer threads x a 2k prompt's 64 MiB sample of the 8B shape
SERVER_LOCAL_BUFFER = 1 << 30
MIN_SEGMENT = 1 << 30


class SampleFailed(RuntimeError):
    """A sample's error marker was found, or it did not appear within the timeout."""


def server_url(port: int, local_buffer: int = SERVER_LOCAL_BUFFER) -> str:
    """Server S's ``--dump-hidden-states-dir``: the master on 127.0.0.1:``port``, TCP, no
    segment of its own (the store node lends the memory: the samples do not compete with
    the server's host memory, docs/store.md)."""
    return (f"mooncake://127.0.0.1:{port}?protocol=tcp&global_segment_size=0"
            f"&local_buffer_size={local_buffer}&local_hostname=127.0.0.1")


def segment_bytes(cell_bytes: Iterable[int]) -> int:
    """The store node's segment for cells of ``cell_bytes`` (each cell's samples, all held
    until the cell ends and deletes them): 1.5 x the largest plus 1 GiB (the master evicts
    above 90 % full), at least ``MIN_SEGMENT``."""
    most = max(cell_bytes, default=0)
    return max(MIN_SEGMENT, int(1.5 * most) + (1 << 30))


class BenchStore:
    """The master on ``port``, a store node lending ``segment`` bytes, and a client that
    lends none (``waiter``), logs under ``log_dir``. ``start()`` raises RuntimeError
    (StoreUnavailable for the client) naming what did not come up; ``stop()`` ends them."""

    def __init__(self, port: int, segment: int, log_dir: str):
        self.port, self.segment, self.log_dir = port, segment, log_dir
        self.master = self.node = self.sink = None

    def start(self) -> "BenchStore":
        from sglang_ext import store, store_client
        from testing import store as st

        why = store_client.mooncake_import_error()
        if why is not None:
            raise RuntimeError(f"the store modes' Mooncake Store {why} (on the GPU host: carry .whl/m, "
                               f"tests/gpu/stage-extras.sh)")
        try:
            self.master = st.MasterProcess(os.path.join(self.log_dir, f"mooncake-master-{self.port}.log"),
                                           self.port, self.port + 1)
            self.node = st.StoreNode(self.master.address, self.segment,
                                     os.path.join(self.log_dir, f"store-node-{self.port}.log"))
            self.sink = store_client.StoreClient(store.StoreConfig(
                self.master.address, global_segment_size=0, local_buffer_size=16 * MiB,
                local_hostname="127.0.0.1")).connect()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for part in (self.sink, self.node, self.master):
            if part is None:
                continue
            try:
                part.close() if part is self.sink else part.stop()
            except Exception as e:  # noqa: BLE001 - the rest still stops
                print(f"  stopping the store's {type(part).__name__}: {e}", flush=True)
        self.master = self.node = self.sink = None

    # ---- the trainer's side

    def wait_visible(self, handle: str, timeout: float = WAIT_TIMEOUT_S) -> bool:
        """Wait until ``handle`` is visible; returns whether it was at the first look-up.
        Raises SampleFailed with the marker's sentence or the timeout."""
        from sglang_ext.store import ERROR_SUFFIX

        deadline = time.monotonic() + timeout
        n = 0
        while True:
            if self.sink.exists(handle):
                return n == 0
            n += 1
            if n % MARKER_EVERY == 0 and self.sink.exists(handle + ERROR_SUFFIX):
                raise SampleFailed(f"store sample {handle}: error marker {self.marker(handle)!r}")
            if time.monotonic() > deadline:
                raise SampleFailed(f"store sample {handle} not visible after {timeout:g} s")
            time.sleep(POLL_S)

    def marker(self, handle: str) -> str:
        """The sentence of ``<handle>:error`` (its JSON ``error``), or "" when unreadable."""
        from sglang_ext import store

        try:
            return json.loads(bytes(self.sink.get(handle + store.ERROR_SUFFIX)))["error"]
        except Exception:  # noqa: BLE001 - the marker's existence is the finding
            return ""

    def consume(self, handles: Iterable[str], timeout: float = WAIT_TIMEOUT_S) -> Tuple[int, List[str]]:
        """What a trainer does with a cell's samples, untimed: wait for each (visible or
        failed; a handle deleted before its put would leave the put's object for good),
        then delete it and its marker. Returns (how many were deleted, the sentences of
        the samples that failed); once one failed, each is waited for at most 5 s (a dead
        server fails them all)."""
        failed: List[str] = []
        n = 0
        for h in handles:
            try:
                self.wait_visible(h, timeout if not failed else min(timeout, 5.0))
            except SampleFailed as e:
                failed.append(str(e))
            self.sink.remove(h)
            n += 1
        return n, failed

    def present(self, handles: Iterable[str]) -> List[str]:
        """Which of ``handles`` (or their markers) are still in the store."""
        from sglang_ext.store import ERROR_SUFFIX

        return [h for h in handles if self.sink.exists(h) or self.sink.exists(h + ERROR_SUFFIX)]

    def cell_entries(self, results, visible, out, wall):
        """What a store cell adds to its results entry ``out`` (``loadgen.run_cell``), from
        ``send_batch``'s ``results`` and ``visible`` and its ``wall`` s: ``objects``,
        ``file_bytes`` (their ``total_aligned_bytes``), ``bytes_per_token``, ``write_gbps``,
        ``file_check``, ``visible_ms`` (response to visible: p50, p99, ``at_response``: the
        share visible at the first look-up), ``removed`` (deleted after the cell, untimed),
        ``error`` for answers without a manifest or samples left in the store."""
        entry, manifests, errors = {}, [], []
        for r in results:
            if r[1] != 200:
                continue
            meta = json.loads(r[3])["meta_info"]
            (manifests if meta.get(MANIFEST) else errors).append(meta.get(MANIFEST) or meta.get(
                "hidden_states_error", "no hidden_states_manifest"))
        nbytes = sum(m["metadata"]["total_aligned_bytes"] for m in manifests)
        entry.update(objects=len(manifests), file_bytes=nbytes, write_gbps=nbytes / wall / 1e9,
                     bytes_per_token=nbytes / out["prompt_tokens"] if out.get("prompt_tokens") else None)
        if manifests:
            entry["file_check"] = {"hidden_states": manifests[0]["tensors"].get("hidden_states")}
        if visible:
            ms = [v * 1000 for v, _ in visible]
            entry["visible_ms"] = {"p50": report.percentile(ms, 50), "p99": report.percentile(ms, 99),
                                   "at_response": sum(first for _, first in visible) / len(visible)}
        if errors:
            entry["error"] = f"{len(errors)} requests without a manifest: {str(errors[0])[:200]}"
        handles = [r[4] for r in results if r[4]]
        entry["removed"], failed = self.consume(handles)
        if failed:
            entry["error"] = entry.get("error") or f"{len(failed)} samples failed: {failed[0][:300]}"
        left = self.present(handles)
        if left:
            entry["error"] = entry.get("error") or f"{len(left)} samples left in the store after deleting them"
        return entry
