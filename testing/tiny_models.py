"""The tiny random models of the GPU suite, and the DeepseekV3 config that the benchmark
(bench/models.py) builds too (one definition, so the benchmark measures the model the GPU
tests verified).

- ``llama``: a LlamaForCausalLM (8 layers, hidden 256, 4 heads / 2 KV heads, vocab 1024)
  with a local word-level tokenizer; served through the container entrypoint
  (``kimi-sglang``), default dump layers.
- ``deepseek``: a DeepseekV3ForCausalLM (MLA + MoE, the architecture of Kimi-K2.5, see
  ``deepseek_tiny_config``); served as upstream documents (``python -m
  sglang.launch_server``) with dump layers ``1,3,4``.
- ``kimi``: a KimiK25ForConditionalGeneration (the class Kimi-K2.5 is served with) whose
  language model is exactly ``deepseek``'s weights, plus a one-block vision tower
  (``build_kimi``); served like ``deepseek``; its reference runs on the text weights.
- ``qwen_vl``: a Qwen2_5_VLForConditionalGeneration (4 layers, hidden 256, a 2-block
  vision tower) with a local word-level tokenizer, a chat template and Qwen's image
  processor (``build_qwen_vl``): the vision-language model both SGLang and HF implement,
  for prompts with images (tests/gpu/test_gpu_vlm.py; the core groups do not run it).
- ``kimi_vl``: ``kimi``'s checkpoint (same weights) plus a tokenizer with Kimi's role and
  media tokens and a chat template (``build_kimi_vl``): the Kimi-K2.5 class serving chats
  with images through its own vision tower (tests/gpu/test_gpu_vlm.py).

Weights are random bf16 drawn after ``torch.manual_seed(0)``. No third-party imports at
module level: bench/models.py imports ``deepseek_tiny_config`` without torch, and the CPU
suite imports this module to check the GPU tests' plumbing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Optional


def deepseek_tiny_config(max_position_embeddings: int = 4096) -> dict:
    """Keyword arguments of ``transformers.DeepseekV3Config``: 4 layers (the first dense),
    hidden 1024, kv_lora_rank 512, q_lora_rank 384, rope/nope/v head dims 64/128/128,
    8 routed experts + 1 shared, vocab 1024.

    Every routed expert is selected (top-k = all 8): routing cannot flip between bf16 and
    an fp32 reference, so differences come from real bugs only (../shared/gpu-lab README).
    ``moe_layer_freq``, ``topk_method`` and ``scoring_func`` are keys transformers no longer
    writes but SGLang 0.5.17 reads (AttributeError without them), set as real DeepSeek-V3
    checkpoints do.
    """
    return dict(
        vocab_size=1024, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
        kv_lora_rank=512, q_lora_rank=384, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, n_routed_experts=8, num_experts_per_tok=8, n_shared_experts=1,
        n_group=1, topk_group=1, first_k_dense_replace=1,
        max_position_embeddings=max_position_embeddings,
        moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", rope_scaling=None,
    )


VOCAB = 1024  # every model; prompts draw ids from [3, VOCAB)


def save_word_tokenizer(path: str, vocab_size: int) -> None:
    """A local word-level tokenizer (token i <-> "t<i>") saved into ``path``, so the Llama's
    server runs with a tokenizer: SGLang's /v1/completions needs one to build its text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(path)


def build_llama(path: str) -> int:
    """Save the tiny Llama (bf16 safetensors + tokenizer) into ``path``; returns its number
    of decoder layers (8)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    save_word_tokenizer(path, cfg.vocab_size)
    return cfg.num_hidden_layers


def build_deepseek(path: str) -> int:
    """Save the tiny DeepseekV3 (bf16 safetensors, no tokenizer: served with
    --skip-tokenizer-init) into ``path``; returns its number of decoder layers (4)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(**deepseek_tiny_config(max_position_embeddings=4096))
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return cfg.num_hidden_layers


KIMI_MEDIA_PLACEHOLDER = 2  # inside the vocab, never in a prompt (ids from 3)


