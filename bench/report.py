"""Pure functions of the benchmark: statistics, headline ratios, stage times (the targets
they are held to: ``bench.targets``).

No torch, no CUDA, no server: ``loadgen`` and ``cli`` feed them measured numbers, the tests
hand-made ones; ``markdown`` and ``plot`` show them. Units are in the names (``_s``
seconds, ``_tps`` prompt tokens per second, ``_gbps`` 1e9 bytes per second).

A results file (what ``cli`` writes): ``{"date", "gpu", "profile", "versions", "config",
"ceilings": {"d2h_pinned_gbps", "writer_threads", "shm_write_gbps": {"<file bytes>": gbps},
"writer_alone": {model: {prompt_len: {"gbps", "file_bytes", ...}}}}, "models": {model:
{"hidden_size", "layer_ids", "cells": [{"mode", "prompt_len", "concurrency", "rep",
"requests", "prompt_tokens", "wall_s", "prefill_tps", "p50_s", "p99_s", "file_bytes",
"write_gbps", "response_bytes", "drain_s", "stages", ...}], "host_memory", "peer_unsupported",
"peer_files"}}, "headline", "targets", "phases", "skipped"}``. Generate cells (bench/gen.py)
carry ``output_tokens``, ``output_tps`` (generated tokens per second) and ``samples_per_s``
instead of ``prefill_tps``."""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Tuple

from bench import modes

# which modes are a dump's cost, and each one's no-dump base: bench/modes.py
DUMP_MODES = modes.names(dumps=True)
STORE_MODES = modes.names(store=True)
# no file written, their ratio reported (nodump_again: the noise floor)
CONTROL_MODES = modes.names(control=True)
NOISE_MODE = "nodump_again"
# the store sink's target: (s') >= 0.95 x (a) at concurrency >= 8 (issue 35, bench.targets)
STORE_TARGET_CONCURRENCY = 8
# the no-dump mode each dump mode's ratio divides by (the same engine's)
BASE_MODE = {m.name: m.base for m in modes.MODES if m.base != "nodump"}
JSON_PROMPT_LEN = 2048
JSON_CONCURRENCY = 8


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear interpolation between ranks (numpy's
    default). NaN for no values."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def cell_stats(latencies_s: List[float], prompt_tokens: int, wall_s: float,
               last_answer_s: Optional[float] = None) -> Dict[str, float]:
    """Prefill throughput and latency percentiles of one batch of requests.

    ``prefill_tps`` = prompt tokens / wall time of the whole batch (first send to last
    response, or, with early answers, to the last file complete), with
    ``max_new_tokens=1`` so the time is prefill (plus, for a dump, the file write the
    response waits for). ``last_answer_s`` (seconds after the first send the last
    response arrived) adds ``drain_s``, the wall time after it: with early answers the
    write of the last files, which a cell of a few dozen requests pays once as a run of
    a whole dataset does at its end.
    """
    out = {
        "prompt_tokens": int(prompt_tokens),
        "wall_s": float(wall_s),
        "prefill_tps": prompt_tokens / wall_s if wall_s > 0 else float("nan"),
        "p50_s": percentile(latencies_s, 50),
        "p99_s": percentile(latencies_s, 99),
    }
    if last_answer_s is not None:
        out["drain_s"] = max(0.0, float(wall_s) - float(last_answer_s))
    return out


# Stages of one file, from sglang_ext/trace.py's timestamps: (name, start key, end key).
STAGES = (
    ("queue", "t_submit", "t_picked"),  # waiting for a writer thread
    ("d2h", "t_picked", "t_copied"),  # waiting for the device-to-host copies
    ("write", "t_copied", "t_written"),  # safetensors file written and renamed
    ("release", "t_written", "t_released"),  # index line, lock released
    ("file", "t_submit", "t_released"),  # last rows seen -> file complete
)


# Stages of one store object (the writer's "store" events; a put is visible when it
# returns: Mooncake makes the key visible at its end): (name, start key, end key).
STORE_STAGES = (
    ("queue", "t_submit", "t_picked"),  # waiting for a writer thread
    ("put", "t_picked", "t_written"),  # the put, start to visible
    ("visible", "t_submit", "t_written"),  # forward end (last rows seen, Finish queued) -> visible
)


