"""Faults and bad input (issue 8): the dump path loses nothing and lets nothing out of DIR.

Every test drives the real code (format, writer, the dump session) with stand-ins for SGLang's
batch and request objects (tests/unit/test_hooks.py's); the outcome of every request is
checked against the contract: a complete file (it loads, equals the reference) or an
error in its response, never a partial file under a final name and never an entry
outside the dump directory. The table in docs/faults.md maps each fault to its test here.
"""

from __future__ import annotations

import gc
import json
import os
import random
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from sglang_ext import format as fmt
from sglang_ext import metrics as dump_metrics
from sglang_ext.writer import DumpWriter
from sglang_ext.config import DumpConfigError, check_directory, env_settings
from standins import (MULTIPROC_HTTP, RIDS, Req, finish, idle, inject_writer, make_runner, reference,
                       run_extend, wait_for)

IDS = [2, 4]


def leftovers(d):
    """Entries that must never outlive a request: temporaries and locks."""
    return sorted(
        n for n in os.listdir(d)
        if n.endswith(fmt.TMP_SUFFIX) or n.endswith(fmt.LOCK_SUFFIX) or n.startswith(".tmp")
    )


def assert_complete_or_error(req, meta, d):
    """The contract for one finished request."""
    if "hidden_states_path" in meta:
        path = meta["hidden_states_path"]
        assert os.path.dirname(os.path.realpath(path)) == os.path.realpath(d)
        rec = fmt.load(path)
        assert torch.equal(rec.hidden_states, reference(req, IDS))
        assert rec.token_ids.tolist() == req.origin_input_ids
        return True
    assert meta.get("hidden_states_error"), meta
    return False


def mount_tmpfs(path, options):
    """Mount a tmpfs at ``path`` (root in a sandbox that allows it); False if refused."""
    path.mkdir(exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                       capture_output=True, text=True)
    return r.returncode == 0


def umount(path):
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


# ---- rids that try to escape or collide, through the hooks -------------------------------
@pytest.mark.parametrize("rid", RIDS)
def test_hostile_rids_through_the_hooks(dump, rid, sessions):
    sess = sessions.start(make_runner(dump, layers="2,4"))
    req = Req(rid, 5, 1)
    run_extend(sess, [(req, 0, 3)], IDS)  # two chunks
    run_extend(sess, [(req, 3, 5)], IDS)
    meta = finish(req)
    assert assert_complete_or_error(req, meta, dump)
    assert fmt.load(meta["hidden_states_path"]).metadata["rid"] == fmt.printable_rid(rid)
    assert all("/" not in n and not n.startswith("..") for n in os.listdir(dump))
    assert sorted(os.listdir(dump)) == sorted([os.path.basename(meta["hidden_states_path"]), fmt.INDEX_NAME])


@pytest.mark.parametrize("rid", [123, ["a", "b"], None, b"bytes"])
def test_rid_that_is_not_a_string_gets_an_error_not_a_file(dump, rid, sessions):
    # SGLang refuses a non-string rid with HTTP 400 (see test_malformed_*); a list rid on
    # a single prompt passes its normalization, so the dump path must cope by itself.
    sess = sessions.start(make_runner(dump, layers="2,4"))
    req = Req(rid, 4, 1)
    run_extend(sess, [(req, 0, 4)], IDS)
    meta = finish(req)
    assert "rid must be str" in meta["hidden_states_error"]
    assert idle(sess)["host_bytes_in_use"] == 0
    assert os.listdir(dump) == []


def test_same_rid_many_times_at_once_and_alike_rids_keep_every_file(dump, monkeypatch, tmp_path, sessions):
    slow_writes(monkeypatch, tmp_path, 0.02)
    sess = sessions.start(make_runner(dump, layers="2,4"))
    same = [Req("dup", 3 + i, i + 1) for i in range(8)]
    alike = [Req(r, 4, 20 + i) for i, r in enumerate(["a/b", "a_b", "a\x00b", "a\\b", "a:b"])]
    run_extend(sess, [(r, 0, len(r.origin_input_ids)) for r in same[:4] + alike], IDS)
    run_extend(sess, [(r, 0, len(r.origin_input_ids)) for r in same[4:]], IDS)
    paths = [finish(r)["hidden_states_path"] for r in same + alike]
    assert len(set(paths)) == len(paths)
    for r, p in zip(same + alike, paths):
        assert torch.equal(fmt.load(p).hidden_states, reference(r, IDS))
    assert leftovers(dump) == []


# ---- the dump directory ------------------------------------------------------------------
def test_missing_directory_refuses_start_and_vanishing_directory_fails_requests(tmp_path, sessions):
    with pytest.raises(DumpConfigError, match="does not exist"):
        sessions.start(make_runner(tmp_path / "nope"))
    d = tmp_path / "hs"
    d.mkdir()
    try:
        sess = sessions.start(make_runner(d, layers="2,4"))
        os.rmdir(d)  # removed while the server runs
        req = Req("r", 4, 1)
        run_extend(sess, [(req, 0, 4)], IDS)
        meta = finish(req)
        assert "hidden_states_path" not in meta and "FileNotFoundError" in meta["hidden_states_error"]
        assert idle(sess)["host_bytes_in_use"] == 0
        assert not d.exists()
    finally:
        sessions.close()


def test_unwritable_directory(tmp_path, sessions):
    d = tmp_path / "ro"
    if not mount_tmpfs(d, "size=1m"):
        pytest.skip("cannot mount tmpfs here (test_config covers the refusal by monkeypatch)")
    try:
        subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)
        with pytest.raises(DumpConfigError, match="cannot write in .*Read-only file system"):
            check_directory(str(d))
        with pytest.raises(DumpConfigError):
            sessions.start(make_runner(d))
        # Writable at start, read-only later: every request gets an error, nothing partial.
        subprocess.run(["mount", "-o", "remount,rw", str(d)], check=True)
        sess = sessions.start(make_runner(d, layers="2,4"))
        subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)
        req = Req("r", 4, 1)
        run_extend(sess, [(req, 0, 4)], IDS)
        meta = finish(req)
        assert "Read-only file system" in meta["hidden_states_error"]
        assert os.listdir(d) == []
    finally:
        sessions.close()
        umount(d)


