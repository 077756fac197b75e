"""The candidate series ``patches/candidates/v0.5.23`` (series 7 + 0009-0012, output rows).

- It applies cleanly (no offsets) to the wheel its base.toml pins, as every ``patches/v*``
  series must (tests/tooling/test_nightly.py).
- Its 0001-0008 are series 7's byte for byte but the ``[PATCH N/M]`` counter (and the
  subject's folding, which the counter's width moves), so a GPU run on it tests series 7
  plus 0009-0012 and nothing else.
- Nothing picks it by default: it is outside ``patches/v*``, and the newest gpu-verified
  series (build.sh, tests/run.sh, the GPU scripts' default) is still ``v0.5.23``.
- On the wheel's sources with the series applied by plain ``git apply``: the doors sit
  where ``DumpSession.on_outputs`` and ``wants_host_rows`` assume (after the finish checks
  and before the outputs are streamed; the decode copy to the host decided where SGLang
  queues it behind the forward; setup_model told that the doors exist).
- On the wheel unpacked with the series applied (conftest's ``patched_site``), SGLang's own
  code around the main-process doors, run in a probe: the abort echo of a request ended
  while waiting (0010, ``TokenizerManager._handle_abort_req``), the conversion of OpenAI
  requests (0011, ``_convert_to_internal_request`` of completions and chat) and their
  streaming responses (0012, ``_generate_completion_stream``, ``_generate_chat_stream``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sglang_ext.tools.patchtool.series import GPU_VERIFIED, known_series, load_series, newest_series

from test_nightly import assert_applies_cleanly, get_wheel, persistent_cache  # noqa: F401 - a fixture

REPO = Path(__file__).resolve().parents[2]
CANDIDATE = REPO / "patches" / "candidates" / "v0.5.23"
V23 = REPO / "patches" / "v0.5.23"


# What each patch past series 7 touches: one concern each.
ADDED = {
    "0009-": ["python/sglang/srt/managers/scheduler.py",
              "python/sglang/srt/managers/scheduler_components/batch_result_processor.py",
              "python/sglang/srt/model_executor/model_runner.py"],
    "0010-": ["python/sglang/srt/managers/tokenizer_manager.py"],
    "0011-": ["python/sglang/srt/entrypoints/openai/protocol.py",
              "python/sglang/srt/entrypoints/openai/serving_chat.py",
              "python/sglang/srt/entrypoints/openai/serving_completions.py"],
    "0012-": ["python/sglang/srt/entrypoints/openai/serving_chat.py",
              "python/sglang/srt/entrypoints/openai/serving_completions.py"],
}


def _uncounted(text: str) -> str:
    """A patch file without its ``[PATCH N/M]`` counter, the Subject unfolded."""
    head, sep, body = text.partition("\n\n")
    head = re.sub(r"\n (?=\S)", " ", head)
    return re.sub(r"\[PATCH \d+/\d+\] ", "", head) + sep + body


def test_it_is_series_7_plus_its_own_patches_and_never_the_default(monkeypatch):
    cand, s7 = load_series(CANDIDATE), load_series(V23)
    added = cand.patches[len(s7.patches):]
    assert [p.name for p in cand.patches[:len(s7.patches)]] == [p.name for p in s7.patches]
    assert [p.name[:5] for p in added] == list(ADDED)
    for mine, theirs in zip(cand.patches, s7.patches):
        assert _uncounted(mine.path.read_text()) == _uncounted(theirs.path.read_text()), (
            f"{mine.name} differs from series 7's")
    for patch in added:
        assert sorted(patch.touched_paths()) == ADDED[patch.name[:5]], patch.name
    assert cand.base.version == s7.base.version and cand.base.wheels == s7.base.wheels
    assert cand.base.status == "apply-checked" and int(cand.base.series_version) == int(s7.base.series_version) + 1
    monkeypatch.delenv("KIMI_SGLANG_PATCHES", raising=False)
    assert CANDIDATE not in known_series() and newest_series(GPU_VERIFIED) == V23


@pytest.mark.network
def test_it_applies_cleanly_to_its_pinned_base(capsys, persistent_cache):  # noqa: F811
    assert_applies_cleanly(capsys, CANDIDATE)


def _body(text: str, name: str) -> str:
    start = text.index(f"    def {name}(")
    end = text.find("\n    def ", start + 1)
    return text[start:end if end > 0 else len(text)]


@pytest.mark.network
def test_the_doors_sit_where_the_session_assumes(tmp_path, persistent_cache):  # noqa: F811
    series = load_series(CANDIDATE)
    info = get_wheel(series.base.version, series.base)
    touched = {p for patch in series.patches for p in patch.touched_paths()}
    with zipfile.ZipFile(info.path) as zf:
        for path in touched:
            name = path.removeprefix("python/")
            if name in zf.namelist():
                (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
                (tmp_path / path).write_bytes(zf.read(name))
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    for patch in series.patches:
        subprocess.run(["git", "apply", str(patch.path)], cwd=tmp_path, check=True)
    srt = tmp_path / "python" / "sglang" / "srt"
    for path in touched:
        if (tmp_path / path).exists():
            compile((tmp_path / path).read_text(), path, "exec")  # the patched files still parse
    brp = (srt / "managers" / "scheduler_components" / "batch_result_processor.py").read_text()
    decode = _body(brp, "process_batch_result_decode")
    sync, door = decode.find("result.copy_done.synchronize()"), decode.find("dump_hooks.on_outputs(")
    finish_check, stream = decode.find("req.update_finish_state("), decode.find("self.output_streamer.stream_output(")
    assert 0 < sync < finish_check < door < stream, (sync, finish_check, door, stream)
    prefill = _body(brp, "process_batch_result_prefill")
    door, stream = prefill.find("dump_hooks.on_outputs("), prefill.find("self.output_streamer.stream_output(")
    assert 0 < prefill.find("req.update_finish_state()") < door < stream
    assert prefill.find("dump_hooks.on_prefill_result(") < prefill.find("req.output_ids.append(")
    copy = _body((srt / "managers" / "scheduler.py").read_text(), "_copy_result_to_cpu")
    wants, fn = copy.find("dump_hooks.wants_host_rows("), copy.find("copy_fn = partial(")
    assert 0 < wants < fn and "return_hidden_states=return_hidden_states" in copy
    assert "elif return_hidden_states or" in copy, "the async copy path would miss the rows"
    runner = (srt / "model_executor" / "model_runner.py").read_text()
    assert runner.count("dump_hooks.setup_model(self, output_rows=True)") == 1


# ---- the main-process doors, run in SGLang's own code (0010-0012) -----------------------------
# One probe on the patched wheel. SGLang's server dependency uvloop (not in the CPU venv)
# only gives the tokenizer manager its event-loop policy at import: asyncio's stands in.
# What the probe makes up is what the code under test reads of its server, never its
# result: a server-args namespace for the doors, the tokenizer manager's fields that
# _handle_abort_req reads, the chat template's step (a prompt of token ids), the outputs of
# the tokenizer manager a stream is made of.
PROBE = r"""
import asyncio, json, sys, types
_uv = types.ModuleType("uvloop"); _uv.EventLoopPolicy = asyncio.DefaultEventLoopPolicy
sys.modules.setdefault("uvloop", _uv)
from sglang.srt.entrypoints.openai import protocol
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from sglang.srt.managers import tokenizer_manager as tm
from sglang.srt.managers.io_struct import AbortReq, GenerateReqInput
from sglang.srt.runtime_context import publish
from sglang.srt.server_args import prepare_server_args
from sglang_ext import hooks
_args = prepare_server_args(["--model-path", "dummy"])
_args.resolve_once()
publish(_args, role="tokenizer")

