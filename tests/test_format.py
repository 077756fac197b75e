"""The file contract: names, atomic write, completion lock, index, reader.

References are independent of the code under test: tensors built by hand, names checked
against the rules in format.py's docstring, files read back with safetensors directly.
"""

import json
import os
import re
import threading

import pytest
import torch
from safetensors import safe_open

from sglang_ext import format as fmt


def _tensors(t=5, layers=4, hidden=8, dtype=torch.bfloat16):
    hs = torch.arange(t * layers * hidden, dtype=torch.float32).reshape(t, layers, hidden)
    return hs.to(dtype), torch.arange(100, 100 + t, dtype=torch.int64)


@pytest.fixture
def dump_dir(tmp_path):
    d = tmp_path / "hs"
    d.mkdir()
    fd = fmt.open_dump_dir(str(d))
    yield d, fd
    os.close(fd)


RIDS = [
    "plain-rid_1.0",
    "../../etc/passwd",
    "/abs/path",
    "a\x00b",
    "dir/sub\\file",
    "x" * 5000,
    "漢字-emoji-😀",
    "",
    "..",
    ".hidden",
    "\udcff-lone-surrogate",
]


@pytest.mark.parametrize("rid", RIDS)
def test_safe_stem_never_a_path(rid):
    stem = fmt.safe_stem(rid)
    assert re.fullmatch(r"[A-Za-z0-9._-]+", stem), stem
    assert not stem.startswith(".")
    assert len((stem + "-99999" + fmt.SUFFIX + fmt.ERROR_SUFFIX).encode()) < 255


def test_safe_stem_distinguishes_rids_that_sanitise_alike():
    assert fmt.safe_stem("a/b") != fmt.safe_stem("a_b")
    assert fmt.safe_stem("a/b") == fmt.safe_stem("a/b")


@pytest.mark.parametrize("rid", RIDS)
def test_hostile_rids_land_inside_the_directory(dump_dir, rid):
    d, fd = dump_dir
    res = fmt.reserve(fd, rid)
    hs, ids = _tensors()
    fmt.write_reserved(res, hs, ids, fmt.build_metadata(rid=rid, layer_ids=[1, 2, 3, 4], num_layers=4))
    fmt.complete(res)
    entries = os.listdir(d)
    assert entries == [res.name]
    assert os.path.dirname(os.path.realpath(d / res.name)) == os.path.realpath(d)
    with safe_open(str(d / res.name), framework="pt") as f:
        meta_rid = f.metadata()["rid"]
    if "\udcff" in rid:
        assert meta_rid == rid.replace("\udcff", "\\udcff")
    else:
        assert meta_rid == rid


def test_round_trip_keys_shapes_dtype_metadata(dump_dir):
    d, fd = dump_dir
    hs, ids = _tensors(t=7, layers=3, hidden=16)
    res = fmt.reserve(fd, "req-1")
    meta = fmt.build_metadata(rid="req-1", layer_ids=[2, 5, 8], num_layers=8, extra={"model_path": "/m"})
    size = fmt.write_reserved(res, hs, ids, meta)
    fmt.complete(res)
    path = d / res.name
    assert size == path.stat().st_size
    # Read back with safetensors itself (the contract speculators relies on).
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == ["hidden_states", "token_ids"]
        got_hs, got_ids, got_meta = f.get_tensor("hidden_states"), f.get_tensor("token_ids"), f.metadata()
    assert got_hs.dtype == torch.bfloat16 and got_hs.shape == (7, 3, 16)
    assert torch.equal(got_hs, hs)
    assert got_ids.dtype == torch.int64 and torch.equal(got_ids, ids)
    assert json.loads(got_meta["layer_ids"]) == [2, 5, 8]
    assert got_meta["rid"] == "req-1" and got_meta["model_path"] == "/m"
    assert got_meta["format"] == fmt.FORMAT_VERSION
    rec = fmt.load(str(path))
    assert rec.layer_ids == [2, 5, 8] and torch.equal(rec.hidden_states, hs)


