"""Copies of one large byte range split across threads: the file sink's rows into a
file's mapped pages.

Why: the kernel serializes ``pwrite``s to one file (the inode's lock), so a 64 MiB file
is written at one thread's memory-copy speed however many writer threads there are
(a since-removed probe, `git show 7e2b2db:bench/filelatency.py`, measured 1, 2 and 4 threads alike). Stores into a shared mapping of
the file take no such lock: ``Copier.copy`` cuts the range into pieces of at least
``MIN_PIECE`` bytes and copies them with ``ctypes.memmove``, which releases the GIL, on
up to ``threads`` threads at once (the caller's included).

The caller owns the memory's validity: both ranges must lie inside live mappings for the
whole call (``copy`` checks nothing but ``n``), and the destination's pages must exist
(a store into a hole of a file on a full filesystem is a SIGBUS, not an error): the
writer uses it only for files whose pages ``posix_fallocate`` made and ``MAP_POPULATE``
mapped ahead (``writer_process.Spares``).
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

MIN_PIECE = 4 << 20  # smaller pieces cost more in hand-offs (~50 us each) than they save
MAX_THREADS = 8  # ~8 threads saturate a socket's memory bandwidth for copies


def default_threads() -> int:
    """Threads for copies: the CPUs this process may run on (its affinity, which
    ``KIMI_SGLANG_WRITER_CPUS`` sets), at most ``MAX_THREADS``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus))


class Copier:
    """``copy(dst, src, n)``: ``n`` bytes from address ``src`` to address ``dst``, split
    over up to ``threads`` threads (``threads - 1`` pool threads plus the caller)."""

    def __init__(self, threads: Optional[int] = None):
        self.threads = max(1, threads if threads is not None else default_threads())
        self.pool = (ThreadPoolExecutor(self.threads - 1, thread_name_prefix="hs-writer-copy")
                     if self.threads > 1 else None)

    def copy(self, dst: int, src: int, n: int) -> None:
        """Copy ``n`` bytes (``n >= 0``) from ``src`` to ``dst`` (addresses, ranges not
        overlapping); returns when all are copied. Raises ``ValueError`` for ``n < 0``."""
        if n < 0:
            raise ValueError(f"cannot copy {n} bytes")
        pieces = max(1, min(self.threads, n // MIN_PIECE))
        if pieces == 1 or self.pool is None:
            ctypes.memmove(dst, src, n)
            return
        step = -(-n // pieces)
        step += -step % 4096  # whole pages per piece (at a page-aligned destination)
        futures = [self.pool.submit(ctypes.memmove, dst + off, src + off, min(step, n - off))
                   for off in range(step, n, step)]
        ctypes.memmove(dst, src, min(step, n))
        for f in futures:
            f.result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
