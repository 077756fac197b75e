"""Benchmark of the hidden-state dump (issue #7): dump overhead, the JSON path, ceilings.

Runs on a CUDA host where SGLang 0.5.17 with the kimi-sglang series is importable
(``bench/run_bench.sh run`` does the staging, as tests/gpu/run_e2e.sh). Phases:

1. ``ceilings`` (``python -m bench.ceilings``, a subprocess, so its CUDA context and
   pinned memory go away after): pinned device-to-host copy GB/s; /dev/shm write GB/s
   with safetensors ``save_file`` from the writer's thread count, for files of each dump
   size of the plan; and the writer alone (``sglang_ext.writer.DumpWriter`` with CUDA
   rows: start / copy_rows / finish), GB/s of files.
2. per model (random weights, built by ``python -m bench.models``): the servers of
   ``bench.servers``, started together (each once the one before has sized its KV
   cache): server A without the dump serves mode ``nodump`` (requests without the field)
   and mode ``json`` (``return_hidden_states: true``); server B with
   ``--dump-hidden-states-dir /dev/shm/...`` serves mode ``dump`` (each response waits for
   its file) and mode ``dump_early`` (answered once the file's name is reserved; the
   client waits on the lock while its next prompt runs, as ``sglang-ext extract`` does).
   Mode ``dump_fp8`` runs on a server D, B's flags plus ``--dump-hidden-states-dtype fp8``
   (the dtype is per server), started only when the mode is asked for; its cells report
   bytes per prompt token beside mode ``dump``'s (about half).
   Modes ``vllm_nodump`` and ``vllm_dump`` run the peer, vLLM 0.33 (``bench.peer``), on
   servers V and W beside ours: the same model files, prompts and cells; W extracts with
   vLLM's extract_hidden_states and its example connector, and a few of its files are
   compared with ours for the same prompts (``bench.peerfiles``). vLLM has no MLA
   support, so DeepseekV3 has no vLLM cells (the report says so).
   Every cell is a batch of requests with ``max_new_tokens=1`` sent by ``concurrency``
   client threads (closed loop); nodump and dump cells alternate so drift hits both alike.
3. headline ratios and targets (``report``), a JSON file and a Markdown table
   (``markdown``) in ``--out``, and a short table printed last.

``--dry-run`` prints the plan and needs neither torch nor a GPU. Results are written
after every phase, so a run cut short still leaves what it measured.
"""

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

