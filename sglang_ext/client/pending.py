"""The server files an ``extract`` run asked for and has not taken yet (its leftovers).

The server writes each request's file into its dump directory (often ``/dev/shm``, RAM);
``extract`` moves it away once it is complete. A file stays behind when the client never
takes it: the client was killed (or interrupted) after sending the request, or a try timed
out while the server was still writing. This module keeps a journal of such requests in
``OUT/.extract-pending-rank<R>.jsonl`` and removes what they left:

- ``sent(rid)`` before a request goes out, ``answered(rid)`` when any HTTP answer came
  (the server is done with it: a file it wrote is named, or there is none, or only an
  ``.error``), ``named(rid, path)`` when the server names its file, ``settled(rid)`` once
  that file is gone (moved into ``OUT``, or its write failed
  and the ``.error`` file was removed);
- ``sweep()`` removes, for every unsettled request, its file and ``.error`` file when no
  writer holds its ``.lock`` any more, and returns the files still being written. A
  request that was never answered is looked up under the name the server gives it
  (``format.safe_stem(rid)``) in every dump directory the journal has seen.

``extract`` sweeps at start (leftovers of a killed run) and at the end (timed-out tries,
Ctrl-C); the journal is deleted once nothing is pending. One run per rank and output
directory at a time (two would share a journal).

What a sweep deletes is bounded, whatever the journal says (a journal is only as good as
the answers it recorded): only entries of a dump directory the journal names in a ``dir``
record (``dump_dir()``), whose name is the server's name for that request
(``server_name_ok``: ``<safe_stem(rid)>[-n].safetensors``, plus ``.error``), and that are
regular files (``lstat``, never following a symlink; a FIFO or a symlink is left alone).
The lock is tested without blocking (``O_NONBLOCK|O_NOFOLLOW``, regular files only).
The journal is created with the mode it is given (``extract``'s file mode, umask applied)
less group and other write, and read only when it is this user's file others cannot write
(``files.Journal``: a forged journal in a shared OUT names nothing to remove).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from typing import Dict, List, Optional, Set, Tuple

from sglang_ext import format as fmt
from sglang_ext.client.files import Journal, unlink_regular


def journal_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f".extract-pending-rank{rank}.jsonl")


# The server's name for a request's file (format.reserve): the rid's safe stem, a
# collision counter, the suffix. The stem holds the rid's own hash, so no file the
# server did not write for this rid has this name.


def server_name_ok(rid: str, name: str) -> bool:
    """``format.is_name_for``: ``name`` is one the server may give ``rid``'s file."""
    return fmt.is_name_for(rid, name)


