"""Files the client creates, checks and removes: never through a symlink, never a partial
file under a final name.

- ``file_mode()``: the mode of every file the client creates (format's rule, umask applied),
  ``dir_mode``: of every directory it makes;
- ``kind_of`` / ``regular_or_why``: what a name holds, in words, without opening it (an
  open of a FIFO blocks for good);
- ``unlink_regular`` / ``unlink_entry``: remove a name (only a regular file / whatever
  entry it is, never what a symlink points to);
- ``append_line``: add one whole line to a JSON-lines file (the manifest, a journal), or
  nothing;
- ``Staged``: build a file under a temporary name and rename it onto its final name once
  complete (``extract``'s ``hs_<i>``, ``convert``'s records, the pending journal);
- ``RunLock``: one ``extract`` run per rank and output directory at a time.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import uuid
from typing import Iterator, List, Optional, Tuple

from sglang_ext import format as fmt


def file_mode() -> int:
    """The mode extract creates its files with: ``format.file_mode()`` (0600, or
    ``KIMI_SGLANG_FILE_MODE``, the same variable the server reads) with the umask applied,
    read once, at start-up, before any thread runs. Raises ``ValueError``, one sentence
    naming the variable."""
    mode = fmt.file_mode()
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def dir_mode(mode: int) -> int:
    """The mode of a directory the client makes (extract's OUT, convert's DST and its
    ``rows_*``), from ``file_mode()``'s: search (x) wherever read is given, so 0600 makes
    0700 and 0640 0750 (a file mode that keeps the files private keeps their names so)."""
    return mode | (mode & 0o444) >> 2


def kind_of(mode: int) -> str:
    """What a non-regular ``st_mode`` is, in words (``a FIFO``): ``format.kind_of``."""
    return fmt.kind_of(mode, "not a regular file")


def regular_or_why(path: str, follow_symlinks: bool = False) -> Optional[str]:
    """None when ``path`` is a regular file, else what it is, in words (``a FIFO``);
    ``FileNotFoundError`` when nothing is there. Never opens it. A symlink is ``a symbolic
    link`` unless ``follow_symlinks`` (then its target is judged: ``convert`` takes a
    link to a regular file; ``extract`` never keeps a symlink as a result)."""
    mode = os.stat(path, follow_symlinks=follow_symlinks).st_mode
    return None if stat.S_ISREG(mode) else kind_of(mode)


def unlink_regular(dir_fd: int, name: str) -> bool:
    """Remove ``name`` from the directory when it is a regular file (not followed: a
    symlink, FIFO or directory there stays); True when something was removed."""
    try:
        if not stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return False
        os.unlink(name, dir_fd=dir_fd)
        return True
    except FileNotFoundError:
        return False


def unlink_entry(dir_fd: int, name: str) -> bool:
    """Remove our own name whatever it holds (a file, or a link or FIFO swapped in there:
    the entry goes, never what it points to); True when something was removed. A
    directory, or a name already gone, is left: False."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        return False


