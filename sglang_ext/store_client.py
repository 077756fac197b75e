"""The Mooncake client both sides use: the writer process's store sink puts samples and
error markers with it (``store_writer``), ``extract --store`` reads and removes them
(``client/fetch.py``).

What the objects are (handles, the packed layout, the manifest, the status codes and
their sentences) is ``sglang_ext.store``, the contract; this module only talks to
Mooncake, and imports the contract, never the other way round. ``mooncake.store`` is
imported on ``StoreClient.connect`` only: a process that never connects (the scheduler,
a client without ``--store``) does not need the package.

A Mooncake put is all-or-nothing: the master allocates the replica (PutStart), the client
copies the bytes, then PutEnd makes the key visible; a failed copy revokes it. So a key
is never readable half-written (tests/integration/test_store.py checks this with a reader
polling during large puts). A put to a key that exists returns success and keeps the old
bytes (seen with 0.3.13.post1), so ``StoreClient.put`` refuses an existing handle itself.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from sglang_ext.store import (
    ERROR_MAX_CHARS, ERROR_SUFFIX, INVALID_PARAMS, OBJECT_NOT_FOUND, TENSOR_ALIGN, PackedLayout, Part,
    StoreConfig, StoreError, StoreUnavailable, metadata_address, part_size, status_error,
)

INSTALL_HINT = "pip install -r requirements/store.txt"
BUFFER_GRANULE = 4 << 20  # registered buffers are sized in steps of this many bytes
HANDSHAKE_S = 20.0  # the longest Mooncake's own set-up may take in ``handshake``'s subprocess
# Mooncake's defaults set by ``StoreClient.connect`` where the environment sets none: an RPC
# to the master gives up after 5 s, not 30 (a hung master fails puts in seconds), and the
# client's set-up tries 3 times, not 20 x 3 s, while it holds the GIL.
MOONCAKE_ENV = {"MC_RPC_TIMEOUT_MS": "5000", "MC_STORE_CLIENT_SETUP_RETRIES": "3"}
# Printed by Mooncake's transfer engine (transfer_metadata.cpp) at every client's set-up
# with P2PHANDSHAKE, before the client's own segment is registered; harmless.
BENIGN_SETUP_LINE = "Local segment descriptor not found"


class MooncakeMissing(StoreUnavailable):
    """``mooncake.store`` does not import here (the package, or a shared library its
    extension loads, is missing)."""


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


def master_unreachable(config: StoreConfig, timeout_s: float = 5.0) -> Optional[str]:
    """None when the master at ``config.master_server_address`` accepts a TCP connection
    within ``timeout_s`` seconds, else why not (one clause). Mooncake's own client setup
    retries a missing master for about 90 s: the server's start-up, the writer's
    connection and ``extract --store`` ask this first, so a typo costs seconds."""
    host, _, port = config.master_server_address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        return f"cannot reach the Mooncake master at {config.master_server_address} ({getattr(e, 'strerror', None) or e})"
    return None


_HANDSHAKE = """
import sys
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup(sys.argv[1], sys.argv[2], 0, 1 << 20, sys.argv[3], sys.argv[4], sys.argv[5])
print("handshake", rc, flush=True)
if rc == 0:
    s.close()
