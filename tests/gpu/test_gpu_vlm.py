"""Prompts with images (issue 40): /v1/chat/completions with ``image_url`` parts dumps every
position, against HF's forward of the same pixels.

The model is ``qwen_vl`` (testing/tiny_models.py ``VLM_MODELS``: a tiny random
Qwen2_5_VLForConditionalGeneration, which SGLang 0.5.23 and transformers both implement,
with a local tokenizer, chat template and Qwen's image processor), served by
``sglang.launch_server`` with ``--mm-attention-backend sdpa`` (the staged stack has no
FlashAttention 3 for the vision tower) and dump layers 1,2,3. The reference
(testing/reference.py ``VLMReference``) is HF's float32 forward on what HF's processor makes
of the same chat (the PNG decoded by PIL): ``input_ids``, ``pixel_values``, ``image_grid_thw``.
SGLang's chat path renders and encodes the chat, then hands its processor the ids decoded
back to text (entrypoints/openai/serving_chat.py ``_apply_jinja_template``), in which
multimodal/processors/qwen_vl.py finds each image by the regex
``<|vision_start|>(<|image_pad|>)+<|vision_end|>``; an image it cannot place is dropped
with "More image data items provided than corresponding tokens" and the prompt runs
without it. So the tiny tokenizer decodes as Qwen's does, special tokens with nothing
between them (tiny_models.save_qwen_vl_processor; tests/tooling/test_qwen_vl_processor.py
runs SGLang's processor over it on the CPU).

Each case sends one chat request (max_tokens 1, temperature 0, ``return_prompt_token_ids``)
and checks: the response's ``kv_transfer_params.hidden_states_path`` (patch 0008) names a
file; its ``token_ids`` equal HF's processor's ``input_ids`` (the image token id at every
vision-token position, never SGLang's pad hashes) and the response's ``prompt_token_ids``;
its metadata says ``image_token_id``; the text rows and the image rows are each within the
file tolerances of the reference (checks.TOL_BLOCK per block, TOL_TOKEN per row).

The Kimi-K2.5 class (``kimi_vl``: ``KimiK25ForConditionalGeneration``, the ``kimi``
checkpoint with a word-level tokenizer, Kimi's role and media tokens and a chat template)
serves one chat (a 84x56 PNG data URL, then text; max_tokens 1, temperature 0) through its
own MoonViT tower. Its processor is a stand-in (testing/kimi_processor.py: Kimi's
``media_proc_cfg`` and image arithmetic; with CUDA SGLang's ``KimiGPUProcessorWrapper``
preprocesses the pixels itself and only reads the stand-in's tokenizer and config). HF
transformers has no Kimi-K2.5 class, so the reference is SGLang's own JSON
``return_hidden_states`` for the same request, from a second server without the dump (the
dump refuses ``--enable-return-hidden-states``), started after the dump server stopped,
with the radix cache off and prefill eager as the dump server runs. SGLang 0.5.23 returns
the rows of the tokens an extend computes (scheduler_components/batch_result_processor.py
``_append_prefill_hidden_states``: ``hidden_states[offset:offset + extend_input_len]``), so
with the radix cache on, ``/generate`` after the chat computed one token (21 of 22 cached)
and answered one row:

- SGLang's chat path cannot return the prompt's rows: with ``return_hidden_states: true``
  it answers ``hidden_states[-1]`` of [prefill rows, decode rows...], i.e. ``[]`` at
  max_tokens 1 (entrypoints/openai/utils.py ``process_hidden_states_for_response``); with
  ``"last"`` it answers the last prompt position's row. So the chat asks for ``"last"``
  (and ``prompt_token_ids``), and ``/generate`` with the chat's prompt ids (its image run
  collapsed to the one placeholder SGLang expands) and the same image, with
  ``return_hidden_states: true``, gives every prompt row;
- both are the final norm's output (the logits processor's input: layers/logits_processor.py
  ``_get_hidden_states_to_store``; DeepseekV2 passes no ``hidden_states_before_norm``), the
  file's id 4 slot is the stream before that norm (patch 0002): the test applies the
  checkpoint's final RMSNorm to the file's slot and compares, text rows and image rows
  apart, within checks.TOL_BLOCK / TOL_TOKEN; layers 1 and 3 have no JSON counterpart;
- the file's ``token_ids`` equal the dump server's and the JSON server's
  ``prompt_token_ids`` and the chat template's ids with the placeholder expanded to 6
  image tokens (4x6 patches of 14, merged 2x2); metadata ``image_token_id`` 2.

Run (one GPU, ~3 minutes with the build, ~3 more for the two Kimi servers):
``pytest tests/gpu/test_gpu_vlm.py`` or ``pytest tests/gpu -k vlm``. The module uses no
``model_name``: a run narrowed by ``--models`` leaves it out (tests/gpu/conftest.py), the
default (every tiny model) and ``-k vlm`` run it.
"""

