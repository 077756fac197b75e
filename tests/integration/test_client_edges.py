"""extract and convert at the edges: a hostile server, hostile neighbours in the dump and
output directories (symlinks, FIFOs, names that are not the server's), a wrong endpoint,
and the mode of what extract creates.

The server is tests/integration/test_cli.py's stand-in for the patched SGLang's ``/generate`` (files
written by hand under ``format.safe_stem(rid)``), here told to answer other paths. Every
command runs in a subprocess with a timeout, so a regression that blocks on a FIFO fails
instead of hanging the suite. Nothing here mocks the file system: real symlinks, real
FIFOs (``os.mkfifo``), real sockets.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_cli import REPO, Server, cli, extract_args, reference_bf16, rows, write_file, write_jsonl

from sglang_ext import format as fmt
from sglang_ext.client.pending import PendingFiles, journal_path


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path / "dump")
    yield s
    s.close()


def user_file(tmp_path, name="thesis.safetensors"):
    """A file of the user's, outside any dump directory, a valid dump file of row 0 (so a
    client that checked it would even accept it)."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    path = home / name
    write_file(str(path), rows(1)[0])
    return path, path.read_bytes()


def result_is_regular_and_right(out, i, ids):
    st = os.lstat(out / f"hs_{i}.safetensors")
    assert stat.S_ISREG(st.st_mode), f"hs_{i} is not a regular file: {stat.filemode(st.st_mode)}"
    raw = (out / f"hs_{i}.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert raw[8 + n:8 + n + len(reference_bf16(ids))] == reference_bf16(ids)


# ---- item 4: extract moves and deletes only the server's own files --------------------------
@pytest.mark.parametrize("dump_dir_flag", [True, False])
def test_an_answer_naming_a_file_outside_the_dump_dir_stops_the_run(server, tmp_path, dump_dir_flag):
    """Every answer names the user's file (its own file is written, then another path is
    answered). With --dump-dir the path is outside it: the run stops (exit 3), naming the
    directory (a server's directory left out of --dump-dir fails every answer alike);
    without, the name is not the server's name for the request, which no retry changes:
    the run stops (exit 3) before the user's folder is taken for a dump directory. Either
    way the user's file is neither moved nor deleted."""
    victim, before = user_file(tmp_path)
    server.answer_path = lambda n, path: str(victim)
    extra = ["--dump-dir", server.dump_dir] if dump_dir_flag else []
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", rows(2)), tmp_path / "out",
                          "--max-retries", 1, *extra), timeout=60)
    assert r.returncode == 3, r.stderr
    assert victim.read_bytes() == before
    assert not list((tmp_path / "out").glob("hs_*"))
    reason = ("which no --dump-dir names" if dump_dir_flag
              else "is not the server's name for request")
    assert reason in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_symlink_named_by_the_server_is_never_followed_nor_kept(server, tmp_path):
    """The server's file is a symlink (under the server's own name) to the user's file:
    the row fails, the user's file stays, OUT holds no symlink (items 4 and 5)."""
    victim, before = user_file(tmp_path)

    def link(n, path):
        os.unlink(path)
        os.symlink(victim, path)
        return path

    server.answer_path = link
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", rows(1)), tmp_path / "out",
                          "--max-retries", 0), timeout=60)
    assert r.returncode == 1, r.stderr
    assert victim.read_bytes() == before
    assert "is not a regular file" in r.stderr, r.stderr
    out = tmp_path / "out"  # the run left it empty: removed (issue 51)
    assert not out.exists() or not [n for n in os.listdir(out) if os.path.islink(out / n)]
    assert not list(out.glob("hs_*"))


def test_a_fifo_named_by_the_server_fails_the_row_without_hanging(server, tmp_path):
    def fifo(n, path):
        os.unlink(path)
        os.mkfifo(path)
        return path

    server.answer_path = fifo
    t0 = time.monotonic()
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", rows(1)), tmp_path / "out",
                          "--max-retries", 0), timeout=60)
    assert r.returncode == 1, r.stderr
    assert "is not a regular file" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 30