def _fill_up(d, sessions):
    """Requests of ~64 KiB each until the 1 MiB filesystem is full, then a few more:
    (session, [(req, meta_info)])."""
    sess = sessions.start(make_runner(d, layers="2,4"))
    reqs = []
    for i in range(24):
        req = Req(f"big-{i}", 1024, i + 1)  # 1024 tokens x 2 slots x 8 x fp32 = 64 KiB
        run_extend(sess, [(req, 0, 1024)], IDS)
        reqs.append((req, finish(req)))
    return sess, reqs


def _check_full(d, sess, reqs):
    ok = [assert_complete_or_error(r, m, d) for r, m in reqs]
    assert any(ok) and not all(ok), "the filesystem should fill up part-way"
    errors = [m["hidden_states_error"] for r, m in reqs if "hidden_states_error" in m]
    assert any("No space left on device" in e for e in errors), errors
    snap = idle(sess)
    assert leftovers(d) == [] and snap["host_bytes_in_use"] == 0
    assert snap["files_written"] == sum(ok) and snap["failures"] == len(reqs) - sum(ok)
    # Space freed: the next request is written again.
    for r, m in reqs:
        if "hidden_states_path" in m:
            os.unlink(m["hidden_states_path"])
    again = Req("after", 16, 99)
    run_extend(sess, [(again, 0, 16)], IDS)
    assert assert_complete_or_error(again, finish(again), d)


def test_full_filesystem_real_tmpfs(tmp_path, sessions):
    d = tmp_path / "full"
    if not mount_tmpfs(d, "size=1m"):
        pytest.skip("cannot mount tmpfs here: test_full_filesystem_injected_enospc covers it")
    try:
        _check_full(d, *_fill_up(d, sessions))
    finally:
        sessions.close()
        umount(d)


# The writer process's writes fail once the dump directory holds more than $DISK_BYTES (a
# small disk), after a partial write, as a real full filesystem does.
SMALL_DISK = """
    import errno, os
    from sglang_ext import format as fmt
    _real, _dir, _cap = fmt.pwrite_all, os.environ["DISK_DIR"], int(os.environ["DISK_BYTES"])
    def _used():
        total = 0
        for n in os.listdir(_dir):
            try:
                total += os.lstat(os.path.join(_dir, n)).st_size
            except FileNotFoundError:
                pass
        return total
    def _pwrite(fd, data, offset):
        n = memoryview(data).nbytes
        if _used() + n > _cap:
            _real(fd, b"\\0" * min(n, 4096), offset)
            raise OSError(errno.ENOSPC, "No space left on device")
        return _real(fd, data, offset)
    fmt.pwrite_all = _pwrite
"""


def test_full_filesystem_injected_enospc(dump, monkeypatch, tmp_path, sessions):
    inject_writer(monkeypatch, tmp_path, SMALL_DISK, DISK_DIR=str(dump), DISK_BYTES=str(1 << 20))
    _check_full(dump, *_fill_up(dump, sessions))


def test_directory_swapped_for_a_symlink_while_running(tmp_path, sessions):
    d, elsewhere = tmp_path / "hs", tmp_path / "elsewhere"
    d.mkdir()
    elsewhere.mkdir()
    try:
        sess = sessions.start(make_runner(d, layers="2,4"))
        os.rename(d, tmp_path / "hs-moved")
        os.symlink(elsewhere, d)
        req = Req("r", 4, 1)
        run_extend(sess, [(req, 0, 4)], IDS)
        meta = finish(req)
        # The file went through the descriptor into the real (moved) directory, never
        # through the symlink. The tokenizer manager (another process) looks the file up
        # by its configured path, which now leads elsewhere: it answers "missing".
        # The waiter found no lock at the configured path and answered at once; let the
        # writer finish before looking at the real directory.
        assert sess.writer.close(timeout=10)
        assert os.listdir(elsewhere) == []
        [name] = [n for n in os.listdir(tmp_path / "hs-moved") if n.endswith(fmt.SUFFIX)]
        assert torch.equal(fmt.load(str(tmp_path / "hs-moved" / name)).hidden_states, reference(req, IDS))
        assert "hidden_states_path" not in meta and "is missing" in meta["hidden_states_error"]
    finally:
        sessions.close()


def test_symlinks_planted_at_every_name_are_never_followed(dump, tmp_path, sessions):
    sess = sessions.start(make_runner(dump, layers="2,4"))
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    stem = fmt.safe_stem("t")
    for name in (f"{stem}{fmt.SUFFIX}", f"{stem}{fmt.SUFFIX}{fmt.LOCK_SUFFIX}",
                 f".{stem}-1{fmt.SUFFIX}{fmt.TMP_SUFFIX}", f"{stem}-1{fmt.SUFFIX}{fmt.ERROR_SUFFIX}",
                 f".{stem}-2{fmt.SUFFIX}{fmt.TMP_SUFFIX}"):
        os.symlink(victim, dump / name)
    req = Req("t", 4, 1)
    run_extend(sess, [(req, 0, 4)], IDS)
    meta = finish(req)
    assert os.path.basename(meta["hidden_states_path"]) == f"{stem}-2{fmt.SUFFIX}"
    assert assert_complete_or_error(req, meta, dump)
    assert not os.path.islink(meta["hidden_states_path"])
    assert victim.read_text() == "keep me"
    # A symlink planted at index.jsonl is not followed either (O_NOFOLLOW).
    os.unlink(dump / fmt.INDEX_NAME)
    os.symlink(victim, dump / fmt.INDEX_NAME)
    req2 = Req("t2", 4, 2)
    run_extend(sess, [(req2, 0, 4)], IDS)
    meta2 = finish(req2)
    assert victim.read_text() == "keep me"
    # The index line is refused, so the request fails as a whole (one outcome per
    # request): its response says why, its file is gone, it counts as failed.
    assert "index line could not be written" in meta2["hidden_states_error"]
    assert not os.path.lexists(dump / f"{fmt.safe_stem('t2')}{fmt.SUFFIX}")
    assert idle(sess)["failures"] == 1 and idle(sess)["files_written"] == 1
    assert [n for n in leftovers(dump) if not os.path.islink(dump / n)] == []


