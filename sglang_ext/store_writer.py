"""The writer process's store sink: a request's ops become one packed object in Mooncake Store.

The file sink's counterpart (``writer_process.Writer``), with the same ops, the same
acknowledgements and the same threads; ``writer_process.serve`` picks one of the two.
Per request (``store.pack_layout``, docs/store.md):

1. ``Begin``: the layout is known (tokens, layer slots, hidden size, dtype); the token
   ids (int64 ``[T]``) are in the arena at ``token_off``.
2. ``Rows``: the request's next rows (fp8: and their float32 scales) are in the arena.
3. ``Finish``: put the object under the handle the scheduler named (and answered with):
   ``hidden_states`` from the rows' arena ranges, ``hidden_states_scales``,
   ``token_ids``, zero padding, with one ``batch_put_from_multi_buffers`` straight from
   the arena (registered with Mooncake once per writer process: no host copy). Then the
   arena ranges go back (``DonePiece``) and ``Wrote``/``Failed`` is acknowledged as the
   file sink does. A failed put leaves the error marker ``<handle>:error`` instead.
4. ``Abandon``: drop what was held; ``MarkError``: put ``<handle>:error`` for a request
   the scheduler gave up on after answering (its writer process died).

Arena ranges are held from their op to the put only when the request's ``Finish`` came
in the same message (``final``: a prompt prefilled in one batch, the common case), so
the put reads them in place. A chunked-prefill request's earlier chunks are copied out
of the arena as they come and their ranges go back at once (holding them until the last
chunk could take the whole arena while other requests' chunks wait for room: a
deadlock): each into its place in a staging buffer of the object's size, registered with
Mooncake once and reused (``store_client.RegisteredBuffers``, the connection's). The put
then reads the staging buffer and, for the last chunk, the arena in place: one host copy
of the earlier chunks, none of the last. The buffer goes back to the pool when the put
has returned (the client copied it into the segment by then) or the request failed.

A put that fails (no room: ``store.StoreFull``; master down: ``store.StoreUnavailable``)
fails its request: the marker when the store takes it, else only the log line and the
failure counter (the reader then times out). The writer goes on; requests after the
master is back succeed (Mooncake's client mounts its segment again by itself).

Shutdown: finishes not started by the drain deadline fail with ``format.SHUTDOWN_MESSAGE``
(their markers); puts still running then are cut off by the exit, and ``Connection.close``
puts their markers with the same message while the master answers.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Deque, Dict, Iterator, List, Optional, Set, Tuple

from sglang_ext import format as fmt
from sglang_ext import store, store_client, trace, wire
from sglang_ext.sink import Sink

logger = logging.getLogger("sglang_ext.writer_process")

LOST_MESSAGE = "the rows never arrived from the GPU (the device-to-host copy did not finish)"
RETRY_CONNECT_S = 5.0  # between attempts to set the client up while the master is unreachable
PROBE_S = 5.0  # the master's TCP probe before each setup (store_client.master_unreachable)
# The longest a request waits for the first setup to end: below the scheduler's watchdog
# (config.DEFAULT_WATCHDOG_S, 60 s), so a slow setup fails requests, not the writer.
FIRST_CONNECT_WAIT_S = 30.0
# Free staging buffers kept registered for the next chunked-prefill requests, in bytes;
# beyond it they are unregistered and unmapped when given back.
STAGING_KEEP_BYTES = 512 << 20
# At exit, for the puts the drain deadline cut off: the master's probe, then at most this
# long for their error markers (the scheduler kills the process 2 s past the deadline).
CUT_OFF_PROBE_S = 0.5
CUT_OFF_MARK_S = 1.0
# Mooncake's own set-up, completed in a subprocess before this process's (store_client.handshake):
# a hung master fails the attempt within this many seconds instead of freezing the writer.
HANDSHAKE_S = 15.0
# Error markers of requests failed while the master did not answer, kept to be put once it
# answers again (``Connection.unavailable``); beyond this many the oldest are only logged.
MAX_DEFERRED_MARKERS = 65536
MARKER_ROUNDS = 12  # watch rounds (RETRY_CONNECT_S apart) a deferred marker is retried when refused
PROBE_KEY = "sglang_ext-probe"  # looked up (never put) to learn whether the master answers


class Connection:
    """This writer process's one Mooncake client, set up in a thread of its own.

    ``StoreClient.connect`` takes up to ~90 s when the master does not answer (Mooncake's
    client retries 20 times), so it must not run on a writer thread per request, and
    each attempt first probes the master's port (``store_client.master_unreachable``,
    ``PROBE_S``): a dead master fails the attempt in seconds, not past the scheduler's
    60 s watchdog. The thread retries every ``RETRY_CONNECT_S`` until it succeeds, then
    registers ``[addr, addr + size)`` (the arena's mapping) once; ``buffers`` are the
    staging buffers of chunked-prefill samples, registered with the same client. ``get`` waits for the
    first attempt only, at most ``FIRST_CONNECT_WAIT_S``; later, while not connected, it
    raises the last error at once. ``putting`` brackets a put, so that ``close`` (at exit)
    knows the ones the drain deadline cut off. Once, at its start, it warns when
    ``local_hostname`` is loopback and the master is not (``StoreConfig.loopback_warning``).

    Each attempt also completes Mooncake's own set-up in a subprocess first
    (``store_client.handshake``, ``HANDSHAKE_S``): Mooncake's ``setup`` holds the GIL
    while it waits, so a master that accepts connections and never answers would freeze
    this process (the watchdog then kills it). Once connected, a put or look-up that
    finds the master not answering (``StoreUnavailable``: an RPC failed or ran past
    ``MC_RPC_TIMEOUT_MS``, 5 s by default) trips ``unavailable``: until a look-up
    answers again (tried every ``RETRY_CONNECT_S`` on a thread of its own), ``get``
    fails at once, so requests fail and their arena ranges go back without waiting on
    the master; their error markers (``defer_marker``) are put once it answers."""

    def __init__(self, config: store.StoreConfig, addr: int, size: int):
        self.sink = store_client.StoreClient(config)
        self._addr, self._size = addr, size
        self._first = threading.Event()
        self._ready = False
        self._error: Optional[store.StoreError] = None
        self._stop = threading.Event()
        self.buffers = store_client.RegisteredBuffers(self.sink, keep_bytes=STAGING_KEEP_BYTES)
        self._putting: Set[str] = set()  # handles whose put has started and not returned
        self._putting_lock = threading.Lock()
        self._down: Optional[str] = None  # why requests fail at once (the master stopped answering)
        self._deferred: Deque[Tuple[str, str, int]] = collections.deque()  # (handle, message, rounds left)
        self._down_lock = threading.Lock()
        self._watching = False  # a _watch thread runs
        warning = config.loopback_warning()
        if warning is not None:
            logger.warning("hidden-state dump: %s", warning)
        threading.Thread(target=self._run, name="hs-store-connect", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sink.connect(probe_s=PROBE_S, handshake_s=HANDSHAKE_S)
                self.sink.register(self._addr, self._size)
                self._ready = True
                logger.info("hidden-state dump: connected to the Mooncake master at %s",
                            self.sink.config.master_server_address)
                self._first.set()
                return
            except store.StoreError as e:
                if self._error is None or str(e) != str(self._error):
                    logger.error("hidden-state dump: %s; retrying every %g s", e, RETRY_CONNECT_S)
                self._error = e
                self.sink.close()
            self._first.set()
            self._stop.wait(RETRY_CONNECT_S)

    def get(self) -> store_client.StoreClient:
        """The connected client; ``StoreUnavailable`` (the setup's sentence) while not."""
        if not self._first.wait(FIRST_CONNECT_WAIT_S):
            raise store.StoreUnavailable(
                f"the Mooncake client for the master at {self.sink.config.master_server_address} was "
                f"still being set up after {FIRST_CONNECT_WAIT_S:g} s")
        if not self._ready:
            raise store.StoreUnavailable(str(self._error or "the Mooncake client is not set up"))
        down = self._down
        if down is not None:
            raise store.StoreUnavailable(down)
        return self.sink

    @property
    def connected(self) -> bool:
        """Whether the client was set up (the master may have stopped answering since)."""
        return self._ready

    def unavailable(self, e: store.StoreUnavailable) -> None:
        """A put or look-up found the master not answering (``e``): from now until it
        answers again, ``get`` fails at once (see the class doc)."""
        with self._down_lock:
            if self._down is not None or self._stop.is_set() or not self._ready:
                return
            self._down = f"{e}; requests fail at once until it answers again"
            start, self._watching = not self._watching, True
        logger.error("hidden-state dump: %s; requests fail at once until it answers again (checked every %g s)",
                     e, RETRY_CONNECT_S)
        if start:
            threading.Thread(target=self._watch, name="hs-store-watch", daemon=True).start()

    def defer_marker(self, handle: str, message: str) -> None:
        """Put ``<handle>:error`` once the master answers again (``unavailable``). A watch
        thread that ended meanwhile (it found the master back and no marker: a race a
        review replayed) is started again, so no deferred marker is left without one."""
        with self._down_lock:
            if len(self._deferred) >= MAX_DEFERRED_MARKERS:
                old = self._deferred.popleft()
                logger.error("hidden-state dump: the error marker of store handle %s is dropped (more than %d "
                             "waiting for the master); its reader will time out", old[0], MAX_DEFERRED_MARKERS)
            self._deferred.append((handle, message, MARKER_ROUNDS))
            start = not self._watching and not self._stop.is_set()
            self._watching = self._watching or start
        if start:
            threading.Thread(target=self._watch, name="hs-store-watch", daemon=True).start()

    def _watch(self) -> None:
        """Every ``RETRY_CONNECT_S``: look ``PROBE_KEY`` up (Mooncake releases the GIL and
        gives up after ``MC_RPC_TIMEOUT_MS``); once the master answers, let requests
        through again and put the deferred markers (one refused for want of room, while
        the client mounts its segment again, is retried for ``MARKER_ROUNDS`` rounds).
        Ends when the master answers and no marker waits."""
        while not self._stop.wait(RETRY_CONNECT_S):
            try:
                self.sink.exists(PROBE_KEY)
            except store.StoreError:
                continue
            with self._down_lock:
                if self._down is not None:
                    self._down = None
                    logger.info("hidden-state dump: the Mooncake master at %s answers again",
                                self.sink.config.master_server_address)
                todo, self._deferred = list(self._deferred), collections.deque()
                if not todo:
                    self._watching = False
                    return
            keep = []
            for n, (handle, message, rounds) in enumerate(todo):
                try:
                    self.sink.put_error(handle, message)
                except store.StoreUnavailable:
                    keep.extend(todo[n:])
                    break
                except store.StoreError as e:
                    if rounds > 1:
                        keep.append((handle, message, rounds - 1))
                    else:
                        logger.error("hidden-state dump: the error marker of store handle %s could not be put "
                                     "(%s); its reader will time out", handle, e)
            with self._down_lock:
                self._deferred.extendleft(reversed(keep))
        with self._down_lock:
            self._watching = False

    @contextlib.contextmanager
    def putting(self, handle: str) -> Iterator[None]:
        """The put of ``handle`` runs inside this block."""
        with self._putting_lock:
            self._putting.add(handle)
        try:
            yield
        finally:
            with self._putting_lock:
                self._putting.discard(handle)

    def close(self) -> None:
        """At exit: stop retrying; put ``<handle>:error`` (``format.SHUTDOWN_MESSAGE``) for
        every put still running (the drain deadline cut it off: the process exits under
        it), as the file sink leaves ``.error``, when the master answers; then close the
        client (its segment, and every object in it, goes). A cut-off put that still ends
        before the exit leaves its object beside the marker; readers look at the marker
        first."""
        self._stop.set()
        if not self._ready:
            return
        if self._deferred:
            logger.error("hidden-state dump: %d error markers waiting for the master are not put (exit); "
                         "their readers time out", len(self._deferred))
        with self._putting_lock:
            cut = sorted(self._putting)
        if cut:
            self._mark_cut_off(cut)
        self.buffers.close()
        self.sink.close()

    def _mark_cut_off(self, handles: List[str]) -> None:
        why = store_client.master_unreachable(self.sink.config, CUT_OFF_PROBE_S)
        if why is not None:
            logger.error("hidden-state dump: %d store puts cut off at shutdown get no error marker (%s); "
                         "their readers time out", len(handles), why)
            return

        def mark():
            for handle in handles:
                try:
                    self.sink.put_error(handle, fmt.SHUTDOWN_MESSAGE)
                except Exception as e:  # noqa: BLE001 - nothing more to do than say so
                    logger.error("hidden-state dump: the error marker of store handle %s, cut off at "
                                 "shutdown, could not be put (%s)", handle, e)

        t = threading.Thread(target=mark, name="hs-store-cut-off", daemon=True)
        t.start()
        t.join(CUT_OFF_MARK_S)
        logger.warning("hidden-state dump: %d store puts cut off at shutdown: %s", len(handles),
                       "error markers put" if not t.is_alive() else "their error markers still being put at exit")


@dataclass
class _Job:
    rid: object
    num_tokens: int
    layout: Optional[store.PackedLayout] = None
    row_bytes: int = 0
    scale_row_bytes: int = 0
    rows: int = 0
    parts: Dict[str, List[store.Part]] = field(default_factory=dict)
    held: List[Tuple[int, int]] = field(default_factory=list)  # (piece, nbytes) to give back after the put
    staging: Optional[store_client.Buffer] = None  # the earlier chunks' copies, until the put returns
    error: Optional[str] = None
    times: Dict[str, float] = field(default_factory=dict)


class StoreWriter(Sink):
    """The store work of one writer process: ``handle(op, fd, lost, final)`` is called on
    one writer thread per request (``writer_process._Thread``), as ``Writer.handle``;
    acknowledgements go to ``acks``. ``mm``: the arena's mapping, ``base``: its address
    (registered with the store by ``connection``)."""

    def __init__(self, connection: Connection, mm, base: int, *, layer_ids, acks: Deque[wire.Ack],
                 wake, metrics=None):
        super().__init__(acks, wake, metrics)
        self.connection = connection
        self.view = memoryview(mm)
        self.base = base
        self.num_slots = len(layer_ids)

    # ---- ops ------------------------------------------------------------------------
    def handle(self, op: wire.Op, fd: Optional[int], lost: bool = False, final: bool = False) -> None:
        """Carry out one op (see the module docstring). ``lost``: its arena data never
        arrived; ``final``: the request's ``Finish`` is in the same message, so its arena
        ranges may be held until the put. Never raises for a request's own failure."""
        kind = type(op)
        if kind is wire.Begin:
            job = self.jobs[op.key] = _Job(rid=op.rid, num_tokens=op.num_tokens, times=dict(op.times or {}))
            nbytes = op.num_tokens * 8
            try:
                if lost:
                    job.error = LOST_MESSAGE
                elif not self.abort:
                    self._guard(job, self._begin, job, op.row_width, op.dtype)
                if job.error is None and job.layout is not None:
                    self._guard(job, self._add, job, fmt.KEY_TOKEN_IDS, op.token_off, nbytes, final)
            finally:
                self._done(job, op.piece, nbytes, final)
        elif kind is wire.Rows:
            job = self.jobs.get(op.key)
            nbytes = op.nrows * (job.row_bytes + job.scale_row_bytes) if job is not None else 0
            try:
                if job is not None and lost and job.error is None:
                    job.error = LOST_MESSAGE
                    job.parts.clear()
                if job is not None and job.error is None and not self.abort:
                    self._guard(job, self._rows, job, op, final)
            finally:
                self._done(job, op.piece, nbytes, final)
        elif kind is wire.Finish:
            self._finish(op.key, op.name, self.jobs.pop(op.key, None), op.times)
        elif kind is wire.Abandon:
            job = self.jobs.pop(op.key, None)
            if job is not None:
                self._release(job)
        elif kind is wire.MarkError:
            self._mark(op.name, op.message)

    def _guard(self, job: _Job, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - the request fails, the writer goes on
            job.error = str(e) if isinstance(e, store.StoreError) else f"{type(e).__name__}: {e}"
            job.parts.clear()

    def _begin(self, job: _Job, row_width: int, dtype: str) -> None:
        if row_width % self.num_slots:
            raise fmt.DumpFormatError(f"row width {row_width} is not {self.num_slots} layer slots")
        job.layout = store.pack_layout(job.num_tokens, self.num_slots, row_width // self.num_slots, dtype)
        job.row_bytes = fmt.row_bytes(row_width, dtype)
        job.scale_row_bytes = fmt.scale_row_bytes(self.num_slots, dtype)
        job.parts = {t.name: [] for t in job.layout.tensors}

    def _rows(self, job: _Job, op: wire.Rows, final: bool) -> None:
        if op.row0 != job.rows or op.row0 + op.nrows > job.num_tokens:
            raise fmt.DumpFormatError(
                f"rows {op.row0}..{op.row0 + op.nrows} arrived after {job.rows} of {job.num_tokens}")
        if (op.scale_off is None) != (job.scale_row_bytes == 0):
            raise fmt.DumpFormatError("fp8 rows came without their scales (or scales without fp8)")
        self._add(job, fmt.KEY_HIDDEN_STATES, op.off, op.nrows * job.row_bytes, final)
        if op.scale_off is not None:
            self._add(job, fmt.KEY_SCALES, op.scale_off, op.nrows * job.scale_row_bytes, final)
        job.rows += op.nrows

    def _add(self, job: _Job, name: str, off: int, nbytes: int, final: bool) -> None:
        """Arena bytes ``[off, off + nbytes)`` are the next piece of tensor ``name``: their
        registered range when the put comes in this message (``final``), else copied to
        their place in the job's staging buffer (taken at its first piece, the object's
        size), whose range is the part (the arena range goes back now). ``StoreError``
        when no client is set up or Mooncake refuses a new buffer."""
        parts = job.parts[name]
        if final:
            parts.append((self.base + off, nbytes))
            return
        if job.staging is None:
            self.connection.get()
            job.staging = self.connection.buffers.take(job.layout.total_bytes)
        pos = job.layout.tensor(name).offset + sum(store.part_size(p) for p in parts)
        job.staging.view[pos:pos + nbytes] = self.view[off:off + nbytes]
        addr = job.staging.addr + pos
        if parts and parts[-1][0] >= job.staging.addr and parts[-1][0] + parts[-1][1] == addr:
            parts[-1] = (parts[-1][0], parts[-1][1] + nbytes)  # the tensor's earlier chunks, contiguous
        else:
            parts.append((addr, nbytes))

    def _done(self, job: Optional[_Job], piece: int, nbytes: int, final: bool) -> None:
        """The op is done with arena range ``piece``: at once, unless its bytes are held
        for the request's put (``final`` and the request still good)."""
        if final and job is not None and job.error is None and not self.abort:
            job.held.append((piece, nbytes))
        else:
            self._ack(wire.DonePiece(piece, nbytes))

    def _release(self, job: _Job) -> None:
        """Give back the arena ranges and the staging buffer ``job`` holds. Past the drain
        deadline (``abort``) nothing is given back: the main thread then fails the
        finishes still queued (``writer_process._fail_queued``) while the request's own
        thread may still be copying into that buffer or reading those ranges; the process
        exits within a second."""
        if self.abort:
            return
        held, job.held = job.held, []
        job.parts.clear()
        staging, job.staging = job.staging, None
        if staging is not None:
            self.connection.buffers.give(staging)
        for piece, nbytes in held:
            self._ack(wire.DonePiece(piece, nbytes))

    def _finish(self, key: int, handle: str, job: Optional[_Job], times) -> None:
        t_picked = trace.now()
        try:
            if self.abort:
                raise RuntimeError(fmt.SHUTDOWN_MESSAGE)
            if job is None:
                raise RuntimeError("the writer process has no rows for this request")
            if job.error is not None:
                raise RuntimeError(job.error)
            if job.rows != job.num_tokens:
                raise fmt.DumpFormatError(f"{job.rows} of {job.num_tokens} rows captured")
            sink = self.connection.get()
            try:
                with self.connection.putting(handle):
                    nbytes = sink.put_packed(handle, job.layout, job.parts)
            finally:
                t_written = trace.now()
                self._release(job)  # the client copied them before put returned
        except Exception as e:  # noqa: BLE001 - reported through the marker and the ack
            message = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
            logger.error("hidden-state dump for rid %s (store handle %s) failed: %s",
                         fmt.brief_rid(job.rid if job is not None else key), handle, message)
            if job is not None:
                self._release(job)
            if isinstance(e, store.StoreUnavailable):
                self.connection.unavailable(e)
            self._fail(key, handle, message)
            return
        if self.metrics is not None:
            self.metrics.written(nbytes)
        self._ack(wire.Wrote(key, handle, nbytes))
        if trace.enabled():
            trace.record("store", name=handle, bytes=nbytes, rows=job.num_tokens,
                         **dict(job.times, **(times or {})), t_picked=t_picked, t_copied=t_written,
                         t_written=t_written, t_released=trace.now())

    def _fail(self, key: int, handle: str, message: str) -> None:
        """Request ``key`` failed: its marker, the counter, ``Failed``. (A put refused
        because its handle holds another answer's object, a collision, is marked too:
        both readers fail rather than one taking the other's sample.)"""
        self._mark(handle, message)
        if self.metrics is not None:
            self.metrics.failed()
        self._ack(wire.Failed(key, handle, message))

    def _mark(self, handle: str, message: str) -> None:
        """Put ``<handle>:error``; while the master does not answer, once it does
        (``Connection.defer_marker``); when the store refuses even that, the log says so
        (the request's reader then times out)."""
        try:
            self.connection.get().put_error(handle, message)
        except store.StoreUnavailable as e:
            if self.connection.connected:
                self.connection.unavailable(e)
                self.connection.defer_marker(handle, message)
            else:
                logger.error("hidden-state dump: the error marker of store handle %s could not be put "
                             "(%s); its reader will time out", handle, e)
        except Exception as e:  # noqa: BLE001 - nothing more to do than say so
            logger.error("hidden-state dump: the error marker of store handle %s could not be put "
                         "(%s); its reader will time out", handle, e)

    def _finish_failed(self, op: wire.Finish, fd: Optional[int], message: str) -> None:
        """A ``Finish`` that raised answers ``Failed`` and leaves the marker."""
        self._fail(op.key, op.name, message)
