"""The Mooncake Store sink: one packed object per request, in hs-connectors' layout.

A trainer on another node reads our samples with hs-connectors 0.9.0's
``MooncakeTransfer.get_generated(manifest)`` (speculators' ``--hidden-states-backend
mooncake``), unchanged. The contract (docs/store.md) comes from hs-connectors'
``mooncake_store.py`` (``packed_layout``, ``MooncakeHiddenStatesStore.put_error`` /
``get_sample``) and ``mooncake_hidden_states_connector.py`` (``sanitize_key``,
``request_finished``'s transfer manifest):

- the object's key is ``unique_handle(rid)``: ``handle_for(rid)`` + ``-`` + 8 random hex
  digits, so it is never another answer's (readers take it from the manifest); its bytes are the tensors of
  ``format.dump_tensors`` (``hidden_states`` ``[T, L, H]``, fp8 adds
  ``hidden_states_scales`` float32 ``[T, L, 1]``, ``token_ids`` int64 ``[T]``), each at a
  64-byte-aligned offset, zero padding between and after, ``total_bytes`` in all
  (``pack_layout``); the reader rejects an object of any other size;
- a failure is the object ``<handle>:error`` holding ``{"error": message}`` (JSON, message
  cut to 4096 characters), which the reader checks before the sample;
- the manifest (``PackedLayout.manifest``) travels in the response, where vLLM puts its
  ``kv_transfer_params``.

A Mooncake put is all-or-nothing: the master allocates the replica (PutStart), the client
copies the bytes, then PutEnd makes the key visible; a failed copy revokes it. So a key
is never readable half-written (tests/integration/test_store.py checks this with a reader polling
during large puts). A put to a key that exists returns success and keeps the old bytes
(seen with 0.3.13.post1), so ``StoreSink.put`` refuses an existing handle itself.

Mooncake is imported lazily (``StoreSink.connect``): nothing here needs it to build
configs, handles or layouts.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import secrets
import socket
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union
from urllib.parse import parse_qsl, urlsplit

from sglang_ext import format as fmt

SCHEME = "mooncake"
MANIFEST_VERSION = 1  # hs_connectors.mooncake_store.VERSION
TENSOR_ALIGN = 64  # hs_connectors.mooncake_store._TENSOR_ALIGN
ERROR_SUFFIX = ":error"  # MooncakeHiddenStatesStore.put_error's key
ERROR_MAX_CHARS = 4096  # put_error keeps error[:4096]
EXTRACT_MODE = "prompt_only"  # the manifest's metadata.extract_mode for prompt hidden states
HOSTNAME_ENV = "MOONCAKE_LOCAL_HOSTNAME"  # hs-connectors' override of the local hostname
_UNSAFE_KEY = re.compile(r"[^a-zA-Z0-9_-]")

# Mooncake's status codes (mooncake-store types.h ErrorCode) that need their own words.
NO_AVAILABLE_HANDLE = -200  # no segment has room for the replica
INVALID_PARAMS = -600  # e.g. a put of bytes larger than what the local buffer has free
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900  # the master did not answer

Part = Union[Tuple[int, int], bytes, bytearray, memoryview]


class StoreError(RuntimeError):
    """A store operation failed; the message is one sentence, the request's error."""


class StoreFull(StoreError):
    """No segment has room for the object (Mooncake status -200)."""


class StoreUnavailable(StoreError):
    """The master does not answer, or the client cannot be set up."""


# ---------------------------------------------------------------- configuration

