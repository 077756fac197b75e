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
from bench import peer, report, servers
from bench import store as bench_store
from bench.models import MODELS, file_bytes

PROFILES = {
    # fits one ~9-minute device call with both models
    "quick": {"cell_tokens": 64 * 1024, "min_rounds": 1, "json_requests": 8,
              "ceiling_mib": 1024, "writer_reps": 2, "deadline_s": 420, "gen_cell_tokens": 2048},
    "full": {"cell_tokens": 256 * 1024, "min_rounds": 2, "json_requests": 16,
             "ceiling_mib": 4096, "writer_reps": 3, "deadline_s": 3000, "gen_cell_tokens": 8192},
}
# generate cells (bench/gen.py): their concurrency grid where --concurrency is not given
GEN_CONCURRENCY = (1, 8, 32)

# the grid's modes, in the order they alternate within a shape (bench/modes.py); ``json``
# (c) runs once, at the headline shape
GRID_MODES = registry.names(grid=True)
MODES = tuple(registry.BY_NAME)
# assumptions for --dry-run time estimates only: a vLLM server's start-up beyond ours, and
# a third SGLang server's (D) beyond the first two's overlapped start
EST_VLLM_STARTUP_S = 70
EST_EXTRA_SGLANG_STARTUP_S = 60
# the file comparison after the servers stop (its own run; HF's reference: ``reference_s``),
# which the runner also keeps free before the deadline (runner.ModelRun.reserve_s)
PEER_COMPARE_S = 30
# the store modes' mooncake_master and store node (bench/store.py), before the servers
EST_STORE_S = 10


def reference_s(spec):
    """Seconds assumed for the file comparison's float32 reference of model ``spec``."""
    return 30 + 2 * spec.num_layers


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


def grid(args, name, gen=False):
    """``(prompt_lens, concurrency)`` of model ``name``: ``--prompt-lens`` and
    ``--concurrency`` where given, else the model's own (bench/models.py); ``gen``: of its
    generate cells, whose concurrency is ``GEN_CONCURRENCY`` unless given."""
    spec = MODELS[name]
    return (list(args.prompt_lens or spec.prompt_lens),
            list(args.concurrency or (GEN_CONCURRENCY if gen else spec.concurrency)))


def gen_cell_requests(concurrency, gen_tokens, gen_cell_tokens, min_rounds):
    """Requests of one generate cell: about ``gen_cell_tokens`` generated tokens
    (``gen_tokens`` per request), at least ``min_rounds`` requests per client thread."""
    return max(math.ceil(gen_cell_tokens / gen_tokens), concurrency * min_rounds, 1)


def gen_est_s(spec, cell, gen_tokens):
    """Seconds assumed for a generate cell (``--dry-run`` and the deadline's first guess):
    waves of ``concurrency`` requests, each a prefill then ``gen_tokens`` decode steps of
    ``spec.est_decode_step_s``; two passes add the capture's prefill of prompt + generated ids."""
    waves = math.ceil(cell["requests"] / cell["concurrency"])
    prefill = cell["prompt_len"] * cell["concurrency"] / spec.est_tps
    if registry.BY_NAME[cell["mode"]].capture:
        prefill += (cell["prompt_len"] + gen_tokens) * cell["concurrency"] / spec.est_tps
    return round(waves * (prefill + gen_tokens * spec.est_decode_step_s) + 0.5, 1)


