"""Test helper: write a whole dump file for a reservation from tensors in hand.

The server never does this (its writer process streams rows chunk by chunk); tests use it
to make real files fast. It takes the writer process's steps with ``format``'s own
pieces: the layout (``dump_tensors``, ``file_layout``, ``dtype_metadata``), a temporary
name (``tmp_name``), ``create_tmp``, ``pwrite_all``, then ``publish``. Like the writer it
leaves nothing under the final name on failure and removes its temporary file; unlike it,
it writes no index line and does not release the reservation (``format.complete`` /
``format.fail`` do).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from sglang_ext import format as fmt


def write_dump(res: fmt.Reservation, hidden_states: Any, token_ids: Any,
               metadata: Mapping[str, str], scales: Any = None) -> int:
    """Write ``res``'s file; returns its size in bytes.

    ``hidden_states``: torch ``[T, L, H]`` (CPU); ``token_ids``: torch int64 ``[T]``;
    ``scales``: float32 ``[T, L, 1]`` when ``hidden_states`` is float8_e4m3fn (its
    ``dtype_metadata`` is added to ``metadata``), else ``None``. Raises
    ``DumpFormatError`` on inconsistent shapes (``check_tensors``) and ``OSError`` on I/O
    failure.
    """
    import torch

    fmt.check_tensors(hidden_states, token_ids, scales)
    dtype = str(hidden_states.dtype).replace("torch.", "")
    specs = fmt.dump_tensors(*hidden_states.shape, dtype)
    layout = fmt.file_layout(specs, {**metadata, **fmt.dtype_metadata(dtype)})
    tensors = (hidden_states, token_ids) if scales is None else (hidden_states, scales, token_ids)
    tmp = fmt.tmp_name("test", 0)
    fd = None
    try:
        fd = fmt.create_tmp(res.dir_fd, tmp)
        fmt.pwrite_all(fd, layout.header, 0)
        for spec, tensor in zip(specs, tensors):
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            fmt.pwrite_all(fd, raw, layout.offsets[spec.name])
        os.close(fd)
        fd = None
        fmt.publish(res.dir_fd, tmp, res.name)
    except BaseException:
        if fd is not None:
            os.close(fd)
        try:
            os.unlink(tmp, dir_fd=res.dir_fd)
        except FileNotFoundError:
            pass
        raise
    return layout.size