def test_rows_that_never_arrive_fail_the_request_and_write_nothing(dump, monkeypatch, tmp_path, sessions):
    """A batch whose device-to-host copy never completes (a hung GPU; here: the copy's
    sequence number is never published): after COPY_TIMEOUT_S the writer fails the
    requests of that batch instead of writing what the arena holds."""
    from sglang_ext import arena

    inject_writer(monkeypatch, tmp_path, """
        from sglang_ext import writer_process
        writer_process.COPY_TIMEOUT_S = 0.3
    """)
    monkeypatch.setattr(arena, "write_seq", lambda mm, seq: None)
    sess = sessions.start(make_runner(dump, layers="2,4"))
    req = Req("lost", 4, 1)
    run_extend(sess, [(req, 0, 4)], IDS)
    assert "never arrived from the GPU" in finish(req)["hidden_states_error"]
    assert not any(n.endswith(fmt.SUFFIX) for n in os.listdir(dump))
    assert wait_for(lambda: leftovers(dump) == [])


def test_writer_dying_right_after_a_rename_counts_the_file_and_indexes_it(dump, monkeypatch, tmp_path, sessions):
    """The writer process is killed between a file's rename and its index line: the file
    is complete, so its response names it, the scheduler counts it as written (not
    failed), appends the missing index line and removes the lock; the next writer goes on."""
    inject_writer(monkeypatch, tmp_path, """
        import os, signal
        from sglang_ext import format as fmt
        _real = fmt.publish
        def publish(*a):
            _real(*a)
            if os.path.exists(os.environ["DIE_ONCE"]):
                os.unlink(os.environ["DIE_ONCE"])
                os.kill(os.getpid(), signal.SIGKILL)
        fmt.publish = publish
    """, DIE_ONCE=str(tmp_path / "die-once"))
    (tmp_path / "die-once").touch()
    sess = sessions.start(make_runner(dump, layers="2,4"))
    req = Req("renamed", 4, 1)
    run_extend(sess, [(req, 0, 4)], IDS)
    assert assert_complete_or_error(req, finish(req), dump)
    snap = idle(sess)
    assert snap["files_written"] == 1 and snap["failures"] == 0 and snap["writer_restarts"] == 1
    assert [r["file"] for r in fmt.read_index(str(dump))] == [f"{fmt.safe_stem('renamed')}{fmt.SUFFIX}"]
    assert fmt.read_index(str(dump))[0]["num_tokens"] == 4
    assert wait_for(lambda: leftovers(dump) == []), leftovers(dump)
    after = Req("after", 4, 2)
    run_extend(sess, [(after, 0, 4)], IDS)
    assert assert_complete_or_error(after, finish(after), dump)


@pytest.mark.parametrize("where", ["publish", "complete"])
def test_settling_a_dead_writers_file_reads_one_index_line_not_the_index(dump, monkeypatch, tmp_path,
                                                                         sessions, where):
    """The writer is killed after a file's rename, before (``publish``) or after
    (``complete``) its index line, while the index starts with a line that is not JSON:
    settling the file reads only the line its lock's mark points at, never the whole
    index, so the file gets exactly one index line either way (the old scan failed on the
    bad line and left the file unindexed)."""
    inject_writer(monkeypatch, tmp_path, f"""
        import os, signal
        from sglang_ext import format as fmt
        _real = fmt.{where}
        def {where}(*a):
            _real(*a)
            if os.path.exists(os.environ["DIE_ONCE"]):
                os.unlink(os.environ["DIE_ONCE"])
                os.kill(os.getpid(), signal.SIGKILL)
        fmt.{where} = {where}
    """, DIE_ONCE=str(tmp_path / "die-once"))
    (tmp_path / "die-once").touch()
    (dump / fmt.INDEX_NAME).write_text("{not json\n")
    sess = sessions.start(make_runner(dump, layers="2,4"))
    req = Req("marked", 4, 1)
    run_extend(sess, [(req, 0, 4)], IDS)
    assert assert_complete_or_error(req, finish(req), dump)
    snap = idle(sess)
    assert snap["files_written"] == 1 and snap["failures"] == 0
    lines = (dump / fmt.INDEX_NAME).read_text().splitlines()
    name = f"{fmt.safe_stem('marked')}{fmt.SUFFIX}"
    assert lines[0] == "{not json" and [json.loads(x)["file"] for x in lines[1:]] == [name], lines
    assert json.loads(lines[1])["num_tokens"] == 4


def test_copy_rows_refuses_rows_outside_the_batch(dump, sessions):
    sess = sessions.start(make_runner(dump, layers="2,4"))
    w = sess.writer
    p = w.start("r", [1, 2, 3, 4], 16, torch.float32)
    with pytest.raises(ValueError, match="outside the batch's 4 rows"):
        w.copy_rows(torch.zeros(4, 16), [(p, 2, 4)])
    w.abandon(p)


# ---- clients that leave; aborted requests ------------------------------------------------
def test_request_dropped_between_chunks_leaves_nothing(dump, sessions):
    sess = sessions.start(make_runner(dump, layers="2,4"))
    req = Req("left", 8, 1)
    run_extend(sess, [(req, 0, 4)], IDS)  # first chunk, then SGLang drops the request
    assert idle(sess)["host_bytes_in_use"] == 0
    del req
    gc.collect()
    assert wait_for(lambda: os.listdir(dump) == []), os.listdir(dump)


def test_aborted_mid_prefill_in_a_mixed_batch(dump, sessions):
    sess = sessions.start(make_runner(dump, layers="2,4"))
    gone, stays = Req("gone", 8, 1), Req("stays", 8, 2)
    run_extend(sess, [(gone, 0, 4), (stays, 0, 4)], IDS)
    gone.aborted = True
    run_extend(sess, [(gone, 4, 8), (stays, 4, 8)], IDS)
    assert gone.customized_info is None
    assert assert_complete_or_error(stays, finish(stays), dump)
    assert idle(sess)["host_bytes_in_use"] == 0
    assert wait_for(lambda: leftovers(dump) == [])
    assert [n for n in os.listdir(dump) if n.endswith(fmt.SUFFIX)] == [f"{fmt.safe_stem('stays')}{fmt.SUFFIX}"]


