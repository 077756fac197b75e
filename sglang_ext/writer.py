"""The scheduler's side of the dump writer: copy rows into the arena, send ops, read acks.

Everything after the device-to-host copy happens in a separate writer process
(``writer_process``), which has its own GIL: the scheduler thread keeps only the copy
(one per contiguous run of a batch's rows, asynchronous on a side CUDA stream into the
pinned shared arena, ``arena.py``), one message per batch (``wire``) and reading the
writer's acknowledgements, which give arena ranges back.

Backpressure: when the arena has no room for a batch's rows, the scheduler thread waits
for the writer process to give ranges back (prefill waits for the disk). Rows stream
through the arena chunk by chunk, so a prompt larger than the arena still goes through.

The writer process is started with the scheduler and ends with it: ``close`` (also run
by ``atexit`` when SGLang's scheduler process exits) lets it finish queued writes within
the drain timeout; if the scheduler dies, the writer sees its socket close and does the
same. If the writer process dies (killed, out of memory), the scheduler notices at its
next batch: the files it had not finished get ``<name>.error`` (their responses carry
``hidden_states_error``), requests still in prefill fail at their next chunk, and a new
writer process is started; the server keeps serving. One that keeps ending right after its
start is started again after a pause that doubles each time (``RESTART_FIRST_S`` up to
``RESTART_MAX_S``), during which requests fail at once with a sentence.

The store sink (``store_url``) uses the same path: the writer process puts objects into
Mooncake Store instead of writing files, requests are named by store handles, and the
requests a dead writer process had not acknowledged get their error markers from the
writer that replaces it (``wire.MarkError``).
"""

from __future__ import annotations

import array
import atexit
import json
import logging
import os
import select
import socket
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from sglang_ext import arena as arena_mod
from sglang_ext import format as fmt
from sglang_ext import config, quant, trace, wire
from sglang_ext.config import DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_STATS_INTERVAL_S, DEFAULT_WATCHDOG_S
from sglang_ext.format import SHUTDOWN_MESSAGE
from sglang_ext.metrics import mark_dead

logger = logging.getLogger(__name__)

DIED_MESSAGE = "the hidden-state writer process died before the file was written"
STUCK_MESSAGE = ("the hidden-state writer process made no progress for {seconds:g} s "
                 "(KIMI_SGLANG_WATCHDOG_S) and was replaced before the file was written")
START_TIMEOUT_S = 60.0
# The most of the arena the rows of deferred requests (output rows) may hold at once.
HOLD_SHARE = 0.5
# Restart backoff: a writer process that ends within RESTART_QUICK_S of its start died at
# start (an import that fails, a store it cannot join); after the second such end in a row
# the next start waits RESTART_FIRST_S, doubling up to RESTART_MAX_S, and requests that
# come meanwhile fail at once with BACKOFF_MESSAGE.
RESTART_QUICK_S = 10.0
RESTART_FIRST_S = 1.0
RESTART_MAX_S = 60.0
BACKOFF_MESSAGE = ("the hidden-state writer process ended {count} times in a row within {quick:g} s "
                   "of its start ({how}); the next one starts in {left:.0f} s")
# ops no writer thread carries out (the main thread does): not progress the watchdog awaits
_UNCOUNTED = (wire.Close, wire.Failures)


class WriterDied(RuntimeError):
    """The writer process this request's rows went to is gone (a new one serves new requests)."""


@dataclass
class PendingDump:
    """One request on its way to the writer: ``rows`` of ``num_tokens`` sent so far.

    A deferred one (``start_deferred``: a request whose row count is known only at its
    end) keeps its ``Rows`` ops in ``held`` (their arena ranges stay in use) until
    ``finish_deferred`` sends its ``Begin`` with the final count; ``num_tokens`` is 0
    until then."""

    key: int
    rid: str
    num_tokens: int
    row_width: int
    dtype: torch.dtype
    generation: int
    rows: int = 0
    times: Optional[Dict[str, float]] = None  # stage timestamps while tracing (trace.py)
    held: Optional[List[wire.Rows]] = None  # deferred: its Rows ops, not sent yet


@dataclass
class WriterStats:
    files: int = 0
    bytes: int = 0
    failures: int = 0
    waits: int = 0
    restarts: int = 0


@dataclass
class _Piece:
    off: int
    nbytes: int
    refs: int = 0
    held: int = 0  # refs of deferred requests' held Rows ops (DumpWriter.held_bytes)


@dataclass
class _Outbox:
    ops: List[wire.Op] = field(default_factory=list)
    fds: List[int] = field(default_factory=list)  # lock descriptors of the Finish ops
    copied: bool = False  # ops read arena data copied since the last send