def test_same_rid_twice_gets_two_files(dump_dir):
    d, fd = dump_dir
    names = []
    for value in (1.0, 2.0):
        res = fmt.reserve(fd, "dup")
        hs = torch.full((2, 1, 4), value)
        fmt.write_reserved(res, hs, torch.zeros(2, dtype=torch.int64), {"rid": "dup"})
        fmt.complete(res)
        names.append(res.name)
    assert len(set(names)) == 2
    assert [fmt.load(str(d / n)).hidden_states[0, 0, 0].item() for n in names] == [1.0, 2.0]


def test_concurrent_reservations_of_one_rid_are_distinct(dump_dir):
    _, fd = dump_dir
    out, lock = [], threading.Lock()

    def take():
        r = fmt.reserve(fd, "same")
        with lock:
            out.append(r)

    threads = [threading.Thread(target=take) for _ in range(16)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len({r.name for r in out}) == 16
    for r in out:
        fmt.complete(r)


def test_planted_symlink_is_not_followed(dump_dir, tmp_path):
    d, fd = dump_dir
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    stem = fmt.safe_stem("target")
    os.symlink(victim, d / f"{stem}{fmt.SUFFIX}")
    os.symlink(victim, d / f"{stem}-1{fmt.SUFFIX}{fmt.LOCK_SUFFIX}")
    res = fmt.reserve(fd, "target")
    assert res.name == f"{stem}-2{fmt.SUFFIX}"
    fmt.write_reserved(res, *_tensors(), {"rid": "target"})
    fmt.complete(res)
    assert victim.read_text() == "keep me"


def test_directory_swapped_for_symlink_after_open(tmp_path):
    d = tmp_path / "hs"
    d.mkdir()
    fd = fmt.open_dump_dir(str(d))
    os.rename(d, tmp_path / "hs-moved")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, d)
    res = fmt.reserve(fd, "r")
    fmt.write_reserved(res, *_tensors(), {"rid": "r"})
    fmt.complete(res)
    assert os.listdir(elsewhere) == []
    assert os.listdir(tmp_path / "hs-moved") == [res.name]
    os.close(fd)


@pytest.mark.parametrize("prepared", [False, True], ids=["inline-tmp", "prepared-tmp"])
def test_failed_write_leaves_no_final_and_no_tmp(dump_dir, monkeypatch, prepared):
    d, fd = dump_dir
    res = fmt.reserve(fd, "r")
    tmp = fmt.create_tmp(fd, 1 << 16) if prepared else None
    real_pwritev = os.pwritev
    calls = []

    def boom(wfd, buffers, offset):
        # The kernel takes the first buffer (the header) only, then the disk fills up.
        calls.append(offset)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real_pwritev(wfd, buffers[:1], offset)

    monkeypatch.setattr(os, "pwritev", boom)
    with pytest.raises(OSError, match="No space"):
        fmt.write_reserved(res, *_tensors(), {"rid": "r"}, tmp)
    monkeypatch.undo()
    assert len(calls) == 2 and calls[1] > 0  # the second call went on after the header
    fmt.fail(res, "OSError: No space left on device")
    assert sorted(os.listdir(d)) == [res.name + fmt.ERROR_SUFFIX]
    assert fmt.wait_complete(str(d / res.name), timeout=1) == "OSError: No space left on device"


def _split(raw: bytes):
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:], n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_file_is_what_safetensors_save_file_writes(dump_dir, tmp_path, dtype):
    """The reference is safetensors' own writer: same header fields (metadata key order
    aside: its writer keeps them in a hash map), same padding, byte-equal data."""
    from safetensors.torch import save_file

    d, fd = dump_dir
    hs, ids = _tensors(t=9, layers=3, hidden=5, dtype=dtype)
    meta = fmt.build_metadata(rid="ref", layer_ids=[1, 2, 3], num_layers=3, extra={"model_path": "/m/é"})
    res = fmt.reserve(fd, "ref")
    size = fmt.write_reserved(res, hs, ids, meta)
    fmt.complete(res)
    ref = tmp_path / "ref.safetensors"
    save_file({"hidden_states": hs, "token_ids": ids}, str(ref), metadata=meta)
    ours, theirs = (d / res.name).read_bytes(), ref.read_bytes()
    assert size == len(ours) == len(theirs)
    (h1, data1, n1), (h2, data2, n2) = _split(ours), _split(theirs)
    assert h1 == h2 and n1 == n2
    assert data1 == data2


