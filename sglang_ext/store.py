"""The Mooncake Store contract: what one request's sample is, in hs-connectors' layout.

A trainer on another node reads our samples with hs-connectors 0.9.0's
``MooncakeTransfer.get_generated(manifest)`` (speculators' ``--hidden-states-backend
mooncake``), unchanged. The contract (docs/store.md) comes from hs-connectors'
``mooncake_store.py`` (``packed_layout``, ``MooncakeHiddenStatesStore.put_error`` /
``get_sample``) and ``mooncake_hidden_states_connector.py`` (``sanitize_key``,
``request_finished``'s transfer manifest):

- the object's key is ``unique_handle(rid)``: ``handle_for(rid)`` + ``-`` + 32 random hex
  digits (128 bits), so it is never another answer's (readers take it from the manifest); its bytes are the tensors of
  ``format.dump_tensors`` (``hidden_states`` ``[T, L, H]``, fp8 adds
  ``hidden_states_scales`` float32 ``[T, L, 1]``, ``token_ids`` int64 ``[T]``), each at a
  64-byte-aligned offset, zero padding between and after, ``total_bytes`` in all
  (``pack_layout``); the reader rejects an object of any other size;
- a failure is the object ``<handle>:error`` holding ``{"error": message}`` (JSON, message
  cut to 4096 characters), which the reader checks before the sample;
- the manifest (``PackedLayout.manifest``) travels in the response, where vLLM puts its
  ``kv_transfer_params``.

Here too: the connection settings (``StoreConfig``, from a ``mooncake://`` URL) and what
Mooncake's status codes mean (``status_error``). Talking to Mooncake is
``sglang_ext.store_client``'s job (it imports this module, never the reverse); nothing
here imports mooncake, so the scheduler and the client build configs, handles, layouts
and manifests without it.
"""
from __future__ import annotations

import ipaddress
import os
import re
import secrets
import socket
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
RPC_TIMEOUT = -901  # the master did not answer within MC_RPC_TIMEOUT_MS (a hung or stopped master)

Part = Union[Tuple[int, int], bytes, bytearray, memoryview]


class StoreError(RuntimeError):
    """A store operation failed; the message is one sentence, the request's error."""


class StoreFull(StoreError):
    """No segment has room for the object (Mooncake status -200)."""


class StoreUnavailable(StoreError):
    """The master does not answer, or the client cannot be set up."""


# ---------------------------------------------------------------- configuration

