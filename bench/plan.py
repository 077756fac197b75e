"""What a run will do: its profile, the modes, every cell's size, the servers' command
lines, time estimates. ``--dry-run`` prints it (``print_plan``); no torch, no GPU.

The defaults the server has (writer threads, the host-memory cap) are sglang_ext.config's,
read the way the server reads them.
"""

from __future__ import annotations

import math
import shlex

from sglang_ext import config

from bench import modes as registry
from bench import peer, profilers, report, servers
from bench.models import MODELS, file_bytes

PROFILES = {
    # fits one ~9-minute device call with both models (see bench/README.md)
    "quick": {"cell_tokens": 64 * 1024, "min_rounds": 1, "json_requests": 8,
              "ceiling_mib": 1024, "writer_reps": 2, "deadline_s": 420, "writer_log_wait_s": 0},
    "full": {"cell_tokens": 256 * 1024, "min_rounds": 2, "json_requests": 16,
             "ceiling_mib": 4096, "writer_reps": 3, "deadline_s": 3000, "writer_log_wait_s": 65},
}

# Modes whose cells run at every (prompt length, concurrency) of the grid, in the order
# they alternate within a shape (bench/modes.py's); ``json`` (c) runs once, at the
# headline shape.
GRID_MODES = registry.names(grid=True)
MODES = tuple(registry.BY_NAME)
# assumptions for --dry-run time estimates only: a vLLM server's start-up (eager, no
# compile) beyond ours (70-121 s seen on the H200, one after another)
EST_VLLM_STARTUP_S = 70
# and a third or fourth SGLang server's (C, D) beyond the first two's overlapped start
# (B and D started in 80-150 s after A, one after another, on the H200)
EST_EXTRA_SGLANG_STARTUP_S = 60
# assumption for the py-spy re-runs: seconds beyond the cell's own run (attach and stop)
EST_PY_SPY_EXTRA_S = 5
# the file comparison after the servers stop: its own run (30 s) and HF's float32 reference
# (its start and ~2 s per layer to load the model): an assumption, which the runner also
# keeps free before the deadline (runner.ModelRun.reserve_s)
PEER_COMPARE_S = 30


def reference_s(spec):
    """Seconds assumed for the file comparison's float32 reference of model ``spec``."""
    return 30 + 2 * spec["num_layers"]


def peer_files_s(spec, reference):
    """Seconds the file comparison takes after the servers stop (``reference``: "hf" or
    "none")."""
    return PEER_COMPARE_S + (reference_s(spec) if reference == "hf" else 0)


def writer_threads():
    """Threads of the writer process (and of the ceilings' writes):
    ``KIMI_SGLANG_WRITER_THREADS`` as the server reads it (sglang_ext.config, default 8)."""
    return config.env_settings(this_host=False)["writer_threads"]


def cell_requests(prompt_len, concurrency, cell_tokens, min_rounds):
    """Requests of one cell: about ``cell_tokens`` prompt tokens, at least ``min_rounds``
    requests per client thread."""
    return max(math.ceil(cell_tokens / prompt_len), concurrency * min_rounds, 1)