# The parts of one hook call (trace.py's hook event; older traces: t0 and t1 only): (name, start, end).
HOOK_STAGES = (
    ("hook_take", "t0", "t_take"),  # rows checked, finished requests' names reserved
    ("hook_copy", "t_take", "t_copy"),  # arena opened, copies enqueued (fp8: quantized), files queued
    ("hook_send", "t_copy", "t1"),  # the batch's message to the writer, its acks read
)


def stage_stats(events: List[dict], wall_s: Optional[float] = None) -> Dict[str, Any]:
    """Where a dump cell's time went, from ``KIMI_SGLANG_TRACE`` lines (trace.py): ms
    ``{stage: {"p50", "p99"}}`` of ``STAGES``, ``response_wait`` (the finished request
    waiting for its file), ``poll_lag`` (file released -> seen complete; slightly negative
    when ``t_released`` is stamped after the waiter saw the lock go), ``hook`` (scheduler
    time per extend batch) and its ``HOOK_STAGES``; ``files``, ``ready_before_response``
    (share of files complete before their request finished) and, with ``wall_s``,
    ``hook_share``. Store objects instead: ``objects`` and ``STORE_STAGES``. {} without
    file or store events."""
    files = {e["name"]: e for e in events if e.get("event") == "file"}
    objects = [e for e in events if e.get("event") == "store"]
    if not files and not objects:
        return {}
    resp = {e["name"]: e for e in events if e.get("event") == "response"}
    hook_events = [e for e in events if e.get("event") == "hook" and "t0" in e and "t1" in e]
    hooks = [e["t1"] - e["t0"] for e in hook_events]

    def ms(values):
        values = [v * 1000 for v in values]
        return {"p50": percentile(values, 50), "p99": percentile(values, 99)}

    def hook_stats(out):
        out["hook"] = ms(hooks)
        for name, a, b in HOOK_STAGES:
            if parts := [e[b] - e[a] for e in hook_events if e.get(a) is not None and e.get(b) is not None]:
                out[name] = ms(parts)
        if wall_s:
            out["hook_share"] = sum(hooks) / wall_s
        return out

    if not files:
        out: Dict[str, Any] = {"objects": len(objects)}
        for name, a, b in STORE_STAGES:
            out[name] = ms([o[b] - o[a] for o in objects if a in o and b in o])
        return hook_stats(out)
    out = {"files": len(files)}
    for name, a, b in STAGES:
        out[name] = ms([f[b] - f[a] for f in files.values() if a in f and b in f])
    joined = [(files[n], r) for n, r in resp.items()
              if n in files and "t_released" in files[n] and "t_meta" in r and "t_done" in r]
    out["response_wait"] = ms([r["t_done"] - r["t_meta"] for _, r in joined])
    out["poll_lag"] = ms([r["t_done"] - f["t_released"] for f, r in joined])
    out["ready_before_response"] = (
        sum(f["t_released"] <= r["t_meta"] for f, r in joined) / len(joined) if joined else None
    )
    return hook_stats(out)


def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    if num is None or den is None or not den or math.isnan(num) or math.isnan(den):
        return None
    return num / den


def ceiling_w(d2h_gbps: Optional[float], shm_gbps: Optional[float]) -> Optional[float]:
    """W: the hardware ceiling of a dump, min(pinned device-to-host, /dev/shm write)."""
    vals = [v for v in (d2h_gbps, shm_gbps) if v is not None and not math.isnan(v)]
    return min(vals) if vals else None


def nearest(table: Dict[str, float], size: float) -> Optional[float]:
    """The value of ``table`` (keys: file sizes in bytes, as JSON strings) whose key is
    closest to ``size`` in log scale; None for an empty table."""
    if not table:
        return None
    key = min(table, key=lambda k: abs(math.log(float(k)) - math.log(max(size, 1.0))))
    return table[key]


ANY_REP = object()


