"""What the CLI prints: a short table per series report, or JSON."""

from __future__ import annotations

import json
from typing import Iterable

from .check import SeriesReport


# The headline of each state: ``clean`` is a tree the series would apply to (not applied).
STATE_WORDS = {"clean": "APPLIES CLEANLY (not applied)", "applied": "APPLIED",
               "partial": "PARTIAL (some patches applied)", "conflict": "CONFLICT"}


def format_table(report: SeriesReport) -> str:
    """Plain-text table: one row per patch (name, status, details), then notes."""
    rows = [(r.patch, r.status, r.detail()) for r in report.patches]
    w0 = max([len("patch")] + [len(r[0]) for r in rows])
    w1 = max([len("status")] + [len(r[1]) for r in rows])
    lines = [f"series {report.series} against {report.target}: "
             f"{STATE_WORDS.get(report.state, report.state.upper())}",
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


def format_markdown(data: dict) -> str:
    """Markdown for a CI step summary from a report's JSON form (``check --json``).

    A heading with the state, one table row per patch naming the failing file and
    hunk (or the offsets), then the notes. Used by ``patches summary`` in
    .github/workflows/nightly-patch-check.yml.
    """
    state = str(data.get("state", "?"))
    ok = state in ("clean", "applied")
    mark = "OK" if ok else "FAILED"
    lines = [f"## Patch series {data.get('series', '?')}: {state.upper()} ({mark})", "",
             f"Target: `{data.get('target', '?')}`", "",
             "| patch | status | file | hunk | line | details |",
             "|---|---|---|---|---|---|"]
    for p in data.get("patches", []):
        name, status, note = p.get("patch", "?"), p.get("status", "?"), p.get("note", "")
        rows = 0
        for f in p.get("failures", []):
            hunk = f.get("hunk")
            lines.append(f"| {name} | **{status}** | `{f.get('file')}` | "
                         f"{hunk if hunk is not None else '-'} | {f.get('line') or '-'} | "
                         f"{(f.get('message') or '')}{'; ' + note if note else ''} |")
            rows += 1
        for o in p.get("offsets", []):
            lines.append(f"| {name} | {status} | `{o.get('file')}` | {o.get('hunk')} | "
                         f"{o.get('line')} | offset {o.get('offset'):+d}{'; ' + note if note else ''} |")
            rows += 1
        if rows == 0:
            lines.append(f"| {name} | {status} | | | | {note} |")
    notes = data.get("notes", [])
    if notes:
        lines.append("")
        lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"
