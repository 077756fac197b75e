"""Reading a dump file: its header (``read_header``, bounded and parsed defensively) and
its tensors (``load``)."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, Dict

from .keys import KEY_HIDDEN_STATES, KEY_TOKEN_IDS, KEY_SCALES
from .files import DumpFormatError, open_regular
from .layout import check_tensors

__all__ = ["DumpRecord", "load", "MAX_HEADER_BYTES", "read_header"]


@dataclass
class DumpRecord:
    """One file, loaded: torch tensors plus the metadata dict."""

    hidden_states: Any  # torch.Tensor [T, L, H]
    token_ids: Any  # torch.Tensor int64 [T]
    metadata: Dict[str, str]
    scales: Any = None  # fp8 files loaded as stored: torch.Tensor float32 [T, L, 1]

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

    Anything the safetensors library refuses (a header too long or not JSON, offsets past
    the end of a truncated file, an unknown dtype) is ``DumpFormatError`` naming ``path``
    too. ``path`` may be a symlink; what it names must be a regular file (a FIFO is
    refused with ``OSError``, never waited on). ``FileNotFoundError`` and other
    ``OSError`` when it cannot be opened.
    """
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
    if "layer_ids" in meta:
        try:
            layer_ids = json.loads(meta["layer_ids"])
        except (ValueError, RecursionError):
            layer_ids = None
        if (
            not isinstance(layer_ids, list)
            or not all(isinstance(k, int) for k in layer_ids)
            or layer_ids != sorted(set(layer_ids))
            or len(layer_ids) != hs.shape[1]
        ):
            raise DumpFormatError(
                f"{path}: metadata layer_ids {meta['layer_ids']!r} is not a sorted list of "
                f"{hs.shape[1]} distinct layer ids (one per slot)"
            )
    if scales is not None and dequantize is not False:
        import torch

        from sglang_ext.quant import dequantize as dequantize_fp8

        hs = dequantize_fp8(hs, scales, torch.float32 if dequantize is True else dequantize)
        scales = None
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
    finally:
        os.close(fd)
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
    return header