def make_plan(args):
    """The plan of a run (``args``: cli's parsed flags): ``{"profile", "modes", "phases",
    "models": {name: {"servers": {which: argv}, "cells": [...], "est_s", "build_s"}}, "est_total_s",
    and the sizes: "cell_tokens", "min_rounds", "deadline_s", "ceiling_mib",
    "writer_reps", "writer_threads", "max_host_mb"}``. Cells in run order: the headline
    shape (2k prompts, concurrency 8: nodump, dump, ..., json) first, so that a run cut
    short by the deadline still has it; then the rest, a shape's modes one after another
    (nodump and dump alternate), ``--repeat`` rounds interleaved; with ``--counterbalance``
    every odd round runs its modes in reverse order (A B, B A, ...), so that a drift over
    the run does not favour the mode that runs first."""
    prof = PROFILES[args.profile]
    cell_tokens = args.cell_tokens or prof["cell_tokens"]
    min_rounds = args.min_rounds or prof["min_rounds"]
    json_requests = args.json_requests or prof["json_requests"]
    modes = args.modes.split(",")
    models = [m for m in args.models.split(",") if m]
    plan = {"profile": args.profile, "modes": modes, "phases": [], "models": {},
            "cell_tokens": cell_tokens, "min_rounds": min_rounds,
            "deadline_s": args.deadline_s or prof["deadline_s"],
            "ceiling_mib": args.ceiling_mib or prof["ceiling_mib"],
            "writer_reps": prof["writer_reps"], "writer_threads": writer_threads(),
            "max_host_mb": args.max_host_mb or config.DEFAULT_MAX_HOST_MB}
    est_total = 0.0
    if not args.skip_ceilings:
        sizes = sorted({file_bytes(MODELS[m], p) for m in models for p in args.prompt_lens})
        plan["phases"].append({"phase": "ceilings", "file_sizes": sizes, "est_s": 25})
        est_total += 25
    for name in models:
        spec = MODELS[name]
        cells = []
        no_peer = peer.unsupported(name) if any(peer.is_peer(m) for m in modes) else None
        grid = [(p, c) for p in args.prompt_lens for c in args.concurrency]
        head = (report.JSON_PROMPT_LEN, report.JSON_CONCURRENCY)
        grid.sort(key=lambda pc: pc != head)
        json_cell = {"mode": "json", "prompt_len": head[0], "concurrency": head[1],
                     "requests": json_requests, "prompt_tokens": json_requests * head[0]}
        for plen, conc in grid:
            scale = 1 if args.cell_tokens or conc < 8 else spec.get("cell_scale", 1)
            n = cell_requests(plen, conc, cell_tokens * scale, min_rounds)
            for rep in range(args.repeat):
                order = GRID_MODES[::-1] if args.counterbalance and rep % 2 else GRID_MODES
                for mode in order:
                    if mode in modes and not (no_peer and peer.is_peer(mode)):
                        cells.append({"mode": mode, "prompt_len": plen, "concurrency": conc,
                                      "requests": n, "prompt_tokens": n * plen}
                                     | ({"rep": rep} if args.repeat > 1 else {}))
            if (plen, conc) == head and "json" in modes:
                cells.append(dict(json_cell))
        if "json" in modes and head not in grid:
            cells.append(dict(json_cell))
        build_s = 0 if args.no_build else spec["est_build_s"]
        kinds = sorted({servers.server_for(args, c["mode"]) for c in cells})
        vllm_s = EST_VLLM_STARTUP_S * sum(servers.api_of(w) == "vllm" for w in kinds)
        vllm_s += EST_EXTRA_SGLANG_STARTUP_S * max(0, sum(servers.api_of(w) == "sglang" for w in kinds) - 2)
        # when the first cell starts (every server is up before it)
        clock = est_total + build_s + spec["est_startup_s"] + vllm_s + 20
        for c in cells:
            tps = spec["est_json_tps"] if c["mode"] == "json" else spec["est_tps"]
            c["est_s"] = round(c["prompt_tokens"] / tps + c["requests"] * 0.004 / c["concurrency"] + 0.5, 1)
            if c["mode"] in report.DUMP_MODES:
                c["dump_bytes"] = c["requests"] * file_bytes(spec, c["prompt_len"], c["mode"] == "dump_fp8")
            clock += c["est_s"]
            clock += plan_profiles(args, c, plan["deadline_s"] - clock)
        cmds = {which: servers.server_cmd(args, name, which) for which in kinds}
        # build, start-up, the cells and the profiles that fit (the clock), then the stop
        est = clock - est_total + 10
        est += peer_files_s(spec, args.peer_reference) if peer_files_wanted(modes, name) else 0
        est_total += est
        plan["models"][name] = {"servers": cmds, "cells": cells, "est_s": round(est), "build_s": build_s}
        if no_peer:
            plan["models"][name]["peer_unsupported"] = no_peer
    plan["est_total_s"] = round(est_total)
    return plan