def kimi_vision_config(text_hidden_size: int) -> dict:
    """``vision_config`` of the tiny Kimi-K2.5: one MoonViT block, hidden 64, 2 heads (the
    2D RoPE needs head_dim % 4 == 0), patches 14, merge 2x2, projector to ``text_hidden_size``.

    SGLang's tower reads ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads`` and
    ``intermediate_size`` (KimiK25VisionConfig; its defaults are the real tower's), its
    projector ``vt_hidden_size`` and ``text_hidden_size``; real checkpoints spell the tower's
    sizes ``vt_*`` only, so both spellings are written."""
    sizes = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128)
    return dict(**sizes, **{f"vt_{k}": v for k, v in sizes.items()},
                patch_size=14, init_pos_emb_height=4, init_pos_emb_width=4, init_pos_emb_time=4,
                pos_emb_type="divided_fixed", merge_kernel_size=[2, 2], video_attn_type="spatial_temporal",
                merge_type="sd2_tpool", mm_projector_type="patchmerger", mm_hidden_size=64,
                projector_hidden_act="gelu", projector_ln_eps=1e-5, text_hidden_size=text_hidden_size)


def kimi_vision_shapes(v: dict) -> dict:
    """Checkpoint name -> shape of the vision tower and projector, named as real Kimi-K2.5
    checkpoints name them (``wqkv``/``wo``, ``mm_projector.proj.0``/``.2``: SGLang's
    ``KimiK25ForConditionalGeneration.load_weights`` renames them)."""
    h, m, p = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    merged = h * v["merge_kernel_size"][0] * v["merge_kernel_size"][1]  # the projector's input
    shapes = {"vision_tower.patch_embed.proj.weight": (h, 3, p, p), "vision_tower.patch_embed.proj.bias": (h,),
              "vision_tower.patch_embed.pos_emb.weight": (v["init_pos_emb_height"], v["init_pos_emb_width"], h),
              "mm_projector.proj.0.weight": (merged, merged), "mm_projector.proj.0.bias": (merged,),
              "mm_projector.proj.2.weight": (v["text_hidden_size"], merged),
              "mm_projector.proj.2.bias": (v["text_hidden_size"],)}
    norms = ["vision_tower.encoder.final_layernorm", "mm_projector.pre_norm"]
    for i in range(v["num_hidden_layers"]):
        b = f"vision_tower.encoder.blocks.{i}."
        norms += [b + "norm0", b + "norm1"]
        for name, out, inp in (("wqkv", 3 * h, h), ("wo", h, h), ("mlp.fc0", m, h), ("mlp.fc1", h, m)):
            shapes[f"{b}{name}.weight"], shapes[f"{b}{name}.bias"] = (out, inp), (out,)
    shapes.update({f"{n}.{w}": (h,) for n in norms for w in ("weight", "bias")})
    return shapes


def kimi_processor_config(vision: dict) -> dict:
    """processor_config.json of the tiny Kimi-K2.5: ``auto_map`` naming the stand-in
    (kimi_processor.py) and Kimi's ``media_proc_cfg`` keys, sized for the tiny tower:
    ``vision``'s patch size, merge 2, at most 256 patches (16 a side), mean/std 0.5.
    An image of at most 16x16 patches is not resized; its sides are padded to multiples
    of 28."""
    return {"auto_map": {"AutoProcessor": "kimi_processor.TinyKimiK25Processor"},
            "media_proc_cfg": {"patch_size": vision["patch_size"], "merge_kernel_size": 2,
                               "in_patch_limit": 256, "patch_limit_on_one_side": 16,
                               "image_mean": [0.5] * 3, "image_std": [0.5] * 3}}


def kimi_text_path(path: str) -> str:
    """Where ``build_kimi(path)`` saves its language model as a plain DeepseekV3: the HF
    reference of the ``kimi`` model."""
    return path + "-text"