def test_finished_request_whose_client_left_gets_a_complete_file(dump, monkeypatch, tmp_path, sessions):
    slow_writes(monkeypatch, tmp_path, 0.2)
    sess = sessions.start(make_runner(dump, layers="2,4"))
    req = Req("orphan", 6, 1)
    run_extend(sess, [(req, 0, 6)], IDS)
    req.aborted = True  # the client disconnects while the file is being written
    del req.customized_info  # nobody waits for the response
    assert sess.writer.close(timeout=10)
    names = os.listdir(dump)
    assert leftovers(dump) == []
    [name] = [n for n in names if n.endswith(fmt.SUFFIX)]
    rec = fmt.load(str(dump / name))
    assert rec.hidden_states.shape == (6, 2, 8)
    assert [r["file"] for r in fmt.read_index(str(dump))] == [name]


# ---- a burst under backpressure ----------------------------------------------------------
# The writer process sleeps $SLOW_S in each row write (SLOW_AT=rows) or before each rename
# (SLOW_AT=publish), and every $FAIL_EVERY-th rename fails as on a full disk.
SLOW = """
    import os, threading, time
    from sglang_ext import format as fmt
    _s, _at, _every = float(os.environ["SLOW_S"]), os.environ["SLOW_AT"], int(os.environ["FAIL_EVERY"])
    _lock, _n = threading.Lock(), [0]
    _pwrite, _publish = fmt.pwrite_all, fmt.publish
    def pwrite_all(fd, data, offset):
        if _at == "rows":
            time.sleep(_s)
        return _pwrite(fd, data, offset)
    def publish(*a):
        if _at == "publish":
            time.sleep(_s)
        with _lock:
            _n[0] += 1
            n = _n[0]
        if _every and n % _every == 0:
            raise OSError(28, "No space left on device")
        return _publish(*a)
    fmt.pwrite_all, fmt.publish = pwrite_all, publish
"""


def slow_writes(monkeypatch, tmp_path, seconds, fail_every=0, at="publish"):
    """Make writer processes started from now on slow (and failing every Nth file)."""
    inject_writer(monkeypatch, tmp_path, SLOW, SLOW_S=str(seconds), SLOW_AT=at,
                  FAIL_EVERY=str(fail_every))


