"""The writer: device-to-host copies on a side CUDA stream, writer threads, backpressure.

Nothing here blocks the scheduler except ``HostBudget.acquire`` when the configured
host-memory cap is reached (that is the backpressure: prefill waits for the disk).

Per request: ``start()`` reserves ``num_tokens x row_bytes`` of the budget and allocates
one pinned host buffer ``[num_tokens, row_width]``; each prefill chunk's rows are copied
into their slice by ``copy_rows()`` (asynchronously, on the side stream, ordered after
the forward that produced them); ``submit()`` hands the buffer to a writer thread,
which waits for the copies' events, writes the file (``format.write_reserved``), appends
the index line and releases the lock and the budget.
"""

from __future__ import annotations

import array
import atexit
import gc
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from sglang_ext import format as fmt
from sglang_ext import trace

logger = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_SWITCH_INTERVAL_MS = 0.2
DEFAULT_STATS_INTERVAL_S = 60.0
POOL_CHECK_INTERVAL_S = 0.5  # pinned-pool statistics are not free: see pinned_pool()
SHUTDOWN_MESSAGE = "server shut down before the hidden-state file was written"


def _env_number(name: str, default: float, unit: str = "seconds") -> float:
    """``float`` of environment variable ``name`` (``default`` when unset or blank);
    raises ``ValueError`` naming the variable and ``unit`` for anything else."""
    value = os.environ.get(name, "")
    if not value.strip():
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of {unit}, got {value!r}") from None


def drain_timeout_s() -> float:
    """``KIMI_SGLANG_DRAIN_TIMEOUT_S`` (default 30): how long shutdown waits for writes."""
    return _env_number("KIMI_SGLANG_DRAIN_TIMEOUT_S", DEFAULT_DRAIN_TIMEOUT_S)


def switch_interval_s() -> Optional[float]:
    """``KIMI_SGLANG_SWITCH_INTERVAL_MS`` (default 0.2): the GIL switch interval the writing
    scheduler process runs with (``sys.setswitchinterval``); 0 keeps Python's (5 ms).
    Raises ``ValueError`` for a value that is not a number >= 0.

    Why: each system call of a writer thread releases the GIL; taking it back, while the
    scheduler's busy event loop holds it, waits for the switch interval. A file costs
    about ten such calls (write, rename, index line, lock): with 5 ms, a 16 MiB file that
    one thread writes in ~7 ms (2.3 GB/s on the H200 host) reached its response after
    56 ms (bench/results/2026-11-29-h200-quick-trace.md, llama-mid 512x1: write 28 ms,
    index line + lock 16 ms); the scheduler thread waits the same way behind the writers
    in ``on_prefill_result``.
    """
    ms = _env_number("KIMI_SGLANG_SWITCH_INTERVAL_MS", DEFAULT_SWITCH_INTERVAL_MS, "milliseconds")
    if not ms >= 0:  # also NaN
        raise ValueError(f"KIMI_SGLANG_SWITCH_INTERVAL_MS must be >= 0 milliseconds, got {ms}")
    return ms / 1000.0 if ms > 0 else None


def stats_interval_s() -> float:
    """``KIMI_SGLANG_STATS_INTERVAL_S`` (default 60): seconds between counter log lines;
    0 or less logs only at shutdown."""
    return _env_number("KIMI_SGLANG_STATS_INTERVAL_S", DEFAULT_STATS_INTERVAL_S)


def apply_switch_interval() -> Optional[Tuple[float, float]]:
    """Set this process's GIL switch interval to ``switch_interval_s()``; returns
    ``(before, after)`` in seconds, or None when the variable says to keep Python's."""
    interval = switch_interval_s()
    if interval is None:
        return None
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    return before, sys.getswitchinterval()


def pinned_block_bytes(nbytes: int) -> int:
    """Bytes torch's pinned allocator (CachingHostAllocator) takes for ``nbytes``: it
    rounds every block up to a power of two (torch.cuda.memory.host_memory_stats docs),
    so the host budget counts that, not the tensor's size."""
    return 1 << max(0, int(nbytes) - 1).bit_length()