def args(on):
    return types.SimpleNamespace(dump_hidden_states_dir="/dump" if on else None)

def abort(rid, custom, on):
    # the scheduler's echo of a request it ended while waiting, as the tokenizer manager
    # answers it; then what the response gets (finish_response, patch 0005)
    obj = GenerateReqInput(input_ids=[1, 2, 3], rid=rid,
                           sampling_params={"max_new_tokens": 8, "custom_params": custom})
    state = tm.ReqState(out_list=[], finished=False, event=asyncio.Event(), obj=obj,
                        time_stats=tm.APIServerReqTimeStats())
    mgr = types.SimpleNamespace(rid_to_state={rid: state}, server_args=args(on),
                                config_value=lambda key: None, enable_lora=False)
    mgr._release_lora_once = types.MethodType(tm.TokenizerManager._release_lora_once, mgr)
    tm.TokenizerManager._handle_abort_req(mgr, AbortReq(rid=rid))
    out = state.out_list[-1]
    asyncio.run(hooks.finish_response(out["meta_info"]))
    return {"finish": out["meta_info"]["finish_reason"]["type"],
            "keys": {k: v for k, v in out["meta_info"].items() if k.startswith("hidden_states")}}

def completion(body, on):
    srv = object.__new__(OpenAIServingCompletion)
    srv.tokenizer_manager = types.SimpleNamespace(server_args=args(on))
    srv.template_manager = types.SimpleNamespace(completion_template_name=None)
    srv.allowed_custom_labels = None
    adapted, _ = srv._convert_to_internal_request(protocol.CompletionRequest(**body))
    return adapted.sampling_params.get("custom_params")

