"""What an SGLang server's log says about the scheduler's work, read between two points
of the log (one cell): its prefill batches, their sizes and the time between them.

Pure functions of the log's text (``read_since`` reads it); ``loadgen.run_cell`` records
``batch_stats`` per cell, ``markdown`` shows it, ``tests/benchmark/test_bench.py`` feeds real lines.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

from bench.report import percentile

# SGLang's line per prefill batch (0.5.23: scheduler_components/metrics_reporter.py,
# report_prefill_stats, called once per prefill batch after its result was processed):
# its new tokens (and replayed ones, when any), the requests still queued at that moment,
# and "input throughput" = (new + replayed tokens) / the time since the previous prefill
# batch's line, i.e. one iteration of the scheduler's loop. A copied log
# (runner.copy_log) marks the lines it cut; the batches on either side are not neighbours.
PREFILL_BATCH = re.compile(r"Prefill batch.*?#new-token: (\d+),(?:.*?#replay-token: (\d+),)?.*?#queue-req: (\d+),"
                           r".*?input throughput \(token/s\): (\d+\.\d+)\s*$")
CUT = re.compile(r"\.\.\. \d+ lines cut")


def prefill_batches(log_text):
    """SGLang's prefill batches in ``log_text``, in order: ``(new tokens, ms since the
    previous prefill batch or None, requests queued after it)``. None where the line says
    no time passed (throughput 0) or follows a cut in a copied log (its time spans the
    cut); a line still being written (no end yet) is left out."""
    out, cut = [], False
    for line in log_text.splitlines(keepends=True):
        if CUT.search(line):
            cut = True
            continue
        m = PREFILL_BATCH.search(line) if line.endswith("\n") else None
        if not m:
            continue
        tokens, replayed, queued, tps = int(m.group(1)), int(m.group(2) or 0), int(m.group(3)), float(m.group(4))
        ms = (tokens + replayed) / tps * 1e3 if tps > 0 and not cut else None
        if cut and out:
            out[-1] = out[-1][:2] + (0,)  # what the cut hides may have drained the queue
        out.append((tokens, ms, queued))
        cut = False
    return out


def read_since(path, offset):
    """The text appended to the file at ``path`` after byte ``offset`` ("" when there is
    no such file, or no path)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def batch_stats(batches: List[tuple]) -> Optional[Dict[str, float]]:
    """What the scheduler's prefill batches of one cell say (``batches``:
    ``prefill_batches``, in order): ``busy_ms_per_1k_tokens``, the median over the
    batches that followed one which left requests queued (the scheduler had work waiting,
    so the loop's iteration between the two lines is work, not idle) of their milliseconds
    per 1000 new tokens, with ``busy_batches`` (how many) and their median size ``busy_tokens``; and
    ``queued_share``, the share of all batches that left requests queued. None without
    batches."""
    if not batches:
        return None
    busy = [(tokens, ms) for (_, _, queued), (tokens, ms, _) in zip(batches, batches[1:])
            if queued > 0 and ms is not None]
    return {"batches": len(batches),
            "queued_share": sum(1 for b in batches if b[2] > 0) / len(batches),
            "busy_batches": len(busy),
            "busy_tokens": percentile([t for t, _ in busy], 50) if busy else None,
            "busy_ms_per_1k_tokens": percentile([ms / t * 1e3 for t, ms in busy], 50) if busy else None}
