"""Reading a dump file: its header (``read_header``, bounded and parsed defensively) and
its tensors (``load``)."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, Dict, Tuple

from .keys import KEY_HIDDEN_STATES, KEY_TOKEN_IDS, KEY_SCALES
from .files import DumpFormatError, open_regular
from .layout import check_tensors

__all__ = ["DumpRecord", "load", "MAX_HEADER_BYTES", "read_header"]


@dataclass
class DumpRecord:
    """One file, loaded: torch tensors (numpy arrays where torch is not installed: see
    ``load``) plus the metadata dict."""

    hidden_states: Any  # torch.Tensor [T, L, H]
    token_ids: Any  # torch.Tensor int64 [T]
    metadata: Dict[str, str]
    scales: Any = None  # fp8 files loaded as stored: float32 [T, L, 1]

    @property
    def layer_ids(self) -> list:
        return json.loads(self.metadata["layer_ids"])


def load(path: str, dequantize: Any = False) -> DumpRecord:
    """Read one dump file; raises ``DumpFormatError`` if it breaks the contract: missing
    keys, shapes or dtypes (``check_tensors``), or ``layer_ids`` metadata that is not a
    sorted list of distinct ids, one per layer slot. Files without our metadata (e.g.
    vLLM's) load with ``metadata == {}``.

    fp8 files (``hidden_states_scales`` present): ``dequantize=False`` returns
    ``hidden_states`` float8_e4m3fn and ``scales`` float32 ``[T, L, 1]`` as stored;
    ``True`` returns float32 ``hidden_states = fp8 * scale`` (``quant.dequantize``) and
    ``scales=None``; a torch dtype (``torch.bfloat16``) dequantizes to that dtype, as
    hs-connectors' ``FP8Transfer`` does. Other files ignore ``dequantize``.

    Without torch (a client's light install) the same checks hold and numpy arrays come
    back: ``token_ids`` int64, ``hidden_states`` float32 holding the stored values exactly
    (bf16 widened bit for bit; fp8 decoded through a table of e4m3's 256 values; other
    dtypes as stored), ``scales`` float32; any ``dequantize`` but ``False`` gives float32
    ``fp8 * scale``, the same numbers as torch's float32 dequantization.

    Anything the safetensors library refuses (a header too long or not JSON, offsets past
    the end of a truncated file, an unknown dtype) is ``DumpFormatError`` naming ``path``
    too. ``path`` may be a symlink; what it names must be a regular file (a FIFO is
    refused with ``OSError``, never waited on). ``FileNotFoundError`` and other
    ``OSError`` when it cannot be opened.
    """
    try:
        import torch  # noqa: F401 - safetensors' torch reader below needs it
    except ImportError:
        return _load_numpy(path, dequantize)
    from safetensors import SafetensorError, safe_open

    fd = open_regular(path, os.O_RDONLY, follow=True)
    try:
        # Through the descriptor checked above, so nothing swapped in at ``path`` since
        # (a FIFO) is opened by the library.
        with safe_open(f"/proc/self/fd/{fd}", framework="pt") as f:
            keys = set(f.keys())
            missing = {KEY_HIDDEN_STATES, KEY_TOKEN_IDS} - keys
            if missing:
                raise DumpFormatError(f"{path}: missing keys {sorted(missing)}")
            meta = f.metadata() or {}
            hs = f.get_tensor(KEY_HIDDEN_STATES)
            ids = f.get_tensor(KEY_TOKEN_IDS)
            scales = f.get_tensor(KEY_SCALES) if KEY_SCALES in keys else None
    except DumpFormatError:
        raise
    except (SafetensorError, ValueError, TypeError, RuntimeError, OverflowError,
            RecursionError, KeyError) as e:
        # RuntimeError / TypeError: torch refusing what the header declares.
        raise DumpFormatError(f"{path}: not a readable safetensors file "
                              f"({type(e).__name__}: {e})") from None
    finally:
        os.close(fd)
    check_tensors(hs, ids, scales)
    _check_layer_ids(path, meta, hs.shape[1])
    if scales is not None and dequantize is not False:
        import torch

        from sglang_ext.quant import dequantize as dequantize_fp8

        hs = dequantize_fp8(hs, scales, torch.float32 if dequantize is True else dequantize)
        scales = None
    return DumpRecord(hidden_states=hs, token_ids=ids, metadata=dict(meta), scales=scales)


def _check_layer_ids(path: str, meta: Dict[str, str], num_slots: int) -> None:
    """``DumpFormatError`` unless ``layer_ids`` (when the metadata has it) is a sorted list
    of ``num_slots`` distinct ints."""
    if "layer_ids" in meta:
        try:
            layer_ids = json.loads(meta["layer_ids"])
        except (ValueError, RecursionError):
            layer_ids = None
        if (
            not isinstance(layer_ids, list)
            or not all(isinstance(k, int) and not isinstance(k, bool) for k in layer_ids)
            or layer_ids != sorted(set(layer_ids))
            or len(layer_ids) != num_slots
        ):
            value = meta["layer_ids"]  # a hostile file's may be megabytes: 80 characters told
            shown = repr(value[:80]) + (f" ({len(value)} characters)" if len(value) > 80 else "")
            raise DumpFormatError(
                f"{path}: metadata layer_ids {shown} is not a sorted list of "
                f"{num_slots} distinct layer ids (one per slot)"
            )


# Reading without torch: safetensors' dtype codes numpy holds as they are; BF16 and
# F8_E4M3 (no numpy dtype) are decoded to float32 exactly by ``_decode``.
_NUMPY_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4",
                 "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?", "BF16": "<u2", "F8_E4M3": "u1"}


def _e4m3_values(np) -> Any:
    """float32 [256]: the value of each float8_e4m3fn byte (sign, 4 exponent bits of bias
    7, 3 mantissa bits; exponent 0 subnormal; S.1111.111 NaN, no infinities)."""
    b = np.arange(256)
    e, m = (b >> 3) & 15, (b & 7) / 8.0
    value = np.where(e == 0, m * 2.0 ** -6, (1 + m) * 2.0 ** (e - 7.0))
    value = np.where(b & 0x80, -value, value)
    value[(b & 0x7F) == 0x7F] = np.nan
    return value.astype(np.float32)


def _read_array(np, fd: int, path: str, key: str, entry: Any, start: int, size: int):
    """``(dtype code, array)`` of tensor ``key`` from its header ``entry``, data at file
    offset ``start`` + its ``data_offsets``; ``DumpFormatError`` for an entry that does
    not describe bytes inside the file."""
    entry = entry if isinstance(entry, dict) else {}
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if code not in _NUMPY_DTYPES:
        raise DumpFormatError(f"{path}: {key} is {code}, which is read only with torch "
                              f"installed (pip install torch)")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2
            and all(type(o) is int for o in offsets)):
        raise DumpFormatError(f"{path}: {key} has no shape and data_offsets of non-negative ints")
    width = np.dtype(_NUMPY_DTYPES[code])
    begin, end = offsets
    if not 0 <= begin <= end or end - begin != math.prod(shape) * width.itemsize or start + end > size:
        raise DumpFormatError(f"{path}: {key}'s data_offsets {offsets} do not hold {code} "
                              f"{shape} inside the file ({size} bytes)")
    raw = np.empty(end - begin, np.uint8)
    view, pos = memoryview(raw), start + begin
    while view:
        got = os.preadv(fd, [view], pos)
        if got <= 0:
            raise DumpFormatError(f"{path}: the file shrank while {key} was read")
        view, pos = view[got:], pos + got
    try:
        array = raw.view(width).reshape(shape)
    except ValueError as e:  # dimensions whose product numpy cannot index, next to a 0
        raise DumpFormatError(f"{path}: {key} of shape {shape}: {e}") from None
    if code == "BF16":  # a bf16 value is the top half of the float32 of the same value
        array = (array.astype(np.uint32) << 16).view(np.float32)
    elif code == "F8_E4M3":
        array = _e4m3_values(np)[array]
    return code, array


def _check_tiling(path: str, header: Dict[str, Any], data_bytes: int) -> None:
    """The tensors' ``data_offsets`` tile the data section, as safetensors requires (its
    loader, torch's path, refuses overlaps, gaps and bytes past the last tensor):
    sorted, the first at 0, each where the one before ends, the last at ``data_bytes``.
    Raises ``DumpFormatError``."""
    spans = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise DumpFormatError(f"{path}: {key} has no data_offsets of two ints")
        spans.append((offsets[0], offsets[1], key))
    end = 0
    for begin, stop, key in sorted(spans):
        if begin != end:
            raise DumpFormatError(f"{path}: {key}'s data_offsets [{begin}, {stop}] "
                                  f"{'overlap' if begin < end else 'leave a gap after'} the tensor before")
        end = stop
    if end != data_bytes:
        raise DumpFormatError(f"{path}: the tensors end at {end} of a {data_bytes}-byte data section")


def _load_numpy(path: str, dequantize: Any) -> DumpRecord:
    """``load`` where torch is not installed: numpy arrays, the same checks."""
    try:
        import numpy as np
    except ImportError:
        raise ImportError("reading a dump file needs numpy (pip install numpy) or torch") from None
    fd = open_regular(path, os.O_RDONLY, follow=True)
    try:
        header, start = _read_header_fd(fd, path)
        missing = {KEY_HIDDEN_STATES, KEY_TOKEN_IDS} - set(header)
        if missing:
            raise DumpFormatError(f"{path}: missing keys {sorted(missing)}")
        size = os.fstat(fd).st_size
        _check_tiling(path, header, size - start)
        read = {key: _read_array(np, fd, path, key, header[key], start, size)
                for key in (KEY_HIDDEN_STATES, KEY_SCALES, KEY_TOKEN_IDS) if key in header}
    finally:
        os.close(fd)
    (hs_code, hs), (ids_code, ids) = read[KEY_HIDDEN_STATES], read[KEY_TOKEN_IDS]
    scales_code, scales = read.get(KEY_SCALES, (None, None))
    if hs.ndim != 3:
        raise DumpFormatError(f"{path}: hidden_states must be [num_tokens, num_layers, "
                              f"hidden_size], got shape {hs.shape}")
    if ids.ndim != 1 or ids_code != "I64":
        raise DumpFormatError(f"{path}: token_ids must be int64 [num_tokens], got {ids_code} {ids.shape}")
    if hs.shape[0] != ids.shape[0]:
        raise DumpFormatError(f"{path}: hidden_states has {hs.shape[0]} rows for {ids.shape[0]} token ids")
    if (hs_code == "F8_E4M3") != (scales is not None):
        raise DumpFormatError(f"{path}: hidden_states of {hs_code} " + (
            "need float32 scales [T, L, 1] (hidden_states_scales)" if scales is None
            else "take no hidden_states_scales"))
    if scales is not None and (scales_code != "F32" or scales.shape != (*hs.shape[:2], 1)):
        raise DumpFormatError(f"{path}: hidden_states_scales must be float32 "
                              f"{[*hs.shape[:2], 1]}, got {scales_code} {list(scales.shape)}")
    meta = header.get("__metadata__", {})
    _check_layer_ids(path, meta, hs.shape[1])
    if scales is not None and dequantize is not False:
        hs, scales = hs * scales, None
    return DumpRecord(hidden_states=hs, token_ids=ids, metadata=dict(meta), scales=scales)


# The longest header read: safetensors' own limit (``MAX_HEADER_SIZE = 100_000_000`` in
# the Rust crate's src/tensor.rs; its readers refuse a longer one as ``HeaderTooLarge``).
MAX_HEADER_BYTES = 100_000_000
# safetensors' numbers are u64 (shapes, offsets): at most 20 digits.
_MAX_INT_DIGITS = 20


def _header_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise ValueError(f"integer of {len(text)} digits")
    return int(text)


def _header_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:32]} out of range")
    return value


def _header_constant(text: str) -> float:
    raise ValueError(f"{text} is not JSON")


def read_header(dir_fd: int, name: str) -> Dict[str, Any]:
    """The JSON header of safetensors file ``name`` in the dump directory (tensor entries
    and ``__metadata__``), without reading the tensors.

    Raises ``DumpFormatError`` naming the file for a file too short, a header length over
    ``MAX_HEADER_BYTES`` (safetensors' limit) or past the end of the file, a header that
    is not UTF-8 JSON (nesting too deep for the parser, NaN/Infinity, numbers no u64 or
    finite float holds), not an object, or whose ``__metadata__`` is not a str -> str
    object; ``OSError`` when it cannot be read or is not a regular file (never blocks on
    a FIFO, never follows a symlink).
    """
    fd = open_regular(name, os.O_RDONLY, dir_fd=dir_fd)
    try:
        return _read_header_fd(fd, name)[0]
    finally:
        os.close(fd)


def _read_header_fd(fd: int, name: str) -> Tuple[Dict[str, Any], int]:
    """``read_header`` of an open file (``name`` for messages); also where its data starts."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise DumpFormatError(f"{name}: shorter than a safetensors header")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES:
        raise DumpFormatError(f"{name}: header length {n} is over safetensors' limit of "
                              f"{MAX_HEADER_BYTES} bytes")
    if n > size - 8:
        raise DumpFormatError(f"{name}: header length {n} runs past the end of the file "
                              f"({size} bytes)")
    text = os.pread(fd, n, 8)
    if len(text) != n:
        raise DumpFormatError(f"{name}: the file shrank while its header was read")
    try:
        header = json.loads(text.decode("utf-8"), parse_int=_header_int,
                            parse_float=_header_float, parse_constant=_header_constant)
    except (ValueError, RecursionError, OverflowError) as e:
        # ValueError includes UnicodeDecodeError; RecursionError: '[[[[...' deeper than
        # the parser's stack.
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise DumpFormatError(f"{name}: the safetensors header is not valid JSON ({why})") from None
    if not isinstance(header, dict):
        raise DumpFormatError(f"{name}: the safetensors header is a JSON "
                              f"{type(header).__name__}, not an object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise DumpFormatError(f"{name}: the header's __metadata__ is not an object of strings")
    return header, 8 + n
