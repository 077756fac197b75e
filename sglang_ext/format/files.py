"""Safe file operations in the dump directory: creation mode (``file_mode``), opens that
accept only a regular file and never follow a symlink or block on a FIFO (``open_regular``),
and the contract's error (``DumpFormatError``)."""

from __future__ import annotations

import errno
import os
import re
import stat
from typing import Optional

__all__ = [
    "DumpFormatError", "FILE_MODE_ENV", "DEFAULT_FILE_MODE", "file_mode", "kind_of",
    "open_regular", "lexists_at",
]


class DumpFormatError(ValueError):
    """A file does not follow the contract above (missing key, bad shape or dtype)."""


# The permission bits of every file created here (data, temporary, lock, error, index):
# owner read and write only, unless the environment asks for more (e.g. 0640 to let a
# group of trainers read the dumps). It is the ``mode`` argument of ``os.open``, so the
# process's umask still applies.
FILE_MODE_ENV = "KIMI_SGLANG_FILE_MODE"
DEFAULT_FILE_MODE = 0o600
_FILE_MODE = re.compile(r"[0-7]{3,4}")


def file_mode() -> int:
    """The mode files are created with: ``KIMI_SGLANG_FILE_MODE`` (an octal string of 3 or
    4 digits, e.g. ``0640``) or 0o600 when it is unset or empty.

    Raises ``ValueError`` (one sentence naming the variable) for a value that is not 3-4
    octal digits, lacks owner read and write (0600: the server rewrites and the client
    reads its own files), or has bits beyond 0777 (setuid, setgid, sticky).
    """
    raw = os.environ.get(FILE_MODE_ENV, "")
    if not raw.strip():
        return DEFAULT_FILE_MODE
    mode = int(raw.strip(), 8) if _FILE_MODE.fullmatch(raw.strip()) else -1
    if mode < 0 or mode > 0o777 or mode & 0o600 != 0o600:
        raise ValueError(
            f"{FILE_MODE_ENV} must be an octal file mode of 3 or 4 digits that includes owner "
            f"read and write (0600) and nothing beyond 0777, such as 0600 or 0640; got {raw!r}"
        )
    return mode


# Every open of an entry in the dump directory: never through a symlink at the name, and
# never blocking on a FIFO (an open of a FIFO waits for its other end unless O_NONBLOCK;
# on a regular file O_NONBLOCK has no effect).
_OPEN_SAFE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISLNK, "a symbolic link"))


def kind_of(st_mode: int, unknown: str = "of an unknown type") -> str:
    """What a non-regular ``st_mode`` is, in words (``a FIFO``); ``unknown`` otherwise."""
    return next((word for test, word in _KINDS if test(st_mode)), unknown)


def _not_regular(name: str, st_mode: int) -> OSError:
    return OSError(f"{name} is {kind_of(st_mode)}, not a regular file")


def open_regular(
    name: str,
    flags: int,
    *,
    dir_fd: Optional[int] = None,
    mode: Optional[int] = None,
    follow: bool = False,
) -> int:
    """``os.open(name, flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)`` that returns only a
    regular file's descriptor; ``mode`` defaults to ``file_mode()``.

    Raises ``OSError`` "``<name>`` is a FIFO, not a regular file" (or a directory, a
    socket, ...) for anything else, without blocking on a FIFO; ``OSError`` (``ELOOP``)
    for a symlink at ``name`` unless ``follow`` (then its target must be regular); and
    what ``os.open`` raises otherwise (``FileNotFoundError``, ``FileExistsError`` with
    ``O_EXCL``, ``ENOSPC``, ...).
    """
    flags |= _OPEN_SAFE if not follow else (os.O_NONBLOCK | os.O_CLOEXEC)
    if mode is None:
        mode = file_mode() if flags & os.O_CREAT else 0
    try:
        fd = os.open(name, flags, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno != errno.ENXIO:  # ENXIO: a FIFO opened to write with nobody reading
            raise
        try:
            st_mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=follow).st_mode
        except OSError:
            raise e from None
        raise _not_regular(name, st_mode) from None
    try:
        st_mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st_mode):
        os.close(fd)
        raise _not_regular(name, st_mode)
    return fd


def lexists_at(dir_fd: int, name: str) -> bool:
    """True when ``name`` exists in the directory (a symlink counts; never followed)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def _unlink_quiet(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _unlink_never_raises(dir_fd: int, name: str) -> None:
    """Unlink ``name`` if possible (a read-only directory, a directory planted at the
    name: it stays, and the lock is released all the same)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def _close_never_raises(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
