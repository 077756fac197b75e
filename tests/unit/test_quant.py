"""fp8 quantization (sglang_ext/quant.py) and fp8 files (format.file_layout / load).

References: the float32 input itself, element by element, against quant.py's stated bound
(2^-4 |x| + 2^-10 scale); hs-connectors' own dequantization formula; the files' bytes
read back with safetensors directly.
"""

import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dumpfiles import write_dump
from sglang_ext import format as fmt
from sglang_ext import quant


def rows_with_layer_scales(n=64, slots=4, hidden=256, seed=0):
    """[n, L*H] float32: slot magnitudes 1e-3 .. 1e3, one all-zero token, one all-zero
    slot, and a few values tiny against their slot's amax (e4m3's subnormal range)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, slots, hidden, generator=g) * torch.logspace(-3, 3, slots)[None, :, None]
    x[3] = 0
    x[5, 1] = 0
    x[7, 2, :8] = x[7, 2].abs().max() * 1e-5
    return x.reshape(n, slots * hidden)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_within_the_stated_bound_per_element(dtype):
    rows = rows_with_layer_scales().to(dtype)
    q, scales = quant.quantize_fp8(rows, 4)
    assert q.dtype == torch.float8_e4m3fn and q.shape == rows.shape
    assert scales.dtype == torch.float32 and scales.shape == (64, 4)
    x = rows.float().reshape(64, 4, -1)
    s = scales[..., None]
    got = quant.dequantize(q.reshape(64, 4, -1), s)
    err = (got - x).abs()
    bound = (2.0 ** -4 * x.abs() + 2.0 ** -10 * s) * (1 + 1e-6)
    assert (err <= bound).all(), f"worst excess {(err - bound).max()}"
    # the bound is not loose: rounding errors near 2^-4 relative do occur
    normal = x.abs() / s >= 2.0 ** -6
    rel = (err[normal] / x.abs()[normal]).max()
    assert 2.0 ** -5 < rel <= 2.0 ** -4
    # each slot's amax is represented exactly (448 * scale)
    assert torch.allclose(got.abs().amax(2), x.abs().amax(2), rtol=1e-6, atol=0)


def test_zero_slots_dequantize_to_exact_zeros_with_the_floor_scale():
    rows = rows_with_layer_scales()
    q, scales = quant.quantize_fp8(rows, 4)
    assert (scales[3] == quant.SCALE_FLOOR).all() and scales[5, 1] == quant.SCALE_FLOOR
    got = quant.dequantize(q.reshape(64, 4, -1), scales[..., None])
    assert torch.equal(got[3], torch.zeros_like(got[3])) and not got[5, 1].any()


def test_scales_match_hs_connectors_formula_per_layer():
    """hs-connectors' quantize_tensor_to_fp8 on one (token, slot) block is ours on it."""
    from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8

    rows = rows_with_layer_scales(n=8)
    q, scales = quant.quantize_fp8(rows, 4)
    x = rows.reshape(8, 4, -1)
    for t in range(8):
        for j in range(4):
            hq, hs = quantize_tensor_to_fp8(x[t, j][None])  # one "token" of H values
            assert hs.item() == scales[t, j].item()
            assert torch.equal(hq[0].view(torch.uint8), q.reshape(8, 4, -1)[t, j].view(torch.uint8))
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(quant.dequantize(q.reshape(8, 4, -1), scales[..., None], dtype),
                           dequantize_fp8_tensor(q.reshape(8, 4, -1), scales[..., None], dtype))


def test_row_width_not_a_multiple_of_the_slots_is_refused():
    with pytest.raises(ValueError, match=r"not \[n, 3 layer slots \* H\]"):
        quant.quantize_fp8(torch.zeros(2, 8), 3)
    with pytest.raises(ValueError, match=r"not \[n, 3 layer slots \* H\]"):
        quant.quantize_fp8(torch.zeros(2, 0), 3)


