"""The file contract at its edges: full disks, planted FIFOs, crafted headers, file modes,
and the cost of reusing a rid (issue 36, items 3, 6, 7, 9, 11).

Real files, real FIFOs (``os.mkfifo``) and a real file-size limit (``RLIMIT_FSIZE`` in a
child process, where a ``write`` that would cross it is cut short or fails with ``EFBIG``,
as on a full disk). Whatever may block runs in a child process with a timeout, so that a
regression fails instead of hanging the suite.
"""

import json
import math
import os
import re
import stat
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

from dumpfiles import write_dump
from sglang_ext import format as fmt

BOUND_S = 20  # a call that blocks on a FIFO would never return: this fails it instead


def _child(code: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``code`` (with ``fmt`` imported and ``sys.argv[1:] == args``) in a fresh
    interpreter; fail the test if it has not returned within ``BOUND_S``."""
    prog = "import os, sys\nfrom sglang_ext import format as fmt\n" + textwrap.dedent(code)
    try:
        return subprocess.run([sys.executable, "-c", prog, *args], capture_output=True,
                              text=True, timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"blocked for more than {BOUND_S}s (a FIFO opened without O_NONBLOCK?)")


def _tensors(t=5, layers=4, hidden=8):
    hs = torch.arange(t * layers * hidden, dtype=torch.float32).reshape(t, layers, hidden)
    return hs.to(torch.bfloat16), torch.arange(100, 100 + t, dtype=torch.int64)


# -- item 7: an index line is written whole or not at all -------------------------------

_APPEND_UNDER_LIMIT = """
    import resource, signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    fd = fmt.open_dump_dir(sys.argv[1])
    limit = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        fmt.append_index(fd, {"rid": "cut", "file": "cut.safetensors", "pad": "x" * 200})
    except OSError as e:
        print("OSError:", e)
    else:
        print("no error")
"""


@pytest.mark.parametrize("room", [0, 50], ids=["efbig", "short-write"])
def test_index_line_is_whole_or_absent_on_a_full_disk(dump_dir, room):
    d, fd = dump_dir
    fmt.append_index(fd, {"rid": "a", "file": "a.safetensors"})
    before = (d / fmt.INDEX_NAME).read_bytes()
    # The file may grow by `room` bytes only: the 200-byte line cannot fit.
    r = _child(_APPEND_UNDER_LIMIT, str(d), str(len(before) + room))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("OSError:") and fmt.INDEX_NAME in r.stdout, r.stdout
    after = (d / fmt.INDEX_NAME).read_bytes()
    assert after == before, f"index changed from {before!r} to {after!r}"
    # The next record starts on a line of its own.
    fmt.append_index(fd, {"rid": "b", "file": "b.safetensors"})
    assert [r["rid"] for r in fmt.read_index(str(d))] == ["a", "b"]


# -- item 9: reserving a name costs O(log n) syscalls, not O(n) --------------------------


class _CountCalls:
    """Counts ``os.open`` and ``os.stat`` calls (those ``reserve`` makes per candidate)."""

    def __init__(self, monkeypatch):
        self.n = 0
        for fn in ("open", "stat"):
            real = getattr(os, fn)
            monkeypatch.setattr(os, fn, self._wrap(real))

    def _wrap(self, real):
        def counted(*a, **k):
            self.n += 1
            return real(*a, **k)
        return counted


def _names_of_rid(stem, count):
    return [f"{stem}{fmt.SUFFIX}"] + [f"{stem}-{n}{fmt.SUFFIX}" for n in range(1, count)]


def test_reserve_with_many_earlier_files_of_one_rid_is_logarithmic(dump_dir, monkeypatch):
    d, fd = dump_dir
    rid = "reused-rid-item9"
    stem = fmt.safe_stem(rid)
    existing = _names_of_rid(stem, 5000)
    for name in existing:
        (d / name).touch()
    # Failed writes hold a name too (their .error stays).
    (d / f"{stem}-5000{fmt.SUFFIX}{fmt.ERROR_SUFFIX}").touch()
    taken = set(existing) | {f"{stem}-5000{fmt.SUFFIX}"}
    bound = 2 * math.log2(len(taken)) + 8

    calls = _CountCalls(monkeypatch)
    res = fmt.reserve(fd, rid)
    first = calls.n
    assert first <= bound, f"reserve made {first} open/stat calls over {len(taken)} files (bound {bound:.0f})"
    assert res.name not in taken
    assert re.fullmatch(re.escape(stem) + r"-[0-9]+" + re.escape(fmt.SUFFIX), res.name), res.name
    assert (d / res.lock_name).is_file()

    # The next one of the same rid is O(1).
    calls.n = 0
    res2 = fmt.reserve(fd, rid)
    assert calls.n <= 8, f"second reserve made {calls.n} calls"
    assert res2.name not in taken | {res.name}

    # Another process took the names after ours: still logarithmic in what it took.
    start = int(res2.name[len(stem) + 1:-len(fmt.SUFFIX)]) + 1
    others = [f"{stem}-{n}{fmt.SUFFIX}" for n in range(start, start + 3000)]
    for name in others:
        (d / name).touch()
    calls.n = 0
    res3 = fmt.reserve(fd, rid)
    assert calls.n <= 2 * math.log2(3000) + 8, f"reserve after 3000 foreign names: {calls.n} calls"
    assert res3.name not in taken | set(others) | {res.name, res2.name}
    for r in (res, res2, res3):
        fmt.cancel(r)


def test_reserve_in_a_fresh_directory_takes_the_plain_name(tmp_path):
    """The hint learnt in one directory does not spoil another's first name."""
    names = []
    for sub in ("one", "two"):
        (tmp_path / sub).mkdir()
        fd = fmt.open_dump_dir(str(tmp_path / sub))
        try:
            a, b = fmt.reserve(fd, "r9"), fmt.reserve(fd, "r9")
            names.append((a.name, b.name))
            fmt.cancel(a)
            fmt.cancel(b)
        finally:
            os.close(fd)
    stem = fmt.safe_stem("r9")
    assert names[0][0] == names[1][0] == f"{stem}{fmt.SUFFIX}"


def test_the_per_stem_hints_are_bounded(dump_dir, monkeypatch):
    _, fd = dump_dir
    monkeypatch.setattr(fmt.names, "_NEXT_HINT_MAX", 8)
    held = [fmt.reserve(fd, f"lru-{i}") for i in range(20)]
    assert len(fmt.names._NEXT_HINT) <= 8
    # The most recent stems are the ones kept.
    assert fmt.safe_stem("lru-19") in {stem for _, _, stem in fmt.names._NEXT_HINT}
    for r in held:
        fmt.cancel(r)


# -- item 11: crafted headers are DumpFormatError, never MemoryError/RecursionError ------


def _crafted(path, n, body: bytes):
    path.write_bytes(struct.pack("<Q", n) + body)


def _header_of(entries):
    return json.dumps(entries).encode()


GOOD_HS = {"dtype": "BF16", "shape": [1, 1, 1], "data_offsets": [0, 2]}
CRAFTED = {
    "n-huge": lambda: (1 << 62, b"{}"),
    "n-over-limit": lambda: (100_000_001, b"{}" + b" " * 64),
    "n-beyond-file": lambda: (len(b"{}") + 100, b"{}"),
    "deep-nesting": lambda: (200_000, b"[" * 200_000),
    "inf-number": lambda: (None, b'{"hidden_states": {"dtype": "BF16", "shape": [1e999, 1, 1], '
                                 b'"data_offsets": [0, 2]}}\x00\x00'),
    "huge-int": lambda: (None, b'{"hidden_states": {"dtype": "BF16", "shape": [1' + b"0" * 5000
                               + b', 1, 1], "data_offsets": [0, 2]}}\x00\x00'),
    "not-a-dict": lambda: (None, b"[1, 2, 3]"),
    "not-utf8": lambda: (None, b'{"\xff\xfe": 1}'),
}


def _write_crafted(path, kind):
    n, body = CRAFTED[kind]()
    if n is None:
        n = body.index(b"}}") + 2 if b"}}" in body else len(body)
    _crafted(path, n, body)
    if kind == "n-over-limit":  # a sparse file long enough to hold what n claims
        os.truncate(path, n + 100)


@pytest.mark.parametrize("kind", sorted(CRAFTED))
def test_read_header_refuses_crafted_headers(dump_dir, kind):
    d, fd = dump_dir
    _write_crafted(d / "x.safetensors", kind)
    with pytest.raises(fmt.DumpFormatError, match="x.safetensors"):
        fmt.read_header(fd, "x.safetensors")


@pytest.mark.parametrize("kind", sorted(CRAFTED))
def test_load_refuses_crafted_headers(tmp_path, kind):
    path = tmp_path / "x.safetensors"
    _write_crafted(path, kind)
    with pytest.raises(fmt.DumpFormatError, match=re.escape(str(path))):
        fmt.load(str(path))


@pytest.mark.parametrize("header", [
    {"token_ids": GOOD_HS},
    {"hidden_states": "BF16"},
    {"hidden_states": {"dtype": "BF16", "shape": "1,1,1"}},
    {"hidden_states": {"dtype": "BF16", "shape": []}},
    {"hidden_states": {"dtype": "BF16", "shape": [-1, 1, 1]}},
    {"hidden_states": {"dtype": "BF16", "shape": [True, 1, 1]}},
    {"hidden_states": GOOD_HS, "__metadata__": ["rid"]},
], ids=["no-hidden-states", "entry-not-dict", "shape-not-list", "shape-empty", "negative",
        "bool", "metadata-not-dict"])
def test_index_record_from_header_refuses_headers_without_what_it_needs(dump_dir, header):
    d, fd = dump_dir
    body = _header_of(header)
    _crafted(d / "x.safetensors", len(body), body + b"\x00\x00")
    with pytest.raises(fmt.DumpFormatError, match="x.safetensors"):
        fmt.index_record_from_header(fd, "x.safetensors", 100)


def test_load_refuses_truncated_data(dump_dir):
    d, fd = dump_dir
    res = fmt.reserve(fd, "t")
    write_dump(res, *_tensors(), {"rid": "t"})
    fmt.complete(res)
    path = d / res.name
    os.truncate(path, path.stat().st_size - 7)
    assert fmt.read_header(fd, res.name)["hidden_states"]["shape"] == [5, 4, 8]
    with pytest.raises(fmt.DumpFormatError, match=re.escape(str(path))):
        fmt.load(str(path))


def test_load_refuses_deeply_nested_layer_ids(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "x.safetensors"
    hs, ids = _tensors(t=3, layers=3)
    save_file({"hidden_states": hs, "token_ids": ids}, str(path), metadata={"layer_ids": "[" * 100_000})
    with pytest.raises(fmt.DumpFormatError, match="layer_ids"):
        fmt.load(str(path))


def test_load_of_a_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        fmt.load(str(tmp_path / "absent.safetensors"))


# -- item 6: file modes -------------------------------------------------------------------


def _modes_of_created_files(d, fd):
    """Create each kind of file format.py makes; returns {kind: permission bits}."""
    modes = {}
    res = fmt.reserve(fd, "m")
    modes["lock"] = stat.S_IMODE((d / res.lock_name).stat().st_mode)
    tmp_fd = fmt.create_tmp(fd, fmt.tmp_name("m", 0))
    modes["tmp"] = stat.S_IMODE(os.fstat(tmp_fd).st_mode)
    os.close(tmp_fd)
    write_dump(res, *_tensors(), {"rid": "m"})
    modes["data"] = stat.S_IMODE((d / res.name).stat().st_mode)
    fmt.append_index(fd, {"rid": "m", "file": res.name})
    modes["index"] = stat.S_IMODE((d / fmt.INDEX_NAME).stat().st_mode)
    fmt.complete(res)
    bad = fmt.reserve(fd, "m")
    fmt.fail(bad, "boom")
    modes["error"] = stat.S_IMODE((d / (bad.name + fmt.ERROR_SUFFIX)).stat().st_mode)
    return modes


@pytest.mark.parametrize("env, umask, want", [
    (None, 0o022, 0o600),
    (None, 0o000, 0o600),
    ("0640", 0o022, 0o640),
    ("640", 0o027, 0o640),
    ("0660", 0o077, 0o600),
])
def test_files_are_created_with_the_file_mode_under_the_umask(dump_dir, monkeypatch, env, umask, want):
    d, fd = dump_dir
    if env is None:
        monkeypatch.delenv("KIMI_SGLANG_FILE_MODE", raising=False)
    else:
        monkeypatch.setenv("KIMI_SGLANG_FILE_MODE", env)
    old = os.umask(umask)
    try:
        modes = _modes_of_created_files(d, fd)
    finally:
        os.umask(old)
    assert modes == dict.fromkeys(modes, want), f"want {want:o} everywhere: " + \
        ", ".join(f"{k} {v:o}" for k, v in modes.items())


@pytest.mark.parametrize("value", ["0400", "0200", "rw", "0x180", "10600", "1600", "4700", "60",
                                   "-600", "0o600", "٠٦٠٠", "06 0"])
def test_file_mode_refuses_bad_values_in_one_sentence(monkeypatch, value):
    monkeypatch.setenv("KIMI_SGLANG_FILE_MODE", value)
    with pytest.raises(ValueError, match="KIMI_SGLANG_FILE_MODE") as e:
        fmt.file_mode()
    assert "\n" not in str(e.value) and repr(value) in str(e.value)


@pytest.mark.parametrize("value, want", [("600", 0o600), ("0600", 0o600), ("0777", 0o777),
                                         ("0640", 0o640), ("", 0o600)])
def test_file_mode_values(monkeypatch, value, want):
    monkeypatch.setenv("KIMI_SGLANG_FILE_MODE", value)
    assert fmt.file_mode() == want


# -- item 3: non-regular files in the directory are refused, never blocked on -----------


def test_fifo_at_index_is_refused_without_blocking(dump_dir):
    d, _ = dump_dir
    os.mkfifo(d / fmt.INDEX_NAME)
    r = _child("""
        fd = fmt.open_dump_dir(sys.argv[1])
        try:
            fmt.append_index(fd, {"rid": "a"})
        except OSError as e:
            print("OSError:", e)
        try:
            fmt.read_index(sys.argv[1])
        except OSError as e:
            print("OSError:", e)
    """, str(d))
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 2, (r.stdout, r.stderr)
    for line in lines:
        assert line.startswith("OSError:") and "index.jsonl is a FIFO, not a regular file" in line, line
    assert stat.S_ISFIFO(os.lstat(d / fmt.INDEX_NAME).st_mode)


def test_fifo_at_error_name_neither_blocks_fail_nor_the_waiter(dump_dir):
    d, _ = dump_dir
    r = _child("""
        fd = fmt.open_dump_dir(sys.argv[1])
        res = fmt.reserve(fd, "e")
        os.mkfifo(res.name + fmt.ERROR_SUFFIX, dir_fd=fd)
        fmt.fail(res, "boom")
        print(fmt.wait_complete(os.path.join(sys.argv[1], res.name), timeout=5))
    """, str(d))
    assert r.returncode == 0, r.stderr
    assert "FIFO, not a regular file" in r.stdout, r.stdout
    [fifo] = [n for n in os.listdir(d) if n.endswith(fmt.ERROR_SUFFIX)]
    assert stat.S_ISFIFO(os.lstat(d / fifo).st_mode)


def test_fifo_at_lock_name_neither_blocks_clean_stale_nor_the_waiter(dump_dir):
    d, _ = dump_dir
    name = f"planted{fmt.SUFFIX}"
    os.mkfifo(d / (name + fmt.LOCK_SUFFIX))
    r = _child("""
        fd = fmt.open_dump_dir(sys.argv[1])
        print(fmt.clean_stale(fd))
        try:
            fmt.wait_complete(os.path.join(sys.argv[1], sys.argv[2]), timeout=5)
        except OSError as e:
            print("OSError:", e)
    """, str(d), name)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == "{'tmp': 0, 'lock': 0}", out
    assert out[1].startswith("OSError:") and "FIFO, not a regular file" in out[1], out


def test_fifo_at_a_data_file_is_refused_by_the_readers(dump_dir):
    d, _ = dump_dir
    os.mkfifo(d / "f.safetensors")
    r = _child("""
        fd = fmt.open_dump_dir(sys.argv[1])
        for call in (lambda: fmt.read_header(fd, "f.safetensors"),
                     lambda: fmt.load(os.path.join(sys.argv[1], "f.safetensors"))):
            try:
                call()
            except (OSError, ValueError) as e:
                print(type(e).__name__, e)
    """, str(d))
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 2, (r.stdout, r.stderr)
    assert all("f.safetensors is a FIFO, not a regular file" in line for line in lines), lines


def test_directory_at_index_name_is_refused(dump_dir):
    d, fd = dump_dir
    (d / fmt.INDEX_NAME).mkdir()
    with pytest.raises(OSError, match="index.jsonl"):
        fmt.append_index(fd, {"rid": "a"})


def test_a_waiter_does_not_take_a_fifo_at_the_final_name_for_the_file(tmp_path):
    """Found by review: once the lock is gone, only a regular file at the final name is
    success; a FIFO (or a directory) put there is reported, not answered as the file."""
    path = tmp_path / "x.safetensors"
    os.mkfifo(path)
    error = fmt.wait_complete(str(path), timeout=5)
    assert error == f"hidden-state file {path} is not a regular file (a FIFO): not the writer's file"
    os.unlink(path)
    path.mkdir()
    assert "is not a regular file (a directory)" in fmt.wait_complete(str(path), timeout=5)


# -- issue 50 #4: an appender killed mid-line never breaks the index ----------------------

_APPEND_FOREVER = """
    fd = fmt.open_dump_dir(sys.argv[1])
    n = int(sys.argv[2])
    while True:
        fmt.append_index(fd, {"rid": f"k{n}", "file": f"k{n}.safetensors", "pad": "x" * 100_000})
        n += 1
"""


def test_index_survives_appenders_killed_mid_line(dump_dir):
    """Real SIGKILLs of a process appending 100 KB lines in a loop, 60 times: every torn
    tail is cut back under the lock by the next append, a reader skips an unfinished last
    line, and every record read is whole."""
    d, fd = dump_dir
    prog = "import os, sys\nfrom sglang_ext import format as fmt\n" + textwrap.dedent(_APPEND_FOREVER)
    ready = d / fmt.INDEX_NAME
    torn = 0
    for i in range(60):
        before = ready.stat().st_size if ready.exists() else 0
        child = subprocess.Popen([sys.executable, "-c", prog, str(d), str(i * 1000)],
                                 env=dict(os.environ), stderr=subprocess.PIPE)
        while child.poll() is None and (ready.stat().st_size if ready.exists() else 0) <= before:
            os.sched_yield()
        child.kill()
        child.wait()
        assert child.returncode == -9, child.stderr.read().decode()
        torn += not ready.read_bytes().endswith(b"\n")
        fmt.read_index(str(d))  # readable between kills: an unfinished last line is skipped
    fmt.append_index(fd, {"rid": "last", "file": "last.safetensors"})
    records = fmt.read_index(str(d))
    assert records[-1] == {"rid": "last", "file": "last.safetensors"}
    bad = [r["rid"] for r in records[:-1] if r.get("pad") != "x" * 100_000]
    assert bad == [], bad
    assert torn > 0, "no kill landed inside a line: nothing was tested"
    assert ready.read_bytes().count(b"\n") == len(records)


def test_index_rotates_into_numbered_parts_read_in_order(dump_dir):
    """Past ``part_bytes`` the append that finds the index that long renames it to
    ``index-<k>.jsonl``; ``read_index`` reads the parts then ``index.jsonl`` in write
    order, and a lock's mark still finds its line after the rotation."""
    d, fd = dump_dir
    res = fmt.reserve(fd, "marked")
    for i in range(10):
        fmt.append_index(fd, {"rid": f"r{i}", "file": f"r{i}.safetensors", "pad": "x" * 60},
                         mark_fd=res.lock_fd if i == 3 else None, part_bytes=250)
    parts = sorted(n for n in os.listdir(d) if n.startswith("index"))
    assert parts == ["index-1.jsonl", "index-2.jsonl", "index-3.jsonl", fmt.INDEX_NAME], parts
    assert all((d / p).stat().st_size <= 250 + 100 for p in parts)
    assert [r["rid"] for r in fmt.read_index(str(d))] == [f"r{i}" for i in range(10)]
    lock = os.open(d / res.lock_name, os.O_RDONLY)
    assert fmt.indexed(fd, "r3.safetensors", lock) and not fmt.indexed(fd, "r4.safetensors", lock)
    os.close(lock)
    fmt.cancel(res)


def test_a_long_tail_without_newline_is_kept_and_ended_not_cut(dump_dir):
    """A partial last line longer than any index line is no appender's (written by hand):
    the next append keeps it, ends it with a newline and starts its own line; a reader
    then names the bad line."""
    d, fd = dump_dir
    fmt.append_index(fd, {"rid": "a", "file": "a.safetensors"})
    junk = b"y" * (fmt.MAX_INDEX_LINE + 10)
    with open(d / fmt.INDEX_NAME, "ab") as f:
        f.write(junk)
    fmt.append_index(fd, {"rid": "b", "file": "b.safetensors"})
    lines = (d / fmt.INDEX_NAME).read_bytes().split(b"\n")
    assert lines[1] == junk and json.loads(lines[2]) == {"rid": "b", "file": "b.safetensors"}
    with pytest.raises(ValueError, match="index.jsonl line 2 is not JSON"):
        fmt.read_index(str(d))
