"""``extract --store``: samples collected from a real ``mooncake_master``, no shared filesystem.

The fake server (a ``ThreadingHTTPServer`` on 127.0.0.1, in this process) answers
``/generate`` as a server started with ``--dump-hidden-states-dir mooncake://...`` does: with
``meta_info.hidden_states_manifest`` (``store.pack_layout(...).manifest(handle_for(rid))``),
and puts the packed sample into the master with ``store_client.StoreClient.put_packed``, before the
answer or after it (early), or ``<handle>:error`` instead. The reference for every
``hs_<i>.safetensors`` is the file sink's own path for the same tensors
(``tests/dumpfiles.write_dump``: ``format.reserve`` + ``file_layout``), compared byte for
byte. Fails (never skips) without Mooncake when run from tests/run.sh.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dumpfiles import write_dump
from fake_sglang_server import JsonHandler
from mooncake_fixture import HAVE_MOONCAKE, MiB, SilentMaster, _free_port, master_config, needs_mooncake

from sglang_ext import format as fmt
from sglang_ext import store as st
from sglang_ext.store_client import StoreClient
from sglang_ext.client import fetch
from sglang_ext.client.extract import EXIT_ABORTED, EXIT_BAD_INPUT, EXIT_FAILED
from sglang_ext.client.manifest import MANIFEST_NAME

REPO = Path(__file__).resolve().parents[2]
LAYERS = [2, 4, 5, 8]
NUM_LAYERS = 8
HIDDEN = 8


# ---- a real mooncake_master (tests/mooncake_fixture.py; the ``master`` fixture is conftest's) --


def trainer_url(master) -> str:
    """What the trainer side passes to ``--store``: lends no segment."""
    return f"mooncake://{master.address}?protocol=tcp&local_buffer_size=16MiB&local_hostname=127.0.0.1"


@pytest.fixture(scope="module")
def sink(master):
    """The fake server's producer client: its segment holds the samples."""
    s = StoreClient(st.StoreConfig.from_url(master_config(master, 64 * MiB))).connect()
    yield s
    s.close()


# ---- the fake server --------------------------------------------------------------------------
def sample(ids, dtype):
    """Tensors of one request, computed from (token id, position, slot, channel):
    hidden_states [T, 4, 8] of ``dtype``, fp8 scales [T, 4, 1] float32, token_ids int64."""
    ids_t = torch.tensor(ids, dtype=torch.float32)[:, None, None]
    t = torch.arange(len(ids), dtype=torch.float32)[:, None, None]
    s = torch.arange(len(LAYERS), dtype=torch.float32)[None, :, None]
    h = torch.arange(HIDDEN, dtype=torch.float32)[None, None, :]
    x = ids_t * 0.5 + t * 0.01 + s * 10 + h * 0.1
    scales = None
    if dtype == "float8_e4m3fn":
        scales = (ids_t + s + 1).expand(len(ids), len(LAYERS), 1).contiguous() / 64
    return x.to(getattr(torch, dtype)), scales, torch.tensor(ids, dtype=torch.int64)


