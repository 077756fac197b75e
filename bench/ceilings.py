"""What the host can move, before any server starts: the ceilings a dump is compared with.

- ``d2h_pinned_gbps``: 1 GiB bf16 copied device to pinned host, best of 5 (CUDA events).
- ``shm_write_gbps[<file bytes>]``: safetensors ``save_file`` of pinned tensors by the
  writer's thread count, for every dump file size of the plan; best of 2.
- ``writer_alone[<model>][<prompt len>]``: ``sglang_ext.writer.DumpWriter`` (the shared
  arena and the writer process) driven with CUDA rows as the scheduler drives it.

``python -m bench.ceilings JOB OUT`` measures (``measure``'s keywords in JOB) and writes
a JSON dict to OUT; ``run`` starts it as a subprocess (its CUDA context and pinned memory
go away after) and reads it. Without CUDA (a CPU check of this code) the copy ceiling is skipped
and the writer gets CPU rows; the numbers then mean nothing.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import shutil
import subprocess
import sys
import time

from sglang_ext import config

from bench import child_env, module_argv
from bench.loadgen import clear_dump_dir
from bench.models import MODELS
from bench.plan import writer_threads


def d2h_ceiling(torch, dev, out):
    """Pinned device-to-host copy of 1 GiB: best and median of 5, GB/s."""
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


def _file_count(size, threads, budget, free):
    """Files per measurement: ``budget`` bytes' worth, at least 2 per thread, at most
    40% of the free space (but one per thread)."""
    count = max(2 * threads, math.ceil(budget / size))
    return min(count, max(threads, int(free * 0.4) // size))


def shm_rates(torch, d, sizes, threads, budget, free, pinned, out):
    """``shm_write_gbps`` of every distinct file size (to 1/4 MiB) of ``sizes``, written
    into directory ``d``."""
    from safetensors.torch import save_file

    out["shm_write_gbps"] = {}
    seen = set()
    for s in sizes:
        rows, layers, hidden = s["rows"], s["layers"], s["hidden"]
        if round(rows * layers * hidden / (1 << 18)) in seen:  # same size to 1/4 MiB
            continue
        seen.add(round(rows * layers * hidden / (1 << 18)))
        # one source tensor per thread, as the writer's buffers are distinct (one shared
        # source could be served from the CPU's cache and flatter the ceiling)
        srcs = [{"hidden_states": torch.empty((rows, layers, hidden), dtype=torch.bfloat16,
                                              pin_memory=pinned).normal_(),
                 "token_ids": torch.arange(rows, dtype=torch.int64)} for _ in range(threads)]
        count = _file_count(rows * layers * hidden * 2 + rows * 8, threads, budget, free)

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
        del srcs, save


def writer_alone(torch, d, sizes, threads, budget, free, reps, max_host_mb, dev, out):
    """``writer_alone``: a DumpWriter (arena + writer process) fed CUDA rows as the
    scheduler feeds it (``start``, ``copy_rows`` per prefill chunk of the model's,
    ``finish`` with a ``format.reserve``d name); GB/s of files until the writer process
    acknowledged every one, best of ``reps`` (each rep's in ``gbps_reps``)."""
    from sglang_ext import format as fmt
    from sglang_ext.writer import DumpWriter

    out["writer_alone"] = {}
    fd = fmt.open_dump_dir(d)
    for s in sizes:
        rows, layers, hidden = s["rows"], s["layers"], s["hidden"]
        width = layers * hidden
        gpu_rows = torch.randn((rows, width), dtype=torch.float32, device=dev or "cpu").to(torch.bfloat16)
        ids = list(range(rows))
        count = _file_count(rows * width * 2 + rows * 8, threads, budget, free)
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
                for c0 in range(0, rows, s["chunk"]):  # one copy per prefill chunk
                    n = min(s["chunk"], rows - c0)
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
        if dev is not None:
            torch.cuda.empty_cache()
    os.close(fd)


def measure(sizes, threads, ceiling_mib, reps, max_host_mb, root):
    """All the ceilings, as a dict (the results' ``ceilings``). ``sizes``: one dict per
    (model, prompt length): model, prompt_len, rows, layers, hidden, layer_ids,
    num_layers, chunk (rows per prefill chunk). Files go to ``root`` (--dump-root, /dev/shm by default), where server B's
    dumps go; at most ``ceiling_mib`` MiB (and 40% of the free space) per measurement."""
    import torch

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else None
    out = {"writer_threads": threads, "cuda": cuda}
    if cuda:
        d2h_ceiling(torch, dev, out)
    free = shutil.disk_usage(root).free
    budget = min(ceiling_mib << 20, int(free * 0.4))
    out["shm_free_bytes"] = free
    d = os.path.join(root, "kimi-bench-ceiling")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    shm_rates(torch, d, sizes, threads, budget, free, cuda, out)
    writer_alone(torch, d, sizes, threads, budget, free, reps, max_host_mb, dev, out)
    shutil.rmtree(d, ignore_errors=True)
    return out


def run(plan, workdir, dump_root, timeout):
    """The ceilings of ``plan``'s models at their prompt lengths, measured by ``python -m
    bench.ceilings`` (raises CalledProcessError or TimeoutExpired when it fails)."""
    os.makedirs(workdir, exist_ok=True)
    job, part = os.path.join(workdir, "ceilings-job.json"), os.path.join(workdir, "ceilings.json")
    sizes = [{"model": n, "prompt_len": p, "rows": p, "layers": len(MODELS[n].layer_ids),
              "hidden": MODELS[n].hidden_size, "layer_ids": MODELS[n].layer_ids,
              "num_layers": MODELS[n].num_layers, "chunk": MODELS[n].chunk}
             for n, m in plan["models"].items() for p in m["prompt_lens"]]
    with open(job, "w") as f:
        json.dump({"sizes": sizes, "threads": plan["writer_threads"], "ceiling_mib": plan["ceiling_mib"],
                   "reps": plan["writer_reps"], "max_host_mb": plan["max_host_mb"], "root": dump_root}, f)
    subprocess.run(module_argv("ceilings", job, part), check=True, timeout=timeout, env=child_env())
    with open(part) as f:
        return json.load(f)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.ceilings", description=__doc__.split("\n")[0])
    ap.add_argument("job", help="JSON: measure()'s keywords (threads optional: KIMI_SGLANG_WRITER_THREADS's)")
    ap.add_argument("out", help="the JSON file to write")
    args = ap.parse_args(argv)
    with open(args.job) as f:
        job = json.load(f)
    out = measure(**{"threads": writer_threads(), "ceiling_mib": 1024, "reps": 2,
                     "max_host_mb": config.DEFAULT_MAX_HOST_MB, "root": "/dev/shm"} | job)
    with open(args.out, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
