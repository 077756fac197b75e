"""The GPU suite's tiny Qwen2.5-VL processor (testing/tiny_models.py ``save_qwen_vl_processor``)
against SGLang's own image path, on the CPU (SGLang as installed in the test venv):

SGLang's chat path renders and encodes the chat, then hands its multimodal processor the ids
decoded back to text (entrypoints/openai/serving_chat.py ``_apply_jinja_template``:
``prompt = tokenizer.decode(prompt_ids)``); multimodal/processors/qwen_vl.py finds each image
there by the regex ``<|vision_start|>(<|image_pad|>)+<|vision_end|>`` and expands it, or,
finding none, drops the image ("More image data items provided than corresponding tokens
found in the prompt", base_processor.py) and runs the prompt without it: the GPU module's
first run dumped the unexpanded placeholder that way, with a tokenizer that decoded
``<|vision_start|> <|image_pad|> <|vision_end|>``. So:

- decoding the chat's ids gives text that re-encodes to the same ids and holds each image's
  placeholder unbroken, and the ids are the ones the word tokenizer always gave (the text
  and store tests of the GPU suite keep their expectations);
- SGLang's ``QwenVLImageProcessor``, built as the tokenizer manager builds it, given what the
  chat layer gives it (the decoded prompt, the ``ImageData`` of a data URL or a ``file://``
  URL), returns HF's processor's ``input_ids`` for the same chat and image (the image token
  at every merged vision token) and one image item over exactly those positions.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")
Image = pytest.importorskip("PIL.Image")
pytest.importorskip("transformers")

from testing import tiny_models  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TEXT = "t5 t17 t300 t42 t7"
IMAGE = tiny_models.QWEN_VL_IMAGE_TOKEN
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """config.json and the processor of the tiny Qwen2.5-VL (no weights: nothing here runs
    the model)."""
    path = tmp_path_factory.mktemp("qwen-vl")
    (path / "config.json").write_text(json.dumps(tiny_models.qwen_vl_config()))
    tiny_models.save_qwen_vl_processor(str(path))
    return path


def png(width, height, seed):
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


CHATS = {  # content of the one user message, as SGLang's chat layer hands it to the template
    "image first": [{"type": "image"}, {"type": "text", "text": TEXT}],
    "image between text": [{"type": "text", "text": TEXT}, {"type": "image"}, {"type": "text", "text": "t9 t10"}],
    "two images": [{"type": "image"}, {"type": "text", "text": "t9"}, {"type": "image"}],
    "text only": TEXT,
}
IDS = {  # the word tokenizer's ids: roles are unknown words (t0), newlines separate only
    "image first": [1025, 0, 1027, IMAGE, 1028, 5, 17, 300, 42, 7, 1026, 1025, 0],
    "image between text": [1025, 0, 5, 17, 300, 42, 7, 1027, IMAGE, 1028, 9, 10, 1026, 1025, 0],
    "two images": [1025, 0, 1027, IMAGE, 1028, 9, 1027, IMAGE, 1028, 1026, 1025, 0],
    "text only": [1025, 0, 5, 17, 300, 42, 7, 1026, 1025, 0],
}


@pytest.mark.parametrize("case", list(CHATS))
def test_decoded_chat_keeps_each_placeholder_and_re_encodes_to_its_ids(model_dir, case):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rendered = tok.apply_chat_template([{"role": "user", "content": CHATS[case]}], tokenize=False,
                                       add_generation_prompt=True)
    ids = tok.encode(rendered)
    assert ids == IDS[case]
    decoded = tok.decode(ids)
    assert tok.encode(decoded) == ids, decoded
    images = sum(1 for part in CHATS[case] if isinstance(part, dict) and part["type"] == "image")
    assert decoded.count(PLACEHOLDER) == images, decoded
    assert tok.decode([5, 17, 300]) == "t5 t17 t300"


PROBE = r"""
import asyncio, json, sys
from types import SimpleNamespace

model_dir, cases = sys.argv[1], json.loads(sys.argv[2])
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.server_args import ServerArgs
from sglang.srt.runtime_context import SpawnRanks, publish

# the GPU module's flags that matter here; device "cuda" as the GPU server resolves it
sa = ServerArgs(model_path=model_dir, device="cuda", mm_attention_backend="sdpa")
publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
mc = ModelConfig.from_server_args(sa)