def test_prepared_file_ends_at_its_preallocation_with_page_aligned_data(dump_dir, tmp_path):
    """The writer prepares file_bytes_estimate() bytes: the header's padding fills the
    allowance, so the file is exactly that long and the data starts at HEADER_ALLOWANCE;
    safetensors reads it, and its header says what save_file's says."""
    from safetensors.torch import save_file

    d, fd = dump_dir
    hs, ids = _tensors(t=6, layers=4, hidden=8)
    est = fmt.file_bytes_estimate(6, 4 * 8 * 2)
    tmp = fmt.create_tmp(fd, est)
    res = fmt.reserve(fd, "aligned")
    meta = fmt.build_metadata(rid="aligned", layer_ids=[1, 2, 3, 4], num_layers=4)
    size = fmt.write_reserved(res, hs, ids, meta, tmp)
    fmt.complete(res)
    raw = (d / res.name).read_bytes()
    assert size == est == len(raw)
    header, data, n = _split(raw)
    assert 8 + n == fmt.HEADER_ALLOWANCE and raw[8:8 + n].rstrip(b" ").endswith(b"}")
    save_file({"hidden_states": hs, "token_ids": ids}, str(tmp_path / "ref"), metadata=meta)
    ref_header, ref_data, _ = _split((tmp_path / "ref").read_bytes())
    assert header == ref_header and data == ref_data
    rec = fmt.load(str(d / res.name))
    assert torch.equal(rec.hidden_states, hs) and torch.equal(rec.token_ids, ids)


def test_prepared_tmp_is_trimmed_and_long_headers_fit(dump_dir):
    d, fd = dump_dir
    hs, ids = _tensors(t=4, layers=2, hidden=8)
    # More than the tensors need: the file is cut back to its size.
    res = fmt.reserve(fd, "big")
    tmp = fmt.create_tmp(fd, 1 << 20)
    assert tmp.allocated == 1 << 20 and os.fstat(tmp.fd).st_size == 1 << 20
    size = fmt.write_reserved(res, hs, ids, {"rid": "big"}, tmp)
    fmt.complete(res)
    assert (d / res.name).stat().st_size == size < 1 << 20
    # A header longer than the estimate's allowance: written all the same.
    res2 = fmt.reserve(fd, "long")
    est = fmt.file_bytes_estimate(4, 2 * 8 * 2)
    tmp2 = fmt.create_tmp(fd, est)
    long_meta = {"rid": "long", "note": "n" * (3 * fmt.HEADER_ALLOWANCE)}
    size2 = fmt.write_reserved(res2, hs, ids, long_meta, tmp2)
    fmt.complete(res2)
    assert size2 > est
    rec = fmt.load(str(d / res2.name))
    assert torch.equal(rec.hidden_states, hs) and rec.metadata["note"] == long_meta["note"]
    assert sorted(os.listdir(d)) == sorted([res.name, res2.name])


