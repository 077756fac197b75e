"""fp8 hidden states: per-token, per-layer-slot ``float8_e4m3fn`` with float32 scales.

``--dump-hidden-states-dtype fp8`` quantizes a batch's rows on the scheduler's device
(the GPU in a server) before the device-to-host copy, so the copy, the write and the
file are about half the bf16 size. The convention is hs-connectors 0.9.0's
(``hs_connectors.fp8_utils``, used by its ``FP8HiddenStatesConnector`` and read back by
``hs_connectors.transfer.FP8Transfer``, speculators' ``--hidden-states-backend fp8``):

- quantize: ``scale = max(amax / 448, 1e-12)``, ``fp8 = (x.float() / scale).to(float8_e4m3fn)``
- dequantize: ``x' = fp8.to(dtype) * scale.to(dtype)`` (any broadcastable scale shape)

with one difference: hs-connectors takes one amax per token over all layers
(``[T, 1, 1]``); we take one per token *and layer slot* (``[T, L, 1]``), because the
layers' magnitudes differ by orders of magnitude (the last layers' residual streams are
far larger than the early ones'), and one scale per token would push the small layers
into e4m3's subnormal range. ``FP8Transfer`` broadcasts either shape. Files say so in
their metadata (``format.SCALE_LAYOUT``).

An all-zero (token, slot) has amax 0, so its scale is the 1e-12 floor (as in
hs-connectors) and every element quantizes to 0 and dequantizes to exactly 0.

Error bound (``dequantize`` in float32, against the float32 value of the input):
e4m3 keeps 3 explicit mantissa bits, so round-to-nearest moves a value whose scaled
magnitude ``|x| / scale`` is in the normal range (>= 2^-6) by at most half an ulp,
``2^-4`` of its magnitude; below 2^-6 (subnormals, spacing 2^-9) the error is at most
``2^-10`` in scaled units. Per element::

    |x' - x| <= 2^-4 * |x| + 2^-10 * scale

(the float32 division and product add relative errors of order 2^-24). Dequantizing to
bf16 (``FP8Transfer``'s default) rounds the scale and the product to bf16 as well: two bf16
roundings (2^-9 each) of a value up to ``(1 + 2^-4) |x|``, so at most ``2^-7`` relative
more. Values scaled to 448 exactly (each slot's amax) are exact
up to float32 rounding; the cast is clamped to +-448 so a rounding of the division above
448 can never become NaN (e4m3fn has no infinity).
"""

from __future__ import annotations

from typing import Tuple

import torch

# The convention's constants and the torch form live with the kernel that is held to them
# (``quant_kernel``, which imports nothing of this module); here they are re-exported.
from sglang_ext import quant_kernel
from sglang_ext.quant_kernel import (  # noqa: F401
    BLOCK_ELEMENTS, FP8_DTYPE, FP8_MAX, SCALE_FLOOR, _check, quantize_fp8_torch)


def quantize_fp8(rows: torch.Tensor, num_slots: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``rows`` (``[n, L*H]``, bf16/fp16/fp32, on any device) to fp8.

    ``num_slots`` is L, the layer slots in one row (the row is ``L`` blocks of ``H``).
    Returns ``(fp8 [n, L*H] float8_e4m3fn, scales [n, L] float32)``, both contiguous and
    on ``rows``' device, with ``rows ~= fp8.view(n, L, H).float() * scales[..., None]``
    (error bound: module docstring); ``rows`` is not modified. Runs on the current CUDA
    stream for CUDA tensors: in one fused kernel where ``quant_kernel.usable`` says so
    (it gives the same bits; a launch that fails turns it off for the device, with a
    warning), else as ``quantize_fp8_torch``.
    Raises ``ValueError`` when the row width is not a multiple of ``num_slots``.
    """
    _check(rows, num_slots)
    if rows.is_cuda:
        if quant_kernel.usable(rows, num_slots):
            try:
                return quant_kernel.quantize(rows, num_slots)
            except Exception as e:  # noqa: BLE001 - e.g. a block size that does not compile
                quant_kernel.refuse(rows.device, f"{type(e).__name__}: {e}")
    return quantize_fp8_torch(rows, num_slots)


def warm_up(device, num_slots: int, hidden_size: int, dtype: torch.dtype) -> bool:
    """Before the first batch (the session's start): decide and compile the fused kernel
    ``quantize_fp8`` takes for CUDA rows of ``num_slots`` x ``hidden_size`` ``dtype``
    values (``quant_kernel.warm_up``). True when it will be used; False (and a warning
    where it failed) when the torch form stays."""
    return quant_kernel.warm_up(device, num_slots, hidden_size, dtype)


def dequantize(fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fp8.to(dtype) * scales.to(dtype)``: hs-connectors' ``dequantize_fp8_tensor``
    formula, so the result equals ``FP8Transfer``'s for the same ``dtype``.

    ``fp8``: ``[T, L, H]`` float8_e4m3fn; ``scales``: broadcastable to it (ours
    ``[T, L, 1]`` float32). Returns ``[T, L, H]`` of ``dtype`` (float32: the accurate
    one, see the module docstring's bound)."""
    return fp8.to(dtype) * scales.to(dtype)
