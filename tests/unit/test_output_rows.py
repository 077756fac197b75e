"""Output rows on the server side (issue 49): a request with ``custom_params
{"hidden_states_output": true}`` gets one file of its prompt's rows and the rows of every
generated token fed back (``format.output``), driven through the session as the patched
scheduler drives it (patch 0009): ``on_prefill_result`` before a prefill batch's finish
checks, ``on_outputs`` after them and after each decode batch's, with a real writer process.

``standins.run_output_prefill`` and ``run_decode`` play SGLang's scheduler: a prefill
appends the token sampled from the prompt's last row, each decode step feeds
``output_ids[-1]`` (its row is computed for position ``P + len(output_ids) - 1``) then
appends the next one, and a request (``standins.GenReq``) ends at its ``max_new_tokens`` or
when aborted. The reference of every row is ``standins.reference`` at
that position (independent of batching), the reference of the token ids is the prompt plus
the generated ids but the last, which the simulation records on its own.
"""

import asyncio
import gc
import logging
import os
import types

import pytest
import torch

from sglang_ext import format as fmt
from sglang_ext import hooks, quant, session
from sglang_ext.writer import HOLD_SHARE
from standins import (HIDDEN, GenReq, Mode, finish, idle, make_runner, output_rows_for, reference,
                      run_decode, run_output_prefill, wait_for)

IDS = [2, 4]


def rows_for(spans):
    return output_rows_for(spans, IDS)


def prefill(sess, spans, decoding=()):
    run_output_prefill(sess, spans, IDS, decoding)


def decode(sess, reqs, abort=()):
    run_decode(sess, reqs, IDS, abort)


@pytest.fixture
def sess(dump, sessions):
    s = session.DumpSession.start(make_runner(dump, layers="2,4"), output_rows=True)
    sessions.started.append(s)
    return s


def check_file(req, meta, dequantize=None):
    """The file of an output request against the references; returns its record."""
    assert "hidden_states_error" not in meta, meta
    p, g = len(req.origin_input_ids), len(req.output_ids)
    rec = fmt.load(meta["hidden_states_path"], dequantize=dequantize)
    want = reference(req, IDS, 0, p + g - 1)
    assert rec.hidden_states.shape == want.shape, (req.rid, rec.hidden_states.shape, want.shape)
    if dequantize is None:
        diff = (rec.hidden_states - want).abs()
        assert torch.equal(rec.hidden_states, want), (
            f"{req.rid}: row {int(diff.amax((1, 2)).argmax())} differs by {diff.max()}")
    assert rec.token_ids.tolist() == req.origin_input_ids + req.output_ids[:-1]
    got = fmt.check_output_rows(rec.token_ids.tolist(), rec.metadata, req.origin_input_ids, req.output_ids)
    assert got.num_prompt_tokens == p and got.output_ids == req.output_ids
    assert rec.metadata[fmt.LAST_TOKEN_ID_KEY] == str(req.output_ids[-1])
    assert rec.layer_ids == IDS and rec.metadata["rid"] == req.rid
    return rec


def test_prompt_and_every_fed_token_in_one_file_beside_a_prompt_only_request(sess, dump):
    a = GenReq("a", 10, 1, max_new_tokens=5)  # chunked prefill, then 4 decode steps
    b = GenReq("b", 3, 2, max_new_tokens=2)
    plain = GenReq("plain", 4, 3, max_new_tokens=3, output=False)
    prefill(sess, [(b, 0, 3), (a, 0, 4)])
    assert a.customized_info is None and b.customized_info is None, "named before its end"
    prefill(sess, [(a, 4, 10), (plain, 0, 4)])
    assert a.customized_info is None
    meta_plain = finish(plain)  # a request without the parameter: named at its prompt's end
    decode(sess, [b, a, plain])  # b ends (2 tokens)
    assert b.customized_info is not None, "b ended: its path must be set before streaming"
    decode(sess, [b, a, plain])  # b again: an overlap scheduler's extra tick adds nothing
    decode(sess, [a, plain])
    decode(sess, [a])  # a ends (5 tokens)
    decode(sess, [a])  # extra tick
    for req in (a, b):
        check_file(req, finish(req))
    rec = fmt.load(meta_plain["hidden_states_path"])
    assert fmt.output_rows(rec.token_ids.tolist(), rec.metadata) is None, "a prompt-only file"
    assert torch.equal(rec.hidden_states, reference(plain, IDS))
    snap = idle(sess)
    assert snap["files_written"] == 3 and snap["failures"] == 0 and snap["host_bytes_in_use"] == 0, snap
    assert sess.writer.held_bytes() == 0 and sess.writer.unwritten_bytes() == 0
    assert sorted(r["rid"] for r in fmt.read_index(str(dump))) == ["a", "b", "plain"]


