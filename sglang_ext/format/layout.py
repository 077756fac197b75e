"""The file layout: tensors, dtypes, metadata and where each byte of a dump file goes
(``file_layout``), the same in the writer's arena and the file."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from .keys import (FORMAT_VERSION, KEY_HIDDEN_STATES, KEY_TOKEN_IDS, KEY_SCALES, FP8, DTYPE_META_KEY,
    SCALE_LAYOUT_KEY, SCALE_LAYOUT)
from .files import DumpFormatError
from .names import printable_rid

__all__ = [
    "build_metadata", "SAFETENSORS_DTYPES", "DATA_ALIGN", "TensorSpec", "FileLayout",
    "file_layout", "dump_tensors", "row_bytes", "scale_row_bytes", "dtype_metadata",
    "check_tensors",
]


def build_metadata(
    *,
    rid: str,
    layer_ids: Sequence[int],
    num_layers: int,
    extra: Optional[Mapping[str, str]] = None,
) -> Dict[str, str]:
    """The ``__metadata__`` dict (all values str, as safetensors requires)."""
    meta = {
        "format": FORMAT_VERSION,
        "rid": printable_rid(rid),
        "layer_ids": json.dumps([int(k) for k in layer_ids]),
        "num_layers": str(int(num_layers)),
    }
    for key, value in (extra or {}).items():
        meta[key] = str(value)
    return meta


# safetensors' dtype codes (its ``Dtype`` enum, as the header names them) and sizes.
SAFETENSORS_DTYPES = {
    "bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4),
    "float64": ("F64", 8), "int64": ("I64", 8), "int32": ("I32", 4), "int16": ("I16", 2),
    "int8": ("I8", 1), "uint8": ("U8", 1), "bool": ("BOOL", 1),
    "float8_e4m3fn": ("F8_E4M3", 1), "float8_e5m2": ("F8_E5M2", 1),
}
# Tensor data starts on a page boundary: rows are written with ``pwrite`` at page-aligned
# offsets, and a reader that maps the file gets page-aligned tensors. The header's JSON
# is padded with spaces to get there, as the safetensors format allows.
DATA_ALIGN = 4096


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a file: ``dtype`` is a torch dtype name (``"bfloat16"``), ``shape``
    its shape. Raises ``DumpFormatError`` for a dtype safetensors cannot hold."""

    name: str
    dtype: str
    shape: Tuple[int, ...]

    def __post_init__(self):
        if self.dtype not in SAFETENSORS_DTYPES:
            raise DumpFormatError(f"tensor {self.name!r}: dtype {self.dtype} has no safetensors code")

    @property
    def nbytes(self) -> int:
        n = SAFETENSORS_DTYPES[self.dtype][1]
        for d in self.shape:
            n *= int(d)
        return n


@dataclass(frozen=True)
class FileLayout:
    """Where everything of one safetensors file goes: ``header`` (the 8-byte length, the
    JSON, padding) at offset 0, tensor ``name``'s data at ``offsets[name]`` (absolute, in
    bytes), ``size`` bytes in all."""

    header: bytes
    offsets: Dict[str, int]
    size: int


