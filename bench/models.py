"""The workloads: one ``Model`` each in ``MODELS``, its shape, its build, its servers' flags.

``python -m bench.models NAME PATH`` builds model ``NAME`` into ``PATH`` (reused when an
earlier build finished there). The run starts it as a subprocess (``runner``),
so that its CUDA context and memory are gone before the servers start. Adding a workload
is one entry: a build function that fills a directory (here or in ``testing/``), the shape
the plan sizes files with before anything is built, and what its servers and grid need.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from sglang_ext.config import default_layer_ids, parse_layer_ids

CHUNK = 8192  # SGLang's default --chunked-prefill-size on an H200 (gpu_mem 80-160 GB)


@dataclass(frozen=True)
class Model:
    """``build(path)``: writes a bf16 HF checkpoint into the empty directory ``path``.
    ``hidden_size``, ``num_layers``, ``vocab``: the checkpoint's (prompts draw ids from
    [3, vocab)); ``layers_flag``: ``--dump-hidden-states-layers`` (None: the server's
    default ids); ``mla``: MLA attention, which vLLM's extraction refuses (``bench.peer``);
    ``server_flags``: more SGLang flags for each of our servers (``--context-length``,
    ``--chunked-prefill-size``, ``--trust-remote-code``...); ``prompt_lens``,
    ``concurrency``: its grid where ``--prompt-lens``/``--concurrency`` are not given;
    ``cell_scale``: its cells at concurrency >= 8 hold this many times the profile's
    tokens; ``est_*``: assumptions for ``--dry-run``'s time estimates only;
    ``kimi_targets``: its report checks issue 48's targets too (the Kimi-K2.5 slices)."""

    build: Callable[[str], object]
    hidden_size: int
    num_layers: int
    vocab: int
    layers_flag: Optional[str] = None
    mla: bool = False
    server_flags: Tuple[str, ...] = ()
    prompt_lens: Tuple[int, ...] = (512, 2048, 8192)
    concurrency: Tuple[int, ...] = (1, 8, 32)
    cell_scale: int = 1
    est_tps: int = 40_000
    est_json_tps: int = 700
    est_startup_s: int = 200
    est_build_s: int = 60
    est_decode_step_s: float = 0.01  # one decode step of a batch, for generate cells
    kimi_targets: bool = False  # also held to issue 48's targets (bench.targets.kimi_targets)

    @property
    def layer_ids(self) -> List[int]:
        """The layer ids its files hold, in file order (sglang_ext.config's rules)."""
        return list(parse_layer_ids(self.layers_flag) or default_layer_ids(self.num_layers))

    @property
    def chunk(self) -> int:
        """Prompt tokens per prefill forward: its ``--chunked-prefill-size``, else ``CHUNK``."""
        flags = list(self.server_flags)
        return int(flags[flags.index("--chunked-prefill-size") + 1]) if "--chunked-prefill-size" in flags else CHUNK


def _save(cls, cfg, path):
    """Random bf16 weights of ``cls(cfg)`` (``torch.manual_seed(0)``) saved into ``path``:
    initialized on the GPU where it fits (1.9 B parameters: seconds there, a minute on the CPU)."""
    import torch

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        with torch.device(device):
            model = cls(cfg).to(torch.bfloat16)
    except Exception as e:  # noqa: BLE001
        if device == "cpu":
            raise
        print(f"init on the GPU failed ({type(e).__name__}: {e}); building on the CPU")
        torch.cuda.empty_cache()
        model = cls(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)


def llama(hidden_size, num_layers, vocab, intermediate_size, heads, kv_heads):
    """A build function of a LlamaForCausalLM of that shape, 16384 positions."""
    def build(path):
        from transformers import LlamaConfig, LlamaForCausalLM

        _save(LlamaForCausalLM, LlamaConfig(
            vocab_size=vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            max_position_embeddings=16384), path)
    return build


def deepseek_tiny(path):
    """testing/tiny_models.py's DeepseekV3 (the model the GPU suite verified), 16384 positions."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from testing import tiny_models

    _save(DeepseekV3ForCausalLM, DeepseekV3Config(**tiny_models.deepseek_tiny_config(max_position_embeddings=16384)),
          path)


def kimi_slice(num_layers):
    """A build function of testing/kimi_slice.py's Kimi-K2.5 slice (real text dimensions,
    INT4 experts in Kimi's own format) of ``num_layers`` decoder layers, drawn on the GPU."""
    def build(path):
        import torch

        from testing.kimi_slice import build_kimi_slice

        build_kimi_slice(path, num_layers, device="cuda" if torch.cuda.is_available() else "cpu")
    return build


