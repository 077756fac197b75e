"""The GPU suite's tiny Kimi-K2.5 (testing/tiny_models.py ``build_kimi``) against
SGLang's own code, on the CPU, for every series (its pinned wheel, the series applied):

- config: SGLang's ``ModelConfig`` reads config.json as ``KimiK25Config`` (``text_config``
  a ``DeepseekV3Config``) with the text model's sizes, MLA attention, multimodal;
- start-up's processor step, which SGLang runs for a multimodal model even with
  --skip-tokenizer-init (``TokenizerManager.init_tokenizer_and_processor``, called here
  step by step: importing the tokenizer manager needs fastapi, not in the test venv):
  ``get_processor`` (AutoProcessor through the model directory's remote code) and
  ``get_mm_processor`` (SGLang's ``KimiK2_5VLImageProcessor``);
- weights: ``KimiK25ForConditionalGeneration`` built with its parameters on the CPU, every
  parameter set to NaN, then its own ``load_weights`` over the checkpoint: none is left
  NaN (no parameter unloaded; an unknown vision name raises there); its language model
  equals, parameter by parameter, SGLang's ``DeepseekV3ForCausalLM`` loaded from the
  reference directory (the HF DeepseekV3 the GPU suite's reference runs);
  ``session.find_decoder`` finds that language model and its decoder.

Building on a CPU host takes two stand-ins: ``ServerArgs(device="cuda")``, as the GPU
server resolves it (auto-detection raises without an accelerator; tensors are still
created on the CPU, torch's default device), and a ``vllm._custom_ops`` module (SGLang's
``RotaryEmbedding`` imports vLLM's kernel when CUDA is absent; it holds no weights).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SERIES_DIRS

pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[2]

from testing import tiny_models  # noqa: E402

PROBE = r"""
import inspect, json, math, socket, sys, types
import torch
from safetensors.torch import load_file

kimi_dir, text_dir = sys.argv[1:3]
vllm = types.ModuleType("vllm")
vllm._custom_ops = types.ModuleType("vllm._custom_ops")
vllm._custom_ops.rotary_embedding = None
sys.modules.update({"vllm": vllm, "vllm._custom_ops": vllm._custom_ops})

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.server_args import ServerArgs

out = {}
# the flags the GPU suite serves the model with (testing/server.py)
sa = ServerArgs(model_path=kimi_dir, skip_tokenizer_init=True, trust_remote_code=True, device="cuda")
try:  # 0.5.23: a scheduler process publishes its server args and ranks
    from sglang.srt.runtime_context import SpawnRanks, publish
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
except ImportError:  # 0.5.17
    from sglang.srt.server_args import set_global_server_args_for_scheduler
    set_global_server_args_for_scheduler(sa)

mc = ModelConfig.from_server_args(sa)
text, vision = mc.hf_text_config, mc.hf_config.vision_config
out["config"] = dict(
    cls=type(mc.hf_config).__name__, text_cls=type(text).__name__, vision_cls=type(vision).__name__,
    num_hidden_layers=mc.num_hidden_layers, hidden_size=mc.hidden_size, vocab_size=mc.vocab_size,
    mla=mc.attention_arch.name, multimodal=mc.is_multimodal, dtype=str(mc.dtype),
    text_keys={k: getattr(text, k, None) for k in ("moe_layer_freq", "topk_method", "scoring_func")},
    vision_sizes=[vision.hidden_size, vision.vt_hidden_size, vision.num_hidden_layers],
    media_placeholder_token_id=mc.hf_config.media_placeholder_token_id)

# TokenizerManager.init_tokenizer_and_processor, multimodal branch
from sglang.srt.managers.multimodal_processor import get_mm_processor, import_processors
from sglang.srt.utils.hf_transformers.processor import get_processor
import_processors("sglang.srt.multimodal.processors")
from sglang.srt.runtime_context import get_mm, get_model, get_serving  # the resolved server args
if "image_processor_backend" in inspect.signature(get_processor).parameters:  # 0.5.23
    from sglang.srt.utils.hf_transformers.processor import resolve_image_processor_backend
    image_kw = {"image_processor_backend": resolve_image_processor_backend(get_mm())}
else:  # 0.5.17
    image_kw = {"use_fast": not get_mm().disable_fast_image_processor}
proc = get_processor(get_serving().tokenizer_path, tokenizer_mode=get_serving().tokenizer_mode,
                     trust_remote_code=get_model().trust_remote_code, revision=get_model().revision,
                     tokenizer_backend=get_serving().tokenizer_backend, model_name=get_model().model_path,
                     **image_kw)
mm = get_mm_processor(mc.hf_config, sa, proc, "cuda_ipc", model_config=mc)
out["processor"] = dict(hf=type(proc).__name__, tokenizer=type(proc.tokenizer).__name__, mm=type(mm).__name__,
                        image_token=mm.mm_tokens.image_token, image_token_id=mm.mm_tokens.image_token_id)

from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
from sglang.srt.layers.dp_attention import initialize_dp_attention
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                             distributed_init_method=f"tcp://127.0.0.1:{port}")
if "tensor_model_parallel_size" in inspect.signature(initialize_model_parallel).parameters:
    initialize_model_parallel(1)  # 0.5.17