def build_kimi(path: str) -> int:
    """Save the tiny Kimi-K2.5 into ``path``, and its language model, ``build_deepseek``'s
    (same seed, same weights), into ``kimi_text_path(path)``; returns 4 (decoder layers).

    ``path`` holds config.json (``KimiK25Config``: ``text_config`` is the DeepseekV3's saved
    config, with the keys SGLang reads that transformers no longer writes, see
    ``deepseek_tiny_config``; ``vision_config``; ``media_placeholder_token_id``),
    model.safetensors (text weights under ``language_model.``, as real checkpoints; vision
    weights random, run by ``kimi_vl`` only) and the processor SGLang builds at start-up
    even with --skip-tokenizer-init (kimi_processor.py, a stand-in of Kimi-K2.5's,
    processor_config.json: remote code, so the server needs --trust-remote-code, as
    Kimi-K2.5 does)."""

    import torch
    from safetensors.torch import load_file, save_file

    text = kimi_text_path(path)
    n = build_deepseek(text)
    with open(os.path.join(text, "config.json")) as f:
        text_config = {k: v for k, v in json.load(f).items() if k != "transformers_version"}
    vision = kimi_vision_config(text_config["hidden_size"])
    gen = torch.Generator().manual_seed(1)
    weights = {f"language_model.{k}": t for k, t in load_file(os.path.join(text, "model.safetensors")).items()}
    weights.update({k: (0.02 * torch.randn(s, generator=gen)).to(torch.bfloat16)
                    for k, s in kimi_vision_shapes(vision).items()})
    os.makedirs(path, exist_ok=True)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    write_kimi_k25_config(path, text_config, vision, KIMI_MEDIA_PLACEHOLDER, pad_token_id=0)
    return n


def write_kimi_k25_config(path: str, text_config: dict, vision: dict, media_placeholder: int,
                          pad_token_id: int, **extra) -> None:
    """config.json of a ``KimiK25ForConditionalGeneration`` checkpoint (``text_config``,
    ``vision_config``, ``media_placeholder_token_id``, ids; ``extra``: more top-level keys,
    e.g. a ``quantization_config``), its processor_config.json and the processor stand-in
    (kimi_processor.py) into ``path``: what SGLang reads at start-up even with
    --skip-tokenizer-init (the tiny ``kimi`` model and testing/kimi_slice.py)."""
    import shutil

    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "dtype": "bfloat16", "text_config": text_config, "vision_config": vision,
              "media_placeholder_token_id": media_placeholder, "pad_token_id": pad_token_id,
              "bos_token_id": text_config["bos_token_id"], "eos_token_id": text_config["eos_token_id"],
              "tie_word_embeddings": False, **extra}
    for name, doc in (("config.json", config), ("processor_config.json", kimi_processor_config(vision))):
        with open(os.path.join(path, name), "w") as f:
            json.dump(doc, f, indent=2)
    shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), "kimi_processor.py"), path)


# Kimi-K2.5's role and media tokens in ``kimi_vl``'s tokenizer, at the top of the 1024
# ids (prompts of the text tests draw from [3, VOCAB) but send ids, never text), and the
# placeholder at KIMI_MEDIA_PLACEHOLDER. Its chat template is Kimi-K2.5's cut to what the
# tests send (string or list content, text and image parts; no tools, no thinking): an
# image part is <|media_begin|>image<|media_content|><|media_pad|><|media_end|>, as in
# the published template; the role names and "image" are unknown words (t0).
KIMI_VL_SPECIAL = {"<|im_end|>": 1016, "<|im_user|>": 1017, "<|im_assistant|>": 1018, "<|im_system|>": 1019,
                   "<|im_middle|>": 1020, "<|media_begin|>": 1021, "<|media_content|>": 1022,
                   "<|media_end|>": 1023, "<|media_pad|>": KIMI_MEDIA_PLACEHOLDER}
KIMI_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|im_system|>system<|im_middle|>"
    "{% elif message['role'] == 'user' %}<|im_user|>user<|im_middle|>"
    "{% else %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ['image', 'image_url'] %}<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)


