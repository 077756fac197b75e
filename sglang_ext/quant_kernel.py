"""The fp8 quantization of ``quant`` in one GPU kernel (Triton), for the scheduler's hook.

Why: ``quant.quantize_fp8``'s torch form launches about nine kernels per block of rows
(cast, abs, amax, divisions, clamps, casts), and the hook launches them on the scheduler's
thread, where at concurrency 1 every microsecond is the answer's: on the H200 an fp8
dump's hook took 0.3-0.4 ms more than a bf16 one's (bench/results/
2026-12-04-h200-latency4-llama-8b.md, "Where the time goes"), which made fp8 files slower
than bf16 ones at 512 tokens x 1. One program per (token, layer slot) loads its ``H``
values once, takes their amax and writes the fp8 values and the scale: one launch, one
pass over the rows.

Same numbers as the torch form on the GPU, bit for bit: float32 throughout; the scale as
torch's CUDA kernel computes ``amax / 448``, i.e. ``amax * float32(1/448)`` (it divides by
a scalar through its reciprocal: ``inv_fp8_max``); the values by IEEE division
(``div_rn``, as torch's tensor-by-tensor CUDA division); the clamp to +-448; the cast to
e4m3 by round-to-nearest-even (Triton's default, as torch's). The first version divided
the amax by 448 exactly and differed from the torch form in the last bit of about half
the scales on the H200 (tests/gpu/results-2026-12-04-h200-v0.5.23-s7-pytest-quant.json),
which the probe caught: the server kept the torch form. ``ready``
checks that once per device on a probe that holds the hard cases (exact ties between two
e4m3 values, an all-zero slot, values in e4m3's subnormal range, magnitudes from 1e-3 to
1e4) before the kernel is used; a device where it fails, or where Triton is missing,
keeps the torch form, with a warning. (Triton's CPU interpreter does not round fp8 casts
as the GPU does, so the kernel is checked on the GPU only: tests/gpu/test_gpu_quant.py.)
"""

from __future__ import annotations

import logging
from typing import Dict, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

MAX_HIDDEN = 16384  # one program holds a slot's H values in registers: wider rows take the torch form
_READY: Dict[str, bool] = {}  # device -> the kernel agreed with the torch form there
_KERNEL = None


