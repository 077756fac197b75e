"""Is a hidden-state file the answer to its request? ``check_file``, before a file takes
its final name ``hs_<i>`` and again when a rerun finds it there (resume)."""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

from sglang_ext import format as fmt


class CheckError(ValueError):
    """A hidden-state file does not match its request (or is not the server's file for it)."""


class NotRegularError(CheckError):
    """A name holds something else than a regular file (a symlink, a FIFO, a directory)."""


# The most values one token's hidden_states row may hold (layer slots x hidden size): 4M,
# ten times Kimi-K2.5's 61 layers x 7168; a header naming more is not a dump's.
MAX_ROW_VALUES = 1 << 22
# What a file may hold besides its tensors: the header (JSON, metadata with the rid, the
# padding to the 4096-byte data start, format.file_layout).
MAX_HEADER_ALLOWANCE = 1 << 20
_ITEM_BYTES = {code: size for code, size in fmt.SAFETENSORS_DTYPES.values()}


def check_header(f, size: int, num_tokens: Optional[int], shown: str) -> int:
    """Check what a file's header declares against a dump's bounds; returns its tokens T.

    ``f``: the file opened with safetensors' ``safe_open`` (which itself refuses a file
    whose tensors do not cover it exactly), ``size`` its bytes. ``hidden_states`` must be
    ``[T, L, H]`` with every dimension >= 1, T == ``num_tokens`` when given,
    ``L x H <= MAX_ROW_VALUES``, and the file at most ``T x (L x H x dtype bytes + 4 L + 8)
    + MAX_HEADER_ALLOWANCE`` bytes (its hidden states, fp8 scales and token ids, plus the
    header): a file of any other size is not the answer to a row of T tokens. Raises
    ``CheckError`` naming ``shown`` and the bound."""
    hs = f.get_slice(fmt.KEY_HIDDEN_STATES)
    shape, dtype = list(hs.get_shape()), hs.get_dtype()
    if len(shape) != 3 or min(shape) < 1:
        raise CheckError(f"{shown}: hidden_states shape {shape}, not [T, L, H] with every "
                         f"dimension >= 1")
    t, layers, hidden = shape
    if num_tokens is not None and t != num_tokens:
        raise CheckError(f"{shown}: hidden_states shape {shape} for {num_tokens} tokens")
    if layers * hidden > MAX_ROW_VALUES:
        raise CheckError(f"{shown}: hidden_states shape {shape} holds {layers * hidden} values "
                         f"per token, over the {MAX_ROW_VALUES} (layers x hidden) extract takes")
    bound = t * (layers * hidden * _ITEM_BYTES.get(dtype, 8) + 4 * layers + 8) + MAX_HEADER_ALLOWANCE
    if size > bound:
        raise CheckError(f"{shown}: {size} bytes, over the {bound} that {t} tokens x {layers} "
                         f"layers x {hidden} hidden ({dtype}) take with scales, token ids and "
                         f"a 1 MiB header: not a dump file")
    return t


def check_file(path: str, input_ids: Optional[List[int]], full: bool) -> int:
    """Check a file against the request's token ids; returns its number of tokens.

    Cheap check (always, without torch): keys, ``token_ids == input_ids``,
    ``hidden_states`` is ``[len(input_ids), L, H]`` and the file's size within
    ``check_header``'s bound (from the header, tensor not loaded). ``input_ids`` None (a
    chat request with images whose answer gave no prompt token ids): the file's own
    ``token_ids`` stand, ``hidden_states`` needs one row each. ``full`` (numpy alone
    will do: ``format.load`` gives numpy arrays without torch, bf16 and fp8 exact): also
    load everything through ``format.load`` and require finite values (fp8 files:
    dequantized, so a NaN or infinite scale counts).
    Raises ``CheckError``.
    """
    from safetensors import safe_open

    try:
        with safe_open(path, framework="numpy") as f:
            keys = set(f.keys())
            missing = {fmt.KEY_HIDDEN_STATES, fmt.KEY_TOKEN_IDS} - keys
            if missing:
                raise CheckError(f"{path}: missing keys {sorted(missing)}")
            check_header(f, os.stat(path).st_size, None if input_ids is None else len(input_ids),
                         path)
            ids = f.get_tensor(fmt.KEY_TOKEN_IDS)
            shape = list(f.get_slice(fmt.KEY_HIDDEN_STATES).get_shape())
    except CheckError:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise CheckError(f"{path}: unreadable: {e}") from None
    if input_ids is None:
        input_ids = ids.tolist()
        if len(ids.shape) != 1 or not input_ids:
            raise CheckError(f"{path}: token_ids of shape {list(ids.shape)}, not [T] with T > 0")
    elif ids.tolist() != list(input_ids):
        raise CheckError(f"{path}: token ids differ from the request's")
    if len(shape) != 3 or shape[0] != len(input_ids):
        raise CheckError(f"{path}: hidden_states shape {shape} for {len(input_ids)} tokens")
    if full:
        try:
            record = fmt.load(path, dequantize=True)  # fp8 files: values = fp8 * scale
        except Exception as e:  # noqa: BLE001
            raise CheckError(f"{path}: {e}") from None
        hs = record.hidden_states  # a torch tensor, or numpy without torch (format.load)
        if hasattr(hs, "isfinite"):
            finite = bool(hs.isfinite().all())
        else:
            import numpy

            finite = bool(numpy.isfinite(hs).all())
        if not finite:
            raise CheckError(f"{path}: hidden_states hold non-finite values")
    return len(input_ids)


def sample_layout(path: str) -> Tuple[str, Tuple[int, ...], str]:
    """What every sample of one dataset shares: ``(layer_ids, (L, H), dtype)`` of a file,
    from its header (its metadata's ``layer_ids``, ``hidden_states``' shape past the token
    axis, its safetensors dtype, e.g. ``BF16``). Raises ``CheckError`` for an unreadable
    file."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="numpy") as f:
            hs = f.get_slice(fmt.KEY_HIDDEN_STATES)
            return ((f.metadata() or {}).get("layer_ids", "?"), tuple(hs.get_shape()[1:]),
                    hs.get_dtype())
    except Exception as e:  # noqa: BLE001 - a file removed or replaced under the run
        raise CheckError(f"{path}: unreadable: {e}") from None
