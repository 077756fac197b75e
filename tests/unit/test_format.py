"""The file contract: names, atomic write, completion lock, index, reader.

References are independent of the code under test: tensors built by hand, names checked
against the rules in format.py's docstring, files read back with safetensors directly.
"""

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors import safe_open

from dumpfiles import write_dump
from sglang_ext import format as fmt
from standins import RIDS


def _tensors(t=5, layers=4, hidden=8, dtype=torch.bfloat16):
    hs = torch.arange(t * layers * hidden, dtype=torch.float32).reshape(t, layers, hidden)
    return hs.to(dtype), torch.arange(100, 100 + t, dtype=torch.int64)




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
    write_dump(res, hs, ids, fmt.build_metadata(rid=rid, layer_ids=[1, 2, 3, 4], num_layers=4))
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
    size = write_dump(res, hs, ids, meta)
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
        write_dump(res, hs, torch.zeros(2, dtype=torch.int64), {"rid": "dup"})
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
    write_dump(res, *_tensors(), {"rid": "target"})
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
    write_dump(res, *_tensors(), {"rid": "r"})
    fmt.complete(res)
    assert os.listdir(elsewhere) == []
    assert os.listdir(tmp_path / "hs-moved") == [res.name]
    os.close(fd)


def test_failed_write_leaves_no_final_and_no_tmp(dump_dir, monkeypatch):
    """The writer process's own steps (``writer_process.Writer``, driven in this process
    with a hand-filled arena): the rows' write stops part-way as on a full disk; the
    request's ``Finish`` then fails its reservation. Only ``<name>.error`` stays, with
    the reason, and the acknowledgements say so."""
    import collections
    import mmap

    from sglang_ext import wire, writer_process

    d, fd = dump_dir
    hs, ids = _tensors()  # [5, 4, 8] bf16
    rows = hs.reshape(5, 32).view(torch.uint8).numpy().tobytes()
    arena = mmap.mmap(-1, 1 << 16)
    arena[0:40] = ids.numpy().tobytes()
    arena[4096:4096 + len(rows)] = rows
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK)
    acks = collections.deque()
    writer = writer_process.Writer(fd, arena, tag="t", layer_ids=[1, 2, 3, 4], num_layers=4,
                                   extra={}, acks=acks, wake=wake_w)
    real = fmt.pwrite_all

    def boom(fd_, data, offset):
        if len(memoryview(data)) != len(rows):
            return real(fd_, data, offset)  # the header and the token ids
        real(fd_, b"partial", offset)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fmt, "pwrite_all", boom)
    res = fmt.reserve(fd, "r")
    writer.handle(wire.Begin(0, "r", 5, 32, "bfloat16", piece=0, token_off=0), None)
    assert [n for n in os.listdir(d) if fmt.is_tmp_name(n)], "the temporary file is open"
    writer.handle(wire.Rows(0, 0, 5, piece=1, off=4096), None)
    writer.handle(wire.Finish(0, res.name), res.lock_fd)
    why = "OSError: [Errno 28] No space left on device"
    assert sorted(os.listdir(d)) == [res.name + fmt.ERROR_SUFFIX]
    assert fmt.wait_complete(str(d / res.name), timeout=1) == why
    assert list(acks) == [wire.DonePiece(0, 40), wire.DonePiece(1, 5 * 64), wire.Failed(0, res.name, why)]
    os.close(wake_r)
    os.close(wake_w)


def test_shape_mismatch_is_refused():
    hs, _ = _tensors(t=5)
    with pytest.raises(fmt.DumpFormatError, match="5 rows for 4 token ids"):
        fmt.check_tensors(hs, torch.zeros(4, dtype=torch.int64))


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
    write_dump(res, *_tensors(), {"rid": "slow"})
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
    # Leftovers of a killed run: the writer's temporary file, an earlier release's
    # (".<name>.safetensors.tmp"), safetensors' own, and a lock nobody holds; a held lock
    # and hidden files of other kinds stay.
    (d / fmt.tmp_name("123-0", 7)).write_bytes(b"partial")
    (d / f".x{fmt.SUFFIX}{fmt.TMP_SUFFIX}").write_bytes(b"partial")
    (d / ".tmpAb12_9").write_bytes(b"partial")
    (d / f"x{fmt.SUFFIX}{fmt.LOCK_SUFFIX}").write_bytes(b"")
    (d / ".keep").write_bytes(b"")
    (d / f"..x{fmt.SUFFIX}{fmt.TMP_SUFFIX}").write_bytes(b"")
    held = fmt.reserve(fd, "held")
    assert fmt.clean_stale(fd) == {"tmp": 3, "lock": 1}
    assert sorted(os.listdir(d)) == sorted(["index.jsonl", held.lock_name, ".keep",
                                            f"..x{fmt.SUFFIX}{fmt.TMP_SUFFIX}"])
    fmt.fail(held, "x")


