"""A cell run once more under py-spy, after its measured run: py-spy on a server's
scheduler process (``--py-spy PROMPTxCONC``, ``--py-spy-kind gil|wait``). A failed profile
is recorded as ``{"error": ...}`` and never ends the model's cells.

The summaries are pure functions of py-spy's ``--format raw`` text (``summarize_py_spy``,
``summarize_gil_wait``), checked on hand-made samples by tests/benchmark/test_bench.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

from bench.loadgen import cell_prompts, run_cell

PY_SPY_RATE = 100  # samples per second

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


def gil_window_share(summary, window_s, rate=PY_SPY_RATE):
    """Per thread of a ``--gil`` profile's ``summarize_py_spy`` summary: its samples /
    (rate x window), the share of the sampled window in which it held the GIL."""
    return {t: share * summary["samples"] / (rate * window_s)
            for t, share in summary["threads"].items()}


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


# The other processes ``--py-spy-also`` samples beside the scheduler, and how each is found:
# SGLang's front end (the launch process: its HTTP server and TokenizerManager, which
# handle every request and response) and the bench's own client (its load threads).
ALSO = {"frontend": "the server's launch process (HTTP server, TokenizerManager)",
        "client": "the bench's own process (its client threads)"}


def also_pid(server, which):
    """The pid of ``which`` (a key of ``ALSO``) for ``server``."""
    if which == "frontend":
        return server.proc.pid  # testing/server.launch starts the launch module itself
    if which == "client":
        return os.getpid()
    raise ValueError(f"unknown process {which!r}: one of {', '.join(ALSO)}")


def py_spy_slowdown(kind):
    """How much slower a cell runs under py-spy of ``kind`` (``--py-spy-kind``): ``gil``
    (non-blocking) ~2x; ``wait`` (blocking ``--idle --native``) 25-29x, measured 2026-12-01."""
    return 30 if kind == "wait" else 2


def py_spy_need_s(args, cell, r):
    """Seconds the py-spy re-run of the cell just measured (``r``, its result) needs
    before the deadline, or None when it is not asked for: its shape is in ``--py-spy``,
    its mode in ``--py-spy-modes`` (default by ``--py-spy-kind``, gil: dump cells; wait:
    no-dump too), and it did not fail: the slowed re-run (``py_spy_slowdown``) plus a
    minute to attach and stop."""
    label = f"{cell['prompt_len']}x{cell['concurrency']}"
    sampled = tuple(getattr(args, "py_spy_modes", None) or
                    (("dump", "nodump") if args.py_spy_kind == "wait" else ("dump",)))
    if cell["mode"] not in sampled or label not in args.py_spy or r.get("error"):
        return None
    return py_spy_slowdown(args.py_spy_kind) * r.get("wall_s", 60) + 60


def profile_cell(server, cell, spec, rng, out_stem, kind="gil", also=()):
    """Run ``cell`` again while py-spy samples the server's scheduler process (all
    threads, ``PY_SPY_RATE`` Hz, without pausing it, ``--gil``: only the thread holding
    the GIL is recorded; the window also holds ~1 s before the load, to attach, and the
    time to stop); returns ``summarize_py_spy`` of the samples plus ``window_s`` and
    ``gil_window_share`` (per thread: samples / (rate x window), the share of the window
    in which that thread held the GIL), or ``{"error": ...}`` when py-spy is missing or
    may not attach. Why the GIL: every thread of the scheduler process (SGLang's event
    loop, which also launches the forward's kernels, and the writer threads) runs Python
    under one GIL, so what the writer holds the scheduler waits for. The raw samples go
    to ``out_stem.txt``.

    ``kind="wait"`` samples instead with ``--idle --native`` (blocking: py-spy pauses
    the process for each sample, so the cell runs slower; compare servers A and B under
    the same sampling) and returns ``summarize_gil_wait``: how much of its wall time
    each thread, the scheduler above all, spent waiting for the GIL, which ``--gil``
    cannot see.

    ``also`` (keys of ``ALSO``, ``--gil`` only): more processes sampled the same way in the
    same re-run, each summarized under ``out["also"][name]`` (its raw samples in
    ``out_stem-<name>.txt``), so the window shares say whether the front end or the client
    was busier than the scheduler."""
    exe = shutil.which("py-spy")
    if not exe:
        return {"error": "py-spy not on PATH"}
    try:
        pid = scheduler_pid(server)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}
    targets = {"": (pid, out_stem + ".txt")}  # "": the scheduler
    if kind != "wait":
        targets.update({w: (also_pid(server, w), f"{out_stem}-{w}.txt") for w in dict.fromkeys(also)})
    for _, raw in targets.values():  # an earlier run's samples must not pass for this one's
        if os.path.exists(raw):
            os.remove(raw)
    # made before sampling: ~1 s of the client's Python per 1M tokens, not the load's
    prompts = cell_prompts(cell, spec, rng)
    t0 = time.monotonic()
    how = ["--idle", "--native"] if kind == "wait" else ["--gil", "--nonblocking"]
    procs = {w: subprocess.Popen([exe, "record", "--pid", str(p), "--rate", str(PY_SPY_RATE),
                                  "--format", "raw", "--threads", *how, "--output", raw],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for w, (p, raw) in targets.items()}
    time.sleep(1.0)  # attach before the load starts
    if procs[""].poll() is not None:
        logs = _stop(procs)
        return {"error": f"py-spy exited {procs[''].returncode}: {logs[''][-400:]}"}
    r = {}
    try:
        r = run_cell(server, cell, spec, rng, cell["mode"], prompts=prompts)
    except Exception as e:  # noqa: BLE001 - a failed profile must not end the model's cells
        r = {"error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        window = time.monotonic() - t0
        logs = _stop(procs)
    summaries = {}
    for w, (_, raw) in targets.items():
        if not os.path.exists(raw):
            got = {"error": f"py-spy wrote nothing: {logs[w][-400:]}"}
        else:
            with open(raw) as f:
                text = f.read()
            got = summarize_gil_wait(text) if kind == "wait" else summarize_py_spy(text)
            got["raw"] = os.path.basename(raw)
            if kind != "wait":
                got["gil_window_share"] = gil_window_share(got, window)
        if w:
            got["process"] = ALSO[w]
        summaries[w] = got
    out = summaries.pop("")
    if summaries:
        out["also"] = summaries
    if out.get("error"):
        return out
    out["window_s"] = window
    out["kind"] = kind
    out["cell_prefill_tps_sampled"] = r.get("prefill_tps")
    if r.get("error"):
        out["cell_error"] = r["error"]
    return out


def _stop(procs):
    """Stop the py-spys of ``procs`` (name -> Popen) together (SIGINT to all first: each
    writes its output on Ctrl-C); returns what each printed."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    logs = {}
    for w, proc in procs.items():
        try:
            logs[w] = proc.communicate(timeout=60)[0] or ""
        except subprocess.TimeoutExpired:
            proc.kill()
            logs[w] = proc.communicate()[0] or ""
    return logs

