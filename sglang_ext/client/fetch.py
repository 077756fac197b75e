"""Samples from a Mooncake Store: ``extract --store`` on a node that shares no filesystem
with the servers.

A server started with ``--dump-hidden-states-dir mooncake://...`` answers each request early
with ``meta_info.hidden_states_manifest``: hs-connectors' transfer manifest, version 1
(``sglang_ext.store.PackedLayout.manifest``, docs/store.md). The sample follows as one
packed object under the manifest's ``handle``, visible only once complete, or the object
``<handle>:error`` (JSON ``{"error": message}``) when the server failed it. For one answer:

1. ``expect``: the manifest is checked against the request before anything is read: the
   handle is one the server names for the rid (``store.handle_matches``: ``handle_for(rid)``
   or that + ``-`` + 32 hex digits, the unique suffix every answer now has; 8 from older servers), and tensors, offsets, sizes
   and ``total_aligned_bytes`` are exactly ``store.pack_layout(len(prompt), L, H, dtype)``'s
   (so ``hidden_states`` has one row per prompt token, fp8 scales are ``[T, L, 1]``); a
   ``layer_ids`` in its metadata must name L layers, and L, H and the dtype must be those
   of the run's first sample (else ``OtherLayout``: the run stops). Anything else is the
   try's error (``FetchError``).
2. ``wait``: poll ``<handle>:error``, then ``<handle>`` (hs-connectors' ``get_generated``
   rule: 1 ms doubling to 50 ms, ``--store-timeout``, 120 s by default).
3. ``take``: ``get_size`` must equal ``total_aligned_bytes``; ``get_into`` a registered
   buffer; the token ids must equal the prompt's; the tensors are written as
   ``OUT/hs_<i>.safetensors`` through a temporary file (``files.Staged``) in the file
   sink's own layout (``format.file_layout``: same keys, dtypes, order, 4096-byte data
   start), checked by ``checks.check_file`` there, then renamed onto the final name.
4. ``consumed``: once the manifest has the sample's line, the object and its ``:error``
   are removed (forced past the lease; "not found" is fine).

The file's ``__metadata__`` is what this node can know: ``format``, ``rid`` (the rid this
client sent), for fp8 ``hidden_states_dtype`` and ``scale_layout``, plus any of
``layer_ids``, ``num_layers``, ``model_path``, ``sglang_version``, ``sglang_ext_version``
and ``series`` that the manifest's metadata carries (``FILE_META_KEYS``; our server's
manifest carries the file's ``__metadata__``, so a file taken from the store has them;
another producer's manifest may not).

Resume and exactly-once: every request is journaled (``OUT/.extract-store-rank<R>.jsonl``:
row index and rid) before it is sent, its checked manifest (with the manifest's own
handle) before its object is waited for, and the handle is marked done once the object
is removed. A request whose answer never came has no known handle (the server picks its
random suffix): its objects are removed by pattern (``remove_by_regex`` on
``handle_for(rid)`` + any suffix; extract's rids carry a random part of their own). A rerun that finds row ``i`` unfinished with a journaled handle takes
that object if it is still in the store (no new request), and requests the row again if
it is gone; a row whose ``hs_<i>`` is in place has its journaled objects removed. At the
end of a run that was not interrupted every journaled object left (tries given up on)
is removed and the journal goes. An object that appears after that (a server far behind)
stays until the server's process exits or the master evicts it.

The reader lends no segment (``global_segment_size`` 0 unless the URL sets it: samples
live in the servers' segments). It talks to Mooncake through the same client as the
server's store sink (``store_client.StoreClient``), which imports mooncake on ``connect``
only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import time
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import parse_qsl, urlsplit

from sglang_ext import format as fmt
from sglang_ext import store as st
from sglang_ext import store_client
from sglang_ext.client.checks import MAX_ROW_VALUES, check_file
from sglang_ext.client.files import Journal, Staged
from sglang_ext.client.http import FatalError, RequestError
from sglang_ext.client.manifest import final_name

DEFAULT_WAIT_S = 120.0  # hs-connectors' get_generated timeout
POLL_FIRST_S = 0.001
POLL_MAX_S = 0.05
PROBE_TIMEOUT_S = 10.0  # a master that does not accept a TCP connection by then is not up
HANDSHAKE_S = 20.0  # Mooncake's own set-up, in a subprocess first (store_client.handshake)
FILE_META_KEYS = ("layer_ids", "num_layers", "model_path", "sglang_version",
                  "sglang_ext_version", "series", "image_token_id")
INSTALL_HINT = store_client.INSTALL_HINT


class FetchError(RequestError):
    """One try's sample could not be taken from the store (retried like a bad file)."""


