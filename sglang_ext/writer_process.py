"""The writer process: receives ops from one scheduler (``wire``), writes the files.

Started by ``writer.DumpWriter`` on each writing rank as
``python -m sglang_ext.writer_process`` with the socket, the arena and the dump
directory passed as descriptors. It imports neither torch nor SGLang and has a GIL of
its own, so nothing it does (system calls, per-file Python) slows the scheduler loop.

Per request (all names relative to the dump directory's descriptor):

1. ``Begin``: create its temporary file (``format.tmp_name``) exclusively (or take a
   spare whose pages are allocated already, unnamed until its ``Finish``, ``Spares``), write the
   safetensors header (``format.file_layout``: shapes and metadata are known from the
   first chunk) and the token ids.
2. ``Rows``: ``pwrite`` each chunk's rows from the arena to their place in the file, as
   chunked prefill produces them (fp8 files: the rows' scales too, a second ``pwrite``);
   the arena range goes back to the scheduler at once, so a prompt longer than the arena
   streams through it.
3. ``Finish``: the lock of the reserved final name arrives with the op (the scheduler
   created it, ``format.reserve``); rename the temporary file to the final name, append
   the index line, unlink and release the lock (``format.complete``). Any failure before
   (``ENOSPC``, a vanished directory) ends as ``format.fail``: ``<name>.error`` and the
   lock released, so the waiting response carries the message.
4. ``Abandon``: the request went away before its last row: unlink the temporary file.

With ``--store mooncake://...`` the same process, threads and acknowledgements serve the
store sink instead (``store_writer``): each request becomes one object in Mooncake Store,
put straight from the arena at its ``Finish``.

Requests are spread over ``--threads`` writer threads, all ops of one request on the same
thread (in order). The main thread receives messages, waits for the arena's sequence
number before handing out ops that read it, and sends the acknowledgements.

Shutdown: on ``Close`` or when the scheduler's end of the socket closes (the scheduler
exited or was killed), the ops already received are carried out, within ``--drain-timeout``
seconds (``Close`` carries its own); at the deadline the finishes not yet started fail
with ``format.SHUTDOWN_MESSAGE`` and the process exits. A write cut off leaves only its
temporary file and its lock, which ``format.clean_stale`` removes at the next start;
never a partial file under a final name. SIGINT is ignored (the server's Ctrl-C reaches
the scheduler, which closes us); SIGTERM starts the same drain.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import logging
import mmap
import os
import queue
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional

from sglang_ext import arena as arena_mod
from sglang_ext.copier import Copier
from sglang_ext import format as fmt
from sglang_ext import trace, wire
from sglang_ext.sink import Sink

logger = logging.getLogger("sglang_ext.writer_process")

COPY_TIMEOUT_S = 600.0  # a batch's device-to-host copy that takes longer: the GPU is hung
# Rows go to a file in slices of at most these many bytes, each counted as written in the
# arena's progress page when done (arena.bump_bytes): the scheduler's watchdog takes bytes
# written as progress, so a chunk slower to write than KIMI_SGLANG_WATCHDOG_S (0.9 GB on
# a disk below 15 MB/s at 60 s) is not a stop, while a stopped process still is. A pwrite
# may block on the disk (1 MiB: a stop only below ~17 KB/s at 60 s); a copy into a spare's
# mapping (tmpfs pages allocated ahead) never does, and is split over the copier's threads.
WRITE_SLICE_BYTES = 1 << 20
COPY_SLICE_BYTES = 64 << 20
LOST_MESSAGE = "the rows never arrived from the GPU (the device-to-host copy did not finish)"


def _sizes(row_width: int, dtype: str, num_slots: int) -> tuple:
    """``(row bytes, scale bytes)`` of one token (``format.row_bytes``,
    ``format.scale_row_bytes``); ``(0, 0)`` for a dtype no file can hold (such a request
    fails at its header and holds no rows)."""
    try:
        return fmt.row_bytes(row_width, dtype), fmt.scale_row_bytes(num_slots, dtype)
    except fmt.DumpFormatError:
        return 0, 0


@dataclass
class _Job:
    rid: Any
    num_tokens: int
    row_bytes: int = 0
    fd: Optional[int] = None
    tmp: str = ""
    base: int = 0  # file offset of hidden_states row 0
    scale_row_bytes: int = 0  # fp8: bytes of one token's scales
    scale_base: int = 0  # fp8: file offset of hidden_states_scales row 0
    size: int = 0
    rows: int = 0
    error: Optional[str] = None
    spare: bool = False  # its temporary file was a spare (Spares)
    mapping: Optional[mmap.mmap] = None  # the spare's pages, mapped: rows are copied in (Copier)
    times: Dict[str, float] = field(default_factory=dict)


def _nothing(nbytes: int) -> None:
    pass


def _unmap(job: _Job) -> None:
    if job.mapping is not None:
        job.mapping.close()
        job.mapping = None


class Writer(Sink):
    """The file work of one writer process: ``handle(op, fds)`` is called on one writer
    thread per request; acknowledgements go to ``acks`` (``wire`` events)."""

    def __init__(self, dir_fd: int, mm, *, tag: str, layer_ids, num_layers: int, extra: dict,
                 acks: Deque[wire.Ack], wake, metrics=None, spares: Optional["Spares"] = None,
                 copier: Optional[Copier] = None):
        super().__init__(acks, wake, metrics)
        self.dir_fd = dir_fd
        self.spares = spares  # files made ahead (shared by the process's writer threads)
        self.copier = copier  # rows into a spare's mapping (shared too); None: pwrite only
        self.mm = mm
        self.view = memoryview(mm)
        self.arena_base = arena_mod.address(mm) if copier is not None else 0
        self.tag = tag
        self.layer_ids = list(layer_ids)
        self.num_layers = num_layers
        self.extra = dict(extra)
        self.wrote = _nothing  # wrote(nbytes) after each slice: the thread's byte counter (_Thread)

    # ---- ops ----------------------------------------------------------------------
    def handle(self, op: wire.Op, fd: Optional[int], lost: bool = False, final: bool = False) -> None:
        """Carry out one op. ``lost``: its arena data never arrived (``COPY_TIMEOUT_S``):
        the request fails instead of writing what the arena holds (``final``, whether the
        request's ``Finish`` is in the same message, matters to the store sink only: a
        file takes each chunk's rows at once). Never raises for a
        request's own failure: it becomes that request's error (its ``Finish`` fails); the
        arena range an op names is acknowledged whatever happens."""
        kind = type(op)
        if kind is wire.Begin:
            try:
                rows, scales = _sizes(op.row_width, op.dtype, len(self.layer_ids))
                job = self.jobs[op.key] = _Job(rid=op.rid, num_tokens=op.num_tokens,
                                               times=dict(op.times or {}),
                                               row_bytes=rows, scale_row_bytes=scales)
                if lost:
                    job.error = LOST_MESSAGE
                elif not self.abort:
                    self._guard(job, self._begin, job, op.key, op.row_width, op.dtype, op.token_off,
                                op.extra)
            finally:
                self._ack(wire.DonePiece(op.piece, op.num_tokens * 8))
        elif kind is wire.Rows:
            job = self.jobs.get(op.key)
            try:
                if job is not None and lost and job.error is None:
                    job.error = LOST_MESSAGE
                    self._release(job)
                if job is not None and job.error is None and not self.abort:
                    self._guard(job, self._rows, job, op.row0, op.nrows, op.off, op.scale_off)
            finally:
                self._ack(wire.DonePiece(op.piece, op.nrows * (job.row_bytes + job.scale_row_bytes
                                                               if job is not None else 0)))
        elif kind is wire.Finish:
            job = self.jobs.pop(op.key, None)
            self._finish(op.key, job, fmt.Reservation(self.dir_fd, op.name, fd), op.times)
        elif kind is wire.Abandon:
            job = self.jobs.pop(op.key, None)
            if job is not None:
                self._release(job)

    def _guard(self, job: _Job, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - the request fails, the writer goes on
            job.error = f"{type(e).__name__}: {e}"
            self._release(job)

    def _begin(self, job: _Job, key: int, row_width: int, dtype: str, token_off: int,
               extra: Optional[Dict[str, str]] = None) -> None:
        if not isinstance(job.rid, str):
            raise TypeError(f"rid must be str, got {type(job.rid).__name__}")
        slots = len(self.layer_ids)
        if row_width % slots:
            raise fmt.DumpFormatError(f"row width {row_width} is not {slots} layer slots")
        metadata = fmt.build_metadata(rid=job.rid, layer_ids=self.layer_ids,
                                      num_layers=self.num_layers,
                                      extra={**self.extra, **fmt.dtype_metadata(dtype), **(extra or {})})
        specs = fmt.dump_tensors(job.num_tokens, slots, row_width // slots, dtype)
        layout = fmt.file_layout(specs, metadata)
        job.base = layout.offsets[fmt.KEY_HIDDEN_STATES]
        job.scale_base = layout.offsets.get(fmt.KEY_SCALES, 0)
        job.size = layout.size
        tmp = fmt.tmp_name(self.tag, key)
        job.fd, job.spare, job.mapping = self._create(tmp, layout.size)
        job.tmp = "" if job.spare else tmp  # only once it is ours: _discard unlinks nothing else
        fmt.pwrite_all(job.fd, layout.header, 0)
        ids = specs[-1].nbytes
        self._pwrite(job.fd, token_off, ids, layout.offsets[fmt.KEY_TOKEN_IDS])

    def _pwrite(self, fd: int, off: int, n: int, at: int) -> None:
        """``n`` bytes of the arena from ``off`` to file offset ``at``, by ``pwrite`` in
        slices of ``WRITE_SLICE_BYTES``, each counted (``wrote``) once written."""
        for s in range(0, n, WRITE_SLICE_BYTES):
            m = min(WRITE_SLICE_BYTES, n - s)
            fmt.pwrite_all(fd, self.view[off + s:off + s + m], at + s)
            self.wrote(m)

    def _create(self, tmp: str, size: int) -> tuple:
        """The temporary file of a ``size``-byte file: a spare (``Spares``: its pages
        allocated already, so the rows' write only copies), left unnamed until the
        request's ``Finish`` (``_finish`` links it in), else a new one named ``tmp``
        (``format.create_tmp``). Returns ``(descriptor, whether a spare, the spare's
        mapping where it holds the whole file and a ``Copier`` is set, else None)``."""
        spare = self.spares.take() if self.spares is not None and size >= SPARE_MIN_BYTES else None
        if spare is not None:
            try:
                os.ftruncate(spare.fd, size)
            except OSError as e:
                logger.warning("hidden-state dump: a spare file could not be sized (%s)", e)
                spare.close()
            else:
                mapping = spare.mapping if self.copier is not None and size <= spare.size else None
                if mapping is None and spare.mapping is not None:
                    spare.mapping.close()
                return spare.fd, True, mapping
        return fmt.create_tmp(self.dir_fd, tmp), False, None

    def _put(self, job: _Job, off: int, n: int, at: int) -> None:
        """``n`` bytes of the arena from ``off`` to the file at offset ``at``: stores into
        the spare's mapping on the copier's threads, else ``pwrite``. Raises
        ``DumpFormatError`` for a range outside the arena or the file (never a wild store)."""
        if off < 0 or n < 0 or off + n > len(self.mm) or at < 0 or at + n > job.size:
            raise fmt.DumpFormatError(f"{n} bytes at arena offset {off} to file offset {at} "
                                      f"fall outside the arena or the {job.size}-byte file")
        if job.mapping is None:
            self._pwrite(job.fd, off, n, at)
            return
        dst, src = arena_mod.address(job.mapping) + at, self.arena_base + off
        for s in range(0, n, COPY_SLICE_BYTES):
            m = min(COPY_SLICE_BYTES, n - s)
            self.copier.copy(dst + s, src + s, m)
            self.wrote(m)

    def _rows(self, job: _Job, row0: int, nrows: int, off: int, scale_off: Optional[int]) -> None:
        if row0 != job.rows or row0 + nrows > job.num_tokens:
            raise fmt.DumpFormatError(
                f"rows {row0}..{row0 + nrows} arrived after {job.rows} of {job.num_tokens}")
        if (scale_off is None) != (job.scale_row_bytes == 0):
            raise fmt.DumpFormatError("fp8 rows came without their scales (or scales without fp8)")
        if row0 == 0 and trace.enabled():
            job.times["t_rows"] = trace.now()
        self._put(job, off, nrows * job.row_bytes, job.base + row0 * job.row_bytes)
        if scale_off is not None:
            self._put(job, scale_off, nrows * job.scale_row_bytes,
                      job.scale_base + row0 * job.scale_row_bytes)
        job.rows += nrows

    def _finish(self, key: int, job: Optional[_Job], res: fmt.Reservation, times) -> None:
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
            if job.spare:  # complete now: the spare gets its temporary name (Spares)
                tmp = fmt.tmp_name(self.tag, key)
                os.link(f"/proc/self/fd/{job.fd}", tmp, dst_dir_fd=self.dir_fd)
                job.tmp = tmp
            os.close(job.fd)
            job.fd = None
            t_copied = trace.now()
            fmt.publish(self.dir_fd, job.tmp, res.name)
            job.tmp = ""
            t_written = trace.now()
            self._index(job, res)
            fmt.complete(res)
        except Exception as e:  # noqa: BLE001 - reported through .error and the ack
            message = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
            logger.error("hidden-state dump for rid %s failed: %s",
                         fmt.brief_rid(job.rid if job is not None else key), message)
            if job is not None:
                self._release(job)
            fmt.fail(res, message)
            if self.metrics is not None:
                self.metrics.failed()
            self._ack(wire.Failed(key, res.name, message))
            return
        if self.metrics is not None:
            self.metrics.written(job.size)
        self._ack(wire.Wrote(key, res.name, job.size))
        if self.spares is not None:
            self.spares.want(job.size)  # after the ack: the next one is made off this path
        if trace.enabled():
            trace.record("file", name=res.name, bytes=job.size, rows=job.num_tokens, spare=job.spare,
                         mapped=job.mapping is not None,
                         **dict(job.times, **(times or {})), t_picked=t_picked, t_copied=t_copied,
                         t_written=t_written, t_released=trace.now())
        _unmap(job)  # last: unmapping 64 MiB takes ~10 ms, off the waiter's path

    def _index(self, job: _Job, res: fmt.Reservation) -> None:
        """Append the file's index line. If that fails, the request fails as a whole: the
        file, still locked (no waiter has seen it), is unlinked and the error raised, so
        the response, the counters, the index and the directory agree. Only if even the
        unlink fails does the file stay, then counted as written without its line. The
        lock file gets the line's mark (``format.indexed``) for a writer killed after it."""
        name = res.name
        try:
            fmt.append_index(self.dir_fd, fmt.index_record(job.rid, name, job.num_tokens, job.size,
                                                           json.dumps(self.layer_ids)),
                             mark_fd=res.lock_fd)
        except OSError as e:
            try:
                os.unlink(name, dir_fd=self.dir_fd)
            except OSError as e2:
                logger.error("hidden-state dump: %s is complete but its index line failed (%s) "
                             "and it cannot be removed (%s); it stays, without an index line",
                             name, e, e2)
                return
            # a sentence, not an OSError: one of format's own (a FIFO at the index) has
            # no errno, which would read "OSError: [Errno None] ..."
            raise RuntimeError(f"the index line could not be written ({e.strerror or e}); "
                               f"the file was removed") from None

    def _release(self, job: _Job) -> None:
        """Drop a request's temporary file; never raises (what cannot be removed now is a
        leftover ``format.clean_stale`` removes at the next start).

        Past the drain deadline (``abort``) only its name goes: the main thread then
        fails the finishes still queued (``_fail_queued``) while the request's own thread
        may still be storing its rows into the mapping or writing to the descriptor;
        unmapping under that copy is a SIGSEGV of the process, closing the descriptor
        lets a later ``pwrite`` land in whatever file reuses its number. Both go with the
        process, which exits right after the deadline."""
        if not self.abort:
            _unmap(job)
            if job.fd is not None:
                try:
                    os.close(job.fd)
                except OSError:
                    pass
                job.fd = None
        if job.tmp:
            try:
                os.unlink(job.tmp, dir_fd=self.dir_fd)
            except FileNotFoundError:
                pass
            except OSError as e:
                logger.warning("hidden-state dump: cannot remove %s: %s", job.tmp, e)
            job.tmp = ""

    def _finish_failed(self, op: wire.Finish, fd: Optional[int], message: str) -> None:
        """A ``Finish`` that raised answers ``Failed``, releasing the lock with ``<name>.error``."""
        if fd is not None:
            fmt.fail(fmt.Reservation(self.dir_fd, op.name, fd), message)
            if self.metrics is not None:
                self.metrics.failed()
            self._ack(wire.Failed(op.key, op.name, message))


# Spare files: sizes worth making ahead, and how much of the directory's free space they
# may take. A file smaller than SPARE_MIN_BYTES gains little (its pages are few); a spare
# is made only while its filesystem has SPARE_FREE_FACTOR times its size free, so spares
# never push a real file into ENOSPC on a nearly full /dev/shm.
SPARE_MIN_BYTES = 4 << 20
SPARE_MAX_BYTES = 1 << 30
# The most bytes of spares one writer process holds at once (Spares.target): llama-8b's
# 2k-token files (64 MiB) may have 8 ready, Kimi-K2.5's 10k-token ones (~570 MiB) one.
SPARE_BUDGET_BYTES = 1 << 30
# Spares.target grows only after this many files in a row fit spares of the size before
# them: sizes that keep moving (mixed prompt lengths) would have it make spares they throw away
STEADY_FILES = 3
SPARE_FREE_FACTOR = 8
# After this long with no file begun or written Spares.target falls back to one and every
# ready spare goes: an idle server holds none (up to SPARE_BUDGET_BYTES of host memory on
# /dev/shm per writing rank)
SPARES_IDLE_S = 30.0


class Spares:
    """Temporary files made ahead, so a file's rows are copied into pages that exist.

    On tmpfs (``/dev/shm``) about half of a fresh file's ``pwrite`` is allocating and
    zeroing its pages (`git show 7e2b2db:bench/filelatency.py`: 64 MiB in ~44 ms fresh, ~24 ms into
    allocated pages, on the development box); the kernel serializes writes to one file
    (the inode's lock), so more threads on one file do not help, but the allocation can
    happen before the rows arrive. One thread of its own keeps ``target`` unnamed files
    (``O_TMPFILE`` in the dump directory) of the size of the last file written (``want``)
    allocated (``posix_fallocate``) and mapped shared with ``MAP_POPULATE`` (the page
    tables filled ahead too); a writer thread ``take``s one at a request's ``Begin``
    (``Writer._create``) and links it into the directory under its temporary name only
    at its ``Finish``, once every row is in (``Writer._finish``), then renames it as any
    file. Unnamed while rows are stored into it, it cannot be truncated by a neighbour
    who finds it in the directory (a store past a file's end is a SIGBUS of the whole
    process, which Python cannot turn into an error); only a process that may open the
    writer's own descriptors (``/proc/<pid>/fd``: its user, who may as well signal it)
    reaches it. A file no larger than its spare
    gets its rows by stores into that mapping, split across threads (``copier.Copier``:
    stores into a mapping take no inode lock); a larger one by ``pwrite``.

    ``target`` follows how many files begin at once. It starts at 1 (one request at a
    time), grows by one for each file that found no spare ready (a prefill batch of
    several requests begins their files together, and the last of them is what a waiting
    answer, or a run's end, waits for) and shrinks by one for each ready spare thrown
    away because file sizes moved (so a mixed-length workload does not keep allocating
    spares it never uses: it grows only after ``STEADY_FILES`` files in a row whose sizes
    fit spares of the size before them). It stays within ``count``
    (``KIMI_SGLANG_WRITER_SPARES``) and within ``budget`` bytes of ready spares
    (``SPARE_BUDGET_BYTES``; one spare at least). After ``idle_s`` seconds
    (``SPARES_IDLE_S``) with no file begun (``take``) or written (``want``) it falls back
    to one and every ready spare goes (``idle``): an idle server holds no spare; the next
    file written makes one again.

    Spares are mapped on tmpfs only (``on_tmpfs``), where a page allocated
    by ``fallocate`` is the page a store lands in, so a full filesystem cannot turn a
    store into a SIGBUS; on a disk filesystem (copy-on-write ones: btrfs, XFS with
    reflinks) a first store may need new blocks, so there spares only save the
    allocation and rows go by ``pwrite``. Files smaller than ``SPARE_MIN_BYTES`` take no
    spare.

    Unnamed, a spare is never seen in the directory and vanishes with the process, even
    a SIGKILLed one. A filesystem without ``O_TMPFILE`` or ``fallocate``, or no
    ``/proc/self/fd`` (the link at ``Finish``), turns spares off for the process; any
    other failure (no space) skips one round."""

    def __init__(self, dir_fd: int, count: int = 1, budget: int = 0, idle_s: float = SPARES_IDLE_S):
        self.dir_fd = dir_fd
        self.count = count  # the most spares kept ready
        self.budget = budget or SPARE_BUDGET_BYTES  # the most bytes of spares at once
        self.idle_s = idle_s  # no file for this long: target back to one (_decay)
        self.used = time.monotonic()  # the last take or want
        self.target = min(1, count)  # how many to keep ready now (the class doc)
        self.size = 0  # what to make: the last file's size (0: nothing)
        self.made = 0  # spares made (tests, the log)
        self.missed = 0  # takes that found none ready once a size was known (tests)
        self.steady = 0  # files in a row whose size fit spares of the one before (take)
        self.ready: List[Spare] = []  # each holds a file of self.size bytes (_fits)
        self.enabled = os.path.isdir("/proc/self/fd")  # a spare is linked in through it
        self.closed = False
        self.stalled = False  # a make failed (no space): none is tried until the next want
        self.idle = False  # idle_s passed without a file: spares given back until the next want
        self.mappable = on_tmpfs(dir_fd)  # see the class doc: elsewhere spares take pwrite only
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="hs-writer-spares", daemon=True)
        self.thread.start()

    def want(self, size: int) -> None:
        """A file of ``size`` bytes was written: keep spares of that size. Sizes outside
        ``SPARE_MIN_BYTES``..``SPARE_MAX_BYTES`` change nothing (a short prompt says
        nothing about the next long one); a ready spare stays while it still holds such a
        file without wasting more than its size (``_fits``)."""
        if not SPARE_MIN_BYTES <= size <= SPARE_MAX_BYTES:
            return
        with self.cond:
            self.used = time.monotonic()
            self.stalled = self.idle = False
            moved = False  # spares of the last size would not do for this one
            if size != self.size:
                moved = bool(self.size) and not _fits(self.size, size)
                self.size = size
                stale = [s for s in self.ready if not _fits(s.size, size)]
                self.ready = [s for s in self.ready if _fits(s.size, size)]
                for spare in stale:
                    spare.close()
                self.target = max(min(1, self.count), self.target - len(stale))
            self.steady = 0 if moved else self.steady + 1
            self.cond.notify()

    def take(self) -> Optional["Spare"]:
        """A spare (``self.size`` bytes allocated, mapped if it could be), or None. None,
        once a size is known and after ``STEADY_FILES`` files in a row whose sizes fit
        spares of the size before them (files coming together, not sizes moving), raises
        ``target`` by one (the class doc)."""
        with self.cond:  # no refill now: it would compete with this file's write (want)
            self.used = time.monotonic()
            if self.ready:
                return self.ready.pop()
            if self.size and self.enabled:
                self.missed += 1
                if self.steady >= STEADY_FILES:
                    self.target = min(self.target + 1, self.count)
            return None

    def close(self) -> None:
        with self.cond:
            self.closed = True
            for spare in self.ready:
                spare.close()
            self.ready = []
            self.cond.notify()

    def _wanted(self) -> int:
        """The size of the next spare to make, or 0: ``target`` not reached, and the ready
        spares (each up to twice ``size``, ``_fits``) plus this one within ``budget``, one
        spare at least."""
        if self.idle or not self.size or len(self.ready) >= self.target:
            return 0
        held = sum(s.size for s in self.ready)
        return self.size if not self.ready or held + self.size <= self.budget else 0

    def _idle_left(self) -> Optional[float]:
        """Seconds until ``_decay`` has something to do, or None (the target is at its
        floor and no spare is ready: wait for a file)."""
        if self.target <= min(1, self.count) and not self.ready:
            return None
        return max(0.0, self.used + self.idle_s - time.monotonic())

    def _decay(self) -> None:
        """No file for ``idle_s``: the target back to one, every ready spare closed, none
        made until the next file is written (``idle``)."""
        if self.used + self.idle_s > time.monotonic():
            return
        self.target = min(1, self.count)
        self.idle = True
        gone, self.ready = self.ready, []
        for spare in gone:
            spare.close()

    def _wait(self, until) -> None:
        """Under ``cond``: wait until ``until()``, closed or disabled, decaying on time."""
        while not self.closed and self.enabled and not until():
            left = self._idle_left()
            if left == 0.0:
                self._decay()
            else:
                self.cond.wait(left)

    def _run(self) -> None:
        while True:
            with self.cond:
                self._wait(self._wanted)
                if self.closed or not self.enabled:
                    return
                size = self._wanted()
            spare = self._make(size)
            if spare is None:
                with self.cond:  # retry at the next file written (want), not in a loop
                    self.stalled = True
                    self._wait(lambda: not self.stalled)
                continue
            with self.cond:
                if self.closed or not _fits(spare.size, self.size):
                    spare.close()
                else:
                    self.ready.append(spare)
                    self.made += 1

    def _make(self, size: int) -> Optional["Spare"]:
        """One unnamed file of ``size`` allocated bytes (mapped on tmpfs: ``Spare.mapping``),
        or None."""
        try:
            st = os.fstatvfs(self.dir_fd)
            if st.f_bavail * st.f_frsize < SPARE_FREE_FACTOR * size:
                return None
            fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, fmt.file_mode(),
                         dir_fd=self.dir_fd)
        except (OSError, ValueError, AttributeError) as e:  # AttributeError: no O_TMPFILE
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                return None
            self.enabled = False
            return None
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                self.enabled = False
            return None
        return Spare.mapped(fd, size) if self.mappable else Spare(fd, size)


