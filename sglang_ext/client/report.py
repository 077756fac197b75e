"""What ``extract`` reports at a run's end: the sweep of the server files its tries left
(``sweep``, ``report_sweep``) and the summary file (``write_summary``)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import List, Tuple

from sglang_ext.client.pending import PendingFiles


def write_summary(path: str, summary: dict, mode: int) -> None:
    """Write ``summary`` as JSON to ``path`` through a temporary file renamed onto it (never
    a partial file under the name), with ``mode``. Raises ``OSError``."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".extract-summary-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), mode)
            json.dump(summary, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def sweep(pending: PendingFiles, forget_unanswered: bool, of: str) -> Tuple[List[str], List[str]]:
    """Sweep the server files this rank's requests left (see ``sglang_ext.client.pending``):
    ``(the files still being written, the sentences that say what happened)``; ``of``
    names the tries, e.g. "interrupted tries"."""
    try:
        removed, busy = pending.sweep(forget_unanswered)
    except OSError as e:  # a server's file refused, the journal's rewrite (a full disk): the
        # next run reads the journal again
        return [], [f"cannot finish the sweep of the server's files ({e}); the next run of this "
                    f"command sweeps again"]
    notes = []
    if removed:
        notes.append(f"removed {removed} file(s) of {of} from the server's dump directory "
                     f"({', '.join(pending.dump_dirs)})")
    if busy:
        notes.append(f"{len(busy)} file(s) of {of} are still being written by the server (e.g. "
                     f"{busy[0]}); the next run of this command removes them")
    unplaced = pending.unplaced()
    if unplaced:
        notes.append(f"note: {unplaced} request(s) were sent and never answered, and this run "
                     f"knows no dump directory (no --dump-dir, no answer, none in the server's "
                     f"/server_info): files the server wrote for them stay in its "
                     f"--dump-hidden-states-dir; pass --dump-dir DIR to the same command to have "
                     f"them removed")
    return busy, notes


def report_sweep(pending: PendingFiles, forget_unanswered: bool, of: str) -> List[str]:
    """``sweep``, its sentences printed a line each; returns the files still being written."""
    busy, notes = sweep(pending, forget_unanswered, of)
    for note in notes:
        print(note, file=sys.stderr)
    return busy
