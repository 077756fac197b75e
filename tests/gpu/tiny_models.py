"""The tiny random models of the GPU suite, and the DeepseekV3 config that the benchmark
(bench/models.py) builds too (one definition, so the benchmark measures the model the GPU
tests verified).

- ``llama``: a LlamaForCausalLM (8 layers, hidden 256, 4 heads / 2 KV heads, vocab 1024)
  with a local word-level tokenizer; served through the container entrypoint
  (``kimi-sglang``), default dump layers.
- ``deepseek``: a DeepseekV3ForCausalLM (MLA + MoE, the architecture of Kimi-K2.5, see
  ``deepseek_tiny_config``); served as upstream documents (``python -m
  sglang.launch_server``) with dump layers ``1,3,4``.

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


VOCAB = 1024  # both models; prompts draw ids from [3, VOCAB)


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


@dataclass(frozen=True)
class ModelSpec:
    """How the GPU suite builds and serves one tiny model.

    ``layers_flag``: ``--dump-hidden-states-layers`` (None: the server's default);
    ``launcher``: "entrypoint" (the container's ``kimi-sglang``, profiles applied) or
    "direct" (``python -m sglang.launch_server``)."""

    name: str
    build: Callable[[str], int]
    layers_flag: Optional[str]
    launcher: str


MODELS = {
    "llama": ModelSpec("llama", build_llama, None, "entrypoint"),
    "deepseek": ModelSpec("deepseek", build_deepseek, "1,3,4", "direct"),
}


@dataclass(frozen=True)
class TinyModel:
    """A built model: ``path`` (HF directory), ``num_layers``, ``hidden_size``,
    ``layer_ids`` (the ids the server dumps, in file order)."""

    spec: ModelSpec
    path: str
    num_layers: int
    hidden_size: int
    layer_ids: tuple

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
        hidden = json.load(f)["hidden_size"]
    layer_ids = parse_layer_ids(spec.layers_flag) or default_layer_ids(n)
    return TinyModel(spec, path, n, hidden, tuple(layer_ids))