TMPFS_MAGIC = 0x01021994  # linux/magic.h: statfs' f_type of tmpfs and shmem


def on_tmpfs(fd: int) -> bool:
    """Whether the directory (or file) ``fd`` is on tmpfs: ``fstatfs``'s ``f_type``, the
    first field of Linux's ``struct statfs`` (a word), read through libc. False where it
    cannot be told."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
        if libc.fstatfs(fd, buf) != 0:
            return False
        return struct.unpack_from("@l", buf.raw)[0] & 0xFFFFFFFF == TMPFS_MAGIC
    except (OSError, AttributeError):
        return False


def _fits(spare_size: int, size: int) -> bool:
    """A spare of ``spare_size`` bytes is kept for files of ``size``: it holds one and its
    unused tail is at most ``size``."""
    return size <= spare_size <= 2 * size


@dataclass
class Spare:
    """A spare file: its descriptor (read-write), its allocated size, and its pages mapped
    shared (``MAP_POPULATE``), or None where the mapping failed (the file is still a
    spare; its rows go by ``pwrite``)."""

    fd: int
    size: int
    mapping: Optional[mmap.mmap] = None

    @classmethod
    def mapped(cls, fd: int, size: int) -> "Spare":
        try:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            return cls(fd, size, mmap.mmap(fd, size, flags=flags,
                                           prot=mmap.PROT_READ | mmap.PROT_WRITE))
        except (OSError, ValueError):
            return cls(fd, size)

    def close(self) -> None:
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        os.close(self.fd)


class _Thread:
    """One writer thread with its own queue, so a request's ops run in order. ``progress``:
    the arena's first page (``arena.attach_progress``), where it counts the ops it has
    carried out and the bytes its writer has written for the scheduler's watchdog (slot
    ``i``), or None."""

    def __init__(self, i: int, writer: Writer, progress=None):
        self.i = i
        self.writer = writer
        self.progress = progress
        if progress is not None:  # bytes written count as progress too (WRITE_SLICE_BYTES)
            writer.wrote = lambda nbytes: arena_mod.bump_bytes(progress, i, nbytes)
        self.queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"hs-writer-{i}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                self.writer.discard_all()
                return
            try:
                self.writer.handle(*item)
            except Exception as e:  # noqa: BLE001 - a bug in one op must not end the thread
                self.writer.failed_op(item[0], item[1], e)
            if self.progress is not None:
                arena_mod.bump_progress(self.progress, self.i)


class _Levels:
    """What the main thread knows of the work in hand: finishes not yet done
    (``queue_depth``) and arena bytes of ops not yet written (``host_bytes_in_use``), plus
    the totals; published as gauges and in the periodic log line."""

    def __init__(self, metrics, log_every_s: float, num_slots: int = 1):
        self.metrics = metrics
        self.queue_depth = 0
        self.held = 0
        self.peak = 0
        self.files = self.bytes = self.failures = 0
        self._row_bytes: Dict[int, int] = {}
        self._slots = num_slots
        self._every = log_every_s
        self._last_log = time.monotonic()
        self._dirty = True

    def received(self, op: wire.Op) -> None:
        kind = type(op)
        if kind is wire.Begin:
            self._row_bytes[op.key] = sum(_sizes(op.row_width, op.dtype, self._slots))
            self.held += op.num_tokens * 8
        elif kind is wire.Rows:
            self.held += op.nrows * self._row_bytes.get(op.key, 0)
        elif kind is wire.Finish:
            self.queue_depth += 1
            self._row_bytes.pop(op.key, None)
        elif kind is wire.Abandon:
            self._row_bytes.pop(op.key, None)
        self.peak = max(self.peak, self.held)
        self._dirty = True

    def acked(self, ev: wire.Ack) -> None:
        kind = type(ev)
        if kind is wire.DonePiece:
            self.held -= ev.nbytes
        elif kind is wire.Wrote:
            self.queue_depth -= 1
            self.files += 1
            self.bytes += ev.nbytes
        elif kind is wire.Failed:
            self.queue_depth -= 1
            self.failures += 1
        self._dirty = True

    def failed_elsewhere(self, count: int) -> None:
        """``count`` requests failed on the scheduler's side (``wire.Failures``)."""
        self.failures += count
        if self.metrics is not None:
            self.metrics.failed(count)
        self._dirty = True

    def publish(self) -> None:
        if self._dirty and self.metrics is not None:
            self.metrics.levels(queue_depth=self.queue_depth, host_bytes_in_use=self.held)
        self._dirty = False
        if self._every > 0 and time.monotonic() - self._last_log >= self._every:
            self._last_log = time.monotonic()
            logger.info("hidden-state dump: %s", self.snapshot())

    def snapshot(self) -> dict:
        return {"files_written": self.files, "bytes_written": self.bytes,
                "failures": self.failures, "queue_depth": self.queue_depth,
                "host_bytes_in_use": self.held, "host_bytes_peak": self.peak}