def test_one_generated_token_ends_at_the_prefill_with_the_prompt_rows_only(sess):
    req = GenReq("one", 6, 4, max_new_tokens=1)
    prefill(sess, [(req, 0, 6)])
    rec = check_file(req, finish(req))
    assert rec.hidden_states.shape[0] == 6 and rec.metadata[fmt.NUM_PROMPT_TOKENS_KEY] == "6"


def test_host_decode_rows_of_the_asking_requests_alone_go_on(sess, monkeypatch):
    """Host rows (SGLang copied them behind the forward): only the rows of the requests
    that asked are handed to the writer, ready (before, the whole batch, which fp8
    quantized on the scheduler's CPU every step for a few requests' rows)."""
    req = GenReq("dev", 3, 5, max_new_tokens=3)
    prefill(sess, [(req, 0, 3)])
    seen = []
    real = sess.writer.copy_rows

    def spy(hidden, segments, ready=False):
        seen.append((hidden.shape[0], [(s, n) for _, s, n in segments], ready))
        return real(hidden, segments, ready=ready)

    monkeypatch.setattr(sess.writer, "copy_rows", spy)
    decode(sess, [GenReq("other", 2, 9, 9, output=False), req])
    assert seen == [(1, [(0, 1)], True)], seen  # host rows: the request's own row alone
    decode(sess, [req])
    check_file(req, finish(req))


def test_decoding_inside_a_mixed_batch_adds_its_row(sess):
    a = GenReq("mixed-a", 4, 1, max_new_tokens=3)
    b = GenReq("mixed-b", 6, 2, max_new_tokens=2)
    prefill(sess, [(a, 0, 4)])
    prefill(sess, [(b, 0, 6), (a, 0, 0)], decoding=(a,))  # a decodes in b's prefill batch
    decode(sess, [a, b])
    for req in (a, b):
        check_file(req, finish(req))


def test_aborted_mid_generation_gets_the_file_of_what_was_computed(sess):
    req = GenReq("cut", 5, 6, max_new_tokens=100)
    prefill(sess, [(req, 0, 5)])
    decode(sess, [req])
    decode(sess, [req], abort=(req,))
    assert len(req.output_ids) == 3
    check_file(req, finish(req))


def test_a_dropped_request_leaves_no_file_and_holds_no_arena(sess, dump):
    req = GenReq("dropped", 5, 6, max_new_tokens=100)
    prefill(sess, [(req, 0, 5)])
    decode(sess, [req])
    assert sess.writer.held_bytes() > 0
    del req
    gc.collect()
    assert sess.writer.held_bytes() == 0
    snap = idle(sess)
    assert snap["host_bytes_in_use"] == 0 and snap["files_written"] == 0, snap
    assert wait_for(lambda: os.listdir(dump) == []), os.listdir(dump)


def test_a_retracted_request_gets_an_error_and_no_file(sess, dump):
    req = GenReq("retracted", 4, 7, max_new_tokens=10)
    prefill(sess, [(req, 0, 4)])
    decode(sess, [req])
    # SGLang re-prefills the prompt and the generated tokens after a retraction
    batch = types.SimpleNamespace(reqs=[req], forward_mode=Mode(True), decoding_reqs=[], prefix_lens=[0])
    n = 4 + len(req.output_ids)
    out = types.SimpleNamespace(hidden_states=rows_for([(req, 0, n)]))
    sess.on_prefill_result(batch, out, [n])
    meta = finish(req)
    assert meta["hidden_states_error"].endswith(session.RETRACTED_MESSAGE), meta
    assert "hidden_states_path" not in meta
    decode(sess, [req])  # nothing more happens to it
    assert idle(sess)["files_written"] == 0
    assert sess.writer.held_bytes() == 0
    assert wait_for(lambda: os.listdir(dump) == []), os.listdir(dump)