_CONTROL = re.compile(r"[\s\x00-\x1f\x7f]")  # whitespace (any script's) or a control character
# ASCII digits only: re's \d and int() also take other scripts' ('\uff14' is 4)
_SIZE = re.compile(r"([0-9]+)[ \t]*(|b|k|kb|kib|m|mb|mib|g|gb|gib|t|tb|tib)", re.IGNORECASE | re.ASCII)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(key: str, text: str) -> int:
    """Bytes from ``"4294967296"``, ``"4GiB"``, ``"512m"`` (ASCII digits, binary units); ``ValueError``
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


def metadata_address(url: str) -> Optional[Tuple[str, int]]:
    """``(host, port)`` of a ``metadata_server`` URL (``http://HOST:PORT/metadata``,
    ``etcd://HOST:PORT``, ``redis://HOST:PORT``), None when it names none."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https", "etcd", "redis") or not parts.hostname or port is None:
        return None
    return parts.hostname, port


def _redact(url: str) -> str:
    """``url`` with any ``USER:SECRET@`` cut out (a sentence never quotes a secret)."""
    return re.sub(r"(?<=://).*@", "", str(url), count=1)  # the last @: a secret may hold / ? #


def is_loopback(host: str) -> Optional[bool]:
    """Whether ``host`` (an address, ``[v6]`` too, or a name) is loopback only: every
    address it resolves to is. None when a name does not resolve."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return None
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


# The least ``local_buffer_size``: puts of bytes (error markers, up to ERROR_MAX_CHARS
# characters) and gets of bytes go through it (the handshake's reader lends 1 MiB too).
MIN_LOCAL_BUFFER = 1 << 20


@dataclass(frozen=True)
class StoreConfig:
    """Connection settings, with hs-connectors' ``MooncakeStoreConfig`` keys.

    ``global_segment_size`` bytes of this process's memory become the store's capacity
    (objects live in the producer's segment, trainers read them from there);
    ``local_buffer_size`` is Mooncake's client staging buffer: every put of bytes goes
    through it (the sink's error markers: ``store_client.StoreClient.put``), as do gets of
    bytes; a put from registered ranges (the writer's arena, its staging buffers of
    chunked-prefill samples) does not. A put of bytes that does not fit fails (status
    -600, one sentence).
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
        if self.local_buffer_size < MIN_LOCAL_BUFFER:
            raise ValueError(f"mooncake setting local_buffer_size {self.local_buffer_size} is below 1 MiB "
                             f"({MIN_LOCAL_BUFFER} bytes): every put of bytes (the sink's error markers) and "
                             f"get of bytes goes through it")
        for key in ("device_name", "local_hostname", "metadata_server", "master_server_address"):
            if _CONTROL.search(getattr(self, key)):
                raise ValueError(f"mooncake setting {key} {getattr(self, key)!r} holds whitespace or a control "
                                 f"character (a space, a NUL, a newline...): Mooncake would fail every request "
                                 f"with it")
        if self.metadata_server != "P2PHANDSHAKE" and metadata_address(self.metadata_server) is None:
            raise ValueError(f"mooncake setting metadata_server {self.metadata_server!r} is neither P2PHANDSHAKE "
                             f"nor a URL with a host and port (http://HOST:PORT/metadata, etcd://HOST:PORT, "
                             f"redis://HOST:PORT)")

    @classmethod
    def is_url(cls, text: str) -> bool:
        """Whether ``text`` names a store (``mooncake://...``) rather than a directory."""
        return str(text)[:len(SCHEME) + 3].lower() == SCHEME + "://"  # as from_url: any case

    @classmethod
    def from_url(cls, url: str) -> "StoreConfig":
        """``mooncake://HOST:PORT?protocol=tcp&device=mlx5_0&global_segment_size=4GiB&...``
        (keys: ``KEYS``; sizes in bytes or with KiB/MiB/GiB; a key given twice: the last
        wins, as in a query string, so a base URL can be extended with overrides).
        ``ValueError`` with one sentence for anything else (an empty ``local_hostname``,
        ``metadata_server`` or ``protocol`` included)."""
        try:
            parts = urlsplit(str(url))
            port = parts.port
        except ValueError:
            raise ValueError(f"{_redact(url)!r} is not a mooncake://HOST:PORT address") from None
        if parts.scheme != SCHEME or not parts.hostname or port is None or parts.path not in ("", "/"):
            raise ValueError(f"{_redact(url)!r} is not a mooncake://HOST:PORT address (the master's)")
        if parts.fragment or str(url).endswith("#"):
            raise ValueError(f"{_redact(url)!r} has a '#' part, which is no setting: give every setting as "
                             f"?key=value&key=value")
        if parts.username is not None or parts.password is not None:
            raise ValueError(f"{_redact(url)!r} carries credentials (USER:SECRET@), which Mooncake's master "
                             f"neither takes nor checks: remove them (docs/store.md says who can read the store)")
        kwargs: Dict[str, Any] = {}
        for key, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False):
            name = cls.KEYS.get(key)
            if name is None:
                raise ValueError(f"unknown mooncake setting {key!r}; known: {', '.join(sorted(cls.KEYS))}")
            if not value and name in ("local_hostname", "metadata_server", "protocol"):
                raise ValueError(f"mooncake setting {key!r} is empty: give a value or leave the key out "
                                 f"(its default)")
            kwargs[name] = parse_size(key, value) if name.endswith("_size") else value
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        return cls(master_server_address=f"{host}:{port}", **kwargs)

    def memory_problem(self) -> Optional[str]:
        """One sentence when ``global_segment_size`` + ``local_buffer_size`` exceed this
        host's physical memory (Mooncake would map them and then fail puts, or the
        process be killed), else None."""
        try:
            ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return None
        want = self.global_segment_size + self.local_buffer_size
        if want <= ram:
            return None
        return (f"mooncake settings global_segment_size {self.global_segment_size} + local_buffer_size "
                f"{self.local_buffer_size} bytes are more than this host's memory ({ram} bytes)")

    def loopback_warning(self) -> Optional[str]:
        """One sentence when ``local_hostname`` (by default this host name's address,
        often 127.0.1.1 on Debian) is loopback while the master is not: a trainer on
        another node would be told to fetch this node's segment from its own loopback.
        None otherwise (both on loopback: one node, which is fine)."""
        if not is_loopback(self.local_hostname):
            return None
        if is_loopback(self.master_server_address.rpartition(":")[0]) is not False:
            return None
        return (f"the Mooncake local_hostname {self.local_hostname} is a loopback address while the master "
                f"at {self.master_server_address} is not, so trainers on other nodes cannot read this "
                f"node's objects: give this node's reachable address with the local_hostname URL key "
                f"(mooncake://HOST:PORT?local_hostname=ADDR) or $MOONCAKE_LOCAL_HOSTNAME")

    def as_hs_connectors(self) -> Dict[str, Any]:
        """The same settings as hs-connectors' ``MooncakeStoreConfig.from_dict`` takes
        (what a trainer passes; ``global_segment_size`` 0 there: a reader lends none)."""
        return {
            "local_hostname": self.local_hostname, "metadata_server": self.metadata_server,
            "master_server_address": self.master_server_address,
            "global_segment_size": self.global_segment_size, "local_buffer_size": self.local_buffer_size,
            "protocol": self.protocol, "device_name": self.device_name,
        }



# ---------------------------------------------------------------- handles and layout


def handle_for(rid: str) -> str:
    """The object key of request ``rid``: hs-connectors' ``sanitize_key`` (every character
    outside ``[a-zA-Z0-9_-]`` becomes ``_``; a leading digit gets a ``k`` prefix, so an
    SGLang uuid-hex rid ``"3f2a..."`` is ``"k3f2a..."``). Distinct rids can share a
    handle (``a.b`` and ``a_b``); ``store_client.StoreClient.put`` refuses a handle that exists.
    ``ValueError`` for an empty rid."""
    if not rid:
        raise ValueError("an empty request id has no store handle")
    safe = _UNSAFE_KEY.sub("_", str(rid))
    return "k" + safe if safe[:1].isdigit() else safe


HANDLE_SUFFIX_HEX = 32  # hex digits of unique_handle's random suffix: 128 bits
OLD_SUFFIX_HEX = 8  # servers before 128-bit suffixes


def unique_handle(rid: str) -> str:
    """The handle of one answer for request ``rid``: ``handle_for(rid)`` + ``"-"`` + 32
    random hex digits (``secrets.token_hex(16)``, 128 bits). A key per answer, not per
    rid: two scheduler processes, servers sharing a master, a repeated rid, or rids that
    sanitize alike (``a.b``/``a_b``) never share an object or a stale ``<handle>:error``.
    (A collision, refused by ``store_client.StoreClient.put``, fails both requests
    through the marker.) hs-connectors' reader takes the handle as an opaque key.
    ``ValueError`` for an empty rid."""
    return f"{handle_for(rid)}-{secrets.token_hex(HANDLE_SUFFIX_HEX // 2)}"


def handle_matches(rid: str, handle: str) -> bool:
    """Whether ``handle`` is one the server may name for ``rid``: ``handle_for(rid)``
    itself (servers before unique handles) or that + ``-`` + 32 (or, from servers before
    128-bit suffixes, 8) lowercase hex digits (``unique_handle``); anything else is
    another request's."""
    base = handle_for(rid)
    return handle == base or re.fullmatch(re.escape(base) + "-" + SUFFIX_RE, handle) is not None


SUFFIX_RE = "(?:[0-9a-f]{%d}|[0-9a-f]{%d})" % (HANDLE_SUFFIX_HEX, OLD_SUFFIX_HEX)


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


def status_error(op: str, key: str, rc: int, nbytes: int, config: StoreConfig) -> StoreError:
    """One sentence for Mooncake status ``rc`` of ``op`` on ``key``."""
    if rc == NO_AVAILABLE_HANDLE and 0 < config.global_segment_size < nbytes:  # 0: store nodes lend
        return StoreFull(
            f"the store object {key!r} ({nbytes} bytes) is larger than the whole segment this process "
            f"lends (global_segment_size {config.global_segment_size} bytes) and no segment has room for "
            f"it: raise global_segment_size above the largest sample's size (or let store nodes lend "
            f"larger segments)")
    if rc == NO_AVAILABLE_HANDLE:
        return StoreFull(
            f"the Mooncake store has no room for {key!r} ({nbytes} bytes): trainers must consume "
            f"samples faster, or raise global_segment_size ({config.global_segment_size} bytes now)")
    if rc in (RPC_FAIL, RPC_TIMEOUT):
        return StoreUnavailable(
            f"the Mooncake master at {config.master_server_address} does not answer ({op} of {key!r} failed"
            f"{' after MC_RPC_TIMEOUT_MS' if rc == RPC_TIMEOUT else ''})")
    if rc == OBJECT_ALREADY_EXISTS:
        return StoreError(f"store handle {key!r} already holds another answer's object (a handle collision)")
    return StoreError(f"Mooncake {op} of {key!r} failed with status {rc}")