def test_another_file_in_the_dump_dir_is_not_taken(server, tmp_path):
    """The answer names a file in the dump directory that is not the request's (another
    client's): it stays where it is, and the run stops at once (exit 3), without retries:
    a server that names files otherwise would fail every request alike (a new user's
    review saw 6 tries per row and 232 files left behind for 40 rows)."""
    other = os.path.join(server.dump_dir, "someone-else.safetensors")
    write_file(other, rows(1)[0])
    server.answer_path = lambda n, path: other
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", rows(3)), tmp_path / "out",
                          "--max-retries", 5, "--concurrency", 1, "--dump-dir", server.dump_dir),
            timeout=60)
    assert r.returncode == 3, r.stderr
    assert os.path.isfile(other)
    assert "is not the server's name for request" in r.stderr, r.stderr
    assert "retrying" not in r.stderr, r.stderr


def test_a_journal_naming_a_users_file_does_not_delete_it(tmp_path):
    """A journal as a killed older client left it, naming (for an unsettled request) a
    user's file outside the dump directory and a symlink in it: the next start-up sweep
    deletes neither the file nor what the link points to."""
    victim, before = user_file(tmp_path)
    dump = tmp_path / "dump"
    dump.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    rid_a, rid_b = "extract-0-0-0123abcd", "extract-1-0-4567cdef"
    link = dump / (fmt.safe_stem(rid_b) + fmt.SUFFIX)
    os.symlink(victim, link)
    with open(journal_path(str(out), 0), "w") as f:
        for rec in ({"dir": str(dump)}, {"rid": rid_a}, {"rid": rid_a, "path": str(victim)},
                    {"rid": rid_b}):
            f.write(json.dumps(rec) + "\n")
    p = PendingFiles(str(out), 0)
    p.sweep(forget_unanswered=True)
    assert victim.read_bytes() == before
    assert p.rids == {}  # nothing left to retry forever


def test_a_good_run_with_dump_dir_takes_every_file(server, tmp_path):
    data = rows(5)
    out = tmp_path / "out"
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", data), out,
                          "--dump-dir", server.dump_dir, "--concurrency", 2), timeout=60)
    assert r.returncode == 0, r.stderr
    for i, ids in enumerate(data):
        result_is_regular_and_right(out, i, ids)
    assert os.listdir(server.dump_dir) == []


def test_a_dump_dir_that_does_not_exist_is_one_sentence(server, tmp_path):
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", rows(1)), tmp_path / "out",
                          "--dump-dir", tmp_path / "nope"), timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: --dump-dir {tmp_path / 'nope'} is not a directory (pass the server's "
        f"--dump-hidden-states-dir as this machine sees it)"]
    assert server.requests == 0


# ---- item 12: a FIFO in OUT neither hangs extract nor convert ---------------------------------
def test_a_fifo_at_a_result_name_is_re_extracted_without_hanging(server, tmp_path):
    data = rows(3)
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "hs_1.safetensors")
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", data), out), timeout=60)
    assert r.returncode == 0, r.stderr
    assert "re-extracting hs_1.safetensors: it is not a regular file" in r.stderr, r.stderr
    for i, ids in enumerate(data):
        result_is_regular_and_right(out, i, ids)


def test_a_symlink_at_a_result_name_is_replaced_by_a_regular_file(server, tmp_path):
    data = rows(1)
    victim, before = user_file(tmp_path)  # a valid file for row 0
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(victim, out / "hs_0.safetensors")
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", data), out), timeout=60)
    assert r.returncode == 0, r.stderr
    result_is_regular_and_right(out, 0, data[0])
    assert victim.read_bytes() == before


@pytest.mark.parametrize("with_masks", [False, True])
def test_convert_names_a_fifo_in_src_in_one_sentence_without_hanging(tmp_path, with_masks):
    src = tmp_path / "src"
    src.mkdir()
    write_file(str(src / "hs_0.safetensors"), [1, 2, 3])
    os.mkfifo(src / "hs_1.safetensors")
    extra = []
    if with_masks:  # the headers are read before any record is written
        extra = ["--loss-mask-from", write_jsonl(tmp_path / "d.jsonl", [[1, 2, 3]] * 2,
                                                 masks=[[0, 1, 1]] * 2)]
    r = cli("convert", "--to", "specforge", src, tmp_path / "dst", "--no-final-norm", *extra,
            timeout=60)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: {src / 'hs_1.safetensors'} is not a regular file (a FIFO); remove it and run "
        f"extract again with the same --out to replace it")


