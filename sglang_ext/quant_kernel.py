"""The fp8 quantization of ``quant`` in its two forms: torch operations
(``quantize_fp8_torch``, the reference) and one GPU kernel (Triton), for the scheduler's
hook. ``quant`` (the public face: ``quantize_fp8``, ``warm_up``, ``dequantize``) imports this
module; this one imports nothing of ``quant``.

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
a scalar through its reciprocal: ``INV_FP8_MAX``); the values by IEEE division
(``div_rn``, as torch's tensor-by-tensor CUDA division); the clamp to +-448; the cast to
e4m3 by round-to-nearest-even (Triton's default, as torch's). The first version divided
the amax by 448 exactly and differed from the torch form in the last bit of about half
the scales on the H200 (tests/gpu/results-2026-12-04-h200-v0.5.23-s7-pytest-quant.json),
which the probe caught: the server kept the torch form. ``ready``
checks that once per device on a probe that holds the hard cases (exact ties between two
e4m3 values, an all-zero slot, values in e4m3's subnormal range, a NaN and +-Inf,
magnitudes from 1e-3 to 1e4) before the kernel is used, and ``warm_up`` again in the
served shape and dtype; a device where it fails, or where Triton is missing, keeps the
torch form, with a warning. (Triton's CPU interpreter does not round fp8 casts
as the GPU does, so the kernel is checked on the GPU only: tests/gpu/test_gpu_quant.py.)
"""

from __future__ import annotations

import contextlib
import logging
from typing import Dict, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_FLOOR = 1e-12  # hs_connectors.fp8_utils' clamp: all-zero slots dequantize to 0
BLOCK_ELEMENTS = 1 << 24  # elements per block of rows in quantize_fp8 (64 MiB of float32)

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
        # NaN stays NaN as in torch's amax and clamp (Triton's max and min drop it by default)
        amax = tl.max(tl.abs(x), axis=0)
        amax = tl.where(tl.max((x != x).to(tl.int32), axis=0) > 0, float("nan"), amax)
        nan = tl.PropagateNan.ALL
        scale = tl.maximum(amax * inv_fp8_max, floor, propagate_nan=nan)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max, propagate_nan=nan), fp8_max,
                       propagate_nan=nan)
        tl.store(q_ptr + slot * h + offs, y.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + slot, scale)

    _KERNEL = (triton, fp8_rows)
    return _KERNEL


# float32(1) / float32(448) as a Python float (exactly that float32 value): the factor
# torch's CUDA division of a tensor by the scalar 448 multiplies by (BinaryDivTrueKernel.cu:
# a CPU scalar divisor becomes ``a * reciprocal(b)``), so the kernel's scales are the torch
# form's on the GPU bit for bit. Computed once: the hook launches the kernel every batch.
INV_FP8_MAX = (torch.ones((), dtype=torch.float32) / torch.tensor(FP8_MAX, dtype=torch.float32)).item()


def usable(rows: torch.Tensor, num_slots: int) -> bool:
    """Whether ``quantize`` takes ``rows`` (``[n, L*H]``, its shape checked by the caller,
    ``quant.quantize_fp8``): on a CUDA device, contiguous, ``H <= MAX_HIDDEN``, a device
    where ``ready`` passed."""
    if not rows.is_cuda or not rows.is_contiguous() or rows.shape[1] // num_slots > MAX_HIDDEN:
        return False
    return ready(rows.device)


