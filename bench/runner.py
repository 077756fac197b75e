"""One model's run: build it, start the store modes' Mooncake Store, start its servers, sample
their memory, warm them up, collect a few files of ours and vLLM's for the same prompts, run
the plan's cells in order (skipping what the deadline, less the file comparison's time, leaves
no room for), read the writer's host-memory peaks, stop the servers, compare those files.
Results go into ``results["models"][name]``, saved after every cell.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import time

from bench import child_env, gen, loadgen, module_argv, peer, peerfiles, report, servers
from bench import modes as registry
from bench.store import BenchStore
from bench import plan as planning
from bench.models import MODELS, file_bytes, model_path
from bench.plan import peer_files_wanted


class Clock:
    """Seconds since the run started, and left before its deadline."""

    def __init__(self, deadline_s):
        self.t0 = time.monotonic()
        self.deadline_s = deadline_s

    def left(self):
        return self.deadline_s - (time.monotonic() - self.t0)

    def elapsed(self):
        return time.monotonic() - self.t0


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


def cell_line(label, r):
    """The line printed after a cell."""
    if "output_tps" in r:  # a generate cell (bench/gen.py)
        return (f"  {label}: {r['output_tps']:.0f} output tok/s, {r.get('samples_per_s', float('nan')):.2f} "
                f"samples/s, p50 {r.get('p50_s', float('nan')):.3f} s" + (
                    f" (generate {r['generate_p50_s']:.3f} s + capture {r['capture_p50_s']:.3f} s)"
                    if "capture_p50_s" in r else "") + (f"  ERROR {r['error']}" if r.get("error") else ""))
    extra = (f" {r['write_gbps']:.2f} GB/s written" if r.get("write_gbps") else "") + (
        f", {r['bytes_per_token']:.0f} B/token" if r.get("bytes_per_token") else "") + (
        f" {r['response_bytes'] / r['requests'] / 1e6:.0f} MB/resp" if r.get("response_bytes") else "")
    return (f"  {label}: {r.get('prefill_tps', float('nan')):.0f} tok/s, p50 "
            f"{r.get('p50_s', float('nan')):.3f} s, p99 {r.get('p99_s', float('nan')):.3f} s{extra}"
            + (f"  ERROR {r['error']}" if r.get("error") else ""))


class ModelRun:
    """The state of one model's run (see the module's docstring); ``run()`` does it."""

    def __init__(self, args, plan, name, clock, results, save, skipped):
        self.args, self.plan, self.name, self.clock = args, plan, name, clock
        self.results, self.save, self.skipped = results, save, skipped
        self.spec = MODELS[name]
        self.mp = plan["models"][name]
        self.m = results["models"].setdefault(name, {
            "hidden_size": self.spec.hidden_size, "num_layers": self.spec.num_layers, "layer_ids": self.spec.layer_ids,
            "servers": self.mp["servers"], "cells": [], "prompt_lens": self.mp["prompt_lens"],
            "concurrency": self.mp["concurrency"], "startup_s": {}})
        if self.mp.get("peer_unsupported"):
            self.m["peer_unsupported"] = self.mp["peer_unsupported"]
        self.peer_pairs = None  # pairs.json of the file comparison, once collected
        self.dirs = {w: servers.dump_dir(args, name, w) for w in self.mp["servers"] if servers.dumps(w)}
        self.servers = {}
        self.rng = random.Random(f"{name}-bench")
        self.samplers = {}
        self.trace_path = None
        self.store = None  # the store modes' BenchStore, while it runs
        self.shm_free = 0  # bytes free under --dump-root after the warm-up

    def phase(self, key, t0):
        self.results["phases"][f"{self.name}/{key}"] = round(time.monotonic() - t0, 1)

    def clear(self, mode):
        """Empty the dump directories of ``mode``'s servers after its cell."""
        for which in servers.servers_of(self.args, mode):
            if servers.dumps(which):
                loadgen.clear_dump_dir(self.dirs[which])

    def run(self):
        args, name = self.args, self.name
        t0 = time.monotonic()
        os.makedirs(args.workdir, exist_ok=True)
        if not args.no_build:
            subprocess.run(module_argv("models", name, model_path(args, name)), check=True, timeout=300,
                           env=child_env())
        self.phase("build_s", t0)
        for d in self.dirs.values():
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
        logs = os.path.join(args.workdir, "logs")
        os.makedirs(logs, exist_ok=True)
        self.trace_path = os.path.join(logs, f"trace-{name}.jsonl")
        if os.path.exists(self.trace_path):
            os.unlink(self.trace_path)
        specs = {w: (cmd, os.path.join(logs, f"server-{name}-{w}.log"), servers.server_env(w, self.trace_path))
                 for w, cmd in self.mp["servers"].items()}
        try:
            if self.mp.get("store"):
                t0 = time.monotonic()
                self.store = BenchStore(self.mp["store"]["master_port"], self.mp["store"]["segment_bytes"],
                                        logs).start()
                self.phase("store_start_s", t0)
            t0 = time.monotonic()
            servers.start_pair(specs, self.servers, timeout=max(60, min(420, self.clock.left() - 40)))
            self.phase("start_s", t0)
            self.m["startup_s"] = {w: s.startup_s for w, s in self.servers.items()}
            self.m["kv_tokens"] = {w: servers.kv_tokens(s.log_text()) for w, s in self.servers.items()}
            print(f"[{name}] servers up in {time.monotonic() - t0:.0f} s {self.m['startup_s']}", flush=True)
            for w, s in self.servers.items():
                if servers.api_of(w) == "vllm" and peer.version_of(s.log_text()):
                    self.results["versions"]["vllm"] = peer.version_of(s.log_text())
            self.start_sampling()
            t0 = time.monotonic()
            for w, s in self.servers.items():
                mode = {"V": "vllm_nodump", "W": "vllm_dump"}.get(w)
                loadgen.warm_up(s, self.spec.vocab, self.rng, self.mp["prompt_lens"],
                                json_too="--enable-return-hidden-states" in s.command, concs=self.mp["concurrency"],
                                mode=mode, store=self.store if servers.stores(w) else None)
            self.warm_up_gen()
            for d in self.dirs.values():
                loadgen.clear_dump_dir(d)
            self.phase("warmup_s", t0)
            self.collect_peer_files()
            self.shm_free = shutil.disk_usage(args.dump_root).free
            t0 = time.monotonic()
            for cell in self.mp["cells"]:
                self.run_cell(cell)
            self.phase("cells_s", t0)
            checked = [c["file_check"] for c in self.m["cells"]
                       if c.get("file_check") and not peer.is_peer(c["mode"])]
            if checked:
                self.m["file_check"] = checked[0]
            self.host_memory()
        finally:
            t0 = time.monotonic()
            servers.stop_all(list(self.servers.values()))
            if self.store is not None:
                self.store.stop()
                self.store = None
            self.phase("stop_s", t0)
            for w, s in self.servers.items():
                copy_log(s.log_path, os.path.join(args.out, f"server-{name}-{w}.log"))
            for d in self.dirs.values():
                shutil.rmtree(d, ignore_errors=True)
            self.compare_peer_files()
            self.save()

    def peer_dir(self):
        return os.path.join(self.args.workdir, "peer-files", self.name)

    def reference_s(self):
        """Time the file comparison's float32 reference needs (``plan.reference_s``, an
        assumption; an overrun costs the reference only, ``compare_peer_files``)."""
        return planning.reference_s(self.spec)

    def reserve_s(self):
        """Seconds the cells leave before the deadline for the file comparison after the
        servers stop (``plan.peer_files_s``; nothing without collected files)."""
        if not self.peer_pairs:
            return 0
        return planning.peer_files_s(self.spec, self.args.peer_reference)

    def collect_peer_files(self):
        """A few prompts through our server B and vLLM's W, after the warm-up and before
        the cells (so a run cut short still has them), their files kept for
        ``compare_peer_files`` (``bench.peerfiles``); a failure is recorded, not raised."""
        args = self.args
        if not (peer_files_wanted(args.modes.split(","), self.name) and {"B", "W"} <= set(self.servers)):
            return
        if self.clock.left() < 60:
            self.m["peer_files"] = {"error": f"deadline: {self.clock.left():.0f} s left"}
            return
        t0 = time.monotonic()
        shutil.rmtree(self.peer_dir(), ignore_errors=True)
        try:
            # the files' hidden size is the served model's (its config.json), not the spec's copy
            with open(os.path.join(model_path(args, self.name), "config.json")) as f:
                hidden = json.load(f)["hidden_size"]
            self.peer_pairs = peerfiles.collect(self.servers["B"], self.servers["W"], self.spec.vocab, self.rng,
                                                self.mp["prompt_lens"], self.peer_dir(), self.spec.layer_ids, hidden)
        except Exception as e:  # noqa: BLE001
            self.m["peer_files"] = {"error": f"collecting: {type(e).__name__}: {e}"[:500]}
        for w in ("B", "W"):
            loadgen.clear_dump_dir(self.dirs[w])
        self.phase("peer_collect_s", t0)

    def _peerfiles(self, reference):
        """One ``python -m bench.peerfiles`` run (a subprocess: the reference's CUDA memory
        goes with it): its comparison dict and printed verdict. Raises RuntimeError
        (failed), subprocess.TimeoutExpired (the deadline came first)."""
        out = os.path.join(self.peer_dir(), f"compared-{reference}.json")
        cmd = module_argv("peerfiles", self.peer_pairs, out, "--model-path", model_path(self.args, self.name),
                          "--reference", reference)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(),
                              timeout=max(20, self.clock.left() - 10))
        if proc.returncode != 0:
            raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-1500:]}")
        with open(out) as f:
            return json.load(f), proc.stdout.strip()

    def compare_peer_files(self):
        """Compare the collected files: first with each other (seconds, kept whatever
        follows), then, with ``--peer-reference hf`` and time for ``reference_s`` left,
        each against HF's float32 forward, which then replaces the first; a reference that
        fails or overruns is recorded as ``reference_error`` beside the first."""
        if not self.peer_pairs:
            return
        t0 = time.monotonic()
        try:
            self.m["peer_files"], verdict = self._peerfiles("none")
            print(f"  [{self.name}] files ours vs vLLM: {verdict}", flush=True)
        except Exception as e:  # noqa: BLE001
            self.m["peer_files"] = {"error": f"comparing: {type(e).__name__}: {e}"[:1500]}
            print(f"  [{self.name}] files ours vs vLLM: ERROR {str(e)[:300]}", flush=True)
        if self.args.peer_reference == "hf" and "error" not in self.m["peer_files"]:
            if self.clock.left() < self.reference_s():
                self.m["peer_files"]["reference_skipped"] = f"deadline: {self.clock.left():.0f} s left"
            else:
                try:
                    self.m["peer_files"], verdict = self._peerfiles("hf")
                    print(f"  [{self.name}] files ours vs vLLM vs HF float32: {verdict}", flush=True)
                except Exception as e:  # noqa: BLE001
                    self.m["peer_files"]["reference_error"] = f"{type(e).__name__}: {e}"[:1500]
                    print(f"  [{self.name}] HF reference: ERROR {str(e)[:300]}", flush=True)
        shutil.rmtree(self.peer_dir(), ignore_errors=True)
        self.phase("peer_compare_s", t0)

    # the sampled servers and the key of each one's baseline (its peak and growth: the
    # same with _peak_ and _delta_)
    SAMPLED = (("B", "rss_baseline_bytes"), ("A", "rss_baseline_bytes_nodump"),
               ("W", "rss_baseline_bytes_vllm_dump"), ("V", "rss_baseline_bytes_vllm_nodump"))

    def start_sampling(self):
        """Memory of server B's process tree from before the warm-up: that is where it
        first allocates its pinned buffers of every size. Server A (same model, no dump) is
        sampled alike; it also serves the JSON cells, so its growth is an upper bound for
        a plain server's, not a control. vLLM's servers (W, V) too, when they run."""
        if not {"B", "W"} & set(self.servers):
            return
        hm = self.m["host_memory"] = {"cap_bytes": self.plan["max_host_mb"] << 20}
        try:
            for which, key in self.SAMPLED:
                if which in self.servers:
                    sampler = loadgen.RssSampler(self.servers[which].proc.pid)
                    hm[key] = sampler.rss()
                    self.samplers[which] = sampler.__enter__()
        except Exception as e:  # noqa: BLE001 - psutil missing: log parse only
            print(f"  no RSS sampling: {e}")
            for sampler in self.samplers.values():
                sampler.__exit__(None, None, None)
            self.samplers = {}

    def warm_up_gen(self):
        """Each generate mode of the plan, a short burst at each of its concurrencies
        (``gen.warm_up``), at its shortest prompt length."""
        for mode in registry.GEN_MODES:
            cells = [c for c in self.mp["cells"] if c["mode"] == mode]
            if cells:
                kinds = servers.servers_of(self.args, mode)
                gen.warm_up(self.servers[kinds[0]], self.servers[kinds[1]] if len(kinds) > 1 else None, mode,
                            self.spec.vocab, self.rng, min(c["prompt_len"] for c in cells),
                            [c["concurrency"] for c in cells])

    def measure(self, cell, server):
        """The cell's measured run: its results entry (``error`` when it failed)."""
        mode = cell["mode"]
        try:
            if registry.is_gen(mode):
                kinds = servers.servers_of(self.args, mode)
                return gen.run_cell(server, self.servers[kinds[1]] if len(kinds) > 1 else None, cell,
                                    self.spec.vocab, self.rng, mode, cell["gen_tokens"],
                                    trace_path=self.trace_path if any(map(servers.dumps, kinds)) else None)
            traced = mode in report.DUMP_MODES and not peer.is_peer(mode)  # the trace is our writer's
            return loadgen.run_cell(server, cell, self.spec.vocab, self.rng, mode,
                                    trace_path=self.trace_path if traced else None,
                                    store=self.store if registry.BY_NAME[mode].store else None)
        except Exception as e:  # noqa: BLE001
            return {"mode": mode, "prompt_len": cell["prompt_len"], "concurrency": cell["concurrency"],
                    "requests": cell["requests"], "error": f"{type(e).__name__}: {e}"[:500]}

    def run_cell(self, cell):
        args, name, clock = self.args, self.name, self.clock
        label = f"{name} {cell['mode']} {cell['prompt_len']}x{cell['concurrency']}" + (
            f" #{cell['rep']}" if "rep" in cell else "")
        need = planning.cell_need_s(cell, self.m["cells"]) + self.reserve_s()
        if clock.left() < need:
            self.skipped.append(f"{label} (deadline: {clock.left():.0f} s left)")
            print(f"  skip {label}: deadline", flush=True)
            return
        cell = dict(cell)
        mode = cell["mode"]
        # the store's segment is sized for its cells (plan); files share --dump-root
        if mode in report.DUMP_MODES and not registry.BY_NAME[mode].store and cell["dump_bytes"] > 0.6 * self.shm_free:
            per = file_bytes(self.spec, cell["prompt_len"], registry.BY_NAME[mode].fp8)
            cell["requests"] = max(cell["concurrency"], int(0.6 * self.shm_free // per))
            cell["scaled_for_shm"] = True
        server = self.servers[servers.server_for(args, mode)]
        r = self.measure(cell, server)
        if cell.get("scaled_for_shm"):
            r["scaled_for_shm"] = True
        if "rep" in cell:
            r["rep"] = cell["rep"]
        self.clear(mode)
        self.m["cells"].append(r)
        print(cell_line(label, r), flush=True)
        self.save()

    def host_memory(self):
        """The sampled growth of each server's memory, and the writer's host-memory peaks
        from server B's log (its counters every 5 s: ``servers.server_env``)."""
        hm = self.m.get("host_memory")
        for which, key in self.SAMPLED:
            sampler = self.samplers.pop(which, None)
            if sampler:
                sampler.__exit__(None, None, None)
                if sampler.peak:
                    hm[key.replace("baseline", "delta")] = max(0, sampler.peak - hm[key])
                    if which == "B":
                        hm["rss_peak_bytes"] = sampler.peak
        if "B" in self.servers:
            log_b = self.servers["B"].log_text()
            hm["log_host_bytes_peak"] = loadgen.writer_log_peak(log_b)
            hm["log_pinned_pool_peak"] = loadgen.writer_log_peak(log_b, "pinned_pool_peak")


def run_model(args, plan, name, clock, results, save, skipped):
    """Run model ``name`` of ``plan`` (``ModelRun``)."""
    ModelRun(args, plan, name, clock, results, save, skipped).run()