# ---- item 13: a wrong endpoint is named at once ----------------------------------------------
def test_a_closed_port_is_one_line_at_once(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    r = cli("extract", "--endpoint", url, "--data", write_jsonl(tmp_path / "d.jsonl", rows(3)),
            "--out", tmp_path / "out", "--no-progress", timeout=60)
    assert r.returncode == 3, r.stderr
    assert time.monotonic() - t0 < 10
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: cannot reach {url}: is the server up? ("), r.stderr
    assert not (tmp_path / "out").exists()


class _Html501(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass


def test_an_http_server_that_is_not_sglang_is_one_line_at_once(tmp_path):
    """http.server answers every GET and POST with HTTP 501 and an HTML page."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Html501)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        t0 = time.monotonic()
        r = cli("extract", "--endpoint", url, "--data", write_jsonl(tmp_path / "d.jsonl", rows(3)),
                "--out", tmp_path / "out", "--no-progress", timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert r.returncode == 3, r.stderr
    assert elapsed < 10
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: {url} is not an SGLang server: GET {url}/health answered "
                               f"HTTP 501 (<!DOCTYPE HTML"), r.stderr
    # the page is quoted as a brief of 200 characters (+ "..."), the rest is the sentence
    assert "</html>" not in r.stderr and len(lines[0]) < 203 + 2 * len(url) + 150


# ---- item 6: extract's outputs are not world-readable -----------------------------------------
def _modes(out):
    return {n: stat.S_IMODE(os.lstat(out / n).st_mode) for n in os.listdir(out)}


def test_outputs_are_0600_by_default_and_follow_kimi_sglang_file_mode(server, tmp_path):
    data = rows(2)
    path = write_jsonl(tmp_path / "d.jsonl", data)
    old = os.umask(0o022)
    try:
        r = cli(*extract_args(server, path, tmp_path / "out"), timeout=60)
        assert r.returncode == 0, r.stderr
        assert _modes(tmp_path / "out") == {"hs_0.safetensors": 0o600, "hs_1.safetensors": 0o600,
                                            "manifest.jsonl": 0o600}
        assert stat.S_IMODE(os.stat(tmp_path / "out").st_mode) == 0o700  # was 0755
        r = cli(*extract_args(server, path, tmp_path / "out2"), timeout=60,
                env=dict(KIMI_SGLANG_FILE_MODE="0640"))
        assert r.returncode == 0, r.stderr
        assert set(_modes(tmp_path / "out2").values()) == {0o640}
        assert stat.S_IMODE(os.stat(tmp_path / "out2").st_mode) == 0o750
        os.umask(0o027)  # the umask still applies to the mode asked for
        r = cli(*extract_args(server, path, tmp_path / "out3"), timeout=60,
                env=dict(KIMI_SGLANG_FILE_MODE="0666"))
        assert r.returncode == 0, r.stderr
        assert set(_modes(tmp_path / "out3").values()) == {0o640}
    finally:
        os.umask(old)


@pytest.mark.parametrize("value", ["0999", "rw-r-----", "01777", "0400"])
def test_an_invalid_file_mode_is_one_sentence(server, tmp_path, value):
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", rows(1)), tmp_path / "out"),
            timeout=60, env=dict(KIMI_SGLANG_FILE_MODE=value))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: KIMI_SGLANG_FILE_MODE must be an octal file mode of 3 or 4 digits that includes owner "
        f"read and write (0600) and nothing beyond 0777, such as 0600 or 0640; got {value!r}"]
    assert server.requests == 0


def test_the_journal_and_copies_across_filesystems_get_the_mode(tmp_path):
    """The journal is created with the mode it is given (umask applied)."""
    old = os.umask(0o022)
    try:
        p = PendingFiles(str(tmp_path), 0, mode=0o640)
        p.sent("r")
        assert stat.S_IMODE(os.stat(journal_path(str(tmp_path), 0)).st_mode) == 0o640
        p.named("r", str(tmp_path / (fmt.safe_stem("r") + fmt.SUFFIX)))
        p._rewrite()
        assert stat.S_IMODE(os.stat(journal_path(str(tmp_path), 0)).st_mode) == 0o640
    finally:
        os.umask(old)


@pytest.mark.parametrize("forged", ["others may write it", "another user's"])
def test_a_pending_journal_not_ours_alone_is_refused(server, tmp_path, forged):
    """``OUT/.extract-pending-rank0.jsonl`` names server files the run removes: a journal
    group or others may write, or another user's, is not read (one sentence, exit 2,
    nothing sent, the file it names untouched), as the store journal is. Before: read, and
    the file it named under a server's name for a rid in a directory it named was removed.
    A journal made with a group-writable file mode is created without group write, so the
    next run reads it."""
    dump = tmp_path / "elsewhere"
    dump.mkdir()
    victim = dump / (fmt.safe_stem("extract-0-0-0123abcd") + fmt.SUFFIX)
    victim.write_bytes(b"someone's file")
    out = tmp_path / "out"
    out.mkdir()
    journal = journal_path(str(out), 0)
    with open(journal, "w") as f:
        for rec in ({"dir": str(dump)}, {"rid": "extract-0-0-0123abcd", "path": str(victim)}):
            f.write(json.dumps(rec) + "\n")
    if forged == "others may write it":
        os.chmod(journal, 0o602)
        why = "is writable by group or others (mode 602)"
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(journal, 65534, 65534)
        why = "belongs to another user (uid 65534)"
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", rows(1)), out), timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: the pending-files journal {journal} {why}: it names server files this run would "
        f"remove, so it is not read; remove it (or fix its owner and mode) if it is this user's"]
    assert victim.read_bytes() == b"someone's file" and server.requests == 0
    os.unlink(journal)
    PendingFiles(str(out), 0, mode=0o660).sent("r")
    assert stat.S_IMODE(os.stat(journal).st_mode) & 0o022 == 0
    assert PendingFiles(str(out), 0).rids == {"r": None}


def test_help_names_the_new_guarantees():
    text = " ".join(cli("extract", "--help").stdout.split())
    for words in ("--dump-dir", "only regular files", "KIMI_SGLANG_FILE_MODE", "GET /health"):
        assert words in text, words


# ---- found by review: the journal and linked files -------------------------------------------
def test_a_fifo_at_the_journal_is_one_sentence_without_hanging(server, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(journal_path(str(out), 0))
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", rows(1)), out), timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: --out {out}: cannot write there ({journal_path(str(out), 0)} is a FIFO, not a regular file)"]


def test_a_server_file_linked_elsewhere_is_copied_and_the_link_left_alone(server, tmp_path):
    """The server's file also has a hard link outside the dump directory (a neighbour who
    can rewrite it later, or a chmod that would reach it): the result is a copy of our own
    (one link, our user, our mode) and the linked file keeps its mode and bytes."""
    data = rows(1)
    home = tmp_path / "home"
    home.mkdir()
    linked = home / "neighbour.safetensors"

    def answer(n, path):
        os.link(path, linked)
        os.chmod(linked, 0o666)
        return path

    server.answer_path = answer
    out = tmp_path / "out"
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", data), out), timeout=60)
    assert r.returncode == 0, r.stderr
    result_is_regular_and_right(out, 0, data[0])
    st = os.lstat(out / "hs_0.safetensors")
    assert st.st_nlink == 1 and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600 & ~_umask()
    assert stat.S_IMODE(os.lstat(linked).st_mode) == 0o666 and os.lstat(linked).st_nlink == 1


def _umask():
    m = os.umask(0)
    os.umask(m)
    return m


# ---- files.Staged: the one temporary-name-then-rename of extract, convert and the journal -----
def test_staged_failure_removes_every_temporary_name_and_keeps_the_final(tmp_path):
    from sglang_ext.client.files import Staged

    (tmp_path / "hs_1.safetensors").write_bytes(b"old")
    (tmp_path / "elsewhere").write_bytes(b"not ours")
    with pytest.raises(RuntimeError, match="check failed"):
        with Staged(str(tmp_path), "hs_1.safetensors") as staged:
            tmp, fd = staged.create(0o600)
            os.write(fd, b"partial")
            os.close(fd)
            swapped = staged.name()  # a symlink swapped in at a temporary name: the entry goes
            os.symlink(tmp_path / "elsewhere", tmp_path / swapped)
            raise RuntimeError("check failed")
    assert sorted(os.listdir(tmp_path)) == ["elsewhere", "hs_1.safetensors"]
    assert (tmp_path / "hs_1.safetensors").read_bytes() == b"old"
    assert (tmp_path / "elsewhere").read_bytes() == b"not ours"


def test_staged_fixed_name_replaces_a_leftover_and_publishes(tmp_path):
    from sglang_ext.client.files import Staged

    (tmp_path / "elsewhere").write_bytes(b"not ours")
    os.symlink(tmp_path / "elsewhere", tmp_path / ".data_0.ckpt.tmp")  # a killed run's leftover
    with Staged(str(tmp_path), "data_0.ckpt", unique=False) as staged:
        tmp, fd = staged.create(0o600)
        assert tmp == ".data_0.ckpt.tmp"
        os.write(fd, b"record")
        os.close(fd)
        staged.publish(tmp)
    assert sorted(os.listdir(tmp_path)) == ["data_0.ckpt", "elsewhere"]
    assert (tmp_path / "data_0.ckpt").read_bytes() == b"record"
    assert (tmp_path / "elsewhere").read_bytes() == b"not ours"
    assert stat.S_IMODE(os.lstat(tmp_path / "data_0.ckpt").st_mode) == 0o600 & ~_umask()


# ---- issue 50 item 1: extract bounds what it reads from a server --------------------------------
def _endless(handler, *_):
    """HTTP 200 and a JSON body that never ends (no Content-Length: closed-delimited),
    as fast as the socket takes it, until the client goes away."""
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.end_headers()
    chunk = b" " * (1 << 16)
    try:
        handler.wfile.write(b'{"meta_info": {"x": "')
        for _ in range(1 << 16):  # 4 GiB at most, then the test's server gives up
            handler.wfile.write(chunk)
    except OSError:
        pass


def _trickle(handler, *_):
    """HTTP 200 announcing 100000 bytes, then one byte a second (for at most 120 s)."""
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", "100000")
    handler.end_headers()
    try:
        for _ in range(120):
            handler.wfile.write(b" ")
            handler.wfile.flush()
            time.sleep(1)
    except OSError:
        pass


def _nested(handler, *_):
    """HTTP 200 and valid JSON nested 100000 levels deep."""
    data = b"[" * 100_000 + b"]" * 100_000
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    try:
        handler.wfile.write(data)
    except OSError:
        pass


def _at_most_4_gib():
    """preexec_fn: the client's address space capped, so that a regression that reads an
    endless answer fails fast with MemoryError instead of filling this machine."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def _no_traceback(r):
    assert "Traceback" not in r.stderr and "RecursionError" not in r.stderr, r.stderr


def test_an_endless_answer_to_generate_fails_its_row_at_the_answer_bound(server, tmp_path):
    server.raw_post = _endless
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", rows(1)), tmp_path / "out",
                          "--max-retries", 0, "--dump-dir", server.dump_dir),
            timeout=120, preexec_fn=_at_most_4_gib)
    _no_traceback(r)
    assert r.returncode == 1, r.stderr
    assert (f"the answer to POST {server.url}/generate is over 16 MiB (extract reads at most "
            f"16 MiB of an answer)") in r.stderr, r.stderr


