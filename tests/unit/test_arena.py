"""arena.create: an arena that cannot be made is one sentence naming the setting and size."""

import errno

import pytest

from sglang_ext import arena


@pytest.mark.parametrize("size, reason", [
    (1 << 50, "Cannot allocate memory"),  # 1 PiB: mmap finds no address space for it
    (1 << 63, "too large"),  # past off_t: Python's OverflowError before any system call
])
def test_create_absurd_size_names_the_flag_and_size(size, reason):
    with pytest.raises(arena.ArenaError) as e:
        arena.create(size)
    msg = str(e.value)
    assert isinstance(e.value, OSError)  # callers that catch OSError still do
    assert msg.startswith(f"cannot allocate the {size >> 20} MiB host arena "), msg
    assert "--dump-hidden-states-max-host-mb" in msg and reason in msg, msg
    assert not msg.startswith("[Errno") and "\n" not in msg
    if size == 1 << 50:
        assert e.value.errno == errno.ENOMEM


def test_create_small_arena_still_works():
    fd, mm = arena.create(1 << 20)
    try:
        assert len(mm) == arena.HEADER_BYTES + (1 << 20)
        arena.write_seq(mm, 7)
        assert arena.read_seq(mm) == 7
    finally:
        mm.close()
        import os
        os.close(fd)
