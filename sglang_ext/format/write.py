"""Writing a file: the temporary file (``create_tmp``, ``pwrite_all``), its rename to the
final name (``publish``) and what an interrupted run left (``clean_stale``)."""

from __future__ import annotations

import errno
import fcntl
import os
from typing import Dict

from .keys import SUFFIX, LOCK_SUFFIX
from .files import file_mode, open_regular, _unlink_quiet, _unlink_never_raises
from .names import is_tmp_name

__all__ = ["create_tmp", "pwrite_all", "publish", "clean_stale"]


def create_tmp(dir_fd: int, tmp: str) -> int:
    """Create ``tmp`` (a ``tmp_name``) in the dump directory for writing; returns its descriptor.

    Exclusive and not following symlinks, with ``file_mode()``: an entry already at that
    name (a planted symlink, a leftover) is unlinked (the link itself, never its target)
    and the create retried once. Raises ``OSError`` (e.g. ``ENOSPC``).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    mode = file_mode()
    try:
        return open_regular(tmp, flags, dir_fd=dir_fd, mode=mode)
    except FileExistsError:
        _unlink_quiet(dir_fd, tmp)
        return open_regular(tmp, flags, dir_fd=dir_fd, mode=mode)


def pwrite_all(fd: int, data, offset: int) -> None:
    """Write all of ``data`` (any buffer) at ``offset``; raises ``OSError``."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        view, offset = view[n:], offset + n


def publish(dir_fd: int, tmp: str, name: str) -> None:
    """Rename a fully written temporary file to its final name (atomic)."""
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def clean_stale(dir_fd: int) -> Dict[str, int]:
    """Remove what an interrupted run left: temporary files and locks nobody holds.

    Temporary files are those ``is_tmp_name`` matches: ours (``.kimi-...safetensors.tmp``,
    and earlier releases' ``.<name>.safetensors.tmp``) and safetensors' own
    (``.tmpXXXXXX``); only the writing ranks of one server may use a dump directory (one
    per DP rank: they all start before the server takes requests).

    Called once at start-up by each writing rank. A lock is stale when an exclusive
    non-blocking ``flock`` on it succeeds; an entry with a lock's name that is not a
    regular file (a planted FIFO) is left alone. Returns counts ``{"tmp": n, "lock": m}``.
    """
    removed = {"tmp": 0, "lock": 0}
    for name in os.listdir(dir_fd):
        if is_tmp_name(name):
            _unlink_never_raises(dir_fd, name)  # a directory planted there stays: never fatal
            removed["tmp"] += 1
        elif name.endswith(SUFFIX + LOCK_SUFFIX):
            try:
                fd = open_regular(name, os.O_RDONLY, dir_fd=dir_fd)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            _unlink_quiet(dir_fd, name)
            os.close(fd)
            removed["lock"] += 1
    return removed