from __future__ import annotations

import base64
import io
import os
import shutil

import pytest

from testing import tiny_models
from testing.checks import TOL_BLOCK, TOL_TOKEN, Problems, Worst
from testing.reference import rel_errors

pytestmark = pytest.mark.gpu

SPEC = tiny_models.VLM_MODELS["qwen_vl"]
TEXT = "t5 t17 t300 t42 t7"  # words of the tokenizer: ids 5 17 300 42 7
# mm attention: SDPA (torch's), no FA3 in the staged sgl_kernel
EXTRA_FLAGS = ["--mm-attention-backend", "sdpa"]


def png(width: int, height: int, seed: int) -> bytes:
    """A random RGB PNG of ``width`` x ``height`` (sides multiples of 28: no resizing, so
    SGLang's and HF's processors cut the same patches)."""
    import numpy as np
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm(pytestconfig):
    """The tiny Qwen2.5-VL built under --model-dir (tiny_models.TinyModel)."""
    workdir = pytestconfig.getoption("--model-dir")
    os.makedirs(workdir, exist_ok=True)
    return tiny_models.build(SPEC, workdir)


@pytest.fixture(scope="module")
def vlm_reference(vlm):
    import torch

    from testing.reference import VLMReference

    ref = VLMReference(vlm.path, device="cuda")
    yield ref
    ref.close()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def vlm_server(request, vlm, server_log_dir, pytestconfig):
    """The patched server on the tiny Qwen2.5-VL (chat template from its tokenizer)."""
    from testing.server import ServerOptions, launch, server_command

    options = ServerOptions(cuda_graph=not pytestconfig.getoption("--no-cuda-graph"))
    dump_dir = f"/dev/shm/hs-{vlm.name}-vlm"
    shutil.rmtree(dump_dir, ignore_errors=True)
    os.makedirs(dump_dir)
    cmd = server_command(vlm.path, dump_dir, SPEC.layers_flag, SPEC.launcher, options) + EXTRA_FLAGS
    srv = launch(cmd, os.path.join(server_log_dir, f"server-{vlm.name}-vlm.log"), None, dump_dir)
    try:
        srv.wait_healthy()
    except BaseException:
        srv.stop()
        raise
    plugin = getattr(request.config, "_kimi_results", None)
    if plugin is not None:
        plugin.servers.append({"name": f"{vlm.name}-vlm", "startup_s": srv.startup_s, "command": srv.command})
    yield srv
    srv.stop()


def chat(server, content):
    """/v1/chat/completions with one user message of ``content`` parts; the JSON answer."""
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 1,
            "temperature": 0, "return_prompt_token_ids": True}
    r = server.post(body, path="/v1/chat/completions")
    assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:500]}"
    return r.json()


def check_chat(answer, ref_ids, ref_block, vlm, case, record_property):
    """The answer's file against HF's ids and rows: ids exact (and the response's
    prompt_token_ids), image token id in the metadata, text rows and image rows each within
    the tolerances."""
    import torch

    from sglang_ext import format as fmt

    problems = Problems()
    path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
    if not path or not os.path.exists(path):
        problems.add(f"{case}: no file (kv_transfer_params {answer.get('kv_transfer_params')!r})")
        problems.check(case)
    rec = fmt.load(path)
    got_ids = rec.token_ids.tolist()
    image = tiny_models.QWEN_VL_IMAGE_TOKEN
    if got_ids != ref_ids:
        problems.add(f"{case}: file token_ids {got_ids} != HF processor's input_ids {ref_ids}")
    prompt_ids = answer["choices"][0].get("prompt_token_ids")
    if prompt_ids is not None and list(prompt_ids) != got_ids:
        problems.add(f"{case}: response prompt_token_ids {prompt_ids} != file token_ids")
    if rec.metadata.get("image_token_id") != str(image):
        problems.add(f"{case}: metadata image_token_id {rec.metadata.get('image_token_id')!r} != {image}")
    if list(rec.layer_ids) != list(vlm.layer_ids):
        problems.add(f"{case}: layer_ids {rec.layer_ids} != {list(vlm.layer_ids)}")
    want_shape = (len(ref_ids), len(vlm.layer_ids), vlm.hidden_size)
    if tuple(rec.hidden_states.shape) != want_shape:
        problems.add(f"{case}: hidden_states shape {tuple(rec.hidden_states.shape)} != {want_shape}")
        problems.check(case)
    is_image = torch.tensor([t == image for t in ref_ids])
    for part, mask in (("text", ~is_image), ("image", is_image)):
        if not bool(mask.any()):
            continue
        worst = Worst()
        worst.add(rel_errors(rec.hidden_states[mask], ref_block[mask]), f"{case} {part} rows")
        record_property(f"max_rel_err_{part}", worst.block)
        record_property(f"max_rel_err_per_token_{part}", worst.token)
        problems.extend(worst.problems(TOL_BLOCK, TOL_TOKEN))
    record_property("image_rows", int(is_image.sum()))
    record_property("rows", len(ref_ids))
    problems.check(case)


