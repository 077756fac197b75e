"""The writer at its edges (issue 36): a client's huge rid, cleanup errors, a stuck writer
process, an index line that cannot be written. Each request still ends in exactly one
outcome (a complete file or an error in its response) and the writer keeps serving.

Driven as the patched scheduler drives it (tests/unit/test_hooks.py's stand-ins), with a
real writer process; faults are injected into that process (``inject_writer``) or made
with real signals and real FIFOs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest
import torch

from sglang_ext import format as fmt
from test_faults import assert_complete_or_error, leftovers, slow_writes
from standins import Req, finish, idle, inject_writer, make_runner, run_extend, wait_for

IDS = [2, 4]


def files(d):
    return sorted(n for n in os.listdir(d) if n.endswith(fmt.SUFFIX))


# ---- 1: a large rid ----------------------------------------------------------------------
def test_a_huge_rid_fails_its_own_request_and_the_writer_lives(dump, sessions):
    """A 1 MB rid (an HTTP field any client sets) fails that request with a sentence; the
    request beside it in the batch gets its file; the writer process is not replaced."""
    sess = sessions.start(make_runner(dump, layers="2,4"))
    writer = sess.writer
    pid = writer.pid
    huge, plain = Req("r" * 1_000_000, 4, 1), Req("plain", 4, 2)
    run_extend(sess, [(huge, 0, 4), (plain, 0, 4)], IDS)
    assert f"at most {fmt.MAX_RID_CHARS}" in finish(huge)["hidden_states_error"]
    assert assert_complete_or_error(plain, finish(plain), dump)
    snap = idle(sess)
    assert writer.pid == pid and snap["writer_restarts"] == 0 and snap["host_bytes_in_use"] == 0


def test_a_message_the_socket_refuses_fails_its_requests_not_the_writer(dump, monkeypatch, sessions):
    """Past the rid check (lifted here), an op too large for one socket message is refused
    by the kernel (EMSGSIZE): that is the message's fault, not the writer's. Its request
    fails, its arena range comes back, the other requests of the batch and the next
    batch are written by the same writer process."""
    monkeypatch.setattr(fmt, "MAX_RID_CHARS", 10**8)
    sess = sessions.start(make_runner(dump, layers="2,4"))
    writer = sess.writer
    pid = writer.pid
    huge, plain = Req("r" * 2_000_000, 4, 1), Req("plain", 4, 2)
    run_extend(sess, [(plain, 0, 4), (huge, 0, 4)], IDS)
    assert finish(huge)["hidden_states_error"]
    assert assert_complete_or_error(plain, finish(plain), dump)
    after = Req("after", 4, 3)
    run_extend(sess, [(after, 0, 4)], IDS)
    assert assert_complete_or_error(after, finish(after), dump)
    snap = idle(sess)
    assert writer.pid == pid and snap["writer_restarts"] == 0
    assert snap["host_bytes_in_use"] == 0 and snap["failures"] == 1 and snap["files_written"] == 2
    assert wait_for(lambda: leftovers(dump) == []), leftovers(dump)


# ---- 2: cleanup errors -------------------------------------------------------------------
# While $BREAK exists, the writer process cannot rename nor unlink temporary files (as in
# a directory made read-only between two chunks of a request).
CLEANUP_FAILS = """
    import os
    from sglang_ext import format as fmt
    _publish, _unlink = fmt.publish, os.unlink
    def publish(*a, **k):
        if os.path.exists(os.environ["BREAK"]):
            raise PermissionError(13, "Permission denied")
        return _publish(*a, **k)
    def unlink(path, *a, **k):
        if os.path.exists(os.environ["BREAK"]) and str(path).endswith(".tmp"):
            raise PermissionError(13, "Permission denied")
        return _unlink(path, *a, **k)
    fmt.publish, os.unlink = publish, unlink