# TokenizerManager.init_tokenizer_and_processor, multimodal branch
from sglang.srt.managers.multimodal_processor import get_mm_processor, import_processors
from sglang.srt.runtime_context import get_mm, get_model, get_serving
from sglang.srt.utils.hf_transformers.processor import get_processor, resolve_image_processor_backend
from sglang.srt.parser.jinja_template_utils import process_content_for_template_format

import_processors("sglang.srt.multimodal.processors")
proc = get_processor(get_serving().tokenizer_path, tokenizer_mode=get_serving().tokenizer_mode,
                     trust_remote_code=get_model().trust_remote_code, revision=get_model().revision,
                     tokenizer_backend=get_serving().tokenizer_backend, model_name=get_model().model_path,
                     image_processor_backend=resolve_image_processor_backend(get_mm()))
mm = get_mm_processor(mc.hf_config, sa, proc, "cpu", model_config=mc)
tok = mm._tokenizer
out = {"processor": type(mm).__name__, "regex": mm.mm_tokens.image_token_regex.pattern, "cases": {}}
for name, content in cases.items():
    # serving_chat._apply_jinja_template: image parts to {"type": "image"} and ImageData,
    # render, encode, decode (the text the multimodal processor reads)
    images = []
    msg = process_content_for_template_format({"role": "user", "content": content}, "openai", images, [], [], [])
    ids = tok.encode(tok.apply_chat_template([msg], tokenize=False, add_generation_prompt=True))
    prompt = tok.decode(ids)
    req = SimpleNamespace(video_data=None, audio_data=None, rid=name, mm_content_hashes=None)
    res = asyncio.run(mm.process_mm_data_async(image_data=images, input_text=prompt, request_obj=req))
    out["cases"][name] = {"prompt": prompt, "input_ids": list(res.input_ids),
                          "items": [[i.modality.name, [list(o) for o in i.offsets]] for i in res.mm_items]}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def sglang_run(model_dir, tmp_path_factory):
    """SGLang's processor over two chats (a data URL image, then text; text, a ``file://``
    image, text), in a subprocess (it publishes process-wide server args); with the HF
    side's images: ``(probe output, {case: (content, PIL image)})``."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed in this environment")
    first, middle = png(112, 84, seed=1), png(56, 140, seed=2)
    path = tmp_path_factory.mktemp("images") / "image.png"
    path.write_bytes(middle)
    url = "data:image/png;base64," + base64.b64encode(first).decode()
    cases = {
        "data URL": ([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": TEXT}], first),
        "file URL": ([{"type": "text", "text": TEXT}, {"type": "image_url", "image_url": {"url": f"file://{path}"}},
                      {"type": "text", "text": "t9 t10"}], middle),
    }
    env = {"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"),
           "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", PROBE, str(model_dir), json.dumps({k: c for k, (c, _) in cases.items()})],
                          env=env, capture_output=True, text=True, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, f"probe crashed:\n{proc.stderr[-4000:]}"
    assert "More image data items provided" not in proc.stderr, proc.stderr[-2000:]
    images = {k: Image.open(io.BytesIO(data)).convert("RGB") for k, (_, data) in cases.items()}
    return json.loads(line[-1][len("RESULT "):]), {k: (c, images[k]) for k, (c, _) in cases.items()}


@pytest.mark.parametrize("case,image_rows", [("data URL", 12), ("file URL", 10)])
def test_sglang_expands_each_image_as_hf_processor(model_dir, sglang_run, case, image_rows):
    """SGLang's input_ids for the chat equal HF's processor's (12 image tokens for 112x84,
    10 for 56x140), with one image item over exactly the image tokens."""
    from transformers import AutoProcessor

    out, cases = sglang_run
    assert out["processor"] == "QwenVLImageProcessor"
    got = out["cases"][case]
    content, image = cases[case]
    hf_content = [{"type": "image", "image": image} if p["type"] == "image_url" else p for p in content]
    hf = AutoProcessor.from_pretrained(str(model_dir)).apply_chat_template(
        [{"role": "user", "content": hf_content}], add_generation_prompt=True, tokenize=True, return_dict=True)
    want = list(hf["input_ids"][0])
    assert want.count(IMAGE) == image_rows
    assert got["input_ids"] == want, got["prompt"]
    first = want.index(IMAGE)
    assert got["items"] == [["IMAGE", [[first, first + image_rows - 1]]]]
