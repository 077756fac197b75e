"""Does the dump's device-to-host copy delay SGLang's own small result copy?

``python -m bench.copyprobe [--out FILE]`` (CUDA only, no server, ~10 s): the latency of a
small device-to-host copy on the current stream (what SGLang's overlap scheduler waits for
after each batch: the next token ids, a few bytes, ``copy_done``), alone and while a large
device-to-host copy runs on another stream (the dump's rows of one extend batch into the
pinned arena: 64 MiB for 8192 deepseek-tiny tokens, ``DumpWriter.copy_rows`` on its copy
stream), the large copy issued whole or in pieces. Prints one JSON object: per case the
median and p90 of the small copy's latency in ms over ``--reps`` tries.

Why: on deepseek-tiny the dump adds ~3 ms to the scheduler's time per 8192-token batch
(run ``rounds-deepseek``'s server logs) while its Python on the scheduler thread is a small
share of that (docs/performance.md); a copy engine busy with the dump's rows for ~1.2 ms
(64 MiB at ~55 GB/s) would hold the small copy that ``copy_done`` waits on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def small_copy_ms(torch, small, host_small, big, host_big, stream, pieces):
    """Latency (ms, host clock) of one small D2H copy on the current stream, issued right
    after a large one on ``stream`` cut into ``pieces`` copies (0: no large copy)."""
    torch.cuda.synchronize()
    if pieces:
        n = big.numel() // pieces
        with torch.cuda.stream(stream):
            for i in range(pieces):
                host_big[i * n:(i + 1) * n].copy_(big[i * n:(i + 1) * n], non_blocking=True)
    t = time.perf_counter()
    small.add_(1)
    host_small.copy_(small, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    ms = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    return ms


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.copyprobe", description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="the large copy's size (MiB)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench.copyprobe: needs CUDA")
    big = torch.empty(args.mib << 20, dtype=torch.uint8, device="cuda")
    host_big = torch.empty(args.mib << 20, dtype=torch.uint8).pin_memory()
    small = torch.zeros(64, dtype=torch.int64, device="cuda")
    host_small = torch.empty(64, dtype=torch.int64).pin_memory()
    stream = torch.cuda.Stream()
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "mib": args.mib,
           "reps": args.reps, "cases": {}}
    t = time.perf_counter()
    with torch.cuda.stream(stream):
        host_big.copy_(big, non_blocking=True)
    torch.cuda.synchronize()
    out["large_copy_gbps"] = (args.mib << 20) / (time.perf_counter() - t) / 1e9
    for pieces in (0, 1, 4, 16, 64):
        small_copy_ms(torch, small, host_small, big, host_big, stream, pieces)  # warm
        ms = sorted(small_copy_ms(torch, small, host_small, big, host_big, stream, pieces)
                    for _ in range(args.reps))
        out["cases"]["alone" if not pieces else f"beside {args.mib} MiB in {pieces}"] = {
            "median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))]}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