def pinned_pool() -> Optional[Dict[str, int]]:
    """The pinned pool of this process: ``bytes`` (blocks held, in use or cached),
    ``peak`` and ``alloc_ms`` (time spent in cudaHostAlloc), from
    ``torch.cuda.host_memory_stats()``; None where torch lacks the function (zeros where it
    has nothing to report yet, e.g. before CUDA starts). The key names changed across
    torch releases ("reserved_bytes" then "allocated_bytes" for the pool), so the larger of
    the two is taken. Costs a dictionary of ~40 entries built in C++: not per request."""
    try:
        st = torch.cuda.host_memory_stats()
    except Exception:  # noqa: BLE001 - older torch, or no CUDA
        return None
    pool = max(st.get("reserved_bytes.current", 0), st.get("allocated_bytes.current", 0))
    peak = max(st.get("reserved_bytes.peak", 0), st.get("allocated_bytes.peak", 0))
    return {"bytes": int(pool), "peak": int(peak),
            "alloc_ms": int(st.get("host_alloc_time.total", 0)) // 1000}


GC_AFTER_WAIT_S = 0.5  # DumpWriter.start: collect cycles once a budget wait lasts this long


def token_ids_tensor(token_ids: Sequence[int]) -> torch.Tensor:
    """``token_ids`` (SGLang's ``origin_input_ids``, a list of ints) as an int64 tensor
    ``[T]``. Through ``array('q')``: the conversion holds the GIL, which the scheduler
    thread waits for, and ``torch.tensor(list)`` took ~3x longer (py-spy --gil, deepseek-tiny
    2048x32 on the H200, 2026-12-01: that line was 7 of the writer threads' 16 samples
    holding the GIL). Raises ``OverflowError`` / ``TypeError`` for ids that are not int64."""
    buf = array.array("q", token_ids)
    if not buf:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(buf, dtype=torch.int64)


class HostBudget:
    """A byte counter with a cap; ``acquire`` blocks until the bytes fit.

    A single request larger than the cap is let through when nothing else is held, so
    one long prompt can never deadlock the server.
    """

    def __init__(self, cap_bytes: int):
        if cap_bytes < 1:
            raise ValueError("cap_bytes must be positive")
        self.cap = int(cap_bytes)
        self.in_use = 0
        self.peak = 0
        self.waits = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int, timeout: Optional[float] = None, *,
                resumed: bool = False) -> None:
        """Take ``nbytes``; raises ``TimeoutError`` if they do not fit within ``timeout`` s.
        ``waits`` counts each wait once: ``resumed=True`` continues a wait that an earlier
        call, ended by its timeout, already counted."""
        with self._cond:
            if not self._fits(nbytes):
                self.waits += 0 if resumed else 1
                if not self._cond.wait_for(lambda: self._fits(nbytes), timeout=timeout):
                    raise TimeoutError(
                        f"host budget: {nbytes} bytes did not fit in {timeout}s "
                        f"({self.in_use}/{self.cap} in use)"
                    )
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.in_use -= nbytes
            assert self.in_use >= 0, "host budget released more than it held"
            self._cond.notify_all()

    def _fits(self, nbytes: int) -> bool:
        return self.in_use + nbytes <= self.cap or self.in_use == 0


@dataclass
class PendingDump:
    """One request's rows on their way to the host: ``host`` is ``[num_tokens, row_width]``."""

    rid: str
    num_tokens: int
    host: torch.Tensor
    nbytes: int
    rows: int = 0
    events: List[Any] = field(default_factory=list)
    times: Optional[Dict[str, float]] = None  # stage timestamps while tracing (trace.py)


@dataclass
class WriterStats:
    files: int = 0
    bytes: int = 0
    failures: int = 0
    queued: int = 0
    pool_trims: int = 0

    def as_dict(self, budget: HostBudget) -> Dict[str, int]:
        return {
            "files_written": self.files,
            "bytes_written": self.bytes,
            "failures": self.failures,
            "queue_depth": self.queued,
            "host_bytes_in_use": budget.in_use,
            "host_bytes_peak": budget.peak,
            "backpressure_waits": budget.waits,
            "pinned_pool_trims": self.pool_trims,
        }