_SIZE = re.compile(r"(\d+)\s*(|b|k|kb|kib|m|mb|mib|g|gb|gib|t|tb|tib)", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(key: str, text: str) -> int:
    """Bytes from ``"4294967296"``, ``"4GiB"``, ``"512m"`` (binary units); ``ValueError``
    with one sentence otherwise."""
    m = _SIZE.fullmatch(str(text).strip())
    if not m:
        raise ValueError(f"mooncake setting {key}={text!r} is not a size (bytes, or a number with KiB/MiB/GiB)")
    return int(m.group(1)) * _UNITS[m.group(2)[:1].lower()]


def default_hostname() -> str:
    """The address trainers reach this node's segment at: ``$MOONCAKE_LOCAL_HOSTNAME``,
    else this host name's address (hs-connectors' ``MooncakeBackend`` rule)."""
    name = os.environ.get(HOSTNAME_ENV)
    if name:
        return name
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


@dataclass(frozen=True)
class StoreConfig:
    """Connection settings, with hs-connectors' ``MooncakeStoreConfig`` keys.

    ``global_segment_size`` bytes of this process's memory become the store's capacity
    (objects live in the producer's segment, trainers read them from there);
    ``local_buffer_size`` is Mooncake's client staging buffer: every put of bytes goes
    through it (error markers, and the whole sample of a chunked-prefill request, whose
    parts are joined into bytes: ``StoreSink.put``), as do gets; a put from a registered
    range (the writer's arena) does not. A put of bytes that does not fit fails (status
    -600, one sentence); size it to at least the largest chunked-prefill sample times
    the writer threads (docs/store.md).
    ``metadata_server`` ``P2PHANDSHAKE`` needs no etcd/HTTP metadata service.
    """

    master_server_address: str
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = 4 << 30
    local_buffer_size: int = 256 << 20
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = field(default_factory=default_hostname)

    # url key -> field; "device" and "master" are the short forms of hs-connectors' CLI.
    KEYS = {
        "protocol": "protocol", "device_name": "device_name", "device": "device_name",
        "global_segment_size": "global_segment_size", "local_buffer_size": "local_buffer_size",
        "metadata_server": "metadata_server", "local_hostname": "local_hostname",
    }

    def __post_init__(self):
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"mooncake protocol must be tcp or rdma, not {self.protocol!r}")
        host, _, port = self.master_server_address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"mooncake master address {self.master_server_address!r} is not HOST:PORT")
        for key in ("global_segment_size", "local_buffer_size"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 0:
                raise ValueError(f"mooncake setting {key} must be a byte count >= 0, not {getattr(self, key)!r}")

    @classmethod
    def is_url(cls, text: str) -> bool:
        """Whether ``text`` names a store (``mooncake://...``) rather than a directory."""
        return str(text).startswith(SCHEME + "://")

    @classmethod
    def from_url(cls, url: str) -> "StoreConfig":
        """``mooncake://HOST:PORT?protocol=tcp&device=mlx5_0&global_segment_size=4GiB&...``
        (keys: ``KEYS``; sizes in bytes or with KiB/MiB/GiB). ``ValueError`` with one
        sentence for anything else."""
        try:
            parts = urlsplit(str(url))
            port = parts.port
        except ValueError:
            raise ValueError(f"{url!r} is not a mooncake://HOST:PORT address") from None
        if parts.scheme != SCHEME or not parts.hostname or port is None or parts.path not in ("", "/"):
            raise ValueError(f"{url!r} is not a mooncake://HOST:PORT address (the master's)")
        kwargs: Dict[str, Any] = {}
        for key, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False):
            name = cls.KEYS.get(key)
            if name is None:
                raise ValueError(f"unknown mooncake setting {key!r}; known: {', '.join(sorted(cls.KEYS))}")
            kwargs[name] = parse_size(key, value) if name.endswith("_size") else value
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        return cls(master_server_address=f"{host}:{port}", **kwargs)

    def as_hs_connectors(self) -> Dict[str, Any]:
        """The same settings as hs-connectors' ``MooncakeStoreConfig.from_dict`` takes
        (what a trainer passes; ``global_segment_size`` 0 there: a reader lends none)."""
        return {
            "local_hostname": self.local_hostname, "metadata_server": self.metadata_server,
            "master_server_address": self.master_server_address,
            "global_segment_size": self.global_segment_size, "local_buffer_size": self.local_buffer_size,
            "protocol": self.protocol, "device_name": self.device_name,
        }


INSTALL_HINT = "pip install -r requirements/store.txt"


