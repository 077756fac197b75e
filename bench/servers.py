"""The servers of one model's run: which kind serves which mode, their command lines,
dump directories and environment, and their start and stop.

Every kind of server is one entry of ``KINDS``; all share the flags of
testing/server.py's ``base_command`` (what the GPU suite verified) plus
``--skip-tokenizer-init --disable-radix-cache --cuda-graph-max-bs 32 --log-level info``
and the run's options, and differ only in their last flags:

- A: plain; plus ``--enable-return-hidden-states`` while it also serves ``json``.
  Serves ``nodump`` and (``--json-server shared``) ``json``.
- B: plus the dump flags (``--dump-hidden-states-dir <dump root>/kimi-bench-<model>``).
  Serves ``dump`` and ``dump_early``.
- C: plus ``--enable-return-hidden-states``; serves ``json`` with ``--json-server separate``.
- D: B's flags plus ``--dump-hidden-states-dtype fp8`` (the dtype is per server); serves
  ``dump_fp8``.
- V and W: the peer, vLLM (``bench.peer``: its own command line and environment, the same
  model files). V serves ``vllm_nodump``; W, with vLLM's extract_hidden_states and its
  example connector writing into ``<dump root>/kimi-bench-<model>-vllm``, ``vllm_dump``.

SGLang 0.5.17 captures hidden states (mode FULL) on every forward of a server started
with --enable-return-hidden-states, whether a request asks for them or not
(ForwardBatch.init_new: "capture the server's configured maximum"), so a shared A does
slightly more than a plain server for (a); --json-server separate measures (a) on a plain
server at the cost of a third start-up.

Starting, waiting and stopping is testing/server.py's launcher (``launch``,
``Server.wait_until``/``wait_healthy``, ``stop_all``), the one the GPU suite uses.

Adding a kind of server (as V and W were, issue 23) is: a ``Kind`` whose ``command``
builds its argv (the launcher only needs ``--port`` and ``/health``) and whose ``env``
gives its environment, the next ``--ports`` entry, its mode in ``bench/modes.py``
(``dumps=True`` if it dumps), and in ``loadgen`` the request
that mode sends and where its file is found (``api``).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, List, Optional

from bench import modes, peer
from bench.models import MODELS, model_path
from testing import server as launcher  # one launcher for the GPU suite and the benchmark


def sglang_command(args, name, which, extra):
    """SGLang's argv for server ``which`` of model ``name``: the shared flags, the run's
    options, then ``extra`` (what makes the kind)."""
    cmd = launcher.base_command(args.server_module, model_path(args, name), port_of(args, which),
                                args.mem_fraction_static, python=sys.executable)
    cmd += ["--skip-tokenizer-init", "--disable-radix-cache", *launcher.cuda_graph_max_bs_flags(32),
            "--log-level", "info"]
    if not args.cuda_graph:
        # max_new_tokens=1: no decode step runs, and the dump turns the prefill graph off
        # anyway; skipping capture saves start-up time and keeps A and B alike.
        cmd += ["--disable-prefill-cuda-graph", "--disable-decode-cuda-graph"]
    if args.chunked_prefill_size:
        cmd += ["--chunked-prefill-size", str(args.chunked_prefill_size)]
    if args.sleep_on_idle:
        cmd += ["--sleep-on-idle"]
    if args.max_total_tokens:
        cmd += ["--max-total-tokens", str(args.max_total_tokens)]
    return cmd + extra


def _dump(args, name, which, dtype=None):
    return launcher.dump_flags(dump_dir(args, name, which), MODELS[name]["layers_flag"],
                               args.max_host_mb or None, dtype)


def _a_flags(args, name, which):
    json_on_a = "json" in args.modes.split(",") and server_for(args, "json") == "A"
    return ["--enable-return-hidden-states"] if json_on_a else []


def vllm_command(args, name, which, extra):
    """vLLM's argv for server ``which`` of model ``name`` (``bench.peer``)."""
    return peer.vllm_command(args, name, port_of(args, which), extra)


@dataclass(frozen=True)
class Kind:
    """One kind of server. ``port_index``: its entry of ``--ports``; ``flags(args, name,
    which)``: what follows the shared flags; ``dump_suffix``: its dump directory is
    ``<dump root>/kimi-bench-<model><suffix>`` (None: it does not dump); ``command``: the
    whole argv (SGLang's by default); ``api``: "sglang" (``/generate``) or "vllm"
    (``/v1/completions``, ``bench.peer``); ``env``: its extra environment, when it is not
    ours (ours: ``server_env``)."""

    port_index: int
    flags: Callable[..., List[str]]
    dump_suffix: Optional[str] = None
    command: Callable[..., List[str]] = sglang_command
    api: str = "sglang"
    env: Optional[Callable[[], dict]] = None


KINDS = {
    "A": Kind(0, _a_flags),
    "B": Kind(1, lambda args, name, which: _dump(args, name, which), dump_suffix=""),
    "C": Kind(2, lambda args, name, which: ["--enable-return-hidden-states"]),
    "D": Kind(3, lambda args, name, which: _dump(args, name, which, "fp8"), dump_suffix="-fp8"),
    "V": Kind(4, lambda args, name, which: [], command=vllm_command, api="vllm", env=peer.vllm_env),
    "W": Kind(5, lambda args, name, which: peer.dump_flags(name, dump_dir(args, name, which)),
              dump_suffix="-vllm", command=vllm_command, api="vllm", env=peer.vllm_env),
}

