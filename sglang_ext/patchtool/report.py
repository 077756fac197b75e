"""What the CLI prints: a short table per series report, or JSON."""

from __future__ import annotations

import json
from typing import Iterable

from .check import SeriesReport


def format_table(report: SeriesReport) -> str:
    """Plain-text table: one row per patch (name, status, details), then notes."""
    rows = [(r.patch, r.status, r.detail()) for r in report.patches]
    w0 = max([len("patch")] + [len(r[0]) for r in rows])
    w1 = max([len("status")] + [len(r[1]) for r in rows])
    lines = [f"series {report.series} against {report.target}: {report.state.upper()}",
             f"{'patch'.ljust(w0)}  {'status'.ljust(w1)}  details",
             f"{'-' * w0}  {'-' * w1}  -------"]
    lines += [f"{a.ljust(w0)}  {b.ljust(w1)}  {c}".rstrip() for a, b, c in rows]
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)


def format_json(reports: Iterable[SeriesReport] | SeriesReport) -> str:
    """JSON text: one object for one report."""
    if isinstance(reports, SeriesReport):
        return json.dumps(reports.to_dict(), indent=2)
    return json.dumps([r.to_dict() for r in reports], indent=2)
