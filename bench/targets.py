"""The targets a run is held to, pass or fail (``targets``), from ``report``'s headline
and the pooled rounds: the dump against (a) and the host's bound, the JSON path, the
writer alone, host memory, the store sink, the file's own latency (issue 39:
``latency_targets``) and generating with the output rows in one pass (issue 49: ``gen_targets``)."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from bench.models import MODELS
from bench.report import GEN_RATIOS, mib, paired_ratio

TARGET_DUMP_VS_BOUND = 0.95  # (b) >= 0.95 x min((a), W/B) tokens/s, every cell
TARGET_DUMP_VS_JSON = 30.0  # (b) >= 30 x (c) at 2k prompts, concurrency 8
TARGET_WRITER_VS_CEILING = 0.70  # writer alone >= 0.70 W
# issue 39 (the file's own latency), on the rounds pooled per shape (latency_targets)
TARGET_WAITING_CONC1 = 0.90
TARGET_WAITING_CONC8 = 0.97
TARGET_EARLY = 0.98
# issue 48 (the Kimi-K2.5 slice), on the rounds pooled per shape (kimi_targets)
TARGET_KIMI_EARLY = 0.97  # early answers (bf16, fp8, store) >= 0.97 x (a) at concurrency >= 8
TARGET_KIMI_FP8 = 0.97  # fp8 files >= 0.97 x bf16 in every shape
# issue 49 (generate and capture in one pass), on the rounds pooled per shape (gen_targets)
TARGET_GEN_OUTPUT = 0.95  # (g out) >= 0.95 x (g) output tokens/s at concurrency 1, 8, 32
GEN_TARGET_CONCURRENCY = (1, 8, 32)
TARGET_ONE_PASS = 1.2  # two passes' wall per sample >= 1.2 x one pass's


def targets(results: dict, head: Dict[str, dict]) -> List[dict]:
    """Pass/fail of each target: ``{"model", "target", "value", "threshold", "pass"}``;
    ``pass`` is None where the inputs were not measured (skipped or failed)."""
    rows = []

    def add(model, name, value, threshold, ok=None, note=""):
        if ok is None:
            ok = None if value is None else value >= threshold
        rows.append({"model": model, "target": name, "value": value, "threshold": threshold, "pass": ok, "note": note})

    for model, h in head.items():
        for mode, name in (("dump", "(b) >= 0.95 x min((a), W/B), worst cell"),
                           ("dump_early", "(b, early answers) >= 0.95 x min((a), W/B), worst cell")):
            cells = [c for c in h["cells"] if c.get("mode", "dump") == mode]
            if mode == "dump_early" and not cells:
                continue  # not in this run's modes
            add(model, name, min((c["dump_vs_bound"] for c in cells if c["dump_vs_bound"] is not None), default=None),
                TARGET_DUMP_VS_BOUND)
        for mode, name in (("dump_store", "(s) store sink >= 0.95 x (a) at conc >= 8, worst cell"),
                           ("dump_store_early", "(s') store sink, early answers >= 0.95 x (a) at conc >= 8, "
                                                "worst cell")):
            if any(c.get("mode") == mode for c in h["cells"]):
                add(model, name, h.get(f"{mode}_vs_nodump_min_conc8"), TARGET_DUMP_VS_BOUND)
        cells = results.get("models", {}).get(model, {}).get("cells", [])
        spec = MODELS.get(model)
        for name, value, threshold in latency_targets(cells) + gen_targets(cells) + (
                kimi_targets(cells) if spec and spec.kimi_targets else []):
            add(model, name, value, threshold)
        add(model, "(b) >= 30 x (c) at 2k/conc 8", h["dump_vs_json"], TARGET_DUMP_VS_JSON)
        add(model, "writer alone >= 0.70 W (2k files)", h["writer_vs_ceiling"], TARGET_WRITER_VS_CEILING)
        mem = results.get("models", {}).get(model, {}).get("host_memory", {})
        cap, peak, pool, rss, rss_a = (mem.get(k) for k in ("cap_bytes", "log_host_bytes_peak", "log_pinned_pool_peak",
                                                              "rss_delta_bytes", "rss_delta_bytes_nodump"))
        note = (f"writer budget peak {mib(peak)}, pinned pool peak {mib(pool)}, cap {mib(cap)}; "
                f"RSS growth {mib(rss)} (server without dump: {mib(rss_a)})")
        if cap is not None and (peak is not None or pool is not None):
            # What the dump path holds: the budget (live buffers) and the pinned pool (live +
            # torch's cache). The RSS also holds SGLang's and Triton's growth: reported only.
            held = max(x for x in (peak, pool) if x is not None)
            add(model, "host memory under the cap", held, cap, ok=held <= cap, note=note)
        elif cap is not None and rss is not None:
            add(model, "host memory under the cap", rss, cap, ok=rss <= cap + (512 << 20), note=note)
        else:
            add(model, "host memory under the cap", None, cap)
    return rows


def latency_targets(cells: List[dict]) -> List[Tuple[str, Optional[float], float]]:
    """Issue 39's targets, each on the worst shape of the rounds pooled (``paired_ratio``):
    ``(name, value, threshold)`` for each whose modes ran. Waiting answers (b) >=
    ``TARGET_WAITING_CONC1`` x (a) at concurrency 1 and >= ``TARGET_WAITING_CONC8`` at
    concurrency >= 8; early answers (b') >= ``TARGET_EARLY`` everywhere; fp8 files
    (waiting) at least as fast as bf16 in each shape."""
    out = []

    def worst(mode, base, keep=lambda shape: True):
        return _worst(cells, mode, base, keep)

    ran = _ran(cells)
    if "dump" in ran:
        for name, keep, threshold in (
                ("(b) waiting >= 0.90 x (a) at conc 1, pooled, worst shape", lambda k: k[1] == 1, TARGET_WAITING_CONC1),
                ("(b) waiting >= 0.97 x (a) at conc >= 8, pooled, worst shape", lambda k: k[1] >= 8,
                 TARGET_WAITING_CONC8)):
            if (value := worst("dump", "nodump", keep)) is not None:
                out.append((name, value, threshold))
    if "dump_early" in ran:
        out.append(("(b') early >= 0.98 x (a), pooled, worst shape", worst("dump_early", "nodump"), TARGET_EARLY))
    if "dump_fp8" in ran and "dump" in ran:
        out.append(("(b fp8) >= (b) bf16, pooled, worst shape", worst("dump_fp8", "dump"), 1.0))
    return out




def kimi_targets(cells: List[dict]) -> List[Tuple[str, Optional[float], float]]:
    """Issue 48's targets for the Kimi-K2.5 slice, each on the worst shape of the rounds
    pooled (``paired_ratio``), for the modes that ran: early answers, bf16 (b'), fp8
    (b' fp8) and the store's (s'), >= ``TARGET_KIMI_EARLY`` x (a) at every prompt length
    at concurrency >= 8; fp8 files >= ``TARGET_KIMI_FP8`` x bf16 in every shape, waiting
    against waiting and early against early. (Its third, waiting answers >= 0.90 x (a) at
    concurrency 1, is ``latency_targets``'.)"""
    out = []
    ran = _ran(cells)
    for mode, label in (("dump_early", "(b') early"), ("dump_fp8_early", "(b' fp8) early"),
                        ("dump_store_early", "(s') store, early")):
        if mode in ran:
            out.append((f"{label} >= 0.97 x (a) at conc >= 8, pooled, worst length",
                        _worst(cells, mode, "nodump", lambda k: k[1] >= 8), TARGET_KIMI_EARLY))
    for fp8, bf16, label in (("dump_fp8", "dump", "(b fp8) >= 0.97 x (b) bf16"),
                             ("dump_fp8_early", "dump_early", "(b' fp8) >= 0.97 x (b') bf16")):
        if fp8 in ran and bf16 in ran:
            out.append((f"{label}, pooled, worst shape", _worst(cells, fp8, bf16), TARGET_KIMI_FP8))
    return out


def gen_targets(cells: List[dict]) -> List[Tuple[str, Optional[float], float]]:
    """Issue 49's targets, for the generate modes that ran, each on the worst shape of the
    rounds pooled (``report.GEN_RATIOS``): output capture (g out) >= ``TARGET_GEN_OUTPUT``
    x no dump (g) in output tokens/s at concurrency ``GEN_TARGET_CONCURRENCY``; two passes
    (generate, then capture prompt + generated ids) >= ``TARGET_ONE_PASS`` x one pass's
    wall per sample."""
    out = []
    ran = _ran(cells)
    for name, mode, base, keys in GEN_RATIOS:
        if mode not in ran or base not in ran:
            continue
        if name == "output_vs_nodump":
            out.append(("(g out) output capture >= 0.95 x (g) no dump, output tok/s at conc 1, 8, 32, pooled, "
                        "worst shape", _worst(cells, mode, base, lambda k: k[1] in GEN_TARGET_CONCURRENCY, **keys),
                        TARGET_GEN_OUTPUT))
        else:
            out.append(("(g 2p) two passes' wall per sample >= 1.2 x (g out) one pass's, pooled, worst shape",
                        _worst(cells, mode, base, **keys), TARGET_ONE_PASS))
    return out


def _ran(cells: List[dict]) -> set:
    """The modes with at least one cell that did not fail."""
    return {c.get("mode") for c in cells if not c.get("error")}


def _worst(cells: List[dict], mode: str, base: str, keep=lambda shape: True, **keys) -> Optional[float]:
    """The smallest ``paired_ratio`` of ``mode`` over ``base`` (``keys``: its ``tokens`` and
    ``rate``) among ``mode``'s shapes (prompt length, concurrency) that ``keep`` takes; None
    where none pairs."""
    shapes = {(c["prompt_len"], c["concurrency"]) for c in cells if c.get("mode") == mode}
    vals = [paired_ratio(cells, mode, base, k, **keys)[0] for k in shapes if keep(k)]
    return min((v for v in vals if v is not None), default=None)