def chat(body, on):
    srv = object.__new__(OpenAIServingChat)
    srv.tokenizer_manager = types.SimpleNamespace(server_args=args(on), model_config=types.SimpleNamespace(
        is_multimodal=False, hf_config=types.SimpleNamespace(architectures=["LlamaForCausalLM"])))
    srv.template_manager = types.SimpleNamespace(reasoning_config=None)
    srv.reasoning_parser, srv.is_gpt_oss, srv.allowed_custom_labels = None, False, None
    srv.default_sampling_params, srv.chat_encoding_spec = {}, None
    srv._prompt_text_round_trip_is_lossy = srv._tokenizer_auto_adds_specials = False
    srv._process_messages = lambda request, is_multimodal: protocol.MessageProcessingResult(
        prompt="", prompt_ids=[1, 2, 3], image_data=None, audio_data=None, video_data=None,
        modalities=[], stop=[])
    adapted, _ = srv._convert_to_internal_request(protocol.ChatCompletionRequest(**body))
    return adapted.sampling_params.get("custom_params")

def outputs(choices):
    # what the tokenizer manager yields for a streaming request: per choice, an output per
    # token, the last one finished with its meta_info as finish_response left it
    async def generate_request(adapted, raw):
        for index, last in enumerate(choices):
            for t in range(3):
                meta = {"id": "cmpl-1", "prompt_tokens": 3, "completion_tokens": t + 1,
                        "finish_reason": {"type": "length", "length": 3} if t == 2 else None}
                yield {"index": index, "text": "ab"[t % 2], "output_ids": [7],
                       "meta_info": {**meta, **(last if t == 2 else {})}}
    return generate_request

def sse(stream):
    async def run():
        return [x async for x in stream]
    chunks = asyncio.run(run())
    assert chunks[-1] == "data: [DONE]\n\n", chunks[-1]
    return [json.loads(c[len("data: "):]) for c in chunks[:-1]]

def completion_stream(choices, body):
    srv = object.__new__(OpenAIServingCompletion)
    srv.tokenizer_manager = types.SimpleNamespace(generate_request=outputs(choices))
    request = protocol.CompletionRequest(prompt=[1, 2, 3], stream=True, n=len(choices), **body)
    return sse(srv._generate_completion_stream(GenerateReqInput(input_ids=[1, 2, 3]), request, None))

