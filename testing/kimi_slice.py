"""A slice of Kimi-K2.5 at its real dimensions, with random weights in its own INT4 format,
and the float32 reference forward that reads the same checkpoint (issue 48).

The model: ``KimiK25ForConditionalGeneration`` (the class Kimi-K2.5 is served with), its
language model a DeepseekV3 with Kimi-K2.5's published text dimensions (``KIMI_K25_TEXT``:
hidden 7168, MLA with 64 heads, q_lora_rank 1536, kv_lora_rank 512, qk_rope/nope 64/128,
v_head 128, 384 routed experts of intermediate 2048, 8 per token, 1 shared, the first
layer dense with intermediate 18432, vocab 163840, yarn rope x64 to 262144 positions) cut
to ``num_layers`` decoder layers, plus the one-block vision tower of the tiny ``kimi``
model (``tiny_models.kimi_vision_config``: SGLang builds the tower even for text prompts).

Weights are Kimi-K2.5's own format, compressed-tensors ``pack-quantized`` INT4: the routed
experts' ``weight_packed`` (int32, 8 signed 4-bit values per word, value + 8 stored low
nibble first, as ``compressed_tensors.pack_to_int32``), ``weight_scale`` (bf16, one per 32
inputs, symmetric: w = q * scale) and ``weight_shape``; everything else bf16, the router's
``e_score_correction_bias`` float32 (``KIMI_K25_QUANT``'s ``ignore`` list is Kimi's).
SGLang 0.5.23 serves this on Hopper through its Marlin W4A16 MoE
(``CompressedTensorsWNA16MoE``): activations stay bf16, so the reference needs no
activation quantization to follow it.

The weights' scale is chosen so that the residual stream is dominated by the token
embedding (bf16 values, exact in both forwards) and each sublayer adds about a tenth of it:
a dumped row then differs from a neighbour's or from the next layer's by far more than the
suite's tolerance, while the few top-8 routing choices that bf16 may flip against float32
(near-ties among 384 sigmoid scores) move a row by little. ``Reference.near_ties`` reports
them.

The reference (``Reference``): HF transformers' DeepseekV3 modules in float32 (attention,
RMSNorm, router, shared expert, dense MLP, yarn rope), run layer by layer over the whole
prompt so that a 128k-token prompt fits one GPU: attention in query chunks against the
layer's full key/value cache, per-token parts in token chunks, and the routed experts
dequantized one at a time from the checkpoint with ``compressed_tensors.unpack_from_int32``
(``StreamedExperts``, the signature of HF's ``DeepseekV3NaiveMoe``). On a small config it
equals HF's whole ``DeepseekV3ForCausalLM`` forward over the dequantized weights
(tests/tooling/test_kimi_slice.py), which is what makes it a reference.
"""

from __future__ import annotations

import json
import math
import os
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

# Kimi-K2.5's language model (config.json's text_config as published), less the layer count.
KIMI_K25_TEXT = dict(
    vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512,
    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=384,
    num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
    routed_scaling_factor=2.827, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
    moe_layer_freq=1, rms_norm_eps=1e-5, max_position_embeddings=262144, rope_theta=50000.0,
    rope_scaling={"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                  "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    hidden_act="silu", attention_bias=False, tie_word_embeddings=False,
    bos_token_id=163584, eos_token_id=163585,
)

GROUP = 32  # inputs per INT4 scale (Kimi-K2.5's group_size)

# Kimi-K2.5's quantization_config: INT4 routed experts, the rest bf16.
KIMI_K25_QUANT = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": GROUP, "dynamic": False, "actorder": None, "observer": "minmax",
                    "observer_kwargs": {}, "block_structure": None}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
}

# Sublayer output gains (see the module doc): each adds about a tenth of the residual.
ATTN_GAIN, MLP_GAIN = 0.5, 0.15
PREFIX = "language_model."  # names as real Kimi-K2.5 checkpoints spell them


def text_config(num_layers: int, **overrides) -> dict:
    """Kimi-K2.5's text config cut to ``num_layers`` decoder layers (``overrides``: the CPU
    test's small dimensions)."""
    cfg = dict(KIMI_K25_TEXT, num_hidden_layers=num_layers)
    cfg.update(overrides)
    return cfg


