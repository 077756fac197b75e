"""``store.StoreConfig``'s loopback check of ``local_hostname`` and the writer's one warning."""

from __future__ import annotations

import ctypes
import logging

import pytest

from sglang_ext import store


def config(master: str, local: str) -> store.StoreConfig:
    return store.StoreConfig.from_url(f"mooncake://{master}?local_hostname={local}")


@pytest.mark.parametrize("host, want", [
    ("127.0.0.1", True), ("127.0.1.1", True), ("[::1]", True), ("localhost", True),
    ("10.0.0.7", False), ("192.0.2.1", False), ("[2001:db8::1]", False),
])
def test_is_loopback(host, want):
    assert store.is_loopback(host) is want


def test_a_name_that_does_not_resolve_is_not_called_loopback():
    assert store.is_loopback("no-such-host.invalid") is None


@pytest.mark.parametrize("master, local", [("10.1.2.3:50051", "127.0.0.1"), ("10.1.2.3:50051", "127.0.1.1"),
                                           ("[2001:db8::1]:50051", "localhost")])
def test_loopback_local_hostname_with_a_remote_master_is_one_sentence_naming_the_key(master, local):
    warning = config(master, local).loopback_warning()
    assert warning is not None and "\n" not in warning and warning.count(". ") == 0
    assert f"local_hostname {local} is a loopback address" in warning
    assert "local_hostname URL key" in warning and master in warning


@pytest.mark.parametrize("master, local", [("127.0.0.1:50051", "127.0.0.1"), ("localhost:50051", "127.0.1.1"),
                                           ("10.1.2.3:50051", "10.0.0.7"),
                                           ("no-such-host.invalid:50051", "127.0.0.1")])
def test_no_warning_on_one_node_or_with_a_reachable_address(master, local):
    assert config(master, local).loopback_warning() is None


def test_the_writer_warns_once_at_start(caplog):
    """``store_writer.Connection`` logs the warning once when it starts (its set-up thread
    then tries the unreachable master in the background and is stopped)."""
    from sglang_ext import store_writer

    arena = ctypes.create_string_buffer(4096)
    with caplog.at_level(logging.WARNING, logger="sglang_ext.writer_process"):
        conn = store_writer.Connection(config("192.0.2.1:50051", "127.0.0.1"), ctypes.addressof(arena), 4096)
        conn.close()
        quiet = store_writer.Connection(config("192.0.2.1:50051", "10.0.0.7"), ctypes.addressof(arena), 4096)
        quiet.close()
    said = [r.getMessage() for r in caplog.records if "loopback" in r.getMessage()]
    assert len(said) == 1 and "local_hostname URL key" in said[0], said


@pytest.mark.parametrize("query, words", [
    ("device=mlx5%000", "mooncake setting device_name 'mlx5\\x000' holds whitespace or a control character"),
    ("local_hostname=a%0Ab", "mooncake setting local_hostname 'a\\nb' holds whitespace or a control character"),
    ("metadata_server=etcd-1", "metadata_server 'etcd-1' is neither P2PHANDSHAKE nor a URL with a host and port"),
    ("metadata_server=http://meta/x", "is neither P2PHANDSHAKE nor a URL with a host and port"),
    # other scripts' digits: re's \d and int() take them (fullwidth 4 was 4 GiB)
    ("global_segment_size=\uff14GiB", "global_segment_size='\uff14GiB' is not a size"),
    ("local_buffer_size=\u0665\u0661\u0662MiB", "is not a size"),
    # whitespace: Mooncake looks the device, the host, the metadata server up as written
    ("device=%20mlx5_0", "mooncake setting device_name ' mlx5_0' holds whitespace or a control character"),
    ("local_hostname=10.0.0.7%20", "mooncake setting local_hostname '10.0.0.7 ' holds whitespace"),
    ("local_hostname=%20", "mooncake setting local_hostname ' ' holds whitespace"),
    # every put of bytes (the sink's error markers) fails with -600 through a buffer of 0
    ("local_buffer_size=0", "mooncake setting local_buffer_size 0 is below 1 MiB (1048576 bytes)"),
    ("local_buffer_size=4KiB", "mooncake setting local_buffer_size 4096 is below 1 MiB"),
])
def test_url_settings_mooncake_would_fail_on_are_refused_in_one_sentence(query, words):
    with pytest.raises(ValueError) as e:
        store.StoreConfig.from_url(f"mooncake://10.0.0.1:50051?{query}")
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_master_host_with_whitespace_is_refused_in_one_sentence():
    """'mooncake://ho st:50051' parsed (urlsplit keeps the space) and the server then waited
    on a name no resolver has; the entrypoint let it through."""
    with pytest.raises(ValueError) as e:
        store.StoreConfig.from_url("mooncake://ho st:50051")
    assert str(e.value) == ("mooncake setting master_server_address 'ho st:50051' holds whitespace or a "
                            "control character (a space, a NUL, a newline...): Mooncake would fail every "
                            "request with it")


def test_a_fragment_is_refused_not_dropped():
    """'mooncake://h:50051?protocol=rdma#device=mlx5_0': urlsplit puts '#...' aside, and
    the setting after it was dropped without a word."""
    with pytest.raises(ValueError) as e:
        store.StoreConfig.from_url("mooncake://10.0.0.1:50051?protocol=rdma#device=mlx5_0")
    assert str(e.value) == ("'mooncake://10.0.0.1:50051?protocol=rdma#device=mlx5_0' has a '#' part, which "
                            "is no setting: give every setting as ?key=value&key=value")


def test_credentials_in_the_url_are_refused_and_never_quoted():
    with pytest.raises(ValueError) as e:
        store.StoreConfig.from_url("mooncake://alice:s3cret@10.0.0.1:50051?protocol=tcp")
    said = str(e.value)
    assert "carries credentials (USER:SECRET@), which Mooncake's master neither takes nor checks" in said
    assert "s3cret" not in said and "alice" not in said and "mooncake://10.0.0.1:50051?protocol=tcp" in said
    for secret in ("pa/ss", "s3c#ret", "s3c?ret"):  # the URL parser splits there: still never quoted
        with pytest.raises(ValueError) as e:
            store.StoreConfig.from_url(f"mooncake://alice:{secret}@10.0.0.1:50051")
        assert secret not in str(e.value) and "alice" not in str(e.value), str(e.value)


def test_a_segment_larger_than_the_host_is_named():
    import os

    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    big = store.StoreConfig.from_url("mooncake://10.0.0.1:50051?global_segment_size=1000TiB")
    assert big.memory_problem() == (
        f"mooncake settings global_segment_size {1000 << 40} + local_buffer_size {256 << 20} bytes are more "
        f"than this host's memory ({ram} bytes)")
    assert store.StoreConfig.from_url("mooncake://10.0.0.1:50051?global_segment_size=1GiB").memory_problem() is None


def test_handles_carry_128_random_bits_and_old_8_hex_handles_still_match():
    import re

    h = store.unique_handle("3f.a")
    assert re.fullmatch(r"k3f_a-[0-9a-f]{32}", h), h
    assert store.handle_matches("3f.a", h) and store.handle_matches("3f.a", "k3f_a-0123abcd")
    assert not store.handle_matches("3f.a", "k3f_a-0123abc") and not store.handle_matches("3f.b", h)
