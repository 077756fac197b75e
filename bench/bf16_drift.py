"""How far two correct bf16 forwards of one random-weight Llama drift apart, per layer id,
on the CPU: the scale against which two engines' files for the same prompt
(``bench.peerfiles``) are read.

A model of ``bench.models.MODELS``' shape is run one decoder layer at a time (HF
transformers' ``LlamaDecoderLayer``, weights drawn as HF's ``_init_weights`` draws them:
normal(0, ``initializer_range``) for every linear layer, ones for the norms), so that
Llama-3.1-8B's shape fits in a few GB of host memory. Three streams go through the same
weights: float32 (the reference), bf16 with SDPA attention and bf16 with eager attention
(two correct bf16 implementations that differ only in kernel order and rounding, as SGLang
and vLLM do). At each id k (the residual stream entering layer k; k = N: after the last
layer, before the final norm, as both engines store it) it reports the relative error
``||a - b|| / ||b||`` over the [T, H] block for bf16-SDPA vs float32, bf16-eager vs
float32 and bf16-SDPA vs bf16-eager.

``python -m bench.bf16_drift [--model llama-8b] [--tokens 256] [--seed 0] [--num-layers N]
[--layer-ids 2,16] [--out F.json]``: about 20 s per layer of llama-8b at 256 tokens on two CPU
cores (612.8 s for all 32; a line per layer on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List, Optional

from bench import gpu_suite_module
from bench.models import MODELS

STREAMS = ("f32", "bf16_sdpa", "bf16_eager")
PAIRS = (("bf16_sdpa", "f32"), ("bf16_eager", "f32"), ("bf16_sdpa", "bf16_eager"))


def _layer_ids(ids: List[int], n: int, asked: List[int]) -> List[int]:
    """``ids`` sorted and deduplicated; ValueError when none is left or one is outside 0..N
    (``asked``: what to name when none is left)."""
    ids = sorted(set(ids))
    if not ids or ids[0] < 0 or ids[-1] > n:
        raise ValueError(f"layer ids {ids or asked} are not within 0..{n} (the stream entering layer k, "
                         f"or N = {n}: after the last layer, before the final norm); pass layer_ids")
    return ids


def drift(name: str = "llama-8b", tokens: int = 256, seed: int = 0,
          layer_ids: Optional[List[int]] = None, num_layers: Optional[int] = None) -> Dict:
    """Run model ``name``'s shape (``num_layers`` overrides its depth, for quick checks)
    on ``tokens`` random token embeddings; ``layer_ids`` (ids 0..N) default to the model's
    that are <= N. Returns ``{"model", "num_layers", "tokens", "seed", "layer_ids",
    "errors": {"a_vs_b": [relative error per layer id]}, "seconds"}``. Raises ValueError
    for a model that is not a Llama, or layer ids outside 0..N (none left by default)."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    spec = MODELS[name]
    if spec["arch"] != "llama":
        raise ValueError(f"{name} is not a Llama (bf16_drift builds Llama decoder layers only)")
    n = num_layers or spec["num_layers"]
    ids = _layer_ids(layer_ids or [k for k in spec["layer_ids"] if k <= n], n, spec["layer_ids"])
    cfg = LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["hidden_size"],
                      intermediate_size=spec["intermediate_size"], num_hidden_layers=n,
                      num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
                      max_position_embeddings=16384)
    t0 = time.time()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, spec["hidden_size"], generator=g) * cfg.initializer_range  # embedding rows
    pos = torch.arange(tokens).unsqueeze(0)
    mask = torch.full((tokens, tokens), float("-inf")).triu(1)[None, None]  # causal, additive
    cos, sin = LlamaRotaryEmbedding(cfg)(x, pos)
    h = {s: x.clone() if s == "f32" else x.to(torch.bfloat16) for s in STREAMS}
    errors = {f"{a}_vs_{b}": [] for a, b in PAIRS}
    rel_errors = gpu_suite_module("reference").rel_errors  # the GPU suite's, on [T, 1, H]

    def record():
        for a, b in PAIRS:
            errors[f"{a}_vs_{b}"].append(rel_errors(h[a][0].unsqueeze(1), h[b][0].unsqueeze(1)).block)

    with torch.no_grad():
        for k in range(n):
            if k in ids:
                record()
            layer = LlamaDecoderLayer(cfg, k)
            for mod in layer.modules():
                if isinstance(mod, torch.nn.Linear):
                    mod.weight.normal_(0.0, cfg.initializer_range, generator=g)
            cfg._attn_implementation = "sdpa"
            h["f32"] = layer(h["f32"], attention_mask=mask, position_ids=pos, position_embeddings=(cos, sin))
            layer.to(torch.bfloat16)
            bmask, bcs = mask.to(torch.bfloat16), (cos.to(torch.bfloat16), sin.to(torch.bfloat16))
            for stream, impl in (("bf16_sdpa", "sdpa"), ("bf16_eager", "eager")):
                cfg._attn_implementation = impl
                h[stream] = layer(h[stream], attention_mask=bmask, position_ids=pos, position_embeddings=bcs)
            del layer
            print(f"layer {k + 1}/{n} done ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
        if n in ids:
            record()
    return {"model": name, "num_layers": n, "tokens": tokens, "seed": seed, "layer_ids": ids,
            "errors": errors, "seconds": round(time.time() - t0, 1)}


def hf_drift(model_dir: str, prompt_lens: List[int], device: str = "cuda", seed: int = 0,
             layer_ids: Optional[List[int]] = None, build: Optional[str] = None) -> Dict:
    """HF's whole model, not layer by layer: the checkpoint in ``model_dir`` through
    tests/gpu/reference.py's float32 forward, then its bf16 forward (``to_dtype``: the
    parameters cast, the rope's ``inv_freq`` kept in float32), on one prompt of random
    token ids per length in ``prompt_lens``: the HF-bf16-vs-float32 error that
    ``bench.peerfiles`` scales its tolerances by, on the device the engines ran on.
    ``build`` (a key of ``bench.models.MODELS``): first build that shape with its seed's
    random weights into ``model_dir``, which must then hold no model (bench.py builds the
    same). ``layer_ids`` (ids 0..N, as tests/gpu/reference.py numbers them) default to
    ``MODELS[build]``'s, else [N]. Returns ``{"model_dir", "device", "prompt_lens", "seed",
    "layer_ids", "hf_bf16_vs_f32": {"slots": [largest per layer id over the prompts],
    "block", "token"}, "seconds"}``. Raises OSError (no checkpoint there; a model there to
    build over), ValueError (a prompt length below 1, a layer id outside 0..N)."""
    import torch

    from bench import models

    t0 = time.time()
    config = os.path.join(model_dir, "config.json")
    if any(t < 1 for t in prompt_lens) or not prompt_lens:
        raise ValueError(f"prompt lengths must be >= 1 (got {prompt_lens})")
    if build:
        if os.path.exists(config):
            raise OSError(f"{model_dir} already holds a model (config.json): building {build} there would "
                          "mix random weights into it; name an empty or new directory")
        models.build(build, model_dir)
    try:
        with open(config) as f:
            n = int(json.load(f)["num_hidden_layers"])
    except (OSError, ValueError, KeyError) as e:
        raise OSError(f"{model_dir} holds no HF checkpoint ({config}: {getattr(e, 'strerror', None) or e}); "
                      "pass --build to build --model's shape there") from None
    ids = _layer_ids(layer_ids or (MODELS[build]["layer_ids"] if build else [n]), n, layer_ids or [])
    reference = gpu_suite_module("reference")
    worst = gpu_suite_module("checks").Worst()  # over the prompts, NaN kept
    ref = reference.Reference(model_dir, device)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, ref.model.config.vocab_size, (t,), generator=g).tolist() for t in prompt_lens]
    try:
        blocks = [ref(p, ids) for p in prompts]
        ref.to_dtype(torch.bfloat16)
        for p, b in zip(prompts, blocks):
            worst.add(reference.rel_errors(ref(p, ids), b), f"{len(p)} tokens")
    finally:
        ref.close()
    return {"model_dir": model_dir, "device": device, "prompt_lens": list(prompt_lens), "seed": seed,
            "layer_ids": ids, "hf_bf16_vs_f32": {"slots": worst.slots, "block": worst.block, "token": worst.token},
            "seconds": round(time.time() - t0, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.bf16_drift", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-8b", choices=sorted(k for k, v in MODELS.items() if v["arch"] == "llama"))
    ap.add_argument("--tokens", type=int, default=256, help="prompt length (random embeddings)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-layers", type=int, default=None, help="run this many layers (default: the model's)")
    ap.add_argument("--layer-ids", default=None,
                    help="comma-separated ids 0..N (default: the model's dump layers up to N)")
    ap.add_argument("--out", help="write the result as JSON here too")
    ap.add_argument("--hf-model-dir", help="instead: the HF checkpoint in this directory, float32 against its "
                    "own bf16 forward, whole model (hf_drift)")
    ap.add_argument("--build", action="store_true",
                    help="with --hf-model-dir: first build --model's shape there with random weights, as "
                         "bench.py does (the directory must hold no model)")
    ap.add_argument("--prompt-lens", default="512,2048,777", help="with --hf-model-dir: one prompt per length")
    ap.add_argument("--device", default="auto", help="with --hf-model-dir (auto: cuda when there is one)")
    args = ap.parse_args(argv)
    try:
        lens = [int(x) for x in args.prompt_lens.split(",")] if args.hf_model_dir else None
        ids = [int(x) for x in args.layer_ids.split(",")] if args.layer_ids else None
    except ValueError:
        ap.error("--prompt-lens and --layer-ids take comma-separated integers")
    if args.hf_model_dir:
        res = _main_hf(ap, args, lens, ids)
    else:
        try:
            res = drift(args.model, args.tokens, args.seed, ids, args.num_layers)
        except ValueError as e:
            ap.error(str(e))
        print(f"{res['model']} ({res['num_layers']} layers, {res['tokens']} tokens, seed {res['seed']}, "
              f"{res['seconds']} s): relative error per layer id")
        print(f"{'pair':28}" + "".join(f"{k:>10}" for k in res["layer_ids"]))
        for pair, errs in res["errors"].items():
            print(f"{pair:28}" + "".join(f"{e:10.2e}" for e in errs))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def _main_hf(ap, args, lens, ids):
    """``--hf-model-dir``: check the device, run ``hf_drift``, print it; returns its result."""
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {device}: torch sees no CUDA device here")
    if device != "cpu" and not device.startswith("cuda"):
        ap.error(f"--device {device}: cpu, cuda or cuda:N")
    try:
        res = hf_drift(args.hf_model_dir, lens, device, args.seed, ids, args.model if args.build else None)
    except (OSError, ValueError) as e:
        ap.error(str(e))
    print(f"{res['model_dir']} on {device}, prompts {lens} ({res['seconds']} s): HF bf16 vs float32 per layer id")
    print("".join(f"{k:>10}" for k in res["layer_ids"]))
    print("".join(f"{e:10.2e}" for e in res["hf_bf16_vs_f32"]["slots"]))
    return res


if __name__ == "__main__":
    sys.exit(main())