KIMI_FLAGS = ("--trust-remote-code", "--context-length", "33792", "--chunked-prefill-size", str(CHUNK))

MODELS = {
    # what most drafters are trained from (default layers [2, N//2, N-3, N])
    "llama-8b": Model(llama(4096, 32, 128256, 14336, 32, 8), 4096, 32, 128256, est_build_s=40),
    # Llama-2-7B's widths, 8 layers
    "llama-mid": Model(llama(4096, 8, 32000, 11008, 32, 32), 4096, 8, 32000,
                       est_tps=80_000, est_json_tps=1_300, est_startup_s=150, est_build_s=15),
    # MLA + MoE, all 4 layers dumped: the stress case (up to ~640k tok/s), a cell of 64k
    # tokens lasting 0.1-0.6 s, where single stalls dominate, so 8x at concurrency >= 8
    "deepseek-tiny": Model(deepseek_tiny, 1024, 4, 1024, layers_flag="1,2,3,4", mla=True, cell_scale=8,
                           est_tps=150_000, est_json_tps=5_000, est_startup_s=130, est_build_s=5),
    # Kimi-K2.5's text dimensions (hidden 7168, MLA 64 heads, 384 INT4 experts): 4 layers
    # (1 dense + 3 MoE, ~35 GB a server: two or three servers need an H200), or 2 (1 + 1,
    # ~16 GB: three fit an H100 at --mem-fraction-static 0.3). Every layer dumped, so the
    # dump weighs more per forward than at 4 of Kimi's 61 layers.
    "kimi-slice": Model(kimi_slice(4), 7168, 4, 163840, layers_flag="1,2,3,4", mla=True, server_flags=KIMI_FLAGS,
                        prompt_lens=(2048, 8192, 32768), concurrency=(1, 8),
                        est_tps=25_000, est_json_tps=300, est_startup_s=240, est_build_s=90, kimi_targets=True),
    "kimi-slice-2": Model(kimi_slice(2), 7168, 2, 163840, layers_flag="1,2", mla=True, server_flags=KIMI_FLAGS,
                          prompt_lens=(2048, 8192, 32768), concurrency=(1, 8),
                          est_tps=45_000, est_json_tps=400, est_startup_s=180, est_build_s=45,
                          kimi_targets=True),
}


def file_bytes(spec, prompt_len, fp8=False):
    """Size of one dump file: hidden_states bf16 [T, L, H] (fp8: float8 [T, L, H] plus
    float32 scales [T, L, 1]) + token_ids int64 [T] + header."""
    slots = len(spec.layer_ids)
    per_token = slots * spec.hidden_size + 4 * slots if fp8 else slots * spec.hidden_size * 2
    return prompt_len * (per_token + 8) + 1024


def model_path(args, name):
    """Where model ``name`` is built: ``--workdir``/name."""
    return os.path.join(args.workdir, name)


BUILT = ".kimi-bench-built"  # written last by ``build``: the checkpoint beside it is whole


def build(name, path):
    """Build model ``name`` (a key of ``MODELS``) into ``path``; nothing to do when an
    earlier ``build`` finished there (its ``BUILT`` marker). A checkpoint without the marker
    (a build cut short) is built again over it."""
    marker = os.path.join(path, BUILT)
    if os.path.exists(marker):
        print(f"{name}: reusing {path}")
        return
    if any(os.path.exists(os.path.join(path, f)) for f in ("model.safetensors.index.json", "model.safetensors")):
        print(f"{name}: {path} holds a checkpoint without {BUILT} (a build cut short?): building again")
    t0 = time.time()
    MODELS[name].build(path)
    with open(marker, "w") as f:
        f.write(name)
    print(f"{name}: built in {time.time() - t0:.1f} s -> {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.models", description="build one workload with random weights")
    ap.add_argument("name", choices=sorted(MODELS))
    ap.add_argument("path", help="the model directory (reused when an earlier build finished there)")
    args = ap.parse_args(argv)
    build(args.name, args.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
