"""Patch 0002 in SGLang's real ``DeepseekV2Model.forward``, run on CPU for every series.

Each series is applied to its pinned wheel's sources; a subprocess imports the patched
``sglang.srt.models.deepseek_v2`` from there and calls the real ``DeepseekV2Model.forward``
on an instance whose decoder layers, embedding and norm are stand-ins (the forward body,
the aux-capture packer and, on 0.5.23, the residual-stream helpers are SGLang's own).

A stand-in layer does what SGLang's layers do with ``captured_last_layer_outputs``: it
captures the residual stream entering it, whatever the forward mode (0.5.17:
``layers/communicator.py`` ``prepare_attn`` appends it; 0.5.23:
``layers/layer_boundary/stage.py`` ``_prepare_attention`` calls
``capture_gathered.capture``; neither looks at the mode), then adds ``i + 1`` to the stream. So the stream entering layer ``i`` is
``embedding + i(i+1)/2``, the reference the captured rows are compared with; id N (=
the number of layers) is the stream before the final norm, captured by patch 0002.

An idle forward (``ForwardMode.IDLE``: a DP-attention rank with no work while other
ranks prefill) has no rows but runs the layers and their captures; the packer's
``finalize()`` raises "captured k of n aux hidden states" unless id N is captured too.

The same probe wraps that model in SGLang's own ``KimiK25ForConditionalGeneration`` (the
class Kimi-K2.5 is served with; built without ``__init__``) and asks
``session.find_decoder`` for the LM and decoder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SERIES_DIRS

REPO = Path(__file__).resolve().parents[2]
VOCAB, HIDDEN, LAYERS = 8, 4, 3

PROBE = r"""
import json, sys, types
import torch
import sglang.srt.models.deepseek_v2 as m
from sglang.srt.model_executor.forward_batch_info import ForwardMode

CASES = json.loads(sys.argv[1])  # [[mode, layers_to_capture, rows], ...]
VOCAB, HIDDEN, LAYERS = (int(x) for x in sys.argv[2:5])


class Layer(torch.nn.Module):
    # 0.5.17: layer(positions, hidden, batch, residual, ...) -> (hidden, residual, topk);
    # the stream is hidden + residual. 0.5.23: layer(positions, hidden, batch, ...) ->
    # (hidden, topk); the residual lives in forward_batch.residual_stream, untouched here.
    def __init__(self, i):
        super().__init__()
        self.i = i

    def forward(self, positions, hidden, batch, *args, captured_last_layer_outputs=None, **kw):
        has_residual = len(args) == 4
        residual = args[0] if has_residual else None
        stream = hidden if residual is None else hidden + residual
        if captured_last_layer_outputs is not None:
            # 0.5.17: LayerCommunicator.prepare_attn appends; 0.5.23: capture_gathered.capture
            keep = getattr(captured_last_layer_outputs, "capture", None) or captured_last_layer_outputs.append
            keep(stream.clone())
        if has_residual:
            return torch.full_like(stream, self.i + 1.0), stream, None
        return stream + (self.i + 1), None


class Norm(torch.nn.Module):  # RMSNorm's call forms; the output is not what we compare
    def forward(self, x, residual=None, **kw):
        return -x if residual is None else (-(x + residual), x + residual)


model = m.DeepseekV2Model.__new__(m.DeepseekV2Model)
torch.nn.Module.__init__(model)
model.layers = torch.nn.ModuleList([Layer(i) for i in range(LAYERS)])
model.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
with torch.no_grad():
    model.embed_tokens.weight.copy_(torch.arange(VOCAB * HIDDEN, dtype=torch.float32).view(VOCAB, HIDDEN))
model.norm = Norm()
model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
model.start_layer, model.end_layer = 0, LAYERS
model.use_dsa = False
model.first_k_dense_replace = 0
model.llama_4_scaling_config = None
model.next_full_attention_layer_id = {}
model.dsa_enable_prefill_cp = model.mla_enable_prefill_cp = False
results = []
for mode, layers_to_capture, rows in CASES:
    model.layers_to_capture = layers_to_capture
    batch = types.SimpleNamespace(forward_mode=getattr(ForwardMode, mode), can_run_tbo=False,
                                  residual_stream=None, attn_cp_metadata=None)
    ids = torch.arange(rows) % VOCAB
    try:
        with torch.no_grad():
            result = model.forward(ids, ids, batch)
        hidden, aux = result if isinstance(result, tuple) else (result, None)
        results.append(dict(ok=True, hidden_shape=list(hidden.shape),
                            aux_shape=None if aux is None else list(aux.shape),
                            aux=None if aux is None else aux.tolist()))
    except Exception as e:
        results.append(dict(ok=False, error=f"{type(e).__name__}: {e}"))

