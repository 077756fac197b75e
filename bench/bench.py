"""Benchmark of the hidden-state dump (issue #7): dump overhead, the JSON path, ceilings.

Runs on a CUDA host where SGLang 0.5.17 with the kimi-sglang series is importable
(``bench/run_bench.sh run`` does the staging, as tests/gpu/run_e2e.sh). Phases:

1. ``ceilings`` (a subprocess, so its CUDA context and pinned memory go away after):
   pinned device-to-host copy GB/s; /dev/shm write GB/s with safetensors ``save_file``
   from the writer's thread count, for files of each dump size of the plan; and the
   writer alone (``sglang_ext.writer.DumpWriter`` with CUDA rows: start / copy_rows /
   submit), GB/s of files.
2. per model (random weights, built by a subprocess): two servers with the same flags,
   started together (the second once the first has sized its KV cache): server A without
   the dump (``--enable-return-hidden-states``) serves mode ``nodump`` (requests without
   the field) and mode ``json`` (``return_hidden_states: true``); server B with
   ``--dump-hidden-states-dir /dev/shm/...`` serves mode ``dump`` (each response waits for
   its file) and mode ``dump_early`` (answered once the file's name is reserved; the
   client waits on the lock while its next prompt runs, as ``sglang-ext extract`` does).
   Mode ``dump_fp8`` runs on a server D, B's flags plus ``--dump-hidden-states-dtype fp8``
   (the dtype is per server), started only when the mode is asked for; its cells report
   bytes per prompt token beside mode ``dump``'s (about half).
   Every cell is a batch of requests with ``max_new_tokens=1`` sent by ``concurrency``
   client threads (closed loop); nodump and dump cells alternate so drift hits both alike.
3. headline ratios and targets (``report.py``), a JSON file and a Markdown table in
   ``--out``, and a short table printed last.

``--dry-run`` prints the plan and needs neither torch nor a GPU. Results are written
after every phase, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures as cf
import datetime
import json
import math
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(REPO))  # sglang_ext, for the ceilings subprocess
sys.path.insert(2, str(REPO / "tests" / "gpu"))  # tiny_models, shared with tests/gpu/e2e.py
import report  # noqa: E402

DEFAULT_WRITER_THREADS = 8  # sglang_ext.config.DEFAULT_WRITER_THREADS
DEFAULT_MAX_HOST_MB = 4096  # sglang_ext.config.DEFAULT_MAX_HOST_MB
DEFAULT_CHUNK = 8192  # SGLang 0.5.17's chunked prefill size on an H200 (gpu_mem 80-160 GB)

# The workloads (random weights). llama-8b: Llama-3.1-8B's shape, what most drafter
# trainers extract from, default dump layers [2, N//2, N-3, N] = 2,16,29,32. llama-mid:
# Llama-2-7B's widths, 8 layers, default layers 2,4,5,8 (a stress case: ~4x 8B's rate).
# DeepseekV3: tests/gpu's tiny MLA + MoE model, with max_position_embeddings raised to
# 16384 for the 8k prompts, all 4 layers dumped (the stress case: up to ~640k tok/s).
MODELS = {
    "llama-8b": {
        "arch": "llama", "hidden_size": 4096, "num_layers": 32, "vocab": 128256,
        "intermediate_size": 14336, "heads": 32, "kv_heads": 8,
        "layers_flag": None, "layer_ids": [2, 16, 29, 32],
        # assumptions for --dry-run time estimates only
        "est_tps": 40_000, "est_json_tps": 700, "est_startup_s": 200,
    },
    "llama-mid": {
        "arch": "llama", "hidden_size": 4096, "num_layers": 8, "vocab": 32000,
        "intermediate_size": 11008, "heads": 32, "kv_heads": 32,
        "layers_flag": None, "layer_ids": [2, 4, 5, 8],
        # assumptions for --dry-run time estimates only
        "est_tps": 80_000, "est_json_tps": 1_300, "est_startup_s": 150,
    },
    "deepseek-tiny": {
        "arch": "deepseek", "hidden_size": 1024, "num_layers": 4, "vocab": 1024,
        "layers_flag": "1,2,3,4", "layer_ids": [1, 2, 3, 4],
        "est_tps": 150_000, "est_json_tps": 5_000, "est_startup_s": 130,
        # its cells at concurrency >= 8 hold 8x the profile's tokens: at 64k tokens (0.1-0.6 s
        # a cell) single stalls dominated them (bench/README.md, Findings); its
        # concurrency-1 cells already last seconds
        "cell_scale": 8,
    },
}

PROFILES = {
    # fits one ~9-minute device call with both models (see bench/README.md)
    "quick": {"cell_tokens": 64 * 1024, "min_rounds": 1, "json_requests": 8,
              "ceiling_mib": 1024, "writer_reps": 2, "deadline_s": 420, "writer_log_wait_s": 0},
    "full": {"cell_tokens": 256 * 1024, "min_rounds": 2, "json_requests": 16,
             "ceiling_mib": 4096, "writer_reps": 3, "deadline_s": 3000, "writer_log_wait_s": 65},
}


# ---- plan ------------------------------------------------------------------------------
def file_bytes(spec, prompt_len, fp8=False):
    """Size of one dump file: hidden_states bf16 [T, L, H] (fp8: float8 [T, L, H] plus
    float32 scales [T, L, 1]) + token_ids int64 [T] + header."""
    slots = len(spec["layer_ids"])
    per_token = slots * spec["hidden_size"] + 4 * slots if fp8 else slots * spec["hidden_size"] * 2
    return prompt_len * (per_token + 8) + 1024


def cell_requests(prompt_len, concurrency, cell_tokens, min_rounds):
    """Requests of one cell: about ``cell_tokens`` prompt tokens, at least ``min_rounds``
    requests per client thread."""
    return max(math.ceil(cell_tokens / prompt_len), concurrency * min_rounds, 1)


def make_plan(args):
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
            "max_host_mb": args.max_host_mb or DEFAULT_MAX_HOST_MB}
    est_total = 0.0
    if not args.skip_ceilings:
        sizes = sorted({file_bytes(MODELS[m], p) for m in models for p in args.prompt_lens})
        plan["phases"].append({"phase": "ceilings", "file_sizes": sizes, "est_s": 25})
        est_total += 25
    for name in models:
        spec = MODELS[name]
        cells = []
        # the headline cells (2k, conc 8: nodump, dump, JSON) first, so that a run cut
        # short by the deadline still has them; then the rest, nodump and dump alternating
        grid = [(p, c) for p in args.prompt_lens for c in args.concurrency]
        head = (report.JSON_PROMPT_LEN, report.JSON_CONCURRENCY)
        grid.sort(key=lambda pc: pc != head)
        for plen, conc in grid:
            scale = 1 if args.cell_tokens or conc < 8 else spec.get("cell_scale", 1)
            n = cell_requests(plen, conc, cell_tokens * scale, min_rounds)
            for rep in range(args.repeat):
                for mode in ("nodump", "dump", "dump_early", "dump_fp8", "nodump_noise"):
                    if mode in modes:
                        cells.append({"mode": mode, "prompt_len": plen, "concurrency": conc,
                                      "requests": n, "prompt_tokens": n * plen}
                                     | ({"rep": rep} if args.repeat > 1 else {}))
            if (plen, conc) == head and "json" in modes:
                cells.append({"mode": "json", "prompt_len": plen, "concurrency": conc,
                              "requests": json_requests, "prompt_tokens": json_requests * plen})
        if "json" in modes and head not in grid:
            plen, conc = head
            cells.append({"mode": "json", "prompt_len": plen, "concurrency": conc,
                          "requests": json_requests, "prompt_tokens": json_requests * plen})
        for c in cells:
            tps = spec["est_json_tps"] if c["mode"] == "json" else spec["est_tps"]
            c["est_s"] = round(c["prompt_tokens"] / tps + c["requests"] * 0.004 / c["concurrency"] + 0.5, 1)
            if c["mode"] in report.DUMP_MODES:
                c["dump_bytes"] = c["requests"] * file_bytes(spec, c["prompt_len"], c["mode"] == "dump_fp8")
        servers = {}
        for which in sorted({server_for(args, c["mode"]) for c in cells}):
            servers[which] = server_cmd(args, name, which)
        est = spec["est_startup_s"] + 20 + sum(c["est_s"] for c in cells) + 10
        est_total += est
        plan["models"][name] = {"servers": servers, "cells": cells, "est_s": round(est)}
    plan["est_total_s"] = round(est_total)
    return plan


def noise_rate(cells, cell, args):
    """Bytes/s the noise process of a ``nodump_noise`` cell aims at: ``--noise-gbps`` if
    given; else what a dump running at no-dump speed would write: the dump cell's file
    bytes per prompt token (same shape and round) x the no-dump cell's prompt tokens/s.
    (The dump cell's own GB/s would be lower by its slowdown: at that rate the noise would
    write fewer bytes per token than the dump.) 0 (as fast as it can) when either cell is
    missing."""
    if args.noise_gbps:
        return args.noise_gbps * 1e9
    shape = (cell["prompt_len"], cell["concurrency"], cell.get("rep"))
    b, a = report.find_cell(cells, "dump", *shape), report.find_cell(cells, "nodump", *shape)
    if not (b and a and b.get("file_bytes") and b.get("prompt_tokens") and a.get("prefill_tps")):
        return 0.0
    return b["file_bytes"] / b["prompt_tokens"] * a["prefill_tps"]


def writer_threads():
    return int(os.environ.get("KIMI_SGLANG_WRITER_THREADS", DEFAULT_WRITER_THREADS))


def model_path(args, name):
    return os.path.join(args.workdir, name)


def dump_dir(args, name, which="B"):
    """Server B's dump directory, or server D's (fp8)."""
    return os.path.join(args.dump_root, f"kimi-bench-{name}" + ("-fp8" if which == "D" else ""))


def server_cmd(args, name, which):
    """The server command line; A, B (C, D) differ only in the last flags."""
    spec = MODELS[name]
    cmd = [sys.executable, "-m", args.server_module, "--model-path", model_path(args, name),
           "--skip-tokenizer-init", "--attention-backend", "triton",
           "--sampling-backend", "pytorch", "--port", str(args.ports["ABCD".index(which)]),
           "--mem-fraction-static", str(args.mem_fraction_static), "--disable-radix-cache",
           "--cuda-graph-max-bs", "32", "--log-level", "info"]
    if not args.cuda_graph:
        # max_new_tokens=1: no decode step runs, and the dump turns the prefill graph off
        # anyway; skipping capture saves start-up time and keeps A and B alike.
        cmd += ["--disable-prefill-cuda-graph", "--disable-decode-cuda-graph"]
    if args.chunked_prefill_size:
        cmd += ["--chunked-prefill-size", str(args.chunked_prefill_size)]
    if args.sleep_on_idle:
        cmd += ["--sleep-on-idle"]
    if which == "C" or (which == "A" and server_for(args, "json") == "A"
                        and "json" in args.modes.split(",")):
        cmd += ["--enable-return-hidden-states"]
    elif which in "BD":
        cmd += ["--dump-hidden-states-dir", dump_dir(args, name, which)]
        if spec["layers_flag"]:
            cmd += ["--dump-hidden-states-layers", spec["layers_flag"]]
        if args.max_host_mb:
            cmd += ["--dump-hidden-states-max-host-mb", str(args.max_host_mb)]
        if which == "D":
            cmd += ["--dump-hidden-states-dtype", "fp8"]
    return cmd


def server_env(which, trace_path):
    """Extra environment of a server: B logs the writer's counters every 5 s (so the log
    holds its host-memory peaks without waiting a minute) and, with ``trace_path``,
    writes stage timestamps there (sglang_ext/trace.py)."""
    if which not in "BD":
        return None
    env = {"KIMI_SGLANG_STATS_INTERVAL_S": "5"}
    if trace_path:
        env["KIMI_SGLANG_TRACE"] = trace_path
    return env


def server_for(args, mode):
    """A: nodump (and json unless --json-server separate); B: dump; C: json, separately;
    D: dump_fp8.

    SGLang 0.5.17 captures hidden states (mode FULL) on every forward of a server started
    with --enable-return-hidden-states, whether a request asks for them or not
    (ForwardBatch.init_new: "capture the server's configured maximum"), so a shared A
    does slightly more than a plain server for (a); --json-server separate measures (a)
    on a plain server at the cost of a third start-up."""
    if mode == "dump_fp8":
        return "D"
    if mode in report.DUMP_MODES:
        return "B"
    if mode == "json" and args.json_server == "separate":
        return "C"
    return "A"


def print_plan(plan):
    print(f"profile {plan['profile']}: modes {plan['modes']}, ~{plan['cell_tokens']} prompt tokens "
          f"per cell, >= {plan['min_rounds']} request(s) per client; writer threads "
          f"{plan['writer_threads']}; deadline {plan['deadline_s']} s")
    for ph in plan["phases"]:
        print(f"\n[ceilings] ~{ph['est_s']} s: pinned D2H 1 GiB; /dev/shm safetensors writes and "
              f"the writer alone, {plan['ceiling_mib']} MiB per size, sizes "
              f"{[f'{s / (1 << 20):.1f} MiB' for s in ph['file_sizes']]}")
    for name, m in plan["models"].items():
        print(f"\n[{name}] ~{m['est_s']} s (start-up assumed {MODELS[name]['est_startup_s']} s)")
        for which, cmd in m["servers"].items():
            print(f"  server {which}: {' '.join(cmd)}")
        print(f"  {'mode':16} {'prompt':>6} {'conc':>4} {'reqs':>5} {'tokens':>8} {'dump GiB':>8} {'est s':>6}")
        for c in m["cells"]:
            gib = f"{c['dump_bytes'] / (1 << 30):.1f}" if "dump_bytes" in c else ""
            mode = c["mode"] + (f" #{c['rep']}" if "rep" in c else "")
            print(f"  {mode:16} {c['prompt_len']:6} {c['concurrency']:4} {c['requests']:5} "
                  f"{c['prompt_tokens']:8} {gib:>8} {c['est_s']:6}")
    print(f"\nestimated total: ~{plan['est_total_s']} s (throughputs and start-up times are "
          f"assumptions; the deadline skips what does not fit)")


# ---- helpers ---------------------------------------------------------------------------
class Clock:
    def __init__(self, deadline_s):
        self.t0 = time.monotonic()
        self.deadline_s = deadline_s

    def left(self):
        return self.deadline_s - (time.monotonic() - self.t0)

    def elapsed(self):
        return time.monotonic() - self.t0


def safetensors_header(path):
    """(tensor shapes/dtypes, metadata) of a safetensors file, read without torch."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", {})
    return {k: {"shape": v["shape"], "dtype": v["dtype"]} for k, v in header.items()}, meta


