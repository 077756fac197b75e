"""The Mooncake Store sink against a real ``mooncake_master`` and hs-connectors' own reader.

Samples are packed by ``sglang_ext.store`` and read back with hs-connectors 0.9.0's
``MooncakeTransfer.get_generated(manifest)`` (what speculators' trainer calls); the
expected bytes are built here by hand (tensor bytes, zero padding to 64). Fault cases: a
master that is killed, a segment that is full, an error marker, an existing handle.
Skipped only when the mooncake wheel is not importable (requirements/store.txt).
"""

from __future__ import annotations

import ctypes
import mmap
import subprocess
import sys
import textwrap
import threading

import pytest

from sglang_ext import store as st
from sglang_ext.store_client import RegisteredBuffers, StoreClient

from mooncake_fixture import MiB, Master, _free_port, master_config, needs_mooncake


def _config(master: Master, segment: int = 64 * MiB) -> st.StoreConfig:
    return st.StoreConfig.from_url(master_config(master, segment))


@pytest.fixture(scope="module")
def sink(master):
    s = StoreClient(_config(master)).connect()
    yield s
    s.close()


@pytest.fixture(scope="module")
def reader(master):
    """hs-connectors' trainer-side transfer: ``MooncakeTransfer`` over its own client."""
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig  # noqa: PLC0415
    from hs_connectors.transfer import MooncakeTransfer  # noqa: PLC0415

    cfg = MooncakeStoreConfig.from_dict(
        {**_config(master).as_hs_connectors(), "global_segment_size": 0, "local_buffer_size": 16 * MiB})
    t = MooncakeTransfer(MooncakeHiddenStatesStore(cfg))
    t.setup()
    return t


def _sample(T: int, L: int, H: int, dtype: str, seed: int):
    """Hand-made tensors of one request: hidden_states [T, L, H], fp8 scales [T, L, 1]
    float32, token_ids int64 [T]."""
    import torch  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, L, H, generator=g) * 3
    ids = torch.randint(0, 150_000, (T,), generator=g, dtype=torch.int64)
    if dtype == "float8_e4m3fn":
        scales = torch.rand(T, L, 1, generator=g) + 0.01
        return {"hidden_states": x.to(torch.float8_e4m3fn), "hidden_states_scales": scales, "token_ids": ids}
    return {"hidden_states": x.to(getattr(torch, dtype)), "token_ids": ids}


def _raw(t) -> bytes:
    import torch  # noqa: PLC0415

    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _expected_object(tensors: dict) -> bytes:
    """The packed object by hand: tensors in order, each padded with zeros to 64 bytes."""
    out = b""
    for t in tensors.values():
        b = _raw(t)
        out += b + bytes(-len(b) % 64)
    return out