# Kimi-K2.5: SGLang's own wrapper class around a DeepseekV3ForCausalLM holding the model
# above, built without __init__ (no vision tower, no weights): what session.find_decoder
# sees in model_runner.model when Kimi-K2.5 is served.
from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration
from sglang_ext import session

lm = m.DeepseekV3ForCausalLM.__new__(m.DeepseekV3ForCausalLM)
torch.nn.Module.__init__(lm)
lm.model = model
lm.capture_aux_hidden_states = False
kimi = KimiK25ForConditionalGeneration.__new__(KimiK25ForConditionalGeneration)
torch.nn.Module.__init__(kimi)
kimi.language_model = lm
found_lm, found_decoder = session.find_decoder(kimi)
kimi_out = dict(lm=type(found_lm).__name__, decoder=type(found_decoder).__name__,
                found_the_language_model=found_lm is lm, found_its_model=found_decoder is model,
                model_alias=kimi.model is lm, kimi_file=sys.modules[KimiK25ForConditionalGeneration.__module__].__file__)
print("RESULT " + json.dumps({"file": m.__file__, "results": results, "kimi": kimi_out}))
"""

CASES = {
    "extend 1,N": ("EXTEND", [1, LAYERS], 3),
    "idle 1,N": ("IDLE", [1, LAYERS], 0),
    "idle 0,2,N": ("IDLE", [0, 2, LAYERS], 0),
    "idle 1,2": ("IDLE", [1, 2], 0),
}


@pytest.fixture(scope="module", params=SERIES_DIRS, ids=lambda d: d.name)
def forwards(request, patched_site) -> dict:
    """Every case of CASES through the series' patched ``DeepseekV2Model.forward``: the
    series' pinned wheel unpacked, the series applied (conftest's ``patched_site``), one
    probe subprocess. Returns case name -> the probe's result dict."""
    site = patched_site(request.param)
    env = {"PYTHONPATH": f"{site}:{REPO}", "PATH": os.environ["PATH"],
           "HOME": os.environ.get("HOME", "/tmp"), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(list(CASES.values())),
         str(VOCAB), str(HIDDEN), str(LAYERS)],
        env=env, capture_output=True, text=True, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, f"probe crashed:\n{proc.stderr[-3000:]}"
    out = json.loads(line[-1][len("RESULT "):])
    assert out["file"].startswith(str(site)), "imported another sglang"
    return {**dict(zip(CASES, out["results"])), "kimi": out["kimi"], "site": str(site)}


def stream_entering(layer: int, token_ids: list[int]) -> list[list[float]]:
    """Reference: embedding row (arange-filled) plus 1 + 2 + ... + layer."""
    return [[float(t * HIDDEN + c + layer * (layer + 1) // 2) for c in range(HIDDEN)]
            for t in token_ids]


@pytest.mark.network
def test_extend_captures_every_id_including_n(forwards):
    out = forwards["extend 1,N"]  # a middle layer and N (= LAYERS), the pre-norm stream
    assert out["ok"], out.get("error")
    assert out["hidden_shape"] == [3, HIDDEN] and out["aux_shape"] == [3, 2 * HIDDEN]
    want = [a + b for a, b in zip(stream_entering(1, [0, 1, 2]), stream_entering(LAYERS, [0, 1, 2]))]
    assert out["aux"] == want


@pytest.mark.network
@pytest.mark.parametrize("case", ["idle 1,N", "idle 0,2,N"])
def test_idle_forward_captures_n_too(forwards, case):
    # The v0.5.23 series up to s2 raised here: "captured 1 of 2 aux hidden states".
    out = forwards[case]
    assert out["ok"], out.get("error")
    n_ids = len(CASES[case][1])
    assert out["hidden_shape"] == [0, HIDDEN] and out["aux_shape"] == [0, n_ids * HIDDEN]


@pytest.mark.network
def test_idle_forward_without_n_is_upstreams(forwards):
    out = forwards["idle 1,2"]
    assert out["ok"], out.get("error")
    assert out["hidden_shape"] == [0, HIDDEN] and out["aux_shape"] == [0, 2 * HIDDEN]


@pytest.mark.network
def test_find_decoder_in_kimi_k25_class(forwards):
    """``KimiK25ForConditionalGeneration`` (sglang/srt/models/kimi_k25.py, both releases)
    holds a ``DeepseekV3ForCausalLM`` in ``language_model`` and aliases ``model`` to it
    (a property); session.find_decoder must reach the LM and its DeepseekV2Model."""
    out = forwards["kimi"]
    assert out["kimi_file"].startswith(forwards["site"])
    assert out["model_alias"]  # the wrapper's own `model` property: the LM, not a decoder
    assert (out["lm"], out["decoder"]) == ("DeepseekV3ForCausalLM", "DeepseekV2Model")
    assert out["found_the_language_model"] and out["found_its_model"]