def test_an_endless_server_info_is_left_at_the_answer_bound_and_the_run_goes_on(server, tmp_path):
    """/server_info is only a hint (the dump directory before any answer): past the bound it
    is a note, and the rows are extracted as usual."""
    server.raw_get["/server_info"] = _endless
    data = rows(2)
    out = tmp_path / "out"
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", data), out),
            timeout=120, preexec_fn=_at_most_4_gib)
    _no_traceback(r)
    assert r.returncode == 0, r.stderr
    assert (f"note: the answer to GET {server.url}/server_info is over 16 MiB (extract reads at "
            f"most 16 MiB of an answer): its dump directory is not taken from it") in r.stderr, r.stderr
    for i, ids in enumerate(data):
        result_is_regular_and_right(out, i, ids)


def test_a_deeply_nested_server_info_is_one_note_and_the_run_goes_on(server, tmp_path):
    server.raw_get["/server_info"] = _nested
    data = rows(2)
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", data), tmp_path / "out"),
            timeout=120)
    _no_traceback(r)
    assert r.returncode == 0, r.stderr
    assert (f"note: the answer to GET {server.url}/server_info is JSON nested deeper than "
            f"Python's parser takes") in r.stderr, r.stderr


def test_a_deeply_nested_answer_to_generate_is_one_sentence(server, tmp_path):
    server.raw_post = _nested
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", rows(1)), tmp_path / "out",
                          "--max-retries", 0, "--dump-dir", server.dump_dir), timeout=120)
    _no_traceback(r)
    assert r.returncode == 1, r.stderr
    assert (f"the answer to POST {server.url}/generate is JSON nested deeper than Python's "
            f"parser takes") in r.stderr, r.stderr


