"""``sglang-ext standin`` as its own process: the answers the patched server gives (early
answers, ``/v1/completions``' ``kv_transfer_params``, no dump, a refused rid, no tokenizer),
its start-up sentences, SIGTERM, and the store sink against a real ``mooncake_master``,
whose samples ``extract --store`` turns into the very files the directory sink writes.
The values themselves are checked against an independent recomputation in test_tryit.py,
and here for requests that ask for their output rows (``hidden_states_output``), with the
generated ids recomputed from ``standin_model.generated_ids``' documented hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from mooncake_fixture import master_config, needs_mooncake

from sglang_ext import format as fmt
from test_tryit import reference  # the stand-in's documented values, in plain Python ints

LAYERS = [2, 4, 5, 8]


class Standin:
    """``python -m sglang_ext standin ARGS --port 0`` until ``stop()``; ``url`` once up."""

    def __init__(self, tmp: Path, *args: str):
        self.log = tmp / "standin.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "sglang_ext", "standin", "--port", "0", *args],
                                     stderr=subprocess.PIPE, text=True)
        lines = []  # Mooncake's client may log first
        while not lines or not lines[-1].startswith("stand-in server"):
            lines.append(self.proc.stderr.readline())
            assert lines[-1], "the stand-in did not start:\n" + "".join(lines)
        self.url = re.search(r"at (http://\S+),", lines[-1]).group(1)

    def post(self, path: str, body) -> tuple:
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self) -> tuple:
        """SIGTERM; returns (exit code, the rest of stderr)."""
        self.proc.send_signal(signal.SIGTERM)
        err = self.proc.stderr.read()
        return self.proc.wait(timeout=60), err


@pytest.fixture
def standin(tmp_path):
    s = Standin(tmp_path, "--dump-dir", str(tmp_path / "dump"))
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait()


def test_answers_as_the_patched_server(standin, tmp_path):
    dump = tmp_path / "dump"
    assert oct(dump.stat().st_mode & 0o777) == "0o700"
    with urllib.request.urlopen(standin.url + "/server_info") as r:
        info = json.loads(r.read())
    assert info["dump_hidden_states_dir"] == str(dump.resolve())
    with urllib.request.urlopen(standin.url + "/health") as r:
        assert r.status == 200 and r.read() == b""

    # early answer: the name is reserved, the file complete once the lock is gone
    code, ans = standin.post("/generate", {"input_ids": [3, 1, 4], "rid": "a/b c",
                                           "sampling_params": {"custom_params": {fmt.WAIT_PARAM: False}}})
    meta = ans["meta_info"]
    assert code == 200 and meta[fmt.PENDING_KEY] is True and meta["id"] == "a/b c"
    path = meta[fmt.PATH_KEY]
    assert os.path.dirname(path) == str(dump.resolve()) and fmt.is_name_for("a/b c", os.path.basename(path))
    assert fmt.wait_complete(path, timeout=60) is None
    record = fmt.load(path)
    assert record.token_ids.tolist() == [3, 1, 4] and list(record.hidden_states.shape) == [3, 4, 64]
    assert str(record.hidden_states.dtype) == "torch.bfloat16" and record.layer_ids == LAYERS
    assert record.metadata["rid"] == "a/b c" and record.metadata["model_path"] == "kimi-sglang standin"

    # the same rid again: the next name, as reserve gives it; answered once complete
    code, ans = standin.post("/generate", {"input_ids": [3, 1, 4], "rid": "a/b c"})
    second = ans["meta_info"][fmt.PATH_KEY]
    assert fmt.PENDING_KEY not in ans["meta_info"] and second != path
    assert not os.path.exists(second + fmt.LOCK_SUFFIX)
    assert open(second, "rb").read() == open(path, "rb").read()  # values depend on the prompt only

    # speculators' client: /v1/completions with kv_transfer_params, file complete
    code, ans = standin.post("/v1/completions", {"prompt": [7, 7], "max_tokens": 1, "return_token_ids": True})
    assert code == 200 and ans["choices"][0]["prompt_token_ids"] == [7, 7]
    kv_path = ans["kv_transfer_params"][fmt.PATH_KEY]
    assert fmt.load(kv_path).token_ids.tolist() == [7, 7] and not os.path.exists(kv_path + fmt.LOCK_SUFFIX)

    # not dumped; a rid the server refuses fails that request alone; no tokenizer
    code, ans = standin.post("/generate", {"input_ids": [1], "sampling_params": {
        "custom_params": {fmt.DUMP_PARAM: False}}})
    assert code == 200 and not set(ans["meta_info"]) & set(fmt.RESPONSE_KEYS)
    code, ans = standin.post("/generate", {"input_ids": [1], "rid": "x" * (fmt.MAX_RID_CHARS + 1)})
    assert code == 200 and "at most 8192" in ans["meta_info"][fmt.ERROR_KEY]
    code, ans = standin.post("/generate", {"text": "hello"})
    assert code == 400 and "no tokenizer" in ans["error"]["message"]
    # SGLang's own requests (health checks, the warm-up) leave no file, as on the real server
    for rid in ("HEALTH_CHECK_7f3a", "kimi-sglang-warmup-0123abcd"):
        code, ans = standin.post("/generate", {"input_ids": [5, 6], "rid": rid})
        assert code == 200 and not set(ans["meta_info"]) & set(fmt.RESPONSE_KEYS), (rid, ans)

    index = fmt.read_index(str(dump))
    assert [(r["rid"], r["num_tokens"]) for r in index] == [("a/b c", 3), ("a/b c", 3), (index[2]["rid"], 2)]
    assert [os.path.join(str(dump.resolve()), r["file"]) for r in index] == [path, second, kv_path]
    rc, err = standin.stop()
    assert rc == 0 and "Traceback" not in err, err
    assert sorted(n for n in os.listdir(dump) if n.startswith(".") or n.endswith((".lock", ".tmp"))) == []


def generated_reference(prompt, n, seed=None):
    """The stand-in's documented generation: sha256(prompt as int64 LE, position as int64
    LE[, rid]), first 4 bytes LE, mod 32000."""
    head = b"".join(t.to_bytes(8, "little", signed=True) for t in prompt)
    tail = seed.encode() if seed is not None else b""
    return [int.from_bytes(hashlib.sha256(head + (len(prompt) + k).to_bytes(8, "little") + tail).digest()[:4],
                           "little") % 32000 for k in range(n)]


def assert_output_file(path, prompt, out):
    """``path`` follows the output-rows contract for ``prompt`` and generated ``out``, every
    value the documented one."""
    record = fmt.load(path)
    fed = prompt + out[:-1]
    assert record.token_ids.tolist() == fed
    assert (record.metadata["num_prompt_tokens"], record.metadata["last_token_id"]) == (str(len(prompt)), str(out[-1]))
    hs = record.hidden_states.float()
    assert list(hs.shape) == [len(fed), len(LAYERS), 64]
    bad = [(t, j, h) for t in range(len(fed)) for j, layer in enumerate(LAYERS) for h in range(64)
           if hs[t, j, h].item() != reference(fed, layer, t, h)]
    assert not bad, f"{len(bad)} values differ from the documented ones, first at [t, slot, h] = {bad[0]}"


def test_output_rows_follow_the_contract(standin):
    prompt = [3, 1, 4, 1]
    greedy = {"max_new_tokens": 6, "temperature": 0, "custom_params": {fmt.OUTPUT_PARAM: True}}
    code, ans = standin.post("/generate", {"input_ids": prompt, "sampling_params": greedy})
    out = generated_reference(prompt, 6)
    assert code == 200 and ans["output_ids"] == out, (ans, out)
    assert ans["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert ans["meta_info"]["completion_tokens"] == 6
    assert_output_file(ans["meta_info"][fmt.PATH_KEY], prompt, out)

    # sampled decoding: the rid seeds it (a retried request, a new rid, is a new sample)
    sampled = {**greedy, "temperature": 0.7, "custom_params": {fmt.OUTPUT_PARAM: True, fmt.WAIT_PARAM: False}}
    code, ans = standin.post("/generate", {"input_ids": prompt, "rid": "s1", "sampling_params": sampled})
    s1 = generated_reference(prompt, 6, "s1")
    assert ans["output_ids"] == s1 and s1 != out and s1 != generated_reference(prompt, 6, "s2")
    assert fmt.wait_complete(ans["meta_info"][fmt.PATH_KEY], timeout=60) is None
    assert_output_file(ans["meta_info"][fmt.PATH_KEY], prompt, s1)

    # a stop token: generation ends with it, and it is the last id (never fed back)
    code, ans = standin.post("/generate", {"input_ids": prompt, "sampling_params": {
        **greedy, "stop_token_ids": [out[2]]}})
    assert ans["output_ids"] == out[:3] and ans["meta_info"]["finish_reason"] == {"type": "stop", "matched": out[2]}
    assert_output_file(ans["meta_info"][fmt.PATH_KEY], prompt, out[:3])

    # one token generated: the prompt's rows alone, that token recorded
    code, ans = standin.post("/generate", {"input_ids": prompt, "sampling_params": {**greedy, "max_new_tokens": 1}})
    assert_output_file(ans["meta_info"][fmt.PATH_KEY], prompt, out[:1])

    # vLLM's spelling on /v1/completions
    code, ans = standin.post("/v1/completions", {"prompt": [7, 7], "max_tokens": 4, "temperature": 0,
                                                 "return_token_ids": True,
                                                 "kv_transfer_params": {fmt.VLLM_OUTPUT_PARAM: True}})
    out2 = generated_reference([7, 7], 4)
    assert code == 200 and ans["choices"][0]["token_ids"] == out2 and ans["usage"]["completion_tokens"] == 4
    assert_output_file(ans["kv_transfer_params"][fmt.PATH_KEY], [7, 7], out2)

    # not asked for: the prompt's rows only, no output metadata; a bad max_new_tokens is HTTP 400
    code, ans = standin.post("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6}})
    meta = fmt.load(ans["meta_info"][fmt.PATH_KEY]).metadata
    assert fmt.NUM_PROMPT_TOKENS_KEY not in meta and fmt.output_rows(prompt, meta) is None
    code, ans = standin.post("/generate", {"input_ids": prompt, "sampling_params": {**greedy, "max_new_tokens": 0}})
    assert code == 400 and "max_new_tokens must be an int >= 1" in ans["error"]["message"]


def test_bad_start_is_one_sentence(tmp_path):
    (tmp_path / "file").write_text("")
    run = [sys.executable, "-m", "sglang_ext", "standin"]
    r = subprocess.run(run + ["--dump-dir", str(tmp_path / "file")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "is not a directory" in r.stderr, r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = subprocess.run(run + ["--dump-dir", str(tmp_path / "d"), "--port", str(s.getsockname()[1])],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: cannot listen on 127.0.0.1:"), r.stderr
    assert "Traceback" not in r.stderr
    for port in ("99999", "-1"):  # not a port at all: the socket layer raises OverflowError
        r = subprocess.run(run + ["--dump-dir", str(tmp_path / "d"), "--port", port],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, (port, r.stderr)
        assert r.stderr.startswith(f"error: --port must be 0 to 65535, not {port}"), r.stderr


@needs_mooncake
def test_store_sink_samples_become_the_directory_sinks_files(master, tmp_path):
    """Against a real master: answers carry the manifest, ``extract --store`` fetches the
    samples, and each ``hs_<i>`` is byte for byte the file the stand-in's directory sink
    writes for the same rid and prompt."""
    from sglang_ext.tools import standin as standin_mod

    server = Standin(tmp_path, "--dump-dir", master_config(master))
    try:
        data = [[5, 6, 7, 8], [9], [10, 11]]
        (tmp_path / "d.jsonl").write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in data))
        trainer = f"mooncake://{master.address}?protocol=tcp&local_buffer_size=16MiB&local_hostname=127.0.0.1"
        r = subprocess.run([sys.executable, "-m", "sglang_ext", "extract", "--endpoint", server.url, "--data",
                            str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "out"), "--store", trainer,
                            "--no-progress"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        rc, err = server.stop()
    assert rc == 0 and "Traceback" not in err, err
    twin_dir = tmp_path / "twins"
    twins = standin_mod.Dump(str(twin_dir), tuple(LAYERS), 8, 64)
    try:
        for i, ids in enumerate(data):
            got = tmp_path / "out" / f"hs_{i}.safetensors"
            rid = fmt.load(str(got)).metadata["rid"]
            res = fmt.reserve(twins.dir_fd, rid)
            twins.write(res, rid, ids)
            assert got.read_bytes() == (twin_dir / res.name).read_bytes(), f"hs_{i} differs from the file sink's"
    finally:
        twins.close()


def test_extract_asks_a_sampling_server_for_every_row(tmp_path, monkeypatch):
    """A server sampling live traffic (here none: ``KIMI_SGLANG_SAMPLE_RATE=0``, decided by
    ``sglang_ext.sampling`` as on the patched server) answers a request that does not ask
    without dump keys; ``extract`` asks for each row (``hidden_states_dump: true``), so
    every row still gets its file (a review saw the run stop at the first row, exit 3)."""
    monkeypatch.setenv("KIMI_SGLANG_SAMPLE_RATE", "0")
    s = Standin(tmp_path, "--dump-dir", str(tmp_path / "dump"))
    try:
        status, body = s.post("/generate", {"input_ids": [5, 6, 7]})
        assert status == 200 and fmt.PATH_KEY not in body["meta_info"], body  # sampled out
        data = tmp_path / "data.jsonl"
        data.write_text("".join(json.dumps({"input_ids": [3 + i, 4, 5 + i]}) + "\n" for i in range(5)))
        out = tmp_path / "out"
        proc = subprocess.run([sys.executable, "-m", "sglang_ext", "extract", "--endpoint", s.url,
                               "--data", str(data), "--out", str(out)], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert sorted(p.name for p in out.glob("hs_*.safetensors")) == [f"hs_{i}.safetensors" for i in range(5)]
    finally:
        s.stop()


def test_validate_needs_no_torch(standin, tmp_path):
    """``extract --validate`` in an interpreter where ``import torch`` fails (a client's
    light install): every file loaded with numpy (format.load) and checked finite
    (before: refused, 'needs torch', though format.load reads without it)."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [7 + i, 8, 9]}) + "\n" for i in range(3)))
    code = ("import sys; sys.modules['torch'] = None\n"
            "from sglang_ext.__main__ import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.run([sys.executable, "-c", code, "extract", "--endpoint", standin.url, "--data", str(data),
                           "--out", str(tmp_path / "out"), "--validate"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(list((tmp_path / "out").glob("hs_*.safetensors"))) == 3


def test_a_rid_prefix_every_rid_of_which_the_server_refuses_is_refused_before_any_row(standin, tmp_path):
    """The stand-in, as the patched server, refuses a rid over 8192 characters; extract's
    rids are ``<--rid-prefix>-<row>-<try>-<8 hex>``. Before, a prefix too long for them sent
    every row 6 times, each refused alike, and exit 1; now exit 2 at once. The longest
    prefix allowed works (its longest rid, last row's last try, is the server's bound)."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [7, 8, i]}) + "\n" for i in range(11)))
    room = 8192 - len("-10-5-") - 8  # rows 0..10, tries 0..5 (--max-retries 5)

    def extract(prefix, out, *extra):
        return subprocess.run([sys.executable, "-m", "sglang_ext", "extract", "--endpoint", standin.url, "--data",
                               str(data), "--out", str(tmp_path / out), "--no-progress", "--backoff", "0.01",
                               "--rid-prefix", prefix, *extra], capture_output=True, text=True, timeout=300)

    for rid in ("x" * 8192, "x" * 8193):  # the server's bound, independent of extract
        status, body = standin.post("/generate", {"input_ids": [7], "rid": rid})
        assert ("hidden_states_error" in body["meta_info"]) == (len(rid) > 8192), body
    proc = extract("x" * (room + 1), "refused")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == (f"error: --rid-prefix is {room + 1} characters long; this run's rids would have up "
                           f"to 8193, the server refuses those over 8192: use at most {room}\n")
    assert not (tmp_path / "refused").exists()
    proc = extract("x" * room, "kept")  # its last row's last try would send an 8192-character rid
    assert proc.returncode == 0, proc.stderr[-2000:]
    for i in range(11):
        assert fmt.load(str(tmp_path / "kept" / f"hs_{i}.safetensors")).token_ids.tolist() == [7, 8, i]


def _raw(url: str, request: bytes) -> tuple:
    """Send ``request`` as it is; returns (status, JSON body) of the answer."""
    host, port = url.rsplit("//", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_request_bodies_it_cannot_read_are_refused_in_a_sentence(standin):
    """A chunked body (no Content-Length) is 411, not a misleading 'input_ids must be'
    400 from an empty body; a Content-Length of 99999999999 is 413, not a 500 MemoryError;
    a Content-Length that is no number is 400; the server answers normally afterwards."""
    chunked = (b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
               b"Content-Type: application/json\r\nConnection: close\r\n\r\n"
               b"14\r\n{\"input_ids\": [1, 2]}\r\n0\r\n\r\n")
    code, body = _raw(standin.url, chunked)
    assert code == 411 and "Content-Length" in body["error"]["message"], body
    huge = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n{}"
    code, body = _raw(standin.url, huge)
    assert code == 413 and "99999999999 bytes" in body["error"]["message"], body
    code, body = _raw(standin.url, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n")
    assert code == 400 and "'-5'" in body["error"]["message"], body
    code, meta = standin.post("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}})
    assert code == 200 and meta["meta_info"]["hidden_states_path"], meta


@needs_mooncake
def test_sigterm_ends_the_store_sink_whose_master_died(tmp_path):
    """The store sink's master SIGKILLed under it, 12 requests answered (their puts queued
    behind the stand-in's two writers, each failing only at Mooncake's RPC timeout): SIGTERM
    ends the stand-in within its drain time, the puts not started dropped with one sentence
    (before, it waited for every queued put, minutes, and looked hung)."""
    import time

    from mooncake_fixture import Master

    (tmp_path / "mooncake").mkdir()
    own = Master(tmp_path / "mooncake")
    server = Standin(tmp_path, "--dump-dir", master_config(own))
    try:
        code, answer = server.post("/generate", {"input_ids": [5, 6, 7]})
        assert code == 200 and answer["meta_info"]["hidden_states_manifest"], answer
        own.kill()
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(12) as pool:  # 12 puts queued behind the stand-in's 2 writers
            answers = list(pool.map(lambda i: server.post("/generate", {"input_ids": [8, 9, i]}), range(12)))
        assert all(code in (200, 500) for code, _ in answers), answers
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        try:
            rc = server.proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            pytest.fail("the stand-in did not end within 40 s of SIGTERM with its master dead")
        err = server.proc.stderr.read()
        assert "Traceback" not in err, err[-3000:]
        assert re.search(r"stand-in: \d+ store puts not started at shutdown were dropped", err), err[-3000:]
        print(f"ended in {time.monotonic() - t0:.1f} s, rc {rc}: {err[-500:]}")
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
        own.kill()


def test_a_request_past_the_context_length_is_refused_as_sglang_refuses_it(tmp_path):
    """SGLang's tokenizer manager answers HTTP 400 for a prompt of context-length tokens or
    more, and for one whose max_new_tokens would run past it (``_validate_one_request``'s
    sentences). The stand-in had no context length: ``extract --generate --max-new-tokens
    100000000`` made it generate until its memory ran out (14 GB, then MemoryError), and a
    killed client left it doing so."""
    s = Standin(tmp_path, "--dump-dir", str(tmp_path / "dump"), "--context-length", "16")
    try:
        prompt = [3, 1, 4, 1]
        code, ans = s.post("/generate", {"input_ids": list(range(16))})
        assert code == 400 and ans["error"]["message"] == (
            "The input (16 tokens) is longer than the model's context length (16 tokens)."), ans
        out = {"custom_params": {fmt.OUTPUT_PARAM: True}, "temperature": 0}
        code, ans = s.post("/generate", {"input_ids": prompt, "sampling_params": {**out, "max_new_tokens": 13}})
        assert code == 400 and ans["error"]["message"].startswith(
            "Requested token count exceeds the model's maximum context length of 16 tokens. You "
            "requested a total of 17 tokens: 4 tokens from the input messages and 13 tokens for the "
            "completion."), ans
        code, ans = s.post("/v1/completions", {"prompt": prompt, "max_tokens": 13})
        assert code == 400 and "a total of 17 tokens" in ans["error"]["message"], ans
        assert os.listdir(tmp_path / "dump") == []  # refused before anything was written
        code, ans = s.post("/generate", {"input_ids": prompt, "sampling_params": {**out, "max_new_tokens": 12}})
        assert code == 200 and ans["output_ids"] == generated_reference(prompt, 12), ans
        assert_output_file(ans["meta_info"][fmt.PATH_KEY], prompt, ans["output_ids"])
    finally:
        code, err = s.stop()
    assert code == 0 and "Traceback" not in err, err
    r = subprocess.run([sys.executable, "-m", "sglang_ext", "standin", "--dump-dir", str(tmp_path / "d"),
                        "--context-length", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr == "error: --context-length must be at least 2, not 1\n", r.stderr


def test_a_streamed_generate_is_answered_as_sglang_streams_it(standin, tmp_path):
    """``stream: true`` on /generate: SGLang's server-sent events (``data: <answer>``, then
    ``data: [DONE]``), the last chunk's meta_info naming the file; a refused request is an
    error chunk (HTTP 200, SGLang's stream_results). Before, the stand-in ignored ``stream``
    and answered one JSON object. /v1/completions does not stream here: HTTP 400."""
    def raw_post(path, body):
        req = urllib.request.Request(standin.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.headers["Content-Type"], r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.headers["Content-Type"], e.read().decode()

    code, kind, text = raw_post("/generate", {"input_ids": [1, 2, 3], "stream": True,
                                              "sampling_params": {"max_new_tokens": 1}})
    assert code == 200 and kind == "text/event-stream", (code, kind, text)
    events = text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1]), text
    last = json.loads(events[-3][len("data: "):])
    assert fmt.load(last["meta_info"][fmt.PATH_KEY]).token_ids.tolist() == [1, 2, 3]
    code, kind, text = raw_post("/generate", {"input_ids": [], "stream": True})
    assert code == 200 and text.endswith("\n\ndata: [DONE]\n\n"), text
    error = json.loads(text.split("\n\n")[0][len("data: "):])["error"]
    assert error["code"] == 400 and error["message"].startswith("input_ids must be one non-empty list"), error
    code, kind, text = raw_post("/v1/completions", {"prompt": [1, 2], "stream": True})
    assert code == 400 and "does not stream /v1/completions" in text, text