def test_rows_past_the_host_share_fail_that_request_and_others_stream_on(dump, sessions):
    # a 1 MiB arena: rows of 2 slots x 8 float32 = 64 bytes; HOLD_SHARE of it is 8192 rows
    sess = session.DumpSession.start(make_runner(dump, layers="2,4", max_mb=1), output_rows=True)
    sessions.started.append(sess)
    limit = int((1 << 20) * HOLD_SHARE) // (2 * HIDDEN * 4)
    big = GenReq("big", limit + 10, 1, max_new_tokens=4)
    small = GenReq("small", 7, 2, max_new_tokens=3)
    plain = GenReq("plain", 3 * limit, 3, max_new_tokens=2, output=False)  # streams: 1.5 arenas
    for lo in range(0, plain_len := len(plain.origin_input_ids), 2000):
        prefill(sess, [(plain, lo, min(lo + 2000, plain_len))])
    prefill(sess, [(small, 0, 7)])
    prefill(sess, [(big, 0, limit + 10)])
    meta = finish(big)
    assert "host arena" in meta["hidden_states_error"] and "hidden_states_path" not in meta, meta
    decode(sess, [small, big])
    decode(sess, [small])
    check_file(small, finish(small))
    assert torch.equal(fmt.load(finish(plain)["hidden_states_path"]).hidden_states, reference(plain, IDS))
    assert idle(sess)["host_bytes_in_use"] == 0


def test_fp8_output_rows_round_trip_and_read_by_speculators_reader(dump, sessions, tmp_path):
    from hs_connectors.transfer import FP8Transfer

    sess = session.DumpSession.start(make_runner(dump, layers="2,4", dtype="fp8"), output_rows=True)
    sessions.started.append(sess)
    req = GenReq("fp8", 6, 3, max_new_tokens=4)
    prefill(sess, [(req, 0, 3)])
    prefill(sess, [(req, 3, 6)])
    for _ in range(3):
        decode(sess, [req])
    meta = finish(req)
    rec = check_file(req, meta, dequantize=False)
    want = reference(req, IDS, 0, 6 + 4 - 1)
    q, sc = quant.quantize_fp8(want.reshape(want.shape[0], -1), 2)
    assert torch.equal(rec.hidden_states.view(torch.uint8), q.view(want.shape).view(torch.uint8))
    assert rec.metadata["hidden_states_dtype"] == fmt.FP8
    hs = tmp_path / "speculators-hs"
    hs.mkdir()
    os.link(meta["hidden_states_path"], hs / "hs_0.safetensors")
    got = FP8Transfer(hs, dequantize_dtype=torch.float32).get_cached(0)
    assert torch.equal(got["hidden_states"], fmt.load(meta["hidden_states_path"], dequantize=torch.float32).hidden_states)
    assert got["token_ids"].tolist() == req.origin_input_ids + req.output_ids[:-1]


def test_without_patch_0009_the_parameter_is_ignored(dump, sessions):
    """Series 7 (setup_model without output_rows): a prompt-only file, as before."""
    sess = sessions.start(make_runner(dump, layers="2,4"))
    req = GenReq("s7", 5, 1, max_new_tokens=3)
    prefill(sess, [(req, 0, 5)])
    rec = fmt.load(finish(req)["hidden_states_path"])
    assert fmt.output_rows(rec.token_ids.tolist(), rec.metadata) is None
    assert torch.equal(rec.hidden_states, reference(req, IDS))
    assert not sess.wants_host_rows(types.SimpleNamespace(reqs=[req], forward_mode=Mode(False)))


def test_host_rows_are_asked_for_decode_batches_with_an_output_request(sess):
    out, plain = GenReq("o", 3, 1, 3), GenReq("p", 3, 2, 3, output=False)
    dec = lambda *reqs: types.SimpleNamespace(reqs=list(reqs), forward_mode=Mode(False))  # noqa: E731
    # before its prefill result is processed (overlap): its parameter decides
    assert sess.wants_host_rows(dec(plain, out)) and not sess.wants_host_rows(dec(plain))
    assert not sess.wants_host_rows(types.SimpleNamespace(reqs=[out], forward_mode=Mode(True)))
    prefill(sess, [(out, 0, 3), (plain, 0, 3)])
    assert sess.wants_host_rows(dec(plain, out))
    decode(sess, [out, plain])
    decode(sess, [out, plain])
    assert out.finished() and not sess.wants_host_rows(dec(plain, out)), "done: no copy"
    check_file(out, finish(out))


