"""Build SGLang's Marlin W4A16 MoE kernels before a server needs them (issue 48).

SGLang 0.5.23 serves Kimi-K2.5's INT4 experts on Hopper and SM120 through
``fused_marlin_moe``, whose two GEMMs are JIT modules (``sglang.kernels.ops.moe.
moe_wna16_marlin``: one translation unit each, hundreds of kernel instantiations). A server
builds them one after the other on its first forward, each as one single-threaded nvcc:
14 minutes on the H100 host. Here both build at once, each nvcc splitting its work over
``--split-compile`` threads (``NVCC_APPEND_FLAGS``, read by nvcc itself; not part of
SGLang's cache key), into SGLang's JIT cache (``SGLANG_JIT_CACHE_DIR``, default
``~/.cache/sglang/jit``), where the server then finds them.

The template arguments are those ``fused_marlin_moe`` passes without expert parallelism
(sglang/srt/layers/moe/fused_moe_triton/fused_marlin_moe.py, 0.5.23): bf16 activations,
no bias, sorted expert ids with the inactive-prefix count; the second GEMM zeroes
inactive rows. Run with the stack's environment: ``python tests/gpu/prebuild_marlin.py``;
prints the seconds each took."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

# (is_ep, has_bias, expert_ids_are_sorted, zero_inactive_output, has_inactive_prefix_count)
GEMMS = {"gemm1 (w13)": (False, False, True, False, True), "gemm2 (w2)": (False, False, True, True, True)}


def _build(item):
    name, args = item
    import torch

    from sglang.kernels.ops.moe.moe_wna16_marlin import _jit_moe_wna16_marlin_module

    t0 = time.monotonic()
    _jit_moe_wna16_marlin_module(torch.bfloat16, *args)
    return name, round(time.monotonic() - t0, 1)


def main() -> int:
    threads = max(1, (os.cpu_count() or 2) // len(GEMMS))
    os.environ.setdefault("NVCC_APPEND_FLAGS", f"--split-compile={threads}")
    print(f"NVCC_APPEND_FLAGS={os.environ['NVCC_APPEND_FLAGS']}", flush=True)
    t0 = time.monotonic()
    with mp.get_context("spawn").Pool(len(GEMMS)) as pool:
        for name, took in pool.imap_unordered(_build, GEMMS.items()):
            print(f"{name}: {took} s", flush=True)
    print(f"marlin moe prebuilt in {time.monotonic() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