"""


def handshake(config: StoreConfig, timeout_s: float = HANDSHAKE_S, probe_s: float = 5.0) -> Optional[str]:
    """None when Mooncake's own client set-up against ``config``'s master completes
    within ``timeout_s`` seconds, else why not (one clause naming the master). The
    set-up runs in a short-lived subprocess (a reader's: no segment lent), because
    ``MooncakeDistributedStore.setup`` holds the GIL while it waits: against a master
    that accepts connections and never answers (hung, stopped, or an address that names
    its HTTP metrics port) it would freeze the calling process, signals included. The
    master's TCP port is probed first (``master_unreachable``, ``probe_s``)."""
    why = master_unreachable(config, probe_s)
    if why is not None:
        return why
    addr = config.master_server_address
    if config.metadata_server != "P2PHANDSHAKE":
        host, port = metadata_address(config.metadata_server)
        try:
            socket.create_connection((host, port), timeout=probe_s).close()
        except OSError as e:
            return (f"cannot reach the Mooncake metadata_server {config.metadata_server} "
                    f"({getattr(e, 'strerror', None) or e})")
    env = dict(os.environ, MC_LOG_LEVEL="ERROR", MC_STORE_CLIENT_SETUP_RETRIES="1",
               MC_RPC_TIMEOUT_MS=str(int(timeout_s * 500)), MC_RPC_CONNECT_TIMEOUT_MS=str(int(timeout_s * 500)))
    argv = [sys.executable, "-c", _HANDSHAKE, config.local_hostname, config.metadata_server,
            config.protocol, config.device_name, addr]
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
        timed_out = False
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except BaseException as e:  # the deadline, or a signal's exception (extract's SIGTERM)
            proc.kill()
            out, _ = proc.communicate()
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            timed_out = True
        err.seek(0)
        errors = [ln.strip() for ln in err.read().decode("utf-8", "replace").splitlines()
                  if ln.startswith("E") and BENIGN_SETUP_LINE not in ln]
    words = out.decode("utf-8", "replace").split()
    if words[:2] == ["handshake", "0"] and not timed_out:
        return None
    if timed_out or any("timed out" in ln for ln in errors):
        # the set-up's RPCs give up at half the deadline (MC_RPC_TIMEOUT_MS above): say which
        waited = timeout_s if timed_out else timeout_s / 2
        return (f"the Mooncake master at {addr} accepts connections but did not complete Mooncake's client "
                f"set-up within {waited:g} s (a hung or stopped mooncake_master, or an address naming "
                f"another service, e.g. the master's HTTP metrics port)")
    last = errors[-1].split("] ", 1)[-1][:200] if errors else f"exit status {proc.returncode}"
    status = words[1] if words[:1] == ["handshake"] and len(words) > 1 else "none"
    return (f"the Mooncake master at {addr} accepts connections but Mooncake's client set-up against it "
            f"failed (status {status}: {last}): is it mooncake_master's RPC port, and are the URL's settings "
            f"usable on this host?")


class StoreClient:
    """One Mooncake client: puts packed objects and error markers, looks them up, reads
    and removes them.

    ``connect`` sets the client up (its segment, ``global_segment_size`` bytes of this
    process's memory, holds every object put into it until removed or evicted, and
    vanishes with the process; a reader lends 0). ``register`` a host range once (the
    writer's arena, a ``RegisteredBuffers`` buffer) and parts that lie in registered
    ranges are put straight from there (``put_from`` / ``batch_put_from_multi_buffers``:
    the client copies them into the segment before the call returns, so the range may be
    reused right after). Parts that are not all in registered memory are joined and put
    as bytes (one extra host copy, through the client's local buffer).
    One client serves several threads: Mooncake's client is thread-safe (hs-connectors'
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

    def connect(self, subject: str = "the Mooncake store sink", probe_s: Optional[float] = None,
                handshake_s: Optional[float] = None) -> "StoreClient":
        """Set the client up (idempotent). ``MooncakeMissing`` (``subject`` + why) when
        ``mooncake.store`` does not import; ``StoreUnavailable`` when the master at
        ``master_server_address`` cannot be reached: with ``probe_s``, its TCP port is
        probed first (``master_unreachable``), so a dead master costs seconds rather than
        Mooncake's ~90 s of setup retries; with ``handshake_s`` too, Mooncake's own
        set-up is first completed in a subprocess within that many seconds
        (``handshake``: a hung master never freezes this process). ``MOONCAKE_ENV``'s
        defaults are set in the environment first (where it sets none). Mooncake's
        ``BENIGN_SETUP_LINE`` is kept off stderr."""
        with self._lock:
            if self._store is not None:
                return self
            why = mooncake_import_error()
            if why is not None:
                raise MooncakeMissing(f"{subject} {why}")
            from mooncake.store import MooncakeDistributedStore  # noqa: PLC0415

            c = self.config
            for key, value in MOONCAKE_ENV.items():
                os.environ.setdefault(key, value)
            if probe_s is not None:
                why = master_unreachable(c, probe_s)
                if why is not None:
                    raise StoreUnavailable(f"{why}: is mooncake_master running there?")
            if handshake_s is not None:
                why = handshake(c, handshake_s, probe_s or 5.0)
                if why is not None:
                    raise StoreUnavailable(why)
            store = MooncakeDistributedStore()
            try:
                with _stderr_without(BENIGN_SETUP_LINE):
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
            raise StoreError("the Mooncake client is not connected (call connect() first)")
        return self._store

    def register(self, addr: int, size: int) -> None:
        """Register host memory ``[addr, addr + size)`` once for zero-copy puts and gets.
        ``StoreError`` if Mooncake refuses it."""
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
                    f"client's puts of bytes): raise local_buffer_size (docs/store.md)")
        if rc != 0:
            raise status_error("put", handle, rc, total, self.config)
        return total

    def put_packed(self, handle: str, layout: PackedLayout, data: Dict[str, Sequence[Part]]) -> int:
        """Put one request's sample: ``layout.pack(data)`` under ``handle`` (``put``'s
        errors; ``ValueError`` when ``data`` does not match ``layout``). When every piece
        of ``data`` is a range, the zero padding comes from the client's registered zero
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

    # -- look-ups, reads, removal

    def exists(self, handle: str) -> bool:
        """Whether ``handle`` is visible (complete). ``StoreUnavailable``/``StoreError``
        when the master cannot say."""
        rc = self._client().is_exist(handle)
        if rc < 0:
            raise status_error("look-up", handle, rc, 0, self.config)
        return rc == 1

    def size(self, handle: str) -> int:
        """The object's size in bytes, or Mooncake's negative status (gone, evicted)."""
        return int(self._client().get_size(handle))

    def get(self, key: str) -> bytes:
        """The whole object ``key`` as bytes (through the client's local buffer: small
        objects, e.g. error markers)."""
        return bytes(self._client().get(key))

    def get_into(self, handle: str, addr: int, size: int) -> int:
        """Read ``handle`` into registered memory ``[addr, addr + size)``; returns the bytes
        read, or Mooncake's negative status."""
        return int(self._client().get_into(handle, int(addr), int(size)))

    def remove(self, handle: str) -> None:
        """Remove ``handle`` and ``<handle>:error`` (hs-connectors' ``delete_sample``:
        forced past the lease; a missing object is not an error). ``StoreError`` else."""
        store = self._client()
        for key in (handle, handle + ERROR_SUFFIX):
            rc = store.remove(key, force=True)
            if rc not in (0, OBJECT_NOT_FOUND):
                raise status_error("remove", key, rc, 0, self.config)

    def remove_matching(self, pattern: str) -> None:
        """Remove every object whose key matches the master's regex ``pattern`` (forced;
        none matching is not an error). ``StoreError`` when the master refuses."""
        rc = self._client().remove_by_regex(pattern, force=True)
        if rc < 0 and rc != OBJECT_NOT_FOUND:
            raise status_error("remove", pattern, rc, 0, self.config)

    def _check_absent(self, store: Any, handle: str) -> None:
        rc = store.is_exist(handle)
        if rc == 1:
            raise StoreError(f"store handle {handle!r} already holds another answer's object (a handle "
                             f"collision): both requests fail")
        if rc < 0:
            raise status_error("put", handle, rc, 0, self.config)