def test_timeout_covers_an_answer_that_trickles(server, tmp_path):
    """A byte a second forever: --timeout 3 ends the try (the test's own limit is 60 s, the
    server would go on for 120)."""
    server.raw_post = _trickle
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", rows(1)), tmp_path / "out",
                          "--max-retries", 0, "--timeout", 3, "--dump-dir", server.dump_dir),
            timeout=60)
    _no_traceback(r)
    assert r.returncode == 1, r.stderr
    assert "no answer within 3 s (--timeout)" in r.stderr, r.stderr


def test_timeout_covers_a_server_info_that_trickles(server, tmp_path):
    server.raw_get["/server_info"] = _trickle
    data = rows(1)
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", data), tmp_path / "out",
                          "--timeout", 3), timeout=60)
    _no_traceback(r)
    assert r.returncode == 0, r.stderr
    result_is_regular_and_right(tmp_path / "out", 0, data[0])


# ---- a server of another user: its files cannot be taken -----------------------------------
@pytest.mark.parametrize("dir_mode", [0o700, 0o755], ids=["unreadable", "read-only"])
def test_a_dump_dir_this_user_may_not_change_stops_the_run_at_the_first_try(server, tmp_path, dir_mode):
    """The server runs as another user (uid 12345 owns its dump directory; a container's
    root for a user on the host): extract, here root without the capabilities that
    override file permissions, may not open or change that directory. Before, every row
    was tried 6 times and failed (exit 1, after minutes with the default backoff); now the
    first refused try stops the run in one sentence, and the server's files stay."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root (chown to another user) and util-linux's setpriv")
    os.chown(server.dump_dir, 12345, 12345)
    os.chmod(server.dump_dir, dir_mode)
    data = write_jsonl(tmp_path / "d.jsonl", rows(2))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", sys.executable,
                        "-m", "sglang_ext", *extract_args(server, data, tmp_path / "out")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Permission denied" in errors[0], r.stderr
    assert "run it as the user the server runs as" in errors[0], r.stderr
    assert "retrying" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not list((tmp_path / "out").glob("hs_*")), "a sample was taken"
    assert 1 <= server.requests <= 2, server.requests  # no row sent twice
    left = [n for n in os.listdir(server.dump_dir) if n.endswith(fmt.SUFFIX)]
    assert len(left) == server.requests, f"a server file was removed or lost: {left}"


# ---- issue 50 item 3: OUT fills up ------------------------------------------------------------
def small_fs_fixture(size: str):
    """A fixture: a real tmpfs of ``size`` (``mount -t tmpfs -o size=...``, as root) at
    tmp_path/fs, unmounted after."""
    @pytest.fixture
    def small_fs(tmp_path):
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        mnt = tmp_path / "fs"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
        assert r.returncode == 0, f"mount -t tmpfs failed: {r.stderr}"
        try:
            yield mnt
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
    return small_fs


small_fs = small_fs_fixture("1m")


def _fill(fs):
    """Write fs/filler until the filesystem refuses (ENOSPC): no page is left."""
    with open(fs / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e


def _renaming_server(server, fs, ids, n):
    """``server`` answers each /generate by renaming one of ``n`` files made beforehand (in
    fs/stage, for ``ids``) to the request's name in its dump directory (fs/dump): a rename
    needs no free space, so the file reaches OUT (same filesystem) on a full disk. Before
    its first answer it fills fs (``_fill``): the client's journal has its page by then."""
    stage = fs / "stage"
    stage.mkdir()
    for k in range(n):
        write_file(str(stage / f"{k}{fmt.SUFFIX}"), ids)
    count = []

    def answer(handler, body):
        if not count:
            _fill(fs)
        count.append(1)
        path = os.path.join(server.dump_dir, fmt.safe_stem(body["rid"]) + fmt.SUFFIX)
        os.rename(stage / f"{len(count) - 1}{fmt.SUFFIX}", path)
        data = json.dumps({"text": "x", "meta_info": {"hidden_states_path": path}}).encode()
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    server.raw_post = answer


