"""One request's file, stage by stage: from its rows in the arena to a waiter that sees it.

``python -m bench.filelatency [--device cuda] [--dtype bf16|fp8] [--reps 9]`` drives a
``sglang_ext.writer.DumpWriter`` (the arena and the writer process) as the scheduler
drives it for one request at concurrency 1 (``start``, one ``copy_rows`` of all its rows,
``finish`` with a ``format.reserve``d name, ``flush``), then waits for the file as the
tokenizer manager does (``format.wait_complete_async``). ``--gap-ms`` between requests
stands for the next request's forward. With ``KIMI_SGLANG_TRACE`` (set here to a file of
its own) every process records its stage times (``sglang_ext.trace``); this prints the
median and max of each stage over the reps, in ms:

- ``submit``: ``start`` to ``FINISH`` queued (the rows' copy into the arena: on CUDA the
  asynchronous device-to-host copy is only enqueued; on CPU rows it is a memcpy);
- ``queue``: ``FINISH`` queued to the writer thread starting the rows' write (the message,
  the copy's arrival ``arena.wait_seq``, the hand-off, the temporary file and its header);
- ``write``: the rows' ``pwrite``; ``close``: to the temporary file closed;
- ``rename``: ``format.publish``; ``release``: the index line and the lock's release;
- ``seen``: renamed to the waiter returning (the index line, the lock's release and the
  waiter's wake-up; ``t_released`` is taken after the acknowledgement, so a waiter woken
  by the release itself may return before it);
- ``total``: ``FINISH`` queued to the waiter returning (what a waiting response adds to
  the request at concurrency 1).

Default request: llama-8b's shape, 2048 tokens x 4 layer slots x 4096 hidden, bf16
(64 MiB), into ``/dev/shm``; ``--tokens 256,512,2048`` draws each request's length from
the list (``--seed``), as a dataset of mixed prompt lengths comes. Output: one JSON line per
rep (``--json``) and the table, headed by how many files went into a spare and how many of
those by stores into its mapping (the spare held the whole file).

Mixed lengths (256-2048 tokens, 8-64 MiB, 40 reps, ``--spares 8``, the development box):
every file takes the ready spare, about half are mapped (a spare is made at the last file's
size); total median 10.5-11.0 ms against 12.5 without spares. Spares made at the largest of
the last 8 sizes were tried: 37-38 of 40 mapped and writes 2.4-2.5 ms instead of 3.0-5.6,
but the unused tail cut off when a large spare is named (``ftruncate`` of mapped, populated
pages) moved 3-5 ms into ``queue``: the same total median (10.1-11.1 ms), so not kept.

Measured on the development box (2 shared CPU cores, no GPU, CPU rows; numbers of a
loaded machine, to compare before and after only), median of 9 reps, ms:

before (one thread's pwrite into fresh tmpfs pages, the waiter polling at most 5 ms apart):
  bf16: submit 8.7, queue 1.6, write 43.5, close 0.0, rename 0.05, release 0.3, wake 2.5
  (max 5.1), total 48.9;
  fp8 (``OMP_NUM_THREADS=1``): write 23.2, wake 3.6, total 29.9. Without it the write took
  65 ms: torch's CPU threads spin after the CPU quantization (submit, ~0.5 s on CPU rows)
  and take the cores from the writer process; a CPU-only effect (on the GPU the
  quantization runs on the device).

after (the rows written into a spare file whose pages were allocated ahead,
``writer_process.Spares``; the waiter woken by inotify on the lock), the same box, run
back to back with ``before`` (load average 2-3; that run's before: write 54.0, seen 2.9,
total 60.0):
  bf16: submit 12.9, queue 1.8, write 24.1, close 0.0, rename 0.05, release 0.7, seen 1.6
  (the wake-up is a thread switch on 2 busy cores), total 28.7 (0.48 x);
  fp8 (``OMP_NUM_THREADS=1``): write 14.2, total 20.6.
On the H200 host (16 cores, rows on the GPU, 21 reps; bench/results/2026-12-03-h200-filelatency.md):
bf16 without spares write 25.8, total 28.2; with the default spare (mapped, stores by up to
8 threads) write 2.4, total 4.6; fp8 with it total 2.9.

Writing one file from several threads (disjoint ``pwrite``s) was measured too and gains
nothing: the kernel holds the file's inode lock for each write (64 MiB: 1 thread 38-48 ms,
2 threads 46-51, 4 threads 45-52).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

STAGES = (("submit", "t_start", "t_submit"), ("queue", "t_submit", "t_rows"),
          ("write", "t_rows", "t_picked"), ("close", "t_picked", "t_copied"),
          ("rename", "t_copied", "t_written"), ("release", "t_written", "t_released"),
          ("seen", "t_written", "t_done"), ("total", "t_submit", "t_done"))


def _events(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _file_events(path, count, timeout=10.0):
    """The trace's ``file`` events by name, once ``count`` are there: the writer records a
    file after its acknowledgement, so the last one may lag the waiter."""
    deadline = time.monotonic() + timeout
    while True:
        files = {e["name"]: e for e in _events(path) if e["event"] == "file"}
        if len(files) >= count or time.monotonic() > deadline:
            return files
        time.sleep(0.01)


def measure(args):
    """The per-rep stage times (dicts of ms) of ``args.reps`` requests."""
    trace_path = os.path.join(tempfile.mkdtemp(prefix="kimi-filelat-"), "trace.jsonl")
    os.environ["KIMI_SGLANG_TRACE"] = trace_path  # before the writer process starts: inherited
    import torch

    from sglang_ext import format as fmt
    from sglang_ext import trace
    from sglang_ext.writer import DumpWriter

    dev = torch.device(args.device) if args.device != "cpu" else None
    d = os.path.join(args.dump_root, f"kimi-filelat-{os.getpid()}")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    fd = fmt.open_dump_dir(d)
    width = args.slots * args.hidden
    rng = random.Random(args.seed)  # mixed prompt lengths: each request's drawn from the list
    lengths = [rng.choice(args.tokens) for _ in range(args.warmup + args.reps)]
    file_bytes = max(args.tokens) * width * 2
    writer = DumpWriter(fd, arena_bytes=max(2 * file_bytes, 64 << 20), threads=args.threads,
                        device=dev, layer_ids=list(range(args.slots)), num_layers=args.slots,
                        stats_interval_s=0, register_atexit=False,
                        hidden_states_dtype="fp8" if args.dtype == "fp8" else "auto",
                        spares=args.spares)
    rows = torch.randn((max(args.tokens), width), dtype=torch.float32,
                       device=dev or "cpu").to(torch.bfloat16)
    done = {}
    reps = []
    try:
        for rep, tokens in enumerate(lengths):
            time.sleep(args.gap_ms / 1e3)
            rid = f"lat-{rep}"
            if dev is not None:
                torch.cuda.synchronize(dev)
            p = writer.start(rid, list(range(tokens)), width, torch.bfloat16)
            writer.copy_rows(rows[:tokens], [(p, 0, tokens)], ready=True)
            res = fmt.reserve(fd, rid)
            writer.finish(p, res)
            writer.flush()
            path = os.path.join(d, res.name)
            error = asyncio.run(fmt.wait_complete_async(path, timeout=60))
            done[res.name] = trace.now()
            if error is not None:
                raise RuntimeError(f"rep {rep}: {error}")
            writer.wait_idle(60)
            os.unlink(path)
        files = _file_events(trace_path, args.warmup + args.reps)
        for rep in range(args.warmup, args.warmup + args.reps):
            name = f"lat-{rep}"
            name = next(n for n in files if n.startswith(fmt.safe_stem(name)))
            e = dict(files[name], t_done=done[name])
            reps.append(dict({stage: (e[b] - e[a]) * 1e3 for stage, a, b in STAGES
                              if a in e and b in e}, spare=e.get("spare"), mapped=e.get("mapped"),
                             tokens=lengths[rep]))
    finally:
        writer.close()
        os.close(fd)
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(os.path.dirname(trace_path), ignore_errors=True)
    return reps


def _ints(text):
    return [int(x) for x in text.split(",")]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.filelatency", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=_ints, default=[2048],
                    help="prompt tokens per request; a comma list: each request's drawn from it (mixed lengths, --seed)")
    ap.add_argument("--seed", type=int, default=0, help="the draw of mixed lengths")
    ap.add_argument("--slots", type=int, default=4, help="layer slots")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (rows on the GPU)")
    ap.add_argument("--threads", type=int, default=8, help="writer threads")
    ap.add_argument("--spares", type=int, default=1,
                    help="the most files kept allocated and mapped ahead (KIMI_SGLANG_WRITER_SPARES; the server keeps "
                         "up to 8, as many as files begin at once; one request at a time here needs 1; "
                         "0: none, each file by one thread's pwrite)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--gap-ms", type=float, default=60.0,
                    help="pause before each request (the next forward at concurrency 1)")
    ap.add_argument("--dump-root", default="/dev/shm")
    ap.add_argument("--json", action="store_true", help="also print each rep as a JSON line")
    args = ap.parse_args(argv)
    reps = measure(args)
    if args.json:
        for r in reps:
            print(json.dumps(r))
    print(f"{','.join(map(str, args.tokens))} tokens x {args.slots} x {args.hidden} {args.dtype}, "
          f"{args.device}, {args.reps} reps (ms); into a spare: {sum(bool(r['spare']) for r in reps)}, "
          f"of which mapped: {sum(bool(r['mapped']) for r in reps)}:")
    for stage, _, _ in STAGES:
        vals = [r[stage] for r in reps if stage in r]
        if vals:
            print(f"  {stage:8s} median {statistics.median(vals):7.2f}  max {max(vals):7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