def _layer_shapes(cfg: dict, i: int) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """Checkpoint name (under ``model.layers.i.``) -> (shape, kind) of decoder layer ``i``;
    kind: "norm", "linear" (bf16, std 1/sqrt(fan_in)), "out" (a residual branch's last
    linear: that std times the branch's gain), "router", "bias", or "int4"/"int4_out"
    (an expert's projection, stored packed)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    s = {"input_layernorm.weight": ((h,), "norm"), "post_attention_layernorm.weight": ((h,), "norm"),
         "self_attn.q_a_proj.weight": ((cfg["q_lora_rank"], h), "linear"),
         "self_attn.q_a_layernorm.weight": ((cfg["q_lora_rank"],), "norm"),
         "self_attn.q_b_proj.weight": ((heads * qk, cfg["q_lora_rank"]), "linear"),
         "self_attn.kv_a_proj_with_mqa.weight": ((cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], h), "linear"),
         "self_attn.kv_a_layernorm.weight": ((cfg["kv_lora_rank"],), "norm"),
         "self_attn.kv_b_proj.weight": ((heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"]),
                                        "linear"),
         "self_attn.o_proj.weight": ((h, heads * cfg["v_head_dim"]), "attn_out")}
    if i < cfg["first_k_dense_replace"]:
        inter = cfg["intermediate_size"]
        s.update({"mlp.gate_proj.weight": ((inter, h), "linear"), "mlp.up_proj.weight": ((inter, h), "linear"),
                  "mlp.down_proj.weight": ((h, inter), "out")})
        return s
    inter, e = cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    shared = inter * cfg["n_shared_experts"]
    s.update({"mlp.gate.weight": ((e, h), "linear"), "mlp.gate.e_score_correction_bias": ((e,), "bias"),
              "mlp.shared_experts.gate_proj.weight": ((shared, h), "linear"),
              "mlp.shared_experts.up_proj.weight": ((shared, h), "linear"),
              "mlp.shared_experts.down_proj.weight": ((h, shared), "out")})
    for j in range(e):
        for name, shape, kind in (("gate_proj", (inter, h), "int4"), ("up_proj", (inter, h), "int4"),
                                  ("down_proj", (h, inter), "int4_out")):
            s[f"mlp.experts.{j}.{name}"] = (shape, kind)
    return s


def _random(shape, kind: str, gen, device):
    """One tensor (or, for "int4" kinds, the packed/scale/shape triple) of ``kind``."""

    fan_in = shape[-1] if len(shape) > 1 else 1
    if kind == "norm":
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    if kind == "bias":
        return 0.05 * torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    gain = {"linear": 1.0, "attn_out": ATTN_GAIN, "out": MLP_GAIN, "int4": 1.0, "int4_out": MLP_GAIN}[kind]
    std = gain / math.sqrt(fan_in)
    if kind in ("int4", "int4_out"):
        out, inp = shape
        packed = torch.randint(-2 ** 31, 2 ** 31 - 1, (out, inp // 8), generator=gen, device=device,
                               dtype=torch.int32)
        # uniform 4-bit values -8..7 have rms sqrt(21.5); scales jitter x0.5-1.5 per group
        jitter = 0.5 + torch.rand((out, inp // GROUP), generator=gen, device=device)
        scale = (std / math.sqrt(21.5) * jitter).to(torch.bfloat16)
        return packed, scale, torch.tensor([out, inp], dtype=torch.int32)
    return (std * torch.randn(shape, generator=gen, device=device)).to(torch.bfloat16)


def _layer_tensors(cfg: dict, i: int, gen, device) -> Dict[str, "object"]:
    out = {}
    base = f"{PREFIX}model.layers.{i}."
    for name, (shape, kind) in _layer_shapes(cfg, i).items():
        t = _random(shape, kind, gen, device)
        if isinstance(t, tuple):
            out[base + name + ".weight_packed"], out[base + name + ".weight_scale"], \
                out[base + name + ".weight_shape"] = t
        else:
            out[base + name] = t
    return out


def build_kimi_slice(path: str, num_layers: int = 4, device: str = "cuda", seed: int = 0,
                     **overrides) -> int:
    """Write the slice into ``path``: config.json (``KimiK25Config``: ``text_config`` =
    ``text_config(num_layers, **overrides)`` with ``KIMI_K25_QUANT``; the tiny ``kimi``
    model's vision tower), one safetensors shard per decoder layer plus one for the
    embeddings, final norm, lm_head and vision tower, model.safetensors.index.json, and
    the processor stand-in SGLang builds at start-up (``tiny_models.build_kimi``'s).
    Tensors are drawn on ``device`` (a CUDA GPU draws 4 layers' ~40 GB in seconds) from
    ``torch.Generator(device).manual_seed(seed + layer)``; returns ``num_layers``.

    Sizes at Kimi-K2.5's dimensions: 9.5 GB per MoE layer (8.5 GB of INT4 experts), 1.0 GB
    for the dense layer, 4.7 GB for the embeddings and lm_head."""
    from safetensors.torch import save_file

    from testing.tiny_models import kimi_vision_config, kimi_vision_shapes, write_kimi_k25_config

    cfg = text_config(num_layers, **overrides)
    os.makedirs(path, exist_ok=True)
    weight_map: Dict[str, str] = {}
    total = 0

    def save(tensors: dict, shard: str) -> None:
        nonlocal total
        cpu = {k: v.contiguous().cpu() for k, v in tensors.items()}
        save_file(cpu, os.path.join(path, shard), metadata={"format": "pt"})
        for k, v in cpu.items():
            weight_map[k] = shard
            total += v.numel() * v.element_size()

    for i in range(num_layers):
        gen = torch.Generator(device).manual_seed(seed + 1 + i)
        save(_layer_tensors(cfg, i, gen, device), f"model-layer-{i:02d}.safetensors")
        if device != "cpu":
            torch.cuda.empty_cache()
    gen = torch.Generator(device).manual_seed(seed)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    vision = kimi_vision_config(h)
    rest = {f"{PREFIX}model.embed_tokens.weight": torch.randn((vocab, h), generator=gen, device=device)
            .to(torch.bfloat16),
            f"{PREFIX}model.norm.weight": torch.ones(h, dtype=torch.bfloat16, device=device),
            f"{PREFIX}lm_head.weight": (torch.randn((vocab, h), generator=gen, device=device) / math.sqrt(h))
            .to(torch.bfloat16)}
    rest.update({k: (0.02 * torch.randn(s, generator=gen, device=device)).to(torch.bfloat16)
                 for k, s in kimi_vision_shapes(vision).items()})
    save(rest, "model-rest.safetensors")
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    text = dict(cfg, architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2", dtype="bfloat16",
                quantization_config=KIMI_K25_QUANT)
    write_kimi_k25_config(path, text, vision, media_placeholder=163605, pad_token_id=163839,
                          quantization_config=KIMI_K25_QUANT)
    return num_layers


COMPLETE = ".complete"  # written last by ensure_built: the slice's layer count


def ensure_built(path: str, num_layers: int = 4, device: str = "cuda", **overrides) -> bool:
    """The slice of ``num_layers`` layers at ``path``, built once per machine: returns False
    when ``path``'s ``COMPLETE`` marker already names ``num_layers``, else removes ``path``,
    builds it (``build_kimi_slice``, given ``overrides``), writes the marker last and
    returns True (the GPU module's fixture and tests/gpu/kimi_slice_prep.sh share it)."""
    import shutil
    import time

    marker = os.path.join(path, COMPLETE)
    if os.path.exists(marker) and open(marker).read() == str(num_layers):
        return False
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.monotonic()
    build_kimi_slice(path, num_layers=num_layers, device=device, **overrides)
    if device != "cpu":
        torch.cuda.empty_cache()
    with open(marker, "w") as f:
        f.write(str(num_layers))
    print(f"slice of {num_layers} layers built in {time.monotonic() - t0:.0f} s", flush=True)
    return True


# --------------------------------------------------------------------------- reference


class Checkpoint:
    """Reads the slice's shards by name onto ``device`` (``safetensors.safe_open``, one
    handle per shard)."""

    def __init__(self, path: str, device: str):
        from safetensors import safe_open

        self.device = device
        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            self.weight_map = json.load(f)["weight_map"]
        self._files = {shard: safe_open(os.path.join(path, shard), framework="pt", device="cpu")
                       for shard in sorted(set(self.weight_map.values()))}

    def get(self, name: str):
        return self._files[self.weight_map[name]].get_tensor(name).to(self.device)

    def packed(self, base: str):
        """(weight_packed int32 [out, in/8], weight_scale bf16 [out, in/32], shape) of the
        INT4 projection ``base``, on the device."""
        shape = tuple(int(x) for x in self.get(base + ".weight_shape").tolist())
        return self.get(base + ".weight_packed"), self.get(base + ".weight_scale"), shape

    @staticmethod
    def dequantize(packed, scale, shape):
        """float32 [out, in] = q * scale, q the signed 4-bit values
        (``compressed_tensors.unpack_from_int32``), one scale per GROUP inputs."""
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        q = unpack_from_int32(packed, 4, torch.Size(shape))  # int8 [out, in]
        return q.float() * scale.float().repeat_interleave(GROUP, dim=1)


class StreamedExperts(torch.nn.Module):
    """HF ``DeepseekV3NaiveMoe``'s forward (hidden [T, H], top_k_index [T, k], top_k_weights
    [T, k]) -> [T, H] for decoder layer ``layer``: the layer's packed experts (8.5 GB at
    Kimi's size) are read onto the device once, and each expert is dequantized to float32
    when its tokens are computed, then dropped (384 float32 experts are 67 GB a layer)."""

    def __init__(self, ckpt: Checkpoint, layer: int, num_experts: int, act_fn):
        super().__init__()
        self.ckpt, self.act_fn = ckpt, act_fn
        base = f"{PREFIX}model.layers.{layer}.mlp.experts."
        self.packed = {(e, n): ckpt.packed(f"{base}{e}.{n}")
                       for e in range(num_experts) for n in ("gate_proj", "up_proj", "down_proj")}

    def forward(self, hidden_states, top_k_index, top_k_weights):
        import torch.nn.functional as F

        out = torch.zeros_like(hidden_states)
        w = {}
        for e in torch.unique(top_k_index).tolist():
            token, slot = torch.where(top_k_index == e)
            for n in ("gate_proj", "up_proj", "down_proj"):
                w[n] = self.ckpt.dequantize(*self.packed[(e, n)])
            x = hidden_states[token]
            y = F.linear(self.act_fn(F.linear(x, w["gate_proj"])) * F.linear(x, w["up_proj"]), w["down_proj"])
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out


class _LayerCache:
    """The one-layer key/value cache HF's attention updates (``update(k, v, layer_idx)``
    -> all keys and values so far): preallocated for ``total`` positions, so a long
    prompt's chunks append in place instead of re-concatenating the whole cache."""

    def __init__(self, total: int):
        self.total, self.k, self.v, self.pos = total, None, None, 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):

        if self.k is None:
            b, h, _, dk = key_states.shape
            self.k = torch.empty((b, h, self.total, dk), dtype=key_states.dtype, device=key_states.device)
            self.v = torch.empty((b, h, self.total, value_states.shape[-1]), dtype=value_states.dtype,
                                 device=value_states.device)
        n = key_states.shape[2]
        self.k[:, :, self.pos:self.pos + n] = key_states
        self.v[:, :, self.pos:self.pos + n] = value_states
        self.pos += n
        return self.k[:, :, :self.pos], self.v[:, :, :self.pos]


class Reference:
    """Float32 forward of the slice: ``ref(ids, layer_ids, rows=None) -> [R, L, H]`` float32
    CPU tensor (R = len(rows), or every position); layer id k < N is the residual stream
    entering decoder layer k, id N the input of the final norm (as
    ``testing.reference.Reference``).

    ``path``: the slice (``build_kimi_slice``); ``token_chunk``: tokens per call of the
    per-token parts (norms, MLP, MoE); ``score_bytes``: the most bytes of one attention
    call's float32 scores (heads x query chunk x keys so far), which sizes the query
    chunk. ``near_ties`` after a call: per MoE layer, the token positions whose 8th and
    9th routing scores (sigmoid + bias, float32) differ by less than ``tie_margin``.

    Routing replay (``routes``): with random weights a third of the tokens have a near-tie
    (``tie_margin``) among 384 experts, where a bf16 server can pick another expert than
    float32 does, which would move that row far (the first H100 run: a row off by 5.15
    relative, 100x the suite's row tolerance) in every later layer.
    Given the experts a server chose (SGLang's ``return_routed_experts``: int32 [T,
    num_layers, k] per prompt), each MoE layer uses those experts instead of its own top-k,
    with weights computed here as HF's ``route_tokens_to_experts`` computes them (float32
    sigmoid scores of the chosen experts, normalized, times ``routed_scaling_factor``):
    what stays compared is the arithmetic, not a coin toss. ``disagreements`` after a
    call: per MoE layer, the positions where the given experts are not the set this
    forward would have chosen."""

    def __init__(self, path: str, device: str = "cuda", token_chunk: int = 32768,
                 score_bytes: float = 2e9, tie_margin: float = 1e-3):
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

        with open(os.path.join(path, "config.json")) as f:
            text = json.load(f)["text_config"]
        keep = {k: v for k, v in text.items() if k not in ("quantization_config", "architectures", "model_type")}
        self.config = DeepseekV3Config(**keep)
        self.config._attn_implementation = "sdpa"
        self.hf, self.device = hf, device
        self.ckpt = Checkpoint(path, device)
        self.num_layers = self.config.num_hidden_layers
        self.token_chunk, self.score_bytes, self.tie_margin = token_chunk, score_bytes, tie_margin
        self.near_ties: Dict[int, List[int]] = {}
        self.disagreements: Dict[int, List[int]] = {}
        self.rotary = hf.DeepseekV3RotaryEmbedding(self.config).to(device)
        with torch.device("meta"):
            norm = hf.DeepseekV3RMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
        self.norm = self._load(norm, f"{PREFIX}model.norm.")

    def _load(self, module, prefix: str, skip: Sequence[str] = ()):
        """``module`` (built on the meta device) with its parameters from the checkpoint,
        float32 on the device (parameters and buffers such as the router's
        ``e_score_correction_bias``); names under ``skip`` stay unloaded (the routed
        experts); any other name the checkpoint lacks raises KeyError."""
        names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
        state = {n: self.ckpt.get(prefix + n).float() for n in names
                 if not any(n.startswith(s) for s in skip) and prefix + n in self.ckpt.weight_map}
        module = module.to_empty(device=self.device)
        missing, unexpected = module.load_state_dict(state, strict=False)
        missing = [n for n in missing if not any(n.startswith(s) for s in skip)]
        if missing or unexpected:  # a name the checkpoint lacks would stay uninitialized memory
            raise KeyError(f"{prefix}: not in the checkpoint: {missing}; unexpected: {unexpected}")
        return module.eval()

    def _layer(self, i: int):

        with torch.device("meta"):
            layer = self.hf.DeepseekV3DecoderLayer(self.config, i)
        moe = isinstance(layer.mlp, self.hf.DeepseekV3MoE)
        layer = self._load(layer, f"{PREFIX}model.layers.{i}.", skip=("mlp.experts.",) if moe else ())
        if moe:
            layer.mlp.experts = StreamedExperts(self.ckpt, i, self.config.n_routed_experts,
                                                layer.mlp.experts.act_fn)
        return layer, moe

    @staticmethod
    def _chunks(n: int, size: int) -> Iterator[slice]:
        for s in range(0, n, size):
            yield slice(s, min(n, s + size))

    def _attention(self, layer, x, position_embeddings):
        """``layer.self_attn`` over x [1, T, H] (already normed): queries in chunks, each
        against every key so far (a causal mask per chunk)."""

        t = x.shape[1]
        cache = _LayerCache(t)
        out = torch.empty_like(x)
        cos, sin = position_embeddings
        q_chunk = max(16, min(4096, int(self.score_bytes // (4 * self.config.num_attention_heads * t))))
        for sl in self._chunks(t, q_chunk):
            q_pos = torch.arange(sl.start, sl.stop, device=x.device)
            k_pos = torch.arange(0, sl.stop, device=x.device)
            mask = (k_pos[None, :] <= q_pos[:, None])[None, None]  # [1, 1, C, stop], True = attend
            out[:, sl], _ = layer.self_attn(x[:, sl], position_embeddings=(cos[:, sl], sin[:, sl]),
                                            attention_mask=mask, past_key_values=cache)
        return out

    def _ties(self, layer, h) -> List[int]:
        """Positions of ``h`` [T, H] (the MoE's input) whose top-k choice is within
        ``tie_margin`` of the next expert's score."""

        logits = layer.mlp.gate(h)
        logits = logits[0] if isinstance(logits, tuple) else logits  # transformers >= 5.19: (logits, ...)
        scores = torch.sigmoid(logits.float()) + layer.mlp.gate.e_score_correction_bias
        top = scores.topk(self.config.num_experts_per_tok + 1, dim=-1).values
        return torch.nonzero(top[:, -2] - top[:, -1] < self.tie_margin).flatten().tolist()

    def _moe(self, mlp, h, given):
        """HF's ``DeepseekV3MoE`` forward over ``h`` [1, C, H], its parts called one by one
        so the experts can be replayed: returns (output [1, C, H], HF's own experts [C, k]).
        ``given`` [C, k] (None, or -1 rows: HF's own): the experts to use instead, weighted
        as HF weighs its own (float32 sigmoid scores of those experts, normalized when
        ``norm_topk_prob``, times ``routed_scaling_factor``: DeepseekV3's routing).
        transformers 5.12 routes in ``mlp.route_tokens_to_experts(gate logits)``; 5.19's
        router returns ``(logits, weights, experts)`` itself."""
        flat = h.view(-1, h.shape[-1])
        routed = mlp.gate(flat)
        if isinstance(routed, tuple) and len(routed) == 3:
            logits, w, idx = routed
        else:
            logits = routed[0] if isinstance(routed, tuple) else routed
            idx, w = mlp.route_tokens_to_experts(logits)
        own = idx
        if given is not None:
            g = given.to(idx.device, torch.long)
            use = g[:, :1] >= 0
            gw = logits.float().sigmoid().gather(1, g.clamp_min(0))
            if self.config.norm_topk_prob:
                gw = gw / (gw.sum(dim=-1, keepdim=True) + 1e-20)
            gw = gw * self.config.routed_scaling_factor
            idx, w = torch.where(use, g, idx), torch.where(use, gw.to(w.dtype), w)
        out = mlp.experts(flat, idx, w).view(*h.shape) + mlp.shared_experts(h)
        return out, own

    def __call__(self, ids: Sequence[int], layer_ids: Sequence[int], rows: Optional[Sequence[int]] = None,
                 routes=None):
        out = self.batch([(ids, rows)], layer_ids, routes=None if routes is None else [routes])
        self.near_ties, self.disagreements = self.near_ties_of[0], self.disagreements_of[0]
        return out[0]

    def batch(self, prompts: Sequence[Tuple[Sequence[int], Optional[Sequence[int]]]],
              layer_ids: Sequence[int], routes=None) -> List[torch.Tensor]:
        """``[ref(ids, layer_ids, rows) for ids, rows in prompts]``, each decoder layer read
        from the checkpoint once for all of them: the prompts' residual streams stay on the
        device side by side (sum of T x H float32), attention runs per prompt, the per-token
        parts over all of them at once (each routed expert dequantized once per token
        chunk, not once per prompt). ``routes``: None, or per prompt None or the experts
        a server chose ([T, num_layers, k] integers, ids 0..n_routed_experts-1, or a
        row of -1 where that position routes itself; rows of dense layers ignored),
        replayed as the class doc says. ``near_ties_of[j]`` and
        ``disagreements_of[j]``: prompt j's ``near_ties`` and ``disagreements``.

        Raises ValueError for a layer id outside 0..N or a route of the wrong shape or
        range."""
        n = self.num_layers
        if any(k < 0 or k > n for k in layer_ids):
            raise ValueError(f"layer ids {list(layer_ids)}: the slice has {n} layers (ids 0..{n})")
        lengths = [len(ids) for ids, _ in prompts]
        given = None
        if routes is not None:
            k, e = self.config.num_experts_per_tok, self.config.n_routed_experts
            parts = []
            for j, (r, t) in enumerate(zip(routes, lengths)):
                if r is None:
                    parts.append(torch.full((t, n, k), -1, dtype=torch.long))
                    continue
                r = torch.as_tensor(r).long()
                if tuple(r.shape) != (t, n, k):
                    raise ValueError(f"prompt {j}: routes of shape {tuple(r.shape)}, expected {(t, n, k)}")
                moe = r[:, self.config.first_k_dense_replace:]
                own = (moe == -1).all(dim=-1, keepdim=True)  # a row of -1: that position routes itself
                if ((moe < 0) | (moe >= e))[~own.expand_as(moe)].any():
                    raise ValueError(f"prompt {j}: routed expert ids outside 0..{e - 1} (or a row of -1)")
                parts.append(r)
            given = torch.cat(parts).to(self.device)  # [sum T, N, k]
        starts = [sum(lengths[:j]) for j in range(len(prompts))]
        embed = self.ckpt.get(f"{PREFIX}model.embed_tokens.weight")
        every = torch.tensor([t for ids, _ in prompts for t in ids], device=self.device)
        x = embed[every].float()[None]  # [1, sum T, H]
        del embed, every
        picks = [torch.tensor(list(rows) if rows is not None else range(t), device=self.device) + o
                 for (_, rows), t, o in zip(prompts, lengths, starts)]
        taken: List[Dict[int, torch.Tensor]] = [{} for _ in prompts]
        self.near_ties_of = [{} for _ in prompts]
        self.disagreements_of = [{} for _ in prompts]
        with torch.no_grad():
            # each prompt's rope cos/sin, the same at every layer ([1, T, rope dim] each)
            pes = [self.rotary(x[:, o:o + t], torch.arange(t, device=self.device)[None])
                   for t, o in zip(lengths, starts)]
            for i in range(n + 1):
                if i in layer_ids:
                    for j, pick in enumerate(picks):
                        taken[j][i] = x[0, pick].cpu()
                if i == n:
                    break
                layer, moe = self._layer(i)
                for t, o, pe in zip(lengths, starts, pes):
                    part = x[:, o:o + t]
                    a = torch.empty_like(part)
                    for sl in self._chunks(t, self.token_chunk):
                        a[:, sl] = layer.input_layernorm(part[:, sl])
                    part += self._attention(layer, a, pe)
                    del a
                ties: List[int] = []
                differ: List[int] = []
                for sl in self._chunks(x.shape[1], self.token_chunk):
                    h = layer.post_attention_layernorm(x[:, sl])
                    if not moe:
                        x[:, sl] += layer.mlp(h)
                        continue
                    ties += [sl.start + p for p in self._ties(layer, h[0])]
                    g = None if given is None else given[sl, i]
                    out, own = self._moe(layer.mlp, h, g)
                    x[:, sl] += out
                    del out
                    if g is not None:
                        mine, theirs = own.sort(dim=-1).values, g.sort(dim=-1).values
                        off = ((mine != theirs).any(dim=-1) & (g[:, 0] >= 0)).nonzero().flatten()
                        differ += [sl.start + p for p in off.tolist()]
                if moe:
                    for j, (t, o) in enumerate(zip(lengths, starts)):
                        self.near_ties_of[j][i] = [p - o for p in ties if o <= p < o + t]
                        self.disagreements_of[j][i] = [p - o for p in differ if o <= p < o + t]
                del layer
                if self.device != "cpu":
                    torch.cuda.empty_cache()
        return [torch.stack([t[k] for k in layer_ids], dim=1) for t in taken]  # [R, L, H] each


if __name__ == "__main__":  # python -m testing.kimi_slice PATH LAYERS
    import sys

    ensure_built(sys.argv[1], int(sys.argv[2]))