def shape_tps(cells: List[dict], mode: str) -> Dict[Tuple[int, int], float]:
    """{(prompt_len, concurrency): tokens/s} of ``mode``'s error-free cells with a rate,
    pooled over the rounds: sum of prompt tokens / sum of wall seconds (one cell: its own
    rate). A ratio of two modes pools only the rounds both ran: ``paired_ratio``."""
    sums: Dict[Tuple[int, int], List[float]] = {}
    for c in _good(cells, mode):
        s = sums.setdefault((c["prompt_len"], c["concurrency"]), [0.0, 0.0])
        s[0] += c["prompt_tokens"]
        s[1] += _wall(c)
    return {k: t / w for k, (t, w) in sums.items() if w}


def _good(cells: List[dict], mode: str, shape: Optional[Tuple[int, int]] = None,
          rate: str = "prefill_tps") -> List[dict]:
    return [c for c in cells if c.get("mode") == mode and c.get(rate) and not c.get("error")
            and (shape is None or (c["prompt_len"], c["concurrency"]) == shape)]


def _wall(c: dict) -> float:
    return c.get("wall_s") or c["prompt_tokens"] / c["prefill_tps"]


def paired_ratio(cells: List[dict], mode: str, base: str, shape: Tuple[int, int],
                 to_last_answer: bool = False, tokens: str = "prompt_tokens",
                 rate: str = "prefill_tps") -> Tuple[Optional[float], int]:
    """``(ratio, rounds)``: ``mode``'s tokens/s at ``shape`` over ``base``'s, each pooled
    (tokens over wall seconds) over the rounds (``rep``) both have an error-free cell in, so
    a round the deadline cut from one side drops from the other too; ``(None, 0)`` when
    they share none. ``to_last_answer``: seconds up to each cell's last answer (its wall
    less its ``drain_s``), None unless every cell pooled has one. ``tokens``, ``rate``: the
    cells' keys counted and rated (generate cells: ``output_tokens`` and ``output_tps``, or
    ``requests`` and ``samples_per_s``: ``gen_ratios``)."""
    mine = {c.get("rep"): c for c in _good(cells, mode, shape, rate)}
    theirs = {c.get("rep"): c for c in _good(cells, base, shape, rate)}
    reps = [r for r in mine if r in theirs]
    if not reps:
        return None, 0
    pooled = []
    for side in (mine, theirs):
        chosen = [side[r] for r in reps]
        if to_last_answer and any("drain_s" not in c for c in chosen):
            return None, len(reps)
        seconds = sum(_wall(c) - (c["drain_s"] if to_last_answer else 0.0) for c in chosen)
        pooled.append(sum(c[tokens] for c in chosen) / seconds if seconds > 0 else None)
    return ratio(pooled[0], pooled[1]), len(reps)


# issue 49's ratios of generate cells (bench/gen.py), each ``paired_ratio``'s keywords:
# (g out)/(g), output tokens/s with and without the output rows; two passes' wall per sample
# over one pass's, i.e. one pass's samples/s over two passes'
GEN_RATIOS = (("output_vs_nodump", "gen_output", "gen_nodump", {"tokens": "output_tokens", "rate": "output_tps"}),
              ("two_pass_vs_one_pass", "gen_output", "gen_two_pass", {"tokens": "requests", "rate": "samples_per_s"}))


def gen_ratios(cells: List[dict]) -> List[dict]:
    """Per shape with a generate cell: ``{"prompt_len", "concurrency", <GEN_RATIOS name>:
    value or None, "rounds_<name>"}``, each pooled over the rounds both modes ran."""
    out = []
    shapes = sorted({(c["prompt_len"], c["concurrency"]) for c in cells if c.get("mode") in modes.GEN_MODES})
    for shape in shapes:
        row: Dict[str, Any] = {"prompt_len": shape[0], "concurrency": shape[1]}
        for name, mode, base, keys in GEN_RATIOS:
            row[name], row[f"rounds_{name}"] = paired_ratio(cells, mode, base, shape, **keys)
        out.append(row)
    return out


