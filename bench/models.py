"""The workloads: random-weight models of known shapes, their dump file size, their build.

``python -m bench.models NAME PATH`` builds model ``NAME`` into ``PATH`` (bf16
safetensors, ``torch.manual_seed(0)``; reused when already there). The run starts it as a
subprocess (``runner``), so that its CUDA context and memory are gone before the servers
start.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# llama-8b: what most drafters are trained from (default layers [2, N//2, N-3, N]);
# llama-mid: Llama-2-7B's widths, 8 layers; deepseek-tiny: tests/gpu's MLA + MoE model,
# 16384 positions, all 4 layers dumped (the stress case: up to ~640k tok/s).
MODELS = {
    "llama-8b": {
        "arch": "llama", "hidden_size": 4096, "num_layers": 32, "vocab": 128256,
        "intermediate_size": 14336, "heads": 32, "kv_heads": 8,
        "layers_flag": None, "layer_ids": [2, 16, 29, 32],
        # assumptions for --dry-run time estimates only
        "est_tps": 40_000, "est_json_tps": 700, "est_startup_s": 200, "est_build_s": 40,
    },
    "llama-mid": {
        "arch": "llama", "hidden_size": 4096, "num_layers": 8, "vocab": 32000,
        "intermediate_size": 11008, "heads": 32, "kv_heads": 32,
        "layers_flag": None, "layer_ids": [2, 4, 5, 8],
        # assumptions for --dry-run time estimates only
        "est_tps": 80_000, "est_json_tps": 1_300, "est_startup_s": 150, "est_build_s": 15,
    },
    "deepseek-tiny": {
        "arch": "deepseek", "hidden_size": 1024, "num_layers": 4, "vocab": 1024,
        "layers_flag": "1,2,3,4", "layer_ids": [1, 2, 3, 4],
        "est_tps": 150_000, "est_json_tps": 5_000, "est_startup_s": 130, "est_build_s": 5,
        # its cells at concurrency >= 8 hold 8x the profile's tokens (at 64k a cell lasts
        # 0.1-0.6 s, where single stalls dominate)
        "cell_scale": 8,
    },
}


def file_bytes(spec, prompt_len, fp8=False):
    """Size of one dump file: hidden_states bf16 [T, L, H] (fp8: float8 [T, L, H] plus
    float32 scales [T, L, 1]) + token_ids int64 [T] + header."""
    slots = len(spec["layer_ids"])
    per_token = slots * spec["hidden_size"] + 4 * slots if fp8 else slots * spec["hidden_size"] * 2
    return prompt_len * (per_token + 8) + 1024


def model_path(args, name):
    """Where model ``name`` is built: ``--workdir``/name."""
    return os.path.join(args.workdir, name)


def build(name, path):
    """Build model ``name`` (a key of ``MODELS``) with random bf16 weights into ``path``;
    nothing to do when a safetensors checkpoint is already there. DeepseekV3's config is
    testing/tiny_models.py's (the model the GPU suite verified), with 16384 positions."""
    import torch

    spec = MODELS[name]
    if os.path.exists(os.path.join(path, "model.safetensors.index.json")) or os.path.exists(
        os.path.join(path, "model.safetensors")
    ):
        print(f"{name}: reusing {path}")
        return
    t0 = time.time()
    if spec["arch"] == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["hidden_size"],
                          intermediate_size=spec["intermediate_size"],
                          num_hidden_layers=spec["num_layers"], num_attention_heads=spec["heads"],
                          num_key_value_heads=spec["kv_heads"], max_position_embeddings=16384)
        cls = LlamaForCausalLM
    else:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        from testing import tiny_models

        cfg = DeepseekV3Config(**tiny_models.deepseek_tiny_config(max_position_embeddings=16384))
        cls = DeepseekV3ForCausalLM
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:  # random init of 1.9 B parameters: seconds on the GPU, a minute on the CPU
        with torch.device(device):
            model = cls(cfg).to(torch.bfloat16)
    except Exception as e:  # noqa: BLE001
        if device == "cpu":
            raise
        print(f"{name}: init on the GPU failed ({type(e).__name__}: {e}); building on the CPU")
        device = "cpu"
        torch.cuda.empty_cache()
        model = cls(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    print(f"{name}: built on {device} in {time.time() - t0:.1f} s -> {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.models",
                                 description="build one workload with random weights")
    ap.add_argument("name", choices=sorted(MODELS))
    ap.add_argument("path", help="the model directory (reused when it holds a checkpoint)")
    args = ap.parse_args(argv)
    build(args.name, args.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