# the server of each mode (json: A, or C with --json-server separate)
MODE_SERVER = {m.name: m.server for m in modes.MODES}


def server_for(args, mode):
    """The kind (``KINDS`` key) that serves ``mode`` in this run."""
    if mode == "json" and args.json_server == "separate":
        return "C"
    return MODE_SERVER.get(mode, "A")


def port_of(args, which):
    return args.ports[KINDS[which].port_index]


def ports_problem(args, modes):
    """Why ``--ports`` is too short for the servers of ``modes`` (an error message), or None."""
    words = ["first", "second", "third", "fourth", "fifth", "sixth"]
    counts = ["one", "two", "three", "four", "five", "six"]
    for mode in modes:
        which = server_for(args, mode)
        i = KINDS[which].port_index
        if i >= len(args.ports):
            return (f"mode {mode} runs on a {words[i]} server ({which}): --ports needs "
                    f"{counts[i]} ports")
    return None


def server_cmd(args, name, which):
    """The command line of server ``which`` of model ``name``; under ``taskset -c CPUS``
    where ``--server-cpus`` gives that server CPUs (its processes inherit them: the
    scheduler, the front end, the dump's writer process)."""
    kind = KINDS[which]
    cmd = kind.command(args, name, which, kind.flags(args, name, which))
    cpus = args.server_cpus.get(which)
    return ["taskset", "-c", cpus, *cmd] if cpus else cmd


def dumps(which):
    """Whether server ``which`` writes dump files."""
    return KINDS[which].dump_suffix is not None


def dump_dir(args, name, which="B"):
    """Server ``which``'s dump directory (B's by default; D's ends in -fp8)."""
    return os.path.join(args.dump_root, f"kimi-bench-{name}{KINDS[which].dump_suffix}")


def api_of(which):
    """How server ``which`` is asked: "sglang" or "vllm" (``Kind.api``)."""
    return KINDS[which].api


def server_env(which, trace_path):
    """Extra environment of a server: a kind's own (vLLM's: ``peer.vllm_env``); else a
    dumping one of ours logs the writer's counters every 5 s (so the log holds its
    host-memory peaks without waiting a minute) and, with ``trace_path``, writes stage
    timestamps there (sglang_ext/trace.py)."""
    if KINDS[which].env:
        return KINDS[which].env()
    if not dumps(which):
        return None
    env = {"KIMI_SGLANG_STATS_INTERVAL_S": "5"}
    if trace_path:
        env["KIMI_SGLANG_TRACE"] = trace_path
    return env


# The log line of a server that has begun loading its weights: the next server may start.
# Its import and start-up (30-80 s of CPU work on the H200 host: SGLang's tokenizer manager
# and scheduler, vLLM's API server and engine core) then overlap this one's GPU phase, which
# ends seconds later (SGLang: weights ~4 s, then "KV Cache is allocated"; vLLM: weights,
# ~12 s of memory profiling, "init engine ... took"), long before the next one takes its
# own memory snapshot. Waiting for the KV cache instead ran the four start-ups end to end:
# 340-386 s of a 600 s call (bench/README.md). SGLang: model_runner.py "Load weight begin";
# vLLM 0.33: v1/worker/gpu/model_runner.py "Loading model from scratch"; the later lines
# (and /health) as before, for servers that print neither.
READY_FOR_NEXT = re.compile(r"Load weight begin|Loading model from scratch"
                            r"|KV [Cc]ache (is )?allocated|Memory pool end|Uvicorn running|fired up"
                            r"|init engine \(profile, create kv cache")


# With vLLM's servers beside ours the GPU holds up to four model copies: the servers'
# fractions of its memory (SGLang's --mem-fraction-static, vLLM's
# --gpu-memory-utilization) must leave room for SGLang's activations and both CUDA contexts.
MAX_MEMORY_SHARE = 0.9


def memory_problem(args, modes):
    """Why the servers of ``modes`` would not fit on one GPU together (an error message),
    or None; checked when vLLM's servers are among them."""
    kinds = sorted({server_for(args, m) for m in modes})
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


# Each server's KV pool in tokens, from its log: SGLang (model_runner: "KV Cache is
# allocated. dtype: ..., #tokens: N") and vLLM 0.33 (v1/core/kv_cache_utils.py: "GPU KV
# cache size: N tokens"). SGLang sizes it from the memory free when the server starts, so a
# server started after another gets less at the same --mem-fraction-static.
KV_TOKENS = re.compile(r"KV Cache is allocated\..*#tokens: (\d+)|GPU KV cache size: ([\d,]+) tokens")


def kv_tokens(log_text):
    """The KV pool (tokens) a server's log states, or None."""
    m = KV_TOKENS.search(log_text)
    return int((m.group(1) or m.group(2)).replace(",", "")) if m else None


def start_pair(specs, started, timeout):
    """Start the servers of ``specs`` (``{which: (cmd, log_path, env)}``, in order) one
    after another, each once the one before has begun loading its weights
    (``READY_FOR_NEXT``, or it answers /health), so that their memory profiling does not
    race while their imports overlap; then wait for all.
    ``started`` (a dict) gets each ``launcher.Server`` as it is launched, so the caller
    can stop them whatever happens. A server that dies while another starts is retried
    once alone."""
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