def pooled_ratios(cells: List[dict]) -> List[dict]:
    """Per shape and mode (the dump modes and the controls), ``paired_ratio`` over its
    base: ``{"mode", "prompt_len", "concurrency", "rounds", "vs_nodump",
    "vs_nodump_to_last_answer"}`` (``rounds``: the rounds both ran; the latter up to the
    cells' last answers, a dump's cost per request with its final drain aside, None for
    runs without the drain measured). Rounds pooled this way weigh each by its seconds,
    and with ``--counterbalance`` a drift within a round falls on both sides."""
    out = []
    for mode in DUMP_MODES + CONTROL_MODES:
        base = BASE_MODE.get(mode, "nodump")
        for shape in sorted({(c["prompt_len"], c["concurrency"]) for c in _good(cells, mode)}):
            value, rounds = paired_ratio(cells, mode, base, shape)
            if value is None:
                continue
            out.append({"mode": mode, "prompt_len": shape[0], "concurrency": shape[1], "rounds": rounds,
                        "vs_nodump": value,
                        "vs_nodump_to_last_answer": paired_ratio(cells, mode, base, shape, True)[0]})
    return out


def find_cell(cells, mode, prompt_len, concurrency, rep=ANY_REP):
    """The first error-free cell of that mode and shape; with ``rep``, of that repetition
    (``--repeat``: cells carry ``rep`` 0..N-1; without it they carry none, i.e. None)."""
    for c in cells:
        if (c.get("mode"), c.get("prompt_len"), c.get("concurrency")) == (
            mode, prompt_len, concurrency
        ) and not c.get("error") and (rep is ANY_REP or c.get("rep") == rep):
            return c
    return None


def headline(results: dict) -> Dict[str, dict]:
    """Per model: per dump cell (and round) its ratio to its base and to its bound
    ``min((a), W/B)`` (the store's has no W: (a) alone); ``<mode>_vs_nodump_min`` and
    ``_geomean`` of every dump mode (the store's also ``_min_conc8``); the pooled rounds;
    the noise floor (a')/(a); fp8's bytes per token over bf16's; ``dump_vs_json`` at 2k x 8;
    ``writer_vs_ceiling`` (per prompt length, and at 2k); with vLLM, ``peer_rows``; with
    generate cells, ``gen`` (``gen_ratios``)."""
    ceil = results.get("ceilings", {})
    d2h, shm = ceil.get("d2h_pinned_gbps"), ceil.get("shm_write_gbps", {})
    out = {}
    for model, m in results.get("models", {}).items():
        cells = m.get("cells", [])
        per_cell = []
        for b in (c for c in cells if c.get("mode") in DUMP_MODES and not c.get("error")):
            a = find_cell(cells, BASE_MODE.get(b["mode"], "nodump"), b["prompt_len"], b["concurrency"], b.get("rep"))
            per_token = b["file_bytes"] / b["prompt_tokens"] if b.get("file_bytes") else None
            w = (None if b["mode"] in STORE_MODES or not per_token
                 else ceiling_w(d2h, nearest(shm, b["file_bytes"] / b["requests"])))
            w_tps = w * 1e9 / per_token if w else None
            a_tps = a["prefill_tps"] if a else None
            bound = min((v for v in (a_tps, w_tps) if v is not None), default=None)
            per_cell.append({"mode": b["mode"], "prompt_len": b["prompt_len"], "concurrency": b["concurrency"],
                             **({"rep": b["rep"]} if "rep" in b else {}),
                             "dump_vs_nodump": ratio(b["prefill_tps"], a_tps), "bytes_per_token": per_token,
                             "w_gbps": w, "w_tps": w_tps, "bound_tps": bound,
                             "dump_vs_bound": ratio(b["prefill_tps"], bound)})
        h = out[model] = {"cells": per_cell}
        if any(c.get("rep") for c in cells) or any(c.get("mode") in CONTROL_MODES for c in cells):
            h["pooled"] = pooled_ratios(cells)
        noise = [ratio(c["prefill_tps"], (find_cell(cells, "nodump", c["prompt_len"], c["concurrency"],
                                                    c.get("rep")) or {}).get("prefill_tps"))
                 for c in cells if c.get("mode") == NOISE_MODE and not c.get("error")]
        if noise := [x for x in noise if x is not None]:
            h.update(nodump_again_vs_nodump_min=min(noise), nodump_again_vs_nodump_max=max(noise))
        for mode in DUMP_MODES:
            rs = [x["dump_vs_nodump"] for x in per_cell if x["mode"] == mode and x["dump_vs_nodump"] is not None]
            h.update({f"{mode}_vs_nodump_min": min(rs, default=None), f"{mode}_vs_nodump_geomean": geomean(rs)})
            if mode in STORE_MODES:
                h[f"{mode}_vs_nodump_min_conc8"] = min(
                    (x["dump_vs_nodump"] for x in per_cell if x["mode"] == mode and x["dump_vs_nodump"] is not None
                     and x["concurrency"] >= STORE_TARGET_CONCURRENCY), default=None)
        same = {(c["prompt_len"], c["concurrency"], c.get("rep")): c["bytes_per_token"]
                for c in per_cell if c["mode"] == "dump" and c["bytes_per_token"]}
        fp8 = [c["bytes_per_token"] / same[k] for c in per_cell if c["mode"] == "dump_fp8" and c["bytes_per_token"]
               and (k := (c["prompt_len"], c["concurrency"], c.get("rep"))) in same]
        h["fp8_vs_bf16_bytes_per_token_max"] = max(fp8, default=None)
        b_json, c_json = (find_cell(cells, mode, JSON_PROMPT_LEN, JSON_CONCURRENCY) for mode in ("dump", "json"))
        h["dump_vs_json"] = ratio(b_json and b_json["prefill_tps"], c_json and c_json["prefill_tps"])
        h["writer_vs_ceiling_by_len"] = {
            plen: ratio(wr.get("gbps"), ceiling_w(d2h, nearest(shm, wr["file_bytes"])))
            for plen, wr in ceil.get("writer_alone", {}).get(model, {}).items()}
        h["writer_vs_ceiling"] = h["writer_vs_ceiling_by_len"].get(str(JSON_PROMPT_LEN))
        if gen := gen_ratios(cells):
            h["gen"] = gen
        if rows := peer_rows(cells):
            vs = [x["dump_vllm_vs_ours"] for x in rows if x["dump_vllm_vs_ours"] is not None]
            h.update(peer=rows, vllm_dump_vs_ours_dump_min=min(vs, default=None),
                     vllm_dump_vs_ours_dump_geomean=geomean(vs))
    return out


