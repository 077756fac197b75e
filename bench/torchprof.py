"""Summary of a torch-profiler trace of a server's scheduler process (``--torch-profile``).

SGLang's ``/start_profile`` ... ``/stop_profile`` (``activities: ["CPU", "GPU"]``) writes a
Chrome trace (Kineto's JSON: ``traceEvents`` with ``ph: "X"``, ``ts``/``dur`` in
microseconds; ``cat`` ``cpu_op`` for ATen ops, ``cuda_runtime``/``cuda_driver`` for CUDA API
calls, ``kernel``/``gpu_memcpy``/``gpu_memset`` for the device). No torch needed here:
``tests/test_bench.py`` feeds it hand-made events.

What it answers: per 1M prompt tokens, how long the scheduler thread (the thread with
the most ``cpu_op`` events: SGLang's event loop, which launches the forward) spent inside
top-level ATen ops (C++ work, the GIL released) and between them (its own Python and any
wait for the GIL), how long its CUDA API calls took (``cudaLaunchKernel``'s mean: a slower
launch in one server points at the CPU or the driver, not at Python), how busy the GPU
was, and what other threads (the dump's writer threads) did in torch.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, List

CPU_CATS = ("cpu_op",)
API_CATS = ("cuda_runtime", "cuda_driver")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _top_level(events: List[dict]) -> List[dict]:
    """Events not nested in an earlier one of the same list (sorted by start)."""
    out, end = [], float("-inf")
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:  # ops of one thread nest properly: anything else is inside
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def _union_us(intervals: Iterable[tuple]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def copies_behind(events: List[dict], large: int = 1 << 20, slack_us: float = 5.0) -> Dict[str, int]:
    """Device-to-host copies of known size: those over ``large`` bytes (the dump's rows
    copies) and, on streams that carry none of them, the small ones (SGLang's result
    copies); how many small ones started within ``slack_us`` after a large one ended
    (queued behind it on the copy engine: ``bench/copyprobe.py`` measures what that costs)
    and how many started while one ran (beside it). A server whose own copies exceed
    ``large`` (``--enable-return-hidden-states``) has its result copies' stream taken for
    a rows stream: read this on dump servers and plain no-dump ones."""
    d2h = [e for e in events if e.get("ph") == "X" and e.get("cat") == "gpu_memcpy"
           and "DtoH" in e.get("name", "") and "dur" in e and "bytes" in (e.get("args") or {})]
    big = [e for e in d2h if e["args"]["bytes"] > large]
    streams = {e["args"].get("stream") for e in big}
    small = [e for e in d2h if e["args"]["bytes"] <= large and e["args"].get("stream") not in streams]
    behind = sum(any(b["ts"] + b["dur"] <= e["ts"] <= b["ts"] + b["dur"] + slack_us for b in big) for e in small)
    during = sum(any(b["ts"] <= e["ts"] < b["ts"] + b["dur"] for b in big) for e in small)
    return {"small_d2h": len(small), "small_d2h_behind_large": behind, "small_d2h_during_large": during,
            "large_d2h": len(big)}


def summarize(events: List[dict], prompt_tokens: int, top: int = 12) -> Dict:
    """``events``: a trace's ``traceEvents``; ``prompt_tokens``: tokens prefilled in the
    profiled window. Returns milliseconds per 1M prompt tokens (``*_ms_per_mtok``) and
    counts; raises ValueError if the trace has no ATen ops."""
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    ops = [e for e in xs if e.get("cat") in CPU_CATS]
    if not ops:
        raise ValueError("no cpu_op events in the trace (was the CPU activity recorded?)")
    per_tid = defaultdict(list)
    for e in ops:
        per_tid[(e.get("pid"), e.get("tid"))].append(e)
    main = max(per_tid, key=lambda k: len(per_tid[k]))
    top_ops = _top_level(per_tid[main])
    start = top_ops[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in top_ops)
    window = end - start
    in_ops = sum(e["dur"] for e in top_ops)
    scale = 1e6 / prompt_tokens / 1e3 if prompt_tokens else float("nan")  # us -> ms per 1M tokens

    by_name = defaultdict(lambda: [0, 0.0])
    for e in top_ops:
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += e["dur"]
    api = defaultdict(lambda: [0, 0.0])
    for e in xs:
        if e.get("cat") in API_CATS and (e.get("pid"), e.get("tid")) == main:
            api[e["name"]][0] += 1
            api[e["name"]][1] += e["dur"]
    longest = max(top_ops, key=lambda e: e["dur"])
    launches = api.get("cudaLaunchKernel") or api.get("cuLaunchKernel") or [0, 0.0]
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in xs if e.get("cat") in GPU_CATS
           and start <= e["ts"] <= end]
    others = {}
    for k, evs in per_tid.items():
        if k == main:
            continue
        t = _top_level(evs)
        others[str(k[1])] = {"ops": len(t), "ops_ms_per_mtok": sum(e["dur"] for e in t) * scale}
    return {
        "prompt_tokens": prompt_tokens,
        "window_ms": window / 1e3,
        "main_thread": str(main[1]),
        "window_ms_per_mtok": window * scale,
        "ops_ms_per_mtok": in_ops * scale,
        "between_ops_ms_per_mtok": (window - in_ops) * scale,
        "ops_per_mtok": len(top_ops) * 1e6 / prompt_tokens if prompt_tokens else None,
        "launch_us_mean": launches[1] / launches[0] if launches[0] else None,
        "launches_per_mtok": launches[0] * 1e6 / prompt_tokens if prompt_tokens else None,
        "api_ms_per_mtok": {n: round(v[1] * scale, 3) for n, v in
                            sorted(api.items(), key=lambda kv: -kv[1][1])[:top]},
        "top_ops_ms_per_mtok": {n: round(v[1] * scale, 3) for n, v in
                                sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]},
        "gpu_busy_ms_per_mtok": _union_us(gpu) * scale,
        # one op far longer than the rest (a Triton JIT compile for a new batch shape, a
        # synchronization) distorts "in ops": shown so that a reader can tell
        "longest_op": {"name": longest["name"], "ms": longest["dur"] / 1e3},
        "other_threads": dict(sorted(others.items(), key=lambda kv: -kv[1]["ops_ms_per_mtok"])[:8]),
        "copies": copies_behind(xs),
    }
