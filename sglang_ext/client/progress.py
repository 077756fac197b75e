"""``extract``'s progress view and its per-worker counts, for a fleet behind a router.

The bar (tqdm, on stderr) shows rows done of the rank's total with rows/s, and in its postfix
tokens/s, GB written, failed rows and, per worker, the samples it wrote and the tries that
failed on it. A worker is known by where its sample came from: the dump directory an answer
names (behind a router give each server its own ``--dump-hidden-states-dir``: one directory,
one worker; servers sharing one directory count as one), ``store`` for samples taken from a
Mooncake Store (its manifest names no server). SGLang's router 0.3.2 does not say which worker
answered, so a try that failed before any answer (connection reset, HTTP 5xx from the router,
timeout) counts under ``(no answer)``; the router's own log and Prometheus metrics name the
worker. ``summary()`` is the JSON part ``extract`` prints and writes (``--summary``).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict, Optional

NO_ANSWER = "(no answer)"  # a failed try whose worker nobody named (see the module doc)
STORE = "store"  # the worker of samples taken from a Mooncake Store (their manifest names no server)
SHOWN_WORKERS = 6  # the bar names at most this many workers (the summary names all)


class Progress:
    """Counts of one run: ``sample(worker, tokens)`` per sample written to OUT,
    ``failed_try(worker)`` per failed try (``worker`` None: ``NO_ANSWER``), ``tick(stats)`` per
    row finished in any way (done, resumed, failed). ``disable``: no bar (``--no-progress``),
    the counts are kept all the same."""

    def __init__(self, total: int, disable: bool):
        from tqdm import tqdm

        # disable None: no bar where stderr is no terminal (a log file, a batch job's
        # output), where its redraws would only pile up; the summary line says it all
        self.bar = tqdm(total=total, unit="row", dynamic_ncols=True, disable=True if disable else None,
                        file=sys.stderr, smoothing=0.1)
        self.start = time.monotonic()
        self.rows = 0
        self.workers: Dict[str, Dict[str, int]] = {}

    def _worker(self, name: str) -> Dict[str, int]:
        return self.workers.setdefault(name, {"samples": 0, "tokens": 0, "failed_tries": 0})

    def sample(self, worker: str, tokens: int) -> None:
        w = self._worker(worker)
        w["samples"] += 1
        w["tokens"] += tokens

    def failed_try(self, worker: Optional[str]) -> None:
        self._worker(worker or NO_ANSWER)["failed_tries"] += 1

    def elapsed(self) -> float:
        return max(time.monotonic() - self.start, 1e-9)

    def tick(self, stats: Any) -> None:
        """One row finished; ``stats``: the run's ``runner.Stats`` (tokens, bytes, failed)."""
        self.rows += 1
        if not self.bar.disable:
            elapsed = self.elapsed()
            shown = sorted(self.workers.items(), key=lambda kv: -kv[1]["samples"])[:SHOWN_WORKERS]
            per = " ".join(f"{_short(name)}:{w['samples']}" + (f"/{w['failed_tries']}f" if w["failed_tries"] else "")
                           for name, w in shown)
            more = f" +{len(self.workers) - len(shown)} more" if len(self.workers) > len(shown) else ""
            self.bar.set_postfix_str(
                f"{stats.tokens / elapsed:,.0f} tok/s, {stats.bytes / 1e9:.2f} GB, "
                f"{stats.failed} failed | {per}{more}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()

    def summary(self, stats: Any) -> Dict[str, Any]:
        """``rows_per_s`` (rows finished in this run, resumed included, per second),
        ``samples_per_s`` (extracted here) and ``workers`` {name: {samples, tokens,
        failed_tries}}."""
        elapsed = self.elapsed()
        return {"rows_per_s": round(self.rows / elapsed, 2),
                "samples_per_s": round(stats.done / elapsed, 2),
                "workers": {name: dict(w) for name, w in sorted(self.workers.items())}}


def _short(name: str) -> str:
    """A worker's name in the bar: a dump directory's last component."""
    if name in (NO_ANSWER, STORE):
        return name
    return os.path.basename(name.rstrip("/")) or name
