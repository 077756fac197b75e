"""The fused fp8 kernel (sglang_ext.quant_kernel) on the GPU, bit for bit against the torch
form (quant.quantize_fp8_torch, itself checked on the CPU against hs-connectors' formula
and the error bound: tests/unit/test_quant.py). No server: ``-k quant`` runs it alone.

Cases: the kernel's own probe (ties between e4m3 values, an all-zero slot, subnormals,
a NaN and +-Inf) at its shape and the served ones,
a prefill batch of Llama-3.1-8B's shape (2048 tokens x 4 slots x 4096, bf16) and of
Kimi-K2.5's (512 x 4 x 7168: H not a power of two, so the last block is masked), random
rows at 1e-3..1e4, fp16 and float32 rows, an empty batch; and that the writer's path
(``quant.quantize_fp8`` on a CUDA tensor) takes the kernel."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sglang_ext import quant, quant_kernel  # noqa: E402

pytestmark = pytest.mark.gpu


def _rows(n, slots, h, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    mags = torch.logspace(-3, 4, slots).repeat_interleave(h)
    return (torch.randn(n, slots * h, generator=g) * mags).to(dtype).cuda()


def _same(rows, slots):
    q, s = quant_kernel.quantize(rows, slots)
    rq, rs = quant.quantize_fp8_torch(rows, slots)
    diff_q = int((q.view(torch.uint8) != rq.view(torch.uint8)).sum())
    diff_s = int((s.view(torch.int32) != rs.view(torch.int32)).sum())  # bits: NaN scales too
    assert diff_q == 0 and diff_s == 0, (
        f"{tuple(rows.shape)} {rows.dtype}: {diff_q} fp8 values and {diff_s} scales differ from the torch form")
    return q, s


def test_kernel_is_ready_on_this_gpu():
    assert quant_kernel.ready(torch.device("cuda", 0)), "the fused kernel failed its probe (see the warning)"


@pytest.mark.parametrize("n,slots,h,dtype", [
    (2048, 4, 4096, torch.bfloat16),   # llama-8b, a 2k prefill
    (512, 4, 7168, torch.bfloat16),    # Kimi-K2.5's hidden size: a masked last block
    (37, 3, 1000, torch.float16),
    (64, 4, 4096, torch.float32),
    (0, 4, 4096, torch.bfloat16),
], ids=["llama-8b-2k", "kimi-512", "fp16-odd", "fp32", "empty"])
def test_kernel_equals_the_torch_form(n, slots, h, dtype):
    rows = _rows(n, slots, h, dtype, seed=n + h)
    q, s = _same(rows, slots)
    assert q.shape == (n, slots * h) and s.shape == (n, slots) and q.dtype == quant.FP8_DTYPE
    if n:  # and within the format's error bound of the rows
        back = quant.dequantize(q.view(n, slots, h), s[..., None]).float()
        ref = rows.view(n, slots, h).float()
        assert torch.all((back - ref).abs() <= 2 ** -4 * ref.abs() + 2 ** -10 * s[..., None] * 1.0001)


def test_probe_rows_equal_the_torch_form():
    """The probe (NaN and +-Inf included) at its own shape and at the served ones."""
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        _same(quant_kernel.probe("cuda", dtype), 4)
    for slots, hidden in ((4, 4096), (4, 7168), (3, 1000)):
        _same(quant_kernel.probe("cuda", torch.bfloat16, slots, hidden), slots)


def test_warm_up_takes_the_served_shape():
    assert quant_kernel.warm_up(torch.device("cuda", 0), 4, 4096, torch.bfloat16)


def test_the_writer_path_takes_the_kernel(monkeypatch):
    rows = _rows(16, 4, 4096, torch.bfloat16, seed=1)
    calls = []
    real = quant_kernel.quantize
    monkeypatch.setattr(quant_kernel, "quantize", lambda r, k: calls.append(r.shape) or real(r, k))
    q, s = quant.quantize_fp8(rows, 4)
    assert calls == [rows.shape]
    rq, rs = quant.quantize_fp8_torch(rows, 4)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