def test_the_doors_forward_and_do_nothing_without_a_session(dump, sessions):
    batch = types.SimpleNamespace(reqs=[], forward_mode=Mode(False))
    assert hooks.wants_host_rows(batch) is False
    hooks.on_outputs(batch, None)
    hooks.setup_model(make_runner(dump, layers="2,4"), output_rows=True)
    assert hooks.session().output_rows
    req = GenReq("door", 3, 1, max_new_tokens=2)
    prefill(hooks.session(), [(req, 0, 3)])
    assert hooks.wants_host_rows(types.SimpleNamespace(reqs=[req], forward_mode=Mode(False)))
    decode_batch = types.SimpleNamespace(reqs=[req], forward_mode=Mode(False), decoding_reqs=None)
    req.sample()
    hooks.on_outputs(decode_batch, types.SimpleNamespace(hidden_states=rows_for([(req, 3, 4)])))
    check_file(req, finish(req))


def test_a_writer_killed_mid_generation_fails_that_request_and_the_next_one_is_whole(sess, dump):
    import signal

    cut = GenReq("cut-by-kill", 4, 1, max_new_tokens=10)
    prefill(sess, [(cut, 0, 4)])
    decode(sess, [cut])
    pid = sess.writer.pid
    os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: (sess.writer.poll() or sess.writer.pid != pid)), "no new writer process"
    decode(sess, [cut])
    meta = finish(cut)
    assert "writer process died" in meta["hidden_states_error"] and "hidden_states_path" not in meta, meta
    after = GenReq("after", 5, 2, max_new_tokens=3)
    prefill(sess, [(after, 0, 5)])
    decode(sess, [after, cut])
    decode(sess, [after])
    check_file(after, finish(after))
    assert sess.writer.held_bytes() == 0
    assert wait_for(lambda: sorted(os.listdir(dump)) == sorted(
        [os.path.basename(finish(after)["hidden_states_path"]), "index.jsonl"])), os.listdir(dump)


PROBE = r"""
import json
from sglang.srt.server_args import prepare_server_args
from sglang.srt.runtime_context import publish, get_context
from sglang.srt.model_executor.forward_batch_info import get_server_return_hidden_states_mode
from sglang_ext import compat
args = prepare_server_args(["--model-path", "dummy"])
args.resolve_once()
publish(args, role="scheduler")
before = get_server_return_hidden_states_mode().name
ok = compat.capture_decode_rows("kimi-sglang: probe")
print(json.dumps({"before": before, "ok": ok, "after": get_server_return_hidden_states_mode().name,
                  "log": [source for source, _ in get_context().overrides_log()]}))
"""