@pytest.mark.parametrize("workers", [("--concurrency", 1, "--no-early-answers"),
                                     ("--concurrency", 8)], ids=["1-worker", "16-workers"])
@pytest.mark.parametrize("manifest_before", [0, 4086])
def test_a_full_out_fails_the_row_naming_the_manifest_and_stops_the_run(tmp_path, small_fs,
                                                                        manifest_before, workers):
    """OUT and the dump directory on one real 1 MiB tmpfs, filled up at the first answer.
    The manifest's ENOSPC escaped the worker: with one (--concurrency 1 --no-early-answers)
    the run hung, with 16 it was a traceback. With a manifest of 4086 bytes (10 short of
    its page) the append was a short write: a torn line, which the next line was glued
    onto. Now the row fails naming the manifest, the run stops (exit 3) with a sentence,
    the manifest holds whole lines only, and once there is room again the next run records
    every sample."""
    ids = [1, 2, 3]
    server = Server(small_fs / "dump")
    out = small_fs / "out"
    out.mkdir()
    manifest = out / "manifest.jsonl"
    before = b""
    if manifest_before:  # an earlier run's line for another row, padded to 4086 bytes
        head = b'{"index":999,"num_tokens":3,"file":"hs_999.safetensors","pad":"'
        before = head + b"x" * (manifest_before - len(head) - 3) + b'"}\n'
        manifest.write_bytes(before)
        assert len(before) == manifest_before
    try:
        _renaming_server(server, small_fs, ids, 3)
        data = write_jsonl(tmp_path / "d.jsonl", [ids] * 3)
        args = extract_args(server, data, out, *workers, "--max-retries", 0)
        r = cli(*args, timeout=120)
        _no_traceback(r)
        assert r.returncode == 3, r.stderr
        row = re.search(r"row (\d) \(line \d of d.jsonl\): cannot append its line to (\S+) "
                        r"\(No space left on device\); hs_(\d).safetensors is kept for the next "
                        r"run", r.stderr)
        assert row and row[2] == str(manifest) and row[1] == row[3], r.stderr
        assert r.stderr.count(f"error: {manifest}: No space left on device: no sample can be "
                              f"written; free space there (or fix the directory) and run the "
                              f"same command again to resume") == 1, r.stderr
        assert (manifest.read_bytes() if manifest.exists() else b"") == before
        taken = sorted(p.name for p in out.glob("hs_*"))
        assert f"hs_{row[1]}.safetensors" in taken, taken
        os.unlink(small_fs / "filler")
        server.raw_post = None
        r = cli(*args, timeout=120)
        assert r.returncode == 0, r.stderr
        lines = [json.loads(line) for line in manifest.read_bytes()[len(before):].splitlines()]
        assert sorted(rec["index"] for rec in lines) == [0, 1, 2], lines
    finally:
        server.close()