"""


def test_a_cleanup_error_fails_the_request_and_the_writer_thread_goes_on(dump, monkeypatch, tmp_path, sessions):
    """The rename and the temporary file's unlink fail with EACCES: the request gets an
    error (not a hang), the failure is counted, and the same single writer thread writes
    the next request once the directory is usable again; ``close`` does not raise."""
    monkeypatch.setenv("KIMI_SGLANG_WRITER_THREADS", "1")
    flag = tmp_path / "break"
    flag.touch()
    inject_writer(monkeypatch, tmp_path, CLEANUP_FAILS, BREAK=str(flag))
    sess = sessions.start(make_runner(dump, layers="2,4"))
    req = Req("ro", 6, 1)
    run_extend(sess, [(req, 0, 3)], IDS)
    run_extend(sess, [(req, 3, 6)], IDS)
    assert "Permission denied" in finish(req)["hidden_states_error"]
    assert idle(sess)["failures"] == 1
    flag.unlink()
    after = Req("after", 4, 2)
    run_extend(sess, [(after, 0, 4)], IDS)
    assert assert_complete_or_error(after, finish(after), dump)
    assert sess.writer.close(timeout=5) is True


def test_a_directory_planted_at_the_temporary_name_fails_that_request_only(dump, monkeypatch, tmp_path, sessions):
    """Temporary names carry a random part, so none can be planted in advance; with the
    name forced (as a neighbour who guessed it), the request whose name is taken gets an
    error, the writer thread survives, and ``close`` does not raise."""
    monkeypatch.setenv("KIMI_SGLANG_WRITER_THREADS", "1")
    planted = ".kimi-planted.safetensors.tmp"
    inject_writer(monkeypatch, tmp_path, f"""
        import os
        from sglang_ext import format as fmt
        _real = fmt.tmp_name
        def tmp_name(tag, key):
            return {planted!r} if key == 0 else _real(tag, key)
        fmt.tmp_name = tmp_name
    """)
    (dump / planted).mkdir()
    sess = sessions.start(make_runner(dump, layers="2,4"))
    first, second = Req("first", 4, 1), Req("second", 4, 2)
    run_extend(sess, [(first, 0, 4)], IDS)
    assert finish(first)["hidden_states_error"]
    run_extend(sess, [(second, 0, 4)], IDS)
    assert assert_complete_or_error(second, finish(second), dump)
    assert (dump / planted).is_dir()
    assert sess.writer.close(timeout=5) is True


def test_temporary_names_cannot_be_guessed():
    names = {fmt.tmp_name("1-0", 7) for _ in range(50)}
    assert len(names) == 50 and all(n.startswith(".kimi-1-0-7-") for n in names)


# ---- 3: the watchdog ---------------------------------------------------------------------
def _gone(pid, timeout=10):
    def dead():
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(") ")[1][0] in "ZX"
        except FileNotFoundError:
            return True
    return wait_for(dead, timeout)


def test_a_stopped_writer_is_replaced_and_its_requests_fail_in_bounded_time(dump, monkeypatch, tmp_path, sessions):
    """SIGSTOP to the writer process while it holds a file: within the watchdog time
    (KIMI_SGLANG_WATCHDOG_S) its waiting response gets an error, the process is killed,
    the next batch starts a new one, which writes."""
    monkeypatch.setenv("KIMI_SGLANG_WATCHDOG_S", "1")
    slow_writes(monkeypatch, tmp_path, 0.5)
    sess = sessions.start(make_runner(dump, layers="2,4"))
    writer = sess.writer
    pid = writer.pid
    req = Req("held", 4, 1)
    run_extend(sess, [(req, 0, 4)], IDS)
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    meta = finish(req, timeout=20)
    assert time.monotonic() - t0 < 10
    # the watchdog settles the file itself: the response has the sentence, no batch needed
    assert "made no progress for 1 s" in meta.get("hidden_states_error", ""), meta
    assert _gone(pid)
    after = Req("after", 4, 2)
    run_extend(sess, [(after, 0, 4)], IDS)
    assert assert_complete_or_error(after, finish(after), dump)
    assert writer.pid != pid and writer.snapshot()["writer_restarts"] == 1
    assert files(dump) == [f"{fmt.safe_stem('after')}{fmt.SUFFIX}"]
    assert "made no progress" in (dump / f"{fmt.safe_stem('held')}{fmt.SUFFIX}{fmt.ERROR_SUFFIX}").read_text()


def test_the_scheduler_waiting_on_a_stopped_writer_is_freed_by_the_watchdog(dump, monkeypatch, sessions):
    """Backpressure on a stopped writer: the arena (1 MiB) is full and the writer never
    gives it back; the scheduler's wait ends within the watchdog time, that batch's
    requests fail, and the server goes on with a new writer process."""
    monkeypatch.setenv("KIMI_SGLANG_WATCHDOG_S", "1")
    sess = sessions.start(make_runner(dump, num_layers=8, layers="2,4", max_mb=1))
    writer = sess.writer
    pid = writer.pid
    os.kill(pid, signal.SIGSTOP)
    reqs = [Req(f"big-{i}", 4096, i + 1) for i in range(4)]  # 4 x 4096 x 2 x 16 x 4 B = 4 MiB
    t0 = time.monotonic()
    run_extend(sess, [(r, 0, 4096) for r in reqs], IDS)
    assert time.monotonic() - t0 < 10
    metas = [finish(r, timeout=20) for r in reqs]
    assert all(m.get("hidden_states_error") for m in metas), metas
    assert _gone(pid) and writer.snapshot()["writer_restarts"] == 1
    after = Req("after", 4, 9)
    run_extend(sess, [(after, 0, 4)], IDS)
    assert assert_complete_or_error(after, finish(after), dump)


def test_a_fifo_planted_at_the_index_blocks_nothing(dump, monkeypatch, sessions):
    """A FIFO at ``index.jsonl`` (a neighbour's trap: opening it for writing blocks
    without a reader): the request whose index line it takes fails within the watchdog
    time at worst, and once it is removed the next request is written and indexed."""
    monkeypatch.setenv("KIMI_SGLANG_WATCHDOG_S", "2")
    os.mkfifo(dump / fmt.INDEX_NAME)
    sess = sessions.start(make_runner(dump, layers="2,4"))
    req = Req("fifo", 4, 1)
    run_extend(sess, [(req, 0, 4)], IDS)
    t0 = time.monotonic()
    error = finish(req, timeout=20).get("hidden_states_error", "")
    assert time.monotonic() - t0 < 10
    # a sentence: a review saw "OSError: [Errno None] the index line could not be written"
    assert error == (f"the index line could not be written ({fmt.INDEX_NAME} is a FIFO, not a "
                     f"regular file); the file was removed"), error
    assert files(dump) == []
    os.unlink(dump / fmt.INDEX_NAME)
    after = Req("after", 4, 2)
    run_extend(sess, [(after, 0, 4)], IDS)
    assert assert_complete_or_error(after, finish(after), dump)
    assert [r["file"] for r in fmt.read_index(str(dump))] == [f"{fmt.safe_stem('after')}{fmt.SUFFIX}"]


def test_a_slow_writer_that_makes_progress_is_not_killed(dump, monkeypatch, tmp_path, sessions):
    """The watchdog measures progress, not time: one writer thread taking 0.4 s a file
    for 8 files (3.2 s in all, past a 1 s watchdog) is never replaced."""
    monkeypatch.setenv("KIMI_SGLANG_WATCHDOG_S", "1")
    monkeypatch.setenv("KIMI_SGLANG_WRITER_THREADS", "1")
    slow_writes(monkeypatch, tmp_path, 0.4)
    sess = sessions.start(make_runner(dump, layers="2,4"))
    reqs = [Req(f"slow-{i}", 4, i + 1) for i in range(8)]
    run_extend(sess, [(r, 0, 4) for r in reqs], IDS)
    assert all(assert_complete_or_error(r, finish(r, timeout=30), dump) for r in reqs)
    assert idle(sess)["writer_restarts"] == 0


def test_a_writer_that_dies_at_start_is_restarted_with_backoff(dump, monkeypatch, tmp_path, caplog, sessions):
    """Writer processes that end at start (here: exit 3 while $DIE exists) are started
    again after a pause that doubles, not at every batch (a review saw 60 starts in 60 s,
    an error line each): 40 batches (4 s or more) start a handful (at most 7 even if they
    took a minute; 40 before), one log line each;
    every request of those batches ends with an error, those during a pause at once with
    the sentence that says when the next start comes; once the cause is gone the next
    start serves requests again."""
    die = tmp_path / "die"
    inject_writer(monkeypatch, tmp_path, """
        import os, sys
        if os.path.exists(os.environ["DIE"]):
            sys.stderr.write("injected: this writer process cannot start\\n")
            os._exit(3)
    """, DIE=str(die))
    sess = sessions.start(make_runner(dump, layers="2,4"))
    writer = sess.writer
    first = Req("first", 4, 1)
    run_extend(sess, [(first, 0, 4)], IDS)
    assert assert_complete_or_error(first, finish(first), dump)
    die.touch()
    os.kill(writer.pid, signal.SIGKILL)  # the first end in a row: its successor starts at once
    assert _gone(writer.pid)
    metas = []
    with caplog.at_level("ERROR", logger="sglang_ext.writer"):
        for i in range(40):
            req = Req(f"b{i}", 4, i + 2)
            run_extend(sess, [(req, 0, 4)], IDS)
            metas.append(finish(req, timeout=20))  # answered, not held for the backoff (up to 60 s)
            time.sleep(0.1)
    ended = [r.getMessage() for r in caplog.records if "ended (" in r.getMessage()]
    starts = writer.snapshot()["writer_restarts"]
    # one line per end; the last may be waiting for its successor
    assert 2 <= starts <= 7 and len(ended) - starts in (0, 1), (starts, ended)
    assert "starting a new one in 1 s, requests fail until then" in ended[1] + ended[2], ended
    assert all(m.get("hidden_states_error") for m in metas), metas
    waited = [m["hidden_states_error"] for m in metas if "the next one starts in" in m["hidden_states_error"]]
    assert len(waited) >= 20, metas
    assert re.search(r"ended \d times in a row within 10 s of its start \(exit code 3\); "
                     r"the next one starts in \d+ s$", waited[-1]), waited[-1]
    die.unlink()
    deadline, tries = time.monotonic() + 90, 0
    while True:  # requests fail until the pause is over, then the next writer serves them
        after = Req("after", 4, 99)
        run_extend(sess, [(after, 0, 4)], IDS)
        meta = finish(after, timeout=20)
        tries += 1
        if "hidden_states_path" in meta or time.monotonic() > deadline:
            break
        assert "the next one starts in" in meta["hidden_states_error"], meta
        time.sleep(0.2)
    assert assert_complete_or_error(after, meta, dump)
    assert idle(sess)["failures"] == 40 + tries - 1


SLOW_BPS = 2 << 20  # the slow disk's write rate: 2 MiB/s
BLKIO = "/sys/fs/cgroup/blkio"  # cgroup v1's block I/O controller


@pytest.fixture
def slow_disk(tmp_path):
    """``(directory, join)``: an empty directory on a disk that writes ``SLOW_BPS`` bytes a
    second for the processes ``join(pid)`` puts there: ext4 on a loop device mounted
    ``sync`` (a write returns once on the device), throttled by cgroup v1's
    ``blkio.throttle.write_bps_device``. Skips where that cannot be made (not root, no
    loop device, no blkio controller)."""
    def sh(*cmd):
        return subprocess.run(cmd, capture_output=True, text=True)

    image, mnt = tmp_path / "disk.img", tmp_path / "slow"
    group = os.path.join(BLKIO, f"kimi-slow-{os.getpid()}-{tmp_path.name}")
    if os.geteuid() != 0 or not os.path.exists(os.path.join(BLKIO, "blkio.throttle.write_bps_device")):
        pytest.skip("a throttled disk needs root and cgroup v1's blkio controller")
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    loop = sh("losetup", "--find", "--show", str(image)).stdout.strip()
    if not loop or sh("mkfs.ext4", "-q", "-F", loop).returncode:
        if loop:
            sh("losetup", "-d", loop)
        pytest.skip("no loop device or mkfs.ext4 here: no throttled disk")
    mnt.mkdir()
    try:
        assert sh("mount", "-o", "sync", loop, str(mnt)).returncode == 0
        os.mkdir(group)
        with open(f"/sys/block/{os.path.basename(loop)}/dev") as f:
            device = f.read().strip()
        with open(os.path.join(group, "blkio.throttle.write_bps_device"), "w") as f:
            f.write(f"{device} {SLOW_BPS}")

        def join(pid):
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(pid))

        (mnt / "hs").mkdir()
        yield mnt / "hs", join
    finally:
        sh("umount", "-l", str(mnt))
        sh("losetup", "-d", loop)
        if os.path.isdir(group):
            wait_for(lambda: sh("rmdir", group).returncode == 0, timeout=10)


def test_a_writer_writing_to_a_slow_disk_is_not_killed_but_a_stopped_one_is(slow_disk, monkeypatch, sessions):
    """One chunk of 8 MiB rows to a disk that writes 2 MiB/s takes ~4 s, twice the
    watchdog's 2 s: the writer writes bytes all along, so it is not killed (a review saw a
    16k-token Kimi-K2.5 chunk killed on every retry below 15 MB/s: progress was counted per
    op) and the file equals its rows. The same writer SIGSTOPped in the middle of the next
    such chunk writes nothing more: it is replaced and that request fails with the reason."""
    d, join = slow_disk
    monkeypatch.setenv("KIMI_SGLANG_WATCHDOG_S", "2")
    monkeypatch.setenv("KIMI_SGLANG_WRITER_SPARES", "0")
    sess = sessions.start(make_runner(d, layers="2,4"))
    writer = sess.writer
    pid = writer.pid
    join(pid)
    tokens = (8 << 20) // (2 * 8 * 4)  # 2 layer slots x HIDDEN 8 x float32: 8 MiB of rows
    big = Req("big", tokens, 1)
    t0 = time.monotonic()
    run_extend(sess, [(big, 0, tokens)], IDS)
    meta = finish(big, timeout=120)
    took = time.monotonic() - t0
    assert assert_complete_or_error(big, meta, d), meta
    assert took > 3, f"the disk wrote 8 MiB in {took:.1f} s: not slow, the test proves nothing"
    assert writer.pid == pid and idle(sess)["writer_restarts"] == 0
    stopped = Req("stopped", tokens, 2)
    run_extend(sess, [(stopped, 0, tokens)], IDS)
    time.sleep(1.0)  # a few slices written
    os.kill(pid, signal.SIGSTOP)
    meta = finish(stopped, timeout=120)
    assert "made no progress for 2 s" in meta.get("hidden_states_error", ""), meta
    assert _gone(pid)
    assert files(d) == [f"{fmt.safe_stem('big')}{fmt.SUFFIX}"]


# ---- 8: one outcome per request ----------------------------------------------------------
INDEX_FAILS = """
    from sglang_ext import format as fmt
    def append_index(*a, **k):
        raise OSError(28, "No space left on device")
    fmt.append_index = append_index