class OtherLayout(FatalError):
    """An answer's hidden_states differ in L, H or dtype from the run's first sample: the
    server's configuration changed (no retry helps), so the run stops."""


class StoreUnreachable(RuntimeError):
    """The Mooncake client cannot be set up (the master does not answer): the run cannot start."""


class MooncakeMissing(StoreUnreachable):
    """The mooncake package is not importable here."""


def _ours(index: Any, rid: Any) -> bool:
    """Whether ``rid`` is one this command makes for row ``index`` (``runner``:
    ``<prefix>-<index>-<try>-<8 hex>``; ``--rid-prefix ""`` too)."""
    return (isinstance(index, int) and not isinstance(index, bool) and index >= 0 and isinstance(rid, str)
            and re.fullmatch(r".*-%d-\d+-[0-9a-f]{8}" % index, rid, re.DOTALL) is not None)


_SENT_PREFIX = "sent:"  # journal key of a request not answered yet (no handle has ':')


def _sent_key(rid: str) -> str:
    return _SENT_PREFIX + rid


def _sent_pattern(rid: str) -> str:
    """The master's regex (``remove_by_regex``) for every object an answer to ``rid`` may
    have made: ``handle_for(rid)``, optionally ``-`` + 32 (or 8) hex digits, optionally ``:error``
    (a handle holds only ``[a-zA-Z0-9_-]``, nothing to escape)."""
    return f"^{st.handle_for(rid)}(-{st.SUFFIX_RE})?({st.ERROR_SUFFIX})?$"


def journal_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f".extract-store-rank{rank}.jsonl")


def reader_config(url: str) -> st.StoreConfig:
    """The trainer-side settings from ``--store URL`` (``StoreConfig.from_url``'s form);
    ``global_segment_size`` is 0 unless the URL names it (a reader holds no samples).
    ``ValueError`` (one sentence) for a URL that is not ``mooncake://HOST:PORT?...``."""
    config = st.StoreConfig.from_url(url)
    if "global_segment_size" not in dict(parse_qsl(urlsplit(url).query, keep_blank_values=True)):
        config = dataclasses.replace(config, global_segment_size=0)
    return config


@dataclasses.dataclass(frozen=True)
class Expected:
    """What one answer promises: the object ``handle`` laid out as ``layout``, from the
    request ``rid``; ``metadata`` the hs_<i> file's ``__metadata__``."""

    rid: str
    handle: str
    layout: st.PackedLayout
    metadata: Dict[str, str]


def _file_metadata(rid: str, dtype: str, meta: Dict[str, Any]) -> Dict[str, str]:
    """``format.build_metadata``'s keys this node knows, in the file sink's order."""
    out = {"format": fmt.FORMAT_VERSION, "rid": fmt.printable_rid(rid)}
    for key in FILE_META_KEYS:
        value = meta.get(key)
        if isinstance(value, str):
            out[key] = value
        elif isinstance(value, (list, int)) and not isinstance(value, bool):
            out[key] = json.dumps(value)
    out.update(fmt.dtype_metadata(dtype))
    return out


