"""Probe (CPU only, no SGLang, no GPU): what ``sglang_ext.hooks.on_prefill_result`` costs
the scheduler thread per prefill batch besides the rows copy, and where that goes.

Drives the hook with tests/test_hooks.py's stand-ins for SGLang's Req and ScheduleBatch and
a real writer process on a CPU arena: ``--batches`` batches of ``--reqs`` requests of
``--tokens`` tokens each, every request finishing in its batch and answered early (as
bench mode dump_early at 2k x 8, whose batches hold ~3-4 such requests), rows only 32
bytes wide so that the copy (a memcpy here, an asynchronous device-to-host copy on a GPU)
costs little. Prints the hook's time per batch (median, p90, p99, milliseconds), the
objects it leaves to the garbage collector per batch (net gc-tracked allocations, a
second pass with the collector off) and the functions with the most own time (cProfile,
a third pass). Files go to a temporary
directory under ``--dir`` (default /dev/shm) and are removed as it goes.

``--defer``: the hook in two calls, as v0.5.17 series 4 makes them
(``on_prefill_result(..., defer=True)`` before the outputs are streamed,
``on_prefill_output()`` after); the times are then also given for the first call alone,
the part on the answers' path.

    python bench/probes/hook_cpu.py [--batches 300] [--reqs 4] [--tokens 2048] [--defer]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import shutil
import sys
import tempfile
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "tests"), ROOT]

import test_hooks as th  # noqa: E402
import torch  # noqa: E402

from sglang_ext import hooks  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--reqs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--defer", action="store_true", help="two calls, as v0.5.17 series 4 makes them")
    args = ap.parse_args(argv)
    d = tempfile.mkdtemp(prefix="hook-probe-", dir=args.dir)
    hooks.setup_model(th.make_runner(d, num_layers=4, layers="1,2,3,4", max_mb=512))
    rows = torch.zeros(args.reqs * args.tokens, 4 * th.HIDDEN)

    def batch(k):
        reqs = []
        for j in range(args.reqs):
            r = th.Req(f"r{k}-{j}", args.tokens, 1)
            r.sampling_params = types.SimpleNamespace(custom_params={"hidden_states_wait": False})
            reqs.append(r)
        b = types.SimpleNamespace(reqs=reqs, forward_mode=th.Mode(), decoding_reqs=[],
                                  prefix_lens=[0] * args.reqs)
        return b, types.SimpleNamespace(hidden_states=rows), [args.tokens] * args.reqs

    def run(n, prof=None, tracked=None, on_path=None):
        times = []
        for k in range(n):
            b, out, lens = batch(k)
            c0 = gc.get_count()[0]
            t = time.perf_counter()
            if prof:
                prof.enable()
            hooks.on_prefill_result(b, out, lens, **({"defer": True} if args.defer else {}))
            t_named = time.perf_counter()
            if args.defer:
                hooks.on_prefill_output()
            if prof:
                prof.disable()
            times.append(time.perf_counter() - t)
            if on_path is not None:
                on_path.append(t_named - t)
            if tracked is not None:
                tracked.append(gc.get_count()[0] - c0)
            if k % 50 == 49:  # keep the directory small
                hooks._DUMPER.writer.wait_idle(30)
                for name in os.listdir(d):
                    if name.endswith(".safetensors"):
                        os.unlink(os.path.join(d, name))
        return sorted(times)

    try:
        run(20)  # warm-up
        on_path = []
        t = run(args.batches, on_path=on_path)
        for what, v in [("hook", t)] + ([("before the outputs", sorted(on_path))] if args.defer else []):
            q = [1e3 * v[int(p * (len(v) - 1))] for p in (0.5, 0.9, 0.99)]
            print(f"{what} per batch of {args.reqs} x {args.tokens} tokens, {len(v)} batches: "
                  f"median {q[0]:.3f} ms, p90 {q[1]:.3f} ms, p99 {q[2]:.3f} ms")
        tracked = []
        gc.collect()
        gc.disable()
        try:
            run(args.batches, tracked=tracked)
        finally:
            gc.enable()
        print(f"net gc-tracked allocations per batch: {sum(tracked) / len(tracked):.1f}")
        prof = cProfile.Profile()
        run(args.batches, prof)
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(15)
    finally:
        hooks._DUMPER.writer.close(timeout=30)
        os.close(hooks._DUMPER.dir_fd)
        hooks._DUMPER = None
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