def test_chat_one_image_data_url(vlm_server, vlm_reference, vlm, record_property):
    """One 112x84 PNG as a base64 data URL, then text: 12 image rows (8x6 patches merged
    2x2) between <|vision_start|> and <|vision_end|>."""
    from PIL import Image

    data = png(112, 84, seed=1)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    answer = chat(vlm_server, [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": TEXT}])
    ids, block = vlm_reference([{"role": "user", "content": [
        {"type": "image", "image": Image.open(io.BytesIO(data)).convert("RGB")},
        {"type": "text", "text": TEXT}]}], vlm.layer_ids)
    assert ids.count(tiny_models.QWEN_VL_IMAGE_TOKEN) == 12, ids
    check_chat(answer, ids, block, vlm, "one image, data URL", record_property)


def test_chat_image_file_url_between_text(vlm_server, vlm_reference, vlm, record_property, tmp_path):
    """Text, a 56x140 PNG as a file:// URL, text: the image rows in the middle (10 of them)."""
    from PIL import Image

    data = png(56, 140, seed=2)
    path = tmp_path / "image.png"
    path.write_bytes(data)
    answer = chat(vlm_server, [{"type": "text", "text": TEXT}, {"type": "image_url", "image_url": {"url": f"file://{path}"}},
                               {"type": "text", "text": "t9 t10"}])
    ids, block = vlm_reference([{"role": "user", "content": [
        {"type": "text", "text": TEXT}, {"type": "image", "image": Image.open(path).convert("RGB")},
        {"type": "text", "text": "t9 t10"}]}], vlm.layer_ids)
    assert ids.count(tiny_models.QWEN_VL_IMAGE_TOKEN) == 10, ids
    check_chat(answer, ids, block, vlm, "image file URL between text", record_property)


def test_chat_text_only(vlm_server, vlm_reference, vlm, record_property):
    """A plain text chat on the same server: no image row, the ids HF's chat template makes."""
    answer = chat(vlm_server, TEXT)
    ids, block = vlm_reference([{"role": "user", "content": [{"type": "text", "text": TEXT}]}], vlm.layer_ids)
    check_chat(answer, ids, block, vlm, "text only", record_property)


# ---- the Kimi-K2.5 class: its own vision tower, against SGLang's own JSON hidden states ----
KIMI = tiny_models.VLM_MODELS["kimi_vl"]
KIMI_PORT = 30031  # one kimi server at a time; the Qwen server (PORT) may still be up
KIMI_SIZE = (84, 56)  # 6x4 patches of 14, merged 2x2: 6 <|media_pad|> rows; no resize, no padding
KIMI_IMAGE_ROWS = 6
KIMI_FINAL = 4  # layer id N = num_hidden_layers: the stream before the final norm


def kimi_content():
    """The one chat content the Kimi cases send: a PNG data URL, then text."""
    url = "data:image/png;base64," + base64.b64encode(png(*KIMI_SIZE, seed=4)).decode()
    return url, [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": TEXT}]


@pytest.fixture(scope="module")
def kimi_vl(pytestconfig):
    """The tiny Kimi-K2.5 with a tokenizer and chat template (tiny_models.TinyModel)."""
    workdir = pytestconfig.getoption("--model-dir")
    os.makedirs(workdir, exist_ok=True)
    return tiny_models.build(KIMI, workdir)


def run_kimi_server(kimi_vl, log_dir, no_cuda_graph, tag, send):
    """Start a server on ``kimi_vl`` (``tag`` "dump": the dump flags; "json": no dump,
    ``--enable-return-hidden-states``, which the dump refuses, and what the dump turns on
    by itself: ``--disable-radix-cache``, ``--disable-prefill-cuda-graph``), call ``send(server)``,
    stop it; returns what ``send`` returned. Raises the start-up error with the log's tail."""
    from testing.server import ServerOptions, launch, server_command

    dump_dir = f"/dev/shm/hs-{kimi_vl.name}-{tag}"
    shutil.rmtree(dump_dir, ignore_errors=True)
    os.makedirs(dump_dir)
    cmd = server_command(kimi_vl.path, dump_dir, KIMI.layers_flag, KIMI.launcher,
                         ServerOptions(cuda_graph=not no_cuda_graph), port=KIMI_PORT)
    if tag == "json":
        # as the dump server runs: no radix cache (a cached prefix has no rows: SGLang
        # returns hidden states of the tokens an extend computes), prefill eager
        cmd = cmd[:cmd.index("--dump-hidden-states-dir")] + [
            "--enable-return-hidden-states", "--disable-radix-cache", "--disable-prefill-cuda-graph"]
    srv = launch(cmd + EXTRA_FLAGS, os.path.join(log_dir, f"server-{kimi_vl.name}-{tag}.log"), None, dump_dir)
    try:
        srv.wait_healthy()
        return send(srv)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def kimi_dump(kimi_vl, server_log_dir, pytestconfig):
    """The dump server's chat answer for ``kimi_content`` (max_tokens 1, temperature 0,
    prompt_token_ids) and the file it names (format.DumpRecord), or None."""
    from sglang_ext import format as fmt

    def send(srv):
        answer = chat(srv, kimi_content()[1])
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        return answer, (fmt.load(path) if path and os.path.exists(path) else None)

    return run_kimi_server(kimi_vl, server_log_dir, pytestconfig.getoption("--no-cuda-graph"), "dump", send)


@pytest.fixture(scope="module")
def kimi_json(kimi_vl, server_log_dir, pytestconfig):
    """SGLang's own JSON hidden states for the same request, from a server without the
    dump: ``chat`` (the chat answer with ``return_hidden_states: "last"`` and
    prompt_token_ids) and ``rows`` ([T, H] float32: /generate with the chat's prompt ids,
    its image run collapsed back to the one placeholder the processor expands, the same
    image, ``return_hidden_states: true``)."""
    import torch

    url, content = kimi_content()

    def send(srv):
        body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 1,
                "temperature": 0, "return_prompt_token_ids": True, "return_hidden_states": "last"}
        r = srv.post(body, path="/v1/chat/completions")
        assert r.status_code == 200, f"chat: HTTP {r.status_code}: {r.text[:500]}"
        answer = r.json()
        ids = answer["choices"][0]["prompt_token_ids"]
        pad = tiny_models.KIMI_MEDIA_PLACEHOLDER
        collapsed = [t for i, t in enumerate(ids) if t != pad or i == 0 or ids[i - 1] != pad]
        r = srv.post({"input_ids": collapsed, "image_data": [url], "return_hidden_states": True,
                      "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        assert r.status_code == 200, f"/generate: HTTP {r.status_code}: {r.text[:500]}"
        hs = r.json()["meta_info"].get("hidden_states")
        assert hs, f"/generate returned no hidden_states: {str(r.json()['meta_info'])[:500]}"
        rows = torch.tensor(hs[0] if isinstance(hs[0][0], list) else hs, dtype=torch.float32)
        return {"chat": answer, "rows": rows}

    return run_kimi_server(kimi_vl, server_log_dir, pytestconfig.getoption("--no-cuda-graph"), "json", send)


def final_norm(kimi_vl, stream):
    """The language model's final RMSNorm (its checkpoint weight, ``rms_norm_eps``) of
    ``stream`` [T, H], in float32: what SGLang's JSON hidden states hold at id N."""
    import json

    import torch
    from safetensors import safe_open

    with open(os.path.join(kimi_vl.path, "config.json")) as f:
        eps = json.load(f)["text_config"].get("rms_norm_eps", 1e-6)
    with safe_open(os.path.join(kimi_vl.path, "model.safetensors"), "pt") as f:
        weight = f.get_tensor("language_model.model.norm.weight").float()
    x = stream.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_kimi_chat_image_dump_file(kimi_dump, kimi_vl):
    """The Kimi-K2.5 class through its own vision tower: the file holds the ids the model
    ran (the chat template's, the placeholder expanded to 6 image tokens, as the
    stand-in's tokenizer and SGLang's navit arithmetic make them), equal to the response's
    prompt_token_ids; image_token_id in the metadata; every row, layer ids 1,3,4."""
    from transformers import AutoTokenizer

    answer, rec = kimi_dump
    problems = Problems()
    case = "kimi_vl chat, one image"
    if rec is None:
        problems.add(f"{case}: no file (kv_transfer_params {answer.get('kv_transfer_params')!r})")
        problems.check(case)
    pad = tiny_models.KIMI_MEDIA_PLACEHOLDER
    tok = AutoTokenizer.from_pretrained(kimi_vl.path)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}],
                                   tokenize=False, add_generation_prompt=True)
    template_ids = tok.encode(text, add_special_tokens=False)
    want = [t for i in template_ids for t in ([pad] * KIMI_IMAGE_ROWS if i == pad else [i])]
    got = rec.token_ids.tolist()
    if got != want:
        problems.add(f"{case}: file token_ids {got} != chat template + {KIMI_IMAGE_ROWS} image tokens {want}")
    prompt_ids = answer["choices"][0].get("prompt_token_ids")
    if prompt_ids is None or list(prompt_ids) != got:
        problems.add(f"{case}: response prompt_token_ids {prompt_ids} != file token_ids {got}")
    if rec.metadata.get("image_token_id") != str(pad):
        problems.add(f"{case}: metadata image_token_id {rec.metadata.get('image_token_id')!r} != {pad}")
    if list(rec.layer_ids) != list(kimi_vl.layer_ids):
        problems.add(f"{case}: layer_ids {rec.layer_ids} != {list(kimi_vl.layer_ids)}")
    shape = (len(want), len(kimi_vl.layer_ids), kimi_vl.hidden_size)
    if tuple(rec.hidden_states.shape) != shape:
        problems.add(f"{case}: hidden_states shape {tuple(rec.hidden_states.shape)} != {shape}")
    elif not bool(rec.hidden_states.float().isfinite().all()):
        problems.add(f"{case}: non-finite values in hidden_states")
    problems.check(case)


def test_kimi_rows_match_sglang_json_hidden_states(kimi_dump, kimi_json, kimi_vl, record_property):
    """The file against SGLang's own JSON hidden states of the same request: the ids equal
    the JSON server's prompt_token_ids; the final norm of the file's id-4 slot (the stream
    before the norm) is within the file tolerances of /generate's rows (post-norm), text
    rows and image rows apart, and of the chat's ``"last"`` row at the last position."""
    import torch

    answer, rec = kimi_dump
    assert rec is not None, f"no file (kv_transfer_params {answer.get('kv_transfer_params')!r})"
    problems = Problems()
    case = "kimi_vl file vs JSON"
    got_ids = rec.token_ids.tolist()
    json_ids = kimi_json["chat"]["choices"][0].get("prompt_token_ids")
    if json_ids is None or list(json_ids) != got_ids:
        problems.add(f"{case}: file token_ids {got_ids} != JSON server's prompt_token_ids {json_ids}")
    rows = kimi_json["rows"]
    if tuple(rows.shape) != (len(got_ids), kimi_vl.hidden_size):
        problems.add(f"{case}: /generate hidden_states {tuple(rows.shape)} != ({len(got_ids)}, {kimi_vl.hidden_size})")
        problems.check(case)
    slot = list(rec.layer_ids).index(KIMI_FINAL)
    normed = final_norm(kimi_vl, rec.hidden_states[:, slot])  # [T, H]
    is_image = torch.tensor([t == tiny_models.KIMI_MEDIA_PLACEHOLDER for t in got_ids])
    if int(is_image.sum()) != KIMI_IMAGE_ROWS:
        problems.add(f"{case}: {int(is_image.sum())} image rows, not {KIMI_IMAGE_ROWS}")
    for part, mask in (("text", ~is_image), ("image", is_image)):
        if not bool(mask.any()):
            continue
        worst = Worst()
        worst.add(rel_errors(normed[mask].unsqueeze(1), rows[mask].unsqueeze(1)), f"{case} {part} rows")
        record_property(f"max_rel_err_{part}", worst.block)
        record_property(f"max_rel_err_per_token_{part}", worst.token)
        problems.extend(worst.problems(TOL_BLOCK, TOL_TOKEN))
    last = kimi_json["chat"]["choices"][0].get("hidden_states")
    if not last or len(last) != kimi_vl.hidden_size:
        problems.add(f"{case}: chat return_hidden_states 'last' gave {str(last)[:200]}, not one row")
    else:
        worst = Worst()
        worst.add(rel_errors(normed[-1:].unsqueeze(1), torch.tensor([last], dtype=torch.float32).unsqueeze(1)),
                  f"{case} chat last row")
        record_property("max_rel_err_chat_last", worst.block)
        problems.extend(worst.problems(TOL_BLOCK, TOL_TOKEN))
    record_property("rows", len(got_ids))
    problems.check(case)