def _lock_held(dir_fd: int, name: str) -> Optional[bool]:
    """True while a writer holds ``<name>.lock`` in the directory, False when it is free or
    gone, None when the lock name holds something else than a regular file (not a
    writer's lock: leave that name alone). Never blocks, never follows a symlink."""
    try:
        fd = os.open(name + fmt.LOCK_SUFFIX, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # symlink, socket, directory
            return None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


class PendingFiles(Journal):
    """Journal of this rank's requests whose server file may still exist (see module doc)."""

    WHAT, NAMES = "pending-files journal", "server files this run would remove"

    def __init__(self, out_dir: str, rank: int, mode: int = 0o600, store: bool = False):
        super().__init__(journal_path(out_dir, rank), mode)
        self.store = store  # samples go to a store (--store): no server file to look for
        self.rids: Dict[str, Optional[str]] = {}  # rid -> server path (None: none named)
        self.answered_rids: Set[str] = set()  # of rids: an HTTP answer came (answered)
        self.dump_dirs: List[str] = []
        for rec in self._records():
            if isinstance(rec.get("dir"), str):
                self._add_dir(rec["dir"])
            elif isinstance(rec.get("done"), str):
                self.rids.pop(rec["done"], None)
                self.answered_rids.discard(rec["done"])
            elif isinstance(rec.get("answered"), str):
                if rec["answered"] in self.rids:
                    self.answered_rids.add(rec["answered"])
            elif isinstance(rec.get("rid"), str):
                path = rec.get("path") if isinstance(rec.get("path"), str) else None
                self.rids[rec["rid"]] = path or self.rids.get(rec["rid"])

    def _add_dir(self, directory: str) -> None:
        if directory not in self.dump_dirs:
            self.dump_dirs.append(directory)

    def _live_records(self) -> List[dict]:
        """The run's dump directories and the rids still pending; none: nothing pending."""
        if not self.rids:
            return []
        return ([{"dir": d} for d in self.dump_dirs]
                + [{"rid": rid, "path": path} if path else {"rid": rid} for rid, path in self.rids.items()]
                + [{"answered": rid} for rid in self.answered_rids if rid in self.rids])

    def dump_dir(self, directory: str) -> None:
        """Journal the run's dump directory: the only one whose files a sweep removes."""
        if directory not in self.dump_dirs:
            self._add_dir(directory)
            self._append({"dir": directory})

    def _unplaced(self, rid: str) -> bool:
        """No sweep can look for ``rid``'s file yet: never answered (the server may still
        write it), and no dump directory known (no ``--dump-dir``, no answer, no word from
        the server's ``/server_info``). Kept journaled until a run knows one."""
        return not (self.store or self.dump_dirs) and self.rids.get(rid, "") is None \
            and rid not in self.answered_rids

    def unplaced(self) -> int:
        """How many requests are ``_unplaced``."""
        return sum(map(self._unplaced, self.rids))

    def sent(self, rid: str) -> None:
        self.rids[rid] = None
        self._append({"rid": rid})

    def answered(self, rid: str) -> None:
        """An HTTP answer for ``rid`` came, whatever it said: the server is done with the
        request, so a run that knows no dump directory need not keep it (``_unplaced``).
        Journaled when the journal is rewritten (each sweep), not a line per request: a
        run killed before that keeps such requests as unanswered, the careful side."""
        if rid in self.rids:
            self.answered_rids.add(rid)

    def named(self, rid: str, path: str) -> None:
        """The server named ``rid``'s file ``path``: a checked name in the run's dump
        directory (``extract`` checks an answer before it journals it)."""
        self.rids[rid] = path
        self.dump_dir(os.path.dirname(path))
        self._append({"rid": rid, "path": path})

    def settled(self, rid: str) -> None:
        self.answered_rids.discard(rid)
        if self.rids.pop(rid, "absent") != "absent":
            self._append({"done": rid})

    def _candidates(self, rid: str, path: Optional[str]) -> List[Tuple[str, str]]:
        """``(dump dir, name)`` where ``rid``'s file may be: the answered path when it is a
        server's name for ``rid`` in a journaled dump directory, else (never answered, or
        an answer that is not such a name) the first name the server gives ``rid`` in
        every journaled dump directory."""
        if path and os.path.dirname(path) in self.dump_dirs \
                and server_name_ok(rid, os.path.basename(path)):
            return [(os.path.dirname(path), os.path.basename(path))]
        name = fmt.safe_stem(rid) + fmt.SUFFIX
        return [(d, name) for d in self.dump_dirs]

    def sweep(self, forget_unanswered: bool) -> Tuple[int, List[str]]:
        """Remove what unsettled requests left; returns ``(files removed, files still being
        written)``. ``forget_unanswered``: also settle requests that were never answered
        and left nothing (at start: their run is over; at the end of a run the server may
        still be working on them, so they stay for the next run's sweep). While no dump
        directory is known (``unplaced``) unanswered requests stay whatever it says: a run
        given ``--dump-dir`` removes what they left."""
        removed = 0
        busy: List[str] = []
        dir_fds: Dict[str, Optional[int]] = {}
        try:
            for rid, path in list(self.rids.items()):
                found = busy_here = False
                for directory, name in self._candidates(rid, path):
                    if directory not in dir_fds:
                        try:
                            dir_fds[directory] = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
                        except OSError:  # gone, or not visible here: nothing to remove
                            dir_fds[directory] = None
                    dir_fd = dir_fds[directory]
                    if dir_fd is None:
                        continue
                    held = _lock_held(dir_fd, name)
                    if held:
                        busy.append(os.path.join(directory, name))
                        busy_here = True
                        continue
                    if held is None:  # not a writer's lock at that name: touch nothing
                        continue
                    for entry in (name, name + fmt.ERROR_SUFFIX):
                        if unlink_regular(dir_fd, entry):
                            removed += 1
                            found = True
                if busy_here or (path is None and not found
                                 and (not forget_unanswered or self._unplaced(rid))):
                    continue
                self.rids.pop(rid)
                self.answered_rids.discard(rid)
        finally:
            for fd in dir_fds.values():
                if fd is not None:
                    os.close(fd)
        self._rewrite()
        return removed, busy
