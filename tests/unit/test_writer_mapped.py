"""Rows stored into a spare's mapping (writer_process.Spares, copier.Copier), under the
conditions that break it: the drain deadline while copies run, many requests (some
failing or abandoned) on several writer threads, fp8 files (scales stored too). Real
writer processes and files in /dev/shm; every file is checked against its rows, or
against the same request written by ``pwrite`` (spares off)."""

from __future__ import annotations

import os
import signal
import time

import torch

from sglang_ext import format as fmt
from sglang_ext.writer import DumpWriter

from test_writer_spares import HIDDEN, SLOTS, _rows, _write, shm_fixture

ROW = SLOTS * HIDDEN * 2  # bf16 bytes of one token


shm_dir = shm_fixture(1 << 30)
big_shm_dir = shm_fixture(6 << 30)


def _spare_maps(pid, d):
    """Mappings of the writer process ``pid`` onto unnamed files of ``d`` (spares made,
    or taken and not yet unmapped)."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if f" {d}/" in line and line.rstrip().endswith("(deleted)"))


def _maps_of(pid, d):
    """All mappings of ``pid`` onto files of ``d``, named or not."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if f" {d}/" in line)


def _fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def _wait_for(cond, timeout=60.0, what="timed out"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_drain_deadline_while_rows_are_stored_into_spares(big_shm_dir):
    """Three ~312 MiB requests begun together, each in a spare of its own (batches of
    three before them had the writer keep three), on three writer threads,
    their rows being stored by the copier (pieces queued for its pool threads) when
    ``close(0)`` passes the drain deadline: the main thread fails their queued finishes
    while the copies run. The writer process must not die by SIGSEGV (a store into a
    mapping unmapped under it); each request ends
    as its file, equal to its rows, or its ``.error``; after ``clean_stale`` no
    temporary file or lock stays."""
    d, fd = big_shm_dir
    tokens, count = 40_000, 3
    writer = DumpWriter(fd, arena_bytes=count * tokens * ROW + (64 << 20), threads=count,
                        layer_ids=[1, 2, 3, 4], num_layers=4, stats_interval_s=0,
                        register_atexit=False, spares=count)
    proc = writer._proc
    rows = [_rows(tokens, 1 + i) for i in range(count)]

    def begin_together(prefix):  # as a prefill batch of ``count`` requests does
        pend = [writer.start(f"{prefix}{i}", list(range(tokens)), SLOTS * HIDDEN, torch.bfloat16)
                for i in range(count)]
        for p, r in zip(pend, rows):
            writer.copy_rows(r, [(p, 0, tokens)], ready=True)
        writer.flush()
        return pend

    def finish(prefix, pend):
        out = []
        for i, p in enumerate(pend):
            out.append(fmt.reserve(fd, f"{prefix}{i}"))
            writer.finish(p, out[-1])
        writer.flush()
        return out

    try:
        first = _write(writer, fd, "w0", _rows(tokens, 0))
        assert fmt.wait_complete(os.path.join(d, first), timeout=60) is None
        # two batches of three: the first makes the size steady (STEADY_FILES files of it),
        # the second finds one spare for three files, so the writer keeps three from now on
        warm = []
        for prefix in ("w", "v"):
            warm += finish(prefix, begin_together(prefix))
            for r in warm[-count:]:
                assert fmt.wait_complete(os.path.join(d, r.name), timeout=60) is None
        _wait_for(lambda: _spare_maps(proc.pid, d) == count)
        pend = begin_together("r")
        time.sleep(0.01)  # the copies start
        res = finish("r", pend)
    finally:
        writer.close(0)
    # 0: it ended by itself; SIGKILL: close's own end of a writer still inside its copies
    # 2 s after the deadline (a loaded 2-core machine); SIGSEGV is the bug: a store into a
    # mapping the main thread unmapped when it failed the queued finishes at the deadline.
    assert proc.returncode in (0, -signal.SIGKILL), f"the writer process ended with {proc.returncode}"
    for r, want in zip(res, rows):
        err = fmt.wait_complete(os.path.join(d, r.name), timeout=10)
        if err is None:
            rec = fmt.load(os.path.join(d, r.name))
            assert torch.equal(rec.hidden_states, want.view(tokens, SLOTS, HIDDEN))
        else:
            assert err == fmt.SHUTDOWN_MESSAGE
    fmt.clean_stale(fd)
    finals = {first} | {r.name for r in warm} | {r.name for r in res if os.path.exists(os.path.join(d, r.name))}
    errors = {r.name + fmt.ERROR_SUFFIX for r in res if r.name not in finals}
    assert sorted(os.listdir(d)) == sorted(finals | errors | {fmt.INDEX_NAME})


def test_many_requests_leak_no_spare_descriptor_or_mapping(shm_dir):
    """200 requests of ~4.7 MiB (spares' size) on 4 writer threads, 8 at a time: most
    whole, some in chunks, some one token larger than the spare (pwrite), every 10th
    short of rows (fails), every 15th abandoned. Every written file equals its rows;
    failed ones leave ``.error``; the writer process holds as many descriptors as after
    the first round and maps no file of the directory but its one spare."""
    d, fd = shm_dir
    tokens = 600
    writer = DumpWriter(fd, arena_bytes=256 << 20, threads=4, layer_ids=[1, 2, 3, 4],
                        num_layers=4, stats_interval_s=0, register_atexit=False, spares=1)
    pid = writer.pid
    written, failed, baseline = {}, [], None
    try:
        for base in range(0, 200, 8):
            batch = []
            for i in range(base, base + 8):
                n = tokens + (1 if i % 7 == 3 else 0)
                rows = _rows(n, i)
                p = writer.start(f"m{i}", list(range(100, 100 + n)), SLOTS * HIDDEN, torch.bfloat16)
                sent = n // 2 if i % 10 == 5 or i % 15 == 7 else n
                step = 250 if i % 4 == 1 else sent
                for c0 in range(0, sent, step):
                    writer.copy_rows(rows[c0:min(sent, c0 + step)], [(p, 0, min(step, sent - c0))],
                                     ready=True)
                if i % 15 == 7:
                    writer.abandon(p)
                    continue
                res = fmt.reserve(fd, f"m{i}")
                writer.finish(p, res)
                batch.append((i, n, res.name, sent == n))
            writer.flush()
            assert writer.wait_idle(60)
            for i, n, name, whole in batch:
                err = fmt.wait_complete(os.path.join(d, name), timeout=30)
                if whole:
                    assert err is None, err
                    written[name] = (i, n)
                else:
                    assert err is not None and f"{n // 2} of {n} rows" in err
                    failed.append(name)
            if base == 8:
                _wait_for(lambda: _spare_maps(pid, d) == 1, 10)
                baseline = _fds(pid)
        _wait_for(lambda: _spare_maps(pid, d) == 1, 10)
        # a written file's mapping goes last, after its ack (writer_process.Writer._finish): wait, not look once
        _wait_for(lambda: _maps_of(pid, d) == 1, 10, "a mapping of a written or failed file stayed")
        assert _fds(pid) == baseline, "descriptors leaked"
    finally:
        assert writer.close()
    for name, (i, n) in written.items():
        rec = fmt.load(os.path.join(d, name))
        assert torch.equal(rec.hidden_states, _rows(n, i).view(n, SLOTS, HIDDEN)), name
        assert rec.token_ids.tolist() == list(range(100, 100 + n))
    assert len(written) > 150 and len(failed) >= 15
    want = set(written) | {f + fmt.ERROR_SUFFIX for f in failed} | {fmt.INDEX_NAME}
    assert set(os.listdir(d)) == want


def _fp8_files(d, fd, spares):
    """Three fp8 requests of 1024 tokens (the last two in chunks of 300) written with
    ``spares``; returns their files' bytes."""
    writer = DumpWriter(fd, arena_bytes=64 << 20, threads=2, layer_ids=[1, 2, 3, 4], num_layers=4,
                        stats_interval_s=0, register_atexit=False, spares=spares,
                        hidden_states_dtype="fp8")
    out = []
    try:
        for i in range(3):
            rows = _rows(1024, i) * (i + 1) / 7
            name = _write(writer, fd, f"f{i}", rows, chunk=300 if i else None)
            assert fmt.wait_complete(os.path.join(d, name), timeout=30) is None
            assert writer.wait_idle(30)
            if spares:
                _wait_for(lambda: _spare_maps(writer.pid, d) == 1, 10)
            with open(os.path.join(d, name), "rb") as f:
                out.append(f.read())
    finally:
        assert writer.close()
    return out


def test_fp8_files_in_spares_equal_those_written_by_pwrite(shm_dir, tmp_path):
    """fp8 files (rows and their scales, two stores per chunk into the mapping) are byte
    for byte the files the same requests make with spares off (``pwrite`` only)."""
    d, fd = shm_dir
    mapped = _fp8_files(d, fd, 1)
    for n in os.listdir(d):
        os.unlink(os.path.join(d, n))
    written = _fp8_files(d, fd, 0)
    assert len(mapped[0]) > 4 << 20
    assert mapped == written