def serve(sock: socket.socket, mm, dir_fd: int, *, threads: int, tag: str, layer_ids,
          num_layers: int, extra: dict, drain_timeout: float, metrics=None,
          stats_interval_s: float = 0.0, progress=None, connection=None, spares: int = 0) -> int:
    """Receive and carry out ops until ``Close`` or the scheduler's end closes; returns the
    number of writes still running at the drain deadline (0 when all ended).
    ``connection``: a ``store_writer.Connection`` selects the store sink (objects in
    Mooncake Store, ``store_writer.StoreWriter``); ``None`` the file sink (``Writer``,
    files in ``dir_fd``)."""
    acks: Deque[wire.Ack] = deque()
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    if connection is not None:
        from sglang_ext.store_writer import StoreWriter

        base = arena_mod.address(mm)

        def sink():
            return StoreWriter(connection, mm, base, layer_ids=layer_ids, acks=acks, wake=wake_w,
                               metrics=metrics)
    else:
        made_ahead = Spares(dir_fd, spares) if spares > 0 else None
        copier = Copier() if made_ahead is not None else None  # only spares are mapped

        def sink():
            return Writer(dir_fd, mm, tag=tag, layer_ids=layer_ids, num_layers=num_layers,
                          extra=extra, acks=acks, wake=wake_w, metrics=metrics, spares=made_ahead,
                          copier=copier)
    workers = [_Thread(i, sink(), progress) for i in range(max(1, threads))]
    levels = _Levels(metrics, stats_interval_s, len(layer_ids))
    stop = {"timeout": None}

    def on_sigterm(signum, frame):  # drain as for Close
        stop["timeout"] = drain_timeout

    signal.signal(signal.SIGTERM, on_sigterm)
    out = _Acks(sock, acks, levels)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    while stop["timeout"] is None:
        ready = dict(poller.poll(100))
        if wake_r in ready:
            _drain_pipe(wake_r)
        if sock.fileno() in ready:
            while True:
                try:
                    msg = wire.recv_ops(sock, socket.MSG_DONTWAIT, locks=connection is None)
                except BlockingIOError:
                    break
                except wire.BadMessage as e:  # the scheduler bounds its messages: a bug, not a reason to stop
                    logger.error("hidden-state dump: %s; its ops are lost (their files fail)", e)
                    continue
                except OSError:
                    msg = None
                if msg is None:  # the scheduler is gone
                    out.peer_open = False
                    stop["timeout"] = drain_timeout
                    break
                seq, ops, fds = msg
                arrived = not seq or arena_mod.wait_seq(mm, seq, timeout=COPY_TIMEOUT_S)
                if not arrived:  # never write rows that did not land: fail their files
                    logger.error("hidden-state dump: rows of copy %d did not arrive within %.0f s",
                                 seq, COPY_TIMEOUT_S)
                fds = iter(fds)
                finishing = {op.key for op in ops if type(op) is wire.Finish}
                for op in ops:
                    kind = type(op)
                    if kind is wire.Close:
                        stop["timeout"] = float(op.timeout_s)
                        continue
                    if kind is wire.MarkError:
                        workers[0].queue.put((op, None, False, False))
                        continue
                    if kind is wire.Failures:
                        levels.failed_elsewhere(op.count)
                        continue
                    fd = next(fds, None) if kind is wire.Finish else None
                    levels.received(op)
                    workers[op.key % len(workers)].queue.put((op, fd, not arrived, op.key in finishing))
        out.send()
        levels.publish()
    # drain: everything received is queued; each thread stops after its queue
    deadline = time.monotonic() + max(0.0, stop["timeout"])
    for w in workers:
        w.queue.put(None)
    while any(w.thread.is_alive() for w in workers) and time.monotonic() < deadline:
        out.send()
        time.sleep(0.005)
    late = 0
    if any(w.thread.is_alive() for w in workers):
        for w in workers:  # first all: a finish its own thread picks up now fails too
            w.writer.abort = True
        for w in workers:  # fail the finishes not started yet; let running writes end
            _fail_queued(w)
        grace = time.monotonic() + 1.0
        while any(w.thread.is_alive() for w in workers) and time.monotonic() < grace:
            time.sleep(0.005)
        late = sum(w.thread.is_alive() for w in workers)
    out.send(block=True)
    levels.publish()
    if connection is None and made_ahead is not None:
        made_ahead.close()
        if not late:  # a write still running may be copying
            copier.close()
    return late