def expect(manifest: Any, rid: str, input_ids: Optional[List[int]],
           shape: Optional[Tuple[int, int, str]] = None) -> Expected:
    """Check an answer's manifest against the request (module doc, step 1); ``shape``:
    the run's ``(L, H, dtype)`` so far; ``input_ids`` None (a chat request with images
    whose answer gave no prompt token ids): the manifest's own token count stands.
    Raises ``FetchError`` (one sentence); ``OtherLayout`` for L, H or dtype not ``shape``'s."""
    if not isinstance(manifest, dict):
        raise FetchError(f"hidden_states_manifest is not an object: {str(manifest)[:200]}")
    if manifest.get("version") != st.MANIFEST_VERSION:
        raise FetchError(f"hidden_states_manifest has version {manifest.get('version')!r}; "
                         f"this client reads version {st.MANIFEST_VERSION}")
    handle = manifest.get("handle")
    if not isinstance(handle, str) or not st.handle_matches(rid, handle):
        raise FetchError(f"hidden_states_manifest names the object {str(handle)[:120]!r}, not a server "
                         f"handle for request {rid} ({st.handle_for(rid)!r} or that + '-' + 32 hex "
                         f"digits): not taken")
    try:
        hs = manifest["tensors"][fmt.KEY_HIDDEN_STATES]
        dims = [int(d) for d in hs["shape"]]
        dtype = str(hs["dtype"]).removeprefix("torch.")
        meta = manifest["metadata"]
        if len(dims) != 3 or not isinstance(meta, dict) or min(dims) < 1 or dims[1] * dims[2] > MAX_ROW_VALUES:
            raise ValueError  # [T, 0, H], a negative dimension, rows larger than extract takes
        layout = st.pack_layout(dims[0] if input_ids is None else len(input_ids), dims[1],
                                dims[2], dtype)
    except (KeyError, TypeError, ValueError, fmt.DumpFormatError):
        raise FetchError(f"hidden_states_manifest does not describe hidden_states [T, L, H] "
                         f"(each at least 1, L x H at most {MAX_ROW_VALUES}) of a known dtype: "
                         f"{json.dumps(manifest)[:300]}") from None
    want = layout.manifest(handle)
    if manifest["tensors"] != want["tensors"] or meta.get("total_aligned_bytes") != layout.total_bytes:
        raise FetchError(f"hidden_states_manifest for {layout.num_tokens} prompt tokens does not match "
                         f"the layout of hidden_states {dims} {dtype}: got {json.dumps(manifest['tensors'])[:300]}, "
                         f"total_aligned_bytes {meta.get('total_aligned_bytes')!r}")
    layer_ids = meta.get("layer_ids")
    if isinstance(layer_ids, str):
        try:
            layer_ids = json.loads(layer_ids)
        except (ValueError, RecursionError):
            layer_ids = None
    if layer_ids is not None and (not isinstance(layer_ids, list) or len(layer_ids) != dims[1]):
        raise FetchError(f"hidden_states_manifest: layer_ids {meta.get('layer_ids')!r} do not name "
                         f"the {dims[1]} layer slots of hidden_states")
    if shape is not None and shape != (dims[1], dims[2], dtype):
        raise OtherLayout(f"hidden_states {dims} {dtype} differ from the run's first sample "
                          f"([T, {shape[0]}, {shape[1]}] {shape[2]}): one dataset of two server "
                          f"configurations (a server restarted with other flags?), so it was not "
                          f"taken and the run stops")
    return Expected(rid, handle, layout, _file_metadata(rid, dtype, meta))


