"""The client side of a cell: random prompts sent by ``concurrency`` client threads (a
closed loop), what came back (files, samples, JSON hidden states), the warm-up, and what
the server held meanwhile (its memory, the writer's log lines, the stage trace).

A server here is anything with ``port``, ``proc``, ``command`` and ``log_text()``
(testing/server.py's ``Server``). Requests are SGLang's ``/generate`` with
``input_ids`` and ``max_new_tokens=1``, or for the peer's modes (``bench.peer``) vLLM's
``/v1/completions`` with the token ids as ``prompt`` and ``max_tokens=1``.
"""

from __future__ import annotations

import ast
import concurrent.futures as cf
import contextlib
import json
import os
import re
import struct
import threading
import time

from bench import modes, peer, report
from bench.store import MANIFEST

_local = threading.local()


def _session():
    import requests

    if not hasattr(_local, "s"):
        _local.s = requests.Session()
    return _local.s


def make_prompts(rng, n, length, vocab):
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def send_batch(port, prompts, concurrency, return_hidden_states=False, early=False, timeout=600,
               api="sglang", wait_files=False, store=None, visible=None, answers=None):
    """Send all prompts with ``concurrency`` client threads; returns (wall_s, results), per
    request (latency_s, status, response bytes, content or None[, store handle or None]).
    ``answers`` (a list) gets each response's arrival, seconds after the first send (the wall
    after the last is the cell's drain). ``early`` (dump_early): each request asks to be
    answered before its file is complete (``format.WAIT_PARAM``), as ``extract`` does, and a
    thread waits for its previous file after its next answer; the wall ends when every file
    is complete. ``api="vllm"``: ``/v1/completions``; ``wait_files`` (vllm_dump): a request
    counts once vLLM's file lock is released, as ours in mode dump. ``store`` (a
    ``BenchStore``): the answers carry a manifest; without ``early`` a request counts once
    its sample is visible, appending (response-to-visible s, visible at the first look-up)
    to ``visible``; with ``early`` a thread waits for its previous sample as for files. A
    sample that fails (its marker, the timeout) fails its request (status "store")."""
    from sglang_ext import format as fmt

    bodies = []
    for ids in prompts:
        if api == "vllm":
            bodies.append(json.dumps(peer.completion_body(ids)).encode())
            continue
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        if return_hidden_states:
            body["return_hidden_states"] = True
        if early:
            body["sampling_params"]["custom_params"] = {fmt.WAIT_PARAM: False}
        bodies.append(json.dumps(body).encode())
    url = f"http://127.0.0.1:{port}" + ("/v1/completions" if api == "vllm" else "/generate")
    slot = threading.local()
    pending = []  # list.append is atomic under the GIL
    arrived = [] if answers is None else answers

    def one(i):
        t = time.perf_counter()
        r = _session().post(url, data=bodies[i], timeout=timeout, headers={"Content-Type": "application/json"})
        content = r.content
        arrived.append(time.perf_counter() - t0)
        if store is not None:
            return store_one(t, r.status_code, content)
        if wait_files and r.status_code == 200:
            path = peer.file_path(json.loads(content))
            if path:
                peer.wait_file(path)
        lat = time.perf_counter() - t
        if early and r.status_code == 200:
            path = json.loads(content)["meta_info"].get("hidden_states_path")
            prev, slot.prev = getattr(slot, "prev", None), path
            if prev:
                fmt.wait_complete(prev, timeout=timeout)
            if path:
                pending.append(path)
        # JSON responses run to 100s of MB: keep the first (and failures) only
        keep = not return_hidden_states or i == 0 or r.status_code != 200
        return lat, r.status_code, len(content), content if keep else None

    last = {}  # store, early: each thread's last handle (the ones before it were waited for)
    visible = [] if visible is None else visible

    def store_one(t, status, content):
        handle = json.loads(content)["meta_info"].get(MANIFEST, {}).get("handle") if status == 200 else None
        try:
            if handle and not early:
                t_resp = time.perf_counter()
                first = store.wait_visible(handle)
                visible.append((time.perf_counter() - t_resp, first))
            lat = time.perf_counter() - t
            if handle and early:
                prev, slot.prev = getattr(slot, "prev", None), handle
                if prev:
                    store.wait_visible(prev)
                last[threading.get_ident()] = handle
        except Exception as e:  # noqa: BLE001 - SampleFailed, or the store's own error
            return time.perf_counter() - t, "store", len(content), str(e).encode(), handle
        return lat, status, len(content), content, handle

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(len(bodies))))
    for path in pending:  # the last file of each thread (the rest return at once)
        fmt.wait_complete(path, timeout=timeout)
    for handle in last.values():  # the last sample of each thread
        store.wait_visible(handle)
    return time.perf_counter() - t0, results


