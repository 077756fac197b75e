"""The command line and the clients without torch, on every Python the package supports.

tests/run.sh runs this module twice: in the main test venv (Python 3.11) and in a small
Python 3.10 venv holding only requirements/ci-py310.txt (no torch, no SGLang): what a
client machine needs for ``extract`` and ``convert``.

The server here is a stand-in for the patched SGLang's ``/generate``: it writes each
request's file by hand (an 8-byte header length, the JSON header, the bytes) as BF16
``hidden_states [T, 2, 4]`` and I64 ``token_ids [T]``, under the name the real writer
gives it (``format.safe_stem(rid)``), with the ``.lock`` protocol for early answers.
Expected bytes come from ``reference_bf16`` (token id, position, slot, channel), never
from the code under test.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import signal
import struct
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sglang_ext import format as fmt

pytestmark = pytest.mark.py310

REPO = Path(__file__).resolve().parents[2]
SLOTS, HIDDEN = 2, 4


def reference_bf16(ids) -> bytes:
    """BF16 bytes of [T, SLOTS, HIDDEN]: value = id + t/4 + slot*2 + channel/8, each
    exactly representable in bf16 for ids < 64, so truncating float32 is exact."""
    out = bytearray()
    for t, tok in enumerate(ids):
        for s in range(SLOTS):
            for h in range(HIDDEN):
                f32 = struct.pack("<f", tok + t / 4 + s * 2 + h / 8)
                out += f32[2:4]
    return bytes(out)


def write_file(path: str, ids, layer_ids: str = "[2, 4]") -> None:
    hs = reference_bf16(ids)
    header = json.dumps({
        "__metadata__": {"format": fmt.FORMAT_VERSION, "layer_ids": layer_ids, "num_layers": "4"},
        "hidden_states": {"dtype": "BF16", "shape": [len(ids), SLOTS, HIDDEN],
                          "data_offsets": [0, len(hs)]},
        "token_ids": {"dtype": "I64", "shape": [len(ids)],
                      "data_offsets": [len(hs), len(hs) + 8 * len(ids)]},
    }).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + hs + struct.pack(f"<{len(ids)}q", *ids))



class _HealthOnly(BaseHTTPRequestHandler):
    """Answers ``GET /health`` (so extract's probe passes) and nothing else: POST gets
    http.server's HTTP 501 HTML page."""

    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()


class Server:
    """``/generate`` on 127.0.0.1. ``mode``: "dump" (write, then answer the path), "nodump"
    (answer without a path, as an unpatched server does), "hang" (never answer).
    ``write_delay_s``: with an early-answer request, answer at once with the name reserved
    (``.lock`` held) and write that much later (the first ``delay_first`` requests only;
    None: all). The first ``hang_first`` requests get their file written, then no answer.
    ``answer_path``: None, or ``f(request number from 1, path written) -> path answered``
    (a hostile server naming another file). ``GET /health`` answers 200, as SGLang's does;
    ``GET /server_info`` gives ``dump_hidden_states_dir`` among the server's args, as the
    patched SGLang's does (``server_info``: False answers 404, as a router may)."""

    def __init__(self, dump_dir: Path, mode: str = "dump"):
        self.dump_dir = str(dump_dir)
        os.makedirs(self.dump_dir, exist_ok=True)
        self.mode = mode
        self.write_delay_s = 0.0
        self.hang_first = 0
        self.delay_first = None
        self.requests = 0
        self.status = 200
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.answer_path = None
        self.server_info = True
        self.layer_ids = "[2, 4]"  # the files' metadata (another server's configuration)
        self.raw_get = {}  # GET path -> f(handler): a hostile answer written by f itself
        self.raw_post = None  # None, or f(handler, request body): the same for every POST
        server = self

        class Handler(_HealthOnly):
            def do_GET(self):
                if self.path in server.raw_get:
                    return server.raw_get[self.path](self)
                if self.path != "/server_info" or not server.server_info:
                    return super().do_GET()
                data = json.dumps({"dump_hidden_states_dir": server.dump_dir, "tp_size": 1}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if server.raw_post is not None:
                    return server.raw_post(self, body)
                code, obj = server.generate(body)
                if code is None:
                    return
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except OSError:  # the client went away
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def generate(self, body):
        with self.lock:
            self.requests += 1
            n = self.requests
        delayed = self.delay_first is None or n <= self.delay_first
        if self.status != 200:
            return self.status, {"error": {"message": "refused"}}
        if self.mode == "hang":
            self.release.wait(60)
            return None, None
        if self.mode == "nodump":
            return 200, {"text": "x", "meta_info": {"id": body["rid"], "prompt_tokens": 3}}
        ids = body["input_ids"]
        path = os.path.join(self.dump_dir, fmt.safe_stem(body["rid"]) + fmt.SUFFIX)
        if n <= self.hang_first:
            write_file(path, ids)
            self.release.wait(60)
            return None, None
        early = ((body.get("sampling_params") or {}).get("custom_params") or {}).get(fmt.WAIT_PARAM) is False
        if early and delayed and self.write_delay_s:
            fd = os.open(path + fmt.LOCK_SUFFIX, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)

            def later():
                time.sleep(self.write_delay_s)
                write_file(path, ids)
                os.unlink(path + fmt.LOCK_SUFFIX)
                os.close(fd)

            threading.Thread(target=later, daemon=True).start()
            return 200, {"text": "x", "meta_info": {"hidden_states_path": path, fmt.PENDING_KEY: True}}
        write_file(path, ids, self.layer_ids)
        if self.answer_path is not None:
            path = self.answer_path(n, path)
        return 200, {"text": "x", "meta_info": {"hidden_states_path": path}}


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path / "dump")
    yield s
    s.close()


def rows(n):
    """Row i: token ids [i, i+1, ..] of length 2 + i % 3 (all < 64)."""
    return [[i + k for k in range(2 + i % 3)] for i in range(n)]


def write_jsonl(path: Path, data, masks=None, blank_after=None) -> str:
    with open(path, "w") as f:
        for i, ids in enumerate(data):
            row = {"input_ids": ids} if ids is not None else {"text": "no ids"}
            if masks is not None:
                row["loss_mask"] = masks[i]
            f.write(json.dumps(row) + "\n")
            if blank_after == i:
                f.write("\n")
    return str(path)


def cli(*args, timeout=60, env=None, **kw) -> subprocess.CompletedProcess:
    """``python -m sglang_ext ARGS`` from this checkout; ``env``: variables to add."""
    env = dict(os.environ, **(env or {}), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "sglang_ext", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, **kw)


def extract_args(server, data, out, *extra):
    return [str(a) for a in ["extract", "--endpoint", server.url, "--data", data, "--out", out,
                             "--no-progress", "--backoff", "0.01", "--max-backoff", "0.05", *extra]]


def summary(stdout: str) -> dict:
    return json.loads(stdout.split("extract summary: ")[1])


def server_files(server) -> list:
    return sorted(n for n in os.listdir(server.dump_dir))


# ---- the command line -------------------------------------------------------------------------
def test_every_command_answers_help_and_only_its_module_is_imported():
    r = cli("--help")
    assert r.returncode == 0, r.stderr
    for name in ("patches", "extract", "convert", "standin"):
        assert name in r.stdout
    for name in ("extract", "convert", "patches", "standin"):
        r = cli(name, "--help")
        assert r.returncode == 0, (name, r.stderr)
        assert f"usage: sglang-ext {name}" in r.stdout
    code = ("import sys; from sglang_ext.__main__ import main\n"
            "try:\n    main(['extract', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('sglang_ext.') or m in ('tomllib', 'tomli', 'torch')))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
    assert r.returncode == 0, r.stderr
    # the client's own modules and format only: no tooling, no torch, no hooks/writer (progress
    # imports tqdm only when a run starts)
    client = ["checks", "dataset", "dumpdir", "extract", "extract_setup", "files", "generation", "http", "images", "manifest",
              "pending", "progress", "report", "runner"]
    fmt_modules = ["completion", "files", "index", "keys", "layout", "names", "output", "reader", "write"]
    assert r.stdout.split("\n")[-2] == str(["sglang_ext.__main__", "sglang_ext.client",
                                             *(f"sglang_ext.client.{m}" for m in client),
                                             "sglang_ext.format",
                                             *(f"sglang_ext.format.{m}" for m in fmt_modules)])


def test_patches_reads_its_series_on_this_python(tmp_path):
    """`patches` loads base.toml (tomllib, or tomli on 3.10) and its report tooling."""
    report = {"series": "v0.5.17", "target": "/x", "state": "clean", "changed": False, "notes": [],
              "patches": [{"patch": "0001-a.diff", "status": "clean", "failures": [], "offsets": [], "note": ""}]}
    (tmp_path / "r.json").write_text(json.dumps(report))
    r = cli("patches", "summary", tmp_path / "r.json")
    assert r.returncode == 0 and "CLEAN (OK)" in r.stdout, r.stdout + r.stderr
    code = "from sglang_ext.__main__ import _import_command; print(_import_command('patches').__name__)"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
    assert r.stdout.strip() == "sglang_ext.tools.patches", r.stderr


# ---- extract ----------------------------------------------------------------------------------
def test_extract_collects_every_row_without_torch(server, tmp_path):
    data = rows(7)
    out = tmp_path / "out"
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", data), out, "--concurrency", 2))
    assert r.returncode == 0, r.stderr
    s = summary(r.stdout)
    assert (s["extracted"], s["failed"], s["tokens"]) == (7, 0, sum(map(len, data)))
    for i, ids in enumerate(data):
        raw = (out / f"hs_{i}.safetensors").read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        assert header["hidden_states"]["shape"] == [len(ids), SLOTS, HIDDEN]
        body = raw[8 + n:]
        assert body[:len(ids) * SLOTS * HIDDEN * 2] == reference_bf16(ids)
        assert list(struct.unpack(f"<{len(ids)}q", body[-8 * len(ids):])) == ids
    assert server_files(server) == []  # every file was moved out of the dump directory
    assert not list(out.glob(".extract-pending*"))  # nothing pending: no journal left


def test_a_server_that_is_not_dumping_aborts_at_once_with_the_reason_first(tmp_path):
    s = Server(tmp_path / "dump", mode="nodump")
    try:
        t0 = time.monotonic()
        r = cli(*extract_args(s, write_jsonl(tmp_path / "d.jsonl", rows(200)), tmp_path / "out",
                              "--concurrency", 4, "--max-retries", 5))
        elapsed = time.monotonic() - t0
    finally:
        s.close()
    assert r.returncode == 3, r.stderr
    first = r.stderr.strip().splitlines()[0]
    assert first.startswith("error: row ") and "is not dumping hidden states" in first
    assert "--dump-hidden-states-dir" in first
    assert s.requests <= 8  # the requests already in flight (2 workers per slot), no retries
    assert elapsed < 20
    assert "Traceback" not in r.stderr
    assert "aborted" in summary(r.stdout)


def test_a_refused_row_is_not_retried(server, tmp_path):
    server.status = 400
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", rows(2)), tmp_path / "out",
                          "--concurrency", 1, "--max-retries", 5))
    assert r.returncode == 1
    assert server.requests == 2
    assert "row 0 (line 1 of d.jsonl): the server refused the row (HTTP 400)" in r.stderr