def gpu_name():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        return out.splitlines()[0] if out else "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


def short_gpu(name):
    """'NVIDIA H200' -> 'h200' (for file names)."""
    m = re.search(r"GB200|B200|H200|H100|H20|A100|L40S?|RTX PRO 6000", name)
    return re.sub(r"[^a-z0-9]+", "", (m.group(0) if m else name).lower()) or "gpu"


def versions():
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for pkg in ("sglang", "torch", "transformers", "safetensors", "sglang-ext"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


# ---- servers -----------------------------------------------------------------------------
READY_FOR_NEXT = re.compile(r"KV [Cc]ache (is )?allocated|Memory pool end|Uvicorn running|fired up")


class Server:
    def __init__(self, name, which, cmd, log_path, env=None):
        self.name, self.which, self.cmd, self.log_path = name, which, cmd, log_path
        self.env = env
        self.port = int(cmd[cmd.index("--port") + 1])
        self.proc = None
        self.t_start = None
        self.startup_s = None

    def start(self):
        self.log = open(self.log_path, "w")
        self.t_start = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     env=None if self.env is None else os.environ | self.env)

    def log_text(self):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def healthy(self):
        import requests

        try:
            return requests.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def wait(self, until, timeout):
        """Wait for ``until()``; raises if the process exits or time runs out."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                tail = self.log_text()[-1500:]
                raise RuntimeError(f"server {self.which} exited with {self.proc.returncode}: ...{tail}")
            if until():
                return
            time.sleep(0.5)
        raise TimeoutError(f"server {self.which} not ready after {timeout:.0f} s")

    def wait_healthy(self, timeout):
        self.wait(self.healthy, timeout)
        if self.startup_s is None:
            self.startup_s = round(time.monotonic() - self.t_start, 1)


def stop_all(servers, grace=20):
    """SIGTERM every server's process group at once, SIGKILL what is left after ``grace`` s."""
    live = [s for s in servers if s.proc is not None and s.proc.poll() is None]
    for s in live:
        try:
            os.killpg(s.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for s in live:
        try:
            s.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(s.proc.pid, signal.SIGKILL)  # stragglers in the group, if any
        except ProcessLookupError:
            pass
        s.proc.wait()


def start_pair(servers, timeout):
    """Start the servers one after another, each once the one before has sized its KV
    cache (its log says so, or it answers /health), so their memory profiling does not
    race; then wait for all. A server that dies while another starts is retried once
    alone."""
    for i, s in enumerate(servers):
        s.start()
        if i + 1 < len(servers):
            s.wait(lambda s=s: READY_FOR_NEXT.search(s.log_text()) or s.healthy(), timeout)
    for s in servers:
        try:
            s.wait_healthy(timeout)
        except RuntimeError as e:
            print(f"  server {s.which} failed ({str(e)[:200]}); retrying it alone", flush=True)
            for other in servers:
                if other is not s and other.proc.poll() is None:
                    other.wait_healthy(timeout)
            s.startup_s = None
            s.start()
            s.wait_healthy(timeout)


# ---- client ---------------------------------------------------------------------------------
_local = threading.local()


def _session():
    import requests

    if not hasattr(_local, "s"):
        _local.s = requests.Session()
    return _local.s


def make_prompts(rng, n, length, vocab):
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def send_batch(port, prompts, concurrency, return_hidden_states=False, early=False, timeout=600):
    """Send all prompts with ``concurrency`` client threads; returns (wall_s, results),
    results per request: (latency_s, status, response bytes, content or None).

    ``early`` (mode dump_early): each request asks to be answered before its file is
    complete (``format.WAIT_PARAM``), as ``sglang_ext.client`` does; a thread waits for
    its previous file's lock after sending its next prompt (one file pending per
    thread), and the wall time ends when every file is complete."""
    from sglang_ext import format as fmt

    bodies = []
    for ids in prompts:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        if return_hidden_states:
            body["return_hidden_states"] = True
        if early:
            body["sampling_params"]["custom_params"] = {fmt.WAIT_PARAM: False}
        bodies.append(json.dumps(body).encode())
    slot = threading.local()
    pending = []

    def one(i):
        t = time.perf_counter()
        r = _session().post(f"http://127.0.0.1:{port}/generate", data=bodies[i], timeout=timeout,
                            headers={"Content-Type": "application/json"})
        content = r.content
        lat = time.perf_counter() - t
        if early and r.status_code == 200:
            path = json.loads(content)["meta_info"].get("hidden_states_path")
            prev, slot.prev = getattr(slot, "prev", None), path
            if prev:
                fmt.wait_complete(prev, timeout=timeout)
            if path:
                pending.append(path)
        # JSON responses run to 100s of MB: keep the first (and failures) only
        keep = not return_hidden_states or i == 0 or r.status_code != 200
        return lat, r.status_code, len(content), content if keep else None

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(len(bodies))))
    for path in pending:  # the last file of each thread (the rest return at once)
        fmt.wait_complete(path, timeout=timeout)
    return time.perf_counter() - t0, results


