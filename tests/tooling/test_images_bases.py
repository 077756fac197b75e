"""Prompts with images on every pinned base (issue 40, docs/images.md), with SGLang's own
objects: each ``patches/v*`` series applied to its wheel's sources, then in a subprocess

- a multimodal ``Req`` padded as the scheduler pads it (Qwen2.5-VL's own
  ``pad_input_ids``, the same padding as Kimi-K2.5's on both bases: every image position
  replaced by the image's pad value, a hash outside the vocabulary):
  ``session.dumped_token_ids`` gives the ids with the image token at every image
  position, the ids a file must record (``origin_input_ids_unpadded``);
- the patched ``OpenAIServingChat._handle_non_streaming_request`` (patch 0008), run on a
  stand-in tokenizer manager that yields one finished result: its response carries
  ``kv_transfer_params`` with the file's path, and a failed dump raises.

The wheels come from ``$KIMI_SGLANG_CACHE/wheels`` (downloaded once, sha256-checked);
``network``: skipped only when PyPI cannot be reached and no wheel is cached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import fetch_wheel_or_skip

from sglang_ext.tools.patchtool.series import load_series

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("KIMI_SGLANG_CACHE") or Path.home() / ".cache" / "kimi-sglang")
SERIES_DIRS = sorted(p for p in (REPO / "patches").glob("v*") if (p / "series").is_file())
IMAGE = 151655  # Qwen2.5-VL's <|image_pad|>
PROMPT = [11, 12, 13] + [IMAGE] * 8 + [14, 15]  # an image of 8 vision tokens at [3, 11)
PAD_VALUE = 0x5A5A_1234  # the image's pad value

PROBE = r"""
import asyncio, json, sys, types
from array import array
from sglang.srt.managers.schedule_batch import Req, MultimodalInputs, MultimodalDataItem, Modality
from sglang.srt.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.entrypoints.openai import protocol as p
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang_ext import session
from sglang_ext.responses import HiddenStatesDumpError

prompt, image, pad_value = json.loads(sys.argv[1])
out = {"file": p.__file__}
req = Req("r", "", array("q", prompt), SamplingParams())  # as the scheduler makes it
item = MultimodalDataItem(modality=Modality.IMAGE, offsets=[(3, 10)])  # inclusive end
item.pad_value = pad_value
mm = MultimodalInputs(mm_items=[item], im_token_id=image)
# the model's own padding, as the scheduler calls it (pad_input_ids_func; it uses no self)
padded = Qwen2_5_VLForConditionalGeneration.pad_input_ids(None, req.origin_input_ids, mm)
req.origin_input_ids = array("q", padded)
out["padded"] = list(req.origin_input_ids)
out["dumped"] = list(session.dumped_token_ids(req))

def built(request, ret, created):
    return p.ChatCompletionResponse(
        id="c", model="m", created=created,
        choices=[p.ChatCompletionResponseChoice(
            index=0, message=p.ChatMessage(role="assistant", content="x"), finish_reason="length")],
        usage=p.UsageInfo(prompt_tokens=len(prompt), completion_tokens=1, total_tokens=len(prompt) + 1))

def serving(meta_info):
    async def generate_request(adapted, raw):
        yield {"meta_info": meta_info, "text": "x"}
    return types.SimpleNamespace(tokenizer_manager=types.SimpleNamespace(generate_request=generate_request),
                                 _build_chat_response=built)

handle = OpenAIServingChat._handle_non_streaming_request
r = asyncio.run(handle(serving({"hidden_states_path": "/hs/r.safetensors"}), None, None, None))
out["kv"] = json.loads(r.model_dump_json()).get("kv_transfer_params")
off = asyncio.run(handle(serving({}), None, None, None))
out["off"] = sorted(json.loads(off.model_dump_json()))
try:
    asyncio.run(handle(serving({"hidden_states_error": "disk full"}), None, None, None))
    out["failed"] = None
except HiddenStatesDumpError as e:
    out["failed"] = str(e)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module", params=SERIES_DIRS, ids=lambda p: p.name)
def patched_site(request, tmp_path_factory, monkeypatch_module):
    """The series' wheel sources under a fresh directory, with the series applied."""
    monkeypatch_module.setenv("KIMI_SGLANG_CACHE", str(CACHE))
    base = load_series(request.param).base
    info = fetch_wheel_or_skip(base.version, base, CACHE)
    assert info.pinned, "the wheel used must match base.toml's sha256"
    site = tmp_path_factory.mktemp(f"site-{request.param.name}")
    with zipfile.ZipFile(info.path) as z:
        z.extractall(site, [n for n in z.namelist() if n.startswith("sglang/")])
    proc = subprocess.run([sys.executable, "-m", "sglang_ext", "patches", "apply", "--series",
                           str(request.param), "--target", str(site)],
                          check=False, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return site


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.network
def test_image_ids_and_chat_hook_on_sglangs_objects(patched_site):
    env = {"PYTHONPATH": f"{patched_site}:{REPO}", "PATH": "/usr/bin:/bin",
           "HOME": os.environ.get("HOME", "/tmp")}
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps([PROMPT, IMAGE, PAD_VALUE])],
                          check=False, env=env, capture_output=True, text=True, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, f"probe crashed:\n{proc.stderr[-3000:]}"
    out = json.loads(line[-1][7:])
    assert out["file"].startswith(str(patched_site)), "imported another sglang"
    assert out["padded"] == PROMPT[:3] + [PAD_VALUE] * 8 + PROMPT[11:]  # what the model runs
    assert out["dumped"] == PROMPT  # what the file records: the image token, as HF's processor
    assert out["kv"] == {"hidden_states_path": "/hs/r.safetensors"}
    assert "kv_transfer_params" not in out["off"] and "choices" in out["off"]  # dumping off
    assert out["failed"] == "hidden-state dump failed: disk full"