def save_kimi_vl_tokenizer(path: str) -> None:
    """``kimi_vl``'s tokenizer into ``path`` (tokenizer.json, tokenizer_config.json with
    ``KIMI_VL_CHAT_TEMPLATE``): word level, token i <-> ``t<i>`` for the ids not in
    ``KIMI_VL_SPECIAL``, those special tokens at theirs; eos ``<|im_end|>``. The
    directory's processor (kimi_processor.py) loads it."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special_ids = set(KIMI_VL_SPECIAL.values())
    vocab = {f"t{i}": i for i in range(VOCAB) if i not in special_ids}
    vocab.update(KIMI_VL_SPECIAL)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in KIMI_VL_SPECIAL])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token=None, eos_token="<|im_end|>")
    tokenizer.chat_template = KIMI_VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)


def build_kimi_vl(path: str) -> int:
    """``build_kimi(path)`` plus ``save_kimi_vl_tokenizer(path)``: the same weights and
    processor, served with a tokenizer and a chat template (no --skip-tokenizer-init), so
    chats with images reach its vision tower; returns 4 (decoder layers)."""
    n = build_kimi(path)
    save_kimi_vl_tokenizer(path)
    return n


# Qwen2.5-VL's special tokens, after the word tokens t0..t1023 (VOCAB)
QWEN_VL_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                   "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN_VL_IMAGE_TOKEN = VOCAB + QWEN_VL_SPECIAL.index("<|image_pad|>")  # 1029
QWEN_VL_VOCAB = 1040  # the embedding's rows: the tokenizer's 1031 ids, padded
# Qwen's chat template cut to what the tests send: string or list content, text and image
# parts (SGLang's chat layer passes image parts as {"type": "image"}; HF's processor takes
# {"type": "image", "image": ...}); the roles become unknown words (t0).
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ['image', 'image_url'] %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_vl_config() -> dict:
    """config.json of the tiny Qwen2.5-VL, in the layout of the published checkpoints
    (text keys at the top level, ``rope_scaling`` with M-RoPE's ``mrope_section``, which
    SGLang reads; transformers 5 reads it too): 4 layers, hidden 256, 4 heads / 2 KV heads
    (head dim 64: mrope_section [8, 12, 12] sums to 32), vocab 1040; vision tower depth 2,
    hidden 64, 2 heads, patches 14, merge 2x2, window 112 (block 1 full attention),
    projected to 256."""
    sp = {t: VOCAB + i for i, t in enumerate(QWEN_VL_SPECIAL)}
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "torch_dtype": "bfloat16", "vocab_size": QWEN_VL_VOCAB, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 4096, "max_window_layers": 4,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
        "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": False,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": sp["<|endoftext|>"], "eos_token_id": sp["<|im_end|>"],
        "pad_token_id": sp["<|endoftext|>"],
        "vision_start_token_id": sp["<|vision_start|>"], "vision_end_token_id": sp["<|vision_end|>"],
        "image_token_id": sp["<|image_pad|>"], "video_token_id": sp["<|video_pad|>"],
        "vision_config": {"depth": 2, "hidden_size": 64, "num_heads": 2, "intermediate_size": 128,
                          "out_hidden_size": 256, "patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [1],
                          "in_chans": 3, "hidden_act": "silu", "tokens_per_second": 2,
                          "model_type": "qwen2_5_vl"},
    }


def save_qwen_vl_processor(path: str) -> None:
    """Qwen2.5-VL's processor, built offline into ``path``: a word-level tokenizer
    (words t0..t1023 at ids 0..1023, split on whitespace, then ``QWEN_VL_SPECIAL`` as special
    tokens), ``QWEN_VL_CHAT_TEMPLATE``, and Qwen2-VL's image processor (patches 14, merge 2,
    temporal patch 2; min/max pixels 3136 / 1003520). An image whose sides are multiples of
    28 and within those bounds is not resized, so SGLang's processor (``smart_resize``,
    factor 28) and HF's give it the same grid.

    The words are stored SentencePiece style ("\u2581t5", Metaspace) so that decoding puts a
    space before each word and nothing around special tokens, as Qwen's byte-level
    tokenizer does: SGLang's chat path hands its multimodal processor the prompt ids
    decoded back to text, which must hold ``<|vision_start|><|image_pad|><|vision_end|>``
    unbroken for SGLang's image regex (a tokenizer without a decoder joins every token with
    a space, and SGLang then drops the image), and re-encodes to the same ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor, Qwen2VLImageProcessor

    vocab = {f"\u2581t{i}": i for i in range(VOCAB)}
    vocab.update({t: VOCAB + i for i, t in enumerate(QWEN_VL_SPECIAL)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="\u2581t0"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")])
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_VL_SPECIAL])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="\u2581t0", bos_token=None,
                                        eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    images = Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2,
                                   min_pixels=56 * 56, max_pixels=1280 * 28 * 28)
    kwargs = {}
    try:  # transformers 5 takes (and saves) a video processor too
        from transformers import Qwen2VLVideoProcessor

        kwargs["video_processor"] = Qwen2VLVideoProcessor()
    except ImportError:
        pass
    Qwen2_5_VLProcessor(image_processor=images, tokenizer=tokenizer, chat_template=QWEN_VL_CHAT_TEMPLATE,
                        **kwargs).save_pretrained(path)