from bench import ceilings, markdown, peer, plan as planning, profilers, report, servers
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
    results["targets"] = report.targets(results, results["headline"])
    with open(os.path.join(out_dir, stem + ".json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write(markdown.render_markdown(results))


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _ints(text):
    return [int(x) for x in text.split(",")]


def _cpu_map(text):
    """``"A=0-4,B=5-9"`` (``--server-cpus``) -> {"A": "0-4", "B": "5-9"}: a server of
    ``servers.KINDS`` and its CPUs in ``taskset -c`` syntax (commas inside a list are
    fine: ``A=0,2,4,B=1,3``)."""
    entries = []
    for tok in (t for t in text.split(",") if t):
        if "=" in tok:
            entries.append(tok)
        elif entries:
            entries[-1] += "," + tok
        else:
            raise argparse.ArgumentTypeError(f"{tok!r}: expected SERVER=CPUS, e.g. A=0-4,B=5-9")
    out = {}
    for e in entries:
        which, cpus = e.split("=", 1)
        try:
            # what taskset gets, normalized (not checked against this host: the plan may be for another)
            cpus = _cpu_text(config.parse_cpu_list(cpus, "CPU list", this_host=False))
        except ValueError:
            cpus = None
        if which not in servers.KINDS or cpus is None:
            raise argparse.ArgumentTypeError(
                f"{e!r}: expected SERVER=CPUS, SERVER one of {', '.join(servers.KINDS)} and CPUS "
                f"as for taskset -c (e.g. 0-4 or 0,2,4)")
        if which in out:
            raise argparse.ArgumentTypeError(f"server {which} appears twice")
        out[which] = cpus
    return out


def _cpu_text(cpus):
    """{0, 1, 2, 3, 6} -> "0-3,6" (taskset -c syntax)."""
    runs = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: expected a positive number of tokens")
    return value


def _labels(text):
    return [x for x in text.split(",") if x]


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--profile", choices=sorted(planning.PROFILES), default="full")
    ap.add_argument("--quick", dest="profile", action="store_const", const="quick",
                    help="the ~8-minute profile (same as --profile quick)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/kimi-bench-out"))
    ap.add_argument("--workdir", default="/tmp/kimi-bench", help="models and raw logs")
    ap.add_argument("--models", default="llama-mid,deepseek-tiny")
    ap.add_argument("--modes", default="nodump,dump,dump_early,json",
                    help="nodump (a), dump (b), dump_early (b'), json (c); also dump_fp8 (b on a "
                         "server D with --dump-hidden-states-dtype fp8), and the peer vLLM's "
                         "vllm_nodump and vllm_dump (servers V and W; Llama workloads only)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every cell of the grid (not the JSON cell) this many times, "
                         "interleaved (cells carry 'rep'; ratios pair cells of one repetition)")
    ap.add_argument("--counterbalance", action="store_true",
                    help="with --repeat: odd rounds run a shape's modes in reverse order")
    ap.add_argument("--prompt-lens", type=_ints, default=[512, 2048, 8192])
    ap.add_argument("--concurrency", type=_ints, default=[1, 8, 32])
    ap.add_argument("--cell-tokens", type=int, default=0, help="prompt tokens per cell (if 0: the profile's, times the model's cell_scale at concurrency >= 8)")
    ap.add_argument("--min-rounds", type=int, default=0, help="requests per client thread, at least")
    ap.add_argument("--json-requests", type=int, default=0, help="requests of the JSON cell")
    ap.add_argument("--ceiling-mib", type=int, default=0, help="MiB written per ceiling measurement")
    ap.add_argument("--skip-ceilings", action="store_true")
    ap.add_argument("--deadline-s", type=float, default=0, help="skip what would end later (profile's if 0)")
    ap.add_argument("--mem-fraction-static", type=float, default=0.3)
    ap.add_argument("--max-host-mb", type=int, default=0,
                    help=f"--dump-hidden-states-max-host-mb (default: the server's {config.DEFAULT_MAX_HOST_MB})")
    ap.add_argument("--max-total-tokens", type=_positive, default=0,
                    help="SGLang's --max-total-tokens for every SGLang server: equal KV pools "
                         "(default: each its own, from the memory free when it starts)")
    ap.add_argument("--server-cpus", type=_cpu_map, default={},
                    help="CPUs per server, as for taskset -c: e.g. A=0-4,B=5-9,D=10-14 (its "
                         "processes inherit them; default: any)")
    ap.add_argument("--chunked-prefill-size", type=int, default=0, help="(default: SGLang's, 8192 on an H200)")
    ap.add_argument("--cuda-graph", action="store_true", help="keep CUDA graphs on (longer start-up)")
    ap.add_argument("--sleep-on-idle", action="store_true")
    ap.add_argument("--case", default=None, help="results file name part (default: the profile)")
    ap.add_argument("--writer-log-wait-s", type=float, default=None,
                    help="after the cells, wait up to this long for the writer's next snapshot "
                         "log line (quick: 0, full: 65)")
    ap.add_argument("--no-trace", action="store_true",
                    help="run server B without KIMI_SGLANG_TRACE (no per-stage times)")
    ap.add_argument("--py-spy", type=_labels, default=["512x1", "2048x32"],
                    help="dump cells (PROMPTxCONC) to run again under py-spy; '' for none")
    ap.add_argument("--py-spy-modes", type=_labels, default=[],
                    help="modes whose --py-spy cells run again under py-spy, e.g. dump,dump_early "
                         "(default: dump; with --py-spy-kind wait, nodump and dump)")
    ap.add_argument("--py-spy-kind", choices=["gil", "wait"], default="gil",
                    help="gil: who holds the GIL (--gil, dump cells); wait: how long each thread "
                         "waits for it (--idle --native, no-dump and dump cells)")
    ap.add_argument("--py-spy-also", type=_labels, default=[],
                    help="with --py-spy-kind gil: more processes sampled in the same re-run, "
                         "comma-separated: frontend (the server's launch process: HTTP server and "
                         "TokenizerManager), client (this bench's own client threads)")
    ap.add_argument("--dump-root", default="/dev/shm", help="where server B's dump directory goes")
    ap.add_argument("--ports", type=_ints, default=[31000, 32000, 33000, 34000, 35000, 36000],
                    help="ports of servers A, B (and C, D, vLLM's V, W)")
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=0,
                    help="vLLM's --gpu-memory-utilization (default: --mem-fraction-static's number)")
    ap.add_argument("--vllm-args", default="",
                    help="more flags for vLLM's servers, appended last (shell syntax)")
    ap.add_argument("--peer-reference", choices=["hf", "none"], default="hf",
                    help="the file comparison with vLLM also checks each file against HF "
                         "transformers' float32 forward (hf), after the servers stop")
    ap.add_argument("--json-server", choices=["shared", "separate"], default="shared",
                    help="JSON mode on server A (shared) or on a third server C, so that A is "
                         "a plain server (see server_for)")
    ap.add_argument("--no-build", action="store_true", help="use the models already in --workdir")
    # tests/benchmark/test_bench.py rehearses the orchestration against a fake server
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
    try:
        peer.gpu_memory_utilization(args)  # splits --vllm-args too
    except ValueError as e:
        ap.error(str(e))
    kinds = {servers.server_for(args, m) for m in modes}
    if set(args.server_cpus) - kinds:
        ap.error(f"--server-cpus: server(s) {', '.join(sorted(set(args.server_cpus) - kinds))} not in this "
                 f"run (its modes start {', '.join(sorted(kinds))})")
    if args.counterbalance and args.repeat < 2:
        ap.error("--counterbalance needs --repeat 2 or more (it reverses every other round)")
    if args.counterbalance and args.repeat % 2:
        print(f"note: --counterbalance with --repeat {args.repeat}: one more round runs forward "
              f"than reversed", file=sys.stderr)
    problem = servers.ports_problem(args, modes) or servers.memory_problem(args, modes)
    if problem:
        ap.error(problem)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    unknown = [w for w in args.py_spy_also if w not in profilers.ALSO]
    if unknown:
        ap.error(f"--py-spy-also: unknown process {unknown[0]!r} (known: {', '.join(profilers.ALSO)})")
    if args.py_spy_also and not args.py_spy:
        ap.error("--py-spy-also samples during the --py-spy cells; --py-spy names none")
    if args.py_spy_also and args.py_spy_kind == "wait":
        ap.error("--py-spy-also samples with --gil only; --py-spy-kind wait pauses the process per sample")
    try:
        planning.writer_threads()
    except config.DumpConfigError as e:
        ap.error(str(e))
    if args.writer_log_wait_s is None:
        args.writer_log_wait_s = planning.PROFILES[args.profile]["writer_log_wait_s"]