class Staged:
    """A file built under a temporary name in ``directory`` and renamed onto ``final`` (in
    the same directory) only when complete, so ``final`` never holds a partial file::

        with Staged(out_dir, "hs_7.safetensors") as staged:
            tmp = staged.name()      # fill it: create, rename or copy into it, check it
            staged.publish(tmp)      # rename(tmp, final): atomic on one filesystem

    Temporary names are hidden, ``.<final>.tmp.<8 hex>`` (``unique``; what ``extract``'s
    start-up clean-up matches) or ``.<final>.tmp`` (one fixed name, which replaces a killed
    run's leftover); no second dot for a ``final`` that starts with one. Leaving the block
    by an exception (Ctrl-C included) removes every temporary name handed out
    (``unlink_entry``); ``final`` keeps what it held. ``fd`` is
    an open descriptor of ``directory`` (closed at the end): names are taken relative to
    it, so no symlink on the way redirects them.
    """

    def __init__(self, directory: str, final: str, unique: bool = True):
        self.final = final
        self.unique = unique
        self.fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._names: List[str] = []

    def __enter__(self) -> "Staged":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is not None:
                for name in self._names:
                    unlink_entry(self.fd, name)
        finally:
            os.close(self.fd)

    def name(self) -> str:
        """A new temporary name (nothing created there yet)."""
        hidden = self.final if self.final.startswith(".") else "." + self.final
        tmp = f"{hidden}.tmp" + (f".{uuid.uuid4().hex[:8]}" if self.unique else "")
        self._names.append(tmp)
        return tmp

    def create(self, mode: int) -> Tuple[str, int]:
        """Create a new temporary file (``O_EXCL|O_NOFOLLOW``, ``mode`` before the umask)
        for writing; returns ``(its name, its descriptor)``. A fixed name's leftover (of a
        killed run) is removed first."""
        tmp = self.name()
        if not self.unique:
            unlink_entry(self.fd, tmp)
        return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                            mode, dir_fd=self.fd)

    def publish(self, tmp: str) -> None:
        """Rename the complete temporary file ``tmp`` onto ``final`` (replacing it)."""
        os.rename(tmp, self.final, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        self._names.remove(tmp)


def append_line(path: str, line: bytes, mode: int) -> None:
    """Append ``line`` (one ``\n``-terminated line) to ``path`` (created with ``mode``,
    never through a symlink or into a FIFO): whole or not at all. Under an exclusive
    ``flock`` (ranks share the manifest) the file's size is taken, the line written with
    ``O_APPEND`` (one ``write``, then the rest of a short one), and after a failed write
    (a full disk: the short write's rest raises ``ENOSPC``) the file is truncated back to
    that size, so no torn line is left for the next one to be glued onto. Raises
    ``OSError``."""
    fd = fmt.open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, mode=mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        view = memoryview(line)
        try:
            while view:
                n = os.write(fd, view)
                if n == 0:
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
                view = view[n:]
        except OSError as e:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass
            raise OSError(e.errno, e.strerror, path) from None  # named: os.write's is not
    finally:
        os.close(fd)  # releases the flock


class JournalRefused(OSError):
    """A journal is not this user's own file, or group or others may write it (one sentence)."""


class Journal:
    """An append-only JSON-lines journal a run keeps beside its output (``path``), read
    back by the next run: ``_records`` yields its dicts (a torn last line of a killed run
    and non-objects skipped), ``_append`` adds one line (created ``mode`` less group and
    other write, never through a symlink or into a FIFO), and every ``COMPACT_EVERY`` lines
    ``_rewrite`` replaces it atomically by ``_live_records()`` (the subclass's state as
    records), or deletes it when there are none.

    A journal names what the run will remove, so ``_records`` reads only a regular file
    of this user that neither group nor others may write: else ``JournalRefused`` (``WHAT``
    and ``NAMES`` word it), and ``OSError`` for a FIFO or symlink (``format.open_regular``)."""

    COMPACT_EVERY = 4096  # journal lines appended before it is rewritten with what is live
    WHAT = "journal"  # the subclass's words for its file and for what its records name
    NAMES = "what this run would remove"

    def __init__(self, path: str, mode: int):
        self.path = path
        self.mode = mode & ~0o022  # of the journal file, before the umask: ours alone to write
        self._appended = 0

    def _check_owner(self, fd: int) -> None:
        """``JournalRefused`` unless the open journal ``fd`` is this user's and neither
        group nor others may write it."""
        info = os.fstat(fd)
        why = None
        if info.st_uid != os.geteuid():
            why = f"belongs to another user (uid {info.st_uid})"
        elif info.st_mode & 0o022:
            why = f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
        if why is not None:
            raise JournalRefused(f"the {self.WHAT} {self.path} {why}: it names {self.NAMES}, so it is "
                                 f"not read; remove it (or fix its owner and mode) if it is this user's")

    def _records(self) -> Iterator[dict]:
        try:
            fd = fmt.open_regular(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            self._check_owner(fd)
        except BaseException:
            os.close(fd)
            raise
        with open(fd, encoding="utf-8") as f:
            lines = f.readlines()
        for line in lines:
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):  # a torn last line of a killed run, deep nesting
                continue
            if isinstance(rec, dict):
                yield rec

    def _live_records(self) -> List[dict]:
        raise NotImplementedError

    def _append(self, rec: dict) -> None:
        append_line(self.path, (json.dumps(rec, separators=(",", ":")) + "\n").encode("utf-8"),
                    self.mode)
        self._appended += 1
        if self._appended >= self.COMPACT_EVERY:
            self._rewrite()

    def _rewrite(self) -> None:
        """Replace the journal by ``_live_records()`` (atomically), or delete it."""
        self._appended = 0
        records = self._live_records()
        if not records:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            return
        directory, name = os.path.split(self.path)
        with Staged(directory, name, unique=False) as staged:
            tmp, fd = staged.create(self.mode)
            with open(fd, "w", encoding="utf-8") as f:
                for rec in records:
                    f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            staged.publish(tmp)



class RunLockHeld(Exception):
    """Another run holds the output directory for this rank (one sentence)."""


class RunLock:
    """``OUT/.extract-rank<R>.lock``, held (an exclusive ``flock``) for a whole ``extract``
    run: two runs of one rank on one output directory (a requeued job whose first copy
    still runs) would each extract every row and write every manifest line twice.

    ``acquire`` raises ``RunLockHeld`` when another run holds it (never blocks), ``OSError``
    when the name cannot be created or holds something else than a regular file.
    ``release`` removes the name and drops the lock (a run killed outright leaves the
    file, free: the next run takes it). The name is checked to still be the file locked
    (a run that released it between our open and our lock): else the open is retried."""

    def __init__(self, out_dir: str, rank: int, mode: int):
        self.path = os.path.join(out_dir, f".extract-rank{rank}.lock")
        self.rank, self.mode = rank, mode
        self.fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        for _ in range(8):
            fd = fmt.open_regular(self.path, os.O_RDWR | os.O_CREAT, mode=self.mode)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunLockHeld(f"another extract run of rank {self.rank} "
                                  f"is writing into {os.path.dirname(self.path)} (it holds "
                                  f"{os.path.basename(self.path)}): one run per rank and --out at a "
                                  f"time; wait for it, or stop it first") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return self
            os.close(fd)
        raise OSError(f"{self.path} kept being replaced while it was locked")

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)  # also drops the flock
        self.fd = None