def make_plan(args):
    """The plan of a run (``args``: cli's parsed flags): ``{"profile", "modes", "phases",
    "models": {name: {"servers": {which: argv}, "cells": [...], "est_s", "build_s"}}, "est_total_s",
    and the sizes: "cell_tokens", "min_rounds", "deadline_s", "ceiling_mib",
    "writer_reps", "writer_threads", "max_host_mb"}``. Cells in run order: the headline
    shape (2k prompts, concurrency 8) first, so that a run cut short by the deadline still
    has it; then the rest, a shape's modes one after another, ``--repeat`` rounds interleaved;
    with ``--counterbalance`` every odd round runs its modes in reverse order (ABBA), so a
    drift over a shape's rounds weighs on each mode alike once the rounds are pooled.
    Generate cells (``--gen-tokens`` each request, ``gen_tokens`` in the plan) run at
    ``GEN_CONCURRENCY`` unless ``--concurrency`` is given."""
    prof = PROFILES[args.profile]
    cell_tokens = args.cell_tokens or prof["cell_tokens"]
    min_rounds, json_requests = prof["min_rounds"], prof["json_requests"]
    modes = args.modes.split(",")
    models = [m for m in args.models.split(",") if m]
    plan = {"profile": args.profile, "modes": modes, "phases": [], "models": {},
            "cell_tokens": cell_tokens, "min_rounds": min_rounds,
            "deadline_s": args.deadline_s or prof["deadline_s"],
            "ceiling_mib": prof["ceiling_mib"],
            "writer_reps": prof["writer_reps"], "writer_threads": writer_threads(),
            "counterbalance": bool(getattr(args, "counterbalance", False)),
            "max_host_mb": args.max_host_mb or config.DEFAULT_MAX_HOST_MB}
    if any(map(registry.is_gen, modes)):
        plan["gen_tokens"] = args.gen_tokens
    est_total = 0.0
    head = (report.JSON_PROMPT_LEN, report.JSON_CONCURRENCY)
    if not args.skip_ceilings:
        sizes = sorted({file_bytes(MODELS[m], p) for m in models for p in grid(args, m)[0]})
        plan["phases"].append({"phase": "ceilings", "file_sizes": sizes, "est_s": 25})
        est_total += 25
    for name in models:
        spec = MODELS[name]
        cells = []
        no_peer = peer.unsupported(name) if any(peer.is_peer(m) for m in modes) else None
        plens, concs = grid(args, name)
        prefill = [(p, c) for p in plens for c in concs] if any(
            m in GRID_MODES and not registry.is_gen(m) for m in modes) else []
        gen = [(p, c) for p in plens for c in grid(args, name, gen=True)[1]] if any(map(registry.is_gen, modes)) else []
        shapes = sorted(prefill + [k for k in gen if k not in prefill], key=lambda pc: pc != head)
        json_cell = {"mode": "json", "prompt_len": head[0], "concurrency": head[1],
                     "requests": json_requests, "prompt_tokens": json_requests * head[0]}
        for plen, conc in shapes:
            scale = 1 if args.cell_tokens or conc < 8 else spec.cell_scale
            n = cell_requests(plen, conc, cell_tokens * scale, min_rounds)
            n_gen = (max(args.gen_requests, conc) if args.gen_requests
                     else gen_cell_requests(conc, args.gen_tokens, prof["gen_cell_tokens"], min_rounds))
            for rep in range(args.repeat):
                reverse = getattr(args, "counterbalance", False) and rep % 2 == 1
                for mode in (GRID_MODES[::-1] if reverse else GRID_MODES):
                    is_gen = registry.is_gen(mode)
                    if mode in modes and not (no_peer and peer.is_peer(mode)) and (plen, conc) in (
                            gen if is_gen else prefill):
                        k = n_gen if is_gen else n
                        cells.append({"mode": mode, "prompt_len": plen, "concurrency": conc,
                                      "requests": k, "prompt_tokens": k * plen}
                                     | ({"gen_tokens": args.gen_tokens} if is_gen else {})
                                     | ({"rep": rep} if args.repeat > 1 else {}))
            if (plen, conc) == head and "json" in modes:
                cells.append(dict(json_cell))
        if "json" in modes and head not in shapes:
            cells.append(dict(json_cell))
        build_s = 0 if args.no_build else spec.est_build_s
        kinds = sorted({w for c in cells for w in servers.servers_of(args, c["mode"])})
        vllm_s = EST_VLLM_STARTUP_S * sum(servers.api_of(w) == "vllm" for w in kinds)
        vllm_s += EST_EXTRA_SGLANG_STARTUP_S * max(0, sum(servers.api_of(w) == "sglang" for w in kinds) - 2)
        # when the first cell starts (every server is up before it)
        store_kind = any(servers.stores(w) for w in kinds)
        clock = est_total + build_s + spec.est_startup_s + vllm_s + 20 + (EST_STORE_S if store_kind else 0)
        for c in cells:
            tps = spec.est_json_tps if c["mode"] == "json" else spec.est_tps
            c["est_s"] = round(c["prompt_tokens"] / tps + c["requests"] * 0.004 / c["concurrency"] + 0.5, 1)
            if registry.is_gen(c["mode"]):
                c["est_s"] = gen_est_s(spec, c, args.gen_tokens)
                # one pass: prompt + generated - 1 rows a file; two passes capture all of them
                rows = {"output": c["prompt_len"] + args.gen_tokens - 1, "two_pass": c["prompt_len"] + args.gen_tokens}
                if (r := rows.get(registry.BY_NAME[c["mode"]].gen)) is not None:
                    c["dump_bytes"] = c["requests"] * file_bytes(spec, r)
            if c["mode"] in report.DUMP_MODES:
                c["dump_bytes"] = c["requests"] * file_bytes(spec, c["prompt_len"], registry.BY_NAME[c["mode"]].fp8)
            clock += c["est_s"]
        cmds = {which: servers.server_cmd(args, name, which) for which in kinds}
        # build, start-up, the cells (the clock), then the stop
        est = clock - est_total + 10
        est += peer_files_s(spec, args.peer_reference) if peer_files_wanted(modes, name) else 0
        est_total += est
        plan["models"][name] = {"servers": cmds, "cells": cells, "est_s": round(est), "build_s": build_s,
                                "prompt_lens": plens, "concurrency": concs}
        if store_kind:
            # every sample of a cell is held until the cell ends; a warm-up burst likewise
            held = [c["dump_bytes"] for c in cells if registry.BY_NAME[c["mode"]].store]
            held.append(max(8, *concs) * file_bytes(spec, max(plens)))
            plan["models"][name]["store"] = {"master_port": args.mooncake_port,
                                             "segment_bytes": bench_store.segment_bytes(held)}
        if no_peer:
            plan["models"][name]["peer_unsupported"] = no_peer
    plan["est_total_s"] = round(est_total)
    return plan