def run_cell(server, cell, vocab, rng, mode, trace_path=None, store=None):
    """One cell (``cell``: prompt_len, concurrency, requests) of ``mode`` against
    ``server``; returns the cell's results entry (``report.cell_stats`` plus, for dump
    modes, the files' bytes and one file's header, the stages of ``trace_path``
    (``report.stage_stats``); for json, the responses' bytes and one's nested shape;
    ``error`` when requests failed). Store modes (``store``: the run's ``BenchStore``):
    ``BenchStore.cell_entries`` too, and the cell's samples are deleted after it."""
    prompts = make_prompts(rng, cell["requests"], cell["prompt_len"], vocab)  # not timed
    offset = trace_size(trace_path)
    visible, answers = [], []
    wall, results = send_batch(server.port, prompts, cell["concurrency"],
                               return_hidden_states=(mode == "json"),
                               early=mode in modes.names(early=True),
                               answers=answers, **api_args(mode),
                               **({"store": store, "visible": visible} if store is not None else {}))
    lat = [r[0] for r in results]
    bad = [r for r in results if r[1] != 200]
    out = {"mode": mode, "prompt_len": cell["prompt_len"], "concurrency": cell["concurrency"],
           "requests": len(prompts)}
    out.update(report.cell_stats(lat, sum(map(len, prompts)), wall, max(answers, default=None)))
    if bad:
        out["error"] = f"{len(bad)} of {len(results)} requests failed: HTTP {bad[0][1]} {bad[0][3][:300]!r}"
    if store is not None:
        out.update(store.cell_entries(results, visible, out, wall))
    elif mode in report.DUMP_MODES and not bad:
        paths, errors = [], []
        for r in results:
            if peer.is_peer(mode):
                path = peer.file_path(json.loads(r[3]))
                (paths if path else errors).append(path or "no kv_transfer_params.hidden_states_path")
                continue
            meta = json.loads(r[3])["meta_info"]
            if meta.get("hidden_states_path"):
                paths.append(meta["hidden_states_path"])
            else:
                errors.append(meta.get("hidden_states_error", "no hidden_states_path"))
        size = sum(os.stat(p).st_size for p in paths)
        out.update(file_bytes=size, write_gbps=size / wall / 1e9, files=len(paths),
                   bytes_per_token=size / out["prompt_tokens"] if out.get("prompt_tokens") else None)
        if errors:
            out["error"] = f"{len(errors)} requests without a file: {errors[0][:200]}"
        if paths:
            tensors, meta = safetensors_header(paths[0])
            out["file_check"] = {"hidden_states": tensors.get("hidden_states"), "layer_ids": meta.get("layer_ids")}
            if "hidden_states_scales" in tensors:
                out["file_check"]["hidden_states_scales"] = tensors["hidden_states_scales"]
            if peer.is_peer(mode):  # vLLM's files carry no metadata: the keys say what is there
                out["file_check"]["token_ids"] = tensors.get("token_ids")
                out["file_check"]["keys"] = sorted(tensors)
    if trace_path and (store is not None or (mode in report.DUMP_MODES and not bad)):
        time.sleep(0.3)  # the writer's trace line follows its lock release (its put)
        out["stages"] = report.stage_stats(read_trace(trace_path, offset), wall)
    if mode == "json" and not bad:
        out["response_bytes"] = sum(r[2] for r in results)
        hs = json.loads(results[0][3])["meta_info"].get("hidden_states")
        out["json_check"] = describe_nested(hs)
        if hs is None:
            out["error"] = "response carries no meta_info.hidden_states"
    return out