def build_qwen_vl(path: str) -> int:
    """Save the tiny Qwen2.5-VL (bf16 safetensors under the published checkpoints' names,
    ``qwen_vl_config``'s config.json, ``save_qwen_vl_processor``'s processor) into
    ``path``; returns its number of decoder layers (4)."""
    import torch
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(qwen_vl_config(), f, indent=2)
    cfg = AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(cfg).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "config.json"), "w") as f:  # the published layout, not transformers'
        json.dump(qwen_vl_config(), f, indent=2)
    save_qwen_vl_processor(path)
    return qwen_vl_config()["num_hidden_layers"]


@dataclass(frozen=True)
class ModelSpec:
    """How the GPU suite builds and serves one tiny model.

    ``layers_flag``: ``--dump-hidden-states-layers`` (None: the server's default);
    ``launcher``: "entrypoint" (the container's ``kimi-sglang``, profiles applied) or
    "direct" (``python -m sglang.launch_server``); ``reference``: the HF directory the
    reference runs, from the model's (None: the model's own)."""

    name: str
    build: Callable[[str], int]
    layers_flag: Optional[str]
    launcher: str
    reference: Optional[Callable[[str], str]] = None


MODELS = {
    "llama": ModelSpec("llama", build_llama, None, "entrypoint"),
    "deepseek": ModelSpec("deepseek", build_deepseek, "1,3,4", "direct"),
    "kimi": ModelSpec("kimi", build_kimi, "1,3,4", "direct", reference=kimi_text_path),
}

# Models of one module only, not in ``MODELS`` (which parametrizes the whole GPU suite):
# the vision-language models of tests/gpu/test_gpu_vlm.py. qwen_vl: layer ids below 4
# (SGLang's Qwen2Model is not patched to capture before its final norm,
# session.FINAL_NORM_CAPTURE_MODELS); kimi_vl: kimi's ids, 4 = the stream before the norm.
VLM_MODELS = {
    "qwen_vl": ModelSpec("qwen_vl", build_qwen_vl, "1,2,3", "direct"),
    "kimi_vl": ModelSpec("kimi_vl", build_kimi_vl, "1,3,4", "direct", reference=kimi_text_path),
}


@dataclass(frozen=True)
class TinyModel:
    """A built model: ``path`` (HF directory), ``num_layers``, ``hidden_size``,
    ``layer_ids`` (the ids the server dumps, in file order), ``reference_path`` (the HF
    directory of the reference forward)."""

    spec: ModelSpec
    path: str
    num_layers: int
    hidden_size: int
    layer_ids: tuple
    reference_path: str

    @property
    def name(self) -> str:
        return self.spec.name


def build(spec: ModelSpec, workdir: str) -> TinyModel:
    """Build ``spec`` under ``workdir/<name>`` (rebuilt every time: same seed, same
    weights) and resolve the layer ids its server will dump."""
    from sglang_ext.config import default_layer_ids, parse_layer_ids

    path = os.path.join(workdir, spec.name)
    n = spec.build(path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    hidden = config.get("text_config", config)["hidden_size"]
    layer_ids = parse_layer_ids(spec.layers_flag) or default_layer_ids(n)
    return TinyModel(spec, path, n, hidden, tuple(layer_ids), spec.reference(path) if spec.reference else path)