def cell_need_s(cell, done):
    """Seconds a grid cell needs left before the deadline to start: twice its expected run
    plus 15. Expected: the longest wall time among the error-free cells of its shape
    (prompt length, concurrency; any mode but json) in ``done``, the run's cells so far;
    before any, the plan's estimate ``est_s``. Generate cells go by generate cells, the
    rest by the rest."""
    walls = [c["wall_s"] for c in done
             if c.get("wall_s") and not c.get("error") and "json" not in (c.get("mode"), cell.get("mode"))
             and registry.is_gen(c.get("mode")) == registry.is_gen(cell.get("mode"))
             and (c.get("prompt_len"), c.get("concurrency")) == (cell["prompt_len"], cell["concurrency"])]
    return 2 * (max(walls) if walls else cell["est_s"]) + 15


def peer_files_wanted(modes, name):
    """Whether model ``name``'s run compares a few files of ours with vLLM's (both dump
    modes asked for, and vLLM serves the model)."""
    return "dump" in modes and "vllm_dump" in modes and not peer.unsupported(name)


def print_plan(plan):
    print(f"profile {plan['profile']}: modes {plan['modes']}, ~{plan['cell_tokens']} prompt tokens "
          f"per cell, >= {plan['min_rounds']} request(s) per client; writer threads "
          f"{plan['writer_threads']}; deadline {plan['deadline_s']} s")
    if plan.get("gen_tokens"):
        print(f"generate cells: {plan['gen_tokens']} tokens per request (ignore_eos, greedy), decode in "
              f"CUDA graphs on every server; ~{PROFILES[plan['profile']]['gen_cell_tokens']} generated "
              f"tokens per cell unless --gen-requests")
    for ph in plan["phases"]:
        print(f"\n[ceilings] ~{ph['est_s']} s: pinned D2H 1 GiB; /dev/shm safetensors writes and "
              f"the writer alone, {plan['ceiling_mib']} MiB per size, sizes "
              f"{[f'{s / (1 << 20):.1f} MiB' for s in ph['file_sizes']]}")
    for name, m in plan["models"].items():
        vllm = sum(servers.api_of(w) == "vllm" for w in m["servers"])
        print(f"\n[{name}] ~{m['est_s']} s (start-up assumed {MODELS[name].est_startup_s} s"
              + (f" + {vllm} x {EST_VLLM_STARTUP_S} s for vLLM's" if vllm else "")
              + (f", the model's build {m['build_s']} s" if m.get("build_s") else "") + ")")
        if m.get("store"):
            st = m["store"]
            print(f"  store: mooncake_master --port {st['master_port']} (metrics {st['master_port'] + 1}); a store "
                  f"node lending {st['segment_bytes'] / (1 << 30):.1f} GiB (testing/store.py's StoreNode); "
                  f"server S lends none; each cell's samples deleted after it")
        for which, cmd in m["servers"].items():
            print(f"  server {which}: {shlex.join(cmd)}")
        if m.get("peer_unsupported"):
            print(f"  no vLLM cells: {m['peer_unsupported']}")
        print(f"  {'mode':20} {'prompt':>6} {'conc':>4} {'reqs':>5} {'tokens':>8} {'dump GiB':>8} {'est s':>6}")
        for c in m["cells"]:
            gib = f"{c['dump_bytes'] / (1 << 30):.1f}" if "dump_bytes" in c else ""
            mode = c["mode"] + (f" #{c['rep']}" if "rep" in c else "")
            print(f"  {mode:20} {c['prompt_len']:6} {c['concurrency']:4} {c['requests']:5} "
                  f"{c['prompt_tokens']:8} {gib:>8} {c['est_s']:6}")
    print(f"\nestimated total: ~{plan['est_total_s']} s (throughputs and start-up times are "
          f"assumptions; the deadline skips what does not fit)")
