"""Prompts with images (issue 40): /v1/chat/completions with ``image_url`` parts dumps every
position, against HF's forward of the same pixels.

The model is ``qwen_vl`` (testing/tiny_models.py ``VLM_MODELS``: a tiny random
Qwen2_5_VLForConditionalGeneration, which SGLang 0.5.23 and transformers both implement,
with a local tokenizer, chat template and Qwen's image processor), served by
``sglang.launch_server`` with ``--mm-attention-backend sdpa`` (the staged stack has no
FlashAttention 3 for the vision tower) and dump layers 1,2,3. The reference
(testing/reference.py ``VLMReference``) is HF's float32 forward on what HF's processor makes
of the same chat (the PNG decoded by PIL): ``input_ids``, ``pixel_values``, ``image_grid_thw``.

Each case sends one chat request (max_tokens 1, temperature 0, ``return_prompt_token_ids``)
and checks: the response's ``kv_transfer_params.hidden_states_path`` (patch 0008) names a
file; its ``token_ids`` equal HF's processor's ``input_ids`` (the image token id at every
vision-token position, never SGLang's pad hashes) and the response's ``prompt_token_ids``;
its metadata says ``image_token_id``; the text rows and the image rows are each within the
file tolerances of the reference (checks.TOL_BLOCK per block, TOL_TOKEN per row).

Run (one GPU, ~3 minutes with the build): ``pytest tests/gpu/test_gpu_vlm.py``. The module
uses no ``model_name``: ``--models`` does not select it, ``-k vlm`` does.
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
