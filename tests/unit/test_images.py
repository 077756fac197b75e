"""Prompts with images on the server side (issue 40, docs/images.md): what the file records
for a multimodal request, and what a /v1/chat/completions response carries (patch 0008).

A multimodal ``Req`` of SGLang 0.5.23 holds the prompt twice: ``origin_input_ids_unpadded``,
the multimodal processor's ids (the image token id at every vision-token position, as HF's
processor returns them), and ``origin_input_ids``, a copy whose image positions the
scheduler replaced by per-image pad values (hashes, outside the vocabulary). The stand-in
``Req`` here carries both as SGLang's does; the file must record the first.
"""

import types

import pytest
import torch

from sglang_ext import format as fmt
from sglang_ext import session
from sglang_ext.responses import HiddenStatesDumpError, openai_chat_extras

from standins import Req, extend_args, finish, idle, make_runner, reference

IMAGE_TOKEN = 151655  # Qwen2.5-VL's <|image_pad|>
PAD_HASH = 0x5A5A_1234_5678  # an image's pad value: a hash, no token of the vocabulary


def image_req(rid, seed, image_at=(3, 11)):
    """A 16-token request whose positions ``image_at`` [start, stop) are one image."""
    req = Req(rid, 16, seed)
    start, stop = image_at
    unpadded = list(req.origin_input_ids)
    unpadded[start:stop] = [IMAGE_TOKEN] * (stop - start)
    padded = list(unpadded)
    padded[start:stop] = [PAD_HASH + seed] * (stop - start)
    req.origin_input_ids_unpadded, req.origin_input_ids = unpadded, padded
    return req


def test_file_records_the_image_token_not_the_pad_hash(dump, sessions):
    """Chunked over two extend batches: the file's token_ids are the unpadded prompt (the
    image token at every vision-token position), its rows every position's, and its
    metadata names the model's image token id (from ``hf_config.image_token_id``)."""
    runner = make_runner(dump, layers="2,4")
    runner.model_config.hf_config = types.SimpleNamespace(image_token_id=IMAGE_TOKEN)
    sess = sessions.start(runner)
    a, text = image_req("img", 1), Req("txt", 5, 2)
    sess.on_prefill_result(*extend_args([(a, 0, 7), (text, 0, 5)], [2, 4]))
    sess.on_prefill_result(*extend_args([(a, 7, 16)], [2, 4]))
    rec = fmt.load(finish(a)["hidden_states_path"])
    assert rec.token_ids.tolist() == a.origin_input_ids_unpadded
    assert rec.token_ids.tolist()[3:11] == [IMAGE_TOKEN] * 8
    assert torch.equal(rec.hidden_states, reference(a, [2, 4]))
    assert rec.metadata["image_token_id"] == str(IMAGE_TOKEN)
    plain = fmt.load(finish(text)["hidden_states_path"])  # a text prompt: its ids as sent
    assert plain.token_ids.tolist() == text.origin_input_ids
    assert idle(sess)["files_written"] == 2


def test_dumped_token_ids_and_image_token_metadata():
    """The unpadded ids only when they line up with the padded ones; the image token id
    from Qwen's ``image_token_id`` or Kimi's ``media_placeholder_token_id``, none for a
    text model (or a non-int value)."""
    req = image_req("x", 1)
    assert session.dumped_token_ids(req) is req.origin_input_ids_unpadded
    req.origin_input_ids_unpadded = req.origin_input_ids_unpadded[:-1]  # no padding of 0.5.23 does this
    assert session.dumped_token_ids(req) is req.origin_input_ids
    text = Req("t", 4, 1)
    assert session.dumped_token_ids(text) is text.origin_input_ids  # no unpadded attribute
    text.origin_input_ids_unpadded = text.origin_input_ids  # SGLang's text Req: the same list
    assert session.dumped_token_ids(text) is text.origin_input_ids

    def meta(**cfg):
        return session.image_token_metadata(types.SimpleNamespace(hf_config=types.SimpleNamespace(**cfg)))

    assert meta(image_token_id=IMAGE_TOKEN, vision_start_token_id=1) == {"image_token_id": str(IMAGE_TOKEN)}
    assert meta(media_placeholder_token_id=163605) == {"image_token_id": "163605"}
    assert meta(vocab_size=1024) == {} and meta(image_token_id=None) == {} and meta(image_token_id=True) == {}
    assert session.image_token_metadata(types.SimpleNamespace()) == {}


def _chat_response():
    pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
    from sglang.srt.entrypoints.openai.protocol import (
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
        UsageInfo,
    )

    return ChatCompletionResponse(
        id="chat-1", model="m",
        choices=[ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content="x"),
                                              finish_reason="length")],
        usage=UsageInfo(prompt_tokens=16, completion_tokens=1, total_tokens=17))


def test_chat_hook_adds_kv_transfer_params():
    """Patch 0008's call on SGLang's own ChatCompletionResponse: the file's path (one per
    choice when there are several) or the store's manifest as ``kv_transfer_params``, in
    the JSON the server sends; the other fields as they were."""
    r = _chat_response()
    out = openai_chat_extras(r, [{"meta_info": {"hidden_states_path": "/hs/a.safetensors"}}])
    body = out.model_dump(mode="json")
    assert body["kv_transfer_params"] == {"hidden_states_path": "/hs/a.safetensors"}
    assert body["choices"] == r.model_dump(mode="json")["choices"] and body["id"] == "chat-1"
    assert '"kv_transfer_params":{"hidden_states_path":"/hs/a.safetensors"}' in out.model_dump_json()
    two = openai_chat_extras(r, [{"meta_info": {"hidden_states_path": "/a"}},
                                 {"meta_info": {"hidden_states_path": "/b"}}])
    assert two.model_dump(mode="json")["kv_transfer_params"] == {
        "hidden_states_path": "/a", "hidden_states_paths": ["/a", "/b"]}
    manifest = {"version": 1, "handle": "k1", "num_tokens": 16}
    stored = openai_chat_extras(r, [{"meta_info": {"hidden_states_manifest": manifest}}])
    assert stored.model_dump(mode="json")["kv_transfer_params"] == manifest
    assert "kv_transfer_params" not in r.model_dump(mode="json")  # the original is untouched


def test_chat_hook_passes_through_and_reports_errors():
    """Dumping off (no dump keys) and SGLang's error responses come back unchanged; a
    failed dump raises (SGLang's OpenAI layer answers HTTP 500, which clients retry)."""
    r = _chat_response()
    assert openai_chat_extras(r, [{"meta_info": {}}]) is r
    # SGLang's error responses are fastapi ORJSONResponse objects (fastapi is not in the CPU
    # venv): any object that is not a pydantic model stands for one
    err = types.SimpleNamespace(body=b'{"error": "bad"}', status_code=400)
    assert openai_chat_extras(err, [{"meta_info": {"hidden_states_path": "/a"}}]) is err
    with pytest.raises(HiddenStatesDumpError, match="hidden-state dump failed: disk full"):
        openai_chat_extras(r, [{"meta_info": {"hidden_states_error": "disk full"}}])