def _fail_queued(w: "_Thread") -> None:
    """Past the drain deadline: take what ``w`` has not started and fail its finishes."""
    while True:
        try:
            item = w.queue.get_nowait()
        except queue.Empty:
            return
        if item is not None:
            w.writer.handle(*item)  # abort is set: a Finish fails, the rest is skipped


class _Acks:
    """Sends the writer threads' acknowledgements to the scheduler (``wire.pack_acks``),
    never blocking the main thread (what does not fit waits for the next round) except at
    the very end."""

    def __init__(self, sock: socket.socket, acks: Deque[wire.Ack], levels: _Levels):
        self.sock, self.acks, self.levels = sock, acks, levels
        self.unsent: List[wire.Ack] = []
        self.peer_open = True

    def send(self, block: bool = False) -> None:
        while self.acks:
            ev = self.acks.popleft()
            self.levels.acked(ev)
            self.unsent.append(ev)
        if not self.peer_open:
            self.unsent.clear()
            return
        while self.unsent:
            blob, n = wire.pack_acks(self.unsent)
            try:
                if block:
                    self.sock.settimeout(5.0)
                    self.sock.send(blob)
                else:
                    self.sock.send(blob, socket.MSG_DONTWAIT)
            except (BlockingIOError, TimeoutError):
                return
            except OSError:
                self.peer_open = False
                return
            del self.unsent[:n]


