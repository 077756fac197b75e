"""The servers of one model's run: which kind serves which mode, their command lines,
dump directories and environment, their start and stop (testing/server.py's launcher, the
GPU suite's). Every kind is one entry of ``KINDS``: ours share testing/server.py's
``base_command``, no radix cache, no CUDA graphs (``max_new_tokens=1`` runs no decode; with
a generate mode in ``--modes`` decode runs in SGLang's CUDA graphs, as served) and
the model's ``server_flags``, and differ only in their last flags: A plain (plus
``--enable-return-hidden-states`` when ``json`` runs), B the dump flags, D B's plus fp8, S
the store's ``mooncake://`` address instead of a directory. V and W are vLLM's (``peer``).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, List, Optional

from bench import modes, peer
from bench import store as bench_store
from bench.models import MODELS, model_path
from testing import server as launcher  # one launcher for the GPU suite and the benchmark


def sglang_command(args, name, which, extra):
    """SGLang's argv for server ``which`` of model ``name``: the shared flags, the run's
    options, the model's ``server_flags``, then ``extra`` (what makes the kind)."""
    cmd = launcher.base_command(args.server_module, model_path(args, name), port_of(args, which),
                                args.mem_fraction_static, python=sys.executable)
    cmd += ["--skip-tokenizer-init", "--disable-radix-cache", *launcher.cuda_graph_max_bs_flags(32),
            "--log-level", "info", "--disable-prefill-cuda-graph"]
    if not any(modes.is_gen(m) for m in args.modes.split(",")):  # generate cells decode in CUDA graphs
        cmd.append("--disable-decode-cuda-graph")
    return cmd + list(MODELS[name].server_flags) + extra


def _dump(args, name, which, dtype=None):
    return launcher.dump_flags(dump_dir(args, name, which), MODELS[name].layers_flag,
                               args.max_host_mb or None, dtype)


def _store_flags(args, name, which):
    return launcher.dump_flags(bench_store.server_url(args.mooncake_port), MODELS[name].layers_flag,
                               args.max_host_mb or None)


def _a_flags(args, name, which):
    return ["--enable-return-hidden-states"] if "json" in args.modes.split(",") else []


def vllm_command(args, name, which, extra):
    """vLLM's argv for server ``which`` of model ``name`` (``bench.peer``)."""
    return peer.vllm_command(args, name, port_of(args, which), extra)


@dataclass(frozen=True)
class Kind:
    """``port_index``: its entry of ``--ports``; ``flags(args, name, which)``: what follows
    the shared flags; ``dump_suffix``: its dump directory is ``<dump root>/kimi-bench-<model>
    <suffix>`` (None: none); ``command``: the whole argv; ``api``: "sglang" or "vllm";
    ``env``: its environment when not ours (``server_env``); ``store``: it dumps into the
    run's Mooncake Store."""

    port_index: int
    flags: Callable[..., List[str]]
    dump_suffix: Optional[str] = None
    command: Callable[..., List[str]] = sglang_command
    api: str = "sglang"
    env: Optional[Callable[[], dict]] = None
    store: bool = False


KINDS = {
    "A": Kind(0, _a_flags),
    "B": Kind(1, lambda args, name, which: _dump(args, name, which), dump_suffix=""),
    "D": Kind(2, lambda args, name, which: _dump(args, name, which, "fp8"), dump_suffix="-fp8"),
    "V": Kind(3, lambda args, name, which: [], command=vllm_command, api="vllm", env=peer.vllm_env),
    "W": Kind(4, lambda args, name, which: peer.dump_flags(name, dump_dir(args, name, which)),
              dump_suffix="-vllm", command=vllm_command, api="vllm", env=peer.vllm_env),
    "S": Kind(5, _store_flags, store=True),
}

MODE_SERVER = {m.name: m.server for m in modes.MODES}


def server_for(args, mode):
    """The kind (``KINDS`` key) that serves ``mode``."""
    return MODE_SERVER.get(mode, "A")


def servers_of(args, mode):
    """Every kind ``mode``'s cells ask: its server, then gen_two_pass's capturing one."""
    capture = modes.BY_NAME[mode].capture if mode in modes.BY_NAME else ""
    return (server_for(args, mode),) + ((capture,) if capture else ())


def port_of(args, which):
    return args.ports[KINDS[which].port_index]


def ports_problem(args, modes):
    """Why ``--ports`` is too short for the servers of ``modes`` (an error message), or None."""
    words = ["first", "second", "third", "fourth", "fifth", "sixth"]
    counts = ["one", "two", "three", "four", "five", "six"]
    for mode in modes:
        for which in servers_of(args, mode):
            i = KINDS[which].port_index
            if i >= len(args.ports):
                return (f"mode {mode} runs on a {words[i]} server ({which}): --ports needs "
                        f"{counts[i]} ports")
    return None


