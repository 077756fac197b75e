"""Output rows (issue 49): the patched server's one file per request of its prompt's rows
and the rows of every generated token fed back, against HF's float32 forward over the same
ids (llama, deepseek; TP=1; decode CUDA graphs on unless ``--no-cuda-graph``).

Needs the candidate series ``patches/candidates/v0.5.23`` (series 7 + 0009-0012): on the H200
host ``KIMI_SGLANG_SERIES=candidates/v0.5.23 bash tests/gpu/run_e2e.sh ... -k output``.
Without patch 0009 in the installed SGLang every test here is skipped with that sentence.

Each case sends ``/generate`` with ``input_ids`` and ``custom_params
{"hidden_states_output": true}`` and checks every answer: its file's ``token_ids`` are the
prompt then the answer's ``output_ids`` but the last (``format.check_output_rows``: also
``num_prompt_tokens``, ``last_token_id``), and every row, prompt and generated, is within
the bf16 tolerance of HF's float32 forward over those ids (``testing.checks``: per request
block and per token row; the generated rows' worst is recorded apart). Decode must replay
the CUDA graphs: SGLang's ``sglang:cuda_graph_passes_total{mode="decode_none"}`` may not grow
while a case runs (batches stay within the suite's ``--cuda-graph-max-bs 8``).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import time

import pytest
import requests

from testing.checks import TOL_BLOCK, TOL_TOKEN, Problems, Worst, compare_file
from testing.server import sglang_srt_dir
from testing.tiny_models import VOCAB

pytestmark = [pytest.mark.gpu, pytest.mark.models("llama", "deepseek")]

DOOR = "dump_hooks.on_outputs("


def _patch_0009_reason():
    """None when the installed SGLang carries patch 0009, else why not (one sentence)."""
    srt = sglang_srt_dir()
    path = srt and os.path.join(srt, "managers", "scheduler_components", "batch_result_processor.py")
    if not path or not os.path.exists(path):
        return "SGLang's batch_result_processor.py is not there (not SGLang 0.5.2x?)"
    with open(path, encoding="utf-8") as f:
        if DOOR not in f.read():
            return ("the installed SGLang lacks patch 0009 (output rows): apply "
                    "patches/candidates/v0.5.23 (KIMI_SGLANG_SERIES=candidates/v0.5.23)")
    return None


@pytest.fixture(autouse=True)
def _needs_patch_0009():
    reason = _patch_0009_reason()
    if reason:
        pytest.skip(reason)


def rand_ids(rng, n):
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def body(ids, max_new_tokens, temperature=0.0, seed=None, stop_token_ids=None, stop=None, rid=None,
         output=True, ignore_eos=False):
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": ignore_eos,
              "custom_params": {"hidden_states_output": True} if output else {}}
    if temperature > 0:
        params["sampling_seed"] = seed
    if stop_token_ids:
        params["stop_token_ids"] = list(stop_token_ids)
    if stop:
        params["stop"] = list(stop)
    out = {"input_ids": list(ids), "sampling_params": params}
    if rid is not None:
        out["rid"] = rid
    return out


def post_all(server, bodies):
    """The answers (JSON) to ``bodies``, sent concurrently."""
    def one(b):
        r = server.post(b)
        r.raise_for_status()
        return r.json()

    with cf.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies))


def output_ids(answer):
    """The generated ids an answer names (top level, as SGLang's /generate gives them)."""
    ids = answer.get("output_ids")
    if ids is None:
        ids = answer.get("meta_info", {}).get("output_ids")
    return list(ids or [])


def decode_passes(server):
    """``{mode: count}`` of SGLang's ``sglang:cuda_graph_passes_total`` on /metrics."""
    text = requests.get(f"{server.url}/metrics", timeout=30).text
    out = {}
    for m in re.finditer(r'^sglang:cuda_graph_passes_total\{([^}]*)\} ([0-9.e+]+)$', text, flags=re.M):
        mode = re.search(r'mode="([^"]+)"', m.group(1))
        if mode:
            out[mode.group(1)] = out.get(mode.group(1), 0.0) + float(m.group(2))
    return out


def check_output_answers(server, bodies, answers, reference, tiny_model, record_property, case,
                         pytestconfig, graphs_before=None):
    """Every answer's file against the answer and HF's forward; the decode graph check."""
    from sglang_ext import format as fmt

    problems, worst, worst_generated = Problems(), Worst(), Worst()
    generated = 0
    for i, (b, res) in enumerate(zip(bodies, answers)):
        prompt = b["input_ids"]
        where = f"{case} request {i} ({len(prompt)} prompt tokens)"
        meta = res.get("meta_info", {})
        path, out = meta.get("hidden_states_path"), output_ids(res)
        if not path or not os.path.exists(path):
            problems.add(f"{where}: no file (path {path!r}, hidden_states_error "
                         f"{meta.get('hidden_states_error')!r})")
            continue
        if not out:
            problems.add(f"{where}: the answer names no output_ids")
            continue
        rec = fmt.load(path, dequantize=True)
        try:
            fmt.check_output_rows(rec.token_ids.tolist(), rec.metadata, prompt, out, shown=where)
        except fmt.DumpFormatError as e:
            problems.add(str(e))
            continue
        fed = prompt + out[:-1]
        ref = reference(fed, tiny_model.layer_ids)
        problems.extend(compare_file(rec, fed, tiny_model.layer_ids, tiny_model.hidden_size, ref, where, worst))
        if len(out) > 1:
            from testing.reference import rel_errors

            worst_generated.add(rel_errors(rec.hidden_states[len(prompt):], ref[len(prompt):]),
                                f"{where} generated rows")
        generated += len(out)
        server.answered.add(os.path.basename(path))
    worst.record(record_property)
    record_property("requests", len(bodies))
    record_property("generated_tokens", generated)
    record_property("worst_generated_block", worst_generated.block)
    problems.extend(worst.problems(TOL_BLOCK, TOL_TOKEN))
    problems.extend(worst_generated.problems(TOL_BLOCK, None))
    if graphs_before is not None and not pytestconfig.getoption("--no-cuda-graph"):
        after = decode_passes(server)
        eager = after.get("decode_none", 0) - graphs_before.get("decode_none", 0)
        replayed = after.get("decode_cuda_graph", 0) - graphs_before.get("decode_cuda_graph", 0)
        record_property("decode_graph_passes", replayed)
        record_property("decode_eager_passes", eager)
        if eager or not replayed:
            problems.add(f"{case}: {eager:g} decode batches ran eager, {replayed:g} replayed a CUDA "
                         f"graph (every decode batch must replay one)")
    problems.check(f"{tiny_model.name} {case}")


def test_greedy_8_concurrent(server, reference, tiny_model, rng, record_property, pytestconfig):
    """8 concurrent prompts of 8-300 tokens (one chunked), 1-40 new tokens at temperature 0:
    decode batches of up to 8 in the CUDA graphs, requests ending at different steps."""
    bodies = [body(rand_ids(rng, n), g) for n, g in
              zip([8, 40, 120, 300, 17, 64, 257, 90], [1, 2, 5, 40, 33, 16, 8, 24])]
    before = decode_passes(server)
    answers = post_all(server, bodies)
    check_output_answers(server, bodies, answers, reference, tiny_model, record_property,
                         "greedy_8_concurrent", pytestconfig, before)


def test_sampled_4(server, reference, tiny_model, rng, record_property, pytestconfig):
    """Sampled decoding (temperature 1, seeds): the rows are the ids actually sampled."""
    bodies = [body(rand_ids(rng, 50 + 30 * i), 20, temperature=1.0, seed=7 + i) for i in range(4)]
    before = decode_passes(server)
    answers = post_all(server, bodies)
    check_output_answers(server, bodies, answers, reference, tiny_model, record_property,
                         "sampled_4", pytestconfig, before)


def test_stop_token_and_stop_string_end_the_file(server, reference, tiny_model, rng, record_property,
                                                 pytestconfig):
    """A greedy run names its 6th generated id; the same prompt again with that id as a
    stop token (and, for llama, which has a word-level tokenizer, its text "t<id>" as a stop
    string) stops early (finish_reason "stop"): the file ends where the answer does."""
    prompt = rand_ids(rng, 60)
    first = post_all(server, [body(prompt, 30, ignore_eos=True)])[0]
    out = output_ids(first)
    assert len(out) == 30, f"the unstopped greedy run gave {len(out)} ids"
    stop_id = out[5]
    bodies = [body(prompt, 30, stop_token_ids=[stop_id])]  # ignore_eos would disable stop ids too
    if tiny_model.name == "llama":
        bodies.append(body(prompt, 30, stop=[f"t{stop_id}"], ignore_eos=True))
    answers = post_all(server, bodies)
    for b, a in zip(bodies, answers):
        got = output_ids(a)
        # stopped early by a match (the stop id, the model's EOS, or the stop string, which
        # may match inside an earlier token's text: "t12" in "t123"), not by the length
        reason = a.get("meta_info", {}).get("finish_reason") or {}
        assert len(got) < 30 and reason.get("type") == "stop", (
            f"{len(got)} of 30 ids, finish_reason {reason}, stop id {stop_id} (at {out.index(stop_id) + 1} unstopped)")
    check_output_answers(server, bodies, answers, reference, tiny_model, record_property,
                         "stop_token_and_string", pytestconfig)


def test_max_new_tokens_1_is_the_prompt_file_with_its_one_token(server, reference, tiny_model, rng,
                                                               record_property, pytestconfig):
    """One generated token: P rows, last_token_id the token, ended at the prefill."""
    bodies = [body(rand_ids(rng, 100), 1), body(rand_ids(rng, 300), 1)]
    answers = post_all(server, bodies)
    check_output_answers(server, bodies, answers, reference, tiny_model, record_property,
                         "max_new_tokens_1", pytestconfig)


def test_without_the_parameter_in_the_same_batches_prompt_only(server, reference, tiny_model, rng,
                                                               record_property, pytestconfig):
    """Requests without the parameter beside ones with it: prompt-only files as before."""
    from sglang_ext import format as fmt

    bodies = [body(rand_ids(rng, 80 + 10 * i), 12, output=i % 2 == 0) for i in range(6)]
    answers = post_all(server, bodies)
    with_param = [(b, a) for i, (b, a) in enumerate(zip(bodies, answers)) if i % 2 == 0]
    check_output_answers(server, [b for b, _ in with_param], [a for _, a in with_param], reference,
                         tiny_model, record_property, "with_param", pytestconfig)
    problems, worst = Problems(), Worst()
    for i, (b, a) in enumerate(zip(bodies, answers)):
        if i % 2 == 0:
            continue
        path = a["meta_info"].get("hidden_states_path")
        rec = fmt.load(path, dequantize=True)
        if fmt.output_rows(rec.token_ids.tolist(), rec.metadata) is not None:
            problems.add(f"request {i}: a file with output rows for a request that did not ask")
        problems.extend(compare_file(rec, b["input_ids"], tiny_model.layer_ids, tiny_model.hidden_size,
                                     reference(b["input_ids"], tiny_model.layer_ids), f"request {i}", worst))
        server.answered.add(os.path.basename(path))
    problems.extend(worst.problems(TOL_BLOCK, TOL_TOKEN))
    problems.check(f"{tiny_model.name} prompt-only beside output rows")


def _sse(res):
    """The JSON data chunks of a streamed answer, [DONE] left out."""
    import json

    out = []
    for line in res.iter_lines(decode_unicode=True):
        if line and line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: "):]))
    return out


def test_the_last_output_names_the_file_however_it_was_sent(server, reference, tiny_model, rng,
                                                            record_property, pytestconfig):
    """SGLang sends a request's outputs before it ends (every token when it streams, every
    SGLANG_FORCE_STREAM_INTERVAL = 50 tokens when it does not), each with its slice of the
    per-token ``customized_info``: the path, recorded at the end, must reach the last one
    (sglang_ext.responses.set_info). /generate not streamed with 120 tokens, /generate with
    ``stream: true`` (the last chunk's ``meta_info``), and the OpenAI routes with vLLM's
    ``kv_transfer_params {"include_output_tokens": true}`` (patch 0011), streamed (the
    chunk before [DONE] names the file, patch 0012) and not (the response's
    ``kv_transfer_params``)."""
    from sglang_ext import format as fmt

    long_ = body(rand_ids(rng, 30), 120, ignore_eos=True)
    streamed = {**body(rand_ids(rng, 50), 70, ignore_eos=True), "stream": True}
    answers = post_all(server, [long_])
    res = requests.post(f"{server.url}/generate", json=streamed, stream=True, timeout=300)
    res.raise_for_status()
    chunks = _sse(res)
    last = chunks[-1]
    record_property("generate_stream_chunks", len(chunks))
    check_output_answers(server, [long_, streamed], answers + [last], reference, tiny_model,
                         record_property, "last_output", pytestconfig)
    problems, worst = Problems(), Worst()
    for stream in (False, True):
        prompt = rand_ids(rng, 40)
        req = {"prompt": prompt, "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": stream,
               "kv_transfer_params": {"include_output_tokens": True}}
        res = requests.post(f"{server.url}/v1/completions", json=req, stream=stream, timeout=300)
        res.raise_for_status()
        params = (_sse(res)[-1] if stream else res.json()).get("kv_transfer_params") or {}
        where = f"/v1/completions stream={stream}"
        path = params.get("hidden_states_path")
        if not path or not os.path.exists(path):
            problems.add(f"{where}: kv_transfer_params {params!r} names no file")
            continue
        rec = fmt.load(path, dequantize=True)
        ids = rec.token_ids.tolist()
        got = fmt.output_rows(ids, rec.metadata, path)
        if got is None or ids[:len(prompt)] != prompt or len(got.output_ids) != 60:
            problems.add(f"{where}: {path} is not the request's file of 60 generated tokens")
            continue
        problems.extend(compare_file(rec, ids, tiny_model.layer_ids, tiny_model.hidden_size,
                                     reference(ids, tiny_model.layer_ids), where, worst))
        server.answered.add(os.path.basename(path))
    problems.extend(worst.problems(TOL_BLOCK, TOL_TOKEN))
    problems.check(f"{tiny_model.name} OpenAI routes with include_output_tokens")


def test_abort_mid_generation_leaves_a_whole_file_or_none(server, reference, tiny_model, rng,
                                                          record_property):
    """A request aborted after some decode steps (SGLang's /abort_request by rid): no
    temporary file stays; a file left under its name is whole (prompt + what was generated,
    within the tolerance against HF over its own token ids), none is partial."""
    from sglang_ext import format as fmt
    from testing.checks import wait_no_leftovers

    rid = f"abort-{tiny_model.name}-{rng.randrange(1 << 30)}"
    prompt = rand_ids(rng, 40)
    before = set(os.listdir(server.dump_dir))
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(server.post, body(prompt, 4000, rid=rid, ignore_eos=True), 300)
        time.sleep(2.0)
        requests.post(f"{server.url}/abort_request", json={"rid": rid}, timeout=30)
        res = fut.result()
    record_property("abort_status", res.status_code)
    answer = res.json() if res.status_code == 200 else {}
    meta = answer.get("meta_info", {})
    finish_reason = meta.get("finish_reason") or {}
    record_property("abort_finish_reason", finish_reason)
    if isinstance(finish_reason, dict) and finish_reason.get("type") == "length":
        record_property("abort_note", "generation ended before the abort reached it")
    problems = wait_no_leftovers(server.dump_dir)
    assert not problems, f"temporary files left after the abort: {problems}"
    new = sorted(n for n in set(os.listdir(server.dump_dir)) - before if n.endswith(fmt.SUFFIX))
    record_property("abort_files", new)
    worst = Worst()
    bad = Problems()
    for name in new:
        rec = fmt.load(os.path.join(server.dump_dir, name), dequantize=True)
        ids = rec.token_ids.tolist()
        got = fmt.output_rows(ids, rec.metadata, name)
        if got is None or ids[:len(prompt)] != prompt:
            bad.add(f"{name}: not the aborted request's file with output rows")
            continue
        record_property("abort_rows", len(ids))
        bad.extend(compare_file(rec, ids, tiny_model.layer_ids, tiny_model.hidden_size,
                                reference(ids, tiny_model.layer_ids), name, worst))
        server.answered.add(name)
    path = meta.get("hidden_states_path")
    if path and os.path.basename(path) not in new:
        bad.add(f"the aborted answer names {path}, which is not a whole file in the directory")
    if path and output_ids(answer) and new:
        rec = fmt.load(path)
        try:
            fmt.check_output_rows(rec.token_ids.tolist(), rec.metadata, prompt, output_ids(answer), shown=path)
        except fmt.DumpFormatError as e:
            bad.add(str(e))
    bad.extend(worst.problems(TOL_BLOCK, TOL_TOKEN))
    bad.check(f"{tiny_model.name} abort")
