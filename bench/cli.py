"""``python -m bench``: the command line, the whole run (ceilings, then each model's
``runner``), and the results file (``<date>-<gpu>-<case>.json`` and ``.md`` in ``--out``,
rewritten after every phase, so a run cut short keeps what it measured). ``--dry-run``
prints the plan and needs neither torch nor a GPU (bench/README.md)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from sglang_ext import config

from bench import ceilings, markdown, peer, plan as planning, report, servers, targets
from bench.models import MODELS
from bench.runner import Clock, run_model


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
    if out["sglang-ext"] is None:  # imported from the tree (PYTHONPATH), as on the GPU host
        import sglang_ext

        out["sglang-ext"] = f"{sglang_ext.__version__} (source tree)"
    # the series the run's servers were patched with, as tests/gpu/stage.sh was told (None:
    # the one made for the staged release, which stage.sh prints)
    out["series"] = os.environ.get("KIMI_SGLANG_SERIES")
    return out


def save_results(results, out_dir, stem):
    """Headline and targets recomputed, then ``stem``.json and ``stem``.md in ``out_dir``."""
    results["headline"] = report.headline(results)
    results["targets"] = targets.targets(results, results["headline"])
    with open(os.path.join(out_dir, stem + ".json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write(markdown.render_markdown(results))


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _ints(text):
    return [int(x) for x in text.split(",")]


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m bench", description="the hidden-state dump benchmark")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--profile", choices=sorted(planning.PROFILES), default="full")
    ap.add_argument("--quick", dest="profile", action="store_const", const="quick",
                    help="the ~8-minute profile (same as --profile quick)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/kimi-bench-out"))
    ap.add_argument("--workdir", default="/tmp/kimi-bench", help="models and raw logs")
    ap.add_argument("--models", default="llama-mid,deepseek-tiny")
    ap.add_argument("--modes", default="nodump,dump,dump_early,json",
                    help=f"comma-separated, of {', '.join(planning.MODES)} (bench/README.md)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every grid cell this many times, interleaved (cells carry 'rep')")
    ap.add_argument("--counterbalance", action="store_true",
                    help="odd rounds run their modes in reverse order (ABBA): a drift over a shape's "
                         "rounds falls on every mode alike in the pooled ratios")
    ap.add_argument("--prompt-lens", type=_ints, help="prompt tokens of the grid (default: each model's)")
    ap.add_argument("--concurrency", type=_ints, help="client threads of the grid (default: each model's)")
    ap.add_argument("--cell-tokens", type=int, default=0,
                    help="prompt tokens per cell (0: the profile's, times the model's cell_scale at concurrency >= 8)")
    ap.add_argument("--gen-tokens", type=int, default=512,
                    help="tokens each request of the generate modes (gen_*) generates (ignore_eos, greedy)")
    ap.add_argument("--gen-requests", type=int, default=0,
                    help="requests per generate cell, at least one per client (0: the profile's ~2k (quick) or "
                         "~8k (full) generated tokens, at least one per client per round)")
    ap.add_argument("--skip-ceilings", action="store_true", help="no host ceilings, no writer-alone run")
    ap.add_argument("--deadline-s", type=float, default=0, help="skip what would end later (0: the profile's)")
    ap.add_argument("--mem-fraction-static", type=float, default=0.3)
    ap.add_argument("--max-host-mb", type=int, default=0,
                    help=f"--dump-hidden-states-max-host-mb (default: the server's {config.DEFAULT_MAX_HOST_MB})")
    ap.add_argument("--case", default=None, help="results file name part (default: the profile)")
    ap.add_argument("--dump-root", default="/dev/shm", help="where the dump directories go")
    ap.add_argument("--ports", type=_ints, default=[31000, 32000, 33000, 34000, 35000, 36000],
                    help="ports of servers A, B, D, V, W, S")
    ap.add_argument("--mooncake-port", type=int, default=36500,
                    help="the store modes' mooncake_master (its metrics: the next port)")
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=0,
                    help="vLLM's --gpu-memory-utilization (default: --mem-fraction-static's number)")
    ap.add_argument("--peer-reference", choices=["hf", "none"], default="hf",
                    help="the file comparison with vLLM also checks each file against HF "
                         "transformers' float32 forward (hf), after the servers stop")
    ap.add_argument("--no-build", action="store_true", help="use the models already in --workdir")
    # tests/benchmark rehearses the orchestration against stand-in servers
    ap.add_argument("--server-module", default="sglang.launch_server", help=argparse.SUPPRESS)
    ap.add_argument("--vllm-server-module", default=peer.DEFAULT_MODULE, help=argparse.SUPPRESS)
    return ap


def check_args(ap, args):
    """Refuse what cannot run (``ap.error``: usage and exit status 2)."""
    for name in args.models.split(","):
        if name and name not in MODELS:
            ap.error(f"unknown model {name!r} (known: {', '.join(MODELS)})")
    modes = args.modes.split(",")
    for mode in modes:
        if mode not in planning.MODES:
            ap.error(f"unknown mode {mode!r} (known: {', '.join(planning.MODES)})")
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.gen_tokens < 1 or args.gen_requests < 0:
        ap.error("--gen-tokens must be >= 1 and --gen-requests >= 0")
    problem = servers.ports_problem(args, modes) or servers.memory_problem(args, modes)
    if problem:
        ap.error(problem)
    try:
        planning.writer_threads()
    except config.DumpConfigError as e:
        ap.error(str(e))


def new_results(args, plan, gpu, date):
    return {
        "date": date.isoformat(timespec="seconds"), "gpu": gpu, "profile": args.profile,
        "versions": versions(), "argv": sys.argv[1:],
        "config": {k: plan[k] for k in ("modes", "cell_tokens", "min_rounds", "writer_threads",
                                        "max_host_mb", "deadline_s", "ceiling_mib")}
        | {"prompt_lens": args.prompt_lens, "concurrency": args.concurrency,
           "mem_fraction_static": args.mem_fraction_static, "repeat": args.repeat,
           "counterbalance": plan["counterbalance"],
           "writer_cpus": os.environ.get("KIMI_SGLANG_WRITER_CPUS", "").strip() or None}
        | ({"vllm_gpu_memory_utilization": peer.gpu_memory_utilization(args),
            "peer_reference": args.peer_reference}
           if any(peer.is_peer(m) for m in plan["modes"]) else {})
        | ({"gen_tokens": plan["gen_tokens"]} if "gen_tokens" in plan else {}),
        "ceilings": {}, "models": {}, "phases": {}, "skipped": [],
    }


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    plan = planning.make_plan(args)
    for name, m in plan["models"].items():
        if not m["cells"]:
            ap.error(f"--modes {args.modes} gives model {name} no cell"
                     + (f" ({m['peer_unsupported']})" if m.get("peer_unsupported") else ""))
    if args.dry_run:
        planning.print_plan(plan)
        return 0

    # SIGTERM (a timeout, the device's limit) unwinds like Ctrl-C: the servers (in their
    # own sessions) are stopped and the results so far written by the finally blocks.
    signal.signal(signal.SIGTERM, _interrupt)
    clock = Clock(plan["deadline_s"])
    os.makedirs(args.out, exist_ok=True)
    gpu = gpu_name()
    date = datetime.datetime.now(datetime.timezone.utc)
    stem = f"{date:%Y-%m-%d}-{short_gpu(gpu)}-{args.case or args.profile}"
    results = new_results(args, plan, gpu, date)
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
        try:
            results["ceilings"] = ceilings.run(plan, args.workdir, args.dump_root,
                                               timeout=max(30, min(180, clock.left() - 60)))
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
    print(markdown.summary_table(results))
    return 0