else:
    initialize_model_parallel()  # 0.5.23: the published widths
kw = {"model_config": mc} if "model_config" in inspect.signature(initialize_dp_attention).parameters else {}
initialize_dp_attention(server_args=sa, **kw)

from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM
from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration
from sglang_ext import session


def loaded(model, path):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(math.nan)
    model.load_weights(iter(load_file(f"{path}/model.safetensors").items()))
    return dict(model.named_parameters())


torch.set_default_dtype(torch.bfloat16)
kimi = KimiK25ForConditionalGeneration(mc.hf_config, quant_config=None)
got = loaded(kimi, kimi_dir)
ref = loaded(DeepseekV3ForCausalLM(ModelConfig(text_dir, trust_remote_code=True).hf_config, quant_config=None),
             text_dir)
lm = {n[len("language_model."):]: p for n, p in got.items() if n.startswith("language_model.")}
lm_found, decoder_found = session.find_decoder(kimi)
out["weights"] = dict(
    params=len(got), unloaded=sorted(n for n, p in got.items() if torch.isnan(p.float()).any()),
    vision=sorted(n for n in got if not n.startswith("language_model.")),
    lm_names_match=sorted(lm) == sorted(ref),
    lm_differ=sorted(n for n in lm if n not in ref or not torch.equal(lm[n], ref[n])),
    find_decoder=[lm_found is kimi.language_model, decoder_found is kimi.language_model.model])
out["file"] = sys.modules[KimiK25ForConditionalGeneration.__module__].__file__
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module", params=SERIES_DIRS, ids=lambda d: d.name)
def probe(request, patched_site, tiny_models_built, tmp_path_factory) -> dict:
    """The probe's findings for this series (config, processor, weights, file)."""
    site = patched_site(request.param)
    kimi = tiny_models_built["kimi"]
    hf_home = tmp_path_factory.mktemp("hf-home")  # transformers copies remote code there
    env = {"PYTHONPATH": f"{site}:{REPO}", "PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"),
           "CUDA_VISIBLE_DEVICES": "", "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", PROBE, kimi.path, kimi.reference_path],
                          env=env, capture_output=True, text=True, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, f"probe crashed:\n{proc.stderr[-4000:]}"
    out = json.loads(line[-1][len("RESULT "):])
    assert out["file"].startswith(str(site)), "imported another sglang"
    return out


@pytest.mark.network
def test_sglang_reads_the_config_as_kimi_k25(probe):
    """SGLang's config class and the sizes the server takes from it (the dump's layer
    count, the file's hidden size) are the text model's; the DeepseekV3 keys SGLang reads
    that transformers no longer writes survive the nesting."""
    c = probe["config"]
    assert (c["cls"], c["text_cls"], c["vision_cls"]) == ("KimiK25Config", "DeepseekV3Config", "KimiK25VisionConfig")
    assert (c["num_hidden_layers"], c["hidden_size"], c["vocab_size"]) == (4, 1024, 1024)
    assert c["mla"] == "MLA" and c["multimodal"] and c["dtype"] == "torch.bfloat16"
    assert c["text_keys"] == {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    assert c["vision_sizes"] == [64, 64, 1]  # the tiny tower, not KimiK25VisionConfig's defaults
    assert c["media_placeholder_token_id"] == 2


@pytest.mark.network
def test_start_up_builds_the_multimodal_processor(probe):
    """With --skip-tokenizer-init the tokenizer manager still builds Kimi's multimodal
    processor: from the model directory's stand-in (--trust-remote-code), wrapped by
    SGLang's own Kimi processor, the placeholder token resolved."""
    p = probe["processor"]
    assert (p["hf"], p["tokenizer"]) == ("TinyKimiK25Processor", "TinyKimiTokenizer")
    assert p["mm"] == "KimiK2_5VLImageProcessor"
    assert (p["image_token"], p["image_token_id"]) == ("<|media_pad|>", 2)


@pytest.mark.network
def test_load_weights_fills_every_parameter_with_the_reference_text_weights(probe):
    """The checkpoint's names are the ones KimiK25ForConditionalGeneration.load_weights
    maps: no parameter left unloaded, the vision tower and projector included; its
    language model holds exactly what SGLang's DeepseekV3 loads from the reference."""
    w = probe["weights"]
    assert w["unloaded"] == [], f"{len(w['unloaded'])} of {w['params']} parameters not loaded: {w['unloaded'][:8]}"
    checkpoint = tiny_models.kimi_vision_shapes(tiny_models.kimi_vision_config(1024))
    assert len(w["vision"]) == len(checkpoint)  # one parameter per tensor, none unloaded
    assert all(n.startswith(("vision_tower.", "mm_projector.")) for n in w["vision"])
    assert "vision_tower.encoder.blocks.0.attn.qkv_proj.weight" in w["vision"]
    assert "mm_projector.linear_2.weight" in w["vision"]
    assert w["lm_names_match"] and w["lm_differ"] == [], w["lm_differ"][:8]
    assert w["find_decoder"] == [True, True]
