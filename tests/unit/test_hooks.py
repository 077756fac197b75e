"""The hooks SGLang's patched files call, driven with stand-ins for SGLang's objects.

The stand-ins carry only the attributes the hooks read (Req: rid, origin_input_ids,
is_retracted, customized_info, finished(); ScheduleBatch: reqs, forward_mode,
decoding_reqs, prefix_lens). The reference for every dumped file is a tensor computed
from (request, token position, layer slot, channel) by a formula, independent of how
the rows were batched, chunked or copied.
"""

import asyncio
import gc
import json
import os
import threading
import time
import types

import pytest
import torch

from sglang_ext import format as fmt
from sglang_ext import hooks, quant, session
from dumpfiles import write_dump
from sglang_ext.config import DumpConfig, DumpConfigError

from standins import (HIDDEN, Mode, Req, reference, extend_args, run_extend, Decoder, make_runner, inject_writer, PUBLISH_FAILS, PUBLISH_GATED, idle, wait_for, finish)  # noqa: F401


def test_setup_turns_on_default_layers(dump, sessions):
    runner = make_runner(dump, num_layers=32)
    sess = sessions.start(runner)
    assert runner.model.capture_aux_hidden_states is True
    assert runner.model.model.layers_to_capture == [2, 16, 29, 32]
    assert sess.layer_ids == (2, 16, 29, 32) and sess.is_writer


def test_the_door_forwards_to_the_session_setup_model_starts(dump, sessions):
    """hooks, as the patched files call it: off until setup_model (a draft model's runner
    starts nothing); then capture_hidden_mode and on_prefill_result reach the session it
    started, each call writing its batch's files."""
    extend = types.SimpleNamespace(forward_mode=Mode(True))
    runner, draft = make_runner(dump, layers="2,4"), make_runner(dump, layers="2,4")
    draft.is_draft_worker = True
    hooks.setup_model(draft)
    assert not hooks.is_enabled() and hooks.session() is None
    assert hooks.capture_hidden_mode(extend, runner, 0) == 0
    a, b = Req("a", 3, 1), Req("b", 4, 2)
    hooks.on_prefill_result(*extend_args([(a, 0, 3)], [2, 4]))  # dumping off: nothing
    assert a.customized_info is None and os.listdir(dump) == []
    hooks.setup_model(runner)
    sess = hooks.session()
    assert hooks.is_enabled() and sess.is_writer
    assert hooks.capture_hidden_mode(extend, runner, 0) is sess.capture_full
    hooks.on_prefill_result(*extend_args([(a, 0, 3)], [2, 4]))
    hooks.on_prefill_result(*extend_args([(b, 0, 4)], [2, 4]))
    for req in (a, b):
        assert torch.equal(fmt.load(finish(req)["hidden_states_path"]).hidden_states, reference(req, [2, 4]))
    assert idle(sess)["files_written"] == 2 and idle(sess)["failures"] == 0