class _stderr_without:
    """While open, file descriptor 2 goes to a temporary file; on close its lines are
    written back to the real stderr, less those holding ``text`` (Mooncake's native
    threads write to fd 2 directly, so ``sys.stderr`` cannot filter them)."""

    def __init__(self, text: str):
        self.text = text.encode()

    def __enter__(self):
        try:
            sys.stderr.flush()
        except (AttributeError, OSError, ValueError):
            pass
        self.tmp = tempfile.TemporaryFile()
        try:
            self.saved = os.dup(2)
            os.dup2(self.tmp.fileno(), 2)
        except OSError:  # no stderr to filter
            self.saved = None
        return self

    def __exit__(self, *exc):
        if self.saved is None:
            self.tmp.close()
            return False
        os.dup2(self.saved, 2)
        os.close(self.saved)
        with self.tmp:
            self.tmp.seek(0)
            kept = b"".join(ln for ln in self.tmp.read().splitlines(keepends=True) if self.text not in ln)
        if kept:
            try:
                os.write(2, kept)
            except OSError:
                pass
        return False


def _as_bytes(part: Part) -> bytes:
    if isinstance(part, tuple):
        return ctypes.string_at(int(part[0]), int(part[1]))
    return bytes(part)


class Buffer:
    """One host buffer registered with a client: ``addr``, ``nbytes``, ``view`` (a
    writable ``memoryview`` of it). Anonymous ``mmap`` memory: page-aligned, and
    untouched pages cost nothing."""

    def __init__(self, nbytes: int):
        self.mm = mmap.mmap(-1, nbytes)
        self.nbytes = nbytes
        self.view = memoryview(self.mm)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))

    def close(self) -> None:
        self.view.release()
        try:
            self.mm.close()
        except BufferError:  # a ctypes view still refers to it: the mapping goes with the object
            pass


