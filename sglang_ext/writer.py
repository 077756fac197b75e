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

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from sglang_ext import format as fmt

logger = logging.getLogger(__name__)


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

    def acquire(self, nbytes: int, timeout: Optional[float] = None) -> None:
        """Take ``nbytes``; raises ``TimeoutError`` if they do not fit within ``timeout`` s."""
        with self._cond:
            if not self._fits(nbytes):
                self.waits += 1
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


@dataclass
class WriterStats:
    files: int = 0
    bytes: int = 0
    failures: int = 0
    queued: int = 0

    def as_dict(self, budget: HostBudget) -> Dict[str, int]:
        return {
            "files_written": self.files,
            "bytes_written": self.bytes,
            "failures": self.failures,
            "queue_depth": self.queued,
            "host_bytes_in_use": budget.in_use,
            "host_bytes_peak": budget.peak,
            "backpressure_waits": budget.waits,
        }


class DumpWriter:
    """Copies rows off the GPU and writes files, never on the caller's thread.

    ``dir_fd``: the dump directory (``format.open_dump_dir``). ``device``: the CUDA
    device the rows live on, or ``None`` for CPU tensors (tests).
    """

    def __init__(
        self,
        dir_fd: int,
        *,
        max_host_bytes: int,
        threads: int,
        device: Optional[torch.device] = None,
        log_every_s: float = 60.0,
    ):
        self.dir_fd = dir_fd
        self.budget = HostBudget(max_host_bytes)
        self.stats = WriterStats()
        self._stats_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hs-writer")
        self._cuda = device is not None and torch.device(device).type == "cuda"
        self._stream = torch.cuda.Stream(device=device) if self._cuda else None
        self._log_every_s = log_every_s
        self._last_log = time.monotonic()

    # ---- scheduler thread -------------------------------------------------------
    def start(self, rid: str, num_tokens: int, row_width: int, dtype: torch.dtype) -> PendingDump:
        """Reserve budget and a host buffer for ``num_tokens`` rows of ``row_width``.

        Blocks while the host budget is exhausted (backpressure).
        """
        nbytes = int(num_tokens) * int(row_width) * torch.empty((), dtype=dtype).element_size()
        self.budget.acquire(nbytes)
        try:
            host = torch.empty((num_tokens, row_width), dtype=dtype, pin_memory=self._cuda)
        except BaseException:
            self.budget.release(nbytes)
            raise
        return PendingDump(rid=rid, num_tokens=num_tokens, host=host, nbytes=nbytes)

    def copy_rows(self, pending: PendingDump, rows: torch.Tensor) -> None:
        """Copy ``rows`` (``[n, row_width]``, on the GPU) into the next ``n`` host rows.

        The copy runs on the side stream after everything already queued on the
        current stream (the forward that produced ``rows``); ``rows`` is kept alive for
        it with ``record_stream``. Raises ``ValueError`` if the rows overflow the buffer.
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
        """Queue the file write; the reservation's lock is released when it is done."""
        with self._stats_lock:
            self.stats.queued += 1
        self._pool.submit(self._write, pending, reservation, token_ids, num_slots, metadata)

    def abandon(self, pending: PendingDump) -> None:
        """Give back a request's budget without writing (aborted request)."""
        for event in pending.events:
            event.synchronize()
        pending.events.clear()
        pending.host = None
        self.budget.release(pending.nbytes)

    # ---- writer threads -----------------------------------------------------------
    def _write(self, pending, reservation, token_ids, num_slots, metadata) -> None:
        try:
            for event in pending.events:
                event.synchronize()
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
            ids = torch.tensor(list(token_ids), dtype=torch.int64)
            size = fmt.write_reserved(reservation, hidden, ids, metadata)
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
            with self._stats_lock:
                self.stats.files += 1
                self.stats.bytes += size
        except BaseException as e:  # noqa: BLE001 - a failed write must never kill the thread
            message = f"{type(e).__name__}: {e}"
            logger.error("hidden-state dump for rid %r failed: %s", pending.rid, message)
            fmt.fail(reservation, message)
            with self._stats_lock:
                self.stats.failures += 1
        finally:
            pending.events.clear()
            pending.host = None
            self.budget.release(pending.nbytes)
            with self._stats_lock:
                self.stats.queued -= 1
            self._maybe_log()

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log >= self._log_every_s:
            self._last_log = now
            logger.info("hidden-state dump: %s", self.stats.as_dict(self.budget))

    def snapshot(self) -> Dict[str, int]:
        """Counters: files and bytes written, failures, queue depth, host bytes in use."""
        with self._stats_lock:
            return self.stats.as_dict(self.budget)

    def close(self, timeout: float = 60.0) -> bool:
        """Wait up to ``timeout`` s for queued writes; True if all finished.

        Writes still running after the deadline leave only temporary files and locks,
        which ``format.clean_stale`` removes at the next start.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._stats_lock:
                if self.stats.queued == 0:
                    break
            time.sleep(0.01)
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._stats_lock:
            return self.stats.queued == 0