def test_start_line_says_where_the_writer_runs(dump, monkeypatch, caplog, sessions):
    """The start line names the CPUs the writer was given (KIMI_SGLANG_WRITER_CPUS), or,
    when the scheduler is confined to fewer CPUs than the host has, that the writer
    shares them and which variable moves it; nothing when the scheduler may use all, and
    nothing on a rank without a writer."""
    monkeypatch.delenv("KIMI_SGLANG_WRITER_CPUS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    with caplog.at_level("INFO", logger="sglang_ext.session"):
        sessions.start(make_runner(dump, layers="2,4"))
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hidden-state dump: layers")]
    assert line.endswith("(writer rank: True; writer process on the scheduler's 1 CPUs [0]: "
                         "KIMI_SGLANG_WRITER_CPUS can name others it may use)"), line
    assert session.writer_cpus_note(True, (2, 3)) == "; writer process on CPUs [2, 3]"
    assert session.writer_cpus_note(False, None) == ""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert session.writer_cpus_note(True, None) == ""


def test_setup_finds_language_model_of_a_multimodal_wrapper(dump, sessions):
    inner = make_runner(dump, layers="3,31,59,61", num_layers=61)
    wrapper = types.SimpleNamespace(language_model=inner.model)
    inner.model = wrapper
    sessions.start(inner)
    assert wrapper.language_model.model.layers_to_capture == [3, 31, 59, 61]


def test_setup_refuses_out_of_range_and_unpatched_final_slot(dump, sessions):
    with pytest.raises(DumpConfigError, match="exceed the model's 8 layers"):
        sessions.start(make_runner(dump, layers="2,9"))
    runner = make_runner(dump, layers="2,8")
    runner.model.model = torch.nn.Module()
    runner.model.model.layers_to_capture = []
    with pytest.raises(DumpConfigError, match="before the final norm"):
        sessions.start(runner)


def test_one_file_per_request_with_chunked_prefill_and_mixed_batches(dump, sessions):
    sess = sessions.start(make_runner(dump, layers="2,4,8"))
    ids = [2, 4, 8]
    a, b, c = Req("a", 10, 1), Req("b", 3, 2), Req("c", 6, 3)
    # Batch 1: b whole, first chunk of a. Batch 2: a's middle chunk, c whole, b decoding.
    # Batch 3: a's last chunk.
    run_extend(sess, [(b, 0, 3), (a, 0, 4)], ids)
    assert a.customized_info is None, "a middle chunk must not finish the request"
    run_extend(sess, [(a, 4, 8), (c, 0, 6), (b, 0, 0)], ids, decoding=(b,))
    run_extend(sess, [(a, 8, 10)], ids)
    for req in (a, b, c):
        meta = finish(req)
        assert "hidden_states_error" not in meta, meta
        rec = fmt.load(meta["hidden_states_path"])
        want = reference(req, ids)
        assert rec.hidden_states.shape == want.shape
        assert torch.equal(rec.hidden_states, want), (
            f"{req.rid}: max diff {(rec.hidden_states - want).abs().max()}"
        )
        assert rec.token_ids.tolist() == req.origin_input_ids
        assert rec.layer_ids == ids and rec.metadata["rid"] == req.rid
    index = fmt.read_index(str(dump))
    assert sorted(r["rid"] for r in index) == ["a", "b", "c"]
    assert {r["file"] for r in index} == {n for n in os.listdir(dump) if n.endswith(".safetensors")}


def test_same_rid_twice_keeps_both_files(dump, sessions):
    sess = sessions.start(make_runner(dump, layers="2,4"))
    first, second = Req("same", 4, 1), Req("same", 5, 2)
    run_extend(sess, [(first, 0, 4), (second, 0, 5)], [2, 4])
    p1, p2 = finish(first)["hidden_states_path"], finish(second)["hidden_states_path"]
    assert p1 != p2
    assert torch.equal(fmt.load(p1).hidden_states, reference(first, [2, 4]))
    assert torch.equal(fmt.load(p2).hidden_states, reference(second, [2, 4]))


def test_other_tp_ranks_copy_and_write_nothing(dump, sessions):
    sess = sessions.start(make_runner(dump, layers="2,4", tp_rank=1))
    assert sess.writer is None
    req = Req("r", 4, 1)
    run_extend(sess, [(req, 0, 4)], [2, 4])
    assert req.customized_info is None
    assert os.listdir(dump) == []


def test_aborted_request_drops_its_temporary_file_and_writes_nothing(dump, sessions):
    sess = sessions.start(make_runner(dump, layers="2,4"))
    req = Req("gone", 8, 1)
    run_extend(sess, [(req, 0, 4)], [2, 4])
    # The first chunk is in the writer's temporary file already, out of the arena.
    assert idle(sess)["host_bytes_in_use"] == 0
    assert [n for n in os.listdir(dump) if n.endswith(fmt.TMP_SUFFIX)]
    req.aborted = True
    run_extend(sess, [(req, 4, 8)], [2, 4])
    assert wait_for(lambda: os.listdir(dump) == []), os.listdir(dump)
    assert req.customized_info is None
    assert sess.writer.unwritten_bytes() == 0  # the free-space floor holds nothing back for it


def test_a_request_sglang_aborts_before_its_forward_gets_no_file(dump, sessions):
    """SGLang's set_finish_with_abort (an invalid request: a bad session id, an image that
    did not load, a prompt over the context length...) replaces the prompt by the one
    token 0 and still runs it; the answer is the abort's error. Before, that forward left a
    file of token 0's rows, with its path in the answer and the index (a sample nobody
    sent); now nothing is written. So for a request aborted between two chunks."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    sess = sessions.start(make_runner(dump, layers="2,4"))
    invalid = Req("invalid", 1, 1)
    invalid.origin_input_ids = [0]
    invalid.to_finish = FINISH_ABORT("Invalid request: session id 7 does not exist")
    chunked = Req("aborted-between-chunks", 8, 2)
    run_extend(sess, [(invalid, 0, 1), (chunked, 0, 4)], [2, 4])
    chunked.to_finish = FINISH_ABORT()
    run_extend(sess, [(chunked, 4, 8)], [2, 4])
    assert wait_for(lambda: os.listdir(dump) == []), os.listdir(dump)  # the first chunk's temporary goes
    assert invalid.customized_info is None and chunked.customized_info is None
    assert sess.writer.unwritten_bytes() == 0


def test_a_request_of_input_embeds_gets_an_error_not_a_file_of_made_up_ids(dump, sessions):
    """A /generate request with input_embeds (SGLang takes them with the radix cache off,
    which dumping turns off) reaches the scheduler with made-up ids, ``[1] *
    len(input_embeds)`` (scheduler.py ``handle_generate_request``), on SGLang's real Req:
    a file would pair its rows with token id 1 at every position. It gets
    hidden_states_error (a sentence) and no file; a request beside it is dumped. Before,
    the file recorded the made-up ids."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req as SGLangReq
    from sglang.srt.sampling.sampling_params import SamplingParams

    embeds = SGLangReq("embeds", "", array("q", [1]) * 5, SamplingParams(max_new_tokens=1),
                       input_embeds=[[0.5] * 16 for _ in range(5)])
    embeds.seed = 1
    _refused_beside_a_plain_request(sessions, dump, embeds, "input_embeds")


def _refused_beside_a_plain_request(sessions, dump, req, says):
    """``req`` (SGLang's real Req of 5 prompt tokens) and a plain request in one extend
    batch: ``req`` gets ``hidden_states_error`` holding ``says`` and no file; the plain one
    its file, equal to its reference, the only file in ``dump``."""
    sess = sessions.start(make_runner(dump, layers="2,4"))
    plain = Req("plain", 3, 2)
    run_extend(sess, [(req, 0, 5), (plain, 0, 3)], [2, 4])
    meta = finish(req)
    assert "hidden_states_path" not in meta and says in meta["hidden_states_error"], meta
    rec = fmt.load(finish(plain)["hidden_states_path"])
    assert torch.equal(rec.hidden_states, reference(plain, [2, 4]))
    assert wait_for(lambda: sorted(os.listdir(dump)) == sorted(
        [os.path.basename(finish(plain)["hidden_states_path"]), "index.jsonl"])), os.listdir(dump)


def test_a_beam_search_request_gets_an_error_not_a_file_it_may_not_have_asked_for(dump, sessions):
    """A beam search request (``beam_width`` > 1): SGLang's ``BeamCoordinator.validate_and_init``
    replaces its sampling_params by ``neutral_member_sampling_params``' (beam_search/fork.py),
    which carry no custom_params, so its ``hidden_states_dump`` false (or ``hidden_states_output``)
    cannot be read. It gets hidden_states_error (a sentence naming beam search) and no file; a
    request beside it is dumped. Before, its prompt was dumped whatever it asked."""
    from array import array

    from sglang.srt.beam_search.beam_group import BeamGroup
    from sglang.srt.beam_search.fork import neutral_member_sampling_params
    from sglang.srt.managers.schedule_batch import Req as SGLangReq
    from sglang.srt.sampling.sampling_params import SamplingParams

    user = SamplingParams(max_new_tokens=4, beam_width=2, custom_params={fmt.DUMP_PARAM: False})
    beam = SGLangReq("beam", "", array("q", range(5, 10)), user)
    beam.seed = 1
    beam.sampling_params = neutral_member_sampling_params(user)  # as validate_and_init does
    beam.beam_group = BeamGroup(beam_width=2, max_new_tokens=4)
    beam.beam_group.leader = beam
    _refused_beside_a_plain_request(sessions, dump, beam, "beam")


def test_prefix_reuse_gives_an_error_not_a_short_file(dump, sessions):
    sess = sessions.start(make_runner(dump, layers="2,4"))
    req = Req("cached", 8, 1)
    run_extend(sess, [(req, 3, 8)], [2, 4])  # a radix-cache hit would start at token 3
    meta = finish(req)
    assert "hidden_states_path" not in meta
    assert "prefix reuse" in meta["hidden_states_error"]
    assert not any(n.endswith(".safetensors") for n in os.listdir(dump))


def test_retracted_mid_prefill_starts_over(dump, sessions):
    sess = sessions.start(make_runner(dump, layers="2,4"))
    req = Req("again", 6, 1)
    run_extend(sess, [(req, 0, 4)], [2, 4])
    run_extend(sess, [(req, 0, 4)], [2, 4])  # scheduled again from scratch
    run_extend(sess, [(req, 4, 6)], [2, 4])
    path = finish(req)["hidden_states_path"]
    assert torch.equal(fmt.load(path).hidden_states, reference(req, [2, 4]))
    # the abandoned first attempt's temporary goes on a writer thread of its own: it may
    # still be there when the second attempt's file is (CI saw it 1 run in 20)
    want = sorted([os.path.basename(path), fmt.INDEX_NAME])
    assert wait_for(lambda: sorted(os.listdir(dump)) == want), os.listdir(dump)


@pytest.mark.parametrize("early", [False, True])
def test_failed_write_reaches_the_response(dump, monkeypatch, tmp_path, early, sessions):
    """Waiting: the response carries hidden_states_error and no path. Answered early
    (custom_params hidden_states_wait=false): the path with hidden_states_pending, and the
    error reaches the client through <path>.error when the lock goes (format.wait_complete)."""
    inject_writer(monkeypatch, tmp_path, PUBLISH_FAILS)
    sess = sessions.start(make_runner(dump, layers="2,4"))
    req = Req("full", 4, 1)
    if early:
        req.sampling_params = types.SimpleNamespace(custom_params={"hidden_states_wait": False})
    run_extend(sess, [(req, 0, 4)], [2, 4])
    meta = finish(req)
    if early:
        assert meta["hidden_states_pending"] is True
        assert "No space left on device" in fmt.wait_complete(meta["hidden_states_path"], timeout=10)
    else:
        assert "No space left on device" in meta["hidden_states_error"]
        assert "hidden_states_path" not in meta
    assert not any(n.endswith(".safetensors") for n in os.listdir(dump))
    assert idle(sess)["failures"] == 1


def test_decode_batches_are_ignored_and_capture_mode(dump, sessions):
    sess = sessions.start(make_runner(dump, layers="2,4"))
    req = Req("d", 4, 1)
    run_extend(sess, [(req, 0, 4)], [2, 4], mode=Mode(extend=False))
    assert req.customized_info is None
    runner = types.SimpleNamespace(is_draft_worker=False)
    assert sess.capture_hidden_mode(types.SimpleNamespace(forward_mode=Mode(True)), runner, 0) is sess.capture_full
    assert sess.capture_hidden_mode(types.SimpleNamespace(forward_mode=Mode(False)), runner, 0) == 0


def test_decode_rows_of_a_mixed_batch_are_skipped(dump, sessions):
    # A request decoding inside a mixed (chunked-prefill + decode) batch contributes one
    # row that is not a prompt row, even if its prefill was never seen by the dumper.
    sess = sessions.start(make_runner(dump, layers="2,4"))
    running, new = Req("running", 4, 1), Req("new", 3, 2)
    run_extend(sess, [(running, 0, 0), (new, 0, 3)], [2, 4], decoding=(running,))
    assert running.customized_info is None
    assert torch.equal(fmt.load(finish(new)["hidden_states_path"]).hidden_states, reference(new, [2, 4]))


def test_health_check_requests_are_not_dumped(dump, sessions):
    sess = sessions.start(make_runner(dump, layers="2,4"))
    probe = Req("HEALTH_CHECK_0123abcd", 1, 1)
    run_extend(sess, [(probe, 0, 1)], [2, 4])
    assert probe.customized_info is None
    assert os.listdir(dump) == []


def test_trace_records_every_stage_in_order(dump, tmp_path, monkeypatch, sessions):
    """KIMI_SGLANG_TRACE: one hook line per extend batch, one file line and one response
    line per request, stage times in pipeline order, bytes equal to the file's size."""
    from sglang_ext import trace

    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(trace.ENV, str(path))
    sess = sessions.start(make_runner(dump, layers="2,4,8"))
    a, b = Req("a", 10, 1), Req("b", 3, 2)
    run_extend(sess, [(b, 0, 3), (a, 0, 4)], [2, 4, 8])
    run_extend(sess, [(a, 4, 10)], [2, 4, 8])
    metas = {r.rid: finish(r) for r in (a, b)}
    # A file's trace line is written just after its lock is released (which the response
    # waits for), so it may land a moment after finish() returns.
    deadline = time.monotonic() + 10
    while True:
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        if sum(x["event"] == "file" for x in lines) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    hooks = [x for x in lines if x["event"] == "hook"]
    assert [x["reqs"] for x in hooks] == [2, 1]
    for h in hooks:  # the hook's parts, in the order it does them
        parts = [h[k] for k in ("t0", "t_take", "t_copy", "t1")]
        assert parts == sorted(parts), h
    files = {x["name"]: x for x in lines if x["event"] == "file"}
    responses = {x["name"]: x for x in lines if x["event"] == "response"}
    for rid, meta in metas.items():
        name = os.path.basename(meta["hidden_states_path"])
        f, r = files[name], responses[name]
        stages = [f[k] for k in ("t_start", "t_submit", "t_picked", "t_copied", "t_written", "t_released")]
        assert stages == sorted(stages), f
        assert f["bytes"] == os.path.getsize(meta["hidden_states_path"])
        assert f["rows"] == (10 if rid == "a" else 3)
        assert r["error"] is None and r["t_meta"] <= r["t_done"]
        # the response waited for the file: it returned after the rename (t_released is
        # taken after the acknowledgement, so a response woken by the release itself may
        # return before it)
        assert f["t_written"] <= r["t_done"]
    monkeypatch.delenv(trace.ENV)  # a server started without the variable
    sess.close(timeout=10)
    recorded = len(path.read_text().splitlines())
    sess = sessions.start(make_runner(dump, layers="2,4,8"))
    c = Req("c", 2, 3)
    run_extend(sess, [(c, 0, 2)], [2, 4, 8])
    finish(c)
    idle(sess)
    assert len(path.read_text().splitlines()) == recorded, "tracing off: nothing recorded"


def test_trace_to_a_path_that_cannot_be_opened_is_silent(tmp_path, monkeypatch):
    from sglang_ext import trace

    monkeypatch.setenv(trace.ENV, str(tmp_path / "missing-dir" / "t.jsonl"))
    trace.record("file", name="x")  # no error, nothing written
    trace.record("file", name="y")
    good = tmp_path / "t.jsonl"
    monkeypatch.setenv(trace.ENV, str(good))
    trace.record("hook", reqs=1, t0=0.0, t1=1.0)
    assert [json.loads(x)["event"] for x in good.read_text().splitlines()] == ["hook"]
    assert not (tmp_path / "missing-dir").exists()


def test_request_that_asks_not_to_wait_is_answered_before_its_file(dump, monkeypatch, tmp_path, sessions):
    """custom_params hidden_states_wait=false: the response comes while the writer still
    holds <path>.lock, says hidden_states_pending, and the file is complete once the lock
    is gone (format.wait_complete). Default requests still wait."""
    gate = tmp_path / "gate"
    inject_writer(monkeypatch, tmp_path, PUBLISH_GATED, GATE=str(gate))
    sess = sessions.start(make_runner(dump, layers="2,4"))
    early, normal = Req("early", 5, 1), Req("normal", 3, 2)
    early.sampling_params = types.SimpleNamespace(custom_params={"hidden_states_wait": False})
    normal.sampling_params = types.SimpleNamespace(custom_params={"other": 1})
    run_extend(sess, [(early, 0, 5), (normal, 0, 3)], [2, 4])
    meta = finish(early, timeout=2)  # would time out if it waited for the gated write
    path = meta["hidden_states_path"]
    assert meta["hidden_states_pending"] is True
    assert os.path.exists(path + fmt.LOCK_SUFFIX) and not os.path.exists(path)
    gate.touch()
    assert fmt.wait_complete(path, timeout=10) is None
    assert torch.equal(fmt.load(path).hidden_states, reference(early, [2, 4]))
    meta_n = finish(normal)
    assert "hidden_states_pending" not in meta_n
    assert torch.equal(fmt.load(meta_n["hidden_states_path"]).hidden_states, reference(normal, [2, 4]))


def test_data_parallel_is_accepted_and_splits_the_host_cap(tmp_path):
    """Each DP rank writes its own requests (DP attention verified on two H200s,
    tests/gpu/results-2026-12-01-h200x2-tp2-deepseek.json); the server's host cap is
    shared among those writer ranks, a cap too small to share is refused, and so is
    attention context parallelism."""
    args = types.SimpleNamespace(
        dump_hidden_states_dir=str(tmp_path), dump_hidden_states_layers=None,
        dump_hidden_states_max_host_mb=64, enable_return_hidden_states=False,
        return_hidden_states_mode=None, enable_dp_attention=True, dp_size=4,
        disable_radix_cache=True, disable_prefill_cuda_graph=True)
    hooks.check_server_args(args)
    assert DumpConfig.from_server_args(args).max_host_bytes == 16 << 20
    args.enable_dp_attention = False  # plain DP: one full TP group, so one writer, per DP rank
    assert DumpConfig.from_server_args(args).max_host_bytes == 16 << 20
    args.dp_size = 1
    assert DumpConfig.from_server_args(args).max_host_bytes == 64 << 20
    args.dp_size, args.dump_hidden_states_max_host_mb = 4, 3
    with pytest.raises(DumpConfigError, match="less than 1 MiB each"):
        hooks.check_server_args(args)
    args.dump_hidden_states_max_host_mb, args.attn_cp_size = 64, 2  # CP ranks: many writers per request
    with pytest.raises(DumpConfigError, match="--attn-cp-size > 1"):
        hooks.check_server_args(args)


@pytest.mark.parametrize("value, refused", [("1", True), ("true", True), ("0", False)])
def test_sglangs_rust_server_is_refused(tmp_path, monkeypatch, value, refused):
    """SGLANG_RUST_SERVER (SGLang 0.5.23's embedded Rust HTTP server and detokenizer)
    replaces the tokenizer manager: its output frames carry no customized_info and
    finish_response never runs, so a dumped request would be answered with neither its
    path nor an error, before its file is written. Refused at start-up in one sentence,
    by SGLang's own reading of the variable (environ.envs); "0" is accepted."""
    monkeypatch.setenv("SGLANG_RUST_SERVER", value)
    args = types.SimpleNamespace(
        dump_hidden_states_dir=str(tmp_path), dump_hidden_states_layers=None,
        dump_hidden_states_max_host_mb=64, enable_return_hidden_states=False,
        return_hidden_states_mode=None, disable_radix_cache=True, disable_prefill_cuda_graph=True)
    if not refused:
        hooks.check_server_args(args)
        return
    with pytest.raises(DumpConfigError, match="cannot be combined with SGLANG_RUST_SERVER"):
        hooks.check_server_args(args)


def test_finish_response_drops_keys_padded_for_other_requests():
    """SGLang's output streamer pads a customized_info key that only some requests of an
    output batch carry with [None] for the others (scheduler_components/output_streamer.py):
    such a request gets neither a path nor an error nor a pending flag, and no wait."""
    meta = {"hidden_states_path": [None], "hidden_states_error": [None],
            "hidden_states_pending": [None], "id": "x"}
    asyncio.run(asyncio.wait_for(hooks.finish_response(meta), 2))
    assert meta == {"id": "x"}
    failed = {"hidden_states_path": [None], "hidden_states_error": ["boom"]}
    asyncio.run(asyncio.wait_for(hooks.finish_response(failed), 2))
    assert failed == {"hidden_states_error": "boom"}


def test_plain_request_padded_with_pending_none_still_waits_for_its_file(dump):
    """A plain request in the same output batch as an early one gets
    hidden_states_pending [None]: it must still wait for its file (held here by the lock)."""
    fd = fmt.open_dump_dir(str(dump))
    res = fmt.reserve(fd, "plain")
    path = os.path.join(str(dump), res.name)
    meta = {"hidden_states_path": [path], "hidden_states_pending": [None]}
    task_done = threading.Event()

    def answer():
        asyncio.run(hooks.finish_response(meta))
        task_done.set()

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    assert not task_done.wait(0.3), "answered while the file was still being written"
    write_dump(res, torch.zeros(2, 1, 4), torch.tensor([1, 2]),
                fmt.build_metadata(rid="plain", layer_ids=[1], num_layers=2))
    fmt.complete(res)
    assert task_done.wait(5)
    assert meta == {"hidden_states_path": path}
    os.close(fd)


def test_a_dropped_request_holds_no_arena_memory(dump, sessions):
    """SGLang 0.5.17's Req.__init__ stores the Req in its own custom_params["__req__"]; with a
    custom logit processor (which reads it, so the hook keeps it) a request dropped between
    prefill chunks is freed only by the cycle collector. Its rows are in
    the writer's temporary file already, not in the arena: the next request, which needs
    most of the arena, goes through without any collection; the temporary file goes when
    the cycle is collected."""
    sess = sessions.start(make_runner(dump, layers="2,4", max_mb=1))
    n = (1 << 20) // (2 * HIDDEN * 4) * 3 // 4  # float32 rows: 3/4 of the 1 MiB arena
    gc.disable()
    try:
        a = Req("cyclic", n, 1)
        a.sampling_params = types.SimpleNamespace(custom_params={"hidden_states_wait": False})
        a.sampling_params.custom_params["__req__"] = a
        a.custom_logit_processor = "some.module:Processor"
        run_extend(sess, [(a, 0, n // 2)], [2, 4])  # its first chunk; then SGLang drops it
        del a
        b = Req("next", n, 2)
        t = threading.Thread(target=run_extend, args=(sess, [(b, 0, n)], [2, 4]), daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), "the scheduler thread stayed blocked on the arena"
        assert torch.equal(fmt.load(finish(b)["hidden_states_path"]).hidden_states, reference(b, [2, 4]))
        assert [n for n in os.listdir(dump) if n.endswith(fmt.TMP_SUFFIX)]  # a's, until collected
    finally:
        gc.enable()
    gc.collect()
    assert wait_for(lambda: not [n for n in os.listdir(dump) if n.endswith(fmt.TMP_SUFFIX)])
    assert sess.writer.unwritten_bytes() == 0


def test_token_ids_of_every_int64_value_round_trip_and_others_fail_the_request(dump, sessions):
    sess = sessions.start(make_runner(dump, layers="2,4"))
    good, bad = Req("good", 5, 1), Req("bad", 3, 2)
    good.origin_input_ids = [0, 1, 2**40, 2**63 - 1, -(2**63)]
    bad.origin_input_ids = [1, 2**63, 3]
    run_extend(sess, [(bad, 0, 3), (good, 0, 5)], [2, 4])
    assert "OverflowError" in finish(bad)["hidden_states_error"]
    rec = fmt.load(finish(good)["hidden_states_path"])
    assert rec.token_ids.dtype == torch.int64 and rec.token_ids.tolist() == good.origin_input_ids
    assert torch.equal(rec.hidden_states, reference(good, [2, 4]))


# ---- --dump-hidden-states-dtype ----------------------------------------------------------
def fp8_bound(x, scales):
    """quant.py's per-element bound: 2^-4 |x| + 2^-10 scale (plus float32 rounding)."""
    return (2.0 ** -4 * x.abs() + 2.0 ** -10 * scales) * (1 + 1e-6)


def test_fp8_files_round_trip_within_the_stated_bound(dump, sessions):
    sess = sessions.start(make_runner(dump, layers="2,4,8", dtype="fp8"))
    ids = [2, 4, 8]
    a, b, c = Req("a", 10, 1), Req("b", 3, 2), Req("c", 6, 3)
    run_extend(sess, [(b, 0, 3), (a, 0, 4)], ids)  # chunked prefill, mixed batch, as above
    run_extend(sess, [(a, 4, 8), (c, 0, 6), (b, 0, 0)], ids, decoding=(b,))
    run_extend(sess, [(a, 8, 10)], ids)
    for req in (a, b, c):
        meta = finish(req)
        assert "hidden_states_error" not in meta, meta
        path = meta["hidden_states_path"]
        rec = fmt.load(path)
        want = reference(req, ids)
        t = want.shape[0]
        assert rec.hidden_states.dtype == torch.float8_e4m3fn and rec.hidden_states.shape == want.shape
        assert rec.scales.dtype == torch.float32 and rec.scales.shape == (t, 3, 1)
        assert torch.equal(rec.scales, (want.abs().amax(2, keepdim=True) / 448).clamp(min=1e-12))
        assert rec.metadata["hidden_states_dtype"] == "float8_e4m3fn"
        assert rec.metadata["scale_layout"] == "per_token_per_layer"
        assert rec.token_ids.tolist() == req.origin_input_ids and rec.layer_ids == ids
        deq = fmt.load(path, dequantize=True)
        assert deq.hidden_states.dtype == torch.float32 and deq.scales is None
        err = (deq.hidden_states - want).abs()
        assert (err <= fp8_bound(want, rec.scales)).all(), f"{req.rid}: max error {err.max()}"
        assert err.max() > 0  # the reference's values are not all exact in e4m3
        # what the hook quantized equals quantizing the reference directly
        q, sc = quant.quantize_fp8(want.reshape(t, -1), 3)
        assert torch.equal(rec.hidden_states.view(torch.uint8), q.view(t, 3, -1).view(torch.uint8))


def test_fp8_file_holds_about_half_the_bytes_of_bf16(dump, tmp_path, sessions):
    sizes = {}
    for dtype in ("bf16", "fp8"):
        d = tmp_path / dtype
        d.mkdir()
        sess = sessions.start(make_runner(d, layers="2,4,8", dtype=dtype))
        req = Req(f"r-{dtype}", 300, 1)
        run_extend(sess, [(req, 0, 300)], [2, 4, 8])
        path = finish(req)["hidden_states_path"]
        rec = fmt.load(path, dequantize=True)
        want = reference(req, [2, 4, 8])
        if dtype == "bf16":  # the model's rows are float32 here: cast on the way
            assert rec.hidden_states.dtype == torch.bfloat16
            assert torch.equal(rec.hidden_states, want.to(torch.bfloat16))
        else:
            assert (rec.hidden_states - want).abs().max() <= 2 ** -4 * want.abs().max()
        sizes[dtype] = os.path.getsize(path)
        sess.close(timeout=10)
    # per token: bf16 2*L*H + 8 (ids); fp8 L*H + 4*L (scales) + 8; plus one 4 KiB header
    slots, t = 3, 300
    assert sizes["bf16"] == 4096 + t * (2 * slots * HIDDEN + 8)
    assert sizes["fp8"] == 4096 + t * (slots * HIDDEN + 4 * slots + 8)


def test_speculators_fp8_reader_loads_our_files_unchanged(dump, tmp_path, sessions):
    """hs-connectors' FP8Transfer (speculators' --hidden-states-backend fp8), directly
    and through speculators' training dataset, gives exactly our dequantization."""
    from hs_connectors.transfer import FP8Transfer, HiddenStatesBackend

    sess = sessions.start(make_runner(dump, layers="2,4,8", dtype="fp8"))
    reqs = [Req(f"s{i}", 5 + 3 * i, i + 1) for i in range(3)]
    run_extend(sess, [(r, 0, len(r.origin_input_ids)) for r in reqs], [2, 4, 8])
    hs_dir = tmp_path / "speculators-hs"
    hs_dir.mkdir()
    for i, r in enumerate(reqs):  # speculators' cached-sample names
        os.link(finish(r)["hidden_states_path"], hs_dir / f"hs_{i}.safetensors")
    for dtype in (torch.bfloat16, torch.float32):
        transfer = FP8Transfer(hs_dir, dequantize_dtype=dtype)
        for i, r in enumerate(reqs):
            got = transfer.get_cached(i)
            ours = fmt.load(str(hs_dir / f"hs_{i}.safetensors"), dequantize=dtype)
            assert set(got) == {"hidden_states", "token_ids"}
            assert got["hidden_states"].dtype == dtype
            assert torch.equal(got["hidden_states"], ours.hidden_states)
            assert torch.equal(got["token_ids"], ours.token_ids)
    try:
        from datasets import Dataset
        from speculators.train.data import ArrowDataset
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"speculators' training dataset does not import ({type(e).__name__}: {e})")
    # the trainer's own construction for --hidden-states-backend fp8 (speculators.train.cli)
    args = types.SimpleNamespace(hidden_states_path=str(hs_dir))
    transfer = HiddenStatesBackend.registry["fp8"].from_train_args(args, str(tmp_path))
    assert isinstance(transfer, FP8Transfer)
    data = [r.origin_input_ids for r in reqs]
    Dataset.from_dict({"input_ids": data, "loss_mask": [[1] * len(d) for d in data],
                       "seq_len": [len(d) for d in data]}).with_format("torch").save_to_disk(
        str(tmp_path / "prepared"))
    ds = ArrowDataset(max_len=64, datapath=str(tmp_path / "prepared"), transfer=transfer,
                      on_missing="raise")
    for i, r in enumerate(reqs):
        item = ds[i]
        ours = fmt.load(str(hs_dir / f"hs_{i}.safetensors"), dequantize=torch.bfloat16).hidden_states
        t = len(r.origin_input_ids)
        assert item["input_ids"].tolist() == r.origin_input_ids
        assert torch.equal(item["hidden_states"], ours[:, :2, :].reshape(t, 2 * HIDDEN))
        assert torch.equal(item["verifier_last_hidden_states"], ours[:, 2, :])


def test_a_request_freed_by_refcount_despite_custom_params_self_reference(dump, sessions):
    """SGLang 0.5.17 puts ``"__req__": req`` into every request's custom_params (a cycle):
    the hook drops it at the request's first chunk, so the finished request dies by its
    refcount with the garbage collector off; a request with a custom logit processor keeps
    it, and a weak proxy (0.5.23) is left alone. The early answer still reads its key."""
    import gc
    import weakref

    sess = sessions.start(make_runner(dump, layers="2,4"))
    early, skipped, processed, proxied = (Req(n, 3, i) for i, n in enumerate(("early", "skip", "clp", "proxy")))
    for req, key in ((early, fmt.WAIT_PARAM), (skipped, fmt.DUMP_PARAM), (processed, fmt.WAIT_PARAM)):
        req.sampling_params = types.SimpleNamespace(custom_params={key: False, "__req__": req})
    processed.custom_logit_processor = "some.module:Processor"
    proxied.sampling_params = types.SimpleNamespace(custom_params={"__req__": weakref.proxy(proxied)})
    run_extend(sess, [(early, 0, 3), (skipped, 0, 3), (processed, 0, 3), (proxied, 0, 3)], [2, 4])
    assert early.sampling_params.custom_params == {fmt.WAIT_PARAM: False}
    assert skipped.sampling_params.custom_params == {fmt.DUMP_PARAM: False}
    assert processed.sampling_params.custom_params["__req__"] is processed
    assert isinstance(proxied.sampling_params.custom_params["__req__"], weakref.ProxyType)
    meta = finish(early)
    assert meta[fmt.PENDING_KEY] is True
    assert fmt.wait_complete(meta["hidden_states_path"], timeout=10) is None
    assert torch.equal(fmt.load(meta["hidden_states_path"]).hidden_states, reference(early, [2, 4]))
    gone = weakref.ref(early)
    gc.disable()
    try:
        del early
        assert gone() is None
    finally:
        gc.enable()


def test_a_request_the_writer_refuses_or_a_closed_writer_answers_with_the_error(dump, sessions):
    """Token ids that do not fit int64 (the writer refuses them when it opens the request),
    at a request's only chunk or its first, or a writer closed (as at SIGTERM): the
    response says hidden_states_error, early answer or not, and no name stays reserved
    (no lock, no .error file); a request that failed at its first chunk ignores the rest."""
    sess = sessions.start(make_runner(dump, layers="2,4"))
    bad, early, middle = Req("bad", 3, 1), Req("early", 3, 2), Req("middle", 6, 3)
    bad.origin_input_ids[1] = 1 << 63
    early.origin_input_ids[0] = -(1 << 64)
    early.sampling_params = types.SimpleNamespace(custom_params={fmt.WAIT_PARAM: False})
    middle.origin_input_ids[5] = 1 << 70
    run_extend(sess, [(bad, 0, 3), (early, 0, 3), (middle, 0, 3)], [2, 4])
    for req in (bad, early):
        meta = finish(req)
        assert set(meta) == {"hidden_states_error"} and "OverflowError" in meta["hidden_states_error"], meta
    run_extend(sess, [(middle, 3, 6)], [2, 4])  # ignored: it failed at its first chunk
    assert "OverflowError" in finish(middle)["hidden_states_error"]
    late = Req("late", 4, 4)
    sess.writer.close(timeout=10)
    run_extend(sess, [(late, 0, 4)], [2, 4])
    meta = finish(late)
    assert set(meta) == {"hidden_states_error"} and "RuntimeError" in meta["hidden_states_error"], meta
    assert not [n for n in os.listdir(dump) if n.endswith((fmt.SUFFIX, fmt.LOCK_SUFFIX, fmt.ERROR_SUFFIX))]


def test_one_call_failure_after_naming_answers_with_the_error_and_leaves_nothing(dump, sessions):
    """The response is not out when the writer refuses a one-chunk request (the hook runs
    before the batch's outputs are streamed): it says hidden_states_error, early answer or
    not, and the reserved name is given back (no lock, no .error file); the batch's other
    request is written."""
    sess = sessions.start(make_runner(dump, layers="2,4"))
    early, ok = Req("early", 3, 1), Req("ok", 3, 2)
    early.origin_input_ids[1] = 1 << 70
    early.sampling_params = types.SimpleNamespace(custom_params={fmt.WAIT_PARAM: False})
    run_extend(sess, [(early, 0, 3), (ok, 0, 3)], [2, 4])
    meta = finish(early)
    assert set(meta) == {"hidden_states_error"} and "OverflowError" in meta["hidden_states_error"]
    assert torch.equal(fmt.load(finish(ok)["hidden_states_path"]).hidden_states, reference(ok, [2, 4]))
    assert sorted(os.listdir(dump)) == sorted([os.path.basename(finish(ok)["hidden_states_path"]), "index.jsonl"])


def test_an_error_escaping_the_hook_fails_its_named_requests_and_leaves_no_lock(dump, monkeypatch, sessions):
    """An error that escapes on_prefill_result (here KeyboardInterrupt out of the copy)
    propagates, and a request of the batch whose name was reserved answers with it (the
    name given back), so no waiter is left a lock with nothing behind it."""
    sess = sessions.start(make_runner(dump, layers="2,4"))

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(sess.writer, "copy_rows", interrupted)
    b, c = Req("b", 3, 2), Req("c", 5, 3)
    with pytest.raises(KeyboardInterrupt):
        run_extend(sess, [(b, 0, 3), (c, 0, 2)], [2, 4])
    meta = finish(b)
    assert set(meta) == {"hidden_states_error"} and "KeyboardInterrupt" in meta["hidden_states_error"], meta
    assert not [n for n in os.listdir(dump) if n.endswith((fmt.SUFFIX, fmt.LOCK_SUFFIX, fmt.ERROR_SUFFIX))]


def test_bad_dtype_names_the_flag(dump, sessions):
    with pytest.raises(DumpConfigError, match="--dump-hidden-states-dtype: 'fp4' is not one of auto, bf16, fp8"):
        sessions.start(make_runner(dump, dtype="fp4"))


def test_requests_that_ask_not_to_be_dumped_are_skipped(dump, sessions):
    """custom_params hidden_states_dump=false: no file, no dump keys in the response, over
    both chunks of a chunked prefill; the batch's other requests keep their own rows (the
    skipped rows sit before theirs in the packed batch). Only JSON false skips."""
    sess = sessions.start(make_runner(dump, layers="2,4"))
    skipped, kept = Req("skip", 6, 1), Req("keep", 3, 2)
    skipped.sampling_params = types.SimpleNamespace(custom_params={"hidden_states_dump": False})
    others = []  # dumped: not JSON false (0 == False in Python), or no dict at all
    for i, params in enumerate(["false", 0, None, [False], "x"]):
        others.append(Req(f"other{i}", 2, 3 + i))
        others[-1].sampling_params = types.SimpleNamespace(
            custom_params=params if params in ("x", [False]) else {"hidden_states_dump": params})
    run_extend(sess, [(skipped, 0, 4), (kept, 0, 3)], [2, 4])
    run_extend(sess, [(skipped, 4, 6)] + [(r, 0, 2) for r in others], [2, 4])
    assert skipped.customized_info is None and finish(skipped) == {}
    for req in [kept] + others:
        assert torch.equal(fmt.load(finish(req)["hidden_states_path"]).hidden_states, reference(req, [2, 4]))
    stats = idle(sess)
    assert stats["files_written"] == 1 + len(others) and stats["failures"] == 0
    assert not any(n.startswith("skip") for n in os.listdir(dump))