def test_fp8_file_layout_and_load(dump_dir):
    d, fd = dump_dir
    rows = rows_with_layer_scales(n=8, slots=3, hidden=16)
    q, scales = quant.quantize_fp8(rows, 3)
    hs, sc = q.reshape(8, 3, 16), scales.reshape(8, 3, 1)
    ids = torch.arange(8, dtype=torch.int64)
    res = fmt.reserve(fd, "r")
    meta = fmt.build_metadata(rid="r", layer_ids=[1, 2, 3], num_layers=3)
    size = write_dump(res, hs, ids, meta, scales=sc)
    fmt.complete(res)
    path = str(d / res.name)
    assert os.path.getsize(path) == size
    with safe_open(path, framework="pt") as f:
        assert list(f.keys()) == sorted(["hidden_states", "hidden_states_scales", "token_ids"])
        assert f.metadata()["hidden_states_dtype"] == "float8_e4m3fn"
        assert f.metadata()["scale_layout"] == "per_token_per_layer"
        assert torch.equal(f.get_tensor("hidden_states").view(torch.uint8), hs.view(torch.uint8))
        assert torch.equal(f.get_tensor("hidden_states_scales"), sc)
    rec = fmt.load(path)
    assert rec.hidden_states.dtype == torch.float8_e4m3fn and torch.equal(rec.scales, sc)
    assert torch.equal(fmt.load(path, dequantize=True).hidden_states, hs.float() * sc)
    assert torch.equal(fmt.load(path, dequantize=torch.bfloat16).hidden_states,
                       hs.to(torch.bfloat16) * sc.to(torch.bfloat16))


def test_fp8_without_scales_and_scales_of_the_wrong_shape_are_refused():
    hs = torch.zeros(2, 3, 4, dtype=torch.float8_e4m3fn)
    ids = torch.arange(2, dtype=torch.int64)
    with pytest.raises(fmt.DumpFormatError, match="need float32 scales"):
        fmt.check_tensors(hs, ids)
    with pytest.raises(fmt.DumpFormatError, match=r"must be float32 \[2, 3, 1\]"):
        fmt.check_tensors(hs, ids, torch.ones(2, 1, 1))
    with pytest.raises(fmt.DumpFormatError, match="take no hidden_states_scales"):
        fmt.check_tensors(hs.float(), ids, torch.ones(2, 3, 1))


def test_blocks_of_rows_give_the_same_result_and_leave_the_input_alone(monkeypatch):
    rows = rows_with_layer_scales(n=50, slots=4, hidden=32)
    before = rows.clone()
    q1, s1 = quant.quantize_fp8(rows, 4)
    monkeypatch.setattr(quant, "BLOCK_ELEMENTS", 3 * 128 + 5)  # 3 rows a block, 50 = 16 x 3 + 2
    q2, s2 = quant.quantize_fp8(rows, 4)
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2)
    assert torch.equal(rows, before)


def test_the_fused_kernel_is_used_only_where_it_agrees_with_the_torch_form(monkeypatch, caplog):
    """``quant_kernel.ready`` runs the kernel once per device on its probe and compares it
    bit for bit with ``quantize_fp8_torch``: a kernel that differs in one fp8 value is not
    used (one warning names the difference) and ``quantize_fp8`` keeps the torch form; on
    the CPU the kernel never runs (``usable`` is False for CPU rows). The kernel itself
    runs on the GPU only (tests/gpu/test_gpu_quant.py)."""
    from sglang_ext import quant_kernel

    def off_by_one_bit(rows, slots):
        q, s = quant.quantize_fp8_torch(rows, slots)
        q.view(torch.uint8).view(-1)[5] ^= 1
        return q, s

    monkeypatch.setattr(quant_kernel, "_READY", {})
    monkeypatch.setattr(quant_kernel, "quantize", off_by_one_bit)
    with caplog.at_level("WARNING", logger="sglang_ext.quant_kernel"):
        assert quant_kernel.ready("cpu") is False
        assert quant_kernel.ready("cpu") is False  # decided once
    warned = [r.getMessage() for r in caplog.records if "fused" in r.getMessage()]
    assert len(warned) == 1 and "differs from the torch form in 1 values" in warned[0]
    monkeypatch.setattr(quant_kernel, "quantize", quant.quantize_fp8_torch)
    monkeypatch.setattr(quant_kernel, "_READY", {})
    assert quant_kernel.ready("cpu") is True  # a kernel that agrees is taken...
    rows = quant_kernel.probe("cpu")
    assert not quant_kernel.usable(rows, 4)  # ...on CUDA rows only
    q, s = quant.quantize_fp8(rows, 4)
    rq, rs = quant.quantize_fp8_torch(rows, 4)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s.view(torch.int32), rs.view(torch.int32))