def test_decode_graphs_are_told_to_capture_through_sglangs_own_config():
    """With SGLang 0.5.23's real published config (a scheduler's), ``capture_decode_rows``
    turns the server-wide mode SGLang's decode graph runners capture with
    (``get_server_return_hidden_states_mode``, read in ``BaseRunner.__init__``) from NULL
    to LAST, through SGLang's override (logged under our source)."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"before": "NULL", "ok": True, "after": "LAST", "log": ["kimi-sglang: probe"]}, got


def _sglang_outputs():
    """SGLang 0.5.23's own scheduler-side output step (``output_streamer.
    _GenerationStreamAccumulator.accept``: which steps send an output and the slice of each
    ``customized_info`` list it carries), with a force-stream interval of 4 tokens for a
    request that does not stream (SGLang's default is 50). Returns ``one_step(req)``:
    ``(customized_info, output_ids)`` of the output sent for ``req``, or None;
    ``one_step(*reqs, by_rid=True)``, one output batch of several (a key some carry is
    padded for the others): rid -> that pair, for those sent."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler_components.output_streamer import _GenerationStreamAccumulator
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    # a scheduler's config, active only while SGLang's code runs (this process's is kept;
    # so is the root logger, whose level SGLang's argument parsing sets)
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        context = create_context(prepare_server_args(["--model-path", "dummy"]), role="scheduler")
    finally:
        root.setLevel(level)
        root.handlers[:] = handlers

    def one_step(*reqs, by_rid=False):
        acc = _GenerationStreamAccumulator(
            return_logprob=False, return_hidden_states=False, return_routed_experts=False,
            return_indexer_topk=False, spec_algorithm=SpeculativeAlgorithm.NONE,
            disaggregation_mode=DisaggregationMode.NULL, default_stream_interval=1,
            default_force_stream_interval=4, get_cached_tokens_details=lambda r: None,
            is_request_level_customized_info_key=lambda key: False, current_weight_version=None)
        with use_context(context):
            for req in reqs:
                acc.accept(req=req)
        sent = {rid: ({key: values[j] for key, values in acc.customized_info.items()}, list(acc.output_ids[j]))
                for j, rid in enumerate(acc.rids)}
        return sent if by_rid else sent.get(reqs[0].rid)

    return one_step


def _tokenizer_manager(monkeypatch, incremental: bool):
    """SGLang 0.5.23's tokenizer-manager side of one request's outputs, in
    ``_handle_batch_output``'s order with its own functions: each output's
    ``customized_info`` slices are added up (``_accumulate_request_meta_info``:
    ``meta_info[key]`` is everything received so far); with
    ``--incremental-streaming-output`` a streamed request's ``meta_info[key]`` is then cut
    to this output's tokens (``_slice_streaming_output_meta_info`` from
    ``ReqState.last_output_offset``). Returns ``receive(customized_info, output_ids)``
    -> the output dict, and ``coalesce(outputs)``: ``_wait_one_response`` draining
    several queued incremental outputs at once (``_coalesce_streaming_chunks``). SGLang's
    server dependency uvloop (not in the CPU venv) only gives the tokenizer manager its
    event-loop policy at import: asyncio's stands in (as in tests/tooling/test_candidate_series)."""
    import sys

    uvloop = types.ModuleType("uvloop")
    uvloop.EventLoopPolicy = asyncio.DefaultEventLoopPolicy
    if "uvloop" not in sys.modules:
        monkeypatch.setitem(sys.modules, "uvloop", uvloop)
    from sglang.srt.managers.tokenizer_manager import (ReqState, TokenizerManager,
                                                       _slice_streaming_output_meta_info)

    state = ReqState(out_list=[], finished=False, event=None, obj=None, time_stats=None)
    received_ids = []

    def receive(info, output_ids):
        meta = {}
        for key, values in (info or {}).items():
            TokenizerManager._accumulate_request_meta_info(meta, state, key, values)
        offset = state.last_output_offset
        received_ids.extend(output_ids)
        if incremental:
            _slice_streaming_output_meta_info(meta, offset, state.customized_info_accumulated.keys())
            state.last_output_offset = len(received_ids)
        else:  # _wait_one_response: a cumulative stream re-reports every key received
            for key, values in state.customized_info_accumulated.items():
                meta.setdefault(key, list(values))
        return {"output_ids": list(output_ids), "meta_info": meta}

    def coalesce(outputs):
        return TokenizerManager._coalesce_streaming_chunks(
            None, outputs, "rid", state.customized_info_accumulated.keys())

    return receive, coalesce


SENT = {"not streamed": (False, False), "streamed": (True, False), "streamed incrementally": (True, True),
        "not streamed, incremental server": (False, True)}  # (req.stream, --incremental-streaming-output)


@pytest.mark.parametrize("output", [True, False], ids=["output rows", "prompt rows"])
@pytest.mark.parametrize("mode", list(SENT))
def test_the_path_reaches_the_last_output_however_often_sglang_sends_one(dump, sessions, monkeypatch, mode,
                                                                         output):
    """SGLang's real ``Req`` and output step: a request that generates 10 tokens is sent
    to the tokenizer manager before it ends (every token when it streams, every 4th when it
    does not), each output carrying its slice of ``customized_info``; the tokenizer
    manager adds the slices up, and with ``--incremental-streaming-output`` cuts each
    streamed output's lists to that output's tokens. The path, recorded at the end (output
    rows, patch 0009) or at the prompt's end (prompt rows, patch 0004), must be in the last
    output. Before, it was recorded as ``[path]`` at position 0, which those outputs had
    already passed: the last one carried ``[]``, the response no path and no error; with
    incremental streaming that was still so for both kinds of request."""
    from array import array

    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    stream, incremental = SENT[mode]
    runner = make_runner(dump, layers="2,4")
    runner.server_args.incremental_streaming_output = incremental
    sess = session.DumpSession.start(runner, output_rows=True)
    sessions.started.append(sess)
    one_step = _sglang_outputs()
    receive, coalesce = _tokenizer_manager(monkeypatch, incremental and stream)
    params = SamplingParams(max_new_tokens=10, custom_params={fmt.OUTPUT_PARAM: True} if output else None)
    req = Req(mode.replace(" ", "-"), "", array("q", range(3000, 3006)), params, stream=stream)
    req.seed = 3  # standins.reference's rows
    outputs = []  # what the tokenizer manager queues for the request

    def step(batch, out, lens=None):
        req.output_ids.append(3500 + len(req.output_ids))  # sampled from this step's row
        if len(req.output_ids) == 10:
            req.finished_reason = FINISH_LENGTH(length=10)
        sess.on_outputs(batch, out, lens)
        sent = one_step(req)
        if sent is not None:
            outputs.append(receive(*sent))

    prefill = types.SimpleNamespace(reqs=[req], forward_mode=Mode(True), decoding_reqs=[], prefix_lens=[0])
    rows = types.SimpleNamespace(hidden_states=rows_for([(req, 0, 6)]))
    sess.on_prefill_result(prefill, rows, [6])
    step(prefill, rows, [6])
    for pos in range(6, 15):
        batch = types.SimpleNamespace(reqs=[req], forward_mode=Mode(False), decoding_reqs=None, prefix_lens=None)
        step(batch, types.SimpleNamespace(hidden_states=rows_for([(req, pos, pos + 1)])))
    assert req.finished()
    assert len(outputs) == (10 if stream else 3)  # sent before the end too
    if incremental and stream:  # per-token lists, as SGLang's own incremental keys (logprobs)
        assert outputs[-1]["output_ids"] == [3509]
        cut = {(len(o["output_ids"]), key, len(v)) for o in outputs for key, v in o["meta_info"].items()}
        assert {(n, k) for n, k, _ in cut} == {(1, k) for k in ("hidden_states_path", "hidden_states_error")}
        assert cut == {(n, k, n) for n, k, _ in cut}, cut
    last = [outputs[-1]["meta_info"]]
    if incremental and stream:  # the last three outputs queued, drained at once
        last.append(coalesce(outputs[-3:])["meta_info"])
    for meta in last:
        meta = dict(meta)
        asyncio.run(hooks.finish_response(meta))
        assert "hidden_states_error" not in meta and "hidden_states_path" in meta, (outputs[-1], meta)
        rec = fmt.load(meta["hidden_states_path"])
        prompt = list(range(3000, 3006))
        assert rec.token_ids.tolist() == (prompt + list(range(3500, 3509)) if output else prompt)
        assert torch.equal(rec.hidden_states, reference(req, IDS, 0, 15 if output else 6))


def test_an_incremental_last_output_without_new_tokens_still_names_the_file(dump, sessions, monkeypatch):
    """With ``--incremental-streaming-output``, the last output of a streamed request can
    carry no new token (its stop position, ``finished_len``, is where the previous output
    ended: SGLang's slice ``[send_token_offset:len(output_ids_through_stop)]`` is empty);
    the tokenizer manager then cuts every list to nothing. The held path answers an empty
    slice with its entry at that position, so the last output still names the file, which
    holds the prompt's rows."""
    from array import array

    from sglang.srt.managers.schedule_batch import FINISH_MATCHED_TOKEN, Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    runner = make_runner(dump, layers="2,4")
    runner.server_args.incremental_streaming_output = True
    sess = session.DumpSession.start(runner)
    sessions.started.append(sess)
    one_step = _sglang_outputs()
    receive, _ = _tokenizer_manager(monkeypatch, True)
    req = Req("trimmed", "", array("q", range(3000, 3006)), SamplingParams(max_new_tokens=10), stream=True)
    req.seed = 3
    prefill = types.SimpleNamespace(reqs=[req], forward_mode=Mode(True), decoding_reqs=[], prefix_lens=[0])
    sess.on_prefill_result(prefill, types.SimpleNamespace(hidden_states=rows_for([(req, 0, 6)])), [6])
    outputs = []
    for t in range(4):
        req.output_ids.append(3500 + t)
        if t == 3:  # the step's token is past the stop position: nothing new to send
            req.finished_reason, req.finished_len = FINISH_MATCHED_TOKEN(matched=3502), 3
        outputs.append(receive(*one_step(req)))
    assert [o["output_ids"] for o in outputs] == [[3500], [3501], [3502], []]
    meta = dict(outputs[-1]["meta_info"])
    asyncio.run(hooks.finish_response(meta))
    assert "hidden_states_error" not in meta and "hidden_states_path" in meta, outputs[-1]
    rec = fmt.load(meta["hidden_states_path"])
    assert rec.token_ids.tolist() == list(range(3000, 3006))
    assert torch.equal(rec.hidden_states, reference(req, IDS, 0, 6))


def test_an_output_request_that_generates_nothing_gets_an_error_not_a_file(dump, sessions):
    """``max_new_tokens`` 0 (a prefill-only request; also the prompt-caching copy SGLang
    sends first for n > 1, with the request's custom_params): SGLang's real ``Req`` still
    appends the step's token (a dummy 0 when the whole batch is prefill-only,
    ``tp_worker``) and finishes with ``finished_len`` 0, so the answer's output ids
    (``output_ids_through_stop``) are empty. The request gets ``hidden_states_error`` and
    no file, as the stand-in refuses it; before, a file named the dummy token as the one
    generated token, which the answer never showed (``format.check_output_rows`` refuses
    it: 'the answer names no generated token')."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    sess = session.DumpSession.start(make_runner(dump, layers="2,4"), output_rows=True)
    sessions.started.append(sess)
    params = SamplingParams(max_new_tokens=0, custom_params={fmt.OUTPUT_PARAM: True})
    params.normalize(None)  # as the tokenizer manager does (no stop strings)
    req = Req("prefill-only", "", array("q", range(3000, 3006)), params)
    req.seed = 3
    batch = types.SimpleNamespace(reqs=[req], forward_mode=Mode(True), decoding_reqs=[], prefix_lens=[0])
    rows = types.SimpleNamespace(hidden_states=rows_for([(req, 0, 6)]))
    sess.on_prefill_result(batch, rows, [6])
    req.output_ids.append(0)  # process_batch_result_prefill: the (dummy) next token, then the finish check
    req.update_finish_state()
    assert req.finished() and list(req.output_ids_through_stop) == []
    sess.on_outputs(batch, rows, [6])
    meta = finish(req)
    assert "hidden_states_path" not in meta and "without generating a token" in meta["hidden_states_error"], meta
    assert idle(sess)["files_written"] == 0 and sess.writer.held_bytes() == 0
    assert wait_for(lambda: os.listdir(dump) == []), os.listdir(dump)


def test_token_ids_that_cannot_fit_beside_held_rows_fail_that_request_instead_of_waiting_forever(dump, sessions):
    """A 1 MiB arena; an output request holds its 7000 prompt rows (448000 bytes, under
    ``HOLD_SHARE``) until it ends. A prompt of 80000 tokens (640000 bytes of token ids, less
    than the arena, so ``_fitting`` lets them through) cannot get a range beside them, and
    only this scheduler can let the held rows go: the request fails with a sentence, and
    the scheduler goes on. Before, it waited in the arena for good (backpressure on rows
    nothing would give back). Once the output request has ended, the same prompt is dumped."""
    import threading

    from standins import Req, run_extend

    sess = session.DumpSession.start(make_runner(dump, layers="2,4", max_mb=1), output_rows=True)
    sessions.started.append(sess)
    held = GenReq("held", 7000, 1, max_new_tokens=2)
    for lo in range(0, 7000, 1000):
        prefill(sess, [(held, lo, lo + 1000)])
    assert sess.writer.held_bytes() == 7000 * 64
    big = Req("big", 80000, 2)
    done = threading.Event()

    def first_chunk():
        run_extend(sess, [(big, 0, 1000)], IDS)
        done.set()

    threading.Thread(target=first_chunk, daemon=True).start()
    assert done.wait(60), "the scheduler waits in the arena for rows only it can let go"
    meta = finish(big)
    assert "hidden_states_path" not in meta and "output rows" in meta["hidden_states_error"], meta
    decode(sess, [held])
    check_file(held, finish(held))
    assert sess.writer.held_bytes() == 0
    again = Req("again", 80000, 3)
    for lo in range(0, 80000, 8000):
        run_extend(sess, [(again, lo, lo + 8000)], IDS)
    assert torch.equal(fmt.load(finish(again)["hidden_states_path"]).hidden_states, reference(again, IDS))


def test_one_output_batch_of_streamed_and_plain_requests_names_each_ones_file(dump, sessions, monkeypatch):
    """One batch, as SGLang's output step sends it (one accumulator: a key one request
    carries is padded with None for the others), with ``--incremental-streaming-output``:
    streamed and plain requests, prompt rows and output rows, some asking not to wait
    (``hidden_states_pending``, which the others are padded with), one not dumped, each
    ending at its own step. Each one's last output names its own file, and pending only
    where it asked; the not-dumped one gets no dump key. (On the code before a28871f the
    streamed ones had neither path nor error.)"""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    runner = make_runner(dump, layers="2,4")
    runner.server_args.incremental_streaming_output = True
    sess = session.DumpSession.start(runner, output_rows=True)
    sessions.started.append(sess)
    one_step = _sglang_outputs()
    out, early = {fmt.OUTPUT_PARAM: True}, {fmt.WAIT_PARAM: False}
    asks = {"stream-prompt": (True, None, 5), "plain-output": (False, out, 7),
            "stream-output-early": (True, {**out, **early}, 6), "stream-not-dumped": (True, {fmt.DUMP_PARAM: False}, 4),
            "stream-prompt-early": (True, early, 8), "plain-prompt": (False, None, 3)}
    reqs = []
    for seed, (rid, (stream, params, n)) in enumerate(asks.items(), 1):
        sampling = SamplingParams(max_new_tokens=n, custom_params=params)
        sampling.normalize(None)
        reqs.append(Req(rid, "", array("q", range(seed * 1000, seed * 1000 + 6)), sampling, stream=stream))
        reqs[-1].seed = seed
    receive = {r.rid: _tokenizer_manager(monkeypatch, r.stream)[0] for r in reqs}
    last = {}

    def step(live, batch, rows, lens=None):
        for r in live:  # process_batch_result_*: the token, then the finish check
            r.output_ids.append(r.seed * 1000 + 500 + len(r.output_ids))
            r.update_finish_state()
        sess.on_outputs(batch, rows, lens)
        for rid, sent in one_step(*live, by_rid=True).items():
            last[rid] = receive[rid](*sent)["meta_info"]

    batch = types.SimpleNamespace(reqs=reqs, forward_mode=Mode(True), decoding_reqs=[], prefix_lens=[0] * 6)
    rows = types.SimpleNamespace(hidden_states=rows_for([(r, 0, 6) for r in reqs]))
    sess.on_prefill_result(batch, rows, [6] * 6)
    step(reqs, batch, rows, [6] * 6)
    while live := [r for r in reqs if not r.finished()]:
        pos = [6 + len(r.output_ids) - 1 for r in live]
        batch = types.SimpleNamespace(reqs=live, forward_mode=Mode(False), decoding_reqs=None, prefix_lens=None)
        step(live, batch, types.SimpleNamespace(hidden_states=rows_for([(r, p, p + 1) for r, p in zip(live, pos)])))
    for req in reqs:
        meta = dict(last[req.rid])
        asyncio.run(hooks.finish_response(meta))
        if req.rid == "stream-not-dumped":
            assert not [k for k in meta if k.startswith("hidden_states")], meta
            continue
        assert meta.get("hidden_states_pending") is (True if "early" in req.rid else None), (req.rid, meta)
        assert fmt.wait_complete(meta["hidden_states_path"], timeout=10) is None, (req.rid, meta)
        rec = fmt.load(meta["hidden_states_path"])
        assert rec.metadata["rid"] == req.rid
        n = 6 + len(req.output_ids) - 1 if "output" in req.rid else 6
        assert torch.equal(rec.hidden_states, reference(req, IDS, 0, n)), req.rid