def test_endpoint_with_a_path_aborts_at_once(server, tmp_path):
    server.status = 404
    r = cli(*extract_args(server, write_jsonl(tmp_path / "d.jsonl", rows(50)), tmp_path / "out",
                          "--concurrency", 1))
    assert r.returncode == 3
    assert "--endpoint must be the server's base URL" in r.stderr.splitlines()[0]
    assert server.requests <= 2


def test_ctrl_c_ends_with_one_line(tmp_path):
    s = Server(tmp_path / "dump", mode="hang")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    args = extract_args(s, write_jsonl(tmp_path / "d.jsonl", rows(20)), str(tmp_path / "out"),
                        "--concurrency", 2)
    proc = subprocess.Popen([sys.executable, "-m", "sglang_ext", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while s.requests < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.requests >= 2, "the client sent nothing"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        s.close()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "CancelledError" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("extract: interrupted: 0 sample(s) extracted"), err
    assert "run the same command again to resume" in lines[0]


def signal_extract(args, until, sig, timeout=30):
    """``python -m sglang_ext ARGS`` in a process of its own; once ``until()`` holds (at
    most ``timeout`` s), send it ``sig`` and return ``(exit code, stderr)``."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "sglang_ext", *map(str, args)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout
        while not until() and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def test_sigterm_ends_as_ctrl_c_does(server, tmp_path):
    """SIGTERM (a batch scheduler's time limit) mid-run: one line, exit 143, no traceback,
    --out released, and the same command resumes (a new user's review: exit 143 with no
    word and no summary)."""
    server.write_delay_s = 0.3  # answered early, files written later: tries in flight
    path = write_jsonl(tmp_path / "d.jsonl", rows(40))
    out = tmp_path / "out"
    code, err = signal_extract(extract_args(server, path, str(out), "--concurrency", 2),
                               lambda: server.requests >= 4, signal.SIGTERM)
    assert code == 143, err
    assert "Traceback" not in err and "CancelledError" not in err, err
    assert "extract: terminated (SIGTERM): " in err and "run the same command again to resume" in err, err
    server.write_delay_s = 0.0
    r = cli(*extract_args(server, path, out))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.glob("hs_*")) == sorted(f"hs_{i}.safetensors" for i in range(40))
    time.sleep(0.5)  # the last delayed writes of the terminated run land...
    r = cli(*extract_args(server, path, out))  # ...and the next run removes them
    assert r.returncode == 0 and not [n for n in server_files(server) if n.endswith(fmt.SUFFIX)], \
        (r.stderr, server_files(server))


def start_standin(dump, *args):
    """``python -m sglang_ext standin --dump-dir DUMP ARGS`` on a free port: (process, url)."""
    proc = subprocess.Popen([sys.executable, "-m", "sglang_ext", "standin", "--port", "0", "--dump-dir",
                             str(dump), *args], env=dict(os.environ, PYTHONPATH=str(REPO)),
                            stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()
    assert line.startswith("stand-in server"), line + proc.stderr.read()
    return proc, re.search(r"at (http://\S+),", line).group(1)


def test_a_dump_dir_seen_under_another_path_is_taken_from(tmp_path):
    """The server's directory is seen here only under another path: in a private mount
    namespace (``unshare -m``, as root) it is bind-mounted at VIEW and its own path is
    covered by an empty tmpfs (a review's repro). ``--dump-dir VIEW`` takes each answer's
    file there by name, its metadata naming the rid; the old code stopped (exit 3) and
    its advice, ``--dump-dir`` the server's path, then failed every row ("is missing")."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("a private mount namespace needs root and unshare")
    srv, view, out = tmp_path / "srv", tmp_path / "view", tmp_path / "out"
    view.mkdir()
    standin, url = start_standin(srv)
    try:
        data = write_jsonl(tmp_path / "d.jsonl", rows(3))
        script = (f"mount --make-rprivate / && mount --bind {srv} {view} && mount -t tmpfs none {srv} && "
                  f"exec {sys.executable} -m sglang_ext " + " ".join(extract_args(
                      argparse.Namespace(url=url), data, out, "--dump-dir", view)))
        r = subprocess.run(["unshare", "-m", "bash", "-c", script], capture_output=True, text=True,
                           timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
        if r.returncode != 0 and "unshare" in r.stderr and "not permitted" in r.stderr:
            pytest.skip(f"no mount namespace here: {r.stderr.strip()}")
        assert r.returncode == 0, r.stderr
        from safetensors import safe_open

        for i, ids in enumerate(rows(3)):
            with safe_open(str(out / f"hs_{i}.safetensors"), "np") as f:
                assert f.get_tensor(fmt.KEY_TOKEN_IDS).tolist() == ids and f.metadata()["rid"].startswith("extract")
        lines = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
        assert sorted(r["index"] for r in lines) == [0, 1, 2]
        assert all(r["source"].startswith(f"{view}/") for r in lines), lines
        assert [n for n in os.listdir(srv) if n != fmt.INDEX_NAME] == [], os.listdir(srv)
    finally:
        standin.kill()
        standin.wait()


def test_a_file_found_by_name_under_another_path_must_name_the_rid(tmp_path):
    """A file found by name in --dump-dir for an answer naming a directory not seen here
    is taken only when its metadata names the request's rid: here the stand-in's file for
    rid "a" under the name of rid "b" is refused and left where it is."""
    from sglang_ext.client.checks import CheckError
    from sglang_ext.client.dumpdir import DumpDirs, move_into_place

    dump, out = tmp_path / "dump", tmp_path / "out"
    out.mkdir()
    standin, url = start_standin(dump)
    try:
        body = json.dumps({"input_ids": [1, 2, 3], "rid": "a"}).encode()
        req = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as answer:
            path = json.loads(answer.read())["meta_info"][fmt.PATH_KEY]
    finally:
        standin.kill()
        standin.wait()
    name_b = fmt.safe_stem("b") + fmt.SUFFIX
    os.rename(path, dump / name_b)
    dirs = DumpDirs([str(dump)])
    try:
        d, name = dirs.take("b", f"/nowhere-here/{name_b}")
        assert (d.path, name) == (str(dump), name_b)
        with pytest.raises(CheckError, match=r"is not request 'b''s \(its metadata says rid 'a'\)"):
            move_into_place(d, name, str(out), 0, [1, 2, 3], False)
    finally:
        dirs.close()
    assert (dump / name_b).exists() and not list(out.glob("hs_*"))


def test_every_file_an_interrupted_run_put_in_out_has_its_manifest_line(tmp_path):
    """Ctrl-C while samples are being copied into OUT (the stand-in's dump directory on
    another filesystem, /dev/shm, and 24 MiB files: each copy takes a while): every
    hs_<i> in OUT has its manifest line, with its source, when the run exits (a new user's
    review: 2166 files, 2155 lines; the rerun added the rest with "source": null)."""
    dump = tempfile.mkdtemp(dir="/dev/shm", prefix="kimi-sglang-test-")
    standin, url = start_standin(dump, "--hidden-size", "3072")
    try:
        path = write_jsonl(tmp_path / "d.jsonl", [[(i + k) % 1000 for k in range(2000)] for i in range(16)])
        out = tmp_path / "out"

        def copying() -> bool:
            return out.is_dir() and any(n.startswith(".hs_") for n in os.listdir(out))

        code, err = signal_extract(extract_args(argparse.Namespace(url=url), path, str(out), "--concurrency", 4),
                                   copying, signal.SIGINT, timeout=120)
        assert code == 130, err
        files = {int(p.name[3:-len(fmt.SUFFIX)]) for p in out.glob("hs_*")}
        manifest = out / "manifest.jsonl"
        lines = [json.loads(x) for x in manifest.read_text().splitlines()] if manifest.exists() else []
        assert files and sorted(r["index"] for r in lines) == sorted(files), (files, lines, err)
        assert all(r["source"].startswith(os.path.realpath(dump) + "/") and r["num_tokens"] == 2000
                   for r in lines), lines
        assert f"extract: interrupted: {len(files)} sample(s) extracted in this run" in err, err
    finally:
        standin.kill()
        standin.wait()
        shutil.rmtree(dump, ignore_errors=True)


def test_files_of_a_killed_run_are_removed_by_the_next_run(server, tmp_path):
    """A run killed while the server still writes (early answers) or before it answers
    leaves files in the dump directory; the next run removes every one of them."""
    data = rows(6)
    path = write_jsonl(tmp_path / "d.jsonl", data)
    out = tmp_path / "out"
    server.hang_first = 2  # written, never answered
    server.write_delay_s = 1.0  # the others: answered early, written 1 s later
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "sglang_ext", *extract_args(
        server, path, str(out), "--concurrency", 4)], cwd=REPO, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while server.requests < 6 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)  # the client has the early answers
    proc.kill()
    proc.wait(timeout=10)
    time.sleep(1.5)  # the server finishes its writes for the killed client
    left = [n for n in server_files(server) if n.endswith(fmt.SUFFIX)]
    assert len(left) == 6, server_files(server)
    server.write_delay_s = 0.0
    r = cli(*extract_args(server, path, out, "--concurrency", 2))
    assert r.returncode == 0, r.stderr
    assert f"removed {len(left)} file(s) of an earlier run of this command from the server's dump " \
           f"directory" in r.stderr, r.stderr
    assert server_files(server) == []
    assert sorted(p.name for p in out.glob("hs_*")) == sorted(f"hs_{i}.safetensors" for i in range(6))


@pytest.mark.parametrize("server_info", [True, False])
def test_files_of_requests_interrupted_before_any_answer_are_removed(server, tmp_path, server_info):
    """Ctrl-C while every request is still unanswered (their files written), no --dump-dir:
    the client learned the dump directory from the server's /server_info, so the
    interrupted run removes those files (a new user's review saw them stay for good); a
    server that does not say (a router) leaves the run without it: the interrupted run
    and the next one's start say how to have them removed, and the next run removes them
    once its first answer names the directory."""
    server.server_info = server_info
    server.hang_first = 4  # each written, never answered
    path = write_jsonl(tmp_path / "d.jsonl", rows(4))
    out = tmp_path / "out"
    code, err = signal_extract(
        extract_args(server, path, str(out), "--concurrency", 4),
        lambda: len([n for n in server_files(server) if n.endswith(fmt.SUFFIX)]) >= 4, signal.SIGINT)
    assert code == 130, err
    server.hang_first = 0
    r = cli(*extract_args(server, path, out))
    assert r.returncode == 0, r.stderr
    hint = "4 request(s) were sent and never answered, and this run knows no dump directory"
    assert (hint in err) == (hint in r.stderr) == (not server_info), (err, r.stderr)
    said = [line for line in err.splitlines() if "interrupted" in line or "removed" in line]
    assert len(said) == 1 and said[0].startswith("extract: interrupted: 0 sample(s)"), err  # one line
    assert ("; removed 4 file(s) of interrupted tries from the server's dump directory" in said[0]) \
        == server_info, err
    assert server_files(server) == [], (err, r.stderr)
    assert sorted(p.name for p in out.glob("hs_*")) == sorted(f"hs_{i}.safetensors" for i in range(4))


def test_only_an_absolute_directory_from_server_info_is_adopted(tmp_path, monkeypatch):
    """/server_info gives the flag as the server was started: a relative path is the
    server's working directory's, not ours, so it is not taken (a review saw the client's
    own ./dump adopted and the server's files left behind); nor is a store URL, a path
    that is no directory here, or any with --dump-dir given."""
    from sglang_ext.client.dumpdir import DumpDirs

    (tmp_path / "dump").mkdir()
    monkeypatch.chdir(tmp_path)
    dirs = DumpDirs([])
    try:
        assert not dirs.adopt("dump") and not dirs.adopt("mooncake://h:50051")
        assert not dirs.adopt(str(tmp_path / "missing")) and dirs.dirs == []
        assert dirs.adopt(str(tmp_path / "dump")) and [d.path for d in dirs.dirs] == [str(tmp_path / "dump")]
    finally:
        dirs.close()
    fixed = DumpDirs([str(tmp_path / "dump")])
    try:
        other = tmp_path / "other"
        other.mkdir()
        assert not fixed.adopt(str(other)) and len(fixed.dirs) == 1
    finally:
        fixed.close()


def test_answered_requests_without_files_do_not_pile_up_in_the_journal(server, tmp_path):
    """A server that answers every try with an error (HTTP 500) and no word of its dump
    directory: each run journals its tries, and the next forgets them, since the server
    answered (no file can be pending); they are not kept as 'never answered' (a review
    saw the journal grow 8, 16, 24, 32 over four runs)."""
    server.server_info = False
    server.status = 500
    path = write_jsonl(tmp_path / "d.jsonl", rows(3))
    out = tmp_path / "out"
    journal = out / ".extract-pending-rank0.jsonl"

    def journaled():
        recs = [json.loads(x) for x in journal.read_text().splitlines()] if journal.exists() else []
        return {r["rid"] for r in recs if "rid" in r} - {r["done"] for r in recs if "done" in r}

    sizes = []
    for _ in range(3):
        r = cli(*extract_args(server, path, out, "--max-retries", 1))
        assert r.returncode == 1, r.stderr
        assert "never answered" not in r.stderr, r.stderr
        sizes.append(len(journaled()))
    assert sizes == [6, 6, 6], sizes  # 3 rows x 2 tries, each run's own


def test_a_rerun_against_a_server_of_other_layers_stops_instead_of_mixing(server, tmp_path):
    """Resume after the server was restarted with other --dump-hidden-states-layers: the
    first new sample's layout differs from the samples already in --out, and the run
    stops (exit 3) naming both, instead of a dataset of two layouts (a new user's review:
    exit 0, 'resumed': 1, and convert failing later with an unrelated sentence)."""
    path = write_jsonl(tmp_path / "d.jsonl", rows(4))
    out = tmp_path / "out"
    assert cli(*extract_args(server, path, out)).returncode == 0
    for i in (1, 2):
        (out / f"hs_{i}.safetensors").unlink()
    server.layer_ids = "[1, 3]"
    r = cli(*extract_args(server, path, out, "--concurrency", 1, "--no-early-answers"))  # in order
    assert r.returncode == 3, r.stderr
    assert "one dataset of two server configurations" in r.stderr, r.stderr
    assert re.search(r"hs_1\.safetensors holds layers \[1, 3\] x \[2, 4\] BF16, but hs_0\.safetensors "
                     r".* holds \[2, 4\] x \[2, 4\] BF16", r.stderr), r.stderr
    assert '"resumed": 1' in r.stdout and '"extracted": 0' in r.stdout, r.stdout
    assert "(so it was not kept)" in r.stderr and not (out / "hs_1.safetensors").exists()
    server.layer_ids = "[2, 4]"  # the server as it was: the same command completes the set
    r = cli(*extract_args(server, path, out))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.glob("hs_*")) == [f"hs_{i}.safetensors" for i in range(4)]


def test_a_timed_out_try_is_reported_then_removed(server, tmp_path):
    """The first try's file takes 2 s; the try times out after 0.5 s and the retry
    succeeds. The late file is reported as still being written, and the next run removes it."""
    path = write_jsonl(tmp_path / "d.jsonl", rows(1))
    out = tmp_path / "out"
    server.write_delay_s, server.delay_first = 2.0, 1
    r = cli(*extract_args(server, path, out, "--timeout", "0.5", "--max-retries", 1))
    assert r.returncode == 0, r.stderr
    s = summary(r.stdout)
    assert s["extracted"] == 1 and s["retries"] == 1
    assert len(s["server_files_left"]) == 1
    late = s["server_files_left"][0]
    assert "still being written by the server" in r.stderr
    time.sleep(2.0)
    assert os.path.exists(late)
    r = cli(*extract_args(server, path, out))
    assert r.returncode == 0, r.stderr
    assert "removed 1 file(s) of an earlier run of this command from" in r.stderr
    assert not os.path.exists(late) and server_files(server) == []
    assert summary(r.stdout)["resumed"] == 1


def test_a_folder_that_is_not_a_dataset_is_one_sentence(server, tmp_path):
    folder = tmp_path / "notdata"
    folder.mkdir()
    (folder / "x.txt").write_text("hello")
    r = cli(*extract_args(server, folder, tmp_path / "out"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"error: --data {folder} is a directory but not a dataset saved by datasets' save_to_disk "
        f"(no state.json in it); pass a JSONL file or such a directory"]
    (folder / "dataset_dict.json").write_text("{}")
    (folder / "train").mkdir()
    r = cli(*extract_args(server, folder, tmp_path / "out"))
    assert r.returncode == 2 and f"pass one of its folders, e.g. {folder / 'train'}" in r.stderr
    assert server.requests == 0


def test_rows_are_counted_from_0_and_name_their_line(server, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [[1, 2], [3, 4], None], blank_after=0)
    r = cli(*extract_args(server, path, tmp_path / "out", "--concurrency", 1))
    assert r.returncode == 2
    assert "error: row 2 (line 4 of d.jsonl) has neither input_ids nor messages" in r.stderr
    # what was extracted before it (here the rows ahead may still be in flight) is kept and
    # counted, and the message says how to go on
    kept = len(list((tmp_path / "out").glob("hs_*.safetensors")))
    assert (f"extract: stopped at that row; the {kept} sample(s) extracted before it are kept in "
            f"{tmp_path / 'out'}: fix the row and run the same command again to resume" in r.stderr) == (kept > 0)
    (tmp_path / "e.jsonl").write_text('{"input_ids": [1]}\n\n\n{oops\n')
    r = cli(*extract_args(server, tmp_path / "e.jsonl", tmp_path / "out2"))
    assert r.returncode == 2 and "error: row 1 (line 4 of e.jsonl): not JSON" in r.stderr
    # what json refuses beyond syntax is a sentence too, not a traceback (a review: exit 1)
    for i, line in enumerate(["[" * 100000 + "]" * 100000, '{"input_ids": [1' + "0" * 5000 + "]}"]):
        (tmp_path / f"x{i}.jsonl").write_text(line + "\n")
        r = cli(*extract_args(server, tmp_path / f"x{i}.jsonl", tmp_path / f"out-x{i}"))
        assert r.returncode == 2 and "error: row 0 (line 1 of " in r.stderr and "Traceback" not in r.stderr, r.stderr


# ---- convert's refusals (all before torch is needed) -------------------------------------------
def test_convert_without_input_files_is_an_error(tmp_path):
    (tmp_path / "src").mkdir()
    r = cli("convert", "--to", "specforge", tmp_path / "src", tmp_path / "dst", "--no-final-norm")
    assert r.returncode == 2
    assert r.stderr.strip() == (f"error: SRC {tmp_path / 'src'} holds no hs_<i>.safetensors files "
                                f"(extract --out writes them); nothing to convert")
    assert not (tmp_path / "dst").exists()


def test_convert_model_folder_without_config_says_so(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_file(str(src / "hs_0.safetensors"), [1, 2, 3])
    (tmp_path / "model").mkdir()
    r = cli("convert", "--to", "specforge", src, tmp_path / "dst", "--model", tmp_path / "model")
    assert r.returncode == 2
    assert r.stderr.strip().startswith(f"error: --model {tmp_path / 'model'} has no config.json")


def test_convert_loss_masks_with_too_few_rows_say_how_many(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        write_file(str(src / f"hs_{i}.safetensors"), [1, 2, 3])
    masks = write_jsonl(tmp_path / "d.jsonl", [[1, 2, 3]] * 2, masks=[[0, 1, 1]] * 2)
    r = cli("convert", "--to", "specforge", src, tmp_path / "dst", "--no-final-norm",
            "--loss-mask-from", masks)
    assert r.returncode == 2
    assert (f"--loss-mask-from {masks} has 2 row(s), but SRC holds hs_3: it needs at least "
            f"4 rows") in r.stderr
    nomask = tmp_path / "n.jsonl"
    nomask.write_text("\n".join(json.dumps({"input_ids": [1, 2, 3]}) for _ in range(4)) + "\n")
    r = cli("convert", "--to", "specforge", src, tmp_path / "dst", "--no-final-norm",
            "--loss-mask-from", nomask)
    assert r.returncode == 2 and "row 0 (line 1 of n.jsonl) has no loss_mask" in r.stderr


def test_the_pending_journal_stays_small_and_survives_a_restart(tmp_path, monkeypatch):
    from sglang_ext.client.pending import PendingFiles, journal_path

    monkeypatch.setattr(PendingFiles, "COMPACT_EVERY", 10)
    dump = tmp_path / "dump"
    dump.mkdir()
    p = PendingFiles(str(tmp_path), rank=1)
    def name(i):  # the server's name for rid r<i>
        return fmt.safe_stem(f"r{i}") + fmt.SUFFIX

    for i in range(100):
        p.sent(f"r{i}")
        p.named(f"r{i}", str(dump / name(i)))
        if i % 10:
            p.settled(f"r{i}")
    p.sent("never-answered")
    lines = open(journal_path(str(tmp_path), 1)).read().splitlines()
    assert len(lines) <= 10 + 1 + 10  # one compaction's worth, the dir line, what is pending
    again = PendingFiles(str(tmp_path), rank=1)
    assert again.rids == {**{f"r{i}": str(dump / name(i)) for i in range(0, 100, 10)},
                          "never-answered": None}
    assert again.dump_dirs == [str(dump)]
    # what they left: a file for r0 and one for the never-answered rid (by its safe name)
    write_file(str(dump / name(0)), [1])
    write_file(str(dump / (fmt.safe_stem("never-answered") + fmt.SUFFIX)), [1])
    assert again.sweep(forget_unanswered=True) == (2, [])
    assert os.listdir(dump) == [] and again.rids == {}
    assert not os.path.exists(journal_path(str(tmp_path), 1))


# ---- extract's refusals of bad input: one sentence, exit 2, nothing sent ------------------------
@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_a_timeout_that_is_not_a_positive_number_is_refused(server, tmp_path, value):
    path = write_jsonl(tmp_path / "d.jsonl", rows(2))
    r = cli(*extract_args(server, path, tmp_path / "out", f"--timeout={value}"))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"error: --timeout {float(value)} must be a positive number "
                                f"of seconds")
    assert server.requests == 0 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag, value", [("--backoff", "-5"), ("--backoff", "nan"), ("--max-backoff", "inf")])
def test_a_backoff_that_is_not_a_number_of_seconds_is_refused(server, tmp_path, flag, value):
    """(A new user's review: --backoff -5 and nan were taken silently.)"""
    path = write_jsonl(tmp_path / "d.jsonl", rows(2))
    r = cli(*extract_args(server, path, tmp_path / "out", f"{flag}={value}"))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"error: {flag} {float(value)} must be a number of seconds >= 0"
    assert server.requests == 0 and not (tmp_path / "out").exists()


def test_messages_that_are_not_a_list_are_named_so(server, tmp_path):
    """(A new user's review: {"messages": "x"} was reported as messages without a tokenizer.)"""
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"messages": "notalist"}) + "\n")
    r = cli(*extract_args(server, path, tmp_path / "out"))
    assert r.returncode == 2, r.stderr
    assert "row 0 (line 1 of m.jsonl): messages must be a list of {role, content} objects, not str" \
        in r.stderr, r.stderr


@pytest.mark.parametrize("endpoint, reason", [
    ("http://", "names no host"),
    ("http://:30000", "names no host"),
    ("http://127.0.0.1:99999", "is not a valid URL (Port out of range 0-65535)"),
    ("http://127.0.0.1:0", "has port 0: a port is a number from 1 to 65535"),
    ("http://127.0.0.1:port", "is not a valid URL (Port could not be cast to integer value"),
    ("http://[::1", "is not a valid URL (Invalid IPv6 URL)"),
    ("ftp://127.0.0.1:30000", "must start with http:// or https://"),
    ("http://127.0.0.1:30000?x=1", "has a query or fragment"),  # was probed as ?x=1/health
])
def test_a_malformed_endpoint_is_refused_at_once(tmp_path, endpoint, reason):
    """Refused before any try (no retries, no 36 s of backoff, no journal in --out)."""
    path = write_jsonl(tmp_path / "d.jsonl", rows(2))
    t0 = time.monotonic()
    r = cli("extract", "--endpoint", endpoint, "--data", path, "--out", tmp_path / "out",
            "--no-progress")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --endpoint {endpoint} {reason}"), r.stderr
    assert time.monotonic() - t0 < 20 and not (tmp_path / "out").exists()


def test_data_that_is_not_utf8_names_the_byte(server, tmp_path):
    path = tmp_path / "latin1.jsonl"
    good = b'{"input_ids": [1, 2]}\n'
    path.write_bytes(good + b'{"input_ids": [3], "note": "caf\xe9"}\n')
    r = cli(*extract_args(server, path, tmp_path / "out"))
    assert r.returncode == 2, r.stderr
    offset = len(good) + len(b'{"input_ids": [3], "note": "caf')
    assert r.stderr.strip() == (f"error: --data {path} is not UTF-8 text: byte {offset} (line 2) "
                                f"is 0xe9")
    assert server.requests == 0


def test_data_with_a_byte_order_mark_is_read(server, tmp_path):
    """A JSONL file saved with a UTF-8 byte order mark (and CRLF line ends), as Windows
    tools write it: before, row 0 was refused ("Unexpected UTF-8 BOM"), exit 2."""
    path = tmp_path / "bom.jsonl"
    data = rows(2)
    path.write_bytes(b"\xef\xbb\xbf" + b"".join(json.dumps({"input_ids": ids}).encode() + b"\r\n"
                                                  for ids in data))
    r = cli(*extract_args(server, path, tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    for i, ids in enumerate(data):
        assert fmt.load(str(tmp_path / "out" / f"hs_{i}.safetensors")).token_ids.tolist() == ids
    # a mark anywhere else is no row's: still refused, naming the row
    path.write_bytes(json.dumps({"input_ids": [1]}).encode() + b"\n\xef\xbb\xbf{}\n")
    r = cli(*extract_args(server, path, tmp_path / "out2"))
    assert r.returncode == 2 and r.stderr.startswith("error: row 1 (line 2 of bom.jsonl)"), r.stderr
    path.write_bytes(b"\xef\xbb\xbf{\"input_ids\": [1], \"note\": \"caf\xe9\"}\n")  # offsets count the mark
    r = cli(*extract_args(server, path, tmp_path / "out3"))
    assert r.stderr.strip() == f"error: --data {path} is not UTF-8 text: byte 34 (line 1) is 0xe9", r.stderr


def test_compressed_data_is_named_as_compressed(server, tmp_path):
    """A gzip, zstd, xz or bzip2 DATA (datasets ship as .jsonl.gz) is refused in one
    sentence saying so; before, 'is not UTF-8 text: byte 1 (line 1) is 0x8b'."""
    import bz2
    import gzip
    import lzma

    text = b"".join(json.dumps({"input_ids": ids}).encode() + b"\n" for ids in rows(2))
    for name, blob, kind in (("d.jsonl.gz", gzip.compress(text), "gzip"), ("d.jsonl.xz", lzma.compress(text), "xz"),
                             ("d.jsonl.bz2", bz2.compress(text), "bzip2"),
                             ("d.jsonl.zst", b"\x28\xb5\x2f\xfd" + bytes(range(128, 160)), "zstd")):
        path = tmp_path / name
        path.write_bytes(blob)
        r = cli(*extract_args(server, path, tmp_path / "out"))
        assert r.returncode == 2 and r.stderr.strip() == (
            f"error: --data {path} is {kind}-compressed, not JSONL text: decompress it first"), r.stderr
    assert server.requests == 0


def test_data_from_a_pipe_is_refused_before_any_row(server, tmp_path):
    """``--data /dev/stdin`` (or ``<(...)``): DATA is read once to count its rows and again
    to send them, so the second read of a pipe found nothing: before, exit 0 with every row
    counted and none extracted (no file, no error). Now one sentence, exit 2."""
    text = "".join(json.dumps({"input_ids": ids}) + "\n" for ids in rows(2))
    r = cli(*extract_args(server, "/dev/stdin", tmp_path / "out"), input=text)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("error: --data /dev/stdin is not a file (a FIFO): extract reads DATA once"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "save it to a file first" in r.stderr, r.stderr
    assert server.requests == 0 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("change", ["cut_short", "grown"])
def test_data_changed_during_the_run_stops_it_instead_of_saying_done(server, tmp_path, change):
    """DATA rewritten while extract runs: its rows were counted at the start, then read as
    they are sent. Cut short (truncated, 20 rows to 10): before, the run ended with exit 0
    ("every row done") though half its rows were never read. Grown (10 rows appended to
    10): before, every row was sent and the summary said rows_for_rank 10, extracted 20.
    Now the rows read (at most those counted) are extracted and the run stops (exit 3)
    saying so; the same command on the whole DATA then finishes the rest."""
    data = [[(i + k) % 50 for k in range(3000)] for i in range(20)]  # ~12 KB lines: past read-ahead
    path = Path(write_jsonl(tmp_path / "d.jsonl", data))
    whole = path.read_bytes()
    first_ten = b"".join(whole.splitlines(keepends=True)[:10])
    if change == "cut_short":
        def during():
            path.write_bytes(first_ten)  # truncate, then write: as `> d.jsonl` would
        says = ("ended after 10 of this rank's 20 rows counted at the start: it changed during the run "
                "(rewritten, truncated?); the rows sent are kept: run the same command again on the whole "
                "DATA to resume")
    else:
        path.write_bytes(first_ten)

        def during():
            with open(path, "ab") as f:  # as `>> d.jsonl` would
                f.write(whole[len(first_ten):])
        says = ("has more than the 10 rows of this rank counted at the start: it grew during the run; "
                "those 10 were sent: run the same command again to extract the rows added")
    answer = server.generate

    def change_at_the_first_request(body):
        if server.requests == 0:
            during()
        return answer(body)

    server.generate = change_at_the_first_request
    r = cli(*extract_args(server, path, tmp_path / "out", "--concurrency", 1))
    assert r.returncode == 3, (r.stdout[-500:], r.stderr[-500:])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: --data {path} {says}"], r.stderr
    assert summary(r.stdout)["extracted"] == 10, r.stdout
    assert sorted(p.name for p in (tmp_path / "out").glob("hs_*")) == sorted(f"hs_{i}.safetensors" for i in range(10))
    server.generate = answer
    path.write_bytes(whole)
    r = cli(*extract_args(server, path, tmp_path / "out"))
    assert r.returncode == 0 and summary(r.stdout)["resumed"] == 10, r.stderr
    for i in range(20):
        assert fmt.load(str(tmp_path / "out" / f"hs_{i}.safetensors")).token_ids.tolist() == data[i], i


def test_empty_data_is_refused_saying_no_rows(server, tmp_path):
    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n  \n")):
        path = tmp_path / name
        path.write_text(text)
        r = cli(*extract_args(server, path, tmp_path / "out"))
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip() == f"error: --data {path} has no rows; nothing to extract"
    assert server.requests == 0 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["below-a-file", "sysfs"])
def test_an_out_directory_that_cannot_be_written_is_one_sentence(server, tmp_path, where):
    """Root ignores a chmod 555 directory, so the unwritable --out is /sys (read-only for
    everyone: a sysfs or a read-only mount) or a path below a regular file."""
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "out" if where == "below-a-file" else Path("/sys")
    path = write_jsonl(tmp_path / "d.jsonl", rows(2))
    r = cli(*extract_args(server, path, out))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --out {out}: cannot write there ("), r.stderr
    assert server.requests == 0


def test_tokenizer_without_transformers_is_one_sentence(server, tmp_path):
    """transformers made unimportable (sys.modules entry None) in the child."""
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    code = ("import sys; sys.modules['transformers'] = None; "
            "from sglang_ext.__main__ import main; sys.exit(main(sys.argv[1:]))")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code,
                        *extract_args(server, path, tmp_path / "out", "--tokenizer", tmp_path)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"error: --tokenizer {tmp_path} needs transformers, which is not "
                                f"installed here (pip install transformers jinja2: chat templates "
                                f"need jinja2)")


def test_an_html_error_page_is_quoted_short_on_one_line(tmp_path):
    """http.server answers POST with HTTP 501 and its HTML error page (~450 bytes, many
    lines); each retry line quotes at most 200 characters of it, on one line."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _HealthOnly)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        path = write_jsonl(tmp_path / "d.jsonl", rows(1))
        r = cli("extract", "--endpoint", url, "--data", path, "--out", tmp_path / "out",
                "--no-progress", "--backoff", "0.01", "--max-backoff", "0.01", "--max-retries", 2)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert r.returncode == 1, r.stderr
    retry = [ln for ln in r.stderr.splitlines() if "retrying" in ln]
    assert len(retry) == 2, r.stderr
    for line in retry + [ln for ln in r.stderr.splitlines() if "tries failed" in ln]:
        quoted = line.split("HTTP 501: ", 1)[1]
        assert quoted.startswith("<!DOCTYPE HTML") and quoted.endswith("...")
        assert len(quoted) == 200 + 3
    assert "</html>" not in r.stderr


# ---- convert: refusals that need the files' headers (still no torch) ---------------------------
def _src_with(tmp_path, n=2, ids=(1, 2, 3)):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(n):
        write_file(str(src / f"hs_{i}.safetensors"), list(ids))  # metadata num_layers "4"
    return src


def test_convert_loss_masks_from_a_missing_file_is_one_sentence(tmp_path):
    src = _src_with(tmp_path, n=1)
    missing = tmp_path / "nonexistent.jsonl"
    r = cli("convert", "--to", "specforge", src, tmp_path / "dst", "--no-final-norm",
            "--loss-mask-from", missing)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"error: --loss-mask-from {missing} does not exist (pass the "
                                f"DATA given to extract)")
    assert not (tmp_path / "dst").exists()


def test_convert_refuses_loss_masks_of_other_prompts(tmp_path):
    src = _src_with(tmp_path)
    data = write_jsonl(tmp_path / "d.jsonl", [[1, 2, 3], [1, 9, 3]], masks=[[0, 1, 1]] * 2)
    r = cli("convert", "--to", "specforge", src, tmp_path / "dst", "--no-final-norm",
            "--loss-mask-from", data)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (
        f"error: --loss-mask-from {data}: row 1 (line 2 of d.jsonl)'s input_ids differ from "
        f"hs_1.safetensors' token_ids at position 1 (row 9, file 2): its loss_mask belongs to "
        f"another prompt; pass the DATA given to extract")
    write_jsonl(tmp_path / "d.jsonl", [[1, 2, 3], [1, 2]], masks=[[0, 1, 1], [0, 1]])
    r = cli("convert", "--to", "specforge", src, tmp_path / "dst", "--no-final-norm",
            "--loss-mask-from", data)
    assert r.returncode == 2 and "at position 2 (row has 2 tokens, file 3)" in r.stderr, r.stderr
    assert not (tmp_path / "dst").exists()


def test_convert_refuses_loss_masks_that_are_not_zeros_and_ones_of_the_right_length(tmp_path):
    """Checked for every row before any record is written (a new user's review: [7, 7, 7]
    was written as it was, and a wrong length failed per file after earlier records)."""
    src = _src_with(tmp_path)
    for masks, says in (([[0, 1, 1], [7, 7, 7]], "row 1 (line 2 of d.jsonl)'s loss_mask must be a list of 0 and 1"),
                        ([[0, 1, 1], [0, 1]], "row 1 (line 2 of d.jsonl)'s loss_mask has 2 values for "
                                              "hs_1.safetensors' 3 tokens")):
        data = write_jsonl(tmp_path / "d.jsonl", [[1, 2, 3], [1, 2, 3]], masks=masks)
        r = cli("convert", "--to", "specforge", src, tmp_path / "dst", "--no-final-norm",
                "--loss-mask-from", data)
        assert r.returncode == 2 and says in r.stderr, r.stderr
        assert not (tmp_path / "dst").exists()


def test_convert_refuses_a_model_with_another_layer_count(tmp_path):
    src = _src_with(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 61,
                                                                   "rms_norm_eps": 1e-6}}))
    r = cli("convert", "--to", "specforge", src, tmp_path / "dst", "--model", model)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (
        f"error: --model {model} has num_hidden_layers 61, but hs_0.safetensors was dumped from "
        f"a model with 4 layers (metadata num_layers): pass the model the files were dumped from")
    assert not (tmp_path / "dst").exists()


def test_convert_refuses_a_dst_that_is_a_file_and_runs_without_torch_with_a_sentence(tmp_path):
    src = _src_with(tmp_path, n=1)
    (tmp_path / "dst").write_text("x")
    r = cli("convert", "--to", "specforge", src, tmp_path / "dst", "--no-final-norm")
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: DST {tmp_path / 'dst'} exists and is not a directory"
    assert (tmp_path / "dst").read_text() == "x"
    code = ("import sys; sys.modules['torch'] = None; "
            "from sglang_ext.__main__ import main; sys.exit(main(sys.argv[1:]))")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code, "convert", "--to", "specforge", str(src),
                        str(tmp_path / "new"), "--no-final-norm"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == ("error: convert writes torch.save records and needs torch, which "
                                "is not installed here (pip install torch)")
    assert not (tmp_path / "new").exists()


def test_convert_help_states_each_default_once():
    r = cli("convert", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "(default: None)" not in text
    assert text.count("(default: all ones)") == 1
    assert "(default: the first of model.norm.weight," in text


def test_extract_help_shows_real_defaults_only():
    """Required flags and flags without a default say nothing of a default; the others
    state theirs (argparse's formatter alone printed "(default: None)" for --endpoint)."""
    r = cli("extract", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "(default: None)" not in text
    assert "HTTP requests in flight" in text and "(default: 32)" in text and "(default: 600.0)" in text


def test_ctrl_c_while_the_command_is_imported_is_one_line():
    """A real SIGINT, sent by the process to itself when ``python -m sglang_ext extract``
    starts importing extract's module (the first half second of a run, where a new user's
    Ctrl-C printed a KeyboardInterrupt traceback)."""
    code = (
        "import os, runpy, signal, sys\n"
        "class Hook:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'sglang_ext.client.extract':\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Hook())\n"
        "sys.argv = ['sglang_ext', 'extract', '--help']\n"
        "runpy.run_module('sglang_ext', run_name='__main__', alter_sys=True)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
    assert r.returncode == 130, r.stderr
    assert r.stderr.strip().splitlines() == ["sglang-ext extract: interrupted"], r.stderr


def test_extract_without_aiohttp_names_the_client_install(tmp_path):
    """aiohttp missing (hidden from the import system): one sentence naming the project's
    own install, ``pip install -e '.[client]'`` (a review: it said ``pip install aiohttp
    tqdm``, which leaves out what the [client] extra pins)."""
    code = ("import runpy, sys\n"
            "sys.modules['aiohttp'] = None\n"
            f"sys.argv = ['sglang_ext', 'extract', '--endpoint', 'http://127.0.0.1:9', '--data', "
            f"{str(tmp_path / 'd.jsonl')!r}, '--out', {str(tmp_path / 'out')!r}]\n"
            "runpy.run_module('sglang_ext', run_name='__main__', alter_sys=True)\n")
    write_jsonl(tmp_path / "d.jsonl", rows(1))
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: extract needs aiohttp: pip install -e '.[client]' in a clone"), r.stderr


def test_the_ctrl_c_line_counts_every_file_the_run_put_in_out(server, tmp_path):
    """Ctrl-C in the middle of a fast run (32 workers): the line's count is the number of
    hs_<i> in OUT, which the next run resumes (a new user's review saw "813" said, 829 files
    in OUT and 829 resumed: rows cancelled after their file was moved were not counted)."""
    data = [[1, 2, 3]] * 400
    path = write_jsonl(tmp_path / "d.jsonl", data)
    out = tmp_path / "out"

    def in_out():
        return len(list(out.glob("hs_*.safetensors"))) if out.exists() else 0

    code, err = signal_extract(extract_args(server, path, str(out), "--concurrency", 16),
                               lambda: in_out() >= 60, signal.SIGINT)
    assert code == 130, err
    said = re.search(r"extract: interrupted: (\d+) sample\(s\) extracted in this run, (\d+) of 400", err)
    assert said, err
    files = in_out()
    assert (int(said[1]), int(said[2])) == (files, files), err
    r = cli(*extract_args(server, path, out), timeout=120)
    assert r.returncode == 0, r.stderr
    assert summary(r.stdout)["resumed"] == files


def test_a_run_stopped_at_a_bad_row_leaves_no_empty_out(server, tmp_path):
    """The dataset's first row has no input_ids (and no --tokenizer): the run stops at it
    (exit 2) and the --out it created is gone again (a new user's review found an empty
    one left behind); an --out that existed before stays."""
    path = write_jsonl(tmp_path / "d.jsonl", [None, [1, 2, 3]])
    r = cli(*extract_args(server, path, tmp_path / "out"))
    assert r.returncode == 2, r.stderr
    assert "row 0 (line 1 of" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
    (tmp_path / "mine").mkdir()
    r = cli(*extract_args(server, path, tmp_path / "mine"))
    assert r.returncode == 2, r.stderr
    assert os.listdir(tmp_path / "mine") == []


def test_convert_help_is_plain_text_with_shapes_and_to_is_optional(tmp_path):
    """convert --help showed RST (double backticks) and a required --to of one choice: the
    help is plain text giving the record's shapes, and --to may be left out (``--to
    specforge`` is still taken)."""
    text = " ".join(cli("convert", "--help").stdout.split())
    assert "``" not in text, text
    for words in ("hidden_states [T, L, H]", "input_ids [T] int64", "loss_mask [T] int64",
                  "aux_hidden_state [1, T, (L-1)*H]", "hidden_state [1, T, H]",
                  "specforge, the only one, is the default"):
        assert words in text, words
    (tmp_path / "src").mkdir()
    r = cli("convert", tmp_path / "src", tmp_path / "dst", "--no-final-norm")
    assert r.returncode == 2
    assert r.stderr.strip() == (f"error: SRC {tmp_path / 'src'} holds no hs_<i>.safetensors files "
                                f"(extract --out writes them); nothing to convert")