class DumpWriter:
    """The dump path of one writing rank. ``dir_fd``: the dump directory
    (``format.open_dump_dir``); ``arena_bytes``: the arena's size (the host cap);
    ``threads``: writer threads in the writer process; ``layer_ids``/``num_layers``/
    ``metadata``: what every file's ``__metadata__`` says besides the rid
    (``format.build_metadata``); ``device``: the CUDA device rows live on, or ``None``
    for CPU tensors (tests); ``metrics_model_name``: publish Prometheus metrics
    (``sglang_ext.metrics``, from the writer process) under that name, or ``None``;
    ``stats_interval_s``: seconds between the writer process's counter log lines;
    ``hidden_states_dtype``: ``"auto"`` (rows as they come), ``"bf16"`` (cast to
    bfloat16 on the device before the copy) or ``"fp8"`` (``quant.quantize_fp8`` on the
    device before the copy: fp8 rows plus float32 scales per token and layer slot);
    ``cpus``: the CPUs the writer process (and its threads) run on
    (``KIMI_SGLANG_WRITER_CPUS``), or ``None`` for the scheduler's; ``watchdog_s``:
    seconds the writer process may hold ops without carrying out any or writing a byte
    (``KIMI_SGLANG_WATCHDOG_S``) before a watchdog thread kills it (a stopped process, a
    write blocked for good; a slow one writes bytes): its files fail, a new one starts (``None``: no watchdog);
    ``store_url``: a ``mooncake://`` address (``store.StoreConfig.from_url``) selects the
    store sink: the writer process puts each request as one object into Mooncake Store
    (``store_writer``) and ``dir_fd`` is ``None``; a request is then named by its handle
    (``reserve_handle``) instead of a reserved file; ``spares``: the most files of
    the last file's size the writer process keeps allocated ahead (``writer_process.Spares``
    keeps as many as files begin at once, within its byte budget;
    ``KIMI_SGLANG_WRITER_SPARES``; file sink only; 0: none).

    Raises ``OSError`` when the arena cannot be made and ``RuntimeError`` when the writer
    process does not start (also when it may not run on ``cpus``).
    """

    def __init__(
        self,
        dir_fd: int,
        *,
        arena_bytes: int,
        threads: int,
        layer_ids: Sequence[int],
        num_layers: int,
        metadata: Optional[Dict[str, str]] = None,
        device: Optional[torch.device] = None,
        metrics_model_name: Optional[str] = None,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        stats_interval_s: float = DEFAULT_STATS_INTERVAL_S,
        register_atexit: bool = True,
        hidden_states_dtype: str = "auto",
        cpus: Optional[Sequence[int]] = None,
        watchdog_s: Optional[float] = DEFAULT_WATCHDOG_S,
        store_url: Optional[str] = None,
        spares: int = 0,
    ):
        if hidden_states_dtype not in ("auto", "bf16", "fp8"):
            raise ValueError(f"hidden_states_dtype must be auto, bf16 or fp8, got {hidden_states_dtype!r}")
        self.hidden_states_dtype = hidden_states_dtype
        self.num_slots = len(layer_ids)
        self.dir_fd = dir_fd
        self.store_url = store_url
        self.threads = int(threads)
        self.spares = int(spares)
        self.cpus = tuple(int(c) for c in cpus) if cpus else None
        if self.cpus and not all(0 <= c < config.MAX_CPUS for c in self.cpus):
            raise ValueError(f"cpus must be CPU numbers from 0 to {config.MAX_CPUS - 1}, got {list(self.cpus)}")
        self.drain_timeout_s = drain_timeout_s
        self.metrics_model_name = metrics_model_name
        self.stats_interval_s = stats_interval_s
        self.stats = WriterStats()
        self.layer_ids = [int(k) for k in layer_ids]
        self.num_layers = int(num_layers)
        self.metadata = dict(metadata or {})
        self._meta = json.dumps({"layer_ids": self.layer_ids, "num_layers": self.num_layers,
                                 "extra": self.metadata})
        self._cuda = device is not None and torch.device(device).type == "cuda"
        self.arena_fd, self._mm = arena_mod.create(arena_bytes)
        self._arena_size = int(arena_bytes)
        self._arena = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._view = memoryview(self._mm)
        self.extents = arena_mod.Extents(arena_mod.HEADER_BYTES, arena_mod.HEADER_BYTES + self._arena_size)
        self.registered = False  # the arena is registered with CUDA now
        self.pinned = False  # it was, while the writer ran (counters)
        self._stream = None
        if self._cuda:
            self._stream = torch.cuda.Stream(device=device)
            self._seq_dev = torch.zeros(1, dtype=torch.int64, device=device)
            self._seq_host = self._arena[arena_mod.SEQ_OFFSET:arena_mod.SEQ_OFFSET + 8].view(torch.int64)
            self.registered = self.pinned = _cuda_host_register(self._arena)
        self._pieces: Dict[int, _Piece] = {}
        self._held_bytes = 0  # arena bytes of pieces held by deferred requests
        self._dropped: List[PendingDump] = []  # deferred requests abandoned, not yet let go
        self._outstanding: Dict[int, str] = {}  # key -> name: FINISH sent, not acknowledged
        self._unwritten: Dict[int, int] = {}  # key -> file bytes: started, not written or failed
        self._out = _Outbox()
        self._next_key = 0
        self._next_piece = 0
        self._seq = 0
        self._busy = False  # inside copy_rows/flush: abandon() must not send
        self._closed = False
        self.generation = 0
        self._proc: Optional[subprocess.Popen] = None
        self._sock: Optional[socket.socket] = None
        self._ops_sent = 0  # ops this generation's writer was sent (watchdog)
        self._settle_lock = threading.Lock()  # _forget_writer and the watchdog's _settle_dead
        self._stuck: Optional[str] = None  # set by the watchdog before it kills the writer
        self._started = 0.0  # when this generation's writer process started
        self._quick_ends = 0  # writer processes in a row that ended within RESTART_QUICK_S
        self._retry_at: Optional[float] = None  # backoff: no writer process until then
        self._last_end = ""  # how the last one ended, in words (BACKOFF_MESSAGE)
        self._spawn()
        self.watchdog_s = watchdog_s
        self._stop_watchdog = threading.Event()
        if watchdog_s:
            threading.Thread(target=self._watchdog, name="hs-writer-watchdog", daemon=True).start()
        self._atexit = register_atexit
        if register_atexit:
            atexit.register(self._close_at_exit)

    # ---- the writer process -----------------------------------------------------------
    @property
    def tag(self) -> str:
        """Names this generation's temporary files (``format.tmp_name``)."""
        return f"{os.getpid()}-{self.generation}"

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def _spawn(self) -> None:
        self._started = time.monotonic()
        self._retry_at = None
        arena_mod.reset_progress(self._mm)
        self._ops_sent = 0
        self._stuck = None
        mine, theirs = wire.socket_pair()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        # The package's root goes to the end of the child's sys.path (after the standard
        # library, unlike PYTHONPATH), for a checkout that is not installed.
        boot = ("import sys; sys.path.append(sys.argv.pop(1)); "
                "from sglang_ext.writer_process import main; sys.exit(main())")
        cmd = [sys.executable, "-c", boot, root,
               "--sock-fd", str(theirs.fileno()), "--arena-fd", str(self.arena_fd),
               "--arena-size", str(self._arena_size),
               "--threads", str(self.threads), "--tag", self.tag, "--meta", self._meta,
               "--drain-timeout", str(self.drain_timeout_s),
               "--stats-interval", str(self.stats_interval_s)]
        if self.store_url is not None:
            cmd += ["--store", self.store_url]
        else:
            cmd += ["--dir-fd", str(self.dir_fd), "--spares", str(self.spares)]
        if self.metrics_model_name is not None:
            cmd += ["--metrics-model-name", str(self.metrics_model_name)]
        if self.cpus:
            cmd += ["--cpus", ",".join(map(str, self.cpus))]
        proc = None
        try:
            fds = (theirs.fileno(), self.arena_fd) + (() if self.dir_fd is None else (self.dir_fd,))
            proc = subprocess.Popen(cmd, pass_fds=fds,
                                    stdin=subprocess.DEVNULL)
            if self.cpus:
                # at once, before its interpreter starts any thread (it sets them again itself)
                os.sched_setaffinity(proc.pid, self.cpus)
        except OSError as e:
            mine.close()
            if proc is None:
                raise RuntimeError(f"cannot start the hidden-state writer process: {e}") from None
            proc.kill()
            proc.wait()
            raise RuntimeError(f"cannot start the hidden-state writer process on CPUs "
                               f"{list(self.cpus)} (KIMI_SGLANG_WRITER_CPUS): {e.strerror or e}") from None
        finally:
            theirs.close()
        self._proc = proc
        self._sock = mine
        self._sock.setblocking(False)

    def _writer_died(self) -> None:
        """Fail what the dead writer held, start a new one (see the module docstring)."""
        proc = self._proc
        try:
            code = proc.wait(timeout=5) if proc is not None else None
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        how = _how(code) if self._stuck is None else f"killed by the watchdog: {self._stuck}"
        message = self._death_message(code)
        orphans = list(self._outstanding.values()) if self.store_url is not None else []
        unsent = _failures(self._out.ops)  # counted here, not yet by a writer process
        failed = self._forget_writer(message)
        quick = time.monotonic() - self._started < RESTART_QUICK_S
        self._quick_ends = self._quick_ends + 1 if quick else 0
        self._last_end = _how(code)
        delay = 0.0 if self._quick_ends < 2 else min(RESTART_MAX_S,
                                                     RESTART_FIRST_S * 2 ** (self._quick_ends - 2))
        if self._closed:
            then = ""
        elif delay:
            then = (f"; it ended {self._quick_ends} times in a row within {RESTART_QUICK_S:g} s of "
                    f"its start: starting a new one in {delay:g} s, requests fail until then")
        else:
            then = "; starting a new one"
        logger.error("hidden-state dump: the writer process (pid %s) ended (%s); %d files in "
                     "flight failed%s", proc.pid if proc else None, how, failed, then)
        if self.metrics_model_name is not None and proc is not None:
            mark_dead(proc.pid)
        if not self._closed:
            self.generation += 1
            if delay:
                self._proc = None
                self._retry_at = time.monotonic() + delay
            else:
                self.stats.restarts += 1
                self._spawn()
            # Their answers are out (their manifests): the next writer puts their markers.
            self._out.ops.extend(wire.MarkError(handle, message) for handle in orphans)
            if failed + unsent:  # the dead writer never counted them: the next one does
                self._out.ops.append(wire.Failures(failed + unsent))

    def _revive(self) -> None:
        """Start the next writer process once the backoff (``_writer_died``) is over;
        while it lasts, raise ``WriterDied`` with ``BACKOFF_MESSAGE``."""
        if self._retry_at is None or self._closed:
            return
        left = self._retry_at - time.monotonic()
        if left > 0:
            raise WriterDied(BACKOFF_MESSAGE.format(count=self._quick_ends, quick=RESTART_QUICK_S,
                                                    how=self._last_end, left=max(1.0, left)))
        self.stats.restarts += 1
        self._spawn()

    def _forget_writer(self, message: str) -> int:
        """Settle what the writer that is gone had not acknowledged: a file already in
        place counts as written (it died after the rename), the others fail with
        ``message``. Returns the number failed."""
        if self._stream is not None:
            self._stream.synchronize()  # no copy may still land in a range handed out again
        failed = 0
        with self._settle_lock:  # the watchdog thread may be settling the same files
            for name in self._outstanding.values():
                if self.dir_fd is None:  # a store handle: its marker is the caller's to put
                    failed += 1
                    continue
                size = _fail_orphan(self.dir_fd, name, message)
                if size is None:
                    failed += 1
                else:
                    self.stats.files += 1
                    self.stats.bytes += size
            self._outstanding.clear()
        self._unwritten.clear()  # the dead writer's requests write nothing more
        self.stats.failures += failed
        self._pieces.clear()
        self._held_bytes = 0
        self._dropped.clear()
        for fd in self._out.fds:
            os.close(fd)
        self._out = _Outbox()
        self.extents.reset()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.dir_fd is None:
            return failed
        prefix = fmt.tmp_prefix(self.tag)
        try:
            names = os.listdir(self.dir_fd)
        except OSError as e:
            logger.error("hidden-state dump: cannot list the dump directory to remove the writer's "
                         "temporary files: %s", e)
            names = []
        for name in names:
            if name.startswith(prefix):
                try:
                    os.unlink(name, dir_fd=self.dir_fd)
                except FileNotFoundError:
                    pass
                except OSError as e:  # e.g. a directory planted there: clean_stale retries later
                    logger.warning("hidden-state dump: cannot remove %s: %s", name, e)
        return failed

    def _watchdog(self) -> None:
        """Beside the scheduler thread, once a ``min(1, watchdog_s / 4)`` s:

        - kill a writer process that holds ops and for ``watchdog_s`` carries out none and
          writes no byte (stopped, or blocked for good; progress is an op carried out or a
          slice of rows written, ``writer_process.WRITE_SLICE_BYTES``: a chunk that takes
          minutes on a slow disk is not a stop);
        - settle the files of a writer process that has ended, whatever ended it: each
          gets ``<name>.error`` (or, renamed already, its index line) and its lock goes,
          so a waiting response has its sentence within about a second
          (``format.SETTLE_S``) even when no batch comes.

        The scheduler thread notices the death where it always does (a waiting send,
        backpressure, the next batch: ``poll``), counts what failed and starts a new one.
        """
        interval = min(1.0, self.watchdog_s / 4)
        seen, since, gen, settled = None, time.monotonic(), -1, -1
        while not self._stop_watchdog.wait(interval):
            proc, now, current = self._proc, time.monotonic(), self.generation
            if self._closed or proc is None or self._mm is None:
                continue
            if proc.poll() is not None:
                if settled != current:
                    settled = current
                    self._settle_dead(proc, current)
                continue
            try:
                done = arena_mod.read_progress(self._mm)
                mark = (done, arena_mod.read_bytes(self._mm))
            except (ValueError, TypeError, BufferError):  # closed meanwhile
                continue
            if gen != current or mark != seen or self._ops_sent <= done:
                seen, since, gen = mark, now, current
                continue
            if now - since >= self.watchdog_s:
                stuck = (f"{self._ops_sent - done} ops in hand, none carried out and no byte written "
                         f"for {now - since:.0f} s")
                with self._settle_lock:
                    if self._proc is not proc:
                        continue
                    self._stuck = stuck
                logger.error("hidden-state dump: the writer process (pid %d) made no progress (no op "
                             "carried out, no byte written) for %.0f s with %d ops in hand; "
                             "killing it (KIMI_SGLANG_WATCHDOG_S)",
                             proc.pid, now - since, self._ops_sent - done)
                try:
                    proc.send_signal(signal.SIGKILL)
                except OSError:
                    pass
                since = now

    def _settle_dead(self, proc: subprocess.Popen, generation: int) -> None:
        """(Watchdog thread) the files writer ``proc`` of ``generation`` held, settled as
        ``_forget_writer`` settles them; nothing if the scheduler thread got there first."""
        with self._settle_lock:
            if self._proc is not proc or self.generation != generation or self.dir_fd is None:
                return
            message = self._death_message(proc.returncode)
            for name in list(self._outstanding.values()):
                _fail_orphan(self.dir_fd, name, message)

    def _death_message(self, code: Optional[int]) -> str:
        """What the files of a writer process that ended with ``code`` fail with."""
        if self._stuck is not None:
            return STUCK_MESSAGE.format(seconds=self.watchdog_s)
        return f"{DIED_MESSAGE} ({_how(code)})"

    # ---- scheduler thread -------------------------------------------------------------
    def poll(self) -> None:
        """Notice a writer process that has ended (killed by the watchdog, or dead) before a
        batch hands it new work: what it held fails, a new one starts, and the batch's new
        requests go to that one. Reads the acknowledgements that arrived, where a closed
        end of the socket shows a dying writer before it can be reaped (a process gives up
        its descriptors, and so its files' locks, before its parent can wait for it: a
        response woken by a lock it released can send the next request at once), then one
        ``waitpid(WNOHANG)``; call once per batch."""
        if not self._closed:
            self._read_acks()
            self._notice_end()
            try:
                self._revive()
            except WriterDied:
                pass  # still backing off: the batch's new requests fail in start()

    def start(self, rid: str, token_ids: Sequence[int], row_width: int, dtype: torch.dtype) -> PendingDump:
        """Open a request of ``len(token_ids)`` prompt tokens whose rows are
        ``row_width`` elements of ``dtype``; its token ids go to the arena now.

        ``dtype`` is the rows' dtype as the model makes them; the file's is that, or
        bfloat16 / float8_e4m3fn under ``hidden_states_dtype`` bf16 / fp8.

        Raises ``TypeError`` for a rid that is not a str and for token ids that are not
        int64 (``OverflowError`` too), ``ValueError`` for a rid longer than
        ``format.MAX_RID_CHARS`` and when the token ids alone exceed the arena,
        ``format.DumpFormatError`` (a ``ValueError``) for a dtype safetensors cannot hold,
        ``RuntimeError`` after ``close``.
        """
        dtype = self._check_start(rid, row_width, dtype)
        ids = self._fitting(array.array("q", token_ids))
        pending = PendingDump(key=self._next_key, rid=rid, num_tokens=len(ids), row_width=int(row_width),
                              dtype=dtype, generation=self.generation)
        self._next_key += 1
        if trace.enabled():
            pending.times = {"t_start": trace.now()}
        self._begin(pending, ids)
        return pending

    def _fitting(self, ids: array.array) -> array.array:
        """``ids`` (int64 token ids), or ``ValueError`` when they alone exceed the arena."""
        nbytes = len(ids) * 8
        if nbytes > self.extents.capacity:
            raise ValueError(f"the token ids of {len(ids)} tokens ({nbytes} bytes) exceed the "
                             f"{self.extents.capacity}-byte arena (--dump-hidden-states-max-host-mb)")
        return ids

    def _begin(self, pending: PendingDump, ids: array.array, extra: Optional[Dict[str, str]] = None) -> None:
        """Put the file's token ids ``ids`` into the arena and queue ``pending``'s ``Begin``
        (``pending.num_tokens`` of them, ``extra`` metadata); its file's bytes count as
        unwritten from now on. ``WriterDied`` when its writer process died meanwhile."""
        nbytes = len(ids) * 8
        off, piece = self._take(max(nbytes, 1), max(nbytes, 1))
        if self.generation != pending.generation:
            raise WriterDied(DIED_MESSAGE)
        if nbytes:
            self._view[off:off + nbytes] = memoryview(ids).cast("B")
        self._pieces[piece].refs = 1
        name = _dtype_name(pending.dtype)
        self._out.ops.append(wire.Begin(pending.key, pending.rid, pending.num_tokens, pending.row_width,
                                        name, piece, off, pending.times, dict(extra) if extra else None))
        # the file's bytes by its own layout, as the sampling budget counts them (session._admit)
        self._unwritten[pending.key] = sum(
            s.nbytes for s in fmt.dump_tensors(len(ids), self.num_slots, pending.row_width // self.num_slots, name))

    def _check_start(self, rid: str, row_width: int, dtype: torch.dtype) -> torch.dtype:
        dtype = self._file_dtype(dtype)
        if self._closed:
            raise RuntimeError(SHUTDOWN_MESSAGE)
        self._revive()
        fmt.check_rid(rid)
        fmt.row_bytes(row_width, _dtype_name(dtype))  # a dtype no file can hold fails here
        return dtype

    def start_deferred(self, rid: str, row_width: int, dtype: torch.dtype) -> PendingDump:
        """Open a request whose row count is known only at its end (a request with output
        rows, ``format.output``): its rows are copied to the arena as they come
        (``copy_rows``) but their ops are held, and nothing reaches the writer process
        until ``finish_deferred`` (or ``abandon``). While held they keep their arena
        ranges: ``hold_error`` says when more would pass ``HOLD_SHARE`` of the arena.
        Raises as ``start``."""
        dtype = self._check_start(rid, row_width, dtype)
        pending = PendingDump(key=self._next_key, rid=rid, num_tokens=0, row_width=int(row_width),
                              dtype=dtype, generation=self.generation, held=[])
        self._next_key += 1
        if trace.enabled():
            pending.times = {"t_start": trace.now()}
        return pending

    def hold_error(self, pending: PendingDump, nrows: int) -> Optional[str]:
        """Why ``nrows`` more rows of deferred ``pending`` may not be held (one sentence),
        or None: the rows deferred requests hold may take at most ``HOLD_SHARE`` of the
        arena, so the rest always streams and backpressure cannot wait on rows that only
        this scheduler can let go."""
        dtype = _dtype_name(pending.dtype)
        step = fmt.row_bytes(pending.row_width, dtype) + fmt.scale_row_bytes(self.num_slots, dtype)
        limit = int(self.extents.capacity * HOLD_SHARE)
        if self._held_bytes + nrows * step <= limit:
            return None
        return (f"the rows of requests with output rows, held until each ends, would take more than "
                f"{limit} bytes, {HOLD_SHARE:.0%} of the {self.extents.capacity}-byte host arena "
                f"(--dump-hidden-states-max-host-mb)")

    def held_bytes(self) -> int:
        """Arena bytes held by deferred requests' rows (``start_deferred``)."""
        if not self._busy:
            self.flush()  # lets go of the deferred requests abandoned since the last batch
        return self._held_bytes

    def _let_go_dropped(self) -> None:
        """Give back the held rows of the deferred requests ``abandon`` queued (it may run
        in a ``weakref.finalize`` callback, in the middle of an arena operation: only the
        scheduler's own calls change the arena)."""
        while self._dropped:
            self._release_held(self._dropped.pop(), give_back=True)

    def _release_held(self, pending: PendingDump, give_back: bool) -> None:
        """Forget ``pending``'s held ops: their pieces stop counting as held (and, with
        ``give_back``, the ops' references to them go: nothing will send them)."""
        held, pending.held = pending.held or [], None
        if not self.is_current(pending):
            return  # the arena was reset when its writer process died
        for op in held:
            piece = self._pieces.get(op.piece)
            if piece is None:
                continue
            piece.held -= 1
            if piece.held == 0:
                self._held_bytes -= piece.nbytes
            if give_back:
                self._give_back(op.piece)

    def finish_deferred(self, pending: PendingDump, reservation, token_ids: Sequence[int],
                        extra: Optional[Dict[str, str]] = None) -> None:
        """Send a deferred request (``start_deferred``) now that it has ended: its
        ``Begin`` with ``len(token_ids)`` tokens and ``extra`` metadata (str -> str), its
        held rows, then ``finish(pending, reservation)``. Raises ``ValueError`` when the
        rows copied are not one per token id or the token ids alone exceed the arena (the
        held rows are given back; the caller fails the reservation), and as ``finish`` does."""
        if pending.held is None:
            raise ValueError(f"rid {pending.rid!r} was not started deferred")
        ids = array.array("q", token_ids)
        if len(ids) != pending.rows:
            self._release_held(pending, give_back=True)
            raise ValueError(f"{pending.rows} rows were captured for the {len(ids)} tokens fed to the model")
        if self._closed or not self.is_current(pending):
            self._release_held(pending, give_back=True)
            pending.num_tokens = len(ids)
            self.finish(pending, reservation)  # fails it as finish does
            return
        pending.num_tokens = len(ids)
        try:
            self._begin(pending, self._fitting(ids), extra)
        except (ValueError, WriterDied):
            self._release_held(pending, give_back=True)  # (the arena is reset when the writer died)
            raise
        held = list(pending.held)
        self._release_held(pending, give_back=False)
        self._out.ops.extend(held)
        self.finish(pending, reservation)

    def is_current(self, pending: PendingDump) -> bool:
        """False when the writer process that took this request's first rows died."""
        return pending.generation == self.generation

    def check_current(self, pending: PendingDump) -> None:
        """Raise ``WriterDied`` unless ``is_current(pending)``."""
        if pending.generation != self.generation:
            raise WriterDied(DIED_MESSAGE)

    def copy_rows(self, hidden: torch.Tensor, segments: Sequence[Tuple[PendingDump, int, int]],
                  *, ready: bool = False) -> None:
        """Copy rows of ``hidden`` (``[num_rows, row_width]``, on the GPU or the CPU) to the
        arena and queue them for their requests: ``segments`` are ``(pending, first
        row in hidden, number of rows)``, each the request's next rows. Segments that
        follow each other in ``hidden`` go in one copy (one per arena range).

        ``ready=True``: the caller guarantees the kernels that produced ``hidden`` have
        finished (SGLang synchronizes ``result.copy_done`` before processing a batch
        result), so the copy starts at once instead of queueing behind work the
        scheduler enqueued since; ``False`` orders it after the current stream.
        Under ``hidden_states_dtype`` fp8 (bf16) the rows are quantized (cast) first, on
        the copy stream, so the copy moves fp8 rows plus their scales: each arena range
        holds the scales (``[n, L]`` float32) of its ``n`` rows, then the rows.
        Raises ``ValueError`` for rows that overflow a request or do not match its width
        (``format.DumpFormatError`` for a dtype no file can hold), ``WriterDied`` when the writer process died meanwhile (the batch's requests fail).
        """
        for pending, start, n in segments:
            if start < 0 or n < 0 or start + n > hidden.shape[0]:
                raise ValueError(f"rid {pending.rid!r}: rows {start}..{start + n} are outside the "
                                 f"batch's {hidden.shape[0]} rows")
            over = pending.held is None and pending.rows + n > pending.num_tokens
            if over or hidden.shape[1] != pending.row_width:
                raise ValueError(
                    f"rid {pending.rid!r}: rows {pending.rows}..{pending.rows + n} of width "
                    f"{hidden.shape[1]} do not fit {pending.num_tokens} rows of {pending.row_width}")
            if not self.is_current(pending):
                raise WriterDied(DIED_MESSAGE)
        src = hidden
        scales = None
        dtype = _dtype_name(self._file_dtype(hidden.dtype))
        row_bytes = fmt.row_bytes(hidden.shape[1], dtype)
        scale_bytes = fmt.scale_row_bytes(self.num_slots, dtype)
        if row_bytes + scale_bytes > self.extents.capacity:
            raise ValueError(f"one token's row ({row_bytes + scale_bytes} bytes) exceeds the {self.extents.capacity}-byte "
                             f"arena (--dump-hidden-states-max-host-mb)")
        gen = self.generation
        self._busy = True
        try:
            if self._cuda and hidden.is_cuda and not ready:
                self._stream.wait_stream(torch.cuda.current_stream(hidden.device))
            if self.hidden_states_dtype != "auto":
                hidden, scales = self._convert(hidden)
            step = row_bytes + scale_bytes
            for run in _runs(segments):
                pos, end = run[0][1], run[-1][1] + run[-1][2]
                i = 0
                while pos < end:
                    off, piece = self._take((end - pos) * step, step)
                    if self.generation != gen:
                        raise WriterDied(DIED_MESSAGE)
                    n = min(self._pieces[piece].nbytes // step, end - pos)
                    rows_off = off + n * scale_bytes  # fp8: [n, L] scales first (4-aligned)
                    if scales is not None:
                        self._copy(scales[pos:pos + n], off, n * scale_bytes)
                    self._copy(hidden[pos:pos + n], rows_off, n * row_bytes)
                    piece_end = pos + n
                    while i < len(run):  # the requests whose rows this range holds
                        pending, s, cnt = run[i]
                        lo, hi = max(s, pos), min(s + cnt, piece_end)
                        if lo < hi:
                            op = wire.Rows(
                                pending.key, pending.rows, hi - lo, piece, rows_off + (lo - pos) * row_bytes,
                                None if scales is None else off + (lo - pos) * scale_bytes)
                            got = self._pieces[piece]
                            got.refs += 1
                            if pending.held is None:
                                self._out.ops.append(op)
                            else:
                                pending.held.append(op)
                                got.held += 1
                                if got.held == 1:
                                    self._held_bytes += got.nbytes
                            pending.rows += hi - lo
                        if s + cnt > piece_end:
                            break  # continues in the next range
                        i += 1
                    pos = piece_end
            if self._cuda and src.is_cuda:
                src.record_stream(self._stream)  # converted rows live on the copy stream
        finally:
            self._busy = False

    def file_metadata(self, rid: str, dtype: str) -> Dict[str, str]:
        """The ``__metadata__`` a file of ``rid`` stored as ``dtype`` (a ``file_dtype`` name)
        carries (``format.build_metadata``): the store sink's manifest carries the same, so
        a sample fetched from the store becomes the file the file sink would have written."""
        return fmt.build_metadata(rid=rid, layer_ids=self.layer_ids, num_layers=self.num_layers,
                                  extra={**self.metadata, **fmt.dtype_metadata(dtype)})

    def file_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the sample is written in for rows of ``dtype`` (``_file_dtype``), as
        a name: ``"bfloat16"``, ``"float8_e4m3fn"``."""
        return _dtype_name(self._file_dtype(dtype))

    def _file_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The file's dtype for rows of ``dtype``: as they come (``auto``), bfloat16
        (``bf16``) or float8_e4m3fn (``fp8``)."""
        if self.hidden_states_dtype == "fp8":
            return quant.FP8_DTYPE
        if self.hidden_states_dtype == "bf16":
            return torch.bfloat16
        return dtype

    def _convert(self, hidden: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The rows in the file's dtype, made on the copy stream when on the GPU (the
        copies that follow on that stream read them in order): fp8 ``(rows, scales)``,
        bf16 ``(rows, None)``."""
        if self._cuda and hidden.is_cuda:
            with torch.cuda.stream(self._stream):
                return self._convert_here(hidden)
        return self._convert_here(hidden)

    def _convert_here(self, hidden: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.hidden_states_dtype == "fp8":
            return quant.quantize_fp8(hidden, self.num_slots)
        return hidden.to(torch.bfloat16), None

    def reserve_handle(self, rid: str) -> str:
        """The store handle of request ``rid`` (store sink): ``store.handle_for(rid)`` +
        ``"-"`` + 32 random hex digits (``store.unique_handle``), so no two answers share a
        handle: not two live requests of one rid, not two scheduler processes (DP ranks)
        or servers on one master, not a rid repeated after its object exists, not rids
        that sanitize alike (``job.1``/``job_1``), and no stale ``<handle>:error``.
        Readers take the handle from the manifest."""
        from sglang_ext.store import unique_handle

        return unique_handle(rid)

    def finish(self, pending: PendingDump, reservation) -> None:
        """Queue the file write; the writer releases ``reservation``'s lock when the file
        is in place (or fails it). After ``close``, or when the writer process that had
        the request's rows died, the reservation fails at once (its response carries the
        message). Store sink: ``reservation`` is the request's handle (``reserve_handle``)
        and the writer puts the object under it; after ``close`` or a dead writer this
        raises ``RuntimeError`` (``WriterDied``) instead, before the response is out."""
        if self.store_url is not None:
            if self._closed:
                raise RuntimeError(SHUTDOWN_MESSAGE)
            self.check_current(pending)
            if pending.times is not None:
                pending.times["t_submit"] = trace.now()
            self._out.ops.append(wire.Finish(pending.key, reservation,
                                             {"t_submit": pending.times["t_submit"]} if pending.times else None))
            self._outstanding[pending.key] = reservation
            return
        if self._closed or not self.is_current(pending):
            self._unwritten.pop(pending.key, None)
            fmt.fail(reservation, SHUTDOWN_MESSAGE if self._closed else DIED_MESSAGE)
            self.failed_here()
            return
        if pending.times is not None:
            pending.times["t_submit"] = trace.now()
        self._out.ops.append(wire.Finish(pending.key, reservation.name,
                                         {"t_submit": pending.times["t_submit"]} if pending.times else None))
        self._out.fds.append(reservation.lock_fd)
        self._outstanding[pending.key] = reservation.name

    def abandon(self, pending: PendingDump) -> None:
        """The request went away before its last row (aborted, retracted, dropped by
        SGLang): the writer drops its temporary file. Safe from a ``weakref.finalize``
        callback (it only queues, unless no batch is being handled)."""
        self._unwritten.pop(pending.key, None)
        if pending.held is not None:  # deferred: the writer process never heard of it
            self._dropped.append(pending)
            if not self._busy:
                self.flush()
            return
        if self._closed or not self.is_current(pending):
            return
        self._out.ops.append(wire.Abandon(pending.key))
        if not self._busy:
            self.flush()

    def flush(self) -> None:
        """Send what this batch queued (one message, or a few for very large batches) and
        read the writer's acknowledgements that have arrived. Never blocks on the writer
        unless the socket's buffer is full."""
        if self._busy:  # re-entered (a weakref.finalize during copy_rows or a send)
            return
        self._busy = True
        try:
            self._let_go_dropped()
            self._send()
            self._read_acks()
        finally:
            self._busy = False

    # ---- arena ---------------------------------------------------------------------------
    def _take(self, want: int, minimum: int) -> Tuple[int, int]:
        """An arena range of ``want`` bytes, or at least ``minimum`` when fragmented; waits
        for the writer to give ranges back while none is free (backpressure). Raises
        ``ValueError`` when none can come: every range in use is held by deferred requests
        (``start_deferred``), which only this scheduler lets go, at their ends."""
        got = self.extents.alloc(want, minimum)
        if got is None:
            self.stats.waits += 1
            gen = self.generation
            while got is None:
                self._send()  # the writer can only give back what it was sent
                self._wait_acks(0.05)
                if self.generation != gen:
                    raise WriterDied(DIED_MESSAGE)
                got = self.extents.alloc(want, minimum)
                if got is None and self.extents.in_use <= self._held_bytes:
                    self._let_go_dropped()  # abandoned since the last batch: theirs come back
                    got = self.extents.alloc(want, minimum)
                    if got is None and self.extents.in_use <= self._held_bytes:
                        raise ValueError(
                            f"{minimum} bytes of the {self.extents.capacity}-byte host arena do not fit "
                            f"beside the {self._held_bytes} bytes the rows of requests with output rows "
                            f"hold until each ends (--dump-hidden-states-max-host-mb)")
        piece = self._next_piece
        self._next_piece += 1
        self._pieces[piece] = _Piece(*got)
        return got[0], piece

    def _copy(self, rows: torch.Tensor, off: int, nbytes: int) -> None:
        dst = self._arena[off:off + nbytes].view(rows.dtype).view(rows.shape)
        if self._cuda and rows.is_cuda:
            with torch.cuda.stream(self._stream):
                dst.copy_(rows, non_blocking=True)
        else:
            dst.copy_(rows)
        self._out.copied = True

    # ---- messages ------------------------------------------------------------------------
    def _send(self) -> None:
        out = self._out
        if not out.ops or self._retry_at is not None:  # backing off: kept for the next writer
            return
        self._out = _Outbox()
        seq = 0
        if out.copied:
            self._seq += 1
            seq = self._seq
            if self._cuda:  # lands after the batch's copies: the stream runs in order
                with torch.cuda.stream(self._stream):
                    self._seq_dev.fill_(seq)
                    self._seq_host.copy_(self._seq_dev, non_blocking=True)
            else:
                arena_mod.write_seq(self._mm, seq)
        messages = wire.pack(seq, out.ops, out.fds)
        for i, msg in enumerate(messages):
            try:
                self._send_blocking(msg.blob, msg.fds)
            except (OSError, WriterDied) as e:
                if isinstance(e, OSError) and wire.is_message_fault(e) and self._proc.poll() is None:
                    self._refuse(msg, e)  # that message's requests fail; the writer goes on
                    continue
                for m in messages[i:]:
                    for fd in m.fds:
                        wire.close_quiet(fd)
                unsent = _failures(op for m in messages[i:] for op in m.ops)
                if not isinstance(e, WriterDied):
                    self._writer_died()
                if unsent:  # for the next writer process's counters
                    self._out.ops.append(wire.Failures(unsent))
                return
            self._ops_sent += sum(type(op) not in _UNCOUNTED for op in msg.ops)
            for fd in msg.fds:  # the writer holds these locks now
                os.close(fd)

    def _refuse(self, msg: "wire.Message", e: OSError) -> None:
        """A message the socket would not take for a reason of its own (``EMSGSIZE``): its
        arena ranges come back, its finished files fail with the reason, and the writer
        (which never saw it) goes on; later ops of its requests fail there (no rows)."""
        fds = iter(msg.fds)
        failed = 0
        keys = []
        for op in msg.ops:
            kind = type(op)
            if kind in (wire.Begin, wire.Rows, wire.Finish):
                keys.append(op.key)
            if kind in (wire.Begin, wire.Rows):
                self._give_back(op.piece)
            elif kind is wire.Finish:
                self._outstanding.pop(op.key, None)
                why = f"the message to the hidden-state writer was refused: {e.strerror or e}"
                if self.dir_fd is None:  # answered with its manifest: the writer puts its marker
                    self._out.ops.append(wire.MarkError(op.name, why))
                else:
                    fmt.fail(fmt.Reservation(self.dir_fd, op.name, next(fds)), why)
                failed += 1
        self.failed_here(failed)
        # The writer may hold these requests' temporary files (an earlier message opened
        # them): it drops them; a later FINISH of theirs then fails there (no rows).
        self._out.ops.extend(wire.Abandon(key) for key in dict.fromkeys(keys))
        for key in keys:
            self._unwritten.pop(key, None)
        logger.error("hidden-state dump: a %d-byte message to the writer process was refused (%s); "
                     "%d files failed, the writer goes on", len(msg.blob), e.strerror or e, failed)

    def _give_back(self, piece_id: int) -> None:
        """One op naming arena range ``piece_id`` is done with it; free it at the last."""
        piece = self._pieces.get(piece_id)
        if piece is not None:
            piece.refs -= 1
            if piece.refs <= 0:
                del self._pieces[piece_id]
                self.extents.free(piece.off, piece.nbytes)

    def _send_blocking(self, blob: bytes, fds: Sequence[int]) -> None:
        while True:
            if self._sock is None:
                raise WriterDied(DIED_MESSAGE)
            try:
                wire.send(self._sock, blob, fds)
                return
            except BlockingIOError:  # the writer is behind on reading: wait for it
                self._wait_acks(0.05, writable=True)

    def _wait_acks(self, timeout: float, writable: bool = False) -> None:
        """Wait up to ``timeout`` s for acknowledgements (or, ``writable``, for room to
        send), then read them; notices a dead writer."""
        if self._sock is None:
            return
        poller = select.poll()
        poller.register(self._sock, select.POLLIN | (select.POLLOUT if writable else 0))
        poller.poll(timeout * 1000)
        self._read_acks()
        self._notice_end()

    def _notice_end(self) -> None:
        """If the writer process has ended: read what it said before it ended, then settle
        its end (``_peer_gone``), unless reading already did (and started a new one)."""
        if self._sock is not None and self._proc.poll() is not None:
            self._read_acks()
            if self._sock is not None and self._proc.poll() is not None:
                self._peer_gone()

    def _peer_gone(self) -> None:
        """The writer's end of the socket closed: expected after ``close``, else it died."""
        if self._closed:
            self._sock.close()
            self._sock = None
        else:
            self._writer_died()

    def _read_acks(self) -> None:
        wrote = failed = nbytes = 0
        while self._sock is not None:
            try:
                events = wire.recv_acks(self._sock, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except wire.BadMessage as e:
                logger.error("hidden-state dump: an acknowledgement from the writer was lost: %s", e)
                continue
            except OSError:
                events = None
            if events is None:  # the writer process is gone
                self._peer_gone()
                break
            for ev in events:
                kind = type(ev)
                if kind is wire.DonePiece:
                    self._give_back(ev.piece)
                elif kind is wire.Wrote:
                    self._outstanding.pop(ev.key, None)
                    self._unwritten.pop(ev.key, None)
                    wrote += 1
                    nbytes += ev.nbytes
                elif kind is wire.Failed:
                    self._outstanding.pop(ev.key, None)
                    self._unwritten.pop(ev.key, None)
                    failed += 1
        self.stats.files += wrote
        self.stats.bytes += nbytes
        self.stats.failures += failed

    # ---- counters ------------------------------------------------------------------------
    def failed_here(self, count: int = 1) -> None:
        """``count`` requests failed on the scheduler's side (the session refused them, or
        their message never reached the writer): counted here and, with the next message,
        by the writer process (``wire.Failures``), whose log line and
        ``kimi_sglang:dump_failures_total`` count every failure."""
        if count > 0:
            self.stats.failures += count
            self._out.ops.append(wire.Failures(count))

    def unwritten_bytes(self) -> int:
        """Bytes of the files of requests started (``start``) and not yet acknowledged
        written, failed or abandoned: each file's whole size (``hidden_states``, fp8 scales,
        token ids; no header), also the part of it already on disk (the careful side), so
        a free-space reading (``sampling.DumpPolicy``) less this is what stays once they
        are all written."""
        return sum(list(self._unwritten.values()))

    def wait_idle(self, timeout: float) -> bool:
        """Send what is queued and wait until the writer process has acknowledged every
        file and arena range; True if it did within ``timeout`` s (tests, benchmarks)."""
        self.flush()
        deadline = time.monotonic() + timeout
        while (self._outstanding or self._pieces) and self._sock is not None \
                and time.monotonic() < deadline:
            self._wait_acks(0.02)
        return not (self._outstanding or self._pieces)

    def snapshot(self) -> Dict[str, int]:
        """Counters: files and bytes written, failures, files sent to the writer and not
        yet acknowledged (``queue_depth``),
        arena bytes in use and peak and its size, backpressure waits, writer restarts."""
        return {
            "files_written": self.stats.files,
            "bytes_written": self.stats.bytes,
            "failures": self.stats.failures,
            "queue_depth": len(self._outstanding),
            "host_bytes_in_use": self.extents.in_use,
            "host_bytes_peak": self.extents.peak,
            "arena_bytes": self._arena_size,
            "arena_pinned": int(self.pinned),
            "backpressure_waits": self.stats.waits,
            "writer_restarts": self.stats.restarts,
        }

    # ---- shutdown ------------------------------------------------------------------------
    def close(self, timeout: Optional[float] = None) -> bool:
        """Stop taking writes; let the writer process finish what it was sent within
        ``timeout`` s (default: the drain timeout), then end it. Returns True if every
        file was written or failed cleanly by then. Files still unfinished after it
        exits get ``<name>.error`` (``SHUTDOWN_MESSAGE``); a write cut off leaves only its
        temporary file and lock (``format.clean_stale`` removes them at the next start).
        Logs the counters."""
        if timeout is None:
            timeout = self.drain_timeout_s
        if self._atexit:
            atexit.unregister(self._close_at_exit)
            self._atexit = False
        if self._closed:
            return not self._outstanding
        self._closed = True
        self._stop_watchdog.set()
        proc = self._proc
        if self._sock is not None:
            self._out.ops.append(wire.Close(float(timeout)))
            self._send()
        deadline = time.monotonic() + max(0.0, timeout) + 2.0
        while self._sock is not None and proc.poll() is None and time.monotonic() < deadline:
            self._wait_acks(0.05)
        late = False
        try:
            if proc is not None:  # None: closed while backing off (_writer_died)
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            late = True
            proc.kill()
            proc.wait()
        self._read_acks()
        drained = not self._outstanding and not late
        self._forget_writer(SHUTDOWN_MESSAGE)  # what it left: .error files, its temporaries
        snap = self.snapshot()
        if drained:
            logger.info("hidden-state dump: writer closed: %s", snap)
        else:
            logger.warning("hidden-state dump: writes still running after %.1fs at shutdown; "
                           "they leave only temporary files, removed at the next start: %s",
                           timeout, snap)
        self._release_arena()
        return drained

    def _release_arena(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self._arena.data_ptr())
            self.registered = False
        self._seq_host = None
        self._arena = None
        self._view.release()
        try:
            self._mm.close()
        except BufferError:
            pass  # a tensor view still lives somewhere: the mapping goes with the process
        os.close(self.arena_fd)

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except Exception as e:  # noqa: BLE001 - never fail interpreter shutdown
            logger.error("hidden-state dump: closing the writer failed: %s", e)


def _dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype as ``format`` and ``wire`` name it: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).replace("torch.", "")


def _failures(ops) -> int:
    """The requests ``wire.Failures`` ops among ``ops`` count."""
    return sum(op.count for op in ops if type(op) is wire.Failures)


def _how(code: Optional[int]) -> str:
    """A process's end in words: ``signal 9`` or ``exit code 1``."""
    return f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"


def _runs(segments):
    """Split segments into runs that follow each other in the batch."""
    run: List[tuple] = []
    for seg in segments:
        # a deferred request's rows never share an arena range with streamed rows, so a
        # held range holds nothing the writer process could otherwise let go
        if run and (run[-1][1] + run[-1][2] != seg[1] or (run[-1][0].held is None) != (seg[0].held is None)):
            yield run
            run = []
        if seg[2] > 0:
            run.append(seg)
    if run:
        yield run


def _cuda_host_register(arena: torch.Tensor) -> bool:
    """Pin the arena with ``cudaHostRegister`` (portable: every CUDA context sees it as
    pinned); False, with a warning, where CUDA refuses (copies then run synchronously)."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(arena.data_ptr(), arena.numel(), 1)  # cudaHostRegisterPortable
    if int(err) != 0:
        logger.warning("hidden-state dump: cudaHostRegister of the %d-byte arena failed (%s); "
                       "device-to-host copies will not be asynchronous", arena.numel(), err)
        return False
    return True


def _fail_orphan(dir_fd: int, name: str, message: str) -> Optional[int]:
    """Settle a file whose writer is gone (the kernel released its lock with the process).
    If the file is in place (the writer died after the rename), remove the lock and
    return the file's size; else leave ``<name>.error``, remove the lock, return None."""
    try:
        size = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_size
    except FileNotFoundError:
        size = None
    try:
        fd = fmt.open_regular(name + fmt.LOCK_SUFFIX, os.O_RDONLY, dir_fd=dir_fd)
    except OSError:
        return size
    if size is None:
        fmt.fail(fmt.Reservation(dir_fd, name, fd), message)
        return None
    # It died between the rename and the lock's release: the index line may be missing
    # (the lock's mark says, without reading the index).
    try:
        if not fmt.indexed(dir_fd, name, fd):
            fmt.append_index(dir_fd, fmt.index_record_from_header(dir_fd, name, size))
    except Exception as e:  # noqa: BLE001 - an index someone edited must not stop the scheduler
        logger.error("hidden-state dump: cannot index %s after its writer died: %s", name, e)
    fmt.complete(fmt.Reservation(dir_fd, name, fd))
    return size
