"""Spare files (writer_process.Spares): a file of pages allocated ahead becomes the next
request's temporary file, its rows stored into its mapping (copier.Copier) when it holds
the whole file. Real writer processes and files in /dev/shm (tmpfs, where the
allocation is what spares save); every file is checked against tensors built here."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

from sglang_ext import format as fmt
from sglang_ext.writer import DumpWriter
from sglang_ext.writer_process import SPARE_MIN_BYTES, STEADY_FILES, Spares, on_tmpfs
from standins import wait_for

SHM = "/dev/shm"
SLOTS, HIDDEN = 4, 1024  # 8 KiB a token: SPARE_MIN_BYTES (4 MiB) from 512 tokens


def shm_fixture(need):
    """A fixture: ``(path, descriptor)`` of a fresh dump directory in /dev/shm (tmpfs,
    where the allocation is what spares save), removed after the test; skips the test
    when /dev/shm has less than ``need`` bytes free."""
    @pytest.fixture
    def fixture(tmp_path):
        if not os.path.isdir(SHM) or shutil.disk_usage(SHM).free < need:
            pytest.skip(f"needs /dev/shm with {need >> 30} GiB free")
        d = os.path.join(SHM, f"kimi-spares-{os.getpid()}-{tmp_path.name}")
        os.makedirs(d)
        fd = fmt.open_dump_dir(d)
        yield d, fd
        os.close(fd)
        shutil.rmtree(d, ignore_errors=True)
    return fixture


shm_dir = shm_fixture(1 << 30)


def _rows(tokens, seed):
    """[T, L*H] bf16 with a value per (seed, token, element) exact in bf16."""
    t = torch.arange(tokens, dtype=torch.float32)[:, None]
    e = torch.arange(SLOTS * HIDDEN, dtype=torch.float32)[None, :]
    return ((seed * 7 + t * 3 + e) % 251).to(torch.bfloat16)


def _write(writer, fd, rid, rows, chunk=None):
    p = writer.start(rid, list(range(100, 100 + rows.shape[0])), rows.shape[1], torch.bfloat16)
    step = chunk or rows.shape[0]
    for c0 in range(0, rows.shape[0], step):
        writer.copy_rows(rows[c0:c0 + step], [(p, 0, min(step, rows.shape[0] - c0))], ready=True)
        writer.flush()
    res = fmt.reserve(fd, rid)
    writer.finish(p, res)
    writer.flush()
    return res.name


def _spare_flags(trace_path, key="spare"):
    with open(trace_path) as f:
        events = [json.loads(line) for line in f]
    return {e["name"]: e[key] for e in events if e["event"] == "file"}


def _one_after_another(shm_dir, tmp_path, monkeypatch, sizes, spares, threads=1, chunk_from=None):
    """Requests of ``sizes`` tokens written one after the other by a writer with
    ``spares`` (from request ``chunk_from`` on, in chunks of 300 rows), each waited for and
    followed by a pause in which the next spare is made (the next forward); every file is
    checked against its rows. Returns the files' names and their trace events' ``spare``
    and ``mapped`` flags."""
    d, fd = shm_dir
    trace_path = str(tmp_path / "trace.jsonl")
    monkeypatch.setenv("KIMI_SGLANG_TRACE", trace_path)
    writer = DumpWriter(fd, arena_bytes=64 << 20, threads=threads, layer_ids=[1, 2, 3, 4], num_layers=4,
                        stats_interval_s=0, register_atexit=False, spares=spares)
    try:
        names = []
        for i, tokens in enumerate(sizes):
            chunk = 300 if chunk_from is not None and i >= chunk_from else None
            names.append(_write(writer, fd, f"r{i}", _rows(tokens, i), chunk=chunk))
            assert fmt.wait_complete(os.path.join(d, names[-1]), timeout=30) is None
            assert writer.wait_idle(30)
            time.sleep(0.3)
    finally:
        assert writer.close()
    for i, (tokens, name) in enumerate(zip(sizes, names)):
        rec = fmt.load(os.path.join(d, name))
        assert torch.equal(rec.hidden_states, _rows(tokens, i).view(tokens, SLOTS, HIDDEN)), \
            f"file {i} differs from its rows"
        assert rec.token_ids.tolist() == list(range(100, 100 + tokens))
    spare, mapped = _spare_flags(trace_path), _spare_flags(trace_path, "mapped")
    return names, [spare[n] for n in names], [mapped[n] for n in names]


def test_files_written_into_spares_equal_their_rows(shm_dir, tmp_path, monkeypatch):
    """Five requests one after the other (8, 8, 5, 6 and 6 MiB; the third in a spare
    made larger, the fourth in one made smaller, the last two in chunks): every file loads
    equal to its rows and token ids, has its layout's size, is indexed, and no temporary
    file stays; the later ones were written into spares, by stores into the spare's
    mapping where it held the whole file (the second, third and fifth), else by pwrite."""
    d, _ = shm_dir
    names, spare, mapped = _one_after_another(shm_dir, tmp_path, monkeypatch, [1024, 1024, 640, 768, 768],
                                              spares=1, threads=2, chunk_from=3)
    assert [r["file"] for r in fmt.read_index(d)] == names
    assert sorted(os.listdir(d)) == sorted(names + [fmt.INDEX_NAME])
    assert spare == [False, True, True, True, True]
    assert mapped == [False, True, True, False, True]


def test_no_spares_when_told(shm_dir, tmp_path, monkeypatch):
    """``spares=0`` (``KIMI_SGLANG_WRITER_SPARES=0``) makes none: every file is created
    fresh and written by ``pwrite``, and nothing is held in the directory's filesystem
    between files."""
    _, spare, mapped = _one_after_another(shm_dir, tmp_path, monkeypatch, [1024] * 3, spares=0)
    assert spare == mapped == [False, False, False]

def test_a_request_that_fails_in_a_spare_leaves_its_error_and_no_file(shm_dir):
    """The spare taken by a request whose rows never all arrive: ``.error`` under the
    name, nothing else (no partial file, no temporary)."""
    d, fd = shm_dir
    writer = DumpWriter(fd, arena_bytes=64 << 20, threads=1, layer_ids=[1, 2, 3, 4], num_layers=4,
                        stats_interval_s=0, register_atexit=False, spares=1)
    try:
        ok = _write(writer, fd, "ok", _rows(1024, 0))
        assert fmt.wait_complete(os.path.join(d, ok), timeout=30) is None
        time.sleep(0.3)
        p = writer.start("short", list(range(1024)), SLOTS * HIDDEN, torch.bfloat16)
        writer.copy_rows(_rows(1024, 1)[:512], [(p, 0, 512)], ready=True)
        res = fmt.reserve(fd, "short")
        writer.finish(p, res)
        writer.flush()
        err = fmt.wait_complete(os.path.join(d, res.name), timeout=30)
        assert "512 of 1024 rows" in err
    finally:
        assert writer.close()
    assert sorted(os.listdir(d)) == sorted([ok, res.name + fmt.ERROR_SUFFIX, fmt.INDEX_NAME])


def test_a_spare_is_out_of_a_neighbours_reach_while_its_rows_are_stored(shm_dir, tmp_path, monkeypatch):
    """A neighbour (same user) truncating the temporary files it finds in the dump
    directory between two chunks of a request written into a mapped spare: a store past
    the truncated end would be a SIGBUS of the writer process (a review's attack). The
    spare has no name until its Finish, so there is nothing to truncate: the file is
    complete and equal to its rows, the writer process the same."""
    d, fd = shm_dir
    trace_path = str(tmp_path / "trace.jsonl")
    monkeypatch.setenv("KIMI_SGLANG_TRACE", trace_path)
    writer = DumpWriter(fd, arena_bytes=64 << 20, threads=1, layer_ids=[1, 2, 3, 4], num_layers=4,
                        stats_interval_s=0, register_atexit=False, spares=1)
    try:
        pid = writer.pid
        first = _write(writer, fd, "first", _rows(1024, 0))
        assert fmt.wait_complete(os.path.join(d, first), timeout=30) is None
        assert writer.wait_idle(30)
        time.sleep(0.3)  # the spare is made
        rows = _rows(1024, 1)
        p = writer.start("attacked", list(range(100, 1124)), rows.shape[1], torch.bfloat16)
        writer.copy_rows(rows[:512], [(p, 0, 512)], ready=True)
        assert writer.wait_idle(30)  # the first chunk is in the spare
        for name in os.listdir(d):  # the neighbour
            if name.startswith(".kimi"):
                os.truncate(os.path.join(d, name), 0)
        writer.copy_rows(rows[512:], [(p, 0, 512)], ready=True)
        res = fmt.reserve(fd, "attacked")
        writer.finish(p, res)
        writer.flush()
        assert fmt.wait_complete(os.path.join(d, res.name), timeout=30) is None
        assert writer.pid == pid and writer.snapshot()["writer_restarts"] == 0
    finally:
        assert writer.close()
    rec = fmt.load(os.path.join(d, res.name))
    assert torch.equal(rec.hidden_states, rows.view(1024, SLOTS, HIDDEN))
    assert (_spare_flags(trace_path)[res.name], _spare_flags(trace_path, "mapped")[res.name]) == (True, True)
    assert sorted(os.listdir(d)) == sorted([first, res.name, fmt.INDEX_NAME])


def test_spares_are_unnamed_sized_and_given_back(shm_dir):
    """Directly: ``want`` makes one spare of that size, never visible in the directory;
    sizes below SPARE_MIN_BYTES make none; ``close`` gives them back."""
    d, fd = shm_dir
    spares = Spares(fd)
    try:
        spares.want(1 << 20)
        time.sleep(0.2)
        assert spares.take() is None and spares.made == 0
        spares.want(SPARE_MIN_BYTES * 2)
        _ready(spares)
        assert spares.made == 1 and os.listdir(d) == []
        got = spares.take()
        st = os.fstat(got.fd)
        assert st.st_size == SPARE_MIN_BYTES * 2 and st.st_blocks * 512 >= SPARE_MIN_BYTES * 2
        assert st.st_mode & 0o777 == fmt.file_mode() & ~_umask()
        assert got.size == SPARE_MIN_BYTES * 2 and len(got.mapping) == got.size
        got.mapping[:4] = b"abcd"  # the mapping is the file's pages
        assert os.pread(got.fd, 4, 0) == b"abcd"
        got.close()
        time.sleep(0.2)
        assert spares.take() is None, "a take must not start a refill (only a written file)"
        spares.want(SPARE_MIN_BYTES * 2)
        _ready(spares)
    finally:
        spares.close()
    assert spares.ready == [] and os.listdir(d) == []


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _ready(spares, n=1, timeout=10):
    deadline = time.monotonic() + timeout
    while len(spares.ready) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return list(spares.ready)


def test_a_spare_is_kept_across_nearby_sizes_and_small_files_change_nothing(shm_dir):
    """``want``: a ready spare stays for files it holds with at most its size to spare
    (8 MiB for 5 MiB files), goes for larger files or a wasteful tail; sizes below
    SPARE_MIN_BYTES (a short prompt) change nothing."""
    d, fd = shm_dir
    spares = Spares(fd)
    try:
        spares.want(SPARE_MIN_BYTES * 2)
        first = _ready(spares)
        assert [s.size for s in first] == [SPARE_MIN_BYTES * 2]
        spares.want(SPARE_MIN_BYTES // 2)  # a short prompt's file
        spares.want(SPARE_MIN_BYTES + (SPARE_MIN_BYTES >> 2))  # 5 MiB: the 8 MiB spare holds it
        assert spares.ready == first and spares.made == 1
        spares.want(SPARE_MIN_BYTES * 3)  # larger than the spare: it goes, a 12 MiB one comes
        assert [s.size for s in _ready(spares)] == [SPARE_MIN_BYTES * 3] and spares.made == 2
        spares.want(SPARE_MIN_BYTES)  # 4 MiB: a 12 MiB spare wastes more than the file
        assert [s.size for s in _ready(spares)] == [SPARE_MIN_BYTES] and spares.made == 3
    finally:
        spares.close()
    assert os.listdir(d) == []


def test_small_files_take_no_spare(shm_dir, tmp_path, monkeypatch):
    """Between two large files, a file below SPARE_MIN_BYTES is written fresh and leaves
    the spare to the next large one, which stores into it."""
    _, spare, mapped = _one_after_another(shm_dir, tmp_path, monkeypatch, [1024, 64, 1024], spares=1)
    assert spare == mapped == [False, False, True]

def test_spares_off_tmpfs_are_not_mapped(tmp_path):
    """On a disk filesystem (here the test's temporary directory, when it is not tmpfs) a
    spare is allocated but not mapped: a first store into a page there may need blocks
    (copy-on-write filesystems), which on a full disk is a SIGBUS, not an error."""
    probe = os.open(str(tmp_path), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if on_tmpfs(probe):
            pytest.skip("the temporary directory is on tmpfs here")
    finally:
        os.close(probe)
    d = tmp_path / "dump"
    d.mkdir()
    fd = fmt.open_dump_dir(str(d))
    spares = Spares(fd)
    try:
        assert not spares.mappable
        spares.want(SPARE_MIN_BYTES)
        got = _ready(spares)
        if not got:
            pytest.skip("no O_TMPFILE/fallocate on this filesystem: spares turn themselves off")
        assert got[0].mapping is None and os.fstat(got[0].fd).st_blocks * 512 >= SPARE_MIN_BYTES
    finally:
        spares.close()
        os.close(fd)
    shm = os.open("/dev/shm", os.O_RDONLY)
    try:
        assert on_tmpfs(shm)
    finally:
        os.close(shm)


def test_spares_follow_how_many_files_begin_at_once(shm_dir):
    """``target``: one spare to begin with; once files of one size come steadily
    (``STEADY_FILES`` in a row), each take that finds none ready (several files begun at
    once) adds one, up to ``count``; a size change that throws ready spares away lowers it
    by as many; a take before any file was written (no size known) changes nothing."""
    d, fd = shm_dir
    size = SPARE_MIN_BYTES * 2
    spares = Spares(fd, count=3)
    try:
        assert spares.take() is None and spares.missed == 0 and spares.target == 1
        for _ in range(STEADY_FILES):  # files of one size, one after another
            spares.want(size)
        assert len(_ready(spares)) == 1
        taken = [spares.take() for _ in range(4)]  # four files begin together
        assert taken[0] is not None and taken[1:] == [None] * 3
        assert spares.missed == 3 and spares.target == 3  # 1 + 3, capped at count
        taken[0].close()
        spares.want(size)  # their files written: three are made, one after another
        assert [s.size for s in _ready(spares, 3)] == [size] * 3
        time.sleep(0.2)
        assert len(spares.ready) == 3 and spares.made == 4
        spares.want(size * 3)  # the sizes moved: the three go, the target with them
        assert spares.target == 1
        assert [s.size for s in _ready(spares)] == [size * 3]
        time.sleep(0.2)
        assert len(spares.ready) == 1
    finally:
        spares.close()
    assert os.listdir(d) == []


def test_an_idle_writer_gives_every_spare_back(shm_dir):
    """``idle_s`` with no file begun or written: the target falls back to one and every
    ready spare is closed, the last one too (a review saw one kept for good: up to 1 GiB
    of /dev/shm per writing rank), and none is made until the next file is written;
    files coming within ``idle_s`` of each other keep them."""
    d, fd = shm_dir
    size = SPARE_MIN_BYTES * 2
    spares = Spares(fd, count=3, idle_s=0.6)
    try:
        assert _batch_after_steady_files(spares, size) == [True, False, False, False]
        assert spares.target == 3
        spares.want(size)
        burst = _ready(spares, 3)
        assert len(burst) == 3
        for _ in range(6):  # a file every 0.2 s: not idle
            time.sleep(0.2)
            spares.want(size)
        assert spares.target == 3 and len(spares.ready) == 3
        # (the spares thread closes them after it emptied the list: wait for both)
        assert wait_for(lambda: not spares.ready and all(s.mapping is None for s in burst))
        assert spares.target == 1
        assert all(_closed(s.fd) for s in burst), "every spare's file given back"
        time.sleep(0.3)
        assert spares.ready == [] and spares.made == 4  # none made again while idle
        spares.want(size)  # the next file: one spare again
        assert len(_ready(spares)) == 1 and spares.made == 5
    finally:
        spares.close()
    assert os.listdir(d) == []


def test_an_idle_writer_gives_its_spares_back_even_when_the_last_could_not_be_made(shm_dir):
    """The target asks for three, the third cannot be made (no room, as when /dev/shm has
    less than SPARE_FREE_FACTOR times its size free): the spares thread waits for the next
    file without retrying, yet still gives the burst's spares back once idle (a review saw
    it sleep with two held for good)."""
    d, fd = shm_dir
    size = SPARE_MIN_BYTES * 2
    spares = Spares(fd, count=3, idle_s=0.6)
    make, room = spares._make, [2]

    def short_of_room(n):  # the first two fit, no more
        if room[0] <= 0:
            return None
        room[0] -= 1
        return make(n)

    spares._make = short_of_room
    try:
        assert _batch_after_steady_files(spares, size) == [True, False, False, False]
        room[0] = 2
        spares.want(size)
        assert len(_ready(spares, 2)) == 2
        assert wait_for(lambda: spares.stalled), "the third was tried"
        assert spares.target == 3
        assert wait_for(lambda: spares.target == 1 and not spares.ready), \
            (spares.target, len(spares.ready))
    finally:
        spares.close()
    assert os.listdir(d) == []


def _closed(fd):
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def _batch_after_steady_files(spares, size, n=4):
    """``STEADY_FILES`` files of ``size`` written, then a batch of ``n`` begun together:
    which of them got a spare (the first does; the others raise the target)."""
    for _ in range(STEADY_FILES):
        spares.want(size)
    _ready(spares)
    taken = [spares.take() for _ in range(n)]
    for t in taken:
        if t is not None:
            t.close()
    return [t is not None for t in taken]


def test_the_byte_budget_caps_the_spares_held(shm_dir):
    """With room for two spares in the budget, a target of four makes two; a file larger
    than the whole budget still gets one."""
    d, fd = shm_dir
    size = SPARE_MIN_BYTES * 2
    spares = Spares(fd, count=8, budget=2 * size)
    try:
        assert _batch_after_steady_files(spares, size) == [True, False, False, False]
        assert spares.target == 4
        spares.want(size)
        assert len(_ready(spares, 2)) == 2
        time.sleep(0.3)
        assert len(spares.ready) == 2, "the budget holds two"
        for s in [spares.take(), spares.take()]:
            s.close()
        spares.want(size * 3)  # one file over the whole budget: one spare all the same
        assert [s.size for s in _ready(spares)] == [size * 3]
        time.sleep(0.3)
        assert len(spares.ready) == 1
    finally:
        spares.close()


def test_the_budget_counts_the_spares_ready_at_their_own_size(shm_dir):
    """Two spares fill a budget of four files' size when they are twice the size of the
    files now written (a ready spare is kept for files down to half its size): none more
    is made, though the target asks for four."""
    d, fd = shm_dir
    big = SPARE_MIN_BYTES * 2
    spares = Spares(fd, count=4, budget=2 * big)
    try:
        assert _batch_after_steady_files(spares, big) == [True, False, False, False]
        for _ in range(STEADY_FILES):
            spares.want(big)
        assert len(_ready(spares, 2)) == 2
        spares.target = 4  # as a later batch of four would ask
        for _ in range(STEADY_FILES):
            spares.want(big // 2 + 4096)  # the two 2x spares still hold these files
        time.sleep(0.3)
        assert [s.size for s in spares.ready] == [big, big], "the budget is full at the spares' own size"
    finally:
        spares.close()


def test_sizes_that_keep_moving_do_not_grow_the_target(shm_dir):
    """Batches of four files whose sizes alternate between 4 MiB and 12 MiB (no spare of
    one holds the other) find no spare ready, yet the target stays 1: it would only make
    spares of the wrong size to throw away. Batches of one size grow it."""
    d, fd = shm_dir
    spares = Spares(fd, count=8)
    try:
        for b in range(6):
            size = SPARE_MIN_BYTES * (1 if b % 2 else 3)
            taken = [spares.take() for _ in range(4)]
            for t in taken:
                if t is not None:
                    t.close()
            for _ in range(4):
                spares.want(size)
                size = SPARE_MIN_BYTES * 3 if size == SPARE_MIN_BYTES else SPARE_MIN_BYTES
            time.sleep(0.3)
        assert spares.target == 1 and spares.missed > 0
        for _ in range(STEADY_FILES):
            spares.want(SPARE_MIN_BYTES * 2)
        time.sleep(0.3)
        taken = [spares.take() for _ in range(4)]
        assert spares.target == 4, spares.target
        for t in taken:
            if t is not None:
                t.close()
    finally:
        spares.close()
    assert os.listdir(d) == []


def test_a_batch_of_files_begun_together_is_written_into_spares(shm_dir, tmp_path, monkeypatch):
    """A writer process (4 threads, the default spares) given five batches of four
    requests each, every batch's files begun together as a prefill batch does: the
    first batch finds no spare (no size known yet; a file written before another thread
    began its own may lend it one), the next ones grow the target, and by the last batch
    every file's rows are stored into a spare's mapping. Every file equals its rows."""
    d, fd = shm_dir
    trace_path = str(tmp_path / "trace.jsonl")
    monkeypatch.setenv("KIMI_SGLANG_TRACE", trace_path)
    tokens, batches, per = 1024, 5, 4
    writer = DumpWriter(fd, arena_bytes=128 << 20, threads=per, layer_ids=[1, 2, 3, 4], num_layers=4,
                        stats_interval_s=0, register_atexit=False, spares=8)
    names = []
    try:
        for b in range(batches):
            pend = [writer.start(f"b{b}r{i}", list(range(100, 100 + tokens)), SLOTS * HIDDEN, torch.bfloat16)
                    for i in range(per)]
            rows = torch.cat([_rows(tokens, b * per + i) for i in range(per)])
            writer.copy_rows(rows, [(p, i * tokens, tokens) for i, p in enumerate(pend)], ready=True)
            for i, p in enumerate(pend):
                res = fmt.reserve(fd, f"b{b}r{i}")
                writer.finish(p, res)
                names.append(res.name)
            writer.flush()
            for name in names[-per:]:
                assert fmt.wait_complete(os.path.join(d, name), timeout=30) is None
            assert writer.wait_idle(30)
            time.sleep(0.5)  # the next forward: spares are made meanwhile
    finally:
        assert writer.close()
    for k, name in enumerate(names):
        rec = fmt.load(os.path.join(d, name))
        assert torch.equal(rec.hidden_states, _rows(tokens, k).view(tokens, SLOTS, HIDDEN)), f"file {k} differs"
    mapped = _spare_flags(trace_path, "mapped")
    by_batch = [[mapped[n] for n in names[b * per:(b + 1) * per]] for b in range(batches)]
    # the first batch had no size to go by (a file written meanwhile may lend one its spare)
    assert sum(by_batch[0]) <= 1, by_batch
    assert by_batch[-1] == [True] * per, by_batch
