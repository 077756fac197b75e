"""fp8 group (issue 22): the core cases against a server started with
``--dump-hidden-states-dtype fp8``, plus the fp8 layout and its size.

Every file is dequantized (``format.load(path, dequantize=True)``, float32) and compared
with HF's float32 forward. Tolerance: the bf16 one (checks.TOL_BLOCK / TOL_TOKEN) plus
fp8's quantization bound (sglang_ext/quant.py: |x' - x| <= 2^-4 |x| per normal element,
so ||x' - x|| <= 2^-4 ||x|| over any block; the subnormal term, 2^-10 x amax/448 per
element, is below 1e-4 of a row's norm for these hidden sizes): by the triangle inequality
||x' - ref|| <= 2^-4 (1 + tol) ||ref|| + tol ||ref||."""

from __future__ import annotations

import os

import pytest

import test_gpu_core
from testing.checks import TOL_BLOCK, TOL_TOKEN, Problems
from testing.server import ServerOptions

pytestmark = [pytest.mark.gpu, pytest.mark.models("llama", "deepseek")]  # kimi: the core group only

FP8_REL = 2.0 ** -4


def fp8_tol(tol: float) -> float:
    return tol + FP8_REL * (1 + tol) + 1e-4


@pytest.fixture(scope="module")
def server_options(pytestconfig):
    return ServerOptions(dump_dtype="fp8", cuda_graph=not pytestconfig.getoption("--no-cuda-graph"))


class TestCoreFp8(test_gpu_core.TestCore):
    """The core group's cases against the fp8 server, within the widened tolerance."""

    TOL = (fp8_tol(TOL_BLOCK), fp8_tol(TOL_TOKEN))

    def test_files_are_fp8_with_per_layer_scales(self, server, tiny_model, rng, record_property):
        """One 300-token prompt: float8_e4m3fn [T, L, H], float32 scales [T, L, 1] equal to
        each (token, slot)'s amax / 448 of the dequantized values, the metadata, and the
        file size: T x (L x H + 4 L + 8) bytes after the header (bf16: T x (2 L H + 8))."""
        import torch

        from sglang_ext import format as fmt

        ids = test_gpu_core.rand_ids(rng, 300)
        path = server.generate(ids, 1, None, False)["meta_info"]["hidden_states_path"]
        server.answered.add(os.path.basename(path))
        rec = fmt.load(path)
        t, slots, h = len(ids), len(tiny_model.layer_ids), tiny_model.hidden_size
        problems = Problems()
        if rec.hidden_states.dtype != torch.float8_e4m3fn or tuple(rec.hidden_states.shape) != (t, slots, h):
            problems.add(f"hidden_states {rec.hidden_states.dtype} {tuple(rec.hidden_states.shape)}")
        if rec.scales is None or tuple(rec.scales.shape) != (t, slots, 1):
            problems.add(f"scales {None if rec.scales is None else tuple(rec.scales.shape)}")
        else:
            amax = rec.hidden_states.float().abs().amax(2, keepdim=True)
            if not torch.all(amax == 448):  # every slot's largest element lands on e4m3's max
                problems.add(f"scaled amax not 448 in {(amax != 448).sum().item()} slots")
        if (rec.metadata.get("hidden_states_dtype"), rec.metadata.get("scale_layout")) != (
                "float8_e4m3fn", "per_token_per_layer"):
            problems.add(f"metadata {rec.metadata}")
        data = t * (slots * h + 4 * slots + 8)
        size = os.path.getsize(path)
        record_property("file_bytes", size)
        record_property("bf16_equivalent_bytes", t * (2 * slots * h + 8))
        if not 0 <= size - data <= 1 << 16:
            problems.add(f"file of {size} bytes for {data} bytes of tensors")
        problems.check(f"{tiny_model.name} fp8 layout")
