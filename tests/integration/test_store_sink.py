"""The server's store sink: the writer process puts each request into a real ``mooncake_master``.

Driven through the session exactly as tests/unit/test_hooks.py drives the file sink (stand-in
``Req`` and batches, ``run_extend``), with ``--dump-hidden-states-dir mooncake://...``.
Samples are read back with hs-connectors 0.9.0's own ``MooncakeTransfer.get_generated``
(what speculators' trainer calls) and compared with an independent reference: the
formula of ``standins.reference`` and the file the file sink writes for the same rows
(both sinks run on the same batches). Fault cases: a request that fails before its
answer, the master killed mid-burst and restarted, a full store, the writer SIGKILLed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import types

import pytest
import torch

from sglang_ext import format as fmt
from sglang_ext import hooks, store
from sglang_ext.config import DumpConfig, DumpConfigError
from sglang_ext.session import check_server_args
from mooncake_fixture import MiB, Master, SilentMaster, _free_port, master_config, needs_mooncake
from test_faults import gone
from standins import Req, finish, idle, inject_writer, make_runner, reference, run_extend, wait_for

pytestmark = needs_mooncake
IDS = [2, 4]
ERROR = "hidden_states_error"
MANIFEST = "hidden_states_manifest"


def reader_for(master: Master):
    """hs-connectors' trainer-side ``MooncakeTransfer`` over a client of its own."""
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig
    from hs_connectors.transfer import MooncakeTransfer

    cfg = store.StoreConfig.from_url(master_config(master)).as_hs_connectors()
    t = MooncakeTransfer(MooncakeHiddenStatesStore(MooncakeStoreConfig.from_dict(
        {**cfg, "global_segment_size": 0, "local_buffer_size": 16 * MiB})))
    t.setup()
    return t


@pytest.fixture(scope="module")
def reader(master):
    return reader_for(master)


def exists(reader, key: str) -> bool:
    return reader.store._store.is_exist(key) == 1


def read(reader, meta: dict) -> dict:
    """The sample of a response: ``get_generated(manifest)``, as speculators calls it."""
    assert ERROR not in meta and "hidden_states_path" not in meta, meta
    return reader.get_generated(meta[MANIFEST])


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def store_runner(master, dtype=None, segment=64 * MiB, max_mb=64, buffer="16MiB"):
    return make_runner(master_config(master, segment, buffer), layers="2,4", dtype=dtype, max_mb=max_mb)


def batches(prefix: str):
    """Requests and three extend batches with chunked prefill and a decode row:
    ``a`` in three chunks, ``b`` and ``c`` whole."""
    a, b, c = Req(f"{prefix}a.1", 10, 1), Req(f"{prefix}b", 3, 2), Req(f"{prefix}c", 6, 3)
    return (a, b, c), [
        ([(b, 0, 3), (a, 0, 4)], ()),
        ([(a, 4, 8), (c, 0, 6), (b, 0, 0)], (b,)),
        ([(a, 8, 10)], ()),
    ]


@pytest.mark.parametrize("dtype", [None, "fp8"])
def test_samples_equal_the_file_sinks_with_chunked_prefill(master, reader, dump, sessions, dtype):
    """The same batches into both sinks: every tensor hs-connectors reads back is byte for
    byte the file sink's (fp8: rows and scales), and for the model's dtype the formula's."""
    by_sink = {}
    for sink, runner in (("file", make_runner(dump, layers="2,4", dtype=dtype)),
                         ("store", store_runner(master, dtype))):
        sess = sessions.start(runner)
        reqs, steps = batches(f"{dtype}-")
        for spans, decoding in steps:
            run_extend(sess, spans, IDS, decoding=decoding)
        metas = [finish(r) for r in reqs]
        snap = idle(sess)
        assert snap["files_written"] == 3 and snap["failures"] == 0, snap
        assert snap["host_bytes_in_use"] == 0, snap
        by_sink[sink] = (reqs, metas)
    for req, fmeta, smeta in zip(by_sink["file"][0], by_sink["file"][1], by_sink["store"][1]):
        manifest = smeta[MANIFEST]
        assert store.handle_matches(req.rid, manifest["handle"]) and manifest["version"] == 1
        assert manifest["handle"] != store.handle_for(req.rid)  # a unique suffix
        rec = fmt.load(fmeta["hidden_states_path"], dequantize=False)
        # the file's __metadata__ rides in the manifest: extract --store writes the same file
        assert {k: manifest["metadata"].get(k) for k in rec.metadata} == rec.metadata, req.rid
        got = read(reader, smeta)
        want = {"hidden_states": rec.hidden_states, "token_ids": rec.token_ids}
        if dtype == "fp8":
            want["hidden_states_scales"] = rec.scales
        assert set(got) == set(want), (req.rid, sorted(got))
        for name, t in want.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape, (req.rid, name)
            assert raw(got[name]) == raw(t), f"{req.rid} {name}: bytes differ from the file sink's"
        if dtype is None:
            assert torch.equal(got["hidden_states"], reference(req, IDS)), req.rid
        assert got["token_ids"].tolist() == req.origin_input_ids
        assert reader.store._store.get_size(manifest["handle"]) == manifest["metadata"]["total_aligned_bytes"]
        reader.delete(manifest["handle"])