class StoreFetcher(Journal):
    """The run's store reader: one Mooncake client, the journal, the get buffers.

    ``url``: ``--store``; ``out_dir``/``rank``/``mode``: where and how the journal and the
    files are written. ``connect`` before use; ``close`` at the end. The get buffers are
    ``store_client.RegisteredBuffers``: one per fetch in flight, reused."""

    WHAT, NAMES = "store journal", "objects this run would remove from the store"

    def __init__(self, url: str, out_dir: str, rank: int, mode: int = fmt.DEFAULT_FILE_MODE):
        super().__init__(journal_path(out_dir, rank), mode)
        self.config = reader_config(url)
        self.url_base = f"mooncake://{self.config.master_server_address}"
        self.out_dir = out_dir
        self.client: Optional[store_client.StoreClient] = None
        self.buffers: Optional[store_client.RegisteredBuffers] = None
        self.shape: Optional[Tuple[int, int, str]] = None  # the run's (L, H, dtype)
        # why the master is gone, once a look-up found its port refusing connections
        # (_exists): the run stops, and every later look-up or removal fails at once
        self.gone: Optional[str] = None
        # index -> {handle: (rid, manifest)} of journaled objects not yet removed
        self.open: Dict[int, Dict[str, Tuple[str, Any]]] = {}
        self._read()

    # -- the journal

    def _read(self) -> None:
        for rec in self._records():
            if isinstance(rec.get("done"), str):
                for handles in self.open.values():
                    handles.pop(rec["done"], None)
            elif _ours(rec.get("index"), rec.get("rid")):
                manifest = rec.get("manifest") if isinstance(rec.get("manifest"), dict) else None
                if manifest is not None and isinstance(manifest.get("handle"), str):
                    if not st.handle_matches(rec["rid"], manifest["handle"]):
                        continue  # not a handle the server names for this rid: never ours to remove
                    handles = self.open.setdefault(rec["index"], {})
                    handles.pop(_sent_key(rec["rid"]), None)
                    handles[manifest["handle"]] = (rec["rid"], manifest)
                else:
                    self.open.setdefault(rec["index"], {})[_sent_key(rec["rid"])] = (rec["rid"], None)
        self.open = {i: h for i, h in self.open.items() if h}

    def _live_records(self) -> List[dict]:
        """The objects still open, one record each."""
        self.open = {i: h for i, h in self.open.items() if h}
        records = []
        for index, handles in self.open.items():
            for rid, manifest in handles.values():
                rec = {"index": index, "rid": rid}
                if manifest is not None:
                    rec["manifest"] = manifest
                records.append(rec)
        return records

    def sent(self, index: int, rid: str) -> None:
        """Journal a request before it is sent. Its object's handle is the server's
        answer (``handle_for(rid)`` + a random suffix), so until ``answered`` the row
        holds a placeholder (``_sent_key``) that names no object."""
        self.open.setdefault(index, {})[_sent_key(rid)] = (rid, None)
        self._append({"index": index, "rid": rid})

    def answered(self, index: int, rid: str, manifest: Dict[str, Any]) -> None:
        """Journal a checked answer (before its object is waited for) under the manifest's
        own handle: a rerun may take it, and it is ours to remove."""
        handles = self.open.setdefault(index, {})
        handles.pop(_sent_key(rid), None)
        handles[manifest["handle"]] = (rid, manifest)
        self._append({"index": index, "rid": rid, "manifest": manifest})

    def resumable(self, index: int) -> List[Tuple[str, Any]]:
        """``(rid, manifest)`` of row ``index``'s journaled answers, newest last."""
        return [(rid, m) for rid, m in self.open.get(index, {}).values() if m is not None]

    # -- the client

    def connect(self) -> "StoreFetcher":
        """Set the Mooncake client up: Mooncake's own set-up is completed in a subprocess
        first (``store_client.handshake``, ``HANDSHAKE_S``), so a master that accepts
        connections and never answers costs seconds and SIGTERM/Ctrl-C still work (the
        set-up holds the GIL while it waits). ``MooncakeMissing`` (one sentence) when
        mooncake is not installed, ``StoreUnreachable`` when the master does not answer."""
        # Mooncake's INFO lines (its set-up, ~16 per run) would bury extract's own on the
        # user's terminal; warnings and errors still show (MC_LOG_LEVEL: Mooncake's own).
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        why = self.config.memory_problem()
        if why is not None:
            raise StoreUnreachable(f"--store: {why}")
        client = store_client.StoreClient(self.config)
        try:
            client.connect(subject="--store", probe_s=PROBE_TIMEOUT_S, handshake_s=HANDSHAKE_S)
        except store_client.MooncakeMissing as e:
            raise MooncakeMissing(str(e)) from None
        except st.StoreError as e:
            raise StoreUnreachable(str(e)) from None
        self.client = client
        self.buffers = store_client.RegisteredBuffers(client)
        return self

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            self.buffers.close()
            client.close()

    def _exists(self, key: str) -> bool:
        """Whether ``key`` is in the store. ``FatalError`` when the master does not answer
        and its port refuses connections (``store_client.master_unreachable``: it died
        after the run connected; every next try would fail alike, its samples are gone
        with it; from then on at once, without asking: ``gone``, so the run's other tries
        stop in a moment instead of each waiting out Mooncake's RPC timeout, 44 s for 64
        workers); ``FetchError`` for any other failed look-up (a slow master: retried)."""
        if self.gone is not None:
            raise FatalError(self.gone)
        try:
            return self.client.exists(key)
        except st.StoreUnavailable as e:
            self._stop_if_gone()
            raise FetchError(str(e)) from None
        except st.StoreError as e:
            raise FetchError(str(e)) from None

    def _stop_if_gone(self) -> None:
        """After a failed store call: ``FatalError`` (and ``gone`` set) when the master's
        port refuses connections; else nothing (the caller's error stands)."""
        if self.gone is None:
            why = store_client.master_unreachable(self.config, PROBE_TIMEOUT_S)
            if why is None:
                return
            self.gone = (f"{why}: no sample can be taken from the store, so every next try "
                         f"would fail alike; start mooncake_master there again and run the "
                         f"same command again to resume")
        raise FatalError(self.gone) from None

    def _error_of(self, handle: str) -> str:
        """The message in ``<handle>:error`` (the server's words)."""
        key = handle + st.ERROR_SUFFIX
        try:
            msg = json.loads(self.client.get(key).decode("utf-8"))["error"]
        except Exception as e:  # noqa: BLE001 - a marker that is not JSON still fails the try
            msg = f"unreadable error marker ({type(e).__name__})"
        return f"the server failed the sample ({key}): {msg}"

    def state(self, handle: str) -> Optional[str]:
        """``"error"``, ``"ready"`` or None (not there), the error marker first;
        ``_exists``' errors."""
        if self._exists(handle + st.ERROR_SUFFIX):
            return "error"
        return "ready" if self._exists(handle) else None

    async def wait(self, exp: Expected, timeout: float) -> None:
        """Wait until ``exp.handle`` is complete. ``FetchError`` with the server's message
        for ``<handle>:error`` (both objects are removed then), or when nothing appeared
        within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        delay = POLL_FIRST_S
        while True:
            found = await asyncio.to_thread(self.state, exp.handle)
            if found == "ready":
                return
            if found == "error":
                msg = await asyncio.to_thread(self._error_of, exp.handle)
                await self.remove(exp.handle)
                raise FetchError(msg)
            if time.monotonic() >= deadline:
                raise FetchError(f"the sample {exp.handle!r} did not appear in the Mooncake store at "
                                 f"{self.config.master_server_address} within {timeout:g} s "
                                 f"(--store-timeout): the server's writer is behind or gone, or the "
                                 f"master evicted it before it was read (a store above its eviction "
                                 f"watermark, docs/store.md)")
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)

    def take(self, exp: Expected, index: int, input_ids: Optional[List[int]], full: bool) -> int:
        """Read ``exp``'s object and write it as ``OUT/hs_<index>.safetensors`` (module
        doc, step 3); returns the file's size. ``input_ids`` None: the object's own token
        ids stand (``expect``). ``FatalError`` when the master is gone (``_stop_if_gone``),
        ``FetchError`` when the object is, has another size or other token ids; ``CheckError`` when the written file fails
        ``check_file``; ``OSError`` on I/O. The final name never holds a partial file."""
        layout = exp.layout
        size = self.client.size(exp.handle)
        if size < 0:
            self._stop_if_gone()  # a dead master answers sizes with -900 as well
            raise FetchError(f"the sample {exp.handle!r} vanished from the store before it was read "
                             f"(status {size}: evicted, or taken by another reader)")
        if size != layout.total_bytes:
            raise FetchError(f"the store object {exp.handle!r} has {size} bytes, its manifest says "
                             f"total_aligned_bytes {layout.total_bytes}")
        try:
            buf = self.buffers.take(size)
        except st.StoreError as e:
            raise FetchError(str(e)) from None
        try:
            got = self.client.get_into(exp.handle, buf.addr, size)
            if got != size:
                if got < 0:
                    self._stop_if_gone()
                raise FetchError(f"reading {exp.handle!r} from the store gave {got} of {size} bytes")
            view = buf.view[:size]
            ids = layout.tensor(fmt.KEY_TOKEN_IDS)
            if input_ids is not None and \
                    view[ids.offset:ids.offset + ids.nbytes].cast("q").tolist() != list(input_ids):
                raise FetchError(f"the store object {exp.handle!r} holds other token ids than the request's")
            specs = fmt.dump_tensors(layout.num_tokens, *layout.tensor(fmt.KEY_HIDDEN_STATES).shape[1:],
                                     layout.dtype)
            file = fmt.file_layout(specs, exp.metadata)
            with Staged(self.out_dir, final_name(index)) as staged:
                tmp, fd = staged.create(self.mode)
                try:
                    fmt.pwrite_all(fd, file.header, 0)
                    for t in layout.tensors:
                        fmt.pwrite_all(fd, view[t.offset:t.offset + t.nbytes], file.offsets[t.name])
                    os.fsync(fd)
                finally:
                    os.close(fd)
                check_file(os.path.join(self.out_dir, tmp), input_ids, full)
                staged.publish(tmp)
        finally:
            self.buffers.give(buf)
        hs = layout.tensor(fmt.KEY_HIDDEN_STATES)
        if self.shape is None:
            self.shape = (hs.shape[1], hs.shape[2], layout.dtype)
        return file.size

    def source(self, handle: str) -> str:
        """The manifest line's ``source`` of a sample taken from ``handle``."""
        return f"{self.url_base}/{handle}"

    async def remove(self, handle: str) -> bool:
        """Remove ``handle`` and ``<handle>:error`` and journal it done; False (and the
        handle stays journaled for the next sweep) when the master does not answer, or is
        ``gone`` (not asked)."""
        if self.gone is not None:
            return False

        def remove():
            try:
                if handle.startswith(_SENT_PREFIX):  # no answer came: any suffix the server chose
                    self.client.remove_matching(_sent_pattern(handle[len(_SENT_PREFIX):]))
                else:
                    self.client.remove(handle)
            except st.StoreError:
                return False
            return True

        if not await asyncio.to_thread(remove):
            return False
        for handles in self.open.values():
            if handles.pop(handle, None) is not None:
                self._append({"done": handle})
        return True

    async def consumed(self, index: int) -> None:
        """Row ``index`` is in OUT and in the manifest: remove every object journaled for
        it (the one taken, and any of earlier tries)."""
        for handle in list(self.open.get(index, {})):
            await self.remove(handle)

    async def sweep(self) -> Tuple[int, int]:
        """At the end of a run that was not interrupted: remove every journaled object left
        (tries given up on); the journal goes once none is left. Returns ``(removed,
        kept)``: kept are those the master did not answer for."""
        removed = kept = 0
        for index in list(self.open):
            for handle in list(self.open[index]):
                if await self.remove(handle):
                    removed += 1
                else:
                    kept += 1
        self._rewrite()
        return removed, kept