def cell_need_s(cell, done):
    """Seconds a grid cell needs left before the deadline to start: twice its expected run
    plus 15. Expected: the longest wall time among the error-free cells of its shape
    (prompt length, concurrency; any mode but json) in ``done``, the run's cells so far;
    before any, the plan's estimate ``est_s`` (an assumed rate: for deepseek-tiny's 1M-token
    cells 7.7 s, where `writer-cpus-deepseek` measured 3.0-3.9 s at 2k x 8 and 10.8-14.2 s
    at 512 x 8)."""
    walls = [c["wall_s"] for c in done
             if c.get("wall_s") and not c.get("error") and "json" not in (c.get("mode"), cell.get("mode"))
             and (c.get("prompt_len"), c.get("concurrency")) == (cell["prompt_len"], cell["concurrency"])]
    return 2 * (max(walls) if walls else cell["est_s"]) + 15


def plan_profiles(args, cell, left_s):
    """The py-spy re-run asked for after ``cell`` (``cell["profiles"]``: what, its
    estimated seconds, and ``fits``: whether the ``left_s`` seconds the estimate leaves
    before the deadline when the cell ends cover what the runner asks to have free,
    ``profilers.*_need_s``); returns the seconds of those that fit."""
    r = {"wall_s": cell["est_s"]}
    asked = []
    need = profilers.py_spy_need_s(args, cell, r)
    if need is not None:
        asked.append({"what": "py-spy", "need_s": need,
                      "est_s": profilers.py_spy_slowdown(args.py_spy_kind) * cell["est_s"] + EST_PY_SPY_EXTRA_S})
    spent = 0.0
    for p in asked:
        p["fits"] = left_s - spent > p["need_s"]
        spent += p["est_s"] if p["fits"] else 0.0
    if asked:
        cell["profiles"] = asked
    return spent


def peer_files_wanted(modes, name):
    """Whether model ``name``'s run compares a few files of ours with vLLM's (both dump
    modes asked for, and vLLM serves the model)."""
    return "dump" in modes and "vllm_dump" in modes and not peer.unsupported(name)


def print_plan(plan):
    print(f"profile {plan['profile']}: modes {plan['modes']}, ~{plan['cell_tokens']} prompt tokens "
          f"per cell, >= {plan['min_rounds']} request(s) per client; writer threads "
          f"{plan['writer_threads']}; deadline {plan['deadline_s']} s")
    for ph in plan["phases"]:
        print(f"\n[ceilings] ~{ph['est_s']} s: pinned D2H 1 GiB; /dev/shm safetensors writes and "
              f"the writer alone, {plan['ceiling_mib']} MiB per size, sizes "
              f"{[f'{s / (1 << 20):.1f} MiB' for s in ph['file_sizes']]}")
    for name, m in plan["models"].items():
        vllm = sum(servers.api_of(w) == "vllm" for w in m["servers"])
        print(f"\n[{name}] ~{m['est_s']} s (start-up assumed {MODELS[name]['est_startup_s']} s"
              + (f" + {vllm} x {EST_VLLM_STARTUP_S} s for vLLM's" if vllm else "")
              + (f", the model's build {m['build_s']} s" if m.get("build_s") else "") + ")")
        for which, cmd in m["servers"].items():
            print(f"  server {which}: {shlex.join(cmd)}")
        if m.get("peer_unsupported"):
            print(f"  no vLLM cells: {m['peer_unsupported']}")
        print(f"  {'mode':16} {'prompt':>6} {'conc':>4} {'reqs':>5} {'tokens':>8} {'dump GiB':>8} {'est s':>6}")
        for c in m["cells"]:
            gib = f"{c['dump_bytes'] / (1 << 30):.1f}" if "dump_bytes" in c else ""
            mode = c["mode"] + (f" #{c['rep']}" if "rep" in c else "")
            print(f"  {mode:16} {c['prompt_len']:6} {c['concurrency']:4} {c['requests']:5} "
                  f"{c['prompt_tokens']:8} {gib:>8} {c['est_s']:6}")
            for p in c.get("profiles", []):
                print(f"    + {p['what']}: ~{p['est_s']} s" + (
                    "" if p["fits"] else f"; LIKELY SKIPPED: it needs {p['need_s']:.0f} s before the "
                    "deadline when its cell ends, and the estimate leaves less (raise --deadline-s)"))
    print(f"\nestimated total: ~{plan['est_total_s']} s (throughputs and start-up times are "
          f"assumptions; the deadline skips what does not fit)")