@pytest.mark.parametrize("dtype", [None, "fp8"])
def test_output_rows_equal_the_file_sinks(master, reader, dump, sessions, dtype):
    """A request with output rows (prompt in two chunks, then decode steps) into both sinks:
    the store's sample is the file sink's byte for byte, its manifest carries the file's
    output metadata (num_prompt_tokens, last_token_id)."""
    from sglang_ext.session import DumpSession
    from standins import GenReq, run_decode, run_output_prefill

    got_by_sink = {}
    for sink, runner in (("file", make_runner(dump, layers="2,4", dtype=dtype)),
                         ("store", store_runner(master, dtype))):
        sess = DumpSession.start(runner, output_rows=True)
        sessions.started.append(sess)
        req = GenReq(f"{dtype}-{sink}-out", 7, 4, max_new_tokens=5)
        run_output_prefill(sess, [(req, 0, 4)], IDS)
        run_output_prefill(sess, [(req, 4, 7)], IDS)
        for _ in range(5):
            run_decode(sess, [req], IDS)
        got_by_sink[sink] = (req, finish(req))
        snap = idle(sess)
        assert snap["files_written"] == 1 and snap["failures"] == 0 and snap["host_bytes_in_use"] == 0, snap
    req, fmeta = got_by_sink["file"]
    sreq, smeta = got_by_sink["store"]
    assert sreq.output_ids == req.output_ids and len(req.output_ids) == 5
    rec = fmt.load(fmeta["hidden_states_path"], dequantize=False)
    assert rec.hidden_states.shape[0] == 7 + 5 - 1
    manifest = smeta[MANIFEST]
    meta = {k: v for k, v in rec.metadata.items() if k != "rid"}
    assert {k: manifest["metadata"].get(k) for k in meta} == meta
    fmt.check_output_rows(rec.token_ids.tolist(), manifest["metadata"], sreq.origin_input_ids, sreq.output_ids)
    got = read(reader, smeta)
    assert got["token_ids"].tolist() == sreq.origin_input_ids + sreq.output_ids[:-1]
    assert raw(got["hidden_states"]) == raw(rec.hidden_states), "bytes differ from the file sink's"
    if dtype == "fp8":
        assert raw(got["hidden_states_scales"]) == raw(rec.scales)
    else:
        assert torch.equal(got["hidden_states"], reference(sreq, IDS, 0, 11))
    reader.delete(manifest["handle"])


