"""What the GPU tests check, as functions of files, logs and numbers (no server, no GPU):
the tolerances, the worst relative error over many files, leftovers in a dump directory,
the writer-rank log lines, per-rank device-to-host bytes in profiler traces, and two
servers' files compared. The CPU suite tests these (tests/tooling/test_gpu_suite.py)."""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from testing.reference import RelError, rel_errors

# bf16 tolerance on the relative error ||got - ref|| / ||ref|| against the float32 reference
TOL_BLOCK = 2e-2  # over each request's (tokens x layer slots) block
TOL_TOKEN = 5e-2  # for every single token row (one token, one layer slot)


@dataclass
class Worst:
    """The largest block and per-token errors seen over several files, and where, and per
    layer slot the largest ``RelError.slots`` (files of one layout). A NaN error (a NaN or
    infinite value in a file) counts as the worst and stays: it fails every tolerance."""

    block: float = 0.0
    token: float = 0.0
    block_where: str = ""
    token_where: str = ""
    files: int = 0
    slots: List[float] = field(default_factory=list)

    def add(self, err: RelError, where: str) -> None:
        self.files += 1
        if _worse(err.block, self.block):
            self.block, self.block_where = err.block, where
        if _worse(err.token, self.token):
            self.token, self.token_where = err.token, f"{where}, token row {err.at[0]}, layer slot {err.at[1]}"
        self.slots = [e if _worse(e, w) else w for e, w in zip(err.slots, self.slots or [0.0] * len(err.slots))]

    def problems(self, tol_block: float = TOL_BLOCK, tol_token: Optional[float] = TOL_TOKEN) -> List[str]:
        """One line per exceeded tolerance (``tol_token`` None: the block only)."""
        out = []
        if not self.block <= tol_block:  # NaN too
            out.append(f"block relative error {self.block:.3e} > {tol_block:g} ({self.block_where})")
        if tol_token is not None and not self.token <= tol_token:
            out.append(f"per-token relative error {self.token:.3e} > {tol_token:g} ({self.token_where})")
        return out

    def record(self, record_property) -> None:
        """The measured errors into the test's record (junit XML / results JSON)."""
        record_property("max_rel_err", self.block)
        record_property("max_rel_err_per_token", self.token)
        record_property("files_compared", self.files)


def _worse(err: float, worst: float) -> bool:
    """Whether ``err`` replaces ``worst``: it is NaN, or not smaller (a NaN worst stays)."""
    return math.isnan(err) or (not math.isnan(worst) and err >= worst)


def compare_file(rec, ids, layer_ids, hidden_size, ref_block, where: str, worst: Worst) -> List[str]:
    """Check one loaded dump (``sglang_ext.format.DumpRecord``) against the request and
    the reference block [T, L, H]: shape, token ids and layer ids exact; the errors go
    into ``worst``. Returns the problems (empty: fine)."""
    want_shape = (len(ids), len(layer_ids), hidden_size)
    got_shape = tuple(rec.hidden_states.shape)
    if got_shape != want_shape:
        return [f"{where}: hidden_states shape {got_shape} != {want_shape} (tokens, layer slots, hidden)"]
    problems = []
    got_ids = rec.token_ids.tolist()
    if got_ids != list(ids):
        first = next((i for i, (a, b) in enumerate(zip(got_ids, ids)) if a != b), min(len(got_ids), len(ids)))
        problems.append(f"{where}: token_ids differ from the request's from position {first}")
    if list(rec.layer_ids) != list(layer_ids):
        problems.append(f"{where}: layer_ids {list(rec.layer_ids)} != {list(layer_ids)}")
    worst.add(rel_errors(rec.hidden_states, ref_block), where)
    return problems


def leftovers(dump_dir: str) -> List[str]:
    """Temporaries in ``dump_dir``: ``*.tmp``, ``*.lock``, ``.tmp*`` (sorted names)."""
    return sorted(n for n in os.listdir(dump_dir)
                  if n.endswith(".tmp") or n.endswith(".lock") or n.startswith(".tmp"))


def wait_no_leftovers(dump_dir: str, timeout: float = 60) -> List[str]:
    """``leftovers`` once they are gone or ``timeout`` seconds passed."""
    t0 = time.time()
    while leftovers(dump_dir) and time.time() - t0 < timeout:
        time.sleep(0.5)
    return leftovers(dump_dir)


