"""Is a hidden-state file the answer to its request? ``check_file``, before a file takes
its final name ``hs_<i>`` and again when a rerun finds it there (resume)."""

from __future__ import annotations

from typing import List, Optional, Tuple

from sglang_ext import format as fmt


class CheckError(ValueError):
    """A hidden-state file does not match its request (or is not the server's file for it)."""


class NotRegularError(CheckError):
    """A name holds something else than a regular file (a symlink, a FIFO, a directory)."""


def check_file(path: str, input_ids: Optional[List[int]], full: bool) -> int:
    """Check a file against the request's token ids; returns its number of tokens.

    Cheap check (always, without torch): keys, ``token_ids == input_ids``,
    ``hidden_states`` is ``[len(input_ids), L, H]`` (shape from the header, tensor not
    loaded). ``input_ids`` None (a chat request with images whose answer gave no prompt
    token ids): the file's own ``token_ids`` stand, ``hidden_states`` needs one row each. ``full`` (needs torch): also load everything through ``format.load`` and
    require finite values (fp8 files: dequantized, so a NaN or infinite scale counts).
    Raises ``CheckError``.
    """
    from safetensors import safe_open

    try:
        with safe_open(path, framework="numpy") as f:
            keys = set(f.keys())
            missing = {fmt.KEY_HIDDEN_STATES, fmt.KEY_TOKEN_IDS} - keys
            if missing:
                raise CheckError(f"{path}: missing keys {sorted(missing)}")
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
        import torch

        try:
            record = fmt.load(path, dequantize=True)  # fp8 files: values = fp8 * scale
        except Exception as e:  # noqa: BLE001
            raise CheckError(f"{path}: {e}") from None
        if not bool(torch.isfinite(record.hidden_states).all()):
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
