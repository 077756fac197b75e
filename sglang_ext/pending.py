"""The server files an ``extract`` run asked for and has not taken yet (its leftovers).

The server writes each request's file into its dump directory (often ``/dev/shm``, RAM);
``extract`` moves it away once it is complete. A file stays behind when the client never
takes it: the client was killed (or interrupted) after sending the request, or a try timed
out while the server was still writing. This module keeps a journal of such requests in
``OUT/.extract-pending-rank<R>.jsonl`` and removes what they left:

- ``sent(rid)`` before a request goes out, ``named(rid, path)`` when the server names its
  file, ``settled(rid)`` once that file is gone (moved into ``OUT``, or its write failed
  and the ``.error`` file was removed);
- ``sweep()`` removes, for every unsettled request, its file and ``.error`` file when no
  writer holds its ``.lock`` any more, and returns the files still being written. A
  request that was never answered is looked up under the name the server gives it
  (``format.safe_stem(rid)``) in every dump directory the journal has seen.

``extract`` sweeps at start (leftovers of a killed run) and at the end (timed-out tries,
Ctrl-C); the journal is deleted once nothing is pending. One run per rank and output
directory at a time (two would share a journal).
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

from sglang_ext import format as fmt


def journal_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f".extract-pending-rank{rank}.jsonl")


def _lock_held(path: str) -> bool:
    """True while a writer holds ``<path>.lock``."""
    try:
        fmt.wait_complete(path, timeout=0)
    except TimeoutError:
        return True
    return False


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


class PendingFiles:
    """Journal of this rank's requests whose server file may still exist (see module doc)."""

    COMPACT_EVERY = 4096  # journal lines appended before it is rewritten with what is pending

    def __init__(self, out_dir: str, rank: int):
        self.path = journal_path(out_dir, rank)
        self.rids: Dict[str, Optional[str]] = {}  # rid -> server path (None: not answered yet)
        self.dump_dirs: List[str] = []
        self._appended = 0
        self._read()

    def _read(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as f:
                lines = f.readlines()
        except FileNotFoundError:
            return
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a torn last line of a killed run
                continue
            if not isinstance(rec, dict):
                continue
            if isinstance(rec.get("dir"), str):
                self._add_dir(rec["dir"])
            elif isinstance(rec.get("done"), str):
                self.rids.pop(rec["done"], None)
            elif isinstance(rec.get("rid"), str):
                path = rec.get("path") if isinstance(rec.get("path"), str) else None
                self.rids[rec["rid"]] = path or self.rids.get(rec["rid"])
                if path:
                    self._add_dir(os.path.dirname(path))

    def _add_dir(self, directory: str) -> None:
        if directory not in self.dump_dirs:
            self.dump_dirs.append(directory)

    def _append(self, rec: dict) -> None:
        line = (json.dumps(rec, separators=(",", ":")) + "\n").encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        self._appended += 1
        if self._appended >= self.COMPACT_EVERY:
            self._rewrite()

    def _rewrite(self) -> None:
        self._appended = 0
        if not self.rids:
            _unlink(self.path)
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for d in self.dump_dirs:
                f.write(json.dumps({"dir": d}) + "\n")
            for rid, path in self.rids.items():
                f.write(json.dumps({"rid": rid, "path": path} if path else {"rid": rid},
                                   separators=(",", ":")) + "\n")
        os.replace(tmp, self.path)

    def sent(self, rid: str) -> None:
        self.rids[rid] = None
        self._append({"rid": rid})

    def named(self, rid: str, path: str) -> None:
        self.rids[rid] = path
        self._add_dir(os.path.dirname(path))
        self._append({"rid": rid, "path": path})

    def settled(self, rid: str) -> None:
        if self.rids.pop(rid, "absent") != "absent":
            self._append({"done": rid})

    def _candidates(self, rid: str, path: Optional[str]) -> List[str]:
        if path:
            return [path]
        name = fmt.safe_stem(rid) + fmt.SUFFIX
        return [os.path.join(d, name) for d in self.dump_dirs]

    def sweep(self, forget_unanswered: bool) -> Tuple[int, List[str]]:
        """Remove what unsettled requests left; returns ``(files removed, files still being
        written)``. ``forget_unanswered``: also settle requests that were never answered
        and left nothing (at start: their run is over; at the end of a run the server may
        still be working on them, so they stay for the next run's sweep)."""
        removed = 0
        busy: List[str] = []
        for rid, path in list(self.rids.items()):
            found = busy_here = False
            for p in self._candidates(rid, path):
                if _lock_held(p):
                    busy.append(p)
                    busy_here = True
                    continue
                for name in (p, p + fmt.ERROR_SUFFIX):
                    if _unlink(name):
                        removed += 1
                        found = True
            if busy_here or (path is None and not found and not forget_unanswered):
                continue
            self.rids.pop(rid)
        self._rewrite()
        return removed, busy