def test_the_probe_holds_ties_a_zero_slot_subnormals_nan_and_inf():
    """The probe the kernel must match (the torch form's answers on it): scaled by 1 (an
    amax of 448), 124, 13.5 and 2.125
    lie halfway between two e4m3 values, so only round-to-nearest-even gives the torch
    form's bits (128, 14 and 2); one slot is all zero (scale 1e-12, fp8 zeros); a slot of
    values up to 3e-5 beside a 1.0 quantizes them into e4m3's subnormals."""
    from sglang_ext import quant_kernel

    rows = quant_kernel.probe("cpu", torch.float32)
    q, s = quant.quantize_fp8_torch(rows, 4)
    q = q.view(12, 4, 160).float()
    assert s[3, 2] == 1.0 and q[3, 2, :6].tolist() == [448.0, 128.0, -128.0, 2.0, -2.0, 14.0]
    assert s[2, 1] == quant.SCALE_FLOOR and not q[2, 1].any()
    tiny = q[4, 0, 1:] * s[4, 0]
    assert 0 < tiny.abs().max() < 2 ** -6 * s[4, 0]  # below e4m3's smallest normal, not all zero
    # a NaN makes its slot NaN, scale and values (so a file shows it); +-Inf make the
    # slot's scale Inf and those two values NaN, the others 0
    assert s[5, 1].isnan() and q[5, 1].isnan().all()
    assert s[6, 0] == float("inf") and q[6, 0, 1:3].isnan().all() and not q[6, 0, 3:].any()


def test_the_kernels_scales_are_torch_cudas_amax_times_the_reciprocal(tmp_path):
    """The fused kernel's scales, run by Triton's CPU interpreter (its fp8 cast is not the
    GPU's, so only the scales are compared here): ``amax * float32(1/448)``, what torch's
    CUDA kernel computes for ``amax / 448`` (a division by a scalar is a multiplication by
    its reciprocal there), which differs from the exact quotient in the last bit of some
    scales; the kernel's first version took the quotient, and the GPU probe refused it."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from sglang_ext import quant, quant_kernel\n"
        "g = torch.Generator().manual_seed(5)\n"
        "rows = torch.cat([quant_kernel.probe('cpu', torch.float32),"
        " torch.randn(244, 640, generator=g) * torch.logspace(-3, 4, 4).repeat_interleave(160)])\n"
        "q, s = quant_kernel.quantize(rows, 4)\n"
        "amax = rows.view(-1, 4, 160).abs().amax(2)\n"
        "want = (amax * quant_kernel.INV_FP8_MAX).clamp(min=quant.SCALE_FLOOR)\n"
        "exact = (amax / torch.tensor(448.0)).clamp(min=quant.SCALE_FLOOR)\n"
        "same = (s == want) | (s.isnan() & want.isnan())  # the probe's NaN slot stays NaN\n"
        "assert s.isnan().sum() == 1 and s.isinf().sum() == 1\n"
        "print(int((~same).sum()), int((want != exact).sum()), s.numel())\n")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    differ, quotient_differs, total = map(int, out.stdout.split())
    assert total == 256 * 4 and differ == 0, f"{differ} of {total} scales are not amax * float32(1/448)"
    assert quotient_differs > 0  # the case the first version got wrong is in these rows


def test_quant_kernel_imports_nothing_of_quant():
    """Data flows one way: ``quant`` (the public face) uses ``quant_kernel``; importing the
    kernel module alone loads no ``sglang_ext.quant`` (they imported each other before)."""
    import subprocess
    import sys

    code = "import sys, sglang_ext.quant_kernel; print('sglang_ext.quant' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False", r.stdout
