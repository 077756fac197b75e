"""Parallel group (issue 9): the patched server at --tp-size N (``--tp``, default 2; needs
N GPUs, else skipped with the reason).

- the core cases against the TP=N server (TestCoreAtTP);
- exactly one rank opens the writer (its start-up log line);
- exactly one rank copies the hidden states off its GPU, measured with SGLang's own
  profiler (CUPTI memcpy records per rank), and its files equal HF's;
- a TP=1 server and (DeepseekV3, MLA) a TP=N server with DP attention produce the same
  files as the TP=N server, within the bf16 tolerance.

The TP=N server is stopped before the comparison servers start (one GPU set, one port)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import shutil
import time
from dataclasses import dataclass

import pytest

import test_gpu_core
from testing.checks import Problems, Worst, compare_file, compare_kept, dtoh_bytes_per_rank, trace_files, writer_ranks
from testing.server import CHUNK, ServerOptions
from testing.tiny_models import VOCAB

# kimi: the core group only
pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu, pytest.mark.models("llama", "deepseek")]


@pytest.fixture(scope="module")
def server_options(pytestconfig):
    return ServerOptions(tp=pytestconfig.getoption("--tp"),
                         cuda_graph=not pytestconfig.getoption("--no-cuda-graph"))


class TestCoreAtTP(test_gpu_core.TestCore):
    """The core group's cases against the --tp N server."""


def make_tp_prompts(rng):
    """Fixed prompts (with rids) sent to every server of this module: short, chunked
    (> CHUNK) and long ones."""
    lens = [5, 33, 64, 200, CHUNK + 1, 480, 700, 1000]
    return [(f"tp-check-{i}", [rng.randrange(3, VOCAB) for _ in range(n)]) for i, n in enumerate(lens)]


@dataclass
class Profiled:
    """One server's answers to the TP prompts under SGLang's profiler: ``kept``
    {rid: copy of its file}, ``per_rank`` {tp_rank: DtoH bytes}, ``problems``."""

    prompts: list
    kept: dict
    per_rank: dict
    problems: list


def profiled_prompts(server, prompts, tag, workdir, ranks) -> Profiled:
    """Send ``prompts`` (4 at a time) under SGLang's /start_profile ... /stop_profile (GPU
    activity on every rank); copy each answered file to workdir/<tag>/<rid>.safetensors."""
    import requests

    keep_dir, trace_dir = os.path.join(workdir, tag), os.path.join(workdir, f"{tag}-traces")
    shutil.rmtree(trace_dir, ignore_errors=True)
    os.makedirs(keep_dir, exist_ok=True)
    requests.post(f"{server.url}/start_profile", timeout=120, json={
        "output_dir": trace_dir, "activities": ["CPU", "GPU"], "with_stack": False,
        "record_shapes": False, "profile_id": tag}).raise_for_status()
    try:
        with cf.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: server.generate(p[1], rid=p[0]), prompts))
    finally:
        requests.post(f"{server.url}/stop_profile", timeout=300).raise_for_status()
    problems, kept = [], {}
    for (rid, _ids), res in zip(prompts, answers):
        path = res["meta_info"].get("hidden_states_path")
        if not path or not os.path.exists(path):
            problems.append(f"{rid}: no file ({res['meta_info'].get('hidden_states_error')})")
            continue
        kept[rid] = os.path.join(keep_dir, f"{rid}.safetensors")
        shutil.copyfile(path, kept[rid])
    t0 = time.time()  # every rank exports before a barrier; wait for the files anyway
    while time.time() - t0 < 120 and len(trace_files(trace_dir)) < ranks:
        time.sleep(1)
    return Profiled(prompts, kept, dtoh_bytes_per_rank(trace_dir), problems)


@pytest.fixture(scope="module")
def tp_profiled(server, server_options, tiny_model, tmp_path_factory):
    """The TP prompts answered by the module's TP=N server under the profiler."""
    prompts = make_tp_prompts(random.Random(f"1234:tp-prompts:{tiny_model.name}"))
    workdir = str(tmp_path_factory.mktemp(f"tp-{tiny_model.name}"))
    return profiled_prompts(server, prompts, f"tp{server_options.tp}", workdir, server_options.tp)


def test_one_writer_rank(server, server_options, record_property):
    """Exactly one rank opens the writer; the others log "writer rank: False" and so never
    copy rows off their GPU (hooks.on_prefill_result returns before any copy on them)."""
    writers, others = writer_ranks(server.log_path)
    record_property("writer_ranks", writers)
    record_property("non_writer_ranks", others)
    assert (writers, others) == (1, server_options.tp - 1), (
        f"{server.log_path}: {writers} rank(s) logged 'writer rank: True' and {others} 'writer rank: False'; "
        f"want 1 and {server_options.tp - 1}")