def test_short_writes_are_continued(dump_dir, monkeypatch):
    """pwritev may write less than asked (the kernel caps one call near 2 GiB): the rest
    follows from where it stopped, also mid-buffer."""
    d, fd = dump_dir
    real_pwritev = os.pwritev
    sizes = []

    def short(wfd, buffers, offset):
        first = memoryview(buffers[0])
        n = real_pwritev(wfd, [first[:max(1, len(first) // 3)]], offset)
        sizes.append(n)
        return n

    monkeypatch.setattr(os, "pwritev", short)
    hs, ids = _tensors(t=16, layers=2, hidden=8)
    res = fmt.reserve(fd, "short")
    size = fmt.write_reserved(res, hs, ids, {"rid": "short"})
    monkeypatch.undo()
    fmt.complete(res)
    assert len(sizes) > 3 and sum(sizes) == size
    rec = fmt.load(str(d / res.name))
    assert torch.equal(rec.hidden_states, hs) and torch.equal(rec.token_ids, ids)


def test_create_tmp_refuses_what_does_not_fit_and_leaves_nothing(dump_dir, monkeypatch):
    d, fd = dump_dir

    def full(tfd, off, n):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="No space"):
        fmt.create_tmp(fd, 1 << 20)
    assert os.listdir(d) == []


def test_create_tmp_without_fallocate_support_still_writes(dump_dir, monkeypatch):
    d, fd = dump_dir

    def unsupported(tfd, off, n):
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    tmp = fmt.create_tmp(fd, 1 << 20)
    assert tmp.allocated == 0
    hs, ids = _tensors()
    res = fmt.reserve(fd, "nofalloc")
    fmt.write_reserved(res, hs, ids, {"rid": "nofalloc"}, tmp)
    fmt.complete(res)
    assert torch.equal(fmt.load(str(d / res.name)).hidden_states, hs)


def test_refused_tensors_remove_the_prepared_tmp(dump_dir):
    d, fd = dump_dir
    res = fmt.reserve(fd, "r")
    tmp = fmt.create_tmp(fd, 1 << 16)
    hs, _ = _tensors(t=5)
    with pytest.raises(fmt.DumpFormatError):
        fmt.write_reserved(res, hs, torch.zeros(4, dtype=torch.int64), {}, tmp)
    fmt.fail(res, "x")
    assert sorted(os.listdir(d)) == [res.name + fmt.ERROR_SUFFIX]


def test_shape_mismatch_is_refused(dump_dir):
    _, fd = dump_dir
    res = fmt.reserve(fd, "r")
    hs, _ = _tensors(t=5)
    with pytest.raises(fmt.DumpFormatError, match="5 rows for 4 token ids"):
        fmt.write_reserved(res, hs, torch.zeros(4, dtype=torch.int64), {})
    fmt.fail(res, "x")


def test_wait_complete_blocks_until_lock_released(dump_dir):
    d, fd = dump_dir
    res = fmt.reserve(fd, "slow")
    path = str(d / res.name)
    result = {}

    def waiter():
        result["err"] = fmt.wait_complete(path, timeout=10)
        result["exists"] = os.path.exists(path)

    t = threading.Thread(target=waiter)
    t.start()
    t.join(0.2)
    assert t.is_alive(), "waiter returned while the lock was held"
    fmt.write_reserved(res, *_tensors(), {"rid": "slow"})
    fmt.complete(res)
    t.join(5)
    assert result == {"err": None, "exists": True}


def test_wait_complete_times_out(dump_dir):
    d, fd = dump_dir
    res = fmt.reserve(fd, "stuck")
    with pytest.raises(TimeoutError):
        fmt.wait_complete(str(d / res.name), timeout=0.1)
    fmt.fail(res, "x")


def test_index_lines_and_clean_stale(dump_dir):
    d, fd = dump_dir
    fmt.append_index(fd, {"rid": "a", "file": "a.safetensors", "num_tokens": 3, "bytes": 10})
    fmt.append_index(fd, {"rid": "b", "file": "b.safetensors", "num_tokens": 4, "bytes": 11})
    assert [r["rid"] for r in fmt.read_index(str(d))] == ["a", "b"]
    # Leftovers of a killed run: a tmp file and a lock nobody holds; a held lock stays.
    (d / f".x{fmt.SUFFIX}{fmt.TMP_SUFFIX}").write_bytes(b"partial")
    (d / f".~123-4{fmt.SUFFIX}{fmt.TMP_SUFFIX}").write_bytes(b"partial")
    (d / f"x{fmt.SUFFIX}{fmt.LOCK_SUFFIX}").write_bytes(b"")
    held = fmt.reserve(fd, "held")
    assert fmt.clean_stale(fd) == {"tmp": 2, "lock": 1}
    assert sorted(os.listdir(d)) == sorted(["index.jsonl", held.lock_name])
    fmt.fail(held, "x")


@pytest.mark.parametrize("layer_ids", ["[5, 1, 2]", "{\"a\": 1}", "not json", "[1, 2]", "[1, 1, 2]"])
def test_load_refuses_bad_layer_ids_metadata(tmp_path, layer_ids):
    from safetensors.torch import save_file

    path = tmp_path / "x.safetensors"
    hs, ids = _tensors(t=3, layers=3)
    save_file({"hidden_states": hs, "token_ids": ids}, str(path), metadata={"layer_ids": layer_ids})
    with pytest.raises(fmt.DumpFormatError, match="layer_ids"):
        fmt.load(str(path))