@pytest.mark.parametrize("layer_ids", ["[5, 1, 2]", "{\"a\": 1}", "not json", "[1, 2]", "[1, 1, 2]"])
def test_load_refuses_bad_layer_ids_metadata(tmp_path, layer_ids):
    from safetensors.torch import save_file

    path = tmp_path / "x.safetensors"
    hs, ids = _tensors(t=3, layers=3)
    save_file({"hidden_states": hs, "token_ids": ids}, str(path), metadata={"layer_ids": layer_ids})
    with pytest.raises(fmt.DumpFormatError, match="layer_ids"):
        fmt.load(str(path))


def _slow_polling(monkeypatch):
    """Polls 2 s apart: a waiter that returns sooner was woken by the release itself."""
    monkeypatch.setattr(fmt, "POLL_FIRST_S", 2.0)
    monkeypatch.setattr(fmt, "POLL_MAX_S", 2.0)


@pytest.mark.parametrize("outcome", ["complete", "fail"])
def test_wait_complete_is_woken_by_the_release_not_the_next_poll(dump_dir, monkeypatch, outcome):
    """With polls 2 s apart the waiter still returns right after ``complete`` / ``fail``
    (inotify on the lock: its unlink), with the file's outcome. The bound (1 s) is half a
    poll, far above a wake-up's cost even on a loaded box."""
    _slow_polling(monkeypatch)
    d, fd = dump_dir
    res = fmt.reserve(fd, f"woken-{outcome}")
    path = str(d / res.name)
    result = {}

    def waiter():
        result["err"] = fmt.wait_complete(path, timeout=30)
        result["t"] = time.monotonic()

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.3)  # the waiter is in its first 2 s wait
    assert t.is_alive()
    if outcome == "complete":
        write_dump(res, *_tensors(), {"rid": "woken"})
        released = time.monotonic()
        fmt.complete(res)
    else:
        released = time.monotonic()
        fmt.fail(res, "disk on fire")
    t.join(5)
    assert result["err"] == (None if outcome == "complete" else "disk on fire")
    assert result["t"] - released < 1.0, f"woken {result['t'] - released:.3f} s after the release"


def test_wait_complete_async_is_woken_by_the_release(dump_dir, monkeypatch):
    """The asyncio waiter (the tokenizer manager's) is woken through the loop as well."""
    _slow_polling(monkeypatch)
    d, fd = dump_dir
    res = fmt.reserve(fd, "woken-async")
    path = str(d / res.name)

    async def scenario():
        task = asyncio.ensure_future(fmt.wait_complete_async(path, timeout=30))
        await asyncio.sleep(0.3)
        assert not task.done()
        write_dump(res, *_tensors(), {"rid": "woken-async"})
        released = time.monotonic()
        fmt.complete(res)
        err = await asyncio.wait_for(task, 5)
        return err, time.monotonic() - released

    err, after = asyncio.run(scenario())
    assert err is None and after < 1.0, after


def test_a_writer_that_dies_holding_the_lock_wakes_the_waiter(dump_dir, monkeypatch, tmp_path):
    """A process holding the lock is SIGKILLed (the kernel drops its flock, nothing is
    unlinked): the waiter wakes at once (the close of the lock's descriptor), sees no
    outcome and keeps the dead-writer settle time (``SETTLE_S``) before "missing"."""
    _slow_polling(monkeypatch)
    monkeypatch.setattr(fmt, "SETTLE_S", 0.5)
    d, fd = dump_dir
    res = fmt.reserve(fd, "dies")
    path = str(d / res.name)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              pass_fds=(res.lock_fd,))
    os.close(res.lock_fd)  # only the holder has it now
    calls = []
    real = fmt.completion._settled

    def counted(*a):
        calls.append(time.monotonic())
        return real(*a)

    monkeypatch.setattr(fmt.completion, "_settled", counted)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("err", fmt.wait_complete(path, timeout=30)))
    t.start()
    time.sleep(0.3)
    assert len(calls) == 1, "a waiter must not wake itself (its own open of the lock)"
    holder.kill()
    holder.wait()
    t.join(10)
    assert "missing" in result["err"]
    assert len(calls) >= 2 and calls[1] - calls[0] < 1.5  # woken by the death, not a 2 s poll


