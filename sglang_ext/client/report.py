"""What ``extract`` reports at a run's end: the sweep of the server files its tries left
(``report_sweep``) and the summary file (``write_summary``)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import List

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


def report_sweep(pending: PendingFiles, forget_unanswered: bool, when: str) -> List[str]:
    """Sweep the server files this rank's requests left (see ``sglang_ext.client.pending``); say
    what was removed and what is still being written. Returns the latter."""
    try:
        removed, busy = pending.sweep(forget_unanswered)
    except OSError as e:  # the journal's rewrite (a full disk): the next run reads it again
        print(f"cannot rewrite {pending.path} ({e.strerror or e}); the next run of this command "
              f"sweeps again", file=sys.stderr)
        return []
    if removed:
        print(f"removed {removed} file(s) {when} in the server's dump directory "
              f"({', '.join(pending.dump_dirs)})", file=sys.stderr)
    if busy:
        print(f"{len(busy)} file(s) {when} are still being written by the server (e.g. "
              f"{busy[0]}); the next run of this command removes them", file=sys.stderr)
    unplaced = pending.unplaced()
    if unplaced:
        print(f"note: {unplaced} request(s) were sent and never answered, and this run knows no "
              f"dump directory (no --dump-dir, no answer, none in the server's /server_info): "
              f"files the server wrote for them stay in its --dump-hidden-states-dir; pass "
              f"--dump-dir DIR to the same command to have them removed", file=sys.stderr)
    return busy