def new_results(args, plan, gpu, date):
    return {
        "date": date.isoformat(timespec="seconds"), "gpu": gpu, "profile": args.profile,
        "versions": versions(), "argv": sys.argv[1:],
        "config": {k: plan[k] for k in ("modes", "cell_tokens", "min_rounds", "writer_threads",
                                        "max_host_mb", "deadline_s", "ceiling_mib")}
        | {"prompt_lens": args.prompt_lens, "concurrency": args.concurrency,
           "cuda_graph": args.cuda_graph, "chunked_prefill_size": args.chunked_prefill_size or None,
           "json_server": args.json_server, "mem_fraction_static": args.mem_fraction_static,
           "repeat": args.repeat,
           "writer_cpus": os.environ.get("KIMI_SGLANG_WRITER_CPUS", "").strip() or None,
           "counterbalance": args.counterbalance, "server_cpus": args.server_cpus or None,
           "max_total_tokens": args.max_total_tokens or None}
        | ({"vllm_gpu_memory_utilization": peer.gpu_memory_utilization(args), "vllm_args": args.vllm_args,
            "peer_reference": args.peer_reference}
           if any(peer.is_peer(m) for m in plan["modes"]) else {}),
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
            results["ceilings"] = ceilings.run(plan, args.prompt_lens, args.workdir, args.dump_root,
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