class RssSampler:
    """Peak resident memory (bytes) of a process and its children, sampled every 0.2 s."""

    def __init__(self, pid):
        import psutil

        self.root = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None

    def rss(self):
        import psutil

        total = 0
        try:
            procs = [self.root] + self.root.children(recursive=True)
        except psutil.Error:  # the server is gone
            return 0
        for p in procs:  # PSS: memory shared by processes (the writer's arena) counted once
            try:
                total += p.memory_full_info().pss
            except (psutil.Error, AttributeError):
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
        return total

    def __enter__(self):
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            self._stop.wait(0.2)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def clear_dump_dir(path):
    for entry in os.listdir(path):
        if entry.endswith(".safetensors") or entry == "index.jsonl":
            try:
                os.unlink(os.path.join(path, entry))
            except FileNotFoundError:
                pass


def read_trace(path, offset):
    """KIMI_SGLANG_TRACE lines appended to ``path`` after byte ``offset``."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return []
    out = []
    for x in data.decode(errors="replace").splitlines():
        try:
            out.append(json.loads(x))
        except ValueError:  # a line still being written
            pass
    return out


def trace_size(path):
    try:
        return os.path.getsize(path)
    except (OSError, TypeError):
        return 0


def run_cell(server, cell, spec, rng, mode, trace_path=None):
    prompts = make_prompts(rng, cell["requests"], cell["prompt_len"], spec["vocab"])
    offset = trace_size(trace_path)
    wall, results = send_batch(server.port, prompts, cell["concurrency"],
                               return_hidden_states=(mode == "json"), early=(mode == "dump_early"))
    lat = [r[0] for r in results]
    bad = [r for r in results if r[1] != 200]
    out = {"mode": mode, "prompt_len": cell["prompt_len"], "concurrency": cell["concurrency"],
           "requests": len(prompts)}
    out.update(report.cell_stats(lat, sum(map(len, prompts)), wall))
    if bad:
        out["error"] = f"{len(bad)} of {len(results)} requests failed: HTTP {bad[0][1]} {bad[0][3][:300]!r}"
    if mode in report.DUMP_MODES and not bad:
        paths, errors = [], []
        for r in results:
            meta = json.loads(r[3])["meta_info"]
            if meta.get("hidden_states_path"):
                paths.append(meta["hidden_states_path"])
            else:
                errors.append(meta.get("hidden_states_error", "no hidden_states_path"))
        sizes = [os.stat(p).st_size for p in paths]
        out["file_bytes"] = sum(sizes)
        out["bytes_per_token"] = sum(sizes) / out["prompt_tokens"] if out.get("prompt_tokens") else None
        out["write_gbps"] = sum(sizes) / wall / 1e9
        out["files"] = len(paths)
        if errors:
            out["error"] = f"{len(errors)} requests without a file: {errors[0][:200]}"
        if paths:
            tensors, meta = safetensors_header(paths[0])
            out["file_check"] = {"hidden_states": tensors.get("hidden_states"),
                                 "layer_ids": meta.get("layer_ids")}
            if "hidden_states_scales" in tensors:
                out["file_check"]["hidden_states_scales"] = tensors["hidden_states_scales"]
        if trace_path:
            time.sleep(0.3)  # the writer's trace line follows its lock release
            out["stages"] = report.stage_stats(read_trace(trace_path, offset), wall)
    if mode == "json" and not bad:
        out["response_bytes"] = sum(r[2] for r in results)
        first = json.loads(results[0][3])
        hs = first["meta_info"].get("hidden_states")
        out["json_check"] = describe_nested(hs)
        if hs is None:
            out["error"] = "response carries no meta_info.hidden_states"
    return out


def scheduler_pid(server):
    """The scheduler process of a server (SGLang names it ``sglang::scheduler``)."""
    import psutil

    for p in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if "scheduler" in (p.name() + " ".join(p.cmdline())).lower():
                return p.pid
        except psutil.Error:
            pass
    raise RuntimeError("no scheduler process found")


def raw_samples(raw_text):
    """py-spy ``--format raw`` lines (``thread;frame;...;frame count``) -> ``(frames, count)``
    pairs, ``frames[0]`` being the thread; lines of another shape are skipped."""
    for line in raw_text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            yield stack.split(";"), int(count)


def summarize_py_spy(raw_text, top=15):
    """py-spy ``--format raw --threads`` output (``thread;frame;...;leaf count`` lines) ->
    ``{"samples", "threads": {thread: share}, "top": [[leaf frame, share], ...],
    "ours": {thread: share}}``. Shares are of all samples (py-spy records a thread only
    while it runs, so ``threads`` says which threads were busy, not for how long); ``ours``
    is, per thread, the share of samples with a frame in ``sglang_ext/`` on the stack."""
    threads, leaves, ours, total = {}, {}, {}, 0
    for frames, n in raw_samples(raw_text):
        if len(frames) < 2:  # a thread with no Python frame
            continue
        total += n
        threads[frames[0]] = threads.get(frames[0], 0) + n
        leaves[frames[-1]] = leaves.get(frames[-1], 0) + n
        if any("sglang_ext/" in f for f in frames[1:]):
            ours[frames[0]] = ours.get(frames[0], 0) + n
    if not total:
        return {"samples": 0, "threads": {}, "top": [], "ours": {}}

    def ranked(d):
        return [[k, v / total] for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]

    return {"samples": total, "threads": dict(ranked(threads)), "top": ranked(leaves),
            "ours": dict(ranked(ours))}


PY_SPY_RATE = 100  # samples per second


def gil_window_share(summary, window_s, rate=PY_SPY_RATE):
    """Per thread of a ``--gil`` profile's ``summarize_py_spy`` summary: its samples /
    (rate x window), the share of the sampled window in which it held the GIL."""
    return {t: share * summary["samples"] / (rate * window_s)
            for t, share in summary["threads"].items()}


# A thread waiting to (re)take the GIL, as py-spy --idle --native shows it on the device
# image's Python 3.12: the interpreter's own frames (take_gil, PyEval_RestoreThread,
# Python/ceval_gil.c) are not shown (py-spy folds the python binary's frames into the
# Python ones), but take_gil's wait is: it waits on a condition variable with a timeout
# (PyCOND_TIMEDWAIT -> pthread_cond_timedwait, Python/condvar.h). Python's own locks
# (threading, queue) wait on semaphores instead (sem_clockwait), so this frame means
# the GIL; pybind11's gil_scoped_acquire (torch's C++ code coming back) waits there too.
# Seen on 2026-12-01 at TP=1 (bench/results/2026-12-01-h200-gilwait-si5ms-deepseek.json):
# all 346 such samples sat where a thread takes the GIL back (pybind11 acquire/release,
# THCPEvent_*, Python-level system calls, queue waits). Not checked at TP > 1, where
# c10d/gloo condition-variable waits might be counted too.
GIL_WAIT_FRAMES = ("pthread_cond_timedwait", "take_gil", "PyEval_RestoreThread",
                   "PyEval_AcquireThread", "PyGILState_Ensure")


def summarize_gil_wait(raw_text, top=10):
    """py-spy ``--idle --native --threads --format raw`` output -> per thread its
    samples and ``gil_wait``: the share of them with a GIL-wait frame
    (``GIL_WAIT_FRAMES``) on the stack. With ``--idle`` every thread is sampled whether it
    runs or not, so a thread's shares are of wall time. The scheduler thread is the one
    whose stacks hold ``event_loop`` (SGLang's ``Scheduler.event_loop_*``);
    ``scheduler_wait_top``: the Python frames it waited for the GIL from (innermost
    Python frame of each waiting sample, share of the scheduler's samples)."""
    per, waited_at = {}, {}
    for frames, n in raw_samples(raw_text):
        t = per.setdefault(frames[0], {"samples": 0, "wait": 0, "loop": 0})
        t["samples"] += n
        names = [f.split(" (", 1)[0] for f in frames[1:]]
        if any(name in GIL_WAIT_FRAMES for name in names):
            t["wait"] += n
            py = [f for f in frames[1:] if ".py:" in f]
            key = (frames[0], py[-1] if py else "(no Python frame)")
            waited_at[key] = waited_at.get(key, 0) + n
        if any("event_loop" in name for name in names):  # Scheduler.event_loop_overlap
            t["loop"] += n
    threads = {k: {"samples": v["samples"], "gil_wait": v["wait"] / v["samples"]}
               for k, v in per.items() if v["samples"]}
    out = {"samples": sum(v["samples"] for v in per.values()), "threads": threads}
    sched = max(per, key=lambda k: per[k]["loop"], default=None)
    if sched is not None and per[sched]["loop"]:
        n = per[sched]["samples"]
        out["scheduler_thread"] = sched
        out["scheduler_gil_wait"] = per[sched]["wait"] / n
        out["scheduler_wait_top"] = [[fr, c / n] for (t, fr), c in sorted(
            waited_at.items(), key=lambda kv: -kv[1]) if t == sched][:top]
    return out


def profile_cell(server, cell, spec, rng, out_stem, kind="gil"):
    """Run ``cell`` again while py-spy samples the server's scheduler process (all
    threads, ``PY_SPY_RATE`` Hz, without pausing it, ``--gil``: only the thread holding
    the GIL is recorded; the window also holds ~1 s before the load, to attach, and the
    time to stop); returns ``summarize_py_spy`` of the samples plus ``window_s`` and
    ``gil_window_share`` (per thread: samples / (rate x window), the share of the window
    in which that thread held the GIL), or ``{"error": ...}`` when py-spy is missing or
    may not attach. Why the GIL: every thread of the scheduler process (SGLang's event
    loop, which also launches the forward's kernels, and the writer threads) runs Python
    under one GIL, so what the writer holds the scheduler waits for.

    ``kind="wait"`` samples instead with ``--idle --native`` (blocking: py-spy pauses
    the process for each sample, so the cell runs slower; compare servers A and B under
    the same sampling) and returns ``summarize_gil_wait``: how much of its wall time
    each thread, the scheduler above all, spent waiting for the GIL, which ``--gil``
    cannot see."""
    exe = shutil.which("py-spy")
    if not exe:
        return {"error": "py-spy not on PATH"}
    try:
        pid = scheduler_pid(server)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}
    raw = out_stem + ".txt"
    t0 = time.monotonic()
    how = ["--idle", "--native"] if kind == "wait" else ["--gil", "--nonblocking"]
    proc = subprocess.Popen([exe, "record", "--pid", str(pid), "--rate", str(PY_SPY_RATE),
                             "--format", "raw", "--threads", *how, "--output", raw],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0)  # attach before the load starts
    if proc.poll() is not None:
        return {"error": f"py-spy exited {proc.returncode}: {proc.stdout.read()[-400:]}"}
    r = {}
    try:
        r = run_cell(server, cell, spec, rng, cell["mode"])
    except Exception as e:  # noqa: BLE001 - a failed profile must not end the model's cells
        r = {"error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        window = time.monotonic() - t0
        proc.send_signal(signal.SIGINT)  # py-spy writes its output on Ctrl-C
        try:
            log = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            log = proc.communicate()[0]
    if not os.path.exists(raw):
        return {"error": f"py-spy wrote nothing: {log[-400:]}"}
    with open(raw) as f:
        text = f.read()
    out = summarize_gil_wait(text) if kind == "wait" else summarize_py_spy(text)
    out["window_s"] = window
    out["kind"] = kind
    if kind != "wait":
        out["gil_window_share"] = gil_window_share(out, window)
    out["cell_prefill_tps_sampled"] = r.get("prefill_tps")
    if r.get("error"):
        out["cell_error"] = r["error"]
    out["raw"] = os.path.basename(raw)
    return out


def torch_profile_cell(server, cell, spec, rng, trace_dir, tag, max_requests):
    """Run ``cell`` again (at most ``max_requests`` requests) between SGLang's
    ``/start_profile`` and ``/stop_profile`` (torch profiler, CPU and GPU activity, no
    stacks), then summarize the trace (``torchprof.summarize``: per 1M prompt tokens, the
    scheduler thread's time in and between ATen ops, CUDA API calls, GPU busy time).
    Returns that dict plus ``trace`` (the file) and ``cell_prefill_tps_profiled``, or
    ``{"error": ...}``; a failed profile does not end the model's cells."""
    import gzip

    import requests
    import torchprof

    small = dict(cell, requests=min(cell["requests"], max_requests))
    small["prompt_tokens"] = small["requests"] * cell["prompt_len"]
    shutil.rmtree(trace_dir, ignore_errors=True)
    base = f"http://127.0.0.1:{server.port}"
    try:
        requests.post(f"{base}/start_profile", timeout=120, json={
            "output_dir": trace_dir, "activities": ["CPU", "GPU"], "with_stack": False,
            "record_shapes": False, "profile_id": tag}).raise_for_status()
        try:
            r = run_cell(server, small, spec, rng, cell["mode"])
        finally:
            requests.post(f"{base}/stop_profile", timeout=300).raise_for_status()
        t0 = time.monotonic()
        found = []
        while time.monotonic() - t0 < 120 and not found:
            found = sorted(n for n in (os.listdir(trace_dir) if os.path.isdir(trace_dir) else [])
                           if n.endswith(".trace.json.gz"))
            if not found:
                time.sleep(0.5)
        if not found:
            return {"error": f"no trace in {trace_dir} after 120 s"}
        with gzip.open(os.path.join(trace_dir, found[0]), "rt") as f:
            events = json.load(f).get("traceEvents", [])
        out = torchprof.summarize(events, small["prompt_tokens"])
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:500]}
    out["trace"] = found[0]
    out["requests"] = small["requests"]
    out["cell_prefill_tps_profiled"] = r.get("prefill_tps")
    if r.get("error"):
        out["cell_error"] = r["error"]
    return out


