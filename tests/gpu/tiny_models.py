"""The tiny DeepseekV3-style model (MLA + MoE, the architecture of Kimi-K2.5) that both
tests/gpu/e2e.py and bench/bench.py build with random weights: one definition, so the
benchmark measures the model the end-to-end checks verified.

No imports at module level: the caller builds ``transformers.DeepseekV3Config(**kwargs)``.
"""


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