def server_cmd(args, name, which):
    """The command line of server ``which`` of model ``name``."""
    kind = KINDS[which]
    return kind.command(args, name, which, kind.flags(args, name, which))


def dumps(which):
    """Whether server ``which`` writes dump files."""
    return KINDS[which].dump_suffix is not None


def stores(which):
    """Whether server ``which`` dumps into the run's Mooncake Store."""
    return KINDS[which].store


def dump_dir(args, name, which="B"):
    """Server ``which``'s dump directory (B's by default; D's ends in -fp8)."""
    return os.path.join(args.dump_root, f"kimi-bench-{name}{KINDS[which].dump_suffix}")


def api_of(which):
    """How server ``which`` is asked: "sglang" or "vllm" (``Kind.api``)."""
    return KINDS[which].api


def server_env(which, trace_path):
    """Extra environment of a server: a kind's own (vLLM's: ``peer.vllm_env``); else a
    dumping one of ours (files or store) logs the writer's counters every 5 s (so the log holds its
    host-memory peaks without waiting a minute) and, with ``trace_path``, writes stage
    timestamps there (sglang_ext/trace.py)."""
    if KINDS[which].env:
        return KINDS[which].env()
    if not dumps(which) and not stores(which):
        return None
    env = {"KIMI_SGLANG_STATS_INTERVAL_S": "5"}
    if trace_path:
        env["KIMI_SGLANG_TRACE"] = trace_path
    return env


# A server's log line once it loads its weights: the next may start, its import (30-80 s of
# CPU) overlapping this one's GPU phase. SGLang: model_runner.py "Load weight begin"; vLLM
# 0.33: v1/worker/gpu/model_runner.py "Loading model from scratch"; later lines (and /health)
# for servers that print neither.
READY_FOR_NEXT = re.compile(r"Load weight begin|Loading model from scratch"
                            r"|KV [Cc]ache (is )?allocated|Memory pool end|Uvicorn running|fired up"
                            r"|init engine \(profile, create kv cache")


# Up to four servers on one GPU: their shares (--mem-fraction-static, vLLM's
# --gpu-memory-utilization) leave room for SGLang's activations and both CUDA contexts.
MAX_MEMORY_SHARE = 0.9


def memory_problem(args, modes):
    """Why the servers of ``modes`` would not fit on one GPU together (an error message),
    or None; checked when vLLM's servers are among them."""
    kinds = sorted({w for m in modes for w in servers_of(args, m)})
    if not any(api_of(w) == "vllm" for w in kinds):
        return None
    share = {w: peer.gpu_memory_utilization(args) if api_of(w) == "vllm" else args.mem_fraction_static
             for w in kinds}
    total = sum(share.values())
    if total <= MAX_MEMORY_SHARE + 1e-9:
        return None
    return (f"servers {', '.join(kinds)} together would take {total:.2f} of the GPU's memory "
            f"({', '.join(f'{w} {v:g}' for w, v in share.items())}; at most {MAX_MEMORY_SHARE}): "
            f"lower --mem-fraction-static (0.2 fits four servers) or --vllm-gpu-memory-utilization")


# A server's KV pool (tokens) from its log: SGLang's model_runner, vLLM 0.33's
# kv_cache_utils. SGLang sizes it from the memory free at its start: a later server gets less.
KV_TOKENS = re.compile(r"KV Cache is allocated\..*#tokens: (\d+)|GPU KV cache size: ([\d,]+) tokens")


def kv_tokens(log_text):
    """The KV pool (tokens) a server's log states, or None."""
    m = KV_TOKENS.search(log_text)
    return int((m.group(1) or m.group(2)).replace(",", "")) if m else None


def start_pair(specs, started, timeout):
    """Start the servers of ``specs`` (``{which: (cmd, log_path, env)}``, in order), each once
    the one before loads its weights (``READY_FOR_NEXT`` or /health: their imports overlap,
    their memory profiling does not race), then wait for all. ``started`` gets each
    ``launcher.Server`` as it is launched (the caller stops them whatever happens). A
    server that dies while another starts is retried once alone."""
    order = list(specs)
    for i, which in enumerate(order):
        s = started[which] = launcher.launch(*specs[which])
        if i + 1 < len(order):
            s.wait_until(lambda s=s: READY_FOR_NEXT.search(s.log_text()) or s.healthy(), timeout)
    for which in order:
        try:
            started[which].wait_healthy(timeout)
        except launcher.ServerExited as e:
            print(f"  server {which} failed ({str(e)[:200]}); retrying it alone", flush=True)
            for other, s in started.items():
                if other != which and s.alive():
                    s.wait_healthy(timeout)
            started[which].stop()  # what its process group left behind
            started[which] = launcher.launch(*specs[which])
            started[which].wait_healthy(timeout)


def stop_all(servers, grace=20):
    """SIGTERM every server's process group at once, SIGKILL what is left after ``grace`` s."""
    launcher.stop_all(servers, grace)