def describe_nested(x):
    """Shape of a nested list (first elements), e.g. [2048, 4096]; None when absent."""
    if x is None:
        return None
    shape = []
    while isinstance(x, list):
        shape.append(len(x))
        if not x:
            break
        x = x[0]
    return shape


def warm_up(server, spec, rng, plens, json_too, concs=(1, 8)):
    """One request, then a burst at every concurrency of the grid, at every prompt length:
    kernels (Triton's fused MoE compiles per batch-size bucket) compiled for the shapes
    before anything is timed."""
    for plen in plens:
        for conc in sorted({1, 8, *concs}):
            send_batch(server.port, make_prompts(rng, conc, plen, spec["vocab"]), conc)
    if json_too:
        send_batch(server.port, make_prompts(rng, 1, 512, spec["vocab"]), 1, return_hidden_states=True)


def wait_writer_log(server, spec, rng, timeout):
    """Send a small dump request every 2 s until the writer logs a new snapshot line (it
    logs after a write at most once a minute), so the log's peak covers every cell."""
    seen = len(re.findall(r"hidden-state dump: \{", server.log_text()))
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        send_batch(server.port, make_prompts(rng, 1, 16, spec["vocab"]), 1)
        if len(re.findall(r"hidden-state dump: \{", server.log_text())) > seen:
            return True
        time.sleep(2)
    return False


def writer_log_peak(text, key="host_bytes_peak"):
    """Max ``key`` over the writer's 'hidden-state dump: {...}' log lines (the budget's
    ``host_bytes_peak``, or ``pinned_pool_peak``: the process's pinned pool)."""
    peaks = []
    for m in re.finditer(r"hidden-state dump: (\{[^}\n]*\})", text):
        try:
            peaks.append(int(ast.literal_eval(m.group(1))[key]))
        except (ValueError, SyntaxError, KeyError):
            pass
    return max(peaks) if peaks else None


