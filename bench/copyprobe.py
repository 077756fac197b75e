"""Does the dump's device-to-host copy delay SGLang's own result copy?

``python -m bench.copyprobe [--out FILE]`` (CUDA only, no server, a few seconds) replays
SGLang 0.5.23's overlap loop on three streams, timed on the GPU clock:

1. batch j's forward on the forward stream (a ``torch.cuda._sleep`` of F ms);
2. its result copy (a few bytes, what ``copy_done`` marks) on SGLang's copy stream after
   the forward (``Scheduler._copy_result_to_cpu``: the copy stream waits for the forward);
3. then, as ``process_batch_result`` of batch j-1 runs while j computes, the dump's rows
   of batch j-1 (``--mib``, 64 MiB = 8192 deepseek-tiny tokens) on the dump's copy stream
   with no wait (``DumpWriter.copy_rows(ready=True)``): whole, in 64 pieces, or started
   just before the forward ends (``late``: the worst overlap).

Per case it reports the delay from the forward's end to the result copy's end (median,
p90, ms) and the host time to issue the rows' copies; cases run round-robin, ``--reps``
times each. Without the rows' copy that delay is the copy's own latency; more with it means
the copy engine made SGLang wait. Forward lengths ``--forward-ms`` (deepseek-tiny's
forward of 8192 tokens: ~4.5 ms of GPU time, per an earlier torch profile).

Why: on deepseek-tiny the dump server's scheduler took 2.8 ms more per 8192-token batch
(run ``rounds-deepseek``'s logs), time py-spy ``--gil`` did not clearly see as Python
(docs/performance.md). The rows' destination here is ``pin_memory``; the server's arena is
shared memory registered with ``cudaHostRegister``, which copies treat the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

CASES = ("none", "whole", "pieces", "late")


def cycles_per_ms(torch, stream):
    """GPU clock cycles per ms of ``torch.cuda._sleep`` on ``stream``."""
    with torch.cuda.stream(stream):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def one(torch, t, forward_cycles, case, pieces, late_cycles):
    """One batch as the loop runs it: (ms from the forward's end to its result copy's end,
    GPU clock; host ms to issue the rows' copies)."""
    torch.cuda.synchronize()
    fwd_end, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(t["fwd"]):
        torch.cuda._sleep(forward_cycles)
        t["small"].add_(1)
        fwd_end.record()
    t["copy"].wait_stream(t["fwd"])
    with torch.cuda.stream(t["copy"]):
        t["host_small"].copy_(t["small"], non_blocking=True)
        done.record()
    t0 = time.perf_counter()
    if case != "none":
        with torch.cuda.stream(t["dump"]):
            if case == "late":
                torch.cuda._sleep(late_cycles)
            n = 1 if case != "pieces" else pieces
            size = t["big"].numel() // n
            for i in range(n):
                t["host_big"][i * size:(i + 1) * size].copy_(t["big"][i * size:(i + 1) * size], non_blocking=True)
    issue_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return fwd_end.elapsed_time(done), issue_ms


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.copyprobe", description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="the rows' copy (MiB)")
    ap.add_argument("--forward-ms", default="0.5,2,5,15", help="forward lengths (ms), comma-separated")
    ap.add_argument("--pieces", type=int, default=64, help="pieces of case 'pieces'")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench.copyprobe: needs CUDA")
    t = {"fwd": torch.cuda.Stream(), "copy": torch.cuda.Stream(), "dump": torch.cuda.Stream(),
         "big": torch.empty(args.mib << 20, dtype=torch.uint8, device="cuda"),
         "host_big": torch.empty(args.mib << 20, dtype=torch.uint8).pin_memory(),
         "small": torch.zeros(64, dtype=torch.int64, device="cuda"),
         "host_small": torch.empty(64, dtype=torch.int64).pin_memory()}
    per_ms = cycles_per_ms(torch, t["fwd"])
    with torch.cuda.stream(t["dump"]):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t["host_big"].copy_(t["big"], non_blocking=True)  # warm
        start.record()
        t["host_big"].copy_(t["big"], non_blocking=True)
        end.record()
    end.synchronize()
    copy_ms = start.elapsed_time(end)
    forwards = [float(x) for x in args.forward_ms.split(",") if x]
    got = {(f, c): ([], []) for f in forwards for c in CASES}
    for rep in range(args.reps + 1):  # round 0 warms every case up
        for f in forwards:
            for c in CASES:
                # late: the rows' copy starts 0.2 ms before the forward ends
                delay, issue = one(torch, t, int(f * per_ms), c, args.pieces, int(max(f - 0.2, 0) * per_ms))
                if rep:
                    got[(f, c)][0].append(delay)
                    got[(f, c)][1].append(issue)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "mib": args.mib,
           "pieces": args.pieces, "reps": args.reps, "rows_copy_ms": copy_ms,
           "rows_copy_gbps": (args.mib << 20) / copy_ms / 1e6, "cases": {}}
    for (f, c), (delays, issues) in got.items():
        delays.sort()
        out["cases"][f"forward {f:g} ms, rows {c}"] = {
            "delay_median_ms": statistics.median(delays), "delay_p90_ms": delays[int(0.9 * (len(delays) - 1))],
            "issue_median_ms": statistics.median(issues)}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