def mooncake_import_error() -> Optional[str]:
    """``None`` when ``mooncake.store`` imports, else a phrase to follow a subject (``"the
    store sink " + phrase``) that quotes the ``ImportError``: the package missing, or its
    extension missing a shared library (libibverbs, librdmacm, libnuma: Debian's
    libibverbs1 librdmacm1 libnuma1). Importing is what finds the latter; ``find_spec``
    does not."""
    try:
        import mooncake.store  # noqa: F401, PLC0415
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "mooncake":
            return f"needs the mooncake package ({INSTALL_HINT})"
        return (f"cannot import mooncake.store ({str(e)[:300]}): install what it names (Debian: "
                f"libibverbs1 librdmacm1 libnuma1) or reinstall mooncake ({INSTALL_HINT})")
    return None


# ---------------------------------------------------------------- handles and layout


def handle_for(rid: str) -> str:
    """The object key of request ``rid``: hs-connectors' ``sanitize_key`` (every character
    outside ``[a-zA-Z0-9_-]`` becomes ``_``; a leading digit gets a ``k`` prefix, so an
    SGLang uuid-hex rid ``"3f2a..."`` is ``"k3f2a..."``). Distinct rids can share a
    handle (``a.b`` and ``a_b``); ``StoreSink.put`` refuses a handle that exists.
    ``ValueError`` for an empty rid."""
    if not rid:
        raise ValueError("an empty request id has no store handle")
    safe = _UNSAFE_KEY.sub("_", str(rid))
    return "k" + safe if safe[:1].isdigit() else safe


HANDLE_SUFFIX_HEX = 8  # hex digits of unique_handle's random suffix


def unique_handle(rid: str) -> str:
    """The handle of one answer for request ``rid``: ``handle_for(rid)`` + ``"-"`` + 8
    random hex digits (``secrets.token_hex(4)``). A key per answer, not per rid: two
    scheduler processes, servers sharing a master, a repeated rid, or rids that sanitize
    alike (``a.b``/``a_b``) never share an object or a stale ``<handle>:error``; 2**32
    suffixes per rid make a collision (refused by ``StoreSink.put``) negligible.
    ``ValueError`` for an empty rid."""
    return f"{handle_for(rid)}-{secrets.token_hex(HANDLE_SUFFIX_HEX // 2)}"


def handle_matches(rid: str, handle: str) -> bool:
    """Whether ``handle`` is one the server may name for ``rid``: ``handle_for(rid)``
    itself (servers before unique handles) or that + ``-`` + 8 lowercase hex digits
    (``unique_handle``); anything else is another request's."""
    base = handle_for(rid)
    return handle == base or re.fullmatch(re.escape(base) + "-[0-9a-f]{%d}" % HANDLE_SUFFIX_HEX, handle) is not None