# ---- reading without torch (issue 51) ----------------------------------------------------
_LOAD_WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None  # 'import torch' raises ImportError, as on a client's light install
import numpy as np
from sglang_ext import format as fmt
out, paths = sys.argv[1], sys.argv[2:]
for i, path in enumerate(paths[:2]):
    rec, deq = fmt.load(path), fmt.load(path, dequantize=True)
    np.savez(f"{out}/{i}.npz", hs=rec.hidden_states, ids=rec.token_ids, deq=deq.hidden_states,
             scales=np.zeros(0, np.float32) if rec.scales is None else rec.scales,
             layer_ids=np.array(rec.layer_ids))
for path in paths[2:]:
    try:
        fmt.load(path)
    except fmt.DumpFormatError as e:
        print("DumpFormatError:", e)
"""


def test_load_without_torch_gives_the_stored_values_exactly(dump_dir, tmp_path):
    """``load`` in an interpreter where ``import torch`` fails: numpy arrays, bf16 widened
    bit for bit (every bf16 bit pattern but NaNs' payloads), fp8 decoded (all 256 e4m3
    bytes) and dequantized as torch's float32 ``fp8 * scale``; a truncated file is
    ``DumpFormatError``. Reference: torch's own conversions, in this process."""
    d, fd = dump_dir
    g = torch.Generator().manual_seed(5)
    bits = torch.randint(0, 1 << 16, (64, 4, 32), generator=g, dtype=torch.int32).to(torch.int16)
    bf16 = bits.view(torch.bfloat16)
    fp8 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(8, 2, 16)
    scales = torch.rand(8, 2, 1, generator=g) * 10
    paths = []
    for rid, hs, sc in (("bf16", bf16, None), ("fp8", fp8, scales)):
        res = fmt.reserve(fd, rid)
        ids = torch.arange(hs.shape[0], dtype=torch.int64) * 7
        write_dump(res, hs, ids, fmt.build_metadata(rid=rid, layer_ids=range(1, hs.shape[1] + 1),
                                                    num_layers=40), sc)
        fmt.complete(res)
        paths.append(str(d / res.name))
    cut = d / "cut.safetensors"
    cut.write_bytes((d / os.path.basename(paths[0])).read_bytes()[:-100])
    huge = d / "huge.safetensors"  # no bytes, but dimensions no array can have
    text = json.dumps({"hidden_states": {"dtype": "BF16", "shape": [0, 2**60, 2**60], "data_offsets": [0, 0]},
                       "token_ids": {"dtype": "I64", "shape": [0], "data_offsets": [0, 0]}}).encode()
    huge.write_bytes(len(text).to_bytes(8, "little") + text)
    overlap = d / "overlap.safetensors"  # token_ids over hidden_states' bytes (a review read garbage ids)
    text = json.dumps({"hidden_states": {"dtype": "BF16", "shape": [2, 1, 8], "data_offsets": [0, 32]},
                       "token_ids": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]},
                       "__metadata__": {"layer_ids": "[1]"}}).encode()
    overlap.write_bytes(len(text).to_bytes(8, "little") + text + bytes(32))
    with pytest.raises(fmt.DumpFormatError):  # torch's path (safetensors) refuses it
        fmt.load(str(overlap))
    r = subprocess.run([sys.executable, "-c", _LOAD_WITHOUT_TORCH, str(tmp_path), *paths, str(cut), str(huge),
                        str(overlap)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 3 and all(x.startswith("DumpFormatError: ") for x in lines), r.stdout
    assert str(cut) in lines[0] and str(huge) in lines[1] and "overlap" in lines[2], r.stdout
    import numpy as np

    for i, (hs, sc) in enumerate(((bf16, None), (fp8, scales))):
        got = np.load(tmp_path / f"{i}.npz")
        want = hs.float().numpy()
        nan = np.isnan(want)
        assert got["hs"].dtype == np.float32 and np.array_equal(np.isnan(got["hs"]), nan)
        same = got["hs"][~nan].view(np.uint32) == want[~nan].view(np.uint32)
        assert same.all(), f"{(~same).sum()} values differ, first {got['hs'][~nan][~same][:4]} vs {want[~nan][~same][:4]}"
        assert got["ids"].dtype == np.int64 and got["ids"].tolist() == (torch.arange(hs.shape[0]) * 7).tolist()
        assert got["layer_ids"].tolist() == list(range(1, hs.shape[1] + 1))
        if sc is not None:
            assert np.array_equal(got["scales"], sc.numpy())
            ref = fmt.load(paths[i], dequantize=True).hidden_states.numpy()  # torch's float32 fp8 * scale
            assert np.array_equal(got["deq"], ref, equal_nan=True)
