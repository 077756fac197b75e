"""The stand-in's pretend model (``sglang-ext standin``): the rows it writes (``values``)
and the tokens it "generates" (``generated_ids``). Both are documented formulas, so a test
recomputes them independently; numpy alone."""

from __future__ import annotations

import hashlib
import struct
from typing import Iterable, List, Optional, Tuple

import numpy as np

VOCAB = 32000  # generated ids are below this

# values(): multipliers of the key (golden-ratio and xxhash32 primes) and lowbias32's.
_K_ID, _K_POS, _K_LAYER = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_M1, _M2 = 0x7FEB352D, 0x846CA68B
_U32 = 0xFFFFFFFF


def values(token_ids, layer_ids, hidden_size: int) -> np.ndarray:
    """The stand-in's hidden states: float32 ``[T, len(layer_ids), hidden_size]``.

    Element ``[t, j, h]``: ``key = (id_t * 0x9E3779B1 + t * 0x85EBCA77 + layer_ids[j] *
    0xC2B2AE3D + h) mod 2**32``, hashed by lowbias32 (``x ^= x >> 16; x *= 0x7feb352d;
    x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16``, mod 2**32), then ``((x >> 24) - 128)
    / 64``: one of 256 values in [-2, 2), each exact in bf16, so the file holds them
    unrounded. Deterministic: the same prompt gives the same rows on every run."""
    ids = np.asarray(token_ids, dtype=np.uint64).reshape(-1, 1, 1)
    pos = np.arange(ids.shape[0], dtype=np.uint64).reshape(-1, 1, 1)
    lay = np.asarray(layer_ids, dtype=np.uint64).reshape(1, -1, 1)
    ch = np.arange(hidden_size, dtype=np.uint64).reshape(1, 1, -1)
    x = (ids * _K_ID + pos * _K_POS + lay * _K_LAYER + ch) & _U32
    x ^= x >> 16
    x = (x * _M1) & _U32
    x ^= x >> 15
    x = (x * _M2) & _U32
    x ^= x >> 16
    return ((x >> 24).astype(np.float32) - 128.0) / 64.0


def bf16_bytes(x: np.ndarray) -> bytes:
    """bf16 bytes of float32 ``x`` whose values bf16 holds exactly (``values``'): the upper
    half of each float32."""
    return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()


def generated_ids(prompt: List[int], max_new_tokens: int, stop_token_ids: Iterable[int] = (),
                  seed: Optional[str] = None) -> Tuple[List[int], dict]:
    """The stand-in's generation for ``prompt``: ``(output_ids, finish_reason)``.

    Token ``k`` (at position ``t = len(prompt) + k``) is ``int.from_bytes(sha256(prompt's
    ids as little-endian int64, then t as little-endian int64, then for sampled decoding
    the rid as UTF-8).digest()[:4], "little") % 32000``: greedy decoding (``seed`` None)
    gives the same tokens for the same prompt on every run; sampled decoding (``seed``: the
    request's rid) gives other tokens for every request, as a retried sample does.
    Generation stops after ``max_new_tokens`` tokens (``finish_reason`` ``{"type":
    "length", "length": n}``) or after a token of ``stop_token_ids``, which is the last
    output id (``{"type": "stop", "matched": id}``), as SGLang reports them."""
    head = hashlib.sha256(struct.pack(f"<{len(prompt)}q", *prompt))
    tail = b"" if seed is None else seed.encode("utf-8", "surrogatepass")
    stops = set(stop_token_ids)
    out: List[int] = []
    for k in range(max_new_tokens):
        h = head.copy()
        h.update(struct.pack("<q", len(prompt) + k) + tail)
        out.append(int.from_bytes(h.digest()[:4], "little") % VOCAB)
        if out[-1] in stops:
            return out, {"type": "stop", "matched": out[-1]}
    return out, {"type": "length", "length": len(out)}