def test_one_rank_copies(tp_profiled, server_options, reference, tiny_model, record_property):
    """One file per request; exactly rank 0 copies the hidden states off its GPU (its DtoH
    bytes >= the files' hidden_states bytes), every other rank less than 1% of that
    (SGLang's own small copies: next token ids). Also each file against HF."""
    from sglang_ext import format as fmt

    tp = server_options.tp
    hs_bytes = sum(len(ids) for _, ids in tp_profiled.prompts) * len(tiny_model.layer_ids) * tiny_model.hidden_size * 2
    problems, worst = Problems(list(tp_profiled.problems)), Worst()
    for rid, ids in tp_profiled.prompts:
        if rid in tp_profiled.kept:
            problems.extend(compare_file(fmt.load(tp_profiled.kept[rid]), ids, tiny_model.layer_ids,
                                         tiny_model.hidden_size, reference(ids, tiny_model.layer_ids), rid, worst))
    per_rank = tp_profiled.per_rank
    copiers = [r for r, v in per_rank.items() if v["dtoh_bytes"] >= hs_bytes]
    quiet = [r for r, v in per_rank.items() if v["dtoh_bytes"] < hs_bytes / 100]
    record_property("hidden_states_bytes", hs_bytes)
    record_property("dtoh_per_rank", per_rank)
    record_property("files", len(tp_profiled.kept))
    worst.record(record_property)
    if len(per_rank) != tp:
        problems.add(f"profiler traces for ranks {sorted(per_rank)}, want {tp}")
    bytes_by_rank = {r: v["dtoh_bytes"] for r, v in per_rank.items()}
    if copiers != [0] or len(quiet) != tp - 1:
        problems.add(f"DtoH bytes per rank {bytes_by_rank}: want rank 0 alone >= {hs_bytes} (the files' "
                     f"hidden states) and every other rank < {hs_bytes // 100}")
    problems.extend(worst.problems())
    problems.check(f"TP={tp} copies")


def _compare_other_server(server, tp_profiled, start_server, options, tag, tmp_path, record_property):
    server.stop()  # the TP=N server's GPUs and port
    other = start_server(options, tag=tag)
    record_property("startup_s", other.startup_s)
    got = profiled_prompts(other, tp_profiled.prompts, tag, str(tmp_path), options.tp)
    more, worst = compare_kept(tp_profiled.prompts, got.kept, tp_profiled.kept)
    problems = Problems(got.problems + more)
    files = len([n for n in os.listdir(other.dump_dir) if n.endswith(".safetensors")])
    record_property("files", files)
    record_property("dtoh_per_rank", got.per_rank)
    worst.record(record_property)
    problems.extend(worst.problems())
    return other, got, problems, files


def test_tp_equals_tp1(server, tp_profiled, start_server, server_options, tmp_path, record_property):
    """A TP=1 server on the same weights answers the same prompts with the same files
    (token ids exact, hidden states within the bf16 tolerance of the TP=N files)."""
    options = ServerOptions(tp=1, cuda_graph=server_options.cuda_graph, launcher="direct")
    _, _, problems, _ = _compare_other_server(server, tp_profiled, start_server, options, "tp1",
                                              tmp_path, record_property)
    problems.check(f"TP=1 files against TP={server_options.tp} files")


@pytest.mark.models("deepseek")  # SGLang's DP attention targets MLA models
def test_dp_attention_equals(server, tp_profiled, start_server, server_options, tmp_path, record_property):
    """A --tp N --dp-size N --enable-dp-attention server answers with the same files as
    the TP=N server; each DP rank copies its own requests (together >= 0.9 x the files'
    bytes) and every request gets a file."""
    options = ServerOptions(tp=server_options.tp, dp_attention=True, cuda_graph=server_options.cuda_graph,
                            launcher="direct")
    other, got, problems, files = _compare_other_server(server, tp_profiled, start_server, options, "dpattn",
                                                        tmp_path, record_property)
    hs = sum(os.path.getsize(p) for p in got.kept.values())
    dtoh = sum(v["dtoh_bytes"] for v in got.per_rank.values())
    record_property("writer_ranks_in_log", writer_ranks(other.log_path))
    if dtoh < hs * 0.9:
        problems.add(f"DtoH bytes over all ranks {dtoh} < 0.9 x the files' {hs} bytes")
    if files < len(tp_profiled.prompts):
        problems.add(f"{files} files for {len(tp_profiled.prompts)} requests")
    problems.check("DP attention files against TP files")