"""


def test_an_index_line_that_cannot_be_written_fails_the_request_as_a_whole(dump, monkeypatch, tmp_path, sessions):
    """The index line fails after the rename: the request fails everywhere alike: its
    response carries the error, no file stays under its name, no index line, one
    failure and no file counted."""
    inject_writer(monkeypatch, tmp_path, INDEX_FAILS)
    sess = sessions.start(make_runner(dump, layers="2,4"))
    req = Req("noindex", 4, 1)
    run_extend(sess, [(req, 0, 4)], IDS)
    meta = finish(req)
    assert "index line could not be written" in meta["hidden_states_error"]
    assert "hidden_states_path" not in meta
    assert files(dump) == [] and fmt.read_index(str(dump)) == []
    snap = idle(sess)
    assert snap["failures"] == 1 and snap["files_written"] == 0
    assert torch.equal(torch.tensor(0), torch.tensor(len(leftovers(dump))))


# ---- found by review ---------------------------------------------------------------------
def test_a_refused_message_leaves_no_temporary_file_of_its_requests(dump, monkeypatch, sessions):
    """A request whose first chunk reached the writer and whose second chunk's message is
    refused (``ETOOMANYREFS``, as the kernel answers a process over its descriptor limit):
    the request fails, and the writer drops the temporary file the first chunk opened."""
    import errno

    from sglang_ext import wire

    sess = sessions.start(make_runner(dump, layers="2,4"))
    writer = sess.writer
    pid = writer.pid
    req = Req("split", 8, 1)
    run_extend(sess, [(req, 0, 4)], IDS)
    real_send = wire.send

    def send(sock, blob, fds=()):
        if fds:
            raise OSError(errno.ETOOMANYREFS, "Too many references")
        return real_send(sock, blob, fds)

    monkeypatch.setattr(wire, "send", send)
    run_extend(sess, [(req, 4, 8)], IDS)
    monkeypatch.setattr(wire, "send", real_send)
    assert "refused" in finish(req)["hidden_states_error"]
    writer.flush()  # the next batch carries the writer's ABANDON
    snap = idle(sess)
    assert writer.pid == pid and snap["writer_restarts"] == 0 and snap["host_bytes_in_use"] == 0
    assert wait_for(lambda: leftovers(dump) == []), leftovers(dump)


def test_an_index_line_that_is_not_an_object_does_not_stop_the_scheduler(dump, monkeypatch, tmp_path, sessions):
    """The writer dies between a file's rename and its lock's release while index.jsonl
    holds a line that is not a JSON object: settling the orphan logs, it never raises into
    the scheduler; the file counts as written and the next request is served."""
    # once: the writer started in its place may start before PYTHONPATH is restored below
    inject_writer(monkeypatch, tmp_path, f"""
        import os, signal
        from sglang_ext import format as fmt
        _real = fmt.complete
        def complete(*a):
            if os.path.exists({str(tmp_path / "killed")!r}):
                return _real(*a)
            open({str(tmp_path / "killed")!r}, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        fmt.complete = complete
    """)
    (dump / fmt.INDEX_NAME).write_text("5\n")
    sess = sessions.start(make_runner(dump, layers="2,4"))
    req = Req("orphan", 4, 1)
    run_extend(sess, [(req, 0, 4)], IDS)
    assert assert_complete_or_error(req, finish(req), dump)
    monkeypatch.delenv("PYTHONPATH")  # the next writer is a healthy one
    after = Req("after", 4, 2)
    run_extend(sess, [(after, 0, 4)], IDS)
    assert assert_complete_or_error(after, finish(after), dump)


def test_a_dying_writer_not_yet_reaped_is_replaced_before_the_next_batch(dump, monkeypatch, tmp_path, sessions):
    """A writer process that has given up its end of the socket (and its locks) but is not
    yet reaped, as any dying process is for a moment: the next batch sees the closed
    socket, starts a new writer and is written by it; nothing is sent into the closed one
    (which failed that batch's requests). Here the old writer lingers 1.5 s that way."""
    closed = tmp_path / "closed"
    inject_writer(monkeypatch, tmp_path, f"""
        import os, stat, threading, time
        from sglang_ext import format as fmt, wire
        _complete, _recv = fmt.complete, wire.recv_ops
        def recv_ops(*a, **k):  # once the socket is gone, the main loop lingers
            if os.path.exists({str(closed)!r}):
                time.sleep(1.5)
            return _recv(*a, **k)
        def close_socket():
            time.sleep(0.2)  # the file's acknowledgement goes out first
            null = os.open(os.devnull, os.O_RDONLY)
            for name in os.listdir("/proc/self/fd"):
                try:
                    if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                        os.dup2(null, int(name))  # our end closes; the descriptor stays
                except OSError:
                    pass
            open({str(closed)!r}, "w").close()
        def complete(*a):
            _complete(*a)
            if not os.path.exists({str(tmp_path / "once")!r}):
                open({str(tmp_path / "once")!r}, "w").close()
                threading.Thread(target=close_socket, daemon=True).start()
        fmt.complete = complete
        wire.recv_ops = recv_ops
    """)
    sess = sessions.start(make_runner(dump, layers="2,4"))
    writer = sess.writer
    pid = writer.pid
    first = Req("first", 4, 1)
    run_extend(sess, [(first, 0, 4)], IDS)
    assert assert_complete_or_error(first, finish(first), dump)
    assert wait_for(closed.exists)
    after = Req("after", 4, 2)
    run_extend(sess, [(after, 0, 4)], IDS)
    assert assert_complete_or_error(after, finish(after), dump)
    snap = idle(sess)
    assert writer.pid != pid and snap["writer_restarts"] == 1 and snap["failures"] == 0, snap


def test_a_writer_killed_while_the_scheduler_is_idle_answers_its_waiters_with_the_reason(dump, monkeypatch, tmp_path, sessions):
    """SIGKILL to the writer while a response waits and no batch follows: the watchdog
    thread settles the file (``.error`` with the reason, the lock removed), so the waiting
    response says why instead of "missing"; the next batch then starts a new writer."""
    import signal as sig

    monkeypatch.setenv("KIMI_SGLANG_WATCHDOG_S", "1")
    slow_writes(monkeypatch, tmp_path, 1.0)
    sess = sessions.start(make_runner(dump, layers="2,4"))
    writer = sess.writer
    req = Req("killed", 4, 1)
    run_extend(sess, [(req, 0, 4)], IDS)
    os.kill(writer.pid, sig.SIGKILL)
    meta = finish(req, timeout=20)
    assert "writer process died" in meta.get("hidden_states_error", ""), meta
    # the .error comes first, then the lock goes (format.fail): the waiter may be between
    assert wait_for(lambda: not (dump / f"{fmt.safe_stem('killed')}{fmt.SUFFIX}{fmt.LOCK_SUFFIX}").exists())
    after = Req("after", 4, 2)
    run_extend(sess, [(after, 0, 4)], IDS)
    assert assert_complete_or_error(after, finish(after), dump)
    snap = idle(sess)
    assert snap["failures"] == 1 and snap["writer_restarts"] == 1