class RegisteredBuffers:
    """Host buffers registered with ``client`` once and reused: the writer's staging
    buffers of chunked-prefill samples, the reader's ``get_into`` buffers. ``take(n)``
    hands out a free buffer of at least ``n`` bytes (the smallest that fits) or registers
    a new one (sized up to ``BUFFER_GRANULE``), which replaces the free ones (all smaller:
    samples of growing size, a dataset sorted by length, would otherwise keep one buffer
    per size step, each resident once read into), so the pool never holds more buffers
    than were in use at once; a buffer is never handed out again until ``give`` returns
    it. Free buffers beyond ``keep_bytes`` in all are unregistered and unmapped on
    ``give`` (None: all kept). Thread-safe."""

    def __init__(self, client: StoreClient, keep_bytes: Optional[int] = None):
        self.client = client
        self.keep_bytes = keep_bytes
        self.free: List[Buffer] = []
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> Buffer:
        """A registered buffer of at least ``nbytes`` bytes, the caller's until ``give``.
        ``StoreError`` when Mooncake refuses to register a new one."""
        with self.lock:
            fits = [b for b in self.free if b.nbytes >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.nbytes)
                self.free.remove(buf)
                return buf
            smaller, self.free = self.free, []
        for b in smaller:
            self._drop(b)
        buf = Buffer(-(-max(nbytes, 1) // BUFFER_GRANULE) * BUFFER_GRANULE)
        try:
            self.client.register(buf.addr, buf.nbytes)
        except StoreError:
            buf.close()
            raise
        return buf

    def give(self, buf: Buffer) -> None:
        """``buf`` is free again (nothing reads or writes it any more)."""
        drop: List[Buffer] = []
        with self.lock:
            self.free.append(buf)
            if self.keep_bytes is not None:
                self.free.sort(key=lambda b: b.nbytes)
                while self.free and sum(b.nbytes for b in self.free) > self.keep_bytes:
                    drop.append(self.free.pop())
        for b in drop:
            self._drop(b)

    def close(self) -> None:
        """Unregister and unmap the free buffers (those handed out are the takers')."""
        with self.lock:
            bufs, self.free = self.free, []
        for b in bufs:
            self._drop(b)

    def _drop(self, buf: Buffer) -> None:
        try:
            self.client.unregister(buf.addr)
        except StoreError:
            pass  # the client is closed: its registrations went with it
        buf.close()

