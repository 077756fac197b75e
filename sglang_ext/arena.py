"""The shared host arena: pinned memory the scheduler copies rows into and the writer
process writes files from.

One ``memfd`` of ``HEADER_BYTES + size`` bytes, mapped by both processes (the writer
process gets the descriptor at spawn). On CUDA the scheduler registers the mapping with
``cudaHostRegister`` once at start-up, so device-to-host copies into it are asynchronous
DMA like copies into ``pin_memory`` tensors, with no per-request pinned allocation.

The first page holds one int64 at offset 0: the copy sequence number (``SEQ_OFFSET``),
from ``PROGRESS_OFFSET`` one int64 per writer thread: how many ops it has carried out, and
from ``BYTES_OFFSET`` one per writer thread: how many bytes it has written (the only bytes
the writer process writes, through its own small mapping, ``attach_progress``), which the
scheduler's watchdog reads.
The scheduler enqueues, on its copy stream after a batch's row copies, a copy of the
batch's sequence number into it; stream order makes it land only after those rows. The
writer process reads rows of a batch once it sees that number (``wait_seq``): no CUDA in
the writer process, no thread in the scheduler waiting for copies.

``Extents`` hands out byte ranges of the arena: the scheduler allocates, the writer
process says (in its acknowledgements) which ranges it is done with, the scheduler frees
them. Freed ranges merge with their neighbours.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import struct
import time
from typing import List, Optional, Tuple

HEADER_BYTES = 4096
SEQ_OFFSET = 0
# Progress counters of the writer process: one int64 per writer thread (ops carried out)
# from PROGRESS_OFFSET, then one per writer thread (bytes written) from BYTES_OFFSET to the
# end of the first page; the scheduler's watchdog sums each kind.
PROGRESS_OFFSET = 64
PROGRESS_SLOTS = 256  # config.MAX_WRITER_THREADS
BYTES_OFFSET = PROGRESS_OFFSET + 8 * PROGRESS_SLOTS
BYTES_SLOTS = (HEADER_BYTES - BYTES_OFFSET) // 8
ALIGN = 512  # every range starts on a 512-byte boundary (DMA- and sector-friendly)


class Extents:
    """Free byte ranges of ``[start, end)``; first fit, merging on free. Not thread-safe
    (only the scheduler thread uses it)."""

    def __init__(self, start: int, end: int, align: int = ALIGN):
        if end <= start:
            raise ValueError(f"empty range [{start}, {end})")
        self.start, self.end, self.align = start, end, align
        self._starts: List[int] = [start]
        self._ends: List[int] = [end]
        self.in_use = 0
        self.peak = 0

    @property
    def capacity(self) -> int:
        return self.end - self.start

    def alloc(self, want: int, minimum: int) -> Optional[Tuple[int, int]]:
        """A range of ``want`` bytes (rounded up to ``align``) if one is free, else the
        largest free range of at least ``minimum`` bytes (rounded up), truncated to a
        multiple of ``align``; ``None`` when not even ``minimum`` fits. Returns
        ``(offset, nbytes)``; ``nbytes`` may exceed what was asked by the rounding."""
        want_r = self._round(want)
        min_r = self._round(minimum)
        best = -1
        for i, (s, e) in enumerate(zip(self._starts, self._ends)):
            size = e - s
            if size >= want_r:
                return self._take(i, want_r)
            if size >= min_r and (best < 0 or size > self._ends[best] - self._starts[best]):
                best = i
        if best < 0:
            return None
        size = (self._ends[best] - self._starts[best]) // self.align * self.align
        return self._take(best, size)

    def free(self, offset: int, nbytes: int) -> None:
        """Give ``[offset, offset + nbytes)`` back; raises ``ValueError`` if any of it is
        already free or outside the arena."""
        end = offset + nbytes
        if nbytes <= 0 or offset < self.start or end > self.end:
            raise ValueError(f"range [{offset}, {end}) is outside the arena")
        i = bisect.bisect_right(self._starts, offset)
        if (i > 0 and self._ends[i - 1] > offset) or (i < len(self._starts) and self._starts[i] < end):
            raise ValueError(f"range [{offset}, {end}) is already free")
        self.in_use -= nbytes
        if i > 0 and self._ends[i - 1] == offset:  # merge with the left neighbour
            i -= 1
            self._ends[i] = end
        else:
            self._starts.insert(i, offset)
            self._ends.insert(i, end)
        if i + 1 < len(self._starts) and self._starts[i + 1] == self._ends[i]:  # and the right
            self._ends[i] = self._ends.pop(i + 1)
            self._starts.pop(i + 1)

    def reset(self) -> None:
        """Everything free again (the writer process that held ranges is gone)."""
        self._starts, self._ends, self.in_use = [self.start], [self.end], 0

    def _round(self, n: int) -> int:
        return max(self.align, -(-int(n) // self.align) * self.align)

    def _take(self, i: int, n: int) -> Tuple[int, int]:
        off = self._starts[i]
        if self._ends[i] - off == n:
            self._starts.pop(i)
            self._ends.pop(i)
        else:
            self._starts[i] = off + n
        self.in_use += n
        self.peak = max(self.peak, self.in_use)
        return off, n


class ArenaError(OSError):
    """The arena cannot be made (``create``): one sentence naming the size, the step
    that failed and why, and ``--dump-hidden-states-max-host-mb``, the flag the size
    comes from; ``errno`` is the system call's (None for a size past ``off_t``)."""