def unloadable_files(dump_dir: str) -> List[str]:
    """Every ``*.safetensors`` under a final name must load completely
    (``sglang_ext.format.load``); one problem line per file that does not."""
    from sglang_ext import format as fmt

    problems = []
    for n in sorted(os.listdir(dump_dir)):
        if n.endswith(".safetensors"):
            try:
                fmt.load(os.path.join(dump_dir, n))
            except Exception as e:  # noqa: BLE001 - any failure to load is the finding
                problems.append(f"{n}: {type(e).__name__}: {e}")
    return problems


def writer_ranks(log_path: str) -> Tuple[int, int]:
    """(ranks that logged "writer rank: True", ranks that logged "writer rank: False") in
    the dump's start-up lines ("hidden-state dump: layers ...") of a server log."""
    with open(log_path, errors="replace") as f:
        lines = [ln for ln in f if "hidden-state dump: layers" in ln]
    return (sum("writer rank: True" in ln for ln in lines),
            sum("writer rank: False" in ln for ln in lines))


def writer_pids() -> List[int]:
    """Pids of the running writer processes (``python -m sglang_ext.writer_process``)."""
    pids = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if b"sglang_ext.writer_process" in f.read():
                    pids.append(int(d))
        except (OSError, ValueError):
            pass
    return sorted(p for p in pids if p != os.getpid())


def trace_files(trace_dir: str) -> List[Tuple[int, str]]:
    """[(tp_rank, file name)] of the profiler traces in ``trace_dir`` (none if missing)."""
    if not os.path.isdir(trace_dir):
        return []
    found = [(re.search(r"-TP-(\d+)", n), n) for n in sorted(os.listdir(trace_dir))]
    return [(int(m.group(1)), n) for m, n in found if m and n.endswith(".trace.json.gz")]


def dtoh_bytes_per_rank(trace_dir: str) -> Dict[int, dict]:
    """{tp_rank: {"dtoh_bytes", "dtoh_copies", "trace"}} from SGLang's torch-profiler traces
    (``<profile_id>-TP-<rank>[-DP-<rank>].trace.json.gz``, profile_utils._ProfilerTorch):
    CUPTI's memcpy activity records (``cat == "gpu_memcpy"``, name ``Memcpy DtoH ...``,
    ``args.bytes``), whatever code issued them: SGLang's own copies count too."""
    out = {}
    for rank, name in trace_files(trace_dir):
        with gzip.open(os.path.join(trace_dir, name), "rt") as f:
            events = json.load(f).get("traceEvents", [])
        copies = [ev for ev in events
                  if ev.get("cat") == "gpu_memcpy" and "DtoH" in str(ev.get("name", ""))]
        out[rank] = {"dtoh_bytes": sum(int((ev.get("args") or {}).get("bytes", 0)) for ev in copies),
                     "dtoh_copies": len(copies), "trace": name}
    return out


def compare_kept(prompts, got_kept: Dict[str, str], want_kept: Dict[str, str]) -> Tuple[List[str], Worst]:
    """Files of one server against another's (same rids): token ids and layer ids exact,
    shapes equal, hidden states compared with ``want`` as the reference (the caller applies
    the tolerances to the returned ``Worst``). ``prompts``: [(rid, ids)]."""
    from sglang_ext import format as fmt

    problems, worst = [], Worst()
    for rid, _ids in prompts:
        if rid not in got_kept or rid not in want_kept:
            problems.append(f"{rid}: missing on one side")
            continue
        got, want = fmt.load(got_kept[rid]), fmt.load(want_kept[rid])
        if got.token_ids.tolist() != want.token_ids.tolist() or got.layer_ids != want.layer_ids:
            problems.append(f"{rid}: token_ids or layer_ids differ")
            continue
        if got.hidden_states.shape != want.hidden_states.shape:
            problems.append(f"{rid}: shape {tuple(got.hidden_states.shape)} != {tuple(want.hidden_states.shape)}")
            continue
        worst.add(rel_errors(got.hidden_states, want.hidden_states.float()), rid)
    return problems, worst


@dataclass
class Problems:
    """Problem lines of one test; ``check()`` fails it with all of them (at most 10)."""

    lines: List[str] = field(default_factory=list)

    def add(self, line: str) -> None:
        self.lines.append(line)

    def extend(self, lines) -> None:
        self.lines.extend(lines)

    def check(self, what: str) -> None:
        __tracebackhide__ = True
        if self.lines:
            more = f"\n  ... and {len(self.lines) - 10} more" if len(self.lines) > 10 else ""
            raise AssertionError(f"{what}: {len(self.lines)} problem(s):\n  "
                                 + "\n  ".join(self.lines[:10]) + more)