def chat_stream(choices, body):
    model_config = types.SimpleNamespace(get_default_sampling_params=dict, is_multimodal=False, hf_config=
                                         types.SimpleNamespace(model_type="llama", architectures=["LlamaForCausalLM"]))
    mgr = types.SimpleNamespace(generate_request=outputs(choices), config_value=lambda name: None, server_args=None,
                                model_config=model_config, tokenizer=None)
    templates = types.SimpleNamespace(chat_template_name=None, completion_template_name=None, reasoning_config=None,
                                      jinja_template_content_format=None, python_chat_template=None)
    srv = OpenAIServingChat(mgr, templates)
    request = protocol.ChatCompletionRequest(stream=True, n=len(choices), **MESSAGES, **body)
    return sse(srv._generate_chat_stream(GenerateReqInput(input_ids=[1, 2, 3]), request, None))

MESSAGES = {"messages": [{"role": "user", "content": "hi"}]}
KINDS = {"abort": abort, "completion": completion, "chat": chat, "completion_stream": completion_stream,
         "chat_stream": chat_stream}
out = {}
for name, (kind, *a) in json.loads(sys.argv[1]).items():
    try:
        out[name] = {"ok": KINDS[kind](*a)}
    except Exception:
        import traceback
        out[name] = {"error": traceback.format_exc()[-2000:]}
print("RESULT " + json.dumps({"file": tm.__file__, "out": out}))
"""

RATE = 0.5


def _rid(sampled: bool) -> str:
    """A rid the sampling rate RATE takes (or leaves out), by the contract's sha256 point."""
    for i in range(1000):
        rid = f"rid-{i}"
        point = int.from_bytes(hashlib.sha256(rid.encode()).digest()[:8], "big") / 2.0 ** 64
        if (point < RATE) == sampled:
            return rid
    raise AssertionError("no rid")


IN, OUT = _rid(True), _rid(False)
OUTPUT, VLLM = {"hidden_states_output": True}, {"kv_transfer_params": {"include_output_tokens": True}}
MESSAGES = {"messages": [{"role": "user", "content": "hi"}]}  # (the probe has its own)
CASES = {
    "abort output": ["abort", IN, OUTPUT, True],
    "abort output, dumping off": ["abort", IN, OUTPUT, False],
    "abort prompt-only": ["abort", IN, {}, True],
    "abort output, dump false": ["abort", IN, {**OUTPUT, "hidden_states_dump": False}, True],
    "abort output, rate leaves it out": ["abort", OUT, OUTPUT, True],
    "abort output, rate left out but asked": ["abort", OUT, {**OUTPUT, "hidden_states_dump": True}, True],
    "completion vllm": ["completion", {"prompt": [1, 2, 3], **VLLM}, True],
    "completion vllm + custom": ["completion", {"prompt": [1, 2, 3], "custom_params": {
        "hidden_states_wait": False, "hidden_states_output": False}, **VLLM}, True],
    "completion vllm not true": ["completion", {"prompt": [1, 2, 3], "kv_transfer_params": {
        "include_output_tokens": "yes"}}, True],
    "completion vllm, dumping off": ["completion", {"prompt": [1, 2, 3], **VLLM}, False],
    "completion ours": ["completion", {"prompt": [1, 2, 3], "custom_params": OUTPUT}, True],
    "chat vllm": ["chat", {**MESSAGES, **VLLM}, True],
    "chat vllm + custom": ["chat", {**MESSAGES, "custom_params": {"hidden_states_wait": False}, **VLLM}, True],
    "chat without": ["chat", MESSAGES, True],
}
PATHS = [{"hidden_states_path": "/dump/a.safetensors"}, {"hidden_states_path": "/dump/b.safetensors"}]
FAILED = {"hidden_states_error": "OSError: [Errno 28] No space left on device"}
USAGE = {"stream_options": {"include_usage": True}}
for route in ("completion", "chat"):
    CASES.update({
        f"{route} stream": [f"{route}_stream", PATHS[:1], {}],
        f"{route} stream n=2 + usage": [f"{route}_stream", PATHS, USAGE],
        f"{route} stream failed": [f"{route}_stream", [FAILED], {}],
        f"{route} stream not dumped": [f"{route}_stream", [{}], USAGE],
    })


