"""What an SGLang server's log says about the scheduler's work, read between two points
of the log (one cell): its prefill batches, their sizes and the time between them.

Pure functions of the log's text (``log_since`` reads it); ``loadgen.run_cell`` records
``batch_stats`` per cell, ``markdown`` shows it, ``tests/test_bench.py`` feeds real lines.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

from bench.report import percentile

# SGLang's line per prefill batch (scheduler_components/metrics_reporter.py,
# report_prefill_stats): its new tokens, the requests still queued after it, and "input
# throughput" = those tokens / the time since the scheduler's previous prefill batch.
PREFILL_BATCH = re.compile(r"Prefill batch.*?#new-token: (\d+),.*?#queue-req: (\d+),"
                           r".*?input throughput \(token/s\): ([\d.]+)")


def prefill_batches(log_text):
    """SGLang's prefill batches in ``log_text``, in order: ``(new tokens, ms since the
    previous prefill batch, requests queued after it)``; a batch logged with throughput 0
    (no time since the previous one) is left out."""
    out = []
    for m in PREFILL_BATCH.finditer(log_text):
        tokens, queued, tps = int(m.group(1)), int(m.group(2)), float(m.group(3))
        if tps > 0:
            out.append((tokens, tokens / tps * 1e3, queued))
    return out


def log_since(server, offset):
    """What the server's log (``server.log_path``, if it has one) got after byte ``offset``."""
    path = getattr(server, "log_path", None)
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
    so the time between the two is work, not idle) of their milliseconds per 1000 new
    tokens, with ``busy_batches`` (how many) and their median size ``busy_tokens``; and
    ``queued_share``, the share of all batches that left requests queued. None without
    batches."""
    if not batches:
        return None
    busy = [(tokens, ms) for (_, _, queued), (tokens, ms, _) in zip(batches, batches[1:]) if queued > 0]
    return {"batches": len(batches),
            "queued_share": sum(1 for b in batches if b[2] > 0) / len(batches),
            "busy_batches": len(busy),
            "busy_tokens": percentile([t for t, _ in busy], 50) if busy else None,
            "busy_ms_per_1k_tokens": percentile([ms / t * 1e3 for t, ms in busy], 50) if busy else None}
