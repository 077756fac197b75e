"""copier.Copier: a byte range copied in page-aligned pieces on several threads equals
the source, whatever the length (pieces, remainders, nothing)."""

from __future__ import annotations

import ctypes
import os

import pytest

from sglang_ext.copier import MIN_PIECE, Copier


def _addr(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("n", [0, 1, MIN_PIECE - 1, 2 * MIN_PIECE, 3 * MIN_PIECE + 12345])
def test_copy_equals_its_source(threads, n):
    src = bytearray(os.urandom(n + 64))
    dst = bytearray(n + 64)
    copier = Copier(threads)
    try:
        copier.copy(_addr(dst) + 7, _addr(src) + 5, n)  # unaligned both sides
    finally:
        copier.close()
    assert dst[7:7 + n] == src[5:5 + n]
    assert dst[:7] == bytes(7) and dst[7 + n:] == bytes(64 - 7), "a byte outside the range changed"


def test_negative_length_is_refused():
    copier = Copier(2)
    try:
        with pytest.raises(ValueError, match="cannot copy -1 bytes"):
            copier.copy(0, 0, -1)
    finally:
        copier.close()
