"""Mode ``nodump_noise``'s load: another process writing dump-sized files, so that a
no-dump cell runs beside the page-cache copies of a dump without anything of the dump
inside the server (no hook, no writer in its process tree, no GIL shared).

``python -m bench.noise SPEC_JSON`` writes until SIGTERM (``write``); ``Noise`` runs it
around a cell; ``noise_rate`` is the pace a cell asks of it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time

from sglang_ext import config

from bench import child_env, module_argv, report


def parse_cpus(text):
    """``"8-15,20"`` -> {8, ..., 15, 20} (the ``taskset -c`` list syntax, as the server's
    ``KIMI_SGLANG_WRITER_CPUS``: ``sglang_ext.config.parse_cpu_list``, not checked against
    this host: the plan may be for another); raises ValueError."""
    return set(config.parse_cpu_list(text, "CPU list", this_host=False))


def noise_rate(cells, cell, args):
    """Bytes/s the noise process of a ``nodump_noise`` cell aims at: ``--noise-gbps`` if
    given; else what a dump running at no-dump speed would write: the dump cell's file
    bytes per prompt token (same shape and round; mode dump's, else dump_early's:
    ``report.paced_by``) x the no-dump cell's prompt tokens/s.
    (The dump cell's own GB/s would be lower by its slowdown: at that rate the noise would
    write fewer bytes per token than the dump.) 0 (as fast as it can) when either cell is
    missing."""
    if args.noise_gbps:
        return args.noise_gbps * 1e9
    shape = (cell["prompt_len"], cell["concurrency"], cell.get("rep"))
    b, a = report.paced_by(cells, *shape), report.find_cell(cells, "nodump", *shape)
    if not (b and a and b.get("file_bytes") and b.get("prompt_tokens") and a.get("prefill_tps")):
        return 0.0
    return b["file_bytes"] / b["prompt_tokens"] * a["prefill_tps"]


def write(sp):
    """Write noise as ``sp`` says: {"dir", "rows", "width", "threads", "rate_bps", "cpus",
    "keep_bytes"}. ``threads`` threads each write safetensors files (``save_file``, as the
    writer does) of ``hidden_states`` bf16 [rows, width] and ``token_ids`` int64 [rows]
    into ``dir``, paced to ``rate_bps`` bytes/s together (0: as fast as they can), keeping
    at most ``keep_bytes`` of files (the oldest are unlinked), on ``cpus`` if given (a
    ``taskset -c`` list). Prints ``ready`` once the first file is written; on SIGTERM (or
    when its parent is gone) it stops and prints one JSON line {"bytes", "files",
    "seconds", "gbps", "threads_alive"}."""
    import torch
    from safetensors.torch import save_file

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
        if os.getppid() != parent:  # the benchmark died without stopping us
            stop.set()
    for t in pool:
        t.join()
    seconds = time.perf_counter() - t0
    print(json.dumps({"bytes": totals["bytes"], "files": totals["files"], "seconds": seconds,
                      "gbps": totals["bytes"] / seconds / 1e9,
                      "threads_alive": sum(t.is_alive() for t in pool)}), flush=True)


class Noise:
    """Context manager around ``python -m bench.noise``: ``__enter__`` returns once it
    writes (RuntimeError if it does not within 120 s); ``result`` after ``__exit__``: its
    JSON line plus the settings (``target_gbps``, ``threads``, ``cpus``)."""

    def __init__(self, directory, rows, width, threads, rate_bps, cpus=None, keep_bytes=1 << 30):
        self.dir = directory
        self.spec = {"dir": directory, "rows": rows, "width": width, "threads": threads,
                     "rate_bps": rate_bps, "cpus": cpus, "keep_bytes": keep_bytes}
        self.proc, self.result = None, {}

    def __enter__(self):
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir)
        self.proc = subprocess.Popen(module_argv("noise", json.dumps(self.spec)),
                                     stdout=subprocess.PIPE, text=True, env=child_env())
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


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.noise", description=__doc__.split("\n")[0])
    ap.add_argument("spec", help='JSON: {"dir", "rows", "width", "threads", "rate_bps", "cpus", "keep_bytes"}')
    write(json.loads(ap.parse_args(argv).spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