# ---- issue 50 item 9: a file of any size or shape is not taken ---------------------------------
def _declaring(path, ids, tensors):
    """A safetensors file holding ``token_ids`` ``ids`` (I64, first) and declaring
    ``tensors`` ({name: (dtype, shape, nbytes)}) after them, their data left sparse
    (``truncate``): valid for the safetensors library, of any size."""
    header = {"token_ids": {"dtype": "I64", "shape": [len(ids)], "data_offsets": [0, 8 * len(ids)]}}
    pos = 8 * len(ids)
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(i.to_bytes(8, "little") for i in ids))
        f.truncate(8 + len(text) + pos)


@pytest.mark.parametrize("tensors,bound", [
    ({"hidden_states": ("BF16", [3, 0, 4], 0)},
     "hidden_states shape [3, 0, 4], not [T, L, H] with every dimension >= 1"),
    ({"hidden_states": ("BF16", [3, 1, 268_435_456], 3 << 29)},
     "hidden_states shape [3, 1, 268435456] holds 268435456 values per token, over the 4194304 "
     "(layers x hidden) extract takes"),
    ({"hidden_states": ("BF16", [3, 2, 4], 48), "padding": ("U8", [3 << 29], 3 << 29)},
     # 3 x (2 x 4 x 2 bytes + 4 x 2 + 8) + 1 MiB
     f"bytes, over the {3 * (16 + 8 + 8) + (1 << 20)} that 3 tokens x 2 layers x 4 hidden (BF16) "
     f"take with scales, token ids and a 1 MiB header: not a dump file"),
])
def test_a_file_of_another_size_or_shape_is_refused_before_it_is_taken(server, tmp_path, tensors,
                                                                        bound):
    """The server's file for a 3-token row declares a zero dimension, a row of 2**28 values
    or 1.5 GiB beside its tensors (sparse): the try fails naming the bound, and nothing of
    it reaches OUT (before, a [3, 0, 4] file was kept as hs_0, and a 1.5 GiB one taken)."""
    def answer(n, path):
        _declaring(path, [1, 2, 3], tensors)
        return path

    server.answer_path = answer
    out = tmp_path / "out"
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", [[1, 2, 3]]), out,
                          "--max-retries", 0, "--dump-dir", server.dump_dir), timeout=60)
    _no_traceback(r)
    assert r.returncode == 1, r.stderr
    assert bound in r.stderr, r.stderr
    assert "the server's file " in r.stderr, r.stderr
    assert not out.exists(), os.listdir(out)  # nothing of it reached OUT, left empty: removed