def file_layout(tensors: Sequence[TensorSpec], metadata: Mapping[str, str]) -> FileLayout:
    """The layout of a safetensors file holding ``tensors`` in the given order.

    The format (huggingface/safetensors' README): a little-endian u64 N, N bytes of JSON
    (``{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [begin, end]}}``,
    offsets relative to the end of the header), then the tensors' bytes, contiguous.
    """
    header: Dict[str, Any] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    pos = 0
    for t in tensors:
        header[t.name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype][0],
            "shape": [int(d) for d in t.shape],
            "data_offsets": [pos, pos + t.nbytes],
        }
        pos += t.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    data_start = -(-(8 + len(text)) // DATA_ALIGN) * DATA_ALIGN
    text += b" " * (data_start - 8 - len(text))
    offsets, pos = {}, data_start
    for t in tensors:
        offsets[t.name] = pos
        pos += t.nbytes
    return FileLayout(header=struct.pack("<Q", len(text)) + text, offsets=offsets, size=pos)


def dump_tensors(num_tokens: int, num_slots: int, hidden_size: int, dtype: str) -> Tuple[TensorSpec, ...]:
    """The tensors of one dump file: ``hidden_states`` ``[T, L, H]`` of ``dtype``, for
    ``dtype == "float8_e4m3fn"`` then ``hidden_states_scales`` ``[T, L, 1]`` float32, and
    ``token_ids`` ``[T]`` int64, in that order."""
    hs = TensorSpec(KEY_HIDDEN_STATES, dtype, (num_tokens, num_slots, hidden_size))
    ids = TensorSpec(KEY_TOKEN_IDS, "int64", (num_tokens,))
    if dtype == FP8:
        return (hs, TensorSpec(KEY_SCALES, "float32", (num_tokens, num_slots, 1)), ids)
    return (hs, ids)


def row_bytes(row_width: int, dtype: str) -> int:
    """Bytes of one token's ``hidden_states`` row: ``row_width`` (= layer slots x hidden
    size) elements of torch dtype name ``dtype``. The same in the arena and in the file.
    Raises ``DumpFormatError`` for a dtype safetensors cannot hold."""
    if dtype not in SAFETENSORS_DTYPES:
        raise DumpFormatError(f"dtype {dtype} has no safetensors code")
    return int(row_width) * SAFETENSORS_DTYPES[dtype][1]


def scale_row_bytes(num_slots: int, dtype: str) -> int:
    """Bytes of one token's ``hidden_states_scales``: ``num_slots`` float32 when ``dtype``
    is fp8 (``float8_e4m3fn``), else 0 (no scales)."""
    return 4 * int(num_slots) if dtype == FP8 else 0


def dtype_metadata(dtype: str) -> Dict[str, str]:
    """What a file of ``hidden_states`` dtype ``dtype`` adds to ``__metadata__``:
    ``hidden_states_dtype`` and ``scale_layout`` for fp8, nothing otherwise."""
    if dtype == FP8:
        return {DTYPE_META_KEY: FP8, SCALE_LAYOUT_KEY: SCALE_LAYOUT}
    return {}


def check_tensors(hidden_states: Any, token_ids: Any, scales: Any = None) -> None:
    """Raise ``DumpFormatError`` unless shapes and dtypes follow the contract (fp8
    ``hidden_states`` come with float32 ``scales`` ``[T, L, 1]``, other dtypes without)."""
    if hidden_states.dim() != 3:
        raise DumpFormatError(
            f"hidden_states must be [num_tokens, num_layers, hidden_size], "
            f"got shape {tuple(hidden_states.shape)}"
        )
    if token_ids.dim() != 1 or str(token_ids.dtype) != "torch.int64":
        raise DumpFormatError(
            f"token_ids must be int64 [num_tokens], got {token_ids.dtype} "
            f"{tuple(token_ids.shape)}"
        )
    if hidden_states.shape[0] != token_ids.shape[0]:
        raise DumpFormatError(
            f"hidden_states has {hidden_states.shape[0]} rows for "
            f"{token_ids.shape[0]} token ids"
        )
    is_fp8 = str(hidden_states.dtype) == "torch." + FP8
    if is_fp8 != (scales is not None):
        raise DumpFormatError(
            f"hidden_states of {hidden_states.dtype} "
            + ("need float32 scales [T, L, 1] (hidden_states_scales)" if is_fp8
               else "take no hidden_states_scales")
        )
    want = (hidden_states.shape[0], hidden_states.shape[1], 1)
    if scales is not None and (str(scales.dtype) != "torch.float32" or tuple(scales.shape) != want):
        raise DumpFormatError(
            f"hidden_states_scales must be float32 {list(want)}, got {scales.dtype} "
            f"{list(scales.shape)}"
        )