def geomean(xs: List[float]) -> Optional[float]:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def peer_rows(cells: List[dict]) -> List[dict]:
    """Side by side with vLLM, per shape and round that has a vLLM cell: each engine's own
    dump/no-dump ratio, and vLLM's tokens/s over ours, no-dump and dump (both dumps done
    when the file is complete), with each dump's bytes per prompt token."""
    shapes = []
    for c in cells:
        shape = (c.get("prompt_len"), c.get("concurrency"), c.get("rep"))
        if c.get("mode") in ("vllm_nodump", "vllm_dump") and shape not in shapes:
            shapes.append(shape)
    rows = []
    for plen, conc, rep in shapes:
        a, b, v, w = (find_cell(cells, mode, plen, conc, rep)
                      for mode in ("nodump", "dump", "vllm_nodump", "vllm_dump"))

        def tps(c):
            return c["prefill_tps"] if c else None

        def bpt(c):
            return c["file_bytes"] / c["prompt_tokens"] if c and c.get("file_bytes") else None

        rows.append({"prompt_len": plen, "concurrency": conc, **({"rep": rep} if rep is not None else {}),
                     "ours_dump_vs_nodump": ratio(tps(b), tps(a)),
                     "vllm_dump_vs_nodump": ratio(tps(w), tps(v)),
                     "nodump_vllm_vs_ours": ratio(tps(v), tps(a)),
                     "dump_vllm_vs_ours": ratio(tps(w), tps(b)),
                     "ours_bytes_per_token": bpt(b), "vllm_bytes_per_token": bpt(w)})
    return rows


def mib(x) -> str:
    """Bytes as whole MiB for tables ("n/a" for None)."""
    return "n/a" if x is None else f"{x / (1 << 20):.0f} MiB"


def num(x, fmt="{:.0f}") -> str:
    """``fmt`` of a number for tables; "-" for None or NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return fmt.format(x)
