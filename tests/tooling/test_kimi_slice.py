"""The Kimi-K2.5 slice (testing/kimi_slice.py) on the CPU, at small dimensions: its INT4
layout is compressed-tensors' own, and its layer-by-layer reference equals HF's whole
``DeepseekV3ForCausalLM`` forward over the same weights (dequantized here by hand, not
by the code under test), so the GPU module may trust it at Kimi's real dimensions."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from testing import kimi_slice  # noqa: E402

SMALL = dict(vocab_size=512, hidden_size=256, intermediate_size=128, moe_intermediate_size=64,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
             qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=16,
             num_experts_per_tok=4, bos_token_id=1, eos_token_id=2)
LAYERS = 3  # one dense, two MoE


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """int32 [out, in/8] -> int8 [out, in]: value i of a word is bits 4i..4i+3, minus 8
    (compressed-tensors' pack-quantized layout, read with numpy alone)."""
    words = packed.astype(np.int64) & 0xFFFFFFFF
    nibbles = [(words >> (4 * i)) & 0xF for i in range(8)]
    return (np.stack(nibbles, axis=-1).reshape(packed.shape[0], -1) - 8).astype(np.int8)


@pytest.fixture(scope="module")
def slice_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi-slice") / "m"
    kimi_slice.build_kimi_slice(str(path), num_layers=LAYERS, device="cpu", **SMALL)
    return path


def dequantized_state(path) -> dict:
    """The checkpoint as HF DeepseekV3ForCausalLM's state dict: names without
    ``language_model.``, experts fused as transformers 5 keeps them (gate_up_proj
    [E, 2I, H], down_proj [E, H, I]), INT4 dequantized with ``unpack_int4``."""
    from safetensors.torch import load_file

    raw = {}
    for shard in sorted(path.glob("model-*.safetensors")):
        raw.update(load_file(str(shard)))
    state, experts = {}, {}
    for name, t in raw.items():
        if not name.startswith(kimi_slice.PREFIX):
            continue  # the vision tower
        name = name[len(kimi_slice.PREFIX):]
        if name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            q = unpack_int4(t.numpy())
            scale = raw[kimi_slice.PREFIX + base + ".weight_scale"].float().numpy()
            w = q.astype(np.float32) * np.repeat(scale, kimi_slice.GROUP, axis=1)
            layer_mlp, e, proj = base.rsplit(".", 2)  # model.layers.i.mlp.experts, e, gate_proj
            experts.setdefault(layer_mlp, {}).setdefault(int(e), {})[proj] = torch.from_numpy(w)
        elif not name.endswith((".weight_scale", ".weight_shape")):
            state[name] = t.float()
    for layer_mlp, by_e in experts.items():
        order = sorted(by_e)
        state[layer_mlp + ".gate_up_proj"] = torch.stack(
            [torch.cat([by_e[e]["gate_proj"], by_e[e]["up_proj"]]) for e in order])
        state[layer_mlp + ".down_proj"] = torch.stack([by_e[e]["down_proj"] for e in order])
    return state


def hf_forward(path, ids, layer_ids, routing=None):
    """HF's whole-model float32 forward: ``output_hidden_states[k]`` for k < N, the final
    norm's input for N (testing/reference.py's convention). ``routing(i, mlp, idx,
    logits)``: called in MoE layer i with HF's chosen experts [T, k] and router logits;
    returns the experts to use (or None to keep HF's), weighted as HF weighs its own."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    text = json.loads((path / "config.json").read_text())["text_config"]
    cfg = DeepseekV3Config(**{k: v for k, v in text.items()
                              if k not in ("quantization_config", "architectures", "model_type")})
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    missing, unexpected = model.load_state_dict(dequantized_state(path), strict=False)
    assert not unexpected and set(missing) <= {"model.rotary_emb.inv_freq"}, (missing, unexpected)
    if routing is not None:
        for i, layer in enumerate(model.model.layers):
            if hasattr(layer.mlp, "route_tokens_to_experts"):  # transformers 5.12
                layer.mlp.route_tokens_to_experts = _forced(i, layer.mlp, routing)
            elif hasattr(layer.mlp, "gate"):  # 5.19: the router returns (logits, weights, experts)
                layer.mlp.gate.forward = _forced_router(i, layer.mlp, routing)
    grabbed = {}
    model.model.norm.register_forward_pre_hook(lambda m, a: grabbed.setdefault("pre", a[0]))
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    n = cfg.num_hidden_layers
    return torch.stack([grabbed["pre"][0] if k == n else out.hidden_states[k][0] for k in layer_ids], dim=1)


def _forced_weights(logits, forced, cfg):
    """DeepseekV3's weights of the experts ``forced``: unbiased sigmoid scores, normalized
    when ``norm_topk_prob``, times ``routed_scaling_factor``."""
    w = logits.sigmoid().gather(1, forced)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) if cfg.norm_topk_prob else w
    return w * cfg.routed_scaling_factor


def _forced(i, mlp, routing):
    """transformers 5.12: ``route_tokens_to_experts(logits) -> (experts, weights)``."""
    choose = mlp.route_tokens_to_experts

    def route(logits):
        idx, w = choose(logits)
        forced = routing(i, mlp, idx, logits)
        return (idx, w) if forced is None else (forced, _forced_weights(logits, forced, mlp.config))

    return route


def _forced_router(i, mlp, routing):
    """transformers 5.19: the router returns ``(logits, weights, experts)``."""
    route = mlp.gate.forward

    def forward(hidden):
        logits, w, idx = route(hidden)
        forced = routing(i, mlp, idx, logits)
        return (logits, w, idx) if forced is None else (logits, _forced_weights(logits, forced, mlp.config), forced)

    return forward


def test_int4_layout_is_compressed_tensors():
    """``unpack_int4`` (this test's reader) undoes compressed-tensors' ``pack_to_int32``,
    so the slice's random words are read as SGLang's loader and Kimi's checkpoints do."""
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    q = torch.randint(-8, 8, (6, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    packed = ct.pack_to_int32(q, 4)
    assert packed.shape == (6, 8) and packed.dtype == torch.int32
    np.testing.assert_array_equal(unpack_int4(packed.numpy()), q.numpy())


def test_checkpoint_names_shapes_and_config(slice_dir):
    index = json.loads((slice_dir / "model.safetensors.index.json").read_text())["weight_map"]
    cfg = json.loads((slice_dir / "config.json").read_text())
    text = cfg["text_config"]
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert text["num_hidden_layers"] == LAYERS and text["first_k_dense_replace"] == 1
    assert cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == kimi_slice.GROUP
    e = SMALL["n_routed_experts"]
    assert sum(name.endswith(".weight_packed") for name in index) == 3 * e * (LAYERS - 1)
    from safetensors import safe_open

    base = "language_model.model.layers.1.mlp.experts.5."
    with safe_open(str(slice_dir / index[base + "down_proj.weight_packed"]), "pt") as f:
        h, inter = SMALL["hidden_size"], SMALL["moe_intermediate_size"]
        assert tuple(f.get_tensor(base + "down_proj.weight_packed").shape) == (h, inter // 8)
        assert tuple(f.get_tensor(base + "down_proj.weight_scale").shape) == (h, inter // kimi_slice.GROUP)
        assert f.get_tensor(base + "down_proj.weight_shape").tolist() == [h, inter]
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in index  # the dense layer, bf16
    assert not any(".layers.0.mlp.experts." in name for name in index)


def test_reference_equals_hf_whole_forward(slice_dir):
    """Layer by layer, chunked attention (16-query chunks against a preallocated cache),
    token chunks of 7, streamed experts == HF's one forward of the whole model, every
    layer id, all rows and a sampled subset."""
    ids = [int(i) for i in np.random.default_rng(0).integers(3, SMALL["vocab_size"], 53)]
    layer_ids = [1, 2, 3]
    want = hf_forward(slice_dir, ids, layer_ids)
    ref = kimi_slice.Reference(str(slice_dir), device="cpu", token_chunk=7,
                               score_bytes=4 * SMALL["num_attention_heads"] * 16 * len(ids))
    got = ref(ids, layer_ids)
    assert got.shape == (len(ids), 3, SMALL["hidden_size"])
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-5, f"layer-by-layer reference differs from HF's forward by {err:.2e}"
    rows = [0, 17, 52]
    torch.testing.assert_close(ref(ids, [3, 1], rows=rows), want[rows][:, [2, 0]], rtol=1e-5, atol=1e-4)
    assert set(ref.near_ties) == {1, 2}  # the MoE layers
    short = ids[:9]
    both = ref.batch([(short, None), (ids, rows)], [2])  # one pass over the layers, two prompts
    torch.testing.assert_close(both[0], ref(short, [2]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both[1], want[rows][:, [1]], rtol=1e-5, atol=1e-4)
    # the sublayers add about a tenth each (the module doc's premise of the tolerances)
    growth = (want[:, 2].norm(dim=-1) / want[:, 0].norm(dim=-1)).mean().item()
    assert 1.0 < growth < 1.6, growth


def test_reference_replays_given_routes(slice_dir):
    """Routing replay: HF's own choices given back change nothing (and disagree nowhere);
    a route that swaps one expert of one token in the first MoE layer gives what HF's
    whole forward gives when forced to the same experts, and is reported as that one
    disagreement; a route of the wrong shape or an expert id out of range is refused."""
    ids = [int(i) for i in np.random.default_rng(1).integers(3, SMALL["vocab_size"], 29)]
    layer_ids = [1, 2, 3]
    k, e = SMALL["num_experts_per_tok"], SMALL["n_routed_experts"]
    chosen = torch.full((len(ids), LAYERS, k), 7, dtype=torch.int32)  # dense layer 0: whatever

    def record(i, mlp, idx, logits):
        chosen[:, i] = idx.to(torch.int32)

    want = hf_forward(slice_dir, ids, layer_ids, routing=record)
    ref = kimi_slice.Reference(str(slice_dir), device="cpu", token_chunk=8)
    torch.testing.assert_close(ref(ids, layer_ids, routes=chosen.numpy()), want, rtol=1e-5, atol=1e-4)
    assert ref.disagreements == {1: [], 2: []}

    pos = 11
    swapped = chosen.clone()
    spare = next(x for x in range(e) if x not in chosen[pos, 1].tolist())
    swapped[pos, 1, 0] = spare
    swapped[:, 2] = -1  # layer 2 routes itself in both forwards (the swap may change its choice)

    def force(i, mlp, idx, logits):
        if i != 1:
            return None
        out = idx.clone()
        out[pos, 0] = spare
        return out

    want_swapped = hf_forward(slice_dir, ids, layer_ids, routing=force)
    got = ref(ids, layer_ids, routes=swapped)
    torch.testing.assert_close(got, want_swapped, rtol=1e-5, atol=1e-4)
    assert (got[pos, 1] - want[pos, 1]).norm() > 1e-3 * want[pos, 1].norm()  # the swap mattered
    assert ref.disagreements == {1: [pos], 2: []}

    # several prompts at once, one without routes, token chunks cutting across prompts:
    # the same rows and disagreements as one prompt at a time
    other = [int(i) for i in np.random.default_rng(2).integers(3, SMALL["vocab_size"], 13)]
    rows = [0, 5, 28]
    both = ref.batch([(other, None), (ids, rows)], layer_ids, routes=[None, swapped.numpy()])
    assert ref.disagreements_of == [{1: [], 2: []}, {1: [pos], 2: []}]
    torch.testing.assert_close(both[0], ref(other, layer_ids), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both[1], want_swapped[rows], rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="shape"):
        ref(ids, layer_ids, routes=chosen[:-1])
    bad = chosen.clone()
    bad[3, 2, 1] = e
    with pytest.raises(ValueError, match="outside"):
        ref(ids, layer_ids, routes=bad)


SGLANG_PROBE = r"""
import glob, json, math, socket, sys, types
import torch
from safetensors import safe_open
from safetensors.torch import load_file

path = sys.argv[1]
vllm = types.ModuleType("vllm")
vllm._custom_ops = types.ModuleType("vllm._custom_ops")
vllm._custom_ops.rotary_embedding = None
sys.modules.update({"vllm": vllm, "vllm._custom_ops": vllm._custom_ops})
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
from sglang.srt.layers.dp_attention import initialize_dp_attention
from sglang.srt.model_loader.loader import _get_quantization_config
from sglang.srt.runtime_context import SpawnRanks, publish
from sglang.srt.server_args import ServerArgs

sa = ServerArgs(model_path=path, skip_tokenizer_init=True, trust_remote_code=True, device="cuda")
publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
mc = ModelConfig.from_server_args(sa)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                             distributed_init_method=f"tcp://127.0.0.1:{port}")
initialize_model_parallel()
initialize_dp_attention(server_args=sa)
qc = _get_quantization_config(mc, LoadConfig())
import sglang.srt.layers.rotary_embedding.rope_variant as rope  # yarn's rope asks for a device
rope.get_device = lambda *a, **k: "cpu"
from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration

torch.set_default_dtype(torch.bfloat16)
kimi = KimiK25ForConditionalGeneration(mc.hf_config, quant_config=qc)
with torch.no_grad():
    for p in kimi.parameters():
        p.fill_(math.nan) if p.dtype.is_floating_point else p.fill_(-12345)
kimi.load_weights(x for f in sorted(glob.glob(f"{path}/model-*.safetensors")) for x in load_file(f).items())
unloaded = [n for n, p in kimi.named_parameters()
            if (p.isnan().any() if p.dtype.is_floating_point else (p == -12345).any())]
experts = kimi.language_model.model.layers[2].mlp.experts
index = json.load(open(f"{path}/model.safetensors.index.json"))["weight_map"]
name = "language_model.model.layers.2.mlp.experts.7.down_proj.weight_packed"
with safe_open(f"{path}/{index[name]}", "pt") as f:
    same = [torch.equal(experts.w2_weight_packed[7], f.get_tensor(name).T),
            torch.equal(experts.w2_weight_scale[7], f.get_tensor(name.replace("packed", "scale")).T)]
print("RESULT " + json.dumps(dict(quant=type(qc).__name__, scheme=type(experts.scheme).__name__,
                                  unloaded=unloaded, same=same)))
"""


def test_sglang_loads_the_slice_as_kimi_int4(slice_dir):
    """SGLang's own config and loader read the slice as Kimi-K2.5's INT4 checkpoint:
    compressed-tensors, the routed experts on its W4A16 MoE scheme (Marlin on a GPU),
    every parameter loaded but the activation-order indices Kimi's checkpoints lack too
    (``*g_idx*``, actorder None), an expert's packed words and scales where the
    checkpoint has them (transposed, as the MoE layer keeps them)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("sglang")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", SGLANG_PROBE, str(slice_dir)], env=env,
                          capture_output=True, text=True, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, f"probe crashed:\n{proc.stderr[-4000:]}"
    out = json.loads(line[-1][len("RESULT "):])
    assert out["quant"] == "CompressedTensorsConfig" and out["scheme"] == "CompressedTensorsWNA16MoE", out
    assert out["unloaded"] and all("g_idx" in n for n in out["unloaded"]), out["unloaded"]
    assert out["same"] == [True, True]


def _gpu_module(monkeypatch, keep, layers):
    """tests/gpu/test_gpu_kimi_slice.py, imported from its file, with its reference phase
    pointed at the CPU, ``keep`` and a slice of ``layers`` layers."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "gpu" / "test_gpu_kimi_slice.py"
    spec = importlib.util.spec_from_file_location("gpu_kimi_slice_on_cpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name, value in (("KEEP", str(keep)), ("LAYERS", layers), ("LAYER_IDS", list(range(1, layers + 1))),
                        ("REF_DEVICE", "cpu"), ("GROUP_TOKENS", 48)):
        monkeypatch.setattr(mod, name, value)
    monkeypatch.setattr(mod.Serving, "stop", classmethod(lambda cls: None))  # no server here
    return mod


def test_gpu_modules_reference_phase_runs_on_the_cpu(slice_dir, tmp_path, monkeypatch):
    """The GPU module's reference phase (``test_files_match_reference``: kept files, their
    routes, grouping, the replay, the checks) run on the CPU against the small slice, so its
    glue fails here, not in a GPU session. Files as the server writes them (the float32
    rows, replaying HF's own experts, stored in bf16; one of sampled rows) with the routes
    SGLang returns (int32 [T, N, k], dense layer zeros): passes. One row scaled by 1.2:
    fails naming that file. Routes in another numbering (ids + 1): fails on the share of
    positions whose experts differ."""
    from safetensors.torch import save_file

    from sglang_ext import format as fmt
    from sglang_ext import quant

    keep = tmp_path / "kept"
    keep.mkdir()
    mod = _gpu_module(monkeypatch, keep, LAYERS)
    k, e = SMALL["num_experts_per_tok"], SMALL["n_routed_experts"]
    rng = np.random.default_rng(5)
    ref = kimi_slice.Reference(str(slice_dir), device="cpu")
    prompts = {"bf16-mixed-0": (17, None), "bf16-mixed-1": (31, None), "bf16-long-50": (50, [0, 7, 48, 49]),
               "store-fp8-mixed-2": (13, None)}
    saved = {}
    for tag, (n, rows) in prompts.items():
        ids = [int(i) for i in rng.integers(3, SMALL["vocab_size"], n)]
        routes = torch.zeros((n, LAYERS, k), dtype=torch.int32)

        def record(i, mlp, idx, logits, routes=routes):
            routes[:, i] = idx.to(torch.int32)

        hf_forward(slice_dir, ids, [LAYERS], routing=record)
        hidden = ref(ids, list(range(1, LAYERS + 1)), routes=routes).to(torch.bfloat16)
        if tag.startswith("store-"):  # a store sample as get_generated returns it: fp8, scales [T, L, 1]
            q, scales = quant.quantize_fp8(hidden.reshape(n, -1), LAYERS)
            save_file({"hidden_states": q.view(n, LAYERS, -1), "hidden_states_scales": scales[..., None],
                       "token_ids": torch.tensor(ids, dtype=torch.int64)}, str(keep / f"{tag}.safetensors"))
        else:
            save_file({fmt.KEY_HIDDEN_STATES: hidden, fmt.KEY_TOKEN_IDS: torch.tensor(ids, dtype=torch.int64)},
                      str(keep / f"{tag}.safetensors"),
                      metadata=fmt.build_metadata(rid=tag, layer_ids=range(1, LAYERS + 1), num_layers=LAYERS))
        np.save(keep / f"{tag}.routes.npy", routes.numpy())
        (keep / f"{tag}.json").write_text(json.dumps({"ids": ids, "rows": rows}))
        saved[tag] = (hidden, routes)

    props = {}
    mod.test_files_match_reference(str(slice_dir), lambda key, value: props.__setitem__(key, value))
    assert set(props["errors"]) == set(prompts)
    assert all(r["experts_differ_share"] == 0 and r["block"] < 1e-2 for k, r in props["errors"].items()
               if not k.startswith("store-fp8")), props["errors"]
    assert 1e-4 < props["errors"]["store-fp8-mixed-2"]["block"] < 2 ** -4  # fp8's rounding, within its bound
    assert len(props["reference_groups_tokens_peak_gib"]) == 3  # 13 + 17 tokens, then 31, then 50 (GROUP_TOKENS 48)

    hidden, routes = saved["bf16-mixed-1"]
    bad = hidden.clone()
    bad[9, 1] *= 1.2
    save_file({fmt.KEY_HIDDEN_STATES: bad, fmt.KEY_TOKEN_IDS: torch.tensor(
        json.loads((keep / "bf16-mixed-1.json").read_text())["ids"], dtype=torch.int64)},
        str(keep / "bf16-mixed-1.safetensors"),
        metadata=fmt.build_metadata(rid="bf16-mixed-1", layer_ids=range(1, LAYERS + 1), num_layers=LAYERS))
    with pytest.raises(AssertionError, match="bf16-mixed-1: the row at position 9, layer id 2"):
        mod.test_files_match_reference(str(slice_dir), lambda key, value: None)

    shifted = routes.clone()
    shifted[:, 1:] = (shifted[:, 1:] + 1) % e
    np.save(keep / "bf16-mixed-1.routes.npy", shifted.numpy())
    with pytest.raises(AssertionError, match="bf16-mixed-1: SGLang's experts differ from float32's at"):
        mod.test_files_match_reference(str(slice_dir), lambda key, value: None)


def test_the_gpu_stacks_transformers_is_the_one_tested():
    """requirements/gpu-transformers.txt (tests/run.sh runs this file again with it) pins the
    transformers tests/gpu/stage-stack.sh stages on the device; in that run
    (``KIMI_SGLANG_EXPECT_TRANSFORMERS``) it is the one imported."""
    import os
    import re
    from pathlib import Path

    import transformers

    root = Path(__file__).resolve().parents[2]
    staged = re.findall(r"\btransformers==([0-9][^\s\\]*)", (root / "tests/gpu/stage-stack.sh").read_text())
    pinned = re.findall(r"^transformers==(\S+)$", (root / "requirements/gpu-transformers.txt").read_text(), re.M)
    assert staged and staged == pinned, (staged, pinned)
    expected = os.environ.get("KIMI_SGLANG_EXPECT_TRANSFORMERS")
    if expected:
        assert transformers.__version__ == expected


def test_ensure_built_builds_once_per_layer_count(tmp_path):
    """``ensure_built`` (the GPU module's fixture, kimi_slice_prep.sh): built and marked at
    the first call, reused at the second, rebuilt for another layer count; a directory
    without the marker (a build cut short) is built again."""
    path = str(tmp_path / "s")
    assert kimi_slice.ensure_built(path, 2, device="cpu", **SMALL)
    assert (tmp_path / "s" / kimi_slice.COMPLETE).read_text() == "2"
    assert not kimi_slice.ensure_built(path, 2, device="cpu", **SMALL)
    assert kimi_slice.ensure_built(path, 3, device="cpu", **SMALL)
    assert json.loads((tmp_path / "s" / "config.json").read_text())["text_config"]["num_hidden_layers"] == 3
    (tmp_path / "s" / kimi_slice.COMPLETE).unlink()
    assert kimi_slice.ensure_built(path, 3, device="cpu", **SMALL)
