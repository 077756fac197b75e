"""``index.jsonl``: one whole line per file (``append_index``), its rotated parts, the mark
that settles a dead writer's file (``indexed``), and reading it (``read_index``)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple

from .keys import KEY_HIDDEN_STATES, INDEX_NAME
from .files import DumpFormatError, open_regular, lexists_at, _close_never_raises
from .completion import POLL_FIRST_S, POLL_MAX_S
from .write import pwrite_all
from .reader import read_header

__all__ = [
    "INDEX_LOCK_TIMEOUT_S", "MAX_INDEX_LINE", "INDEX_PART_BYTES", "index_part_name",
    "append_index", "indexed", "index_record", "index_record_from_header", "read_index",
]


# How long ``append_index`` waits for another process's lock on the index (each holds it
# for one write) before it gives up.
INDEX_LOCK_TIMEOUT_S = 10.0
# The longest index line (bytes, newline included): a rid of ``MAX_RID_CHARS`` characters
# each escaped as a JSON surrogate pair (12 bytes) and the rest of the record fit.
MAX_INDEX_LINE = 128 * 1024
# ``index.jsonl`` is rotated past this size: renamed to ``index-<k>.jsonl`` (k = 1, 2, ...)
# by the append that finds it this long, so no one part grows without bound (~300k lines
# of ~200 bytes a part); ``read_index`` reads the parts in order, then ``index.jsonl``.
INDEX_PART_BYTES = 64 << 20


def index_part_name(k: int) -> str:
    """The name of the ``k``-th rotated part of the index (k >= 1): ``index-<k>.jsonl``."""
    return f"index-{k}.jsonl"


def _index_parts(dir_fd: int) -> List[str]:
    """The rotated parts that exist, oldest first (they are numbered without gaps)."""
    parts = []
    while lexists_at(dir_fd, index_part_name(len(parts) + 1)):
        parts.append(index_part_name(len(parts) + 1))
    return parts


def _open_index_locked(dir_fd: int, part_bytes: int) -> Tuple[int, int]:
    """Open ``index.jsonl`` for appending and take its lock; returns ``(fd, size)`` with
    any partial last line (its writer was killed mid-line) cut away, and the index
    rotated first when it holds ``part_bytes`` or more. The lock is on the file, so after
    taking it the name is checked to still be this file (another append may have rotated
    it meanwhile); if not, the new one is opened."""
    while True:
        fd = open_regular(INDEX_NAME, os.O_RDWR | os.O_CREAT | os.O_APPEND, dir_fd=dir_fd)
        try:
            _lock_bounded(fd, INDEX_LOCK_TIMEOUT_S, INDEX_NAME)
            st = os.fstat(fd)
            try:
                named = os.stat(INDEX_NAME, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                named = None
            if named is None or (named.st_dev, named.st_ino) != (st.st_dev, st.st_ino):
                os.close(fd)
                continue
            size = _cut_partial_line(fd, st.st_size)
            if size < part_bytes:
                return fd, size
            os.rename(INDEX_NAME, index_part_name(len(_index_parts(dir_fd)) + 1),
                      src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.close(fd)
        except BaseException:
            _close_never_raises(fd)
            raise


def _cut_partial_line(fd: int, size: int) -> int:
    """Cut a partial last line (one that does not end in a newline: its appender was
    killed mid-write) back to the end of the last whole line; returns the new size.
    A tail without a newline longer than ``MAX_INDEX_LINE`` is no line of ours (someone
    wrote it by hand): it is kept and ended with a newline instead. Called under the
    index lock."""
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    start = max(0, size - MAX_INDEX_LINE)
    cut = os.pread(fd, size - start, start).rfind(b"\n")
    if cut < 0 and start > 0:
        pwrite_all(fd, b"\n", size)
        return size + 1
    os.ftruncate(fd, start + cut + 1)
    return start + cut + 1


def append_index(dir_fd: int, record: Mapping[str, Any], *, mark_fd: Optional[int] = None,
                 part_bytes: int = INDEX_PART_BYTES) -> None:
    """Append one JSON line (at most ``MAX_INDEX_LINE`` bytes) to ``index.jsonl``, whole
    or not at all.

    Under an exclusive ``flock`` on the index (writers of several servers may share a
    directory): a partial last line a killed appender left is cut away first, the index
    is rotated past ``part_bytes`` (``INDEX_PART_BYTES``), then the line goes in one
    ``write``; one cut short (disk full, file size limit) or failed is undone by
    truncating the index back to its size before it. ``mark_fd`` (the request's lock
    file, open for writing) receives where the line goes (``index_mark``) before it is
    written, so that ``indexed`` can tell without reading the index whether a writer
    that died later had appended it. Raises ``OSError`` naming ``index.jsonl`` then (the
    caller makes it the request's error), for a longer line (``EFBIG``), when the index
    is not a regular file (a FIFO planted there: refused without blocking), or when its
    lock stays held longer than ``INDEX_LOCK_TIMEOUT_S``.
    """
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode("ascii")
    if len(line) > MAX_INDEX_LINE:
        raise OSError(errno.EFBIG, f"{INDEX_NAME}: a line of {len(line)} bytes is over the "
                      f"bound of {MAX_INDEX_LINE}")
    fd, size = _open_index_locked(dir_fd, part_bytes)
    try:
        if mark_fd is not None:
            st = os.fstat(fd)
            mark = f"{st.st_dev} {st.st_ino} {size}\n".encode("ascii")
            if os.pwrite(mark_fd, mark, 0) != len(mark):
                raise OSError(errno.ENOSPC, f"{INDEX_NAME}: the lock file took only part of "
                              f"the index mark")
        try:
            written = os.write(fd, line)
            if written != len(line):
                raise OSError(errno.ENOSPC, f"only {written} of {len(line)} bytes were written")
        except OSError as e:
            why = e.strerror or str(e)
            try:
                os.ftruncate(fd, size)
            except OSError as t:
                raise OSError(e.errno, f"{INDEX_NAME}: a line of {len(line)} bytes could not be "
                              f"written ({why}), and cutting the index back to {size} bytes "
                              f"failed too ({t.strerror}): the next append cuts the partial "
                              f"line") from None
            raise OSError(e.errno, f"{INDEX_NAME}: a line of {len(line)} bytes could not be "
                          f"written ({why}); the index is left as it was") from None
    finally:
        os.close(fd)  # also releases the flock


def indexed(dir_fd: int, name: str, lock_fd: int) -> bool:
    """Whether file ``name``'s index line is in the index, from the mark ``append_index``
    left in its lock file (``lock_fd``, open for reading): True when the line that starts
    where the mark says (in ``index.jsonl`` or, rotated since, a part) is whole and names
    ``name``; False when there is no mark (the writer died before its append) or the line
    there is not this file's (cut away as partial, then another file's line went there).
    Reads one line, never the whole index. Raises ``OSError`` when the lock or the index
    cannot be read."""
    try:
        dev, ino, offset = (int(v) for v in os.pread(lock_fd, 64, 0).split())
    except ValueError:
        return False
    for part in [INDEX_NAME] + _index_parts(dir_fd)[::-1]:
        try:
            fd = open_regular(part, os.O_RDONLY, dir_fd=dir_fd)
        except FileNotFoundError:
            continue
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (dev, ino):
                continue
            text = os.pread(fd, MAX_INDEX_LINE, offset)
        finally:
            os.close(fd)
        line, newline, _ = text.partition(b"\n")
        try:
            record = json.loads(line) if newline else None
        except ValueError:
            return False
        return isinstance(record, dict) and record.get("file") == name
    return False


def _lock_bounded(fd: int, timeout: float, name: str) -> None:
    """Take an exclusive ``flock`` on ``fd``, polling; ``OSError`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    delay = POLL_FIRST_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise OSError(errno.EAGAIN, f"{name} stayed locked by another process for "
                              f"more than {timeout:g} s") from None
            time.sleep(delay)
            delay = min(delay * 1.5, POLL_MAX_S)


def index_record(rid: str, name: str, num_tokens: int, size: int, layer_ids: str) -> Dict[str, Any]:
    """The ``index.jsonl`` record of file ``name``: its request's ``rid``, ``num_tokens``
    prompt tokens, ``size`` bytes, ``layer_ids`` as the metadata holds them (a JSON list
    in a string). The one place its keys are spelled."""
    return {"rid": rid, "file": name, "num_tokens": num_tokens, "bytes": size, "layer_ids": layer_ids}


def index_record_from_header(dir_fd: int, name: str, size: int) -> Dict[str, Any]:
    """``index_record`` of file ``name`` (``size`` bytes), from its header (for a file
    whose writer died before it appended the line). Raises what ``read_header`` raises,
    and ``DumpFormatError`` when the header has no ``hidden_states`` entry whose
    ``shape`` is a non-empty list of non-negative ints."""
    header = read_header(dir_fd, name)
    meta = header.get("__metadata__", {})
    entry = header.get(KEY_HIDDEN_STATES)
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if not (isinstance(shape, list) and shape
            and all(type(d) is int and d >= 0 for d in shape)):
        raise DumpFormatError(f"{name}: the header has no {KEY_HIDDEN_STATES} entry with a "
                              f"shape of non-negative ints")
    return index_record(meta.get("rid"), name, shape[0], size, meta.get("layer_ids"))


def read_index(directory: str) -> list:
    """All records of the index of ``directory``, in write order: its rotated parts
    (``index-1.jsonl``, ``index-2.jsonl``, ...) then ``index.jsonl`` (``[]`` when there is
    none). A last line without its newline (an append in progress, or one whose writer was
    killed: the next append cuts it) is skipped. Raises ``OSError`` when a part is not a
    regular file (never blocks on a FIFO) and ``ValueError`` naming the part and line for
    a whole line that is not JSON."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    try:
        records: list = []
        for part in _index_parts(dir_fd) + [INDEX_NAME]:
            try:
                fd = open_regular(part, os.O_RDONLY, dir_fd=dir_fd)
            except FileNotFoundError:
                continue
            with os.fdopen(fd, "rb") as f:
                for number, line in enumerate(f, 1):
                    if not line.endswith(b"\n") or not line.strip():
                        continue
                    try:
                        records.append(json.loads(line))
                    except (ValueError, RecursionError):  # nested past the recursion limit
                        raise ValueError(f"{os.path.join(directory, part)} line {number} is not "
                                         f"JSON: {line[:80]!r}") from None
        return records
    finally:
        os.close(dir_fd)