class Arena:
    """A shared anonymous mapping like the writer's arena, registered with the sink."""

    def __init__(self, sink: StoreClient, size: int):
        self.map = mmap.mmap(-1, size)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.used = 0
        self.sink = sink
        sink.register(self.addr, size)

    def close(self) -> None:
        """Unregister before the mapping goes: a later mapping may reuse the addresses,
        and Mooncake refuses to register an overlapping range (status -600)."""
        self.sink.unregister(self.addr)

    def place(self, data: bytes) -> tuple:
        """Copy ``data`` in at a 512-byte-aligned spot; its ``(addr, nbytes)`` range."""
        off = -(-self.used // 512) * 512
        self.map[off:off + len(data)] = data
        self.used = off + len(data)
        return (self.addr + off, len(data))


# ---------------------------------------------------------------- no engine needed


def test_config_from_url():
    c = st.StoreConfig.from_url(
        "mooncake://10.0.0.5:50051?protocol=rdma&device=mlx5_0,mlx5_1&global_segment_size=8GiB"
        "&local_buffer_size=512m&metadata_server=P2PHANDSHAKE&local_hostname=10.0.0.7")
    assert (c.master_server_address, c.protocol, c.device_name) == ("10.0.0.5:50051", "rdma", "mlx5_0,mlx5_1")
    assert (c.global_segment_size, c.local_buffer_size) == (8 << 30, 512 << 20)
    assert c.as_hs_connectors() == {
        "local_hostname": "10.0.0.7", "metadata_server": "P2PHANDSHAKE", "master_server_address": "10.0.0.5:50051",
        "global_segment_size": 8 << 30, "local_buffer_size": 512 << 20, "protocol": "rdma",
        "device_name": "mlx5_0,mlx5_1"}
    assert st.StoreConfig.is_url("mooncake://h:1") and not st.StoreConfig.is_url("/data/hs")
    # any case, as from_url (urlsplit) takes it: the server must not read it as a directory
    assert st.StoreConfig.is_url("Mooncake://h:1") and not st.StoreConfig.is_url("mooncake")
    assert st.StoreConfig.from_url("MOONCAKE://h:1").master_server_address == "h:1"
    # a key given twice: the last wins (a base URL extended with an override)
    assert st.StoreConfig.from_url("mooncake://h:1?local_buffer_size=16MiB&local_buffer_size=1MiB"
                                   ).local_buffer_size == 1 << 20


@pytest.mark.parametrize("url, words", [
    ("mooncake://host", "is not a mooncake://HOST:PORT address"),
    ("mooncake://host:99999", "is not a mooncake://HOST:PORT address"),
    ("http://host:1", "is not a mooncake://HOST:PORT address"),
    ("mooncake://host:1/x", "is not a mooncake://HOST:PORT address"),
    ("mooncake://host:1?protocol=udp", "protocol must be tcp or rdma, not 'udp'"),
    ("mooncake://host:1?segment=4GiB", "unknown mooncake setting 'segment'; known:"),
    ("mooncake://host:1?global_segment_size=lots", "global_segment_size='lots' is not a size"),
    ("mooncake://host:1?local_hostname=", "setting 'local_hostname' is empty"),
    ("mooncake://host:1?metadata_server=", "setting 'metadata_server' is empty"),
])
def test_config_bad_url_is_one_sentence(url, words):
    with pytest.raises(ValueError) as e:
        st.StoreConfig.from_url(url)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_handle_for_is_hs_connectors_sanitize_key():
    # sanitize_key (mooncake_hidden_states_connector.py): [^a-zA-Z0-9_-] -> "_", "k" before a digit.
    assert st.handle_for("chatcmpl-abc_1") == "chatcmpl-abc_1"
    assert st.handle_for("3f2a9c") == "k3f2a9c"
    assert st.handle_for("a.b/c:d é") == "a_b_c_d__"
    assert st.handle_for("-x") == "-x"
    with pytest.raises(ValueError, match="empty request id"):
        st.handle_for("")


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_layout_equals_hs_connectors_packed_layout(dtype):
    import torch  # noqa: PLC0415
    from hs_connectors.mooncake_store import packed_layout  # noqa: PLC0415

    T, L, H = 7, 3, 20  # odd sizes: every tensor needs padding
    ours = st.pack_layout(T, L, H, dtype).manifest("h")
    spec = {"hidden_states": ([T, L, H], getattr(torch, dtype))}
    if dtype == "float8_e4m3fn":
        spec["hidden_states_scales"] = ([T, L, 1], torch.float32)
    spec["token_ids"] = ([T], torch.int64)
    theirs, total = packed_layout(spec)
    assert ours["tensors"] == theirs and ours["metadata"]["total_aligned_bytes"] == total
    assert ours["version"] == 1 and ours["metadata"]["num_tokens"] == T


def test_pack_rejects_wrong_sizes():
    lay = st.pack_layout(2, 1, 4, "bfloat16")
    with pytest.raises(ValueError, match="'hidden_states' has 15 bytes, the layout needs 16"):
        lay.pack({"hidden_states": [bytes(15)], "token_ids": [bytes(16)]})
    with pytest.raises(ValueError, match="packed object needs tensors"):
        lay.pack({"hidden_states": [bytes(16)]})


# ---------------------------------------------------------------- the real engine


@needs_mooncake
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_round_trip_through_hs_connectors_reader(sink, reader, dtype):
    """Two prefill chunks from the registered arena -> one object; the trainer's reader
    gets the very tensors back, and the object's bytes are the hand-packed ones."""
    T, L, H = 37, 3, 96
    tensors = _sample(T, L, H, dtype, seed=1 if dtype == "bfloat16" else 2)
    arena = Arena(sink, 4 * MiB)
    layout = st.pack_layout(T, L, H, dtype)
    data = {}
    for name, t in tensors.items():
        raw = _raw(t)
        cut = len(raw) // T * 20  # tokens [0, 20) and [20, T): two chunks, two arena ranges
        data[name] = [arena.place(raw[:cut]), arena.place(raw[cut:])] if name != "token_ids" else [arena.place(raw)]
    handle = st.handle_for(f"{dtype}-req.1")
    assert sink.put_packed(handle, layout, data) == layout.total_bytes
    manifest = layout.manifest(handle)

    got = reader.get_generated(manifest)
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and tuple(got[name].shape) == tuple(t.shape), name
        assert _raw(got[name]) == _raw(t), f"{name}: bytes differ"
    whole = reader.store._store.get(handle)
    assert whole == _expected_object(tensors), "object bytes differ from the hand-packed layout"
    reader.delete(handle)
    assert not sink.exists(handle)
    arena.close()


@needs_mooncake
def test_bytes_fallback_and_source_reuse(sink, reader):
    """Unregistered parts go as one bytes put; a registered range may be overwritten once
    put returns (the object keeps what was there at the put)."""
    T, L, H = 5, 2, 32
    tensors = _sample(T, L, H, "bfloat16", seed=3)
    layout = st.pack_layout(T, L, H, "bfloat16")
    sink.put_packed("fallback", layout, {n: [_raw(t)] for n, t in tensors.items()})
    assert reader.store._store.get("fallback") == _expected_object(tensors)

    arena = Arena(sink, 1 * MiB)
    rng = arena.place(b"\x11" * 4096)
    sink.put("reuse", [rng])
    arena.map[0:4096] = b"\x22" * 4096
    assert reader.store._store.get("reuse") == b"\x11" * 4096
    sink.remove("fallback")
    sink.remove("reuse")
    arena.close()


@needs_mooncake
def test_a_bytes_put_larger_than_the_local_buffer_is_one_sentence(master, reader):
    """A put of bytes (error markers; parts not all in registered memory) goes through the
    client's local buffer; one larger than ``local_buffer_size`` (Mooncake: status -600)
    fails with a sentence naming the setting and both sizes, and leaves nothing; a
    registered range of the same size needs no local buffer and is put."""
    s = StoreClient(st.StoreConfig.from_url(master_config(master) + "&local_buffer_size=1MiB")).connect()
    try:
        with pytest.raises(st.StoreError, match=r"^the store object 'big' \(2097152 bytes\) does not fit "
                                                r"the Mooncake client's local buffer \(local_buffer_size "
                                                r"1048576 bytes, shared by the client's puts of bytes\): raise "
                                                r"local_buffer_size \(docs/store.md\)$"):
            s.put("big", [b"\x01" * (2 * MiB)])
        assert reader.store._store.is_exist("big") != 1
        arena = Arena(s, 2 * MiB)
        s.put("big", [arena.place(b"\x02" * (2 * MiB))])
        assert reader.store._store.get_size("big") == 2 * MiB
        s.remove("big")
        arena.close()
    finally:
        s.close()


@needs_mooncake
def test_error_marker_is_an_error_to_the_reader(sink, reader):
    from hs_connectors.mooncake_store import MooncakeIntegrityError  # noqa: PLC0415

    layout = st.pack_layout(4, 2, 8, "bfloat16")
    sink.put_error("failed_req", "prompt has 9 tokens, the dump saw 4")
    with pytest.raises(MooncakeIntegrityError, match="prompt has 9 tokens, the dump saw 4"):
        reader.get_generated(layout.manifest("failed_req"))
    sink.put_error("long_req", "x" * 10_000)
    assert reader.store._store.get("long_req:error") == b'{"error": "' + b"x" * 4096 + b'"}'
    reader.delete("failed_req")
    reader.delete("long_req")
    assert not sink.exists("failed_req:error")


@needs_mooncake
def test_existing_handle_is_refused(sink, reader):
    sink.put("dup", [b"first"])
    with pytest.raises(st.StoreError, match="'dup' already holds another answer's object"):
        sink.put("dup", [b"second"])
    assert reader.store._store.get("dup") == b"first"
    sink.remove("dup")


@needs_mooncake
def test_threads_share_one_sink(sink, reader):
    """Four writer threads put through one client at once; every object reads back whole."""
    arena = Arena(sink, 16 * MiB)
    ranges = [arena.place(bytes([i]) * (MiB + 64 * i)) for i in range(8)]
    errors = []

    def put(i):
        try:
            sink.put(f"thread_{i}", [ranges[i]])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=put, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for i in range(8):
        assert reader.store._store.get(f"thread_{i}") == bytes([i]) * (MiB + 64 * i), f"thread_{i}"
        sink.remove(f"thread_{i}")
    arena.close()


POLLER = textwrap.dedent("""
    import sys, time
    from mooncake.store import MooncakeDistributedStore
    addr, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", addr) == 0
    print("ready", flush=True)
    pending, polls, deadline = set(range(n)), 0, time.monotonic() + 60
    while pending and time.monotonic() < deadline:
        for i in sorted(pending):
            polls += 1
            if s.is_exist(f"atomic_{i}") == 1:
                got = s.get(f"atomic_{i}")
                if len(got) != size or got.count(bytes([i + 1])) != size:
                    print(f"PARTIAL atomic_{i}: {len(got)} bytes", flush=True)
                    sys.exit(1)
                pending.discard(i)
    print(f"done pending={sorted(pending)} polls={polls}", flush=True)
    sys.exit(1 if pending else 0)
""")


@needs_mooncake
def test_object_is_never_visible_half_written(master, sink):
    """Another process polls while 8 MiB objects are put: whenever a handle exists, its
    object is whole."""
    n, size = 6, 8 * MiB
    arena = Arena(sink, n * size)
    ranges = [arena.place(bytes([i + 1]) * size) for i in range(n)]
    poller = subprocess.Popen([sys.executable, "-c", POLLER, master.address, str(n), str(size)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert poller.stdout.readline().strip() == "ready"
    for i in range(n):
        sink.put(f"atomic_{i}", [ranges[i]])
    out, _ = poller.communicate(timeout=90)
    assert poller.returncode == 0, out
    for i in range(n):
        sink.remove(f"atomic_{i}")
    arena.close()


@needs_mooncake
def test_store_full_is_one_sentence_and_nothing_visible(tmp_path):
    # --eviction_ratio=0: a full master would otherwise evict "fits" (its lease long past on
    # a loaded machine) to make room for the marker; eviction is docs/store.md's business
    m = Master(tmp_path, "--eviction_ratio=0")
    try:
        small = StoreClient(_config(m, segment=16 * MiB)).connect()
        arena = Arena(small, 10 * MiB)
        rng = arena.place(b"\x07" * (10 * MiB))  # one fits the 16 MiB segment, two do not
        small.put("fits", [rng])
        with pytest.raises(st.StoreFull) as e:
            small.put("too_much", [rng])
        assert "has no room for 'too_much' (10485760 bytes)" in str(e.value) and "\n" not in str(e.value)
        assert not small.exists("too_much")
        small.put_error("too_much", str(e.value))  # the marker still fits: a reader fails fast
        assert small.exists("too_much:error") and small.exists("fits")
        small.close()
    finally:
        m.kill()


@needs_mooncake
def test_a_sample_larger_than_the_segment_says_so(tmp_path):
    """A sample larger than the whole global_segment_size (one master, one segment) never
    fits: the sentence says so and asks for a larger segment, not for faster trainers
    (before: "trainers must consume samples faster, or raise ...", on an empty store)."""
    m = Master(tmp_path, "--eviction_ratio=0")
    try:
        small = StoreClient(_config(m, segment=16 * MiB)).connect()
        arena = Arena(small, 20 * MiB)
        rng = arena.place(b"\x07" * (20 * MiB))
        with pytest.raises(st.StoreFull) as e:
            small.put("huge", [rng])
        msg = str(e.value)
        assert "'huge' (20971520 bytes) is larger than" in msg and "global_segment_size 16777216" in msg, msg
        assert "faster" not in msg and "\n" not in msg
        assert not small.exists("huge")
        small.close()
    finally:
        m.kill()


@needs_mooncake
def test_master_down_is_one_sentence(tmp_path):
    m = Master(tmp_path)
    s = StoreClient(_config(m)).connect()
    arena = Arena(s, 1 * MiB)
    rng = arena.place(b"\x01" * 4096)
    s.put("before", [rng])
    m.kill()
    for op in (lambda: s.put("after", [rng]), lambda: s.put_error("after", "boom")):
        with pytest.raises(st.StoreUnavailable) as e:
            op()
        assert str(e.value).startswith(f"the Mooncake master at {m.address} does not answer")
        assert "\n" not in str(e.value)
    s.close()


@needs_mooncake
def test_connect_without_master_is_one_sentence():
    port = _free_port()
    s = StoreClient(st.StoreConfig.from_url(f"mooncake://127.0.0.1:{port}?global_segment_size=16MiB"
                                             "&local_buffer_size=16MiB&local_hostname=127.0.0.1"))
    with pytest.raises(st.StoreUnavailable, match=f"could not set up the Mooncake client for the master at 127.0.0.1:{port}"):
        s.connect()


@needs_mooncake
def test_registered_buffers_are_reused_only_once_given_back(sink, reader):
    """``RegisteredBuffers`` (the writer's staging, the reader's get buffers): a buffer
    handed out is not handed out again until given back; then the smallest that fits is
    reused, registered (a put from it reads it in place); past ``keep_bytes`` a freed one is
    unregistered."""
    pool = RegisteredBuffers(sink, keep_bytes=16 * MiB)
    a = pool.take(9 * MiB)  # sizes go up in 4 MiB steps: 12, 4 and 4 MiB
    b = pool.take(1 * MiB)
    assert a.addr != b.addr and a.nbytes >= 9 * MiB and b.nbytes >= 1 * MiB
    c = pool.take(1 * MiB)  # a and b are in use
    assert c.addr not in (a.addr, b.addr)
    a.view[:MiB] = b"\x05" * MiB
    sink.put("pooled", [(a.addr, MiB)])
    assert reader.store._store.get("pooled") == b"\x05" * MiB
    sink.remove("pooled")
    pool.give(b)
    pool.give(a)
    again = pool.take(6 * MiB)
    assert again is a  # b is too small; a fits
    assert pool.take(100) is b
    pool.give(again)
    pool.give(b)
    pool.give(c)  # 12 + 4 + 4 MiB free: past keep_bytes the largest goes
    assert sorted(x.addr for x in pool.free) == sorted([b.addr, c.addr])
    kept = {x.addr for x in pool.free}
    for x in (a, b, c):
        assert sink._registered(x.addr, x.nbytes) == (x.addr in kept)
    pool.close()
    assert not any(sink._registered(x.addr, x.nbytes) for x in (a, b, c))


@needs_mooncake
def test_registered_buffers_of_growing_samples_are_not_all_kept(sink):
    """The reader's pool (``keep_bytes`` None, ``StoreFetcher``'s) fed samples in growing
    size, one at a time (a dataset sorted by length, --concurrency 1): a buffer registered
    because no free one fits replaces the free ones (all smaller), so the pool holds one
    buffer, not one per 4 MiB step (before: 5 buffers, 45 MiB registered, and, as each was
    written by its get, resident)."""
    pool = RegisteredBuffers(sink)
    before = len(sink._regions)
    taken = []
    for mib in (1, 5, 9, 13, 17):
        buf = pool.take(mib * MiB)
        buf.view[:mib * MiB] = b"\x01" * (mib * MiB)
        taken.append(buf)
        pool.give(buf)
    assert [x.addr for x in pool.free] == [taken[-1].addr] and taken[-1].nbytes >= 17 * MiB
    assert len(sink._regions) == before + 1  # the others unregistered (an address may come again)
    assert pool.take(2 * MiB) is taken[-1]  # the larger one serves smaller samples
    pool.close()