def test_burst_of_1000_requests_stays_under_the_host_cap(dump, monkeypatch, tmp_path, sessions):
    monkeypatch.setenv("KIMI_SGLANG_WRITER_THREADS", "4")
    slow_writes(monkeypatch, tmp_path, 0.004, fail_every=97, at="rows")
    sess = sessions.start(make_runner(dump, layers="2,4", max_mb=1))
    rng = random.Random(8)
    reqs = [Req(f"burst-{i}", rng.randrange(16, 256), i + 1) for i in range(1000)]
    pending, done = list(reqs), []
    while pending:  # batches of up to 40 requests; long prompts in two chunks
        batch, pending = pending[:40], pending[40:]
        spans = []
        for r in batch:
            n = len(r.origin_input_ids)
            spans.append((r, 0, n // 2) if n > 128 else (r, 0, n))
        run_extend(sess, spans, IDS)
        rest = [(r, n0, len(r.origin_input_ids)) for r, _, n0 in spans if n0 < len(r.origin_input_ids)]
        if rest:
            run_extend(sess, rest, IDS)
        done += batch
    outcomes = [assert_complete_or_error(r, finish(r), dump) for r in done]
    assert len(outcomes) == 1000 and sum(outcomes) == 1000 - 1000 // 97
    snap = idle(sess)
    assert snap["host_bytes_peak"] <= snap["arena_bytes"] == 1 << 20
    assert snap["backpressure_waits"] > 0, "the burst should have hit the cap"
    assert snap["files_written"] == sum(outcomes) and snap["failures"] == 1000 // 97
    assert snap["queue_depth"] == 0 and snap["host_bytes_in_use"] == 0
    assert len(fmt.read_index(str(dump))) == sum(outcomes)
    assert leftovers(dump) == []


def test_a_prompt_larger_than_the_arena_streams_through_it(dump, sessions):
    """A 40,000-token prompt in chunked-prefill chunks of 4,096 through a 1 MiB arena: its
    rows (2.5 MiB in float32) stream through the arena chunk by chunk into one complete file
    equal to the reference, the arena never over its size. A prompt whose token ids alone
    (8 bytes a token) exceed the arena is refused with an error naming the setting, and
    leaves nothing in the directory."""
    sess = sessions.start(make_runner(dump, layers="2,4", max_mb=1))
    big = Req("larger-than-the-arena", 40_000, 3)
    assert 40_000 * len(IDS) * 8 * 4 > 2 * (1 << 20)  # the rows are over twice the arena
    for start in range(0, 40_000, 4096):
        run_extend(sess, [(big, start, min(start + 4096, 40_000))], IDS)
    assert assert_complete_or_error(big, finish(big, timeout=60), dump)
    snap = idle(sess)
    assert snap["host_bytes_peak"] <= snap["arena_bytes"] == 1 << 20

    ids_over = Req("token-ids-over-the-arena", (1 << 20) // 8 + 1000, 4)
    run_extend(sess, [(ids_over, 0, 4096)], IDS)
    meta = finish(ids_over)
    assert "hidden_states_path" not in meta
    assert "--dump-hidden-states-max-host-mb" in meta["hidden_states_error"], meta
    idle(sess)
    assert leftovers(dump) == [] and len(fmt.read_index(str(dump))) == 1


# ---- shutdown: SIGTERM / SIGKILL with writes in flight -----------------------------------
CHILD = textwrap.dedent(r"""
    import os, sys, torch
    from sglang_ext import format as fmt
    from sglang_ext.config import env_settings
    from sglang_ext.writer import DumpWriter

    d, n = sys.argv[1], int(sys.argv[2])
    fd = fmt.open_dump_dir(d)
    fmt.clean_stale(fd)
    w = DumpWriter(fd, arena_bytes=1 << 24, threads=2, layer_ids=[2, 4], num_layers=4,
                   drain_timeout_s=env_settings()["drain_timeout_s"])
    for i in range(n):
        p = w.start(f"r{i}", [1, 2, 3, 4], 8, torch.float32)
        w.copy_rows(torch.full((4, 8), float(i)), [(p, 0, 4)])
        w.finish(p, fmt.reserve(fd, f"r{i}"))
    w.flush()
    print("READY", w.pid, flush=True)
    # The scheduler's event loop: it ends on ShutdownReq (here: a line on stdin), after
    # which run_scheduler_process returns and the process exits through sys.exit.
    sys.stdin.readline()
    print("SHUTDOWN", flush=True)
""")


def run_child(d, n, write_s, drain_s, monkeypatch, tmp_path):
    """A scheduler stand-in with ``n`` files queued to a writer whose renames take
    ``write_s`` s; returns (process, writer pid)."""
    slow_writes(monkeypatch, tmp_path, write_s)
    env = dict(os.environ, KIMI_SGLANG_DRAIN_TIMEOUT_S=str(drain_s))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(d), str(n)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    ready, pid = proc.stdout.readline().split()
    assert ready == "READY"
    return proc, int(pid)


def gone(pid, timeout=30):
    """True once process ``pid`` has exited (no orphan left behind)."""
    def dead():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as f:  # a zombie not yet reaped counts as gone
            return f.read().split(")")[-1].split()[0] == "Z"
    return wait_for(dead, timeout)


def check_dir_after_exit(d):
    """Only complete files under final names; returns (files, errors, leftovers)."""
    files = sorted(n for n in os.listdir(d) if n.endswith(fmt.SUFFIX))
    for n in files:
        assert fmt.load(str(d / n)).hidden_states.shape == (4, 2, 4)
    errors = sorted(n for n in os.listdir(d) if n.endswith(fmt.ERROR_SUFFIX))
    assert sorted(r["file"] for r in fmt.read_index(str(d))) == files
    return files, errors, leftovers(d)


def test_shutdown_drains_queued_writes_within_the_deadline(dump, monkeypatch, tmp_path):
    proc, writer_pid = run_child(dump, 6, 0.3, 30, monkeypatch, tmp_path)
    t0 = time.monotonic()
    proc.communicate("shutdown\n", timeout=60)
    assert proc.returncode == 0
    assert time.monotonic() - t0 < 10
    files, errors, left = check_dir_after_exit(dump)
    assert len(files) == 6 and errors == [] and left == []
    assert gone(writer_pid)


def test_shutdown_past_the_deadline_fails_what_is_left_and_leaves_nothing(dump, monkeypatch, tmp_path):
    proc, writer_pid = run_child(dump, 6, 30, 0.5, monkeypatch, tmp_path)
    t0 = time.monotonic()
    _, err = proc.communicate("shutdown\n", timeout=60)
    assert proc.returncode == 0
    assert time.monotonic() - t0 < 10, "exit must not wait for writes past the deadline"
    assert "still running after" in err
    files, errors, left = check_dir_after_exit(dump)
    # 2 writer threads were mid-write and 4 writes were queued: all 6 fail with an .error
    # file (their waiters get the message); the writer process is gone, and the scheduler
    # removed its temporary files and locks.
    assert files == [] and len(errors) == 6 and left == []
    assert all(fmt.SHUTDOWN_MESSAGE in (dump / e).read_text() for e in errors)
    assert gone(writer_pid)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_scheduler_killed_mid_write_the_writer_finishes_and_exits(dump, sig, monkeypatch, tmp_path):
    # SGLang's scheduler keeps the default SIGTERM action (it is stopped by ShutdownReq,
    # and SIGKILLed by kill_process_tree or PR_SET_PDEATHSIG): either signal ends it at
    # once. Its writer process sees the socket close, writes what it was sent (within the
    # drain timeout) and exits: no orphan, no partial file under a final name.
    import signal

    proc, writer_pid = run_child(dump, 4, 0.4, 30, monkeypatch, tmp_path)
    time.sleep(0.6)  # the first two writes are done, the next two are running
    proc.send_signal(getattr(signal, sig))
    proc.communicate(timeout=30)
    assert gone(writer_pid)
    files, errors, left = check_dir_after_exit(dump)
    assert len(files) == 4 and errors == [] and left == []


def test_writer_killed_mid_burst_fails_its_files_and_a_new_writer_serves(dump, monkeypatch, tmp_path, sessions):
    """SIGKILL to the writer process: the files it had not finished get an error in their
    responses (and an .error file), requests still in prefill fail at their next chunk,
    nothing partial stays, and a new writer process writes the next requests."""
    import signal

    slow_writes(monkeypatch, tmp_path, 0.5)
    sess = sessions.start(make_runner(dump, layers="2,4"))
    writer = sess.writer
    first_pid = writer.pid
    done = [Req(f"done-{i}", 4, i + 1) for i in range(3)]
    half = Req("half", 8, 9)
    run_extend(sess, [(r, 0, 4) for r in done] + [(half, 0, 4)], IDS)
    os.kill(first_pid, signal.SIGKILL)
    assert gone(first_pid)
    metas = [finish(r) for r in done]
    assert all("writer process" in m.get("hidden_states_error", "") or "missing" in m.get("hidden_states_error", "")
               for m in metas), metas
    run_extend(sess, [(half, 4, 8)], IDS)  # its writer died: the next chunk fails the request
    assert "writer process died" in finish(half)["hidden_states_error"]
    assert writer.pid != first_pid and writer.snapshot()["writer_restarts"] == 1
    after = Req("after", 4, 20)
    run_extend(sess, [(after, 0, 4)], IDS)
    assert assert_complete_or_error(after, finish(after), dump)
    assert wait_for(lambda: leftovers(dump) == []), leftovers(dump)
    assert [n for n in os.listdir(dump) if n.endswith(fmt.SUFFIX)] == [f"{fmt.safe_stem('after')}{fmt.SUFFIX}"]
    assert writer.wait_idle(10) and writer.unwritten_bytes() == 0  # the floor holds nothing back


def test_submit_after_close_fails_the_request_cleanly(dump, sessions):
    sess = sessions.start(make_runner(dump, layers="2,4"))
    sess.writer.close(timeout=1)
    req = Req("late", 4, 1)
    run_extend(sess, [(req, 0, 4)], IDS)
    meta = finish(req)
    assert fmt.SHUTDOWN_MESSAGE in meta["hidden_states_error"]
    assert leftovers(dump) == [] and sess.writer.snapshot()["host_bytes_in_use"] == 0


def test_writer_settings_come_from_the_environment_and_bad_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("KIMI_SGLANG_DRAIN_TIMEOUT_S", "2.5")
    monkeypatch.setenv("KIMI_SGLANG_STATS_INTERVAL_S", "0")
    monkeypatch.setenv("KIMI_SGLANG_WRITER_THREADS", "3")
    monkeypatch.setenv("KIMI_SGLANG_WRITER_CPUS", "0")
    monkeypatch.setenv("KIMI_SGLANG_WATCHDOG_S", "5")
    monkeypatch.setenv("KIMI_SGLANG_WRITER_SPARES", "2")
    assert env_settings().items() >= {"writer_threads": 3, "writer_spares": 2, "drain_timeout_s": 2.5, "stats_interval_s": 0,
                                      "writer_cpus": (0,), "watchdog_s": 5}.items()
    monkeypatch.delenv("KIMI_SGLANG_WATCHDOG_S")
    monkeypatch.delenv("KIMI_SGLANG_WRITER_SPARES")
    assert env_settings()["writer_spares"] == 8  # up to eight unless told (Spares keeps as many as files begin at once)
    for name, value, message in [("KIMI_SGLANG_WRITER_SPARES", "9", "from 0 to 8"),
                                 ("KIMI_SGLANG_WRITER_SPARES", "1.5", "whole number"),
                                 ("KIMI_SGLANG_WRITER_SPARES", "-1", ">= 0"),("KIMI_SGLANG_DRAIN_TIMEOUT_S", "soon", "number of seconds"),
                                 ("KIMI_SGLANG_DRAIN_TIMEOUT_S", "-1", ">= 0"),
                                 ("KIMI_SGLANG_WRITER_THREADS", "0", ">= 1"),
                                 ("KIMI_SGLANG_WATCHDOG_S", "0", ">= 1 seconds"),
                                 ("KIMI_SGLANG_WATCHDOG_S", "inf", "finite number"),
                                 ("KIMI_SGLANG_WRITER_THREADS", "2.5", "whole number"),
                                 ("KIMI_SGLANG_STATS_INTERVAL_S", "nan?", "number"),
                                 ("KIMI_SGLANG_STATS_INTERVAL_S", "nan", "finite number"),
                                 ("KIMI_SGLANG_WRITER_THREADS", "inf", "finite number"),
                                 ("KIMI_SGLANG_WRITER_THREADS", "1e9", "from 1 to 256"),
                                 ("KIMI_SGLANG_WRITER_CPUS", "0-x", "not a CPU number or range"),
                                 ("KIMI_SGLANG_WRITER_CPUS", "3-1", "not a CPU range"),
                                 ("KIMI_SGLANG_WRITER_CPUS", "0,", "not a CPU number"),
                                 ("KIMI_SGLANG_WRITER_CPUS", str(os.cpu_count()),
                                  f"'{os.cpu_count()}' names CPUs beyond this host's 0-{os.cpu_count() - 1}"),
                                 # refused before it is expanded: a typo builds no giant set
                                 ("KIMI_SGLANG_WRITER_CPUS", "0-999999999", "names CPUs beyond"),
                                 ("KIMI_SGLANG_WRITER_CPUS", "1_0", "not a CPU number"),
                                 ("KIMI_SGLANG_WRITER_CPUS", "9" * 5000, "not a CPU number"),
                                 ("KIMI_SGLANG_WRITER_CPUS", "\u0663", "not a CPU number")]:
        monkeypatch.setenv(name, value)
        with pytest.raises(DumpConfigError, match=f"{name}.*{re.escape(message)}"):
            env_settings()
        monkeypatch.delenv(name)
    monkeypatch.delenv("KIMI_SGLANG_DRAIN_TIMEOUT_S", raising=False)
    monkeypatch.delenv("KIMI_SGLANG_STATS_INTERVAL_S", raising=False)
    monkeypatch.setenv("KIMI_SGLANG_WRITER_CPUS", " ")  # blank: unset
    assert env_settings().items() >= {"writer_threads": 8, "drain_timeout_s": 30, "stats_interval_s": 60,
                                      "writer_cpus": None, "watchdog_s": 60}.items()


def _allowed_cpus(pid):
    """{thread id: its Cpus_allowed_list} of every thread of process ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            out[tid] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("Cpus_allowed_list"))
    return out


def test_writer_process_runs_on_the_cpus_asked_and_a_refused_set_fails_the_start(tmp_path, monkeypatch):
    """KIMI_SGLANG_WRITER_CPUS (DumpWriter ``cpus``): the writer process and every one of
    its threads run on those CPUs only, not the scheduler's, and still write the file; CPUs
    the kernel refuses fail the start with a sentence naming the variable, leaving no
    process behind."""
    last = os.cpu_count() - 1
    d = tmp_path / "d"
    d.mkdir()
    fd = fmt.open_dump_dir(str(d))
    w = DumpWriter(fd, arena_bytes=1 << 20, threads=3, layer_ids=[2, 4], num_layers=4, cpus=[last],
                   register_atexit=False)
    try:
        p = w.start("r", [1, 2, 3, 4], 8, torch.float32)
        rows = torch.arange(32, dtype=torch.float32).reshape(4, 8)
        w.copy_rows(rows, [(p, 0, 4)])
        w.finish(p, fmt.reserve(fd, "r"))
        assert w.wait_idle(10)
        allowed = _allowed_cpus(w.pid)
        assert len(allowed) >= 4 and set(allowed.values()) == {str(last)}  # main + 3 writer threads (+ acks)
        assert _allowed_cpus(os.getpid())[str(os.getpid())] != str(last) or os.cpu_count() == 1
        [name] = [n for n in os.listdir(d) if n.endswith(".safetensors")]
        from safetensors.torch import load_file

        got = load_file(str(d / name))["hidden_states"]
        assert torch.equal(got.reshape(4, 8), rows)
    finally:
        assert w.close(10)

    spawned = []
    real_popen = subprocess.Popen

    def popen(*a, **k):
        spawned.append(real_popen(*a, **k))
        return spawned[-1]

    def refuse(pid, cpus):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(subprocess, "Popen", popen)
    for bad in ([-1], [1 << 40]):  # through the API: refused before anything starts
        with pytest.raises(ValueError, match="cpus must be CPU numbers"):
            DumpWriter(fd, arena_bytes=1 << 20, threads=1, layer_ids=[2, 4], num_layers=4, cpus=bad,
                       register_atexit=False)
    assert spawned == []
    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    with pytest.raises(RuntimeError, match=r"on CPUs \[0\] \(KIMI_SGLANG_WRITER_CPUS\): Invalid argument"):
        DumpWriter(fd, arena_bytes=1 << 20, threads=1, layer_ids=[2, 4], num_layers=4, cpus=[0],
                   register_atexit=False)
    assert len(spawned) == 1 and spawned[0].poll() is not None  # killed and reaped


# ---- malformed request fields --------------------------------------------------------------
def _sglang_request(body):
    """What SGLang's /generate does with a JSON body before the scheduler sees it:
    FastAPI validates it into GenerateReqInput (pydantic; a failure is a
    RequestValidationError, which http_server's handler answers with 400), then the
    tokenizer manager normalizes it (a ValueError is answered with 400 too)."""
    pydantic = pytest.importorskip("pydantic")
    io_struct = pytest.importorskip("sglang.srt.managers.io_struct")
    obj = pydantic.TypeAdapter(io_struct.GenerateReqInput).validate_python(body)
    obj.normalize_batch_and_arguments()
    return obj


@pytest.mark.parametrize("body, message", [
    ({"rid": 123, "input_ids": [1, 2]}, "valid string"),
    ({"rid": {"a": 1}, "input_ids": [1, 2]}, "valid string"),
    ({"input_ids": []}, "input_ids cannot be empty"),
    ({"input_ids": "1,2"}, "must be list"),
    ({"input_ids": [1.5, 2]}, "must be int"),
    ({"rid": ["a", "a"], "input_ids": [[1], [2]]}, "Duplicate request IDs"),
    ({"rid": ["a"], "input_ids": [[1], [2]]}, "rids length mismatch"),
])
def test_malformed_dump_inputs_are_refused_by_sglang_validation(body, message):
    with pytest.raises(Exception, match=message) as info:
        _sglang_request(body)
    assert type(info.value).__name__ in ("ValidationError", "ValueError")


def test_hostile_but_wellformed_rids_pass_validation_unchanged():
    for rid in RIDS:
        if "\udcff" in rid:
            continue  # JSON cannot carry a lone surrogate as UTF-8 bytes; \\udcff escapes can
        assert _sglang_request({"rid": rid, "input_ids": [1, 2]}).rid == rid


# ---- observability -------------------------------------------------------------------------
def _prometheus(prom_dir):
    """What SGLang's /metrics serves from a multiprocess directory: {sample line: value}."""
    out = subprocess.run([sys.executable, "-c", MULTIPROC_HTTP],
                         env=dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(prom_dir)),
                         check=True, capture_output=True, text=True).stdout
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in out.splitlines()
            if ln.startswith("kimi_sglang:")}


def test_counters_in_the_log_and_in_prometheus(dump, monkeypatch, tmp_path, caplog, sessions):
    pytest.importorskip("prometheus_client")
    prom = tmp_path / "prom"
    prom.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(prom))
    gate = tmp_path / "gate"
    # renames wait for the gate file; the third fails as on a full disk
    inject_writer(monkeypatch, tmp_path, """
        import os, threading, time
        from sglang_ext import format as fmt
        _real, _lock, _n = fmt.publish, threading.Lock(), [0]
        def publish(*a):
            while not os.path.exists(os.environ["GATE"]):
                time.sleep(0.01)
            with _lock:
                _n[0] += 1
                third = _n[0] == 3
            if third:
                raise OSError(28, "No space left on device")
            return _real(*a)
        fmt.publish = publish
    """, GATE=str(gate))
    runner = make_runner(dump, layers="2,4")
    runner.server_args.enable_metrics = True
    sess = sessions.start(runner)
    reqs = [Req(f"m{i}", 4, i + 1) for i in range(3)]
    run_extend(sess, [(r, 0, 4) for r in reqs], IDS)

    def value(name):
        return _prometheus(prom).get(f'kimi_sglang:{name}{{model_name="/models/tiny"}}')

    assert wait_for(lambda: value("dump_queue_depth") == 3)  # all three held at the gate
    gate.touch()
    metas = [finish(r) for r in reqs]
    sizes = [os.path.getsize(x["hidden_states_path"]) for x in metas if "hidden_states_path" in x]
    # The writer process moves the counters just after it releases a lock, so a waiter can
    # see the file a moment before them.
    assert wait_for(lambda: value("dump_queue_depth") == 0)
    assert value("dump_files_written_total") == 2 and value("dump_failures_total") == 1
    assert value("dump_bytes_written_total") == sum(sizes)
    assert value("dump_host_bytes_in_use") == 0
    with caplog.at_level("INFO", logger="sglang_ext.writer"):
        sess.writer.close(timeout=5)
    [line] = [r.getMessage() for r in caplog.records if "writer closed" in r.getMessage()]
    assert "'files_written': 2" in line and "'failures': 1" in line and "'bytes_written'" in line
    assert value("dump_queue_depth") is None, "a writer that exited leaves no gauge behind"


def test_failures_on_the_scheduler_side_are_counted_everywhere(dump, monkeypatch, tmp_path, capfd, sessions):
    """Requests the scheduler fails itself (rids over ``format.MAX_RID_CHARS``, refused
    before the writer process sees them) count as failures like the writer's own: in the
    scheduler's counters, the writer process's log line and
    ``kimi_sglang:dump_failures_total`` (a review saw 8 errors shown as 0 failures)."""
    pytest.importorskip("prometheus_client")
    prom = tmp_path / "prom"
    prom.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(prom))
    monkeypatch.setenv("KIMI_SGLANG_STATS_INTERVAL_S", "0.000001")
    runner = make_runner(dump, layers="2,4")
    runner.server_args.enable_metrics = True
    sess = sessions.start(runner)
    bad = [Req("r" * (fmt.MAX_RID_CHARS + 1) + str(i), 4, i + 1) for i in range(3)]
    ok = Req("ok", 4, 9)
    run_extend(sess, [(r, 0, 4) for r in bad] + [(ok, 0, 4)], IDS)
    assert all(f"at most {fmt.MAX_RID_CHARS}" in finish(r)["hidden_states_error"] for r in bad)
    assert assert_complete_or_error(ok, finish(ok), dump)
    snap = idle(sess)
    assert (snap["failures"], snap["files_written"]) == (3, 1), snap
    label = '{model_name="/models/tiny"}'
    assert wait_for(lambda: _prometheus(prom).get(f"kimi_sglang:dump_failures_total{label}") == 3.0), \
        _prometheus(prom)
    assert _prometheus(prom)[f"kimi_sglang:dump_files_written_total{label}"] == 1.0
    assert wait_for(lambda: _logged_failures(capfd, 3))