def api_args(mode):
    """``send_batch``'s keywords for ``mode``'s server: vLLM's API for the peer's modes,
    waiting for the files in ``vllm_dump``."""
    if not peer.is_peer(mode):
        return {}
    return {"api": "vllm", "wait_files": mode == "vllm_dump"}


def describe_nested(x):
    """Shape of a nested list (first elements), e.g. [2048, 4096]; None when absent."""
    shape = None if x is None else []
    while isinstance(x, list):
        shape.append(len(x))
        x = x[0] if x else None
    return shape


def safetensors_header(path):
    """(tensor shapes/dtypes, metadata) of a safetensors file, read without torch."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", {})
    return {k: {"shape": v["shape"], "dtype": v["dtype"]} for k, v in header.items()}, meta


def warm_up(server, vocab, rng, plens, json_too, concs=(1, 8), mode=None, store=None):
    """One request, then a burst at every concurrency of the grid, at every prompt length:
    kernels (Triton's fused MoE compiles per batch-size bucket) compiled for the shapes
    before anything is timed. ``mode``: a mode the server serves, when it decides the API
    (the peer's; vllm_dump waits for its files, so none is written after the warm-up).
    ``store``: the server dumps into it; each burst's samples are deleted after it."""
    for plen in plens:
        for conc in sorted({1, 8, *concs}):
            _, results = send_batch(server.port, make_prompts(rng, conc, plen, vocab), conc,
                                    store=store, **api_args(mode or ""))
            if store is not None:
                _, failed = store.consume([r[4] for r in results if r[4]])
                if failed:
                    print(f"  warm-up: {len(failed)} store samples failed: {failed[0][:300]}", flush=True)
    if json_too:
        send_batch(server.port, make_prompts(rng, 1, 512, vocab), 1, return_hidden_states=True)


def clear_dump_dir(path):
    """Delete a dump directory's files and index (between cells; not timed), and the lock
    files vLLM's connector leaves beside its files (ours remove their own)."""
    for entry in os.listdir(path):
        if entry.endswith(".safetensors") or entry.endswith(".safetensors.lock") or entry == "index.jsonl":
            try:
                os.unlink(os.path.join(path, entry))
            except FileNotFoundError:
                pass


def read_trace(path, offset):
    """KIMI_SGLANG_TRACE lines appended to ``path`` after byte ``offset``."""
    out = []
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return out
    for x in text.splitlines():
        try:
            out.append(json.loads(x))
        except ValueError:  # a line still being written
            pass
    return out


def trace_size(path):
    try:
        return os.path.getsize(path)
    except (OSError, TypeError):
        return 0


class RssSampler:
    """Peak memory (bytes; PSS where psutil reads it, else RSS) of a process and its
    children, sampled every 0.2 s while in its ``with`` block."""

    def __init__(self, pid):
        import psutil

        self.psutil, self.root, self.peak = psutil, psutil.Process(pid), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self):
        ps, total = self.psutil, 0
        try:
            procs = [self.root] + self.root.children(recursive=True)
        except ps.Error:  # the server is gone
            return 0
        for p in procs:  # PSS: memory shared by processes (the writer's arena) counted once
            try:
                total += p.memory_full_info().pss
            except (ps.Error, AttributeError):
                with contextlib.suppress(ps.Error):
                    total += p.memory_info().rss
        return total

    def _run(self):
        while True:
            self.peak = max(self.peak, self.rss())
            if self._stop.wait(0.2):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def writer_log_peak(text, key="host_bytes_peak"):
    """Max ``key`` over the writer's 'hidden-state dump: {...}' log lines (the budget's
    ``host_bytes_peak``, or ``pinned_pool_peak``: the process's pinned pool)."""
    peaks = []
    for m in re.finditer(r"hidden-state dump: (\{[^}\n]*\})", text):
        try:
            peaks.append(int(ast.literal_eval(m.group(1))[key]))
        except (ValueError, SyntaxError, KeyError):
            pass
    return max(peaks) if peaks else None