# ---- issue 51: --store against a server that writes files ---------------------------------------
def test_store_against_a_file_sink_server_stops_with_the_mismatch(server, tmp_path, master):
    """A real mooncake_master for --store, a server that answers with hidden_states_path:
    before, the run took the files and said nothing of --store doing nothing; now it stops
    at the first answer (exit 3) naming both sides."""
    from mooncake_fixture import HAVE_MOONCAKE

    assert HAVE_MOONCAKE, "tests/run.sh installs Mooncake (requirements/store.txt)"
    url = f"mooncake://{master.address}?protocol=tcp&local_buffer_size=16MiB&local_hostname=127.0.0.1"
    out = tmp_path / "out"
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", rows(3)), out,
                          "--store", url, "--concurrency", 1), timeout=120)
    assert r.returncode == 3, r.stderr
    assert (f"the server at {server.url} writes files (its answers carry "
            f"meta_info.hidden_states_path, e.g. {server.dump_dir}/") in r.stderr, r.stderr
    assert "not samples into a Mooncake Store: --store has nothing to collect" in r.stderr, r.stderr
    assert not list(out.glob("hs_*"))


def test_an_out_full_before_the_first_request_stops_the_run_naming_the_journal(tmp_path, small_fs):
    """OUT on a real tmpfs filled before the run: the request journal's first line cannot
    be written, so nothing is sent and the run stops at once (exit 3) naming the journal
    (before: every try of every row failed on its own, "[Errno 28] ...", retried, exit 1)."""
    from sglang_ext.client.pending import journal_path

    server = Server(tmp_path / "dump")
    server.server_info = False  # else its dump directory is journaled at start: exit 2 there
    out = small_fs / "out"
    out.mkdir()
    _fill(small_fs)
    try:
        r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", rows(3)), out,
                              "--concurrency", 1, "--max-retries", 2), timeout=120)
    finally:
        server.close()
    _no_traceback(r)
    assert r.returncode == 3, r.stderr
    assert (f"error: row 0 (line 1 of d.jsonl): {journal_path(str(out), 0)}: No space left on "
            f"device: no sample can be written; free space there (or fix the directory) and run "
            f"the same command again to resume") in r.stderr, r.stderr
    assert "retrying" not in r.stderr and server.requests == 0