def _logged_failures(capfd, n):
    """The writer process's counter line (on stderr) says ``n`` failures."""
    return f"'failures': {n}," in capfd.readouterr().err


def test_metrics_only_with_enable_metrics():
    import types

    sa = types.SimpleNamespace(enable_metrics=False, model_path="/m", served_model_name=None)
    assert dump_metrics.model_name(sa) is None


def test_periodic_counter_log_interval(dump, monkeypatch, capfd, sessions):
    monkeypatch.setenv("KIMI_SGLANG_STATS_INTERVAL_S", "0.000001")
    sess = sessions.start(make_runner(dump, layers="2,4"))
    req = Req("log", 4, 1)
    run_extend(sess, [(req, 0, 4)], IDS)
    finish(req)
    assert wait_for(lambda: "'files_written': 1" in capfd.readouterr().err, timeout=5)


MULTIPROC_SCHEDULER = textwrap.dedent(r"""
    import os, sys, types, torch
    from sglang_ext import format as fmt, metrics
    from sglang_ext.writer import DumpWriter
    sa = types.SimpleNamespace(enable_metrics=True, model_path="/models/tiny", served_model_name=None)
    fd = fmt.open_dump_dir(sys.argv[1])
    w = DumpWriter(fd, arena_bytes=1 << 20, threads=1, layer_ids=[2, 4], num_layers=4,
                   metrics_model_name=metrics.model_name(sa))
    p = w.start("r", [1, 2, 3, 4], 8, torch.float32)
    w.copy_rows(torch.zeros(4, 8), [(p, 0, 4)])
    w.finish(p, fmt.reserve(fd, "r"))
    assert w.wait_idle(10)
    print(w.pid, flush=True)
    sys.stdin.readline()  # hold on while the test reads /metrics
    assert w.close(10)
""")

