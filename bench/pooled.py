"""Tokens/s pooled over a run's rounds (``--repeat``), and ratios of pooled rates.

One round's cell of deepseek-tiny moves by up to 0.37 between two identical servers
(docs/performance.md). Pooling sums each mode's prompt tokens and wall seconds over the
rounds, which weighs each round by its length and leaves the systematic difference. Pure
functions of the results' cells (``bench.report``'s layout); ``report`` and ``plot`` use them.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Tuple


def pooled_tps(cells: List[dict], mode: str) -> Dict[Tuple[int, int], float]:
    """{(prompt_len, concurrency): tokens/s} of ``mode``'s cells with a rate, over the
    rounds pooled: sum of prompt tokens / sum of wall seconds (one cell: its own rate)."""
    sums: Dict[Tuple[int, int], List[float]] = {}
    for c in cells:
        if c["mode"] == mode and c.get("prefill_tps"):
            s = sums.setdefault((c["prompt_len"], c["concurrency"]), [0.0, 0.0])
            s[0] += c["prompt_tokens"]
            s[1] += c.get("wall_s") or c["prompt_tokens"] / c["prefill_tps"]
    return {k: t / w for k, (t, w) in sums.items() if w}


def pooled_ratios(cells: List[dict], modes: Iterable[str], base_of: Callable[[str], str],
                  key: str = "dump_vs_nodump_pooled") -> List[dict]:
    """Per mode of ``modes`` and shape (prompt length, concurrency): its tokens/s pooled
    over the rounds that have both its cell and ``base_of(mode)``'s (error-free, with a
    wall time), over the base cells' pooled the same way. Rows ``{"mode", "prompt_len",
    "concurrency", "rounds", key}`` in the order of the cells; a round's base cell is the
    first error-free one with a wall time of its mode, shape and ``rep``."""
    modes = tuple(modes)
    ok = [c for c in cells if not c.get("error") and c.get("wall_s")]
    first: Dict[tuple, dict] = {}
    for c in ok:
        first.setdefault((c.get("mode"), c.get("prompt_len"), c.get("concurrency"), c.get("rep")), c)
    sums: Dict[tuple, List[float]] = {}
    for b in (c for c in ok if c.get("mode") in modes):
        a = first.get((base_of(b["mode"]), b["prompt_len"], b["concurrency"], b.get("rep")))
        if a is None:
            continue
        s = sums.setdefault((b["mode"], b["prompt_len"], b["concurrency"]), [0.0, 0.0, 0.0, 0.0, 0])
        s[0] += b["prompt_tokens"]
        s[1] += b["wall_s"]
        s[2] += a["prompt_tokens"]
        s[3] += a["wall_s"]
        s[4] += 1
    return [{"mode": mode, "prompt_len": plen, "concurrency": conc, "rounds": n,
             key: (tb / wb) / (ta / wa)}
            for (mode, plen, conc), (tb, wb, ta, wa, n) in sums.items()]