def _kernel():
    """The Triton kernel, compiled on first use (imported lazily: CPU-only clients and
    tests never import Triton)."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_rows(x_ptr, q_ptr, s_ptr, h, fp8_max, inv_fp8_max, floor, BLOCK: tl.constexpr):
        slot = tl.program_id(0).to(tl.int64)  # one (token, layer slot): h contiguous values
        offs = tl.arange(0, BLOCK)
        mask = offs < h
        x = tl.load(x_ptr + slot * h + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) * inv_fp8_max, floor)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)
        tl.store(q_ptr + slot * h + offs, y.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + slot, scale)

    _KERNEL = (triton, fp8_rows)
    return _KERNEL


def inv_fp8_max() -> float:
    """float32(1) / float32(448), as a Python float (exactly that float32 value): the
    factor torch's CUDA division of a tensor by the scalar 448 multiplies by
    (BinaryDivTrueKernel.cu: a CPU scalar divisor becomes ``a * reciprocal(b)``), so the
    kernel's scales are the torch form's on the GPU bit for bit."""
    from sglang_ext.quant import FP8_MAX

    return (torch.ones((), dtype=torch.float32) / torch.tensor(FP8_MAX, dtype=torch.float32)).item()


def usable(rows: torch.Tensor, num_slots: int) -> bool:
    """Whether ``quantize`` takes ``rows`` (``[n, L*H]`` on a CUDA device, contiguous,
    ``H <= MAX_HIDDEN``) on a device where ``ready`` passed."""
    if not rows.is_cuda or rows.dim() != 2 or not rows.is_contiguous() or num_slots < 1:
        return False
    if rows.shape[1] % num_slots or rows.shape[1] // num_slots > MAX_HIDDEN:
        return False
    return ready(rows.device)


def quantize(rows: torch.Tensor, num_slots: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``quant.quantize_fp8`` in one launch on the current CUDA stream: ``rows``
    ``[n, L*H]`` (bf16, fp16 or fp32, contiguous, on a CUDA device) to ``(fp8 [n, L*H]
    float8_e4m3fn, scales [n, L] float32)``. The caller checks ``usable`` first."""
    from sglang_ext.quant import FP8_DTYPE, FP8_MAX, SCALE_FLOOR

    triton, fp8_rows = _kernel()
    n, width = rows.shape
    h = width // num_slots
    q = torch.empty((n, width), dtype=FP8_DTYPE, device=rows.device)
    scales = torch.empty((n, num_slots), dtype=torch.float32, device=rows.device)
    if n:
        block = triton.next_power_of_2(h)
        fp8_rows[(n * num_slots,)](rows, q, scales, h, FP8_MAX, inv_fp8_max(), SCALE_FLOOR, BLOCK=block,
                                    num_warps=max(1, min(16, block // 512)))
    return q, scales


def probe(device, dtype=torch.bfloat16) -> torch.Tensor:
    """Rows ``[12, 4 * 160]`` of ``dtype`` on ``device`` holding what the cast can get wrong:
    four slots of magnitudes 1e-3, 1, 30 and 1e4 (random, seeded), an all-zero slot,
    values at exact ties between two e4m3 values once scaled (an amax of 448 scales by 1:
    124 lies between 120 and 128, 13.5 between 13 and 14, 2.125 between 2 and 2.25), and
    values far below a slot's amax (e4m3's subnormals once scaled)."""
    g = torch.Generator().manual_seed(39)
    rows = torch.randn(12, 4 * 160, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1e4]).repeat_interleave(160)
    rows[2, 160:320] = 0.0
    ties = torch.tensor([448.0, 124.0, -124.0, 2.125, -2.125, 13.5, 0.01, -0.0039])
    rows[3, 320:320 + len(ties)] = ties
    rows[4, :160] = torch.linspace(-1.0, 1.0, 160) * 3e-5  # scaled by 448: below 2^-6, e4m3 subnormals
    rows[4, 0] = 1.0
    return rows.to(dtype).to(device)


def warm_up(device, num_slots: int, hidden_size: int, dtype: torch.dtype) -> bool:
    """At start-up, off any request's path: ``ready`` on ``device``, then one launch for
    rows of ``hidden_size`` values of ``dtype`` per slot, so the kernel that batches use
    is compiled (Triton compiles per block size and dtype on first launch, which in a
    batch's hook would stall the scheduler for a second or more). Returns whether the
    kernel will be used."""
    if hidden_size > MAX_HIDDEN or not ready(device):
        return False
    try:
        quantize(torch.zeros((1, num_slots * hidden_size), dtype=dtype, device=device), num_slots)
    except Exception as e:  # noqa: BLE001 - the probe's block size compiled, this one did not
        refuse(device, f"{type(e).__name__}: {e}")
        return False
    return True


def refuse(device, why: str) -> None:
    """Use the torch form on ``device`` from now on, saying why (once per call)."""
    _READY[str(torch.device(device))] = False
    logger.warning("hidden-state dump: fp8 rows are quantized by several torch kernels on %s, "
                   "not the fused one (%s)", torch.device(device), why[:300])


def ready(device) -> bool:
    """Whether the kernel runs on ``device`` and agrees bit for bit with the torch form on
    ``probe`` (bf16 and float32 rows); decided once per device, logged when it does not."""
    key = str(torch.device(device))
    if key in _READY:
        return _READY[key]
    from sglang_ext.quant import quantize_fp8_torch

    why: Optional[str] = None
    try:
        for dtype in (torch.bfloat16, torch.float32):
            rows = probe(device, dtype)
            q, s = quantize(rows, 4)
            rq, rs = quantize_fp8_torch(rows, 4)
            if not (torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)):
                bad = int((q.view(torch.uint8) != rq.view(torch.uint8)).sum()) + int((s != rs).sum())
                why = f"it differs from the torch form in {bad} values ({dtype})"
                break
    except Exception as e:  # noqa: BLE001 - no Triton, no compiler, an old GPU: the torch form
        why = f"{type(e).__name__}: {e}"
    if why is not None:
        refuse(device, why)
        return False
    _READY[key] = True
    return True