class DumpWriter:
    """Copies rows off the GPU and writes files, never on the caller's thread.

    ``dir_fd``: the dump directory (``format.open_dump_dir``). ``device``: the CUDA
    device the rows live on, or ``None`` for CPU tensors (tests). ``metrics``: an
    optional ``sglang_ext.metrics.DumpMetrics`` (Prometheus counters and gauges).

    Shutdown: ``close(timeout)`` waits for queued writes up to a deadline. It is also
    registered with ``atexit``: SGLang 0.5.17 stops a scheduler process by a
    ``ShutdownReq`` (the tokenizer manager's SIGTERM watchdog sends it after draining
    requests), ``run_scheduler_process`` returns and the spawned process leaves through
    ``sys.exit``, which runs ``atexit``. The writer threads are daemon threads, so neither
    ``threading._shutdown`` nor the interpreter waits for them beyond that deadline; a
    write cut off there (or by SIGKILL) leaves only its temporary file and lock, which
    ``format.clean_stale`` removes at the next start. Never a truncated final file.
    """

    def __init__(
        self,
        dir_fd: int,
        *,
        max_host_bytes: int,
        threads: int,
        device: Optional[torch.device] = None,
        log_every_s: Optional[float] = None,
        metrics: Any = None,
        register_atexit: bool = True,
    ):
        self.dir_fd = dir_fd
        self.budget = HostBudget(max_host_bytes)
        self.stats = WriterStats()
        self.metrics = metrics
        self._stats_lock = threading.Lock()
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._closed = False  # no new writes accepted
        self._abort = False  # deadline passed: fail what has not started
        self._cuda = device is not None and torch.device(device).type == "cuda"
        # Pinned memory the process held before this writer: not ours to trim against.
        pool = pinned_pool() if self._cuda else None
        self._pool_baseline = pool["bytes"] if pool is not None else 0
        self._pool_checked = 0.0  # monotonic time of the last pool check (trim)
        self._stream = torch.cuda.Stream(device=device) if self._cuda else None
        self._log_every_s = stats_interval_s() if log_every_s is None else log_every_s
        self._last_log = time.monotonic()
        self._threads = [
            threading.Thread(target=self._worker, name=f"hs-writer-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()
        self._atexit = register_atexit
        if register_atexit:
            atexit.register(self._close_at_exit)

    # ---- scheduler thread -------------------------------------------------------
    def start(self, rid: str, num_tokens: int, row_width: int, dtype: torch.dtype) -> PendingDump:
        """Reserve budget and a host buffer for ``num_tokens`` rows of ``row_width``.

        Blocks while the host budget is exhausted (backpressure). A pinned buffer counts
        ``pinned_block_bytes`` of its size (what the allocator really takes).
        """
        nbytes = int(num_tokens) * int(row_width) * dtype.itemsize
        if self._cuda:
            nbytes = pinned_block_bytes(nbytes)
        try:
            self.budget.acquire(nbytes, timeout=GC_AFTER_WAIT_S)
        except TimeoutError:
            # Buffers of requests SGLang dropped between prefill chunks come back when their
            # Req is freed (hooks: weakref.finalize -> abandon). A Req in a reference cycle
            # (SGLang's Req.__init__ puts the Req into its own custom_params["__req__"], so
            # every request with custom_params) is freed only by the cycle collector: after
            # a long wait run it once, or the scheduler could wait for memory nobody
            # releases. (Not before every wait: a full collection costs ~0.1 s in a server.)
            gc.collect()
            self.budget.acquire(nbytes, resumed=True)
        try:
            host = torch.empty((num_tokens, row_width), dtype=dtype, pin_memory=self._cuda)
        except BaseException:
            self.budget.release(nbytes)
            raise
        self._publish()
        pending = PendingDump(rid=rid, num_tokens=num_tokens, host=host, nbytes=nbytes)
        if trace.enabled():
            pending.times = {"t_start": trace.now()}
        return pending

    def copy_rows(self, pending: PendingDump, rows: torch.Tensor, *, ready: bool = False) -> None:
        """Copy ``rows`` (``[n, row_width]``, on the GPU) into the next ``n`` host rows.

        The copy runs on the side stream; ``rows`` is kept alive for it with
        ``record_stream``. ``ready=False``: the copy is ordered after everything already
        queued on the caller's current stream (the forward that produced ``rows``).
        ``ready=True``: the caller guarantees the kernels that produced ``rows`` have
        finished (SGLang synchronizes ``result.copy_done`` before processing a batch
        result), so the copy starts at once instead of waiting behind work the
        scheduler queued since, e.g. the next batch's forward under overlap scheduling.
        Raises ``ValueError`` if the rows overflow the buffer.
        """
        n = rows.shape[0]
        end = pending.rows + n
        if end > pending.num_tokens or rows.shape[1:] != pending.host.shape[1:]:
            raise ValueError(
                f"rid {pending.rid!r}: rows {pending.rows}..{end} of shape "
                f"{tuple(rows.shape)} do not fit a buffer of {tuple(pending.host.shape)}"
            )
        dst = pending.host[pending.rows:end]
        if self._cuda and rows.is_cuda:
            if not ready:
                self._stream.wait_stream(torch.cuda.current_stream(rows.device))
            with torch.cuda.stream(self._stream):
                dst.copy_(rows, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            rows.record_stream(self._stream)
            pending.events.append(event)
        else:
            dst.copy_(rows)
        pending.rows = end

    def submit(
        self,
        pending: PendingDump,
        reservation: fmt.Reservation,
        token_ids: Sequence[int],
        num_slots: int,
        metadata: Mapping[str, str],
    ) -> None:
        """Queue the file write; the reservation's lock is released when it is done.

        After ``close`` the write is not queued: the reservation fails at once (the
        response carries the error) and the buffer is released.
        """
        if pending.times is not None:
            pending.times["t_submit"] = trace.now()
        with self._stats_lock:
            self.stats.queued += 1
            closed = self._closed
        item = (pending, reservation, token_ids, num_slots, metadata)
        if closed:
            self._run(item, SHUTDOWN_MESSAGE)
        else:
            self._queue.put(item)
            self._publish()

    def abandon(self, pending: PendingDump) -> None:
        """Give back a request's budget without writing (aborted request)."""
        if pending.host is None:
            return  # already given back
        for event in pending.events:
            event.synchronize()
        pending.events.clear()
        pending.host = None
        self.budget.release(pending.nbytes)
        self._publish()

    # ---- writer threads -----------------------------------------------------------
    def _worker(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._run(item, SHUTDOWN_MESSAGE if self._abort else None)

    def _run(self, item, refuse: Optional[str]) -> None:
        """Write one file (or, with ``refuse``, fail it with that message)."""
        pending, reservation, token_ids, num_slots, metadata = item
        try:
            if refuse is not None:
                raise RuntimeError(refuse)
            if pending.times is not None:
                pending.times["t_picked"] = trace.now()
            size = self._write(pending, reservation, token_ids, num_slots, metadata)
            with self._stats_lock:
                self.stats.files += 1
                self.stats.bytes += size
            if self.metrics is not None:
                self.metrics.written(size)
            if pending.times is not None:
                trace.record("file", name=reservation.name, bytes=size, rows=pending.num_tokens,
                             **pending.times)
        except BaseException as e:  # noqa: BLE001 - a failed write must never kill the thread
            message = f"{type(e).__name__}: {e}"
            logger.error("hidden-state dump for rid %r failed: %s", pending.rid, message)
            fmt.fail(reservation, message)
            with self._stats_lock:
                self.stats.failures += 1
            if self.metrics is not None:
                self.metrics.failed()
        finally:
            pending.events.clear()
            if pending.host is not None:
                pending.host = None
                self.budget.release(pending.nbytes)
                self._trim_pinned_pool()
            with self._stats_lock:
                self.stats.queued -= 1
            self._publish()
            self._maybe_log()

    def _trim_pinned_pool(self) -> None:
        """Keep the pinned pool within the host cap: torch caches freed pinned blocks per
        power-of-two size and never gives them back by itself, so prompts of many sizes
        would grow the process past ``--dump-hidden-states-max-host-mb``. When the pool
        (in use + cached) exceeds the cap beyond what the process held before the writer
        started, the cached blocks are returned to CUDA (all of them, SGLang's own small
        ones too: torch has no finer call). Checked at most every
        ``POOL_CHECK_INTERVAL_S`` after a buffer is released, so the pool may pass the cap
        for that long."""
        if not self._cuda:
            return
        now = time.monotonic()
        with self._stats_lock:
            if now - self._pool_checked < POOL_CHECK_INTERVAL_S:
                return
            self._pool_checked = now
        pool = pinned_pool()
        empty_cache = getattr(torch._C, "_host_emptyCache", None)  # torch.cuda.graphs uses it
        if (pool is not None and empty_cache is not None
                and pool["bytes"] - self._pool_baseline > self.budget.cap):
            empty_cache()
            with self._stats_lock:
                self.stats.pool_trims += 1

    def _write(self, pending, reservation, token_ids, num_slots, metadata) -> int:
        for event in pending.events:
            event.synchronize()
        times = pending.times if pending.times is not None else {}
        times["t_copied"] = trace.now()
        if pending.rows != pending.num_tokens:
            raise fmt.DumpFormatError(
                f"rid {pending.rid!r}: {pending.rows} of {pending.num_tokens} rows captured"
            )
        width = pending.host.shape[1]
        if width % num_slots:
            raise fmt.DumpFormatError(
                f"rid {pending.rid!r}: row width {width} is not {num_slots} layer slots"
            )
        hidden = pending.host.view(pending.num_tokens, num_slots, width // num_slots)
        ids = token_ids_tensor(token_ids)
        size = fmt.write_reserved(reservation, hidden, ids, metadata)
        times["t_written"] = trace.now()
        fmt.append_index(
            reservation.dir_fd,
            {
                "rid": pending.rid,
                "file": reservation.name,
                "num_tokens": pending.num_tokens,
                "bytes": size,
                "layer_ids": metadata.get("layer_ids"),
            },
        )
        fmt.complete(reservation)
        times["t_released"] = trace.now()
        return size

    def _publish(self) -> None:
        if self.metrics is not None:
            with self._stats_lock:
                queued = self.stats.queued
            self.metrics.levels(queue_depth=queued, host_bytes_in_use=self.budget.in_use)

    def _maybe_log(self) -> None:
        if self._log_every_s <= 0:
            return
        now = time.monotonic()
        if now - self._last_log >= self._log_every_s:
            self._last_log = now
            logger.info("hidden-state dump: %s", self.snapshot())

    def queue_depth(self) -> int:
        """Writes queued or running (cheap: no pinned-pool statistics)."""
        with self._stats_lock:
            return self.stats.queued

    def snapshot(self) -> Dict[str, int]:
        """Counters: files and bytes written, failures, queue depth, host bytes in use
        and peak (the budget), and on CUDA the process's pinned pool (``pinned_pool_*``:
        bytes held now, peak, ms spent in cudaHostAlloc)."""
        with self._stats_lock:
            snap = self.stats.as_dict(self.budget)
        pool = pinned_pool() if self._cuda else None
        if pool is not None:
            snap.update({"pinned_pool_bytes": pool["bytes"], "pinned_pool_peak": pool["peak"],
                         "pinned_alloc_ms": pool["alloc_ms"]})
        return snap

    def close(self, timeout: Optional[float] = None) -> bool:
        """Stop taking writes; wait up to ``timeout`` s (default: ``drain_timeout_s()``)
        for queued ones; True if all finished.

        At the deadline, writes that have not started fail with an ``.error`` file (their
        waiters get the message); writes already running go on in their daemon threads
        until the process exits, which leaves at most their temporary files and locks
        (``format.clean_stale`` removes them at the next start). Logs the counters.
        """
        if timeout is None:
            timeout = drain_timeout_s()
        with self._stats_lock:
            already = self._closed
            self._closed = True
        if self._atexit:
            atexit.unregister(self._close_at_exit)
            self._atexit = False
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            with self._stats_lock:
                if self.stats.queued == 0:
                    break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        self._abort = True
        while True:  # fail what no thread has taken yet
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._run(item, SHUTDOWN_MESSAGE)
        if not already:
            for _ in self._threads:
                self._queue.put(None)
        snap = self.snapshot()
        drained = snap["queue_depth"] == 0
        if drained:
            logger.info("hidden-state dump: writer closed: %s", snap)
        else:
            logger.warning(
                "hidden-state dump: %d writes still running after %.1fs at shutdown; they "
                "leave only temporary files, removed at the next start: %s",
                snap["queue_depth"], timeout, snap,
            )
        return drained

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except Exception as e:  # noqa: BLE001 - never fail interpreter shutdown
            logger.error("hidden-state dump: closing the writer failed: %s", e)