def create(size: int) -> Tuple[int, mmap.mmap]:
    """A new arena of ``size`` usable bytes: ``(fd, mapping)``; the descriptor is not
    inheritable (pass it with ``subprocess.Popen(pass_fds=...)``).

    Raises ``ArenaError`` (an ``OSError``) when the kernel refuses the memfd, its size or
    the mapping (ENOMEM for more address space or memory than the host has), or when
    ``size`` is past what a file offset holds; the message names the size and the
    server flag it comes from, so that start-up fails with a sentence instead of a bare
    ``[Errno 12] Cannot allocate memory``.
    """
    step = "memfd_create"
    fd = -1
    try:
        fd = os.memfd_create("kimi-sglang-arena", os.MFD_CLOEXEC)
        step = "ftruncate"
        os.ftruncate(fd, HEADER_BYTES + int(size))
        step = "mmap"
        mm = mmap.mmap(fd, HEADER_BYTES + int(size))
    except (OSError, OverflowError, ValueError) as e:
        if fd >= 0:
            os.close(fd)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else f"the size is too large ({e})"
        err = ArenaError(
            f"cannot allocate the {_mib(size)} host arena ({step}: {reason}); it is this "
            f"writer rank's share of --dump-hidden-states-max-host-mb: give a smaller value"
        )
        err.errno = getattr(e, "errno", None)
        raise err from None
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    return fd, mm


def _mib(size: int) -> str:
    """``size`` bytes as whole MiB, or bytes below 1 MiB (for messages)."""
    size = int(size)
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size}-byte"


def attach(fd: int, size: int) -> mmap.mmap:
    """Map an arena made by ``create`` (in the writer process), read-only."""
    return mmap.mmap(fd, HEADER_BYTES + int(size), prot=mmap.PROT_READ)


class _PyBuffer(ctypes.Structure):  # CPython's Py_buffer (Include/pybuffer.h)
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.py_object), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


def address(mm: mmap.mmap) -> int:
    """The address of the mapping ``mm``'s first byte (what the store registers, what the
    file sink's parallel copies read from). The writer process maps the arena read-only,
    which ``ctypes.c_char.from_buffer`` refuses, so the address comes from the buffer
    protocol itself; the mapping must outlive every use of the address."""
    view = _PyBuffer()
    ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(mm), ctypes.byref(view), 0)
    try:
        return int(view.buf)
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(view))


def write_seq(mm: mmap.mmap, seq: int) -> None:
    """Publish ``seq`` from the CPU (when the rows were copied synchronously)."""
    struct.pack_into("<q", mm, SEQ_OFFSET, seq)


def read_seq(mm: mmap.mmap) -> int:
    return struct.unpack_from("<q", mm, SEQ_OFFSET)[0]


def wait_seq(mm: mmap.mmap, seq: int, timeout: float) -> bool:
    """Wait until the arena's sequence number reaches ``seq``; False after ``timeout`` s.
    Polls: first after 20 us, backing off to 1 ms (a batch's copies take ~0.1-40 ms)."""
    if read_seq(mm) >= seq:
        return True
    deadline = time.monotonic() + timeout
    delay = 2e-5
    while read_seq(mm) < seq:
        if time.monotonic() > deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)
    return True


def attach_progress(fd: int) -> mmap.mmap:
    """Map the arena's first page writable (in the writer process): the progress counters."""
    return mmap.mmap(fd, HEADER_BYTES)


def bump_progress(page: mmap.mmap, slot: int) -> None:
    """One more op carried out by writer thread ``slot`` (each thread owns its slot)."""
    off = PROGRESS_OFFSET + 8 * (slot % PROGRESS_SLOTS)
    struct.pack_into("<q", page, off, struct.unpack_from("<q", page, off)[0] + 1)


def read_progress(mm: mmap.mmap) -> int:
    """Ops carried out by the writer process so far: the sum of its threads' counters."""
    return sum(struct.unpack_from(f"<{PROGRESS_SLOTS}q", mm, PROGRESS_OFFSET))


def bump_bytes(page: mmap.mmap, slot: int, nbytes: int) -> None:
    """``nbytes`` more written by writer thread ``slot`` (threads past ``BYTES_SLOTS``
    share a slot: an update may be lost, the counter still moves)."""
    off = BYTES_OFFSET + 8 * (slot % BYTES_SLOTS)
    struct.pack_into("<q", page, off, struct.unpack_from("<q", page, off)[0] + nbytes)


def read_bytes(mm: mmap.mmap) -> int:
    """Bytes written by the writer process so far: the sum of its threads' counters."""
    return sum(struct.unpack_from(f"<{BYTES_SLOTS}q", mm, BYTES_OFFSET))


def reset_progress(mm: mmap.mmap) -> None:
    """Zero the counters, ops and bytes (before a new writer process starts)."""
    mm[PROGRESS_OFFSET:HEADER_BYTES] = bytes(HEADER_BYTES - PROGRESS_OFFSET)