def _drain_pipe(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sock-fd", type=int, required=True)
    p.add_argument("--arena-fd", type=int, required=True)
    p.add_argument("--arena-size", type=int, required=True, help="usable arena bytes")
    p.add_argument("--dir-fd", type=int, default=-1, help="the dump directory (file sink)")
    p.add_argument("--store", default=None,
                   help="a mooncake:// address (store.StoreConfig.from_url): the store sink")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--spares", type=int, default=0,
                   help="the most files kept allocated ahead (Spares; file sink only, 0: none)")
    p.add_argument("--tag", required=True, help="names this writer's temporary files")
    p.add_argument("--meta", required=True,
                   help='JSON {"layer_ids": [...], "num_layers": N, "extra": {...}}')
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--stats-interval", type=float, default=0.0,
                   help="seconds between counter log lines (0: none)")
    p.add_argument("--metrics-model-name", default=None,
                   help="publish Prometheus metrics (sglang_ext.metrics) with this model_name")
    p.add_argument("--cpus", default=None,
                   help="comma-separated CPUs to run on (KIMI_SGLANG_WRITER_CPUS, parsed by the scheduler)")
    args = p.parse_args(argv)
    if args.cpus:  # before any thread starts: they inherit it
        try:
            os.sched_setaffinity(0, [int(c) for c in args.cpus.split(",")])
        except OSError:
            pass  # the scheduler set it already (or refused to start this process)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="[%(asctime)s kimi-sglang writer] %(message)s")
    meta = json.loads(args.meta)
    sock = socket.socket(fileno=args.sock_fd)
    mm = arena_mod.attach(args.arena_fd, args.arena_size)
    metrics = None
    if args.metrics_model_name is not None:
        from sglang_ext.metrics import DumpMetrics, mark_dead

        metrics = DumpMetrics(args.metrics_model_name)
    connection = None
    if args.store is not None:
        from sglang_ext.store import StoreConfig
        from sglang_ext.store_writer import Connection

        connection = Connection(StoreConfig.from_url(args.store), arena_mod.address(mm), len(mm))
    late = serve(sock, mm, args.dir_fd, threads=args.threads, tag=args.tag,
                 layer_ids=meta["layer_ids"], num_layers=meta["num_layers"],
                 extra=meta.get("extra", {}), drain_timeout=args.drain_timeout,
                 metrics=metrics, stats_interval_s=args.stats_interval,
                 progress=arena_mod.attach_progress(args.arena_fd), connection=connection,
                 spares=args.spares)
    if connection is not None:
        connection.close()  # its segment leaves the master: objects not read by now are gone
    if late and connection is None:
        logger.warning("%d writes still running at the drain deadline; they leave only "
                       "temporary files and locks, removed at the next start", late)
    elif late:
        logger.warning("%d puts still running at the drain deadline; their handles got "
                       ":error markers where the master answered", late)
    if metrics is not None:
        mark_dead(os.getpid())
    sys.stdout.flush()
    os._exit(0)  # daemon writer threads may still be inside a write


if __name__ == "__main__":
    sys.exit(main())