def quantize(rows: torch.Tensor, num_slots: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``quant.quantize_fp8`` in one launch on the current CUDA stream of ``rows``'
    device: ``rows`` ``[n, L*H]`` (bf16, fp16 or fp32, contiguous, on a CUDA device) to
    ``(fp8 [n, L*H] float8_e4m3fn, scales [n, L] float32)``. The caller checks ``usable``
    first."""
    triton, fp8_rows = _kernel()
    n, width = rows.shape
    h = width // num_slots
    q = torch.empty((n, width), dtype=FP8_DTYPE, device=rows.device)
    scales = torch.empty((n, num_slots), dtype=torch.float32, device=rows.device)
    if n:
        block = triton.next_power_of_2(h)
        # Triton launches on the current device (CPU rows: the interpreter, in tests)
        with torch.cuda.device(rows.device) if rows.is_cuda else contextlib.nullcontext():
            fp8_rows[(n * num_slots,)](rows, q, scales, h, FP8_MAX, INV_FP8_MAX, SCALE_FLOOR,
                                        BLOCK=block, num_warps=max(1, min(16, block // 512)))
    return q, scales


def probe(device, dtype=torch.bfloat16, slots: int = 4, hidden: int = 160) -> torch.Tensor:
    """Rows ``[12, slots * hidden]`` (``hidden`` >= 8) of ``dtype`` on ``device`` holding
    what the kernel can get wrong: slots of magnitudes 1e-3, 1, 30 and 1e4 in turn (random,
    seeded); an all-zero slot; values at exact ties between two e4m3 values once scaled
    (an amax of 448 scales by 1: 124 lies between 120 and 128, 13.5 between 13 and 14,
    2.125 between 2 and 2.25); values far below their slot's amax (e4m3's subnormals once
    scaled); a NaN, and +-Inf (the torch form keeps them NaN)."""
    g = torch.Generator().manual_seed(39)
    mags = torch.tensor([1e-3, 1.0, 30.0, 1e4]).repeat(slots)[:slots].repeat_interleave(hidden)
    rows = torch.randn(12, slots * hidden, generator=g) * mags
    h = hidden

    def at(row, slot):
        return row, slice((slot % slots) * h, (slot % slots) * h + h)

    rows[at(2, 1)] = 0.0
    ties = torch.tensor([448.0, 124.0, -124.0, 2.125, -2.125, 13.5, 0.01, -0.0039])
    r, cols = at(3, 2)
    rows[r, cols.start:cols.start + len(ties)] = ties
    rows[r, cols.start + len(ties):cols.stop] = rows[r, cols.start + len(ties):cols.stop].clamp(-400, 400)
    r, cols = at(4, 0)
    rows[r, cols] = torch.linspace(-1.0, 1.0, h) * 3e-5  # scaled by 448: below 2^-6, e4m3 subnormals
    rows[r, cols.start] = 1.0
    r, cols = at(5, 1)
    rows[r, cols.start + 3] = float("nan")
    r, cols = at(6, 0)
    rows[r, cols.start + 1], rows[r, cols.start + 2] = float("inf"), float("-inf")
    return rows.to(dtype).to(device)


def _differs(device, dtype, slots: int, hidden: int) -> Optional[str]:
    """Why the kernel's output differs from the torch form on ``probe`` rows of this
    shape and dtype (bit for bit, scales included, NaN payloads too), or None."""
    rows = probe(device, dtype, slots, hidden)
    q, s = quantize(rows, slots)
    rq, rs = quantize_fp8_torch(rows, slots)
    bad = int((q.view(torch.uint8) != rq.view(torch.uint8)).sum()) + int((s.view(torch.int32) != rs.view(torch.int32)).sum())
    return f"it differs from the torch form in {bad} values ({dtype}, {slots} x {hidden})" if bad else None


def warm_up(device, num_slots: int, hidden_size: int, dtype: torch.dtype) -> bool:
    """At start-up, off any request's path: ``ready`` on ``device``, then the probe again
    in the shape and dtype batches will have (``num_slots`` x ``hidden_size`` values of
    ``dtype``: Triton compiles per block size and dtype, and the kernel that runs must be
    the one that agreed; compiling it in a batch's hook would also stall the scheduler for
    a second or more). Returns whether the kernel will be used."""
    if hidden_size > MAX_HIDDEN or hidden_size < 8 or not ready(device):
        return False
    try:
        why = _differs(device, dtype, num_slots, hidden_size)
    except Exception as e:  # noqa: BLE001 - the probe's block size compiled, this one did not
        why = f"{type(e).__name__}: {e}"
    if why is not None:
        refuse(device, why)
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
    why: Optional[str] = None
    try:
        for dtype in (torch.bfloat16, torch.float32):
            why = _differs(device, dtype, 4, 160)
            if why is not None:
                break
    except Exception as e:  # noqa: BLE001 - no Triton, no compiler, an old GPU: the torch form
        why = f"{type(e).__name__}: {e}"
    if why is not None:
        refuse(device, why)
        return False
    _READY[key] = True
    return True


def _check(rows: torch.Tensor, num_slots: int) -> None:
    if rows.dim() != 2 or num_slots < 1 or rows.shape[1] < num_slots or rows.shape[1] % num_slots:
        raise ValueError(f"rows of shape {tuple(rows.shape)} are not [n, {num_slots} layer slots * H]")


def quantize_fp8_torch(rows: torch.Tensor, num_slots: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``quant.quantize_fp8`` in torch operations, the reference the fused kernel is held to.
    Works through blocks of rows so the float32 temporaries stay near
    ``BLOCK_ELEMENTS`` x 4 bytes however large the batch (on the GPU: ~64 MiB beside the
    fp8 output, not 4 bytes per element of a whole prefill chunk). Raises ``ValueError``
    as ``quantize_fp8``."""
    _check(rows, num_slots)
    n, width = rows.shape
    h = width // num_slots
    q = torch.empty((n, width), dtype=FP8_DTYPE, device=rows.device)
    scales = torch.empty((n, num_slots), dtype=torch.float32, device=rows.device)
    step = max(1, BLOCK_ELEMENTS // max(width, 1))
    for i in range(0, n, step):
        x = rows[i:i + step].reshape(-1, num_slots, h).to(torch.float32, copy=True)
        s = (x.abs().amax(dim=2, keepdim=True) / FP8_MAX).clamp_(min=SCALE_FLOOR)
        q[i:i + step].view(-1, num_slots, h).copy_(x.div_(s).clamp_(-FP8_MAX, FP8_MAX))
        scales[i:i + step].copy_(s.view(-1, num_slots))
    return q, scales