@pytest.fixture(scope="module")
def doors(patched_site) -> dict:
    site = patched_site(CANDIDATE)
    env = {"PYTHONPATH": f"{site}:{REPO}", "PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"),
           "CUDA_VISIBLE_DEVICES": "", "KIMI_SGLANG_SAMPLE_RATE": str(RATE)}
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(CASES)], env=env, capture_output=True,
                          text=True, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, f"probe crashed:\n{proc.stderr[-3000:]}"
    got = json.loads(line[-1][len("RESULT "):])
    assert got["file"].startswith(str(site)), "imported another sglang"
    for name, result in got["out"].items():
        assert "error" not in result, f"{name}: {result['error']}"
    return {name: result["ok"] for name, result in got["out"].items()}


@pytest.mark.network
def test_an_output_request_aborted_while_waiting_says_why_it_has_no_file(doors):
    """0010: SGLang's abort echo of a request ended while waiting (never scheduled, or
    retracted and not scheduled again) carried no customized_info, so a request that asked
    for its output rows ended with neither a file nor an error. Now it says why; requests
    the server would not dump anyway are left as they were."""
    from sglang_ext.responses import ABORTED_MESSAGE

    assert doors["abort output"] == {"finish": "abort", "keys": {"hidden_states_error": ABORTED_MESSAGE}}
    assert doors["abort output, rate left out but asked"]["keys"] == {"hidden_states_error": ABORTED_MESSAGE}
    for name in ("abort output, dumping off", "abort prompt-only", "abort output, dump false",
                 "abort output, rate leaves it out"):
        assert doors[name] == {"finish": "abort", "keys": {}}, name


@pytest.mark.network
def test_vllms_include_output_tokens_asks_for_output_rows_on_both_openai_routes(doors):
    """0011: kv_transfer_params {"include_output_tokens": true} reaches SGLang's sampling
    parameters as custom_params hidden_states_output (pydantic dropped the undeclared
    field before); other custom_params are kept, only JSON true counts, and nothing changes
    with dumping off."""
    assert doors["completion vllm"] == {"hidden_states_output": True}
    assert doors["completion vllm + custom"] == {"hidden_states_wait": False, "hidden_states_output": True}
    assert doors["completion vllm not true"] is None
    assert doors["completion vllm, dumping off"] is None
    assert doors["completion ours"] == {"hidden_states_output": True}
    assert doors["chat vllm"] == {"hidden_states_output": True}
    assert doors["chat vllm + custom"] == {"hidden_states_wait": False, "hidden_states_output": True}
    assert doors["chat without"] is None


@pytest.mark.network
@pytest.mark.parametrize("route", ["completion", "chat"])
def test_streaming_responses_name_the_file_or_the_error_in_their_last_chunk(doors, route):
    """0012: SGLang's own stream generators, fed the tokenizer manager's outputs (the last
    of each choice holding its path or error): after every choice's last chunk and before
    the usage chunk comes one response-level chunk (``choices: []``) whose
    ``kv_transfer_params`` names the file (each choice's when n > 1), or the error; none
    for a request that was not dumped. Before, no chunk carried any of it."""
    def dump_chunks(chunks):
        return [i for i, c in enumerate(chunks) if "kv_transfer_params" in c]

    one = doors[f"{route} stream"]
    assert dump_chunks(one) == [len(one) - 1] and one[-1]["choices"] == [] and one[-1]["id"] == "cmpl-1"
    assert one[-1]["kv_transfer_params"] == PATHS[0]
    assert one[-2]["choices"][0]["finish_reason"] == "length"
    two = doors[f"{route} stream n=2 + usage"]
    assert dump_chunks(two) == [len(two) - 2] and two[-1]["usage"] is not None, "before the usage chunk"
    assert two[-2]["kv_transfer_params"] == {**PATHS[0], "hidden_states_paths": [p["hidden_states_path"] for p in PATHS]}
    assert doors[f"{route} stream failed"][-1]["kv_transfer_params"] == FAILED
    assert dump_chunks(doors[f"{route} stream not dumped"]) == []