def test_many_concurrent_chunked_requests_each_read_back_whole(master, reader, sessions):
    """Twelve chunked-prefill requests of 1.1-1.7 MB, three chunks each, staggered so three
    or four are in prefill at once and later ones reuse the staging buffers of earlier
    ones: every sample reads back as its own request's rows (a buffer handed out again
    before its put returned would mix two requests' rows). The client's local buffer is
    1 MiB, smaller than any of them: the samples are put from registered memory, not
    joined into bytes (docs/store.md, chunked prefill)."""
    sess = sessions.start(store_runner(master, buffer="1MiB"))
    reqs = [Req(f"chunky-{i}", 16_000 + 700 * i, i + 1) for i in range(12)]
    steps = {}
    for i, r in enumerate(reqs):
        n = len(r.origin_input_ids)
        cuts = [0, n // 3, 2 * n // 3, n]
        for j in range(3):
            steps.setdefault(i + j, []).append((r, cuts[j], cuts[j + 1]))
    for k in sorted(steps):
        run_extend(sess, steps[k], IDS)
    metas = [finish(r) for r in reqs]
    snap = idle(sess, 60)
    assert snap["files_written"] == 12 and snap["failures"] == 0, snap
    assert snap["host_bytes_in_use"] == 0, snap
    for req, meta in zip(reqs, metas):
        got = read(reader, meta)
        assert torch.equal(got["hidden_states"], reference(req, IDS)), req.rid
        assert got["token_ids"].tolist() == req.origin_input_ids, req.rid
        reader.delete(meta[MANIFEST]["handle"])


def test_every_answer_gets_its_own_handle(master, reader, sessions):
    """Each answer's handle is ``handle_for(rid)`` + ``-`` + 8 random hex digits, so none
    shares an object or a marker with another: two live requests of one rid, the rid
    repeated after its object exists, a second scheduler process (DP rank) on the same
    master, rids that sanitize alike (``job.1``/``job_1``), and a stale ``same:error``
    an older server left. Every sample reads back as its own request's rows."""
    reader.store._store.put("same:error", b'{"error": "stale marker of an older server"}')
    sess = sessions.start(store_runner(master))
    other = sessions.start(store_runner(master))
    first, second = Req("same", 4, 1), Req("same", 5, 2)
    run_extend(sess, [(first, 0, 4), (second, 0, 5)], IDS)
    metas = [finish(first), finish(second)]
    assert idle(sess)["files_written"] == 2
    again, dotted, underscored = Req("same", 3, 3), Req("job.1", 6, 4), Req("job_1", 2, 5)
    run_extend(sess, [(again, 0, 3), (dotted, 0, 6)], IDS)
    rank1 = Req("same", 7, 6)
    run_extend(other, [(rank1, 0, 7), (underscored, 0, 2)], IDS)
    reqs = [first, second, again, dotted, rank1, underscored]
    metas += [finish(again), finish(dotted), finish(rank1), finish(underscored)]
    assert (idle(sess)["failures"], idle(other)["failures"]) == (0, 0)
    handles = [m[MANIFEST]["handle"] for m in metas]
    assert len(set(handles)) == len(handles), handles
    for req, handle in zip(reqs, handles):
        assert re.fullmatch(re.escape(store.handle_for(req.rid)) + "-[0-9a-f]{32}", handle), (req.rid, handle)
        assert store.handle_matches(req.rid, handle)
    for req, meta in zip(reqs, metas):
        assert torch.equal(read(reader, meta)["hidden_states"], reference(req, IDS)), req.rid
        assert read(reader, meta)["token_ids"].tolist() == req.origin_input_ids
        reader.delete(meta[MANIFEST]["handle"])
    reader.store._store.remove("same:error")


def test_a_request_failing_before_its_answer_gets_hidden_states_error(master, reader, sessions):
    sess = sessions.start(store_runner(master))
    cached = Req("cached", 8, 1)
    run_extend(sess, [(cached, 3, 8)], IDS)  # a radix-cache hit would start at token 3
    meta = finish(cached)
    assert MANIFEST not in meta and "prefix reuse" in meta[ERROR]
    sess.writer.close(timeout=5)
    late = Req("late", 4, 2)
    run_extend(sess, [(late, 0, 4)], IDS)
    meta = finish(late)
    assert MANIFEST not in meta and fmt.SHUTDOWN_MESSAGE in meta[ERROR]
    assert not exists(reader, "cached") and not exists(reader, "late")


def test_master_killed_mid_burst_then_back(tmp_path, sessions):
    """Every request is answered (a manifest, or hidden_states_error); while the master is
    down puts fail (logged, counted), the server goes on, and once it is back (same
    port) new requests are put and readable."""
    m = Master(tmp_path)
    try:
        sess = sessions.start(store_runner(m))
        pid = sess.writer.pid
        reqs = [Req(f"burst-{i}", 4, i + 1) for i in range(12)]
        for i in range(0, 12, 3):
            if i == 6:
                assert idle(sess)["files_written"] == 6
                m.kill()
            run_extend(sess, [(r, 0, 4) for r in reqs[i:i + 3]], IDS)
        metas = [finish(r) for r in reqs]
        assert all(MANIFEST in x or ERROR in x for x in metas), metas
        snap = idle(sess, 30)
        assert (snap["files_written"], snap["failures"]) == (6, 6), snap
        assert sess.writer.pid == pid and snap["writer_restarts"] == 0
        m.restart()
        reader = reader_for(m)
        ok = None
        for i in range(40):  # the writer's client mounts its segment again within seconds
            req = Req(f"after-{i}", 4, 50 + i)
            run_extend(sess, [(req, 0, 4)], IDS)
            meta = finish(req)
            idle(sess)
            if exists(reader, meta[MANIFEST]["handle"]):
                ok = (req, meta)
                break
            # not mounted yet: the put and its marker fail with "no room" (logged, counted)
            wait_for(lambda: False, 0.5)
        assert ok is not None, "no put succeeded after the master came back"
        assert torch.equal(read(reader, ok[1])["hidden_states"], reference(ok[0], IDS))
    finally:
        m.kill()


def test_full_store_gives_per_request_errors(tmp_path, sessions):
    """A 16 MiB segment and 4.3 MB requests: the first ones are put, the rest fail with
    the store's sentence, which their readers get from the error marker. (Eviction is
    off: a full master otherwise evicts a share of the unread objects, markers too.)"""
    from hs_connectors.mooncake_store import MooncakeIntegrityError

    m = Master(tmp_path, "--eviction_ratio=0")
    try:
        sess = sessions.start(store_runner(m, segment=16 * MiB, max_mb=128))
        reader = reader_for(m)
        first = [Req(f"big-{i}", 60_000, i + 1) for i in range(3)]
        for r in first:
            run_extend(sess, [(r, 0, 60_000)], IDS)
        metas = [finish(r) for r in first]
        assert idle(sess, 60)["files_written"] == 3
        for req, meta in zip(first, metas):  # read, so leased: the master may not evict them
            assert torch.equal(read(reader, meta)["hidden_states"], reference(req, IDS)), req.rid
        more = [Req(f"big-{i}", 60_000, i + 1) for i in range(3, 6)]
        for r in more:
            run_extend(sess, [(r, 0, 60_000)], IDS)
        metas = [finish(r) for r in more]
        snap = idle(sess, 60)
        assert (snap["files_written"], snap["failures"]) == (3, 3), snap
        assert snap["host_bytes_in_use"] == 0
        for meta in metas:
            with pytest.raises(MooncakeIntegrityError, match="has no room"):
                read(reader, meta)
    finally:
        m.kill()


# Every put of the writer process waits until the file $GATE exists.
PUT_GATED = """
    import os, time
    from sglang_ext import store_client
    _real = store_client.StoreClient.put_packed
    def _gated(*a, **k):
        while not os.path.exists(os.environ["GATE"]):
            time.sleep(0.01)
        return _real(*a, **k)
    store_client.StoreClient.put_packed = _gated
"""


def test_writer_sigkill_marks_in_flight_requests_and_a_new_writer_serves(master, reader, monkeypatch,
                                                                         tmp_path, sessions):
    """SIGKILL to the writer process while its puts wait: the answered requests get
    ``<handle>:error`` (the new writer puts the markers), a request in prefill fails at
    its next chunk, and the new writer puts the next requests."""
    from hs_connectors.mooncake_store import MooncakeIntegrityError

    gate = tmp_path / "gate"
    inject_writer(monkeypatch, tmp_path, PUT_GATED, GATE=str(gate))
    sess = sessions.start(store_runner(master))
    first_pid = sess.writer.pid
    done = [Req(f"kill-{i}", 4, i + 1) for i in range(3)]
    half = Req("kill-half", 8, 9)
    run_extend(sess, [(r, 0, 4) for r in done] + [(half, 0, 4)], IDS)
    metas = [finish(r) for r in done]
    os.kill(first_pid, signal.SIGKILL)
    assert gone(first_pid)
    gate.touch()
    run_extend(sess, [(half, 4, 8)], IDS)  # the scheduler notices, starts a new writer
    assert "writer process died" in finish(half)[ERROR]
    assert sess.writer.pid != first_pid and sess.writer.snapshot()["writer_restarts"] == 1
    after = Req("kill-after", 4, 20)
    run_extend(sess, [(after, 0, 4)], IDS)
    meta = finish(after)
    assert idle(sess)["files_written"] == 1
    assert torch.equal(read(reader, meta)["hidden_states"], reference(after, IDS))
    for m in metas:
        with pytest.raises(MooncakeIntegrityError, match="writer process died"):
            reader.get_generated(m[MANIFEST])


def test_close_drains_puts_in_flight(master, reader, monkeypatch, tmp_path, sessions):
    """Shutdown (Close, as SIGTERM): the puts the writer holds finish within the drain
    timeout and are acknowledged."""
    gate = tmp_path / "gate"
    inject_writer(monkeypatch, tmp_path, PUT_GATED, GATE=str(gate))
    sess = sessions.start(store_runner(master))
    reqs = [Req(f"drain-{i}", 4, i + 1) for i in range(4)]
    run_extend(sess, [(r, 0, 4) for r in reqs], IDS)
    sess.writer.flush()
    gate.touch()
    assert sess.close(timeout=20) is True
    snap = sess.writer.snapshot()
    assert snap["files_written"] == 4 and snap["failures"] == 0, snap


def test_puts_cut_off_at_shutdown_get_the_shutdown_marker(monkeypatch, tmp_path, sessions):
    """Close with a 1 s drain timeout while every put waits (never let through): the
    writer exits under them, and each answered request's reader gets ``<handle>:error``
    with the file sink's shutdown message, not a timeout. A store node lends the memory, so
    the markers outlive the writer's client. (A master of its own: the node it kills at
    the end would stay a dead segment in the module's master.)"""
    from hs_connectors.mooncake_store import MooncakeIntegrityError

    master = Master(tmp_path)
    node = subprocess.Popen([sys.executable, "-c", STORE_NODE, master.address, str(32 * MiB)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert node.stdout.readline().split() == ["mounted", "0"]
        reader = reader_for(master)
        inject_writer(monkeypatch, tmp_path, PUT_GATED, GATE=str(tmp_path / "never"))
        sess = sessions.start(store_runner(master, segment=0))
        reqs = [Req(f"cut-{i}", 4, i + 1) for i in range(3)]
        run_extend(sess, [(r, 0, 4) for r in reqs], IDS)
        metas = [finish(r) for r in reqs]
        sess.writer.flush()
        assert sess.close(timeout=1) is False
        for req, meta in zip(reqs, metas):
            with pytest.raises(MooncakeIntegrityError, match=re.escape(fmt.SHUTDOWN_MESSAGE)):
                read(reader, meta)
            assert not exists(reader, meta[MANIFEST]["handle"]), req.rid
    finally:
        node.kill()
        node.wait()
        master.kill()


def test_kv_transfer_params_is_the_manifest():
    """/v1/completions (patch 0006): kv_transfer_params is the manifest itself, as vLLM's
    Mooncake connector returns it; a failed dump is an error (HTTP 500)."""
    pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
    from sglang.srt.entrypoints.openai.protocol import CompletionResponse, CompletionResponseChoice, UsageInfo

    manifest = store.pack_layout(3, 2, 8, "bfloat16").manifest("k1")
    response = CompletionResponse(
        id="cmpl-1", model="m",
        choices=[CompletionResponseChoice(index=0, text="x", finish_reason="length")],
        usage=UsageInfo(prompt_tokens=3, completion_tokens=1, total_tokens=4))
    out = hooks.openai_completion_extras(response, [{"meta_info": {MANIFEST: manifest}}])
    body = out.model_dump(mode="json")
    assert body["kv_transfer_params"] == manifest
    two = hooks.openai_completion_extras(
        response, [{"meta_info": {MANIFEST: manifest}}, {"meta_info": {MANIFEST: {**manifest, "handle": "k2"}}}])
    params = two.model_dump(mode="json")["kv_transfer_params"]
    assert params["handle"] == "k1" and [x["handle"] for x in params[MANIFEST + "s"]] == ["k1", "k2"]
    with pytest.raises(Exception, match="hidden-state dump failed: boom"):
        hooks.openai_completion_extras(response, [{"meta_info": {ERROR: "boom"}}])


def test_finish_response_answers_a_store_request_at_once_even_when_it_asks_to_wait():
    manifest = store.pack_layout(3, 2, 8, "bfloat16").manifest("k1")
    meta = {MANIFEST: [manifest], "hidden_states_path": [None]}
    asyncio.run(asyncio.wait_for(hooks.finish_response(meta), 2))
    assert meta == {MANIFEST: manifest}


def test_store_url_selects_the_sink_and_bad_ones_are_one_sentence(master, tmp_path):
    args = types.SimpleNamespace(dump_hidden_states_dir=master_config(master), dump_hidden_states_layers=None,
                                 dump_hidden_states_max_host_mb=64, dump_hidden_states_dtype=None)
    config = DumpConfig.from_server_args(args)
    assert config.sink == "store" and config.store.master_server_address == master.address
    for url, words in [("mooncake://127.0.0.1", "is not a mooncake://HOST:PORT address"),
                       ("mooncake://h:1?colour=red", "unknown mooncake setting 'colour'"),
                       (f"mooncake://127.0.0.1:{_free_port()}", "cannot reach the Mooncake master")]:
        bad = types.SimpleNamespace(**{**vars(args), "dump_hidden_states_dir": url})
        with pytest.raises(DumpConfigError) as e:
            check_server_args(bad)
        assert words in str(e.value) and "\n" not in str(e.value)
        assert str(e.value).startswith("--dump-hidden-states-dir: ")
    assert not (tmp_path / "mooncake:").exists()


STORE_NODE = """
import sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", "P2PHANDSHAKE", int(sys.argv[2]), 16 << 20, "tcp", "", sys.argv[1])
print("mounted", rc, flush=True)
time.sleep(600)
"""


def test_a_writer_whose_master_is_gone_fails_its_requests_in_seconds():
    """The writer's connection probes the master before Mooncake's setup (which retries a
    dead master ~90 s, past the scheduler's 60 s watchdog): a request gets the probe's
    sentence within seconds, and again at once while the master stays gone."""
    import ctypes
    import time

    from sglang_ext import store_writer

    port = _free_port()
    cfg = store.StoreConfig.from_url(f"mooncake://127.0.0.1:{port}?protocol=tcp&local_hostname=127.0.0.1")
    arena = ctypes.create_string_buffer(1 << 20)
    conn = store_writer.Connection(cfg, ctypes.addressof(arena), len(arena))
    try:
        t0 = time.monotonic()
        with pytest.raises(store.StoreUnavailable, match=rf"cannot reach the Mooncake master at 127\.0\.0\.1:{port} "
                                                         r"\(.*\): is mooncake_master running there\?"):
            conn.get()
        assert time.monotonic() - t0 < store_writer.PROBE_S + 3
        t0 = time.monotonic()
        with pytest.raises(store.StoreUnavailable, match="cannot reach the Mooncake master"):
            conn.get()
        assert time.monotonic() - t0 < 1
    finally:
        conn.close()


def test_start_up_refuses_a_master_that_accepts_connections_and_never_answers():
    """A hung master (or its HTTP metrics port named by typo) passes a TCP probe; start-up
    completes Mooncake's own set-up in a subprocess with a deadline, and refuses it in
    one sentence naming the address (before: accepted, then the writer froze in setup)."""
    silent = SilentMaster()
    try:
        args = types.SimpleNamespace(
            dump_hidden_states_dir=f"mooncake://{silent.address}?protocol=tcp&local_hostname=127.0.0.1",
            dump_hidden_states_layers=None, dump_hidden_states_max_host_mb=64, dump_hidden_states_dtype=None)
        with pytest.raises(DumpConfigError) as e:
            check_server_args(args)
        said = str(e.value)
        assert said.startswith("--dump-hidden-states-dir: the Mooncake master at " + silent.address), said
        assert "did not complete Mooncake's client set-up" in said and "\n" not in said
    finally:
        silent.close()


def test_a_writer_connection_to_a_master_that_never_answers_fails_requests_with_a_sentence():
    """The writer's own set-up completes Mooncake's in a subprocess first: a master that
    accepts and never answers fails the request in one sentence, and the process is never
    frozen (before: ``setup`` held the GIL for minutes)."""
    import ctypes

    from sglang_ext import store_writer

    silent = SilentMaster()
    cfg = store.StoreConfig.from_url(f"mooncake://{silent.address}?protocol=tcp&local_hostname=127.0.0.1")
    arena = ctypes.create_string_buffer(1 << 20)
    conn = store_writer.Connection(cfg, ctypes.addressof(arena), len(arena))
    try:
        with pytest.raises(store.StoreUnavailable, match=rf"the Mooncake master at {re.escape(silent.address)} "
                                                         r"accepts connections but did not complete"):
            conn.get()
    finally:
        conn.close()
        silent.close()


def test_an_unreachable_metadata_server_is_refused_at_start(master):
    args = types.SimpleNamespace(
        dump_hidden_states_dir=master_config(master) + f"&metadata_server=http://127.0.0.1:{_free_port()}/metadata",
        dump_hidden_states_layers=None, dump_hidden_states_max_host_mb=64, dump_hidden_states_dtype=None)
    with pytest.raises(DumpConfigError, match=r"^--dump-hidden-states-dir: cannot reach the Mooncake "
                                              r"metadata_server http://127\.0\.0\.1:\d+/metadata \("):
        check_server_args(args)


def test_a_stopped_master_fails_puts_fast_and_marks_them_once_it_answers(tmp_path, sessions):
    """SIGSTOP of a real master: the first put waits one RPC timeout (MC_RPC_TIMEOUT_MS),
    later requests fail at once (their arena ranges go back: the writer catches up while
    the master is still stopped), and once it runs again every failed request's
    ``<handle>:error`` is in the store (before: each put waited 30 s and no marker came)."""
    m = Master(tmp_path)
    try:
        sess = sessions.start(store_runner(m))
        first = Req("stop-0", 4, 1)
        run_extend(sess, [(first, 0, 4)], IDS)
        finish(first)
        assert idle(sess)["files_written"] == 1
        os.kill(m.process.proc.pid, signal.SIGSTOP)
        reqs = [Req(f"stop-{i}", 4, i + 1) for i in range(1, 9)]
        for i in range(0, 8, 2):
            run_extend(sess, [(r, 0, 4) for r in reqs[i:i + 2]], IDS)
        metas = [finish(r, 60) for r in reqs]
        snap = idle(sess, 60)  # while the master is stopped
        assert (snap["files_written"], snap["failures"]) == (1, 8), snap
        os.kill(m.process.proc.pid, signal.SIGCONT)
        reader = reader_for(m)
        handles = [meta[MANIFEST]["handle"] for meta in metas]
        assert wait_for(lambda: all(exists(reader, h + store.ERROR_SUFFIX) for h in handles), 60), \
            [h for h in handles if not exists(reader, h + store.ERROR_SUFFIX)]
        said = reader.store._store.get(handles[-1] + store.ERROR_SUFFIX).decode()
        assert f"the Mooncake master at {m.address} does not answer" in said, said
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(m.process.proc.pid, signal.SIGCONT)
        m.kill()


def test_a_handle_collision_fails_both_requests_through_the_marker(master, reader, sessions, monkeypatch):
    """Two live requests of one rid whose random suffixes collide (forced here): the
    second put is refused and its marker makes both readers fail, rather than the second
    reader taking the first request's sample (before: no marker). Handles carry 128 bits."""
    from hs_connectors.mooncake_store import MooncakeIntegrityError

    assert re.fullmatch(r"k1-[0-9a-f]{32}", store.unique_handle("1"))
    sess = sessions.start(store_runner(master))
    monkeypatch.setattr(store.secrets, "token_hex", lambda n: "ab" * n)
    a, b = Req("twin", 4, 1), Req("twin", 4, 2)
    run_extend(sess, [(a, 0, 4)], IDS)
    meta_a = finish(a)
    idle(sess)
    run_extend(sess, [(b, 0, 4)], IDS)
    meta_b = finish(b)
    snap = idle(sess)
    handle = meta_a[MANIFEST]["handle"]
    assert meta_b[MANIFEST]["handle"] == handle and snap["failures"] >= 1
    assert exists(reader, handle + store.ERROR_SUFFIX)
    with pytest.raises(MooncakeIntegrityError, match="handle collision"):
        read(reader, meta_b)


def test_start_up_quotes_a_mooncake_that_cannot_load(master, tmp_path):
    """``check_store_reachable`` imports ``mooncake.store``: a package whose extension
    misses libibverbs is refused at start-up in one sentence quoting the loader (with
    only ``find_spec`` it passed, and the writer failed every request)."""
    pkg = tmp_path / "lib" / "mooncake"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "store.py").write_text("raise ImportError('libibverbs.so.1: cannot open shared object file')\n")
    code = (f"import sys; sys.path.insert(0, {str(tmp_path / 'lib')!r})\n"
            "from sglang_ext import config, store\n"
            f"cfg = store.StoreConfig.from_url({master_config(master)!r})\n"
            "try:\n    config.check_store_reachable(cfg)\n"
            "except config.DumpConfigError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == (
        "--dump-hidden-states-dir: the Mooncake store sink cannot import mooncake.store (libibverbs.so.1: "
        "cannot open shared object file): install what it names (Debian: libibverbs1 librdmacm1 libnuma1) "
        "or reinstall mooncake (pip install -r requirements/store.txt)"), r.stdout + r.stderr


def test_samples_outlive_the_server_when_a_store_node_lends_the_memory(sessions, tmp_path):
    """The deployment docs/store.md recommends: a store node mounts the memory, the server
    lends none (``global_segment_size=0``). Its samples are put into the node's segment and
    stay readable, whole, after the server's writer has exited. A master and reader of its
    own: with the module's, a full CI run once failed the read (TRANSFER_FAIL, the node's
    session closed), and it took the module's master down at its end."""
    import subprocess
    import sys

    master = Master(tmp_path)
    reader = reader_for(master)
    node = subprocess.Popen([sys.executable, "-c", STORE_NODE, master.address, str(32 * MiB)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert node.stdout.readline().split() == ["mounted", "0"]
        sess = sessions.start(store_runner(master, segment=0))
        reqs = [Req("outlive-a", 5, 1), Req("outlive-b", 3, 2)]
        run_extend(sess, [(reqs[0], 0, 5), (reqs[1], 0, 3)], IDS)
        metas = [finish(r) for r in reqs]
        snap = idle(sess)
        assert snap["files_written"] == 2 and snap["failures"] == 0, snap
        sessions.close()  # the writer process exits, and with it any segment it lent
        for req, meta in zip(reqs, metas):
            got = read(reader, meta)
            assert torch.equal(got["hidden_states"], reference(req, IDS)), req.rid
            assert got["token_ids"].tolist() == req.origin_input_ids
    finally:
        node.kill()
        node.wait()
        master.kill()


def test_a_marker_deferred_after_the_watch_ended_is_still_put(tmp_path, monkeypatch):
    """The breaker's race a review replayed: a writer thread finds the breaker tripped
    (``unavailable`` returns at once), the watch thread then sees the master answer with
    no marker waiting and ends, and only then is that thread's marker deferred: it must
    still be put (before: it waited for the next outage's watch, its reader timed out)."""
    import ctypes

    from sglang_ext import store_writer

    monkeypatch.setattr(store_writer, "RETRY_CONNECT_S", 0.2)
    master = Master(tmp_path)  # a master of its own (the module's was unreachable here in a full CI run)
    reader = reader_for(master)
    arena = ctypes.create_string_buffer(1 << 20)
    conn = store_writer.Connection(store.StoreConfig.from_url(master_config(master, 16 * MiB)),
                                   ctypes.addressof(arena), len(arena))
    try:
        conn.get()
        conn.unavailable(store.StoreUnavailable("the master did not answer"))  # the breaker trips
        assert wait_for(lambda: not conn._watching, 30)  # the master answers: the watch ends
        handle = store.unique_handle("late-marker")
        conn.defer_marker(handle, "the master did not answer")  # the late thread's marker
        assert wait_for(lambda: exists(reader, handle + store.ERROR_SUFFIX), 30), "the marker was never put"
    finally:
        conn.close()
        master.kill()