def raw(t) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class StoreServer:
    """Answers ``/generate`` with a manifest and puts the sample into the store with ``sink``.

    ``early_s``: put that long after the answer (in a thread), else before it;
    ``error_first``: first token ids whose first ``error_tries`` tries get ``<handle>:error``;
    ``never_for``: first token ids whose object is never put; ``hold``: an Event puts
    wait for; ``wrong_ids_for``: objects holding other token ids; ``manifest_meta``: extra
    keys for the manifest's metadata; ``before_answer``: called (no arguments) before each
    answer."""

    def __init__(self, sink: StoreClient, dtype: str = "bfloat16"):
        self.sink = sink
        self.dtype = dtype
        self.early_s = None
        self.error_first = set()
        self.error_tries = 1
        self.never_for = set()
        self.wrong_ids_for = set()
        self.hold = None
        self.manifest_meta = {}
        self.delay = 0.0
        self.before_answer = None
        self.tensors = {}  # rid -> (hidden_states, scales, token_ids) put for it
        self.handles = []  # every handle answered
        self.counts = {}
        self.lock = threading.Lock()
        server = self

        class Handler(JsonHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/generate":
                    return self.reply(404, {"error": "not found"})
                self.reply(200, server.generate(body["input_ids"], body["rid"]))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def generate(self, ids, rid):
        with self.lock:
            n = self.counts[tuple(ids)] = self.counts.get(tuple(ids), 0) + 1
        if self.delay:
            time.sleep(self.delay)
        hs, scales, token_ids = sample(ids, self.dtype)
        handle = st.unique_handle(rid)
        layout = st.pack_layout(len(ids), len(LAYERS), HIDDEN, self.dtype)
        manifest = layout.manifest(handle)
        manifest["metadata"].update(self.manifest_meta)
        if ids[0] in self.wrong_ids_for:
            token_ids = token_ids + 1
        data = {"hidden_states": [raw(hs)], "token_ids": [raw(token_ids)]}
        if scales is not None:
            data["hidden_states_scales"] = [raw(scales)]
        with self.lock:
            self.tensors[rid] = (hs, scales, token_ids)
            self.handles.append(handle)
        fail = ids[0] in self.error_first and n <= self.error_tries

        def put():
            if self.hold is not None:
                self.hold.wait(60)
            if ids[0] in self.never_for:
                return
            if fail:
                self.sink.put_error(handle, "OSError: [Errno 28] No space left on device")
            else:
                self.sink.put_packed(handle, layout, data)

        if self.before_answer is not None:
            self.before_answer()
        if self.early_s is None and self.hold is None:
            put()
        else:
            def later():
                time.sleep(self.early_s or 0)
                put()
            threading.Thread(target=later, daemon=True).start()
        return {"text": "x", "meta_info": {"id": rid, "hidden_states_manifest": manifest}}

    def left_in_store(self):
        """Handles (or error markers) still in the store."""
        return [k for h in self.handles for k in (h, h + st.ERROR_SUFFIX) if self.sink.exists(k)]


@pytest.fixture
def server(sink):
    s = StoreServer(sink)
    yield s
    s.close()


# ---- helpers ----------------------------------------------------------------------------------
def rows(n):
    """n rows of 3..10 token ids; row i starts with 1000 + i (identifies it)."""
    return [[1000 + i] + [(i * 7 + k * 3) % 97 for k in range(2 + i % 8)] for i in range(n)]


def write_jsonl(path, data):
    with open(path, "w") as f:
        for ids in data:
            f.write(json.dumps({"input_ids": ids}) + "\n")
    return str(path)


def extract(server, data, out, *extra, store=None):
    args = ["extract", "--endpoint", server.url, "--data", str(data), "--out", str(out),
            "--no-progress", "--backoff", "0.01", "--max-backoff", "0.05",
            *(["--store", store] if store else []), *map(str, extra)]
    from sglang_ext.__main__ import main

    return main(args)


def hs_indices(out) -> set:
    return {int(m.group(1)) for m in map(re.compile(r"hs_(\d+)\.safetensors").fullmatch, os.listdir(out)) if m}


def manifest_lines(out):
    with open(os.path.join(out, MANIFEST_NAME)) as f:
        return [json.loads(line) for line in f]


def file_sink_twin(tmp_path, rid, tensors, extra=None) -> Path:
    """The file the file sink writes for ``rid``'s tensors (format.reserve, write_dump)."""
    hs, scales, token_ids = tensors
    directory = tmp_path / "file-sink"
    directory.mkdir(exist_ok=True)
    dir_fd = fmt.open_dump_dir(str(directory))
    try:
        res = fmt.reserve(dir_fd, rid)
        meta = fmt.build_metadata(rid=rid, layer_ids=LAYERS, num_layers=NUM_LAYERS, extra=extra)
        write_dump(res, hs, token_ids, meta, scales)
        fmt.complete(res)
    finally:
        os.close(dir_fd)
    return directory / res.name


def read(path):
    with safe_open(str(path), framework="pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}


# ---- the manifest check (no store needed) -----------------------------------------------------
def test_a_manifest_is_checked_against_the_request_before_anything_is_read():
    ids = [5, 6, 7]
    rid = "extract-0-0-ab"
    good = st.pack_layout(3, 4, 8, "bfloat16").manifest(st.handle_for(rid))
    exp = fetch.expect(good, rid, ids)
    assert exp.handle == "extract-0-0-ab" and exp.layout.total_bytes == good["metadata"]["total_aligned_bytes"]
    assert exp.metadata == {"format": fmt.FORMAT_VERSION, "rid": rid}

    def bad(change, words, shape=None):
        m = json.loads(json.dumps(good))
        change(m)
        with pytest.raises(fetch.FetchError, match=words):
            fetch.expect(m, rid, ids, shape)

    bad(lambda m: m.update(version=2), "version 2")
    suffixed = dict(good, handle=st.unique_handle(rid))  # what servers answer now
    assert fetch.expect(suffixed, rid, ids).handle == suffixed["handle"]
    assert suffixed["handle"] != good["handle"]
    bad(lambda m: m.update(handle="other"), "not a server handle")
    bad(lambda m: m.update(handle=rid + "-0123abc"), "not a server handle")  # 7 digits
    bad(lambda m: m.update(handle=rid + "-0123abcG"), "not a server handle")
    bad(lambda m: m.update(handle=rid + "-0123abcd-2"), "not a server handle")
    bad(lambda m: m.update(handle="extract-0-0-ac-0123abcd"), "not a server handle")  # another rid's
    bad(lambda m: m.update(handle=None), "not a server handle")
    bad(lambda m: m["tensors"]["hidden_states"].update(shape=[4, 4, 8]), "does not match")  # 4 rows, 3 tokens
    bad(lambda m: m["tensors"]["token_ids"].update(offset=0), "does not match")
    bad(lambda m: m["metadata"].update(total_aligned_bytes=10), "total_aligned_bytes 10")
    bad(lambda m: m["tensors"]["hidden_states"].update(dtype="torch.complex64"), "known dtype")
    bad(lambda m: m["metadata"].update(layer_ids="[1, 2]"), "do not name the 4 layer slots")
    with pytest.raises(fetch.OtherLayout, match="differ from the run's first sample"):  # the run stops
        fetch.expect(good, rid, ids, (4, 16, "bfloat16"))
    with pytest.raises(fetch.FetchError, match="not an object"):
        fetch.expect("x", rid, ids)
    # a server that adds the file's metadata to the manifest: it goes into the file
    carried = json.loads(json.dumps(good))
    carried["metadata"].update(layer_ids=LAYERS, num_layers=NUM_LAYERS, model_path="/m")
    assert fetch.expect(carried, rid, ids).metadata == {
        "format": fmt.FORMAT_VERSION, "rid": rid, "layer_ids": json.dumps(LAYERS), "num_layers": "8",
        "model_path": "/m"}
    # a chat request with images whose answer gave no prompt token ids: the manifest's own
    # token count stands (its offsets still checked); image_token_id goes into the file
    carried["metadata"].update(image_token_id=9)
    exp = fetch.expect(carried, rid, None)
    assert exp.layout == fetch.expect(good, rid, ids).layout and exp.metadata["image_token_id"] == "9"
    with pytest.raises(fetch.FetchError, match="does not describe hidden_states"):
        m = json.loads(json.dumps(good))
        m["tensors"]["hidden_states"]["shape"] = [0, 4, 8]
        fetch.expect(m, rid, None)



def test_a_manifest_of_an_empty_or_negative_shape_is_refused_even_when_self_consistent():
    """Issue 50 #9: a manifest whose tensors, offsets and total agree with themselves but
    describe [T, 0, H], a negative dimension or more values a row than extract takes is
    refused in one sentence before anything is read."""
    rid, ids = "extract-0-0-ab", [5, 6, 7]
    for dims in ((3, 0, 8), (3, -2, 8), (3, 2, -8), (3, 2, 1 << 22)):
        forged = st.pack_layout(*dims, "bfloat16").manifest(st.handle_for(rid))
        with pytest.raises(fetch.FetchError, match="does not describe hidden_states"):
            fetch.expect(forged, rid, ids)


def test_store_url_is_checked_before_anything_is_sent(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", rows(2))
    args = ["extract", "--endpoint", "http://127.0.0.1:9", "--data", data, "--out", str(tmp_path / "o"),
            "--no-progress", "--store"]
    from sglang_ext.__main__ import main

    assert main([*args, "http://127.0.0.1:50051"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "--store" in err and "mooncake://HOST:PORT" in err and "Traceback" not in err
    assert main([*args, "mooncake://127.0.0.1:50051?colour=red"]) == EXIT_BAD_INPUT
    assert "unknown mooncake setting 'colour'" in capsys.readouterr().err
    assert main([*args, "mooncake://127.0.0.1:50051", "--store-timeout", "0"]) == EXIT_BAD_INPUT
    assert "--store-timeout 0.0 must be a positive" in capsys.readouterr().err


# ---- against a real master --------------------------------------------------------------------
@needs_mooncake
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_store_samples_become_the_file_sinks_files_and_leave_the_store(
        master, sink, tmp_path, capsys, dtype):
    server = StoreServer(sink, dtype)
    try:
        data = rows(12)
        server.early_s = 0.05  # answered before the put, as the server always does
        out = tmp_path / "out"
        assert extract(server, write_jsonl(tmp_path / "d.jsonl", data), out, "--concurrency", 4,
                       store=trainer_url(master)) == 0
        summary = json.loads(capsys.readouterr().out.split("extract summary: ")[1])
        assert summary["extracted"] == 12 and summary["failed"] == 0
        assert hs_indices(out) == set(range(12))
        lines = manifest_lines(out)
        assert sorted(r["index"] for r in lines) == list(range(12))
        for rec in lines:
            i = rec["index"]
            meta, got = read(out / f"hs_{i}.safetensors")
            rid = meta["rid"]
            assert rid.startswith(f"extract-{i}-")
            handle = rec["source"].removeprefix(f"mooncake://127.0.0.1:{master.port}/")
            assert handle in server.handles and st.handle_matches(rid, handle), rec["source"]
            assert rec["num_tokens"] == len(data[i]) and rec["bytes"] == os.path.getsize(out / f"hs_{i}.safetensors")
            ref_meta, want = read(file_sink_twin(tmp_path, rid, server.tensors[rid]))
            assert list(got) == list(want), f"row {i}: keys {list(got)} vs the file sink's {list(want)}"
            for k in want:
                assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, (i, k)
                assert raw(got[k]) == raw(want[k]), f"row {i}: {k} bytes differ from the file sink's"
            # what a version-1 manifest cannot carry: the layer ids and the model's layer count
            assert meta == {k: v for k, v in ref_meta.items() if k not in ("layer_ids", "num_layers")}
            assert got["token_ids"].tolist() == data[i]
        assert server.left_in_store() == []
        assert not [n for n in os.listdir(out) if n.startswith(".")]  # no temporary file, no journal
    finally:
        server.close()


@needs_mooncake
def test_with_the_file_metadata_in_the_manifest_the_file_is_byte_identical(master, server, tmp_path):
    extra = {"model_path": "/models/x", "sglang_version": "0.5.23", "sglang_ext_version": "1",
             "series": "v0.5.23"}
    server.manifest_meta = {"layer_ids": json.dumps(LAYERS), "num_layers": NUM_LAYERS, **extra}
    data = rows(3)
    out = tmp_path / "out"
    assert extract(server, write_jsonl(tmp_path / "d.jsonl", data), out, store=trainer_url(master)) == 0
    for i in range(3):
        rid = read(out / f"hs_{i}.safetensors")[0]["rid"]
        twin = file_sink_twin(tmp_path, rid, server.tensors[rid], extra)
        assert (out / f"hs_{i}.safetensors").read_bytes() == twin.read_bytes()
        assert fmt.load(str(out / f"hs_{i}.safetensors")).layer_ids == LAYERS


@needs_mooncake
def test_an_error_marker_retries_the_row_and_is_removed(master, server, tmp_path, capsys):
    data = rows(4)
    server.error_first = {1000, 1002}
    server.early_s = 0.02
    out = tmp_path / "out"
    assert extract(server, write_jsonl(tmp_path / "d.jsonl", data), out, store=trainer_url(master)) == 0
    err = capsys.readouterr().err
    assert "row 2 (line 3 of d.jsonl): try 1 failed, retrying: the server failed the sample (extract-2-0-" in err
    assert "No space left on device" in err
    assert server.counts[tuple(data[0])] == 2 and server.counts[tuple(data[1])] == 1
    assert hs_indices(out) == set(range(4))
    assert server.left_in_store() == []  # markers too

    server.error_tries = 99  # every try fails: the row fails, the run goes on
    out2 = tmp_path / "out2"
    assert extract(server, write_jsonl(tmp_path / "d.jsonl", data), out2, "--max-retries", 1,
                   store=trainer_url(master)) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "row 0 (line 1 of d.jsonl): 2 tries failed; last: the server failed the sample" in err
    assert hs_indices(out2) == {1, 3}
    assert server.left_in_store() == []


@needs_mooncake
def test_a_missing_object_times_out_with_a_sentence(master, server, tmp_path, capsys):
    data = rows(3)
    server.never_for = {1001}
    out = tmp_path / "out"
    assert extract(server, write_jsonl(tmp_path / "d.jsonl", data), out, "--max-retries", 0,
                   "--store-timeout", 0.3, store=trainer_url(master)) == EXIT_FAILED
    err = capsys.readouterr().err
    assert re.search(r"row 1 \(line 2 of d\.jsonl\): 1 tries failed; last: the sample 'extract-1-0-[0-9a-f]{8}-[0-9a-f]{32}' did not appear "
                     r"in the Mooncake store at 127\.0\.0\.1:\d+ within 0\.3 s \(--store-timeout\)", err), err
    assert "or the master evicted it" in err, err  # put, then evicted, looks the same to a reader
    assert "Traceback" not in err
    assert hs_indices(out) == {0, 2}
    assert not (out / fetch.journal_path("", 0)).exists()  # swept at the end


@needs_mooncake
def test_other_token_ids_in_the_object_fail_the_try(master, server, tmp_path, capsys):
    data = rows(2)
    server.wrong_ids_for = {1001}
    out = tmp_path / "out"
    assert extract(server, write_jsonl(tmp_path / "d.jsonl", data), out, "--max-retries", 1,
                   store=trainer_url(master)) == EXIT_FAILED
    assert "holds other token ids than the request's" in capsys.readouterr().err
    assert hs_indices(out) == {0}
    assert server.left_in_store() == []


@needs_mooncake
def test_a_manifest_without_store_is_one_sentence_naming_the_flag(server, tmp_path, capsys):
    out = tmp_path / "out"
    assert extract(server, write_jsonl(tmp_path / "d.jsonl", rows(3)), out) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "puts its samples into a Mooncake Store" in err and "pass --store mooncake://HOST:PORT" in err
    assert "Traceback" not in err
    assert not out.exists()  # the run left it empty: removed (issue 51)


def test_an_unreachable_master_is_one_sentence(tmp_path, capsys):
    if not HAVE_MOONCAKE:
        pytest.skip("mooncake not importable")
    s = StoreServer(sink=None)
    try:
        url = f"mooncake://127.0.0.1:{_free_port()}?protocol=tcp&local_hostname=127.0.0.1"
        assert extract(s, write_jsonl(tmp_path / "d.jsonl", rows(1)), tmp_path / "o", store=url) == EXIT_ABORTED
        err = capsys.readouterr().err
        assert "cannot reach the Mooncake master at 127.0.0.1:" in err and "Traceback" not in err
        assert s.counts == {}  # nothing sent
    finally:
        s.close()


@needs_mooncake
@pytest.mark.parametrize("sigterm", [False, True])
def test_a_master_that_never_answers_is_one_sentence_and_sigterm_ends_the_wait(tmp_path, sigterm):
    """A master that accepts connections and never answers: Mooncake's set-up runs in a
    subprocess with a deadline, so the run ends with one sentence, or at once on SIGTERM
    (exit 143), and nothing is sent (before: setup held the GIL, SIGTERM waited minutes)."""
    silent = SilentMaster()
    s = StoreServer(sink=None)
    proc = None
    try:
        data = write_jsonl(tmp_path / "d.jsonl", rows(1))
        url = f"mooncake://{silent.address}?protocol=tcp&local_hostname=127.0.0.1"
        proc = subprocess.Popen([sys.executable, "-m", "sglang_ext", "extract", "--endpoint", s.url, "--data",
                                 data, "--out", str(tmp_path / "o"), "--no-progress", "--store", url],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if sigterm:  # once the set-up's subprocess runs (extract's handlers are in place by then)
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
            deadline = time.monotonic() + 60
            while not children.read_text().split() and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        if sigterm:
            assert proc.returncode == 143 and "terminated (SIGTERM)" in err, err
        else:
            assert proc.returncode == EXIT_ABORTED, err
            assert f"the Mooncake master at {silent.address} accepts connections but did not complete " \
                   f"Mooncake's client set-up" in err, err
        assert "Traceback" not in err and s.counts == {}
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        s.close()
        silent.close()


@needs_mooncake
@pytest.mark.parametrize("mode", [0o620, 0o602])
def test_a_store_journal_others_may_write_is_refused(master, server, tmp_path, capsys, mode):
    """``OUT/.extract-store-rank0.jsonl`` names objects the run removes from the store: a
    journal group or others may write is not read (one sentence, exit 2, nothing sent)."""
    out = tmp_path / "out"
    out.mkdir()
    journal = out / ".extract-store-rank0.jsonl"
    journal.write_text(json.dumps({"index": 0, "rid": "extract-0-0-0123abcd"}) + "\n")
    journal.chmod(mode)
    code = extract(server, write_jsonl(tmp_path / "d.jsonl", rows(1)), out, store=trainer_url(master))
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT, err
    assert f"the store journal {journal} is writable by group or others (mode {mode:o})" in err, err
    assert "Traceback" not in err and server.counts == {}


@needs_mooncake
def test_a_forged_store_journal_removes_no_other_runs_objects(master, server, sink, tmp_path):
    """Journal records naming objects this run could not have made (a rid of another shape,
    a handle that is not the server's for its rid) are ignored: another run's objects stay."""
    victims = [st.unique_handle("other-run-7"), st.unique_handle("extract-0-0-0123abcd") + "x",
               "trainer_cache"]
    for h in victims:
        sink.put(h, [b"v" * 64])
    out = tmp_path / "out"
    out.mkdir()
    journal = out / ".extract-store-rank0.jsonl"
    layout = st.pack_layout(3, len(LAYERS), HIDDEN, "bfloat16")
    recs = [{"index": 0, "rid": "other-run-7"},
            {"index": 0, "rid": "other-run-7", "manifest": layout.manifest(victims[0])},
            {"index": 0, "rid": "extract-0-0-0123abcd", "manifest": layout.manifest(victims[1])},
            {"index": 0, "rid": "extract-0-0-0123abcd", "manifest": layout.manifest("trainer_cache")}]
    journal.write_text("".join(json.dumps(r) + "\n" for r in recs))
    journal.chmod(0o600)
    try:
        assert extract(server, write_jsonl(tmp_path / "d.jsonl", rows(2)), out, store=trainer_url(master)) == 0
        assert [h for h in victims if not sink.exists(h)] == []
    finally:
        for h in victims:
            sink.remove(h)


def test_without_the_mooncake_package_is_one_sentence(tmp_path):
    s = StoreServer(sink=None)
    try:
        data = write_jsonl(tmp_path / "d.jsonl", rows(1))
        code = ("import sys; sys.modules['mooncake'] = None; sys.modules['mooncake.store'] = None\n"
                "from sglang_ext.__main__ import main\n"
                f"sys.exit(main(['extract', '--endpoint', {s.url!r}, '--data', {data!r}, '--out', "
                f"{str(tmp_path / 'o')!r}, '--no-progress', '--store', 'mooncake://127.0.0.1:1']))")
        r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert r.returncode == EXIT_BAD_INPUT, r.stderr
        assert "--store needs the mooncake package (pip install -r requirements/store.txt)" in r.stderr
        assert "Traceback" not in r.stderr and s.counts == {}
    finally:
        s.close()


def test_mooncake_missing_a_shared_library_is_one_sentence_quoting_it(tmp_path):
    """A mooncake whose extension cannot load (libibverbs missing: an ImportError from
    ``mooncake.store``, not from ``find_spec``): one sentence quoting the loader."""
    pkg = tmp_path / "lib" / "mooncake"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "store.py").write_text("raise ImportError('libibverbs.so.1: cannot open shared object file: "
                                  "No such file or directory')\n")
    s = StoreServer(sink=None)
    try:
        data = write_jsonl(tmp_path / "d.jsonl", rows(1))
        code = (f"import sys; sys.path.insert(0, {str(tmp_path / 'lib')!r})\n"
                "from sglang_ext.__main__ import main\n"
                f"sys.exit(main(['extract', '--endpoint', {s.url!r}, '--data', {data!r}, '--out', "
                f"{str(tmp_path / 'o')!r}, '--no-progress', '--store', 'mooncake://127.0.0.1:1']))")
        r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert r.returncode == EXIT_BAD_INPUT, r.stderr
        assert ("--store cannot import mooncake.store (libibverbs.so.1: cannot open shared object file: "
                "No such file or directory): install what it names (Debian: libibverbs1") in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and s.counts == {}
    finally:
        s.close()


def _cmd(server, data, out, master):
    return [sys.executable, "-m", "sglang_ext", "extract", "--endpoint", server.url, "--data", data,
            "--out", str(out), "--concurrency", "4", "--no-progress", "--store", trainer_url(master)]


@needs_mooncake
def test_a_master_that_dies_mid_run_stops_the_run_at_the_first_try(tmp_path):
    """The master dies after extract connected (the server answered, its put never came):
    the client's look-up of the sample finds no master, which no retry can change, so the
    run stops at that try, one sentence naming the master (exit 3). Before, each row was
    requested again (a new prefill per try) until --max-consecutive-failures."""
    from mooncake_fixture import Master

    master = Master(tmp_path)
    s = StoreServer(sink=None)
    try:
        data = rows(3)
        s.never_for = {ids[0] for ids in data}  # the put is the dead master's: never there
        s.before_answer = master.kill  # dies once the first request is in
        r = subprocess.run([*_cmd(s, write_jsonl(tmp_path / "d.jsonl", data), tmp_path / "out", master),
                            "--concurrency", "1", "--no-early-answers", "--max-retries", "2",
                            "--max-consecutive-failures", "2"],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
        assert r.returncode == EXIT_ABORTED, r.stderr
        assert len(errors) == 1 and errors[0].startswith(
            f"error: row 0 (line 1 of d.jsonl): cannot reach the Mooncake master at {master.address} ("), r.stderr
        assert errors[0].endswith("so every next try would fail alike; start mooncake_master there again "
                                  "and run the same command again to resume"), r.stderr
        assert "retrying" not in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert sum(s.counts.values()) == 1, s.counts  # one request: no try sent again
        assert hs_indices(tmp_path / "out") == set()
    finally:
        s.close()
        master.kill()


@needs_mooncake
def test_once_the_master_is_found_gone_no_other_try_asks_it_again(tmp_path):
    """The first look-up that finds the master dead (its port refusing connections) stops
    the run; the run's other tries, already waiting on their objects, then stop at once
    instead of each asking the dead master and waiting out Mooncake's RPC timeout: an
    extract run at --concurrency 32 printed its error line and exited 44 s later. Removals
    are not asked either: the objects stay journaled for the next run. The fetcher's real
    Mooncake client is wrapped only to count the calls that reach it."""
    import asyncio

    from mooncake_fixture import Master

    master = Master(tmp_path)
    fetcher = fetch.StoreFetcher(trainer_url(master), str(tmp_path), 0).connect()
    real, calls = fetcher.client, []

    class Counting:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)

    try:
        assert fetcher.state("extract-0-0-aaaaaaaa-" + "0" * 32) is None  # the master answers
        master.kill()
        with pytest.raises(fetch.FatalError) as first:
            fetcher.state("extract-0-0-aaaaaaaa-" + "0" * 32)
        assert str(first.value).startswith(f"cannot reach the Mooncake master at {master.address} (")
        fetcher.client = Counting()
        with pytest.raises(fetch.FatalError) as again:
            fetcher.state("extract-1-0-bbbbbbbb-" + "1" * 32)
        assert str(again.value) == str(first.value)
        assert asyncio.run(fetcher.remove("extract-1-0-bbbbbbbb-" + "1" * 32)) is False
        assert calls == [], calls  # neither went to the dead master
    finally:
        fetcher.client = real
        fetcher.close()
        master.kill()


@needs_mooncake
def test_a_good_run_prints_no_mooncake_set_up_noise(master, server, tmp_path):
    """Mooncake logs ``E... Local segment descriptor not found`` at every client's set-up
    (its transfer engine looks up the client's own segment before registering it); a good
    ``extract --store`` run keeps it off the user's terminal (issue 51)."""
    path = write_jsonl(tmp_path / "d.jsonl", rows(2))
    r = subprocess.run(_cmd(server, path, tmp_path / "out", master), cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Local segment descriptor not found" not in r.stderr, r.stderr
    assert hs_indices(tmp_path / "out") == {0, 1}


@needs_mooncake
@pytest.mark.parametrize("prefix", [None, ""])
def test_killed_while_waiting_then_rerun_takes_the_journaled_objects_without_asking_again(
        master, server, tmp_path, prefix):
    """``prefix`` "": --rid-prefix "" (rids ``-<i>-<try>-<8 hex>``) is journaled as any
    (before, the rerun found none of its records its own: every row asked again, the
    killed run's objects left in the store)."""
    data = rows(6)
    path = write_jsonl(tmp_path / "d.jsonl", data)
    out = tmp_path / "out"
    server.hold = threading.Event()  # answered at once, put only when the test says
    cmd = _cmd(server, path, out, master) + ([] if prefix is None else [f"--rid-prefix={prefix}"])
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while sum(server.counts.values()) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the answers are journaled before the waits start
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert sum(server.counts.values()) == 6 and hs_indices(out) == set()
    server.hold.set()
    deadline = time.monotonic() + 10
    while sum(map(server.sink.exists, server.handles)) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.split("extract summary: ")[1])["extracted"] == 6
    assert all(server.counts[tuple(ids)] == 1 for ids in data)  # taken from the store, not asked again
    assert sorted(rec["index"] for rec in manifest_lines(out)) == list(range(6))
    for i, ids in enumerate(data):
        assert read(out / f"hs_{i}.safetensors")[1]["token_ids"].tolist() == ids
    assert server.left_in_store() == []
    assert not [n for n in os.listdir(out) if n.startswith(".")]


@needs_mooncake
def test_killed_half_way_then_rerun_takes_every_row_once(master, server, tmp_path):
    data = rows(40)
    path = write_jsonl(tmp_path / "d.jsonl", data)
    out = tmp_path / "out"
    server.delay = 0.03
    server.early_s = 0.02
    proc = subprocess.Popen(_cmd(server, path, out, master), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if out.exists() and len(hs_indices(out)) >= 10:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_at_kill = hs_indices(out)
    assert 10 <= len(done_at_kill) < 40, "kill came too late to test anything"

    server.delay = 0.0
    time.sleep(0.1)  # the killed run's last puts land
    r = subprocess.run(_cmd(server, path, out, master), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.split("extract summary: ")[1])
    assert summary["resumed"] == len(done_at_kill)
    assert summary["resumed"] + summary["extracted"] == 40
    lines = manifest_lines(out)
    assert sorted(rec["index"] for rec in lines) == list(range(40))  # one line per row
    for i, ids in enumerate(data):
        assert read(out / f"hs_{i}.safetensors")[1]["token_ids"].tolist() == ids
    for i in done_at_kill:  # finished before the kill: never requested again
        assert server.counts[tuple(data[i])] == 1
    assert server.left_in_store() == []  # taken or given up, every object is gone
    assert not [n for n in os.listdir(out) if n.startswith(".")]


@needs_mooncake
def test_a_server_of_another_configuration_mid_run_stops_the_run(master, server, tmp_path, capsys):
    """The server answers rows 0 and 1 in bf16, then (restarted with other flags, or
    another server behind the endpoint) in fp16: no retry can change that, so the run
    stops at the first such answer with the file path's sentence (exit 3), asking the
    server once for each row; before, every later row was asked 1 + --max-retries times,
    each refused as 'differ from the run's first sample', until --max-consecutive-failures."""
    data = rows(6)
    path = write_jsonl(tmp_path / "d.jsonl", data)
    out = tmp_path / "out"

    def switch():
        if sum(server.counts.values()) > 1:
            server.dtype = "float16"

    server.before_answer = switch
    rc = extract(server, path, out, "--concurrency", 1, "--max-retries", 3, store=trainer_url(master))
    err = capsys.readouterr().err
    assert rc == EXIT_ABORTED, err
    assert "one dataset of two server configurations" in err and "float16" in err, err
    assert set(server.counts.values()) == {1}, server.counts
    assert hs_indices(out) == {0, 1}
    server.before_answer, server.dtype = None, "bfloat16"  # the server as it was: the rerun completes
    assert extract(server, path, out, "--concurrency", 1, store=trainer_url(master)) == 0
    assert hs_indices(out) == set(range(6))
    assert server.left_in_store() == []  # the stopped run's objects too (its journal)