def _align(n: int) -> int:
    return -(-n // TENSOR_ALIGN) * TENSOR_ALIGN


@dataclass(frozen=True)
class PackedTensor:
    """One tensor of a packed object: ``dtype`` a torch dtype name (``"bfloat16"``),
    ``offset``/``nbytes`` in bytes from the object's start."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class PackedLayout:
    """A packed object: ``tensors`` in order, 64-byte-aligned offsets, ``total_bytes``
    (the last tensor's end rounded up to 64, as hs-connectors' ``packed_layout``)."""

    tensors: Tuple[PackedTensor, ...]
    total_bytes: int
    num_tokens: int
    dtype: str

    def tensor(self, name: str) -> PackedTensor:
        """The tensor called ``name`` (``KeyError`` if the layout has none)."""
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def manifest(self, handle: str, file_metadata: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
        """The transfer manifest, version 1 (``request_finished``'s dict in hs-connectors'
        connector): ``handle``, ``version``, ``tensors`` {name: shape, dtype
        ``"torch.<name>"``, nbytes, offset}, ``metadata`` {num_tokens,
        total_aligned_bytes, extract_mode}; fp8 adds metadata ``scale_layout``.
        ``file_metadata`` (the file sink's ``__metadata__``: format, rid, layer_ids,
        num_layers, model_path, versions) joins ``metadata`` where it adds a key, so
        ``extract --store`` writes the file the file sink would have; hs-connectors'
        reader reads only the keys above."""
        meta: Dict[str, Any] = {
            "num_tokens": self.num_tokens, "total_aligned_bytes": self.total_bytes,
            "extract_mode": EXTRACT_MODE,
        }
        if self.dtype == fmt.FP8:
            meta[fmt.SCALE_LAYOUT_KEY] = fmt.SCALE_LAYOUT
        for key, value in (file_metadata or {}).items():
            meta.setdefault(key, value)
        return {
            "handle": handle,
            "version": MANIFEST_VERSION,
            "tensors": {
                t.name: {"shape": list(t.shape), "dtype": "torch." + t.dtype, "nbytes": t.nbytes, "offset": t.offset}
                for t in self.tensors
            },
            "metadata": meta,
        }

    def pack(self, data: Dict[str, Sequence[Part]]) -> List[Part]:
        """The parts of the whole object in order: each tensor's pieces (``data[name]``:
        ``(addr, nbytes)`` ranges or bytes-like, e.g. one per prefill chunk) with zero
        padding between tensors and at the end. ``ValueError`` when a tensor is missing,
        extra, or its pieces do not add up to its ``nbytes``."""
        if set(data) != {t.name for t in self.tensors}:
            raise ValueError(
                f"packed object needs tensors {[t.name for t in self.tensors]}, got {sorted(data)}")
        parts: List[Part] = []
        pos = 0
        for t in self.tensors:
            if t.offset > pos:
                parts.append(bytes(t.offset - pos))
            got = sum(part_size(p) for p in data[t.name])
            if got != t.nbytes:
                raise ValueError(f"tensor {t.name!r} has {got} bytes, the layout needs {t.nbytes}")
            parts.extend(p for p in data[t.name] if part_size(p))
            pos = t.offset + t.nbytes
        if self.total_bytes > pos:
            parts.append(bytes(self.total_bytes - pos))
        return parts


def pack_layout(num_tokens: int, num_slots: int, hidden_size: int, dtype: str) -> PackedLayout:
    """The packed layout of one request: ``format.dump_tensors``' tensors (``hidden_states``
    ``[T, L, H]`` of ``dtype``; for ``dtype == "float8_e4m3fn"`` ``hidden_states_scales``
    float32 ``[T, L, 1]``; ``token_ids`` int64 ``[T]``), each at a 64-byte-aligned offset.
    ``format.DumpFormatError`` for a dtype safetensors cannot hold."""
    specs = fmt.dump_tensors(num_tokens, num_slots, hidden_size, dtype)
    tensors, pos = [], 0
    for s in specs:
        tensors.append(PackedTensor(s.name, s.dtype, tuple(int(d) for d in s.shape), pos, s.nbytes))
        pos = _align(pos + s.nbytes)
    return PackedLayout(tuple(tensors), pos, int(num_tokens), dtype)


def part_size(part: Part) -> int:
    """Bytes in one part: an ``(addr, nbytes)`` range or a bytes-like object."""
    if isinstance(part, tuple):
        return int(part[1])
    return memoryview(part).nbytes


# ---------------------------------------------------------------- the sink


class StoreSink:
    """One Mooncake client: puts packed objects and error markers, removes them.

    ``connect`` sets the client up (its segment, ``global_segment_size`` bytes of this
    process's memory, holds every object it puts until removed or evicted, and vanishes
    with the process). ``register`` a host range once (the shared arena) and parts that
    lie in registered ranges are put straight from there (``put_from`` /
    ``batch_put_from_multi_buffers``: the client copies them into the segment before the
    call returns, so the range may be reused right after). Parts that are not all in
    registered memory are joined and put as bytes (one extra host copy).
    One sink serves several threads: Mooncake's client is thread-safe (hs-connectors'
    connector puts from a thread pool through one client); registration is locked here.
    """

    def __init__(self, config: StoreConfig):
        self.config = config
        self._store: Any = None
        self._lock = threading.Lock()
        self._regions: List[Tuple[int, int]] = []
        self._zero_page: Any = None  # ctypes buffer of TENSOR_ALIGN zeros, registered on first use
        self._zero_lock = threading.Lock()

    # -- setup

    def connect(self) -> "StoreSink":
        """Set the client up (idempotent). ``StoreUnavailable`` when the mooncake package
        is missing or the master at ``master_server_address`` cannot be reached."""
        with self._lock:
            if self._store is not None:
                return self
            why = mooncake_import_error()
            if why is not None:
                raise StoreUnavailable(f"the Mooncake store sink {why}")
            from mooncake.store import MooncakeDistributedStore  # noqa: PLC0415

            c = self.config
            store = MooncakeDistributedStore()
            try:
                rc = store.setup(c.local_hostname, c.metadata_server, c.global_segment_size,
                                 c.local_buffer_size, c.protocol, c.device_name, c.master_server_address)
            except Exception as e:  # noqa: BLE001 - pybind raises RuntimeError/TypeError
                raise StoreUnavailable(
                    f"could not set up the Mooncake client for the master at {c.master_server_address}: {e}") from None
            if rc != 0:
                raise StoreUnavailable(
                    f"could not set up the Mooncake client for the master at {c.master_server_address} "
                    f"(status {rc}: is mooncake_master running there?)")
            self._store = store
            return self

    def close(self) -> None:
        """Close the client: its segment, and every object in it, goes away."""
        with self._lock:
            store, self._store = self._store, None
            self._regions = []
            self._zero_page = None
        if store is not None:
            store.close()

    def _client(self) -> Any:
        if self._store is None:
            raise StoreError("the store sink is not connected (call connect() first)")
        return self._store

    def register(self, addr: int, size: int) -> None:
        """Register host memory ``[addr, addr + size)`` once for zero-copy puts (the shared
        arena's mapping). ``StoreError`` if Mooncake refuses it."""
        rc = self._client().register_buffer(int(addr), int(size))
        if rc != 0:
            raise StoreError(f"Mooncake refused to register {size} bytes of host memory at {addr:#x} (status {rc})")
        with self._lock:
            self._regions.append((int(addr), int(size)))

    def unregister(self, addr: int) -> None:
        """Undo ``register`` for the range that starts at ``addr``."""
        with self._lock:
            self._regions = [r for r in self._regions if r[0] != addr]
        self._client().unregister_buffer(int(addr))

    def _registered(self, addr: int, size: int) -> bool:
        return any(a <= addr and addr + size <= a + n for a, n in self._regions)

    # -- puts

    def put(self, handle: str, parts: Sequence[Part]) -> int:
        """Put the concatenation of ``parts`` as one object under ``handle``; returns its
        size in bytes. The object is visible only once whole. ``StoreError`` (one
        sentence) when ``handle`` already exists or the put fails; ``StoreFull`` when no
        segment has room; ``StoreUnavailable`` when the master does not answer."""
        store = self._client()
        total = sum(part_size(p) for p in parts)
        if total == 0:
            raise StoreError(f"store object {handle!r} would be empty")
        self._check_absent(store, handle)
        ranges = [p for p in parts if isinstance(p, tuple)]
        if len(ranges) == len(parts) and all(self._registered(a, n) for a, n in ranges):
            if len(ranges) == 1:
                rc = store.put_from(handle, int(ranges[0][0]), int(ranges[0][1]))
            else:
                rc = store.batch_put_from_multi_buffers(
                    [handle], [[int(a) for a, _ in ranges]], [[int(n) for _, n in ranges]])[0]
        else:
            rc = store.put(handle, b"".join(_as_bytes(p) for p in parts))
            if rc == INVALID_PARAMS:  # the client could not take the bytes into its local buffer
                raise StoreError(
                    f"the store object {handle!r} ({total} bytes) does not fit the Mooncake client's local "
                    f"buffer (local_buffer_size {self.config.local_buffer_size} bytes, shared by the "
                    f"writer threads' puts of bytes): raise local_buffer_size to at least the largest "
                    f"chunked-prefill sample times the writer threads (docs/store.md)")
        if rc != 0:
            raise status_error("put", handle, rc, total, self.config)
        return total

    def put_packed(self, handle: str, layout: PackedLayout, data: Dict[str, Sequence[Part]]) -> int:
        """Put one request's sample: ``layout.pack(data)`` under ``handle`` (``put``'s
        errors; ``ValueError`` when ``data`` does not match ``layout``). When every piece
        of ``data`` is a range, the zero padding comes from the sink's registered zero
        page (the put then reads registered memory only); else the parts are put as bytes."""
        parts = layout.pack(data)
        if all(isinstance(p, tuple) for pieces in data.values() for p in pieces):
            # the only bytes parts are pack's padding, each shorter than TENSOR_ALIGN
            parts = [self._zeros(part_size(p)) if isinstance(p, bytes) else p for p in parts]
        return self.put(handle, parts)

    def _zeros(self, n: int) -> Tuple[int, int]:
        """A registered range of ``n`` (< ``TENSOR_ALIGN``) zero bytes: the padding parts."""
        if n >= TENSOR_ALIGN:
            raise ValueError(f"{n} bytes of padding: more than the {TENSOR_ALIGN}-byte zero page")
        with self._zero_lock:
            if self._zero_page is None:
                page = ctypes.create_string_buffer(TENSOR_ALIGN)
                self.register(ctypes.addressof(page), TENSOR_ALIGN)
                self._zero_page = page
        return (ctypes.addressof(self._zero_page), n)

    def put_error(self, handle: str, message: str) -> None:
        """Put the error marker ``<handle>:error`` = ``{"error": message[:4096]}`` (JSON),
        which hs-connectors' reader raises as ``MooncakeIntegrityError``. ``put``'s errors."""
        body = json.dumps({"error": str(message)[:ERROR_MAX_CHARS]}).encode("utf-8")
        self.put(handle + ERROR_SUFFIX, [body])

    def remove(self, handle: str) -> None:
        """Remove ``handle`` and ``<handle>:error`` (hs-connectors' ``delete_sample``:
        forced past the lease; a missing object is not an error). ``StoreError`` else."""
        store = self._client()
        for key in (handle, handle + ERROR_SUFFIX):
            rc = store.remove(key, force=True)
            if rc not in (0, OBJECT_NOT_FOUND):
                raise status_error("remove", key, rc, 0, self.config)

    def exists(self, handle: str) -> bool:
        """Whether ``handle`` is visible (complete). ``StoreUnavailable``/``StoreError``
        when the master cannot say."""
        rc = self._client().is_exist(handle)
        if rc < 0:
            raise status_error("look-up", handle, rc, 0, self.config)
        return rc == 1

    def _check_absent(self, store: Any, handle: str) -> None:
        rc = store.is_exist(handle)
        if rc == 1:
            raise StoreError(f"store handle {handle!r} already holds an object (a repeated request id?)")
        if rc < 0:
            raise status_error("put", handle, rc, 0, self.config)


def _as_bytes(part: Part) -> bytes:
    if isinstance(part, tuple):
        return ctypes.string_at(int(part[0]), int(part[1]))
    return bytes(part)


def master_unreachable(config: StoreConfig, timeout_s: float = 5.0) -> Union[str, None]:
    """None when the master at ``config.master_server_address`` accepts a TCP connection
    within ``timeout_s`` seconds, else why not (one clause). Mooncake's own client setup
    retries a missing master for about 90 s: the server's start-up and ``extract --store``
    ask this first, so a typo costs seconds."""
    host, _, port = config.master_server_address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        return f"cannot reach the Mooncake master at {config.master_server_address} ({getattr(e, 'strerror', None) or e})"
    return None


def status_error(op: str, key: str, rc: int, nbytes: int, config: StoreConfig) -> StoreError:
    """One sentence for Mooncake status ``rc`` of ``op`` on ``key``."""
    if rc == NO_AVAILABLE_HANDLE:
        return StoreFull(
            f"the Mooncake store has no room for {key!r} ({nbytes} bytes): trainers must consume "
            f"samples faster, or raise global_segment_size ({config.global_segment_size} bytes now)")
    if rc == RPC_FAIL:
        return StoreUnavailable(
            f"the Mooncake master at {config.master_server_address} does not answer ({op} of {key!r} failed)")
    if rc == OBJECT_ALREADY_EXISTS:
        return StoreError(f"store handle {key!r} already holds an object (a repeated request id?)")
    return StoreError(f"Mooncake {op} of {key!r} failed with status {rc}")