def test_metrics_from_the_writer_process_reach_sglangs_multiprocess_registry(dump, tmp_path):
    pytest.importorskip("prometheus_client")
    prom = tmp_path / "prom"
    prom.mkdir()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(prom))
    sched = subprocess.Popen([sys.executable, "-c", MULTIPROC_SCHEDULER, str(dump)], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    writer_pid = int(sched.stdout.readline())
    size = os.path.getsize(dump / f"{fmt.safe_stem('r')}{fmt.SUFFIX}")
    label = '{model_name="/models/tiny"}'
    assert wait_for(lambda: _prometheus(prom).get(f"kimi_sglang:dump_files_written_total{label}") == 1.0)
    values = _prometheus(prom)
    assert values[f"kimi_sglang:dump_bytes_written_total{label}"] == float(size)
    assert values[f"kimi_sglang:dump_queue_depth{label}"] == 0.0
    assert values[f"kimi_sglang:dump_host_bytes_in_use{label}"] == 0.0
    assert values[f"kimi_sglang:dump_failures_total{label}"] == 0.0
    assert any(f"_{writer_pid}.db" in n for n in os.listdir(prom)), "written by the writer process"
    sched.communicate("done\n", timeout=30)
    assert sched.returncode == 0


MULTIPROC_LEVELS = textwrap.dedent(r"""
    import sys, types
    from sglang_ext import metrics
    sa = types.SimpleNamespace(enable_metrics=True, model_path="/models/tiny", served_model_name=None)
    metrics.DumpMetrics(metrics.model_name(sa)).levels(queue_depth=int(sys.argv[1]), host_bytes_in_use=int(sys.argv[2]))
""")


def test_metrics_levels_add_up_over_writer_processes(tmp_path):
    """One writer per DP rank, each its own process: the server's queue depth and pinned
    bytes in use are the sum of theirs (a gauge of one process would hide the others)."""
    pytest.importorskip("prometheus_client")
    prom = tmp_path / "prom"
    prom.mkdir()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(prom))
    for depth, held in ((5, 1 << 20), (3, 2 << 20)):
        subprocess.run([sys.executable, "-c", MULTIPROC_LEVELS, str(depth), str(held)], env=env, check=True)
    out = subprocess.run([sys.executable, "-c", MULTIPROC_HTTP], env=env, check=True,
                         capture_output=True, text=True).stdout
    values = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in out.splitlines()
              if ln.startswith("kimi_sglang:")}
    assert values['kimi_sglang:dump_queue_depth{model_name="/models/tiny"}'] == 8
    assert values['kimi_sglang:dump_host_bytes_in_use{model_name="/models/tiny"}'] == 3 << 20