# ---- subprocess phases (torch) ---------------------------------------------------------------
def internal_build(name, path):
    import torch

    spec = MODELS[name]
    if os.path.exists(os.path.join(path, "model.safetensors.index.json")) or os.path.exists(
        os.path.join(path, "model.safetensors")
    ):
        print(f"{name}: reusing {path}")
        return
    t0 = time.time()
    if spec["arch"] == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["hidden_size"],
                          intermediate_size=spec["intermediate_size"],
                          num_hidden_layers=spec["num_layers"], num_attention_heads=spec["heads"],
                          num_key_value_heads=spec["kv_heads"], max_position_embeddings=16384)
        cls = LlamaForCausalLM
    else:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        from tiny_models import deepseek_tiny_config  # tests/gpu: e2e.py's model

        cfg = DeepseekV3Config(**deepseek_tiny_config(max_position_embeddings=16384))
        cls = DeepseekV3ForCausalLM
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:  # random init of 1.9 B parameters: seconds on the GPU, a minute on the CPU
        with torch.device(device):
            model = cls(cfg).to(torch.bfloat16)
    except Exception as e:  # noqa: BLE001
        if device == "cpu":
            raise
        print(f"{name}: init on the GPU failed ({type(e).__name__}: {e}); building on the CPU")
        device = "cpu"
        torch.cuda.empty_cache()
        model = cls(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    print(f"{name}: built on {device} in {time.time() - t0:.1f} s -> {path}")


def d2h_ceiling(torch, dev, out):
    """Pinned device-to-host copy of 1 GiB: best and median of 5, GB/s."""
    # 1. pinned device-to-host copy, 1 GiB
    n = 1 << 29  # bf16 elements = 1 GiB
    src = torch.randn(n, dtype=torch.float32, device=dev).to(torch.bfloat16)
    host = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    host.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        host.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    out["d2h_pinned_gbps"] = (n * 2) / min(times) / 1e9
    out["d2h_pinned_gbps_median"] = (n * 2) / sorted(times)[len(times) // 2] / 1e9
    del src, host
    torch.cuda.empty_cache()
    print(f"pinned D2H: {out['d2h_pinned_gbps']:.1f} GB/s", flush=True)


def one_file_rates(d, tensor, threads, files=4):
    """GB/s of writing one file at a time (what a request at concurrency 1 waits for):
    ``"save_file"`` with one thread; ``"pwrite_<threads>"``, the same bytes written by
    ``threads`` threads with ``os.pwrite`` at disjoint offsets of one file (does the file
    system let several threads fill one file at once?); ``"fallocate"``, allocating a
    file's pages ahead (``posix_fallocate``), and ``"prealloc_write"``, one thread's
    ``os.pwrite`` into such a file (what preallocating ahead would leave for the critical
    path; the writer tried it on 2026-12-01, see bench/README.md)."""
    import torch
    from safetensors.torch import save_file

    data = memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())
    n = len(data)
    rates = {}
    t0 = time.perf_counter()
    for i in range(files):
        save_file({"hidden_states": tensor}, os.path.join(d, f"one{i}.safetensors"))
    rates["save_file"] = files * n / (time.perf_counter() - t0) / 1e9
    piece = -(-n // threads)

    def put(fd, off, end):
        while off < end:
            off += os.pwrite(fd, data[off:end], off)

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(threads) as pool:
        for i in range(files):
            fd = os.open(os.path.join(d, f"par{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            list(pool.map(lambda off, fd=fd: put(fd, off, min(off + piece, n)), range(0, n, piece)))
            os.close(fd)
    rates[f"pwrite_{threads}"] = files * n / (time.perf_counter() - t0) / 1e9
    prep = write = 0.0
    for i in range(files):
        fd = os.open(os.path.join(d, f"pre{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        t0 = time.perf_counter()
        os.posix_fallocate(fd, 0, n)
        t1 = time.perf_counter()
        put(fd, 0, n)
        write, prep = write + time.perf_counter() - t1, prep + t1 - t0
        os.close(fd)
    rates["fallocate"] = files * n / prep / 1e9
    rates["prealloc_write"] = files * n / write / 1e9
    for e in os.listdir(d):
        os.unlink(os.path.join(d, e))
    print(f"one file at a time, {n / (1 << 20):.1f} MiB: "
          + ", ".join(f"{k} {v:.2f} GB/s" for k, v in rates.items()), flush=True)
    return rates


def internal_ceilings(part_path, sizes_json, threads, ceiling_mib, reps, max_host_mb, root):
    """Measure the ceilings; writes a JSON dict to ``part_path``. Files go to ``root``
    (--dump-root, /dev/shm by default), where server B's dumps go."""
    import torch
    from safetensors.torch import save_file

    from sglang_ext import format as fmt
    from sglang_ext.writer import DumpWriter

    cuda = torch.cuda.is_available()
    # Without CUDA (a CPU check of this code) the copy ceiling is skipped and the writer
    # gets CPU rows; the numbers then mean nothing.
    dev = torch.device("cuda", 0) if cuda else None
    out = {"writer_threads": threads, "cuda": cuda}
    if cuda:
        d2h_ceiling(torch, dev, out)

    budget = ceiling_mib << 20
    free = shutil.disk_usage(root).free
    budget = min(budget, int(free * 0.4))
    out["shm_free_bytes"] = free

    # 2. /dev/shm write: safetensors save_file from pinned host tensors, `threads` threads
    d = os.path.join(root, "kimi-bench-ceiling")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    out["shm_write_gbps"] = {}
    seen = set()
    for s in json.loads(sizes_json):
        rows, layers, hidden = s["rows"], s["layers"], s["hidden"]
        if round(rows * layers * hidden / (1 << 18)) in seen:  # same size to 1/4 MiB
            continue
        seen.add(round(rows * layers * hidden / (1 << 18)))
        # one source tensor per thread, as the writer's buffers are distinct (one shared
        # source could be served from the CPU's cache and flatter the ceiling)
        srcs = [{"hidden_states": torch.empty((rows, layers, hidden), dtype=torch.bfloat16,
                                              pin_memory=cuda).normal_(),
                 "token_ids": torch.arange(rows, dtype=torch.int64)} for _ in range(threads)]
        size = rows * layers * hidden * 2 + rows * 8
        count = max(2 * threads, math.ceil(budget / size))
        count = min(count, max(threads, int(free * 0.4) // size))

        def save(i, srcs=srcs):
            p = os.path.join(d, f"f{i}.safetensors")
            save_file(srcs[i % len(srcs)], p, metadata={"i": str(i)})
            return os.path.getsize(p)

        best = 0.0
        for _ in range(2):
            t0 = time.perf_counter()
            with cf.ThreadPoolExecutor(threads) as pool:
                total = sum(pool.map(save, range(count)))
            best = max(best, total / (time.perf_counter() - t0) / 1e9)
            for e in os.listdir(d):
                os.unlink(os.path.join(d, e))
        out["shm_write_gbps"][str(total // count)] = best
        print(f"/dev/shm write, {total // count / (1 << 20):.1f} MiB files x {count}, "
              f"{threads} threads: {best:.1f} GB/s", flush=True)
        out.setdefault("shm_one_file_gbps", {})[str(total // count)] = one_file_rates(
            d, srcs[0]["hidden_states"], threads)
        del srcs, save

    # 3. the writer alone: DumpWriter (arena + writer process) with CUDA rows, as the
    # scheduler drives it, one copy per prefill chunk
    out["writer_alone"] = {}
    fd = fmt.open_dump_dir(d)
    for s in json.loads(sizes_json):
        rows, layers, hidden = s["rows"], s["layers"], s["hidden"]
        width = layers * hidden
        gpu_rows = torch.randn((rows, width), dtype=torch.float32, device=dev or "cpu").to(torch.bfloat16)
        ids = list(range(rows))
        size = rows * width * 2 + rows * 8
        count = max(2 * threads, math.ceil(budget / size))
        count = min(count, max(threads, int(free * 0.4) // size))
        writer = DumpWriter(fd, arena_bytes=max_host_mb << 20, threads=threads, device=dev,
                            layer_ids=s["layer_ids"], num_layers=s["num_layers"],
                            stats_interval_s=0, register_atexit=False)
        results = []
        for rep in range(reps):
            before = writer.snapshot()["bytes_written"]
            t0 = time.perf_counter()
            for i in range(count):
                rid = f"w{rep}-{i}"
                p = writer.start(rid, ids, width, torch.bfloat16)
                for c0 in range(0, rows, DEFAULT_CHUNK):  # one copy per prefill chunk
                    n = min(DEFAULT_CHUNK, rows - c0)
                    writer.copy_rows(gpu_rows[c0:c0 + n], [(p, 0, n)], ready=True)
                    if c0 + n < rows:
                        writer.flush()
                writer.finish(p, fmt.reserve(fd, rid))
                writer.flush()
            writer.wait_idle(600)
            wall = time.perf_counter() - t0
            snap = writer.snapshot()
            results.append((snap["bytes_written"] - before) / wall / 1e9)
            clear_dump_dir(d)
        writer.close()
        snap = writer.snapshot()
        out["writer_alone"].setdefault(s["model"], {})[str(s["prompt_len"])] = {
            "gbps": max(results), "gbps_reps": results, "file_bytes": snap["bytes_written"] // max(snap["files_written"], 1),
            "files_per_rep": count, "failures": snap["failures"],
            "host_bytes_peak": snap["host_bytes_peak"], "backpressure_waits": snap["backpressure_waits"],
            "arena_pinned": snap["arena_pinned"],
        }
        print(f"writer alone, {s['model']} {s['prompt_len']}-token files x {count}: "
              f"{max(results):.1f} GB/s (reps {[round(x, 1) for x in results]})", flush=True)
        del gpu_rows
        if cuda:
            torch.cuda.empty_cache()
    os.close(fd)
    shutil.rmtree(d, ignore_errors=True)
    with open(part_path, "w") as f:
        json.dump(out, f)


def parse_cpus(text):
    """``"8-15,20"`` -> {8, ..., 15, 20} (the ``taskset -c`` list syntax); raises ValueError."""
    cpus = set()
    for part in (p for p in text.split(",") if p):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    if not cpus:
        raise ValueError(f"empty CPU list {text!r}")
    return cpus


def internal_noise(spec_json):
    """Mode ``nodump_noise``'s load: another process writing dump-sized files, so that a
    no-dump cell runs beside the page-cache copies of a dump without anything of the dump
    inside the server (no hook, no writer threads in its process, no GIL shared).

    ``spec_json``: {"dir", "rows", "width", "threads", "rate_bps", "cpus", "keep_bytes"}.
    ``threads`` threads each write safetensors files (``save_file``, as the writer does) of
    ``hidden_states`` bf16 [rows, width] and ``token_ids`` int64 [rows] into ``dir``, paced to
    ``rate_bps`` bytes/s together (0: as fast as they can), keeping at most ``keep_bytes``
    of files (the oldest are unlinked), on ``cpus`` if given (a ``taskset -c`` list).
    Prints ``ready`` once the first file is written; on SIGTERM (or when its parent is
    gone) it stops and prints one JSON line {"bytes", "files", "seconds", "gbps",
    "threads_alive"}."""
    import collections

    import torch
    from safetensors.torch import save_file

    sp = json.loads(spec_json)
    if sp.get("cpus"):
        os.sched_setaffinity(0, parse_cpus(sp["cpus"]))  # the threads below inherit it
    stop, first = threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threads, rows, width = sp["threads"], sp["rows"], sp["width"]
    srcs = [{"hidden_states": torch.empty((rows, width), dtype=torch.bfloat16).normal_(),
             "token_ids": torch.arange(rows, dtype=torch.int64)} for _ in range(threads)]
    interval = threads * (rows * width * 2 + rows * 8) / sp["rate_bps"] if sp["rate_bps"] else 0.0
    lock, kept = threading.Lock(), collections.deque()
    totals = {"bytes": 0, "files": 0, "kept": 0}

    def run(k):
        t_next = time.perf_counter() + k * interval / threads  # staggered, not in bursts
        stop.wait(max(0.0, t_next - time.perf_counter()))
        i = 0
        while not stop.is_set():
            path = os.path.join(sp["dir"], f"noise-{k}-{i}.safetensors")
            i += 1
            save_file(srcs[k], path)
            size = os.path.getsize(path)
            with lock:
                kept.append((path, size))
                totals["bytes"] += size
                totals["files"] += 1
                totals["kept"] += size
                while totals["kept"] > sp["keep_bytes"] and len(kept) > 1:
                    old, n = kept.popleft()
                    os.unlink(old)
                    totals["kept"] -= n
            first.set()
            if interval:
                t_next += interval
                stop.wait(max(0.0, t_next - time.perf_counter()))

    t0 = time.perf_counter()
    pool = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(threads)]
    for t in pool:
        t.start()
    while not first.wait(0.1):
        if stop.is_set():
            break
    print("ready", flush=True)
    parent = os.getppid()
    while not stop.wait(0.1):
        if os.getppid() != parent:  # bench.py died without stopping us
            stop.set()
    for t in pool:
        t.join()
    seconds = time.perf_counter() - t0
    print(json.dumps({"bytes": totals["bytes"], "files": totals["files"], "seconds": seconds,
                      "gbps": totals["bytes"] / seconds / 1e9,
                      "threads_alive": sum(t.is_alive() for t in pool)}), flush=True)


class Noise:
    """Context manager around ``internal_noise`` in a subprocess: ``__enter__`` returns once
    it writes; ``result`` after ``__exit__``: its JSON line plus the settings."""

    def __init__(self, directory, rows, width, threads, rate_bps, cpus=None, keep_bytes=1 << 30):
        self.dir = directory
        self.spec = {"dir": directory, "rows": rows, "width": width, "threads": threads,
                     "rate_bps": rate_bps, "cpus": cpus, "keep_bytes": keep_bytes}
        self.proc, self.result = None, {}

    def __enter__(self):
        import select

        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--internal", "noise", "--internal-sizes", json.dumps(self.spec)],
            stdout=subprocess.PIPE, text=True)
        try:
            ready, _, _ = select.select([self.proc.stdout], [], [], 120)
            line = self.proc.stdout.readline().strip() if ready else ""
        except BaseException:
            self.__exit__(None, None, None)
            raise
        if line != "ready":
            self.__exit__(None, None, None)
            raise RuntimeError(f"noise process did not start writing (got {line!r})")
        return self

    def __exit__(self, *exc):
        try:
            self.proc.send_signal(signal.SIGTERM)
            out, _ = self.proc.communicate(timeout=60)
            lines = out.strip().splitlines()
            self.result = json.loads(lines[-1]) if lines else {"error": "no result line"}
        except Exception as e:  # noqa: BLE001
            self.proc.kill()
            self.proc.wait()
            self.result = {"error": f"{type(e).__name__}: {e}"[:300]}
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.result |= {"target_gbps": self.spec["rate_bps"] / 1e9, "threads": self.spec["threads"],
                        "cpus": self.spec["cpus"]}


# ---- orchestration -----------------------------------------------------------------------------
def save_results(results, out_dir, stem):
    results["headline"] = report.headline(results)
    results["targets"] = report.targets(results, results["headline"])
    with open(os.path.join(out_dir, stem + ".json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write(report.render_markdown(results))


def copy_log(src, dst, head=400, tail=4000):
    """Server log into --out, cut to its first ``head`` and last ``tail`` lines."""
    try:
        lines = open(src, errors="replace").read().splitlines()
    except OSError:
        return
    if len(lines) > head + tail:
        lines = lines[:head] + [f"... {len(lines) - head - tail} lines cut ..."] + lines[-tail:]
    with open(dst, "w") as f:
        f.write("\n".join(lines) + "\n")


def run_model(args, plan, name, clock, results, save, skipped):
    spec = MODELS[name]
    mp = plan["models"][name]
    m = results["models"].setdefault(name, {
        "hidden_size": spec["hidden_size"], "num_layers": spec["num_layers"],
        "layer_ids": spec["layer_ids"], "servers": mp["servers"], "cells": [], "startup_s": {},
    })
    t0 = time.monotonic()
    path = model_path(args, name)
    os.makedirs(args.workdir, exist_ok=True)
    if not args.no_build:
        subprocess.run([sys.executable, __file__, "--internal", "build", "--internal-model", name],
                       check=True, timeout=300, env=os.environ | {"KIMI_BENCH_MODEL_PATH": path})
    results["phases"][f"{name}/build_s"] = round(time.monotonic() - t0, 1)
    dd = dump_dir(args, name)
    dirs = {w: dump_dir(args, name, w) for w in "BD" if w in mp["servers"]}
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    logs = os.path.join(args.workdir, "logs")
    os.makedirs(logs, exist_ok=True)
    trace_path = None if args.no_trace else os.path.join(logs, f"trace-{name}.jsonl")
    if trace_path and os.path.exists(trace_path):
        os.unlink(trace_path)
    servers = {w: Server(name, w, cmd, os.path.join(logs, f"server-{name}-{w}.log"),
                         env=server_env(w, trace_path))
               for w, cmd in mp["servers"].items()}
    t0 = time.monotonic()
    rng = random.Random(f"{name}-bench")
    try:
        start_pair(list(servers.values()), timeout=max(60, min(420, clock.left() - 40)))
        results["phases"][f"{name}/start_s"] = round(time.monotonic() - t0, 1)
        m["startup_s"] = {w: s.startup_s for w, s in servers.items()}
        print(f"[{name}] servers up in {time.monotonic() - t0:.0f} s {m['startup_s']}", flush=True)
        sampler = sampler_a = None
        if "B" in servers:
            # from before the warm-up: that is where server B first allocates its pinned
            # buffers of every size. Server A (same model, no dump) is sampled alike; it
            # also serves the JSON cells, so its growth is an upper bound for a plain
            # server's, not a control.
            m["host_memory"] = {"cap_bytes": plan["max_host_mb"] << 20}
            try:
                sampler = RssSampler(servers["B"].proc.pid)
                m["host_memory"]["rss_baseline_bytes"] = sampler.rss()
                sampler.__enter__()
                if "A" in servers:
                    sampler_a = RssSampler(servers["A"].proc.pid)
                    m["host_memory"]["rss_baseline_bytes_nodump"] = sampler_a.rss()
                    sampler_a.__enter__()
            except Exception as e:  # noqa: BLE001 - psutil missing: log parse only
                print(f"  no RSS sampling: {e}")
                sampler = sampler_a = None
        t0 = time.monotonic()
        for s in servers.values():
            warm_up(s, spec, rng, args.prompt_lens, json_too="--enable-return-hidden-states" in s.cmd,
                    concs=args.concurrency)
        for d in dirs.values():
            clear_dump_dir(d)
        results["phases"][f"{name}/warmup_s"] = round(time.monotonic() - t0, 1)
        shm_free = shutil.disk_usage(args.dump_root).free

        def noise_for(cell, rate_bps):  # mode nodump_noise's writer process for this cell
            return Noise(os.path.join(args.dump_root, "kimi-bench-noise"), cell["prompt_len"],
                         len(spec["layer_ids"]) * spec["hidden_size"], writer_threads(), rate_bps,
                         args.noise_cpus, keep_bytes=int(0.3 * shm_free))

        t0 = time.monotonic()
        for cell in mp["cells"]:
            label = (f"{name} {cell['mode']} {cell['prompt_len']}x{cell['concurrency']}"
                     + (f" #{cell['rep']}" if "rep" in cell else ""))
            need = cell["est_s"] * 2 + 15
            if clock.left() < need:
                skipped.append(f"{label} (deadline: {clock.left():.0f} s left)")
                print(f"  skip {label}: deadline", flush=True)
                continue
            cell = dict(cell)
            if cell["mode"] in report.DUMP_MODES and cell["dump_bytes"] > 0.6 * shm_free:
                per = file_bytes(spec, cell["prompt_len"], cell["mode"] == "dump_fp8")
                cell["requests"] = max(cell["concurrency"], int(0.6 * shm_free // per))
                cell["scaled_for_shm"] = True
            server = servers[server_for(args, cell["mode"])]
            try:
                if cell["mode"] == "nodump_noise":
                    noise = noise_for(cell, noise_rate(m["cells"], cell, args))
                    with noise:
                        r = run_cell(server, cell, spec, rng, cell["mode"])
                    r["noise"] = noise.result
                    if noise.result.get("bytes") is not None and r.get("prompt_tokens"):
                        r["noise"]["bytes_per_token"] = noise.result["bytes"] / r["prompt_tokens"]
                    if noise.result.get("error") or not noise.result.get("files"):
                        r["error"] = f"noise process: {noise.result.get('error', 'wrote no file')}"
                    elif not noise.result["target_gbps"]:
                        r["error"] = "noise unpaced: no dump and no-dump cell of this shape and round to pace it by"
                else:
                    r = run_cell(server, cell, spec, rng, cell["mode"],
                                 trace_path=trace_path if cell["mode"] in report.DUMP_MODES else None)
            except Exception as e:  # noqa: BLE001
                r = {"mode": cell["mode"], "prompt_len": cell["prompt_len"],
                     "concurrency": cell["concurrency"], "requests": cell["requests"],
                     "error": f"{type(e).__name__}: {e}"[:500]}
            if cell.get("scaled_for_shm"):
                r["scaled_for_shm"] = True
            if "rep" in cell:
                r["rep"] = cell["rep"]
            if cell["mode"] in report.DUMP_MODES:
                clear_dump_dir(dirs[server_for(args, cell["mode"])])
            m["cells"].append(r)
            spy_label = f"{cell['prompt_len']}x{cell['concurrency']}"
            sampled = ("dump", "nodump") if args.py_spy_kind == "wait" else ("dump",)
            slowdown = 30 if args.py_spy_kind == "wait" else 2  # blocking sampling: 25-29x (2026-12-01)
            if (cell["mode"] in sampled and spy_label in args.py_spy and not r.get("error")
                    and clock.left() > slowdown * r.get("wall_s", 60) + 60):
                # the same cell again, sampled (the measured run above was not)
                results.setdefault("py_spy", {})[f"{name} {cell['mode']} {spy_label}"] = profile_cell(
                    server, cell, spec, rng,
                    os.path.join(args.out, f"py-spy-{args.case or args.profile}-{name}-{cell['mode']}-{spy_label}"),
                    args.py_spy_kind)
                if cell["mode"] in report.DUMP_MODES:
                    clear_dump_dir(dirs[server_for(args, cell["mode"])])
            if (cell["mode"] in ("nodump", "dump", "nodump_noise") and spy_label in args.torch_profile
                    and not r.get("error") and clock.left() > 3 * r.get("wall_s", 60) + 90):
                key = f"{name} {cell['mode']} {spy_label}" + (f" #{cell['rep']}" if "rep" in cell else "")
                tag = f"{args.case or args.profile}-{name}-{cell['mode']}-{spy_label}" + (
                    f"-{cell['rep']}" if "rep" in cell else "")
                trace_dir = os.path.join(args.workdir, "torch-profile", tag)
                try:
                    if cell["mode"] == "nodump_noise":  # the same noise again, while profiled
                        with noise_for(cell, r["noise"]["target_gbps"] * 1e9):
                            tp = torch_profile_cell(server, cell, spec, rng, trace_dir, tag,
                                                    args.torch_profile_requests)
                    else:
                        tp = torch_profile_cell(server, cell, spec, rng, trace_dir, tag,
                                                args.torch_profile_requests)
                except Exception as e:  # noqa: BLE001 - a failed profile must not end the model
                    tp = {"error": f"{type(e).__name__}: {e}"[:500]}
                results.setdefault("torch_profile", {})[key] = tp
                if cell["mode"] in report.DUMP_MODES:
                    clear_dump_dir(dirs[server_for(args, cell["mode"])])
                if tp.get("trace"):  # keep the trace beside the results (gzip, a few MB)
                    shutil.copyfile(os.path.join(trace_dir, tp["trace"]),
                                    os.path.join(args.out, f"torch-{tag}.trace.json.gz"))
                print(f"  torch profile {key}: " + (tp.get("error") or (
                    f"window {tp['window_ms_per_mtok']:.0f} ms/Mtok, in ops {tp['ops_ms_per_mtok']:.0f}, "
                    f"between {tp['between_ops_ms_per_mtok']:.0f}, launch {tp['launch_us_mean'] or 0:.1f} us, "
                    f"GPU busy {tp['gpu_busy_ms_per_mtok']:.0f}")), flush=True)
            extra = (f" {r['write_gbps']:.2f} GB/s written" if r.get("write_gbps") else "") + (
                f", {r['bytes_per_token']:.0f} B/token" if r.get("bytes_per_token") else "") + (
                f" beside {r['noise'].get('gbps', 0):.2f} GB/s of noise" if r.get("noise") else "") + (
                f" {r['response_bytes'] / r['requests'] / 1e6:.0f} MB/resp" if r.get("response_bytes") else "")
            print(f"  {label}: {r.get('prefill_tps', float('nan')):.0f} tok/s, p50 "
                  f"{r.get('p50_s', float('nan')):.3f} s, p99 {r.get('p99_s', float('nan')):.3f} s{extra}"
                  + (f"  ERROR {r['error']}" if r.get("error") else ""), flush=True)
            save()
        results["phases"][f"{name}/cells_s"] = round(time.monotonic() - t0, 1)
        checked = [c["file_check"] for c in m["cells"] if c.get("file_check")]
        if checked:
            m["file_check"] = checked[0]
        if "B" in servers:
            hm = m["host_memory"]
            if args.writer_log_wait_s and clock.left() > args.writer_log_wait_s + 30:
                wait_writer_log(servers["B"], spec, rng, args.writer_log_wait_s)
                clear_dump_dir(dd)
            log_b = servers["B"].log_text()
            hm["log_host_bytes_peak"] = writer_log_peak(log_b)
            hm["log_pinned_pool_peak"] = writer_log_peak(log_b, "pinned_pool_peak")
            if sampler_a:
                sampler_a.__exit__(None, None, None)
                if sampler_a.peak:
                    hm["rss_delta_bytes_nodump"] = max(0, sampler_a.peak - hm["rss_baseline_bytes_nodump"])
            if sampler:
                sampler.__exit__(None, None, None)
            if sampler and sampler.peak:
                hm["rss_peak_bytes"] = sampler.peak
                hm["rss_delta_bytes"] = max(0, sampler.peak - hm["rss_baseline_bytes"])
    finally:
        t0 = time.monotonic()
        stop_all(list(servers.values()))
        results["phases"][f"{name}/stop_s"] = round(time.monotonic() - t0, 1)
        for w, s in servers.items():
            copy_log(s.log_path, os.path.join(args.out, f"server-{name}-{w}.log"))
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
        save()


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="full")
    ap.add_argument("--quick", dest="profile", action="store_const", const="quick",
                    help="the ~8-minute profile (same as --profile quick)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/kimi-bench-out"))
    ap.add_argument("--workdir", default="/tmp/kimi-bench", help="models and raw logs")
    ap.add_argument("--models", default="llama-mid,deepseek-tiny")
    ap.add_argument("--modes", default="nodump,dump,dump_early,json",
                    help="nodump (a), dump (b), dump_early (b'), json (c); also dump_fp8 (b on a "
                         "server D with --dump-hidden-states-dtype fp8) and nodump_noise: "
                         "(a) while another process writes dump-sized files into --dump-root, "
                         "paced as --noise-gbps says")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every cell of the grid (not the JSON cell) this many times, "
                         "interleaved (cells carry 'rep'; ratios pair cells of one repetition)")
    ap.add_argument("--noise-gbps", type=float, default=0,
                    help="nodump_noise's write rate in GB/s (0: the dump cell's bytes per prompt "
                         "token x the no-dump cell's tokens/s, same shape and round)")
    ap.add_argument("--noise-cpus", default=None,
                    help="CPUs of the noise process, as for taskset -c (default: any)")
    ap.add_argument("--prompt-lens", type=lambda s: [int(x) for x in s.split(",")], default=[512, 2048, 8192])
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--cell-tokens", type=int, default=0, help="prompt tokens per cell (if 0: the profile's, times the model's cell_scale at concurrency >= 8)")
    ap.add_argument("--min-rounds", type=int, default=0, help="requests per client thread, at least")
    ap.add_argument("--json-requests", type=int, default=0, help="requests of the JSON cell")
    ap.add_argument("--ceiling-mib", type=int, default=0, help="MiB written per ceiling measurement")
    ap.add_argument("--skip-ceilings", action="store_true")
    ap.add_argument("--deadline-s", type=float, default=0, help="skip what would end later (profile's if 0)")
    ap.add_argument("--mem-fraction-static", type=float, default=0.3)
    ap.add_argument("--max-host-mb", type=int, default=0, help="--dump-hidden-states-max-host-mb (default: the server's 4096)")
    ap.add_argument("--chunked-prefill-size", type=int, default=0, help="(default: SGLang's, 8192 on an H200)")
    ap.add_argument("--cuda-graph", action="store_true", help="keep CUDA graphs on (longer start-up)")
    ap.add_argument("--sleep-on-idle", action="store_true")
    ap.add_argument("--case", default=None, help="results file name part (default: the profile)")
    ap.add_argument("--writer-log-wait-s", type=float, default=None,
                    help="after the cells, wait up to this long for the writer's next snapshot "
                         "log line (quick: 0, full: 65)")
    ap.add_argument("--no-trace", action="store_true",
                    help="run server B without KIMI_SGLANG_TRACE (no per-stage times)")
    ap.add_argument("--py-spy", type=lambda s: [x for x in s.split(",") if x], default=["512x1", "2048x32"],
                    help="dump cells (PROMPTxCONC) to run again under py-spy; '' for none")
    ap.add_argument("--py-spy-kind", choices=["gil", "wait"], default="gil",
                    help="gil: who holds the GIL (--gil, dump cells); wait: how long each thread "
                         "waits for it (--idle --native, no-dump and dump cells)")
    ap.add_argument("--torch-profile", type=lambda s: [x for x in s.split(",") if x], default=[],
                    help="cells (PROMPTxCONC) whose nodump, dump and nodump_noise runs are repeated under "
                         "SGLang's torch profiler (/start_profile), summarized by bench/torchprof.py")
    ap.add_argument("--torch-profile-requests", type=int, default=96,
                    help="requests of each torch-profiled run (traces grow with them)")
    ap.add_argument("--dump-root", default="/dev/shm", help="where server B's dump directory goes")
    ap.add_argument("--ports", type=lambda s: [int(x) for x in s.split(",")], default=[31000, 32000, 33000, 34000],
                    help="ports of servers A, B (and C, D)")
    ap.add_argument("--json-server", choices=["shared", "separate"], default="shared",
                    help="JSON mode on server A (shared) or on a third server C, so that A is "
                         "a plain server (see server_for)")
    ap.add_argument("--no-build", action="store_true", help="use the models already in --workdir")
    # tests/test_bench.py rehearses the orchestration against a fake server
    ap.add_argument("--server-module", default="sglang.launch_server", help=argparse.SUPPRESS)
    ap.add_argument("--internal", choices=["build", "ceilings", "noise"], help=argparse.SUPPRESS)
    ap.add_argument("--internal-model", help=argparse.SUPPRESS)
    ap.add_argument("--internal-part", help=argparse.SUPPRESS)
    ap.add_argument("--internal-sizes", help=argparse.SUPPRESS)
    return ap


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)

    if args.internal == "build":
        internal_build(args.internal_model, os.environ["KIMI_BENCH_MODEL_PATH"])
        return 0
    if args.internal == "noise":
        internal_noise(args.internal_sizes)
        return 0
    if args.internal == "ceilings":
        prof = PROFILES[args.profile]
        internal_ceilings(args.internal_part, args.internal_sizes, writer_threads(),
                          args.ceiling_mib or prof["ceiling_mib"], prof["writer_reps"],
                          args.max_host_mb or DEFAULT_MAX_HOST_MB, args.dump_root)
        return 0

    for name in args.models.split(","):
        if name and name not in MODELS:
            ap.error(f"unknown model {name!r} (known: {', '.join(MODELS)})")
    for mode in args.modes.split(","):
        if mode not in ("nodump", "json", "nodump_noise") + report.DUMP_MODES:
            ap.error(f"unknown mode {mode!r} (known: nodump, dump, dump_early, dump_fp8, nodump_noise, json)")
    if "dump_fp8" in args.modes.split(",") and len(args.ports) < 4:
        ap.error("mode dump_fp8 runs on a fourth server (D): --ports needs four ports")
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.noise_cpus:
        try:
            parse_cpus(args.noise_cpus)
        except ValueError as e:
            ap.error(f"--noise-cpus: {e}")
    if args.writer_log_wait_s is None:
        args.writer_log_wait_s = PROFILES[args.profile]["writer_log_wait_s"]
    plan = make_plan(args)
    if args.dry_run:
        print_plan(plan)
        return 0

    # SIGTERM (a timeout, the device's limit) unwinds like Ctrl-C: the servers (in their
    # own sessions) are stopped and the results so far written by the finally blocks.
    signal.signal(signal.SIGTERM, _interrupt)
    clock = Clock(plan["deadline_s"])
    os.makedirs(args.out, exist_ok=True)
    gpu = gpu_name()
    date = datetime.datetime.now(datetime.timezone.utc)
    stem = f"{date:%Y-%m-%d}-{short_gpu(gpu)}-{args.case or args.profile}"
    results = {
        "date": date.isoformat(timespec="seconds"), "gpu": gpu, "profile": args.profile,
        "versions": versions(), "argv": sys.argv[1:],
        "config": {k: plan[k] for k in ("modes", "cell_tokens", "min_rounds", "writer_threads",
                                        "max_host_mb", "deadline_s", "ceiling_mib")}
        | {"prompt_lens": args.prompt_lens, "concurrency": args.concurrency,
           "cuda_graph": args.cuda_graph, "chunked_prefill_size": args.chunked_prefill_size or None,
           "json_server": args.json_server, "mem_fraction_static": args.mem_fraction_static,
           "repeat": args.repeat, "noise_gbps": args.noise_gbps or None, "noise_cpus": args.noise_cpus},
        "ceilings": {}, "models": {}, "phases": {}, "skipped": [],
    }
    skipped = results["skipped"]

    def save():
        results["phases"]["total_s"] = round(clock.elapsed(), 1)
        save_results(results, args.out, stem)

    shm_free = shutil.disk_usage(args.dump_root).free
    results["config"]["dump_root_free_bytes"] = shm_free
    print(f"== {gpu}; {args.dump_root}: {shm_free / (1 << 30):.1f} GiB free; results -> "
          f"{os.path.join(args.out, stem)}.json", flush=True)
    if shm_free < 8 << 30:
        print(f"WARNING: {args.dump_root} has {shm_free / (1 << 30):.1f} GiB free; dump cells are "
              f"cut to fit (scaled_for_shm) and may fail; try --dump-root on a larger tmpfs", flush=True)
    if not args.skip_ceilings:
        t0 = time.monotonic()
        part = os.path.join(args.workdir, "ceilings.json")
        os.makedirs(args.workdir, exist_ok=True)
        sizes = [{"model": n, "prompt_len": p, "rows": p, "layers": len(MODELS[n]["layer_ids"]),
                  "hidden": MODELS[n]["hidden_size"], "layer_ids": MODELS[n]["layer_ids"],
                  "num_layers": MODELS[n]["num_layers"]}
                 for n in plan["models"] for p in args.prompt_lens]
        try:
            subprocess.run([sys.executable, __file__, "--internal", "ceilings", "--profile", args.profile,
                            "--internal-part", part, "--internal-sizes", json.dumps(sizes),
                            "--dump-root", args.dump_root]
                           + (["--ceiling-mib", str(args.ceiling_mib)] if args.ceiling_mib else [])
                           + (["--max-host-mb", str(args.max_host_mb)] if args.max_host_mb else []),
                           check=True, timeout=max(30, min(180, clock.left() - 60)))
            with open(part) as f:
                results["ceilings"] = json.load(f)
        except Exception as e:  # noqa: BLE001
            results["ceilings"] = {"error": f"{type(e).__name__}: {e}"}
            skipped.append("ceilings failed")
        results["phases"]["ceilings_s"] = round(time.monotonic() - t0, 1)
        save()
    for name in plan["models"]:
        if clock.left() < 90:
            skipped.append(f"{name} (deadline: {clock.left():.0f} s left)")
            continue
        try:
            run_model(args, plan, name, clock, results, save, skipped)
        except Exception as e:  # noqa: BLE001
            results["models"].setdefault(name, {})["error"] = f"{type(e).__name__}: {e}"[:2000]
            print(f"[{name}] ERROR {type(e).__name__}: {str(e)[:500]}", flush=True)
    save()
    print(f"\nresults: {os.path.join(args.out, stem)}.json / .md ({clock.elapsed():.0f} s)"
          + (f"; skipped: {'; '.join(skipped)}" if skipped else ""))
    print(report.summary_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
