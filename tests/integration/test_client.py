"""extract / convert / the vLLM-compatible completions hook, against a local fake server.

The fake server (a ``ThreadingHTTPServer`` on 127.0.0.1) answers ``/generate`` (and, for
prompts with images, ``/v1/chat/completions``: ``render_chat`` stands in for the chat template
and image processor, the answer is SGLang 0.5.23's ``ChatCompletionResponse`` plus the
top-level ``kv_transfer_params`` the chat patch adds) as the patched SGLang does: it writes each request's file through ``sglang_ext.format``'s real
writer path (reserve -> write -> complete, so the ``.lock`` is gone before the
answer) and names it in ``meta_info.hidden_states_path``. Its ``/v1/completions`` builds
SGLang 0.5.17's own ``CompletionResponse`` (with ``prompt_token_ids`` as SGLang returns
them for ``return_token_ids``) and passes it through ``hooks.openai_completion_extras``,
as patch 0006 does.

Expected tensors never come from the code under test: ``reference(ids)`` computes every
value from (token id, position, layer slot, channel).

The trainer readers are the real packages, installed --no-deps (requirements/ci-nodeps.txt):
speculators 0.9.0 (``speculators.train.data.ArrowDataset`` with ``hs_connectors.FileTransfer``;
its offline generator ``speculators.cli.generate_offline_data``) and specforge 0.2.0
(``specforge.data.preprocessing.build_offline_eagle3_dataset``). A test whose package does
not import is skipped, saying so; it never falls back to a re-implementation.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dumpfiles import write_dump
from fake_sglang_server import JsonHandler

from sglang_ext import hooks
from sglang_ext.responses import HiddenStatesDumpError
from sglang_ext.client import convert
from sglang_ext.client.checks import CheckError, check_file
from sglang_ext.client.dumpdir import DumpDir, move_into_place
from sglang_ext.client.extract import EXIT_ABORTED, EXIT_BAD_INPUT, EXIT_FAILED
from sglang_ext.client.http import backoff_delay
from sglang_ext.client.manifest import MANIFEST_NAME
from sglang_ext import format as fmt

LAYERS = [2, 4, 5, 8]  # N = 8: aux [2, N//2, N-3] plus N
NUM_LAYERS = 8
HIDDEN = 8
REPO = Path(__file__).resolve().parents[2]


def reference(ids) -> torch.Tensor:
    """[T, L, H] float32: id*0.5 + position*0.01 + slot*10 + channel*0.1 (exact in f32)."""
    ids_t = torch.tensor(ids, dtype=torch.float32)[:, None, None]
    t = torch.arange(len(ids), dtype=torch.float32)[:, None, None]
    s = torch.arange(len(LAYERS), dtype=torch.float32)[None, :, None]
    h = torch.arange(HIDDEN, dtype=torch.float32)[None, None, :]
    return ids_t * 0.5 + t * 0.01 + s * 10 + h * 0.1


def rows(n, seed=0):
    """n rows of 3..10 token ids; row i starts with 1000 + i (identifies it)."""
    return [[1000 + i] + [(seed + i * 7 + k * 3) % 97 for k in range(2 + i % 8)] for i in range(n)]


def write_jsonl(path, data, masks=None):
    with open(path, "w") as f:
        for i, ids in enumerate(data):
            row = {"input_ids": ids}
            if masks is not None:
                row["loss_mask"] = masks[i]
            f.write(json.dumps(row) + "\n")
    return str(path)


# ---- the fake server's chat template and image processor (a stand-in for SGLang's) --------
BOS, TURN_END, IMAGE_START, IMAGE_END, IMAGE_TOKEN = 1, 2, 7, 8, 9
ROLE_IDS = {"system": 13, "user": 11, "assistant": 12}


def word_id(word):
    """A word's token id: 1000 + n for a number n, else 100..899 from its bytes."""
    return 1000 + int(word) if word.isdigit() else 100 + sum(word.encode()) % 800


def image_bytes(url):
    """An image's bytes as the server gets them: a data URL decoded, a file:// path read
    (ValueError, SGLang's HTTP 400, when it cannot be)."""
    import base64
    from urllib.parse import unquote, urlsplit

    if url.startswith("data:"):
        return base64.b64decode(url.split(",", 1)[1])
    if url.startswith("file://"):
        try:
            return Path(unquote(urlsplit(url).path)).read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read the image {url}: {e.strerror}") from None
    raise ValueError(f"cannot fetch the image {url} (no network here)")


def render_chat(messages, continue_final=False):
    """The prompt's token ids: BOS, per message its role id, its words and images, TURN_END
    (not after a continued final assistant message), then the generation prompt (the
    assistant's role id) unless continued. Each image is IMAGE_START, IMAGE_TOKEN * (2 +
    its size % 5), IMAGE_END, as a processor expands its placeholder."""
    ids = [BOS]
    for k, m in enumerate(messages):
        ids.append(ROLE_IDS[m["role"]])
        content = m["content"]
        for part in ([{"type": "text", "text": content}] if isinstance(content, str) else content):
            if part["type"] == "text":
                ids += [word_id(w) for w in part["text"].split()]
            elif part["type"] == "image_url" and isinstance(part.get("image_url"), dict):
                n = 2 + len(image_bytes(part["image_url"]["url"])) % 5
                ids += [IMAGE_START] + [IMAGE_TOKEN] * n + [IMAGE_END]
            else:
                raise ValueError(f"unsupported content part {part}")
        if not (continue_final and k == len(messages) - 1 and m["role"] == "assistant"):
            ids.append(TURN_END)
    if not (continue_final and messages[-1]["role"] == "assistant"):
        ids.append(ROLE_IDS["assistant"])
    return ids


# ---- the fake server ---------------------------------------------------------------------
class FakeServer:
    def __init__(self, dump_dir):
        self.dump_dir = str(dump_dir)
        os.makedirs(self.dump_dir, exist_ok=True)
        self.dir_fd = fmt.open_dump_dir(self.dump_dir)
        self.fail_first = 0  # fail the first k tries of every input (500, then dump error)
        self.always_fail = False
        self.nan_for = set()  # first token ids whose file holds a NaN
        self.wrong_ids_for = set()  # first token ids whose file has other token ids
        self.delay = 0.0
        self.early_write_s = None  # honor hidden_states_wait=false: answer, write this much later
        self.fail_write_once = set()  # first token ids whose first write fails (<path>.error)
        self.asked_early = 0
        self.pending = self.max_pending = 0
        self.counts = {}
        self.chat_bodies = []  # every /v1/chat/completions body, as received
        self.generate_calls = 0  # POST /generate requests
        self.chat_kv = True  # chat answers carry kv_transfer_params (the patched server)
        self.chat_meta = True  # ... and choices[0].meta_info when asked (return_meta_info)
        self.image_meta = True  # files of chat requests name image_token_id in their metadata
        self.lock = threading.Lock()
        # requests being answered and early writes not done: close() waits for them, so none
        # writes through dir_fd after it is closed (its number reused by the next test's
        # server: a timed-out request's late file once landed in another test's directory)
        self.busy = 0
        self.idle = threading.Condition(self.lock)
        server = self

        class Handler(JsonHandler):  # the fake servers' JSON replies (fake_sglang_server)
            def do_GET(self):
                if self.path == "/v1/models":
                    self.reply(200, {"object": "list", "data": [
                        {"id": "fake-model", "object": "model", "created": 0, "owned_by": "t"}]})
                elif self.path == "/health":  # SGLang's; extract probes it before any row
                    self.reply(200, {})
                else:
                    self.reply(404, {"error": "not found"})

            def do_POST(self):
                server.enter()
                try:
                    self.post()
                finally:
                    server.leave()

            def post(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/generate":
                    server.generate_calls += 1
                    params = (body.get("sampling_params") or {}).get("custom_params") or {}
                    code, obj = server.generate(body["input_ids"], body.get("rid", "r"),
                                                early=params.get(fmt.WAIT_PARAM) is False)
                elif self.path == "/v1/completions":
                    code, obj = server.completions(body)
                elif self.path == "/v1/chat/completions":
                    code, obj = server.chat(body)
                else:
                    code, obj = 404, {"error": "not found"}
                self.reply(code, obj)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def enter(self):
        with self.idle:
            self.busy += 1

    def leave(self):
        with self.idle:
            self.busy -= 1
            self.idle.notify_all()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        with self.idle:
            assert self.idle.wait_for(lambda: self.busy == 0, timeout=120), "a request never finished"
        os.close(self.dir_fd)

    def dump(self, ids, rid, early=False, extra=None):
        """Write the file as the patched server does; returns meta_info. ``early`` (and
        ``early_write_s`` set): answer with the name reserved, write in a thread later."""
        hs = reference(ids)
        token_ids = torch.tensor(ids, dtype=torch.int64)
        if ids[0] in self.nan_for:
            hs[len(ids) // 2, 1, 3] = float("nan")
        if ids[0] in self.wrong_ids_for:
            token_ids = token_ids + 1
        res = fmt.reserve(self.dir_fd, rid)
        meta = fmt.build_metadata(rid=rid, layer_ids=LAYERS, num_layers=NUM_LAYERS, extra=extra)
        info = {"id": rid, "hidden_states_path": os.path.join(self.dump_dir, res.name)}

        with self.lock:
            fail = ids[0] in self.fail_write_once
            self.fail_write_once.discard(ids[0])

        def write():
            if fail:  # as the writer does when a write fails after an early answer
                fmt.fail(res, "OSError: [Errno 28] No space left on device")
                return
            write_dump(res, hs, token_ids, meta)
            fmt.complete(res)

        if early and self.early_write_s is not None:
            with self.lock:
                self.asked_early += 1
                self.pending += 1
                self.max_pending = max(self.max_pending, self.pending)
            self.enter()

            def later():
                try:
                    time.sleep(self.early_write_s)
                    with self.lock:
                        self.pending -= 1
                    write()
                finally:
                    self.leave()

            threading.Thread(target=later, daemon=True).start()
            return info | {fmt.PENDING_KEY: True}
        write()
        return info

    def generate(self, ids, rid, early=False, extra=None):
        with self.lock:
            key = tuple(ids)
            n = self.counts[key] = self.counts.get(key, 0) + 1
        if self.delay:
            time.sleep(self.delay)
        if self.always_fail or n <= self.fail_first:
            if n % 2 == 1:
                return 500, {"error": "injected"}
            return 200, {"text": "", "meta_info": {"id": rid, "hidden_states_error": "injected"}}
        return 200, {"text": "x", "meta_info": self.dump(ids, rid, early, extra)}

    def chat(self, body):
        """``/v1/chat/completions`` as the patched server answers it (``render_chat``
        stands in for the chat template and the image processor; an image it cannot read
        is HTTP 400, a failed dump HTTP 500 as ``openai_completion_extras`` raises)."""
        from sglang.srt.entrypoints.openai.protocol import (
            ChatCompletionResponse,
            ChatCompletionResponseChoice,
            ChatMessage,
            UsageInfo,
        )

        with self.lock:
            self.chat_bodies.append(body)
        try:
            ids = render_chat(body["messages"], body.get("continue_final_message", False))
        except ValueError as e:
            return 400, {"object": "error", "message": str(e), "code": 400}
        rid = body.get("rid", "chat")
        params = body.get("custom_params") or {}
        extra = {"image_token_id": str(IMAGE_TOKEN)} if self.image_meta else None
        code, ret = self.generate(ids, rid, early=params.get(fmt.WAIT_PARAM) is False, extra=extra)
        if code != 200:
            return code, ret
        meta = ret["meta_info"]
        if meta.get(fmt.ERROR_KEY):
            return 500, {"object": "error", "message": f"hidden-state dump failed: {meta[fmt.ERROR_KEY]}"}
        response = ChatCompletionResponse(
            id="chatcmpl-1", model="m",
            choices=[ChatCompletionResponseChoice(
                index=0, message=ChatMessage(role="assistant", content="x"), finish_reason="length",
                prompt_token_ids=list(ids) if body.get("return_prompt_token_ids") else None,
                meta_info=meta if body.get("return_meta_info") and self.chat_meta else None,
            )],
            usage=UsageInfo(prompt_tokens=len(ids), completion_tokens=1, total_tokens=len(ids) + 1),
        ).model_dump(mode="json")
        if self.chat_kv:
            response["kv_transfer_params"] = {fmt.PATH_KEY: meta[fmt.PATH_KEY]}
        return 200, response

    def completions(self, body):
        from sglang.srt.entrypoints.openai.protocol import (
            CompletionResponse,
            CompletionResponseChoice,
            UsageInfo,
        )

        ids = body["prompt"]
        with self.lock:
            self.counts[tuple(ids)] = self.counts.get(tuple(ids), 0) + 1
        ret = {"text": "x", "output_ids": [5], "meta_info": self.dump(ids, f"cmpl-{ids[0]}")}
        if body.get("return_token_ids"):
            ret["prompt_token_ids"] = list(ids)  # what tokenizer_manager adds (0.5.17)
        # As serving_completions._build_completion_response builds it:
        response = CompletionResponse(
            id="cmpl-1", model=body.get("model", "m"),
            choices=[CompletionResponseChoice(
                index=0, text=ret["text"], finish_reason="length",
                token_ids=ret["output_ids"] if body.get("return_token_ids") else None,
                prompt_token_ids=ret.get("prompt_token_ids") if body.get("return_token_ids") else None,
            )],
            usage=UsageInfo(prompt_tokens=len(ids), completion_tokens=1, total_tokens=len(ids) + 1),
        )
        response = hooks.openai_completion_extras(response, [ret])  # patch 0006
        return 200, response.model_dump(mode="json")


@pytest.fixture
def server(tmp_path):
    s = FakeServer(tmp_path / "server")
    yield s
    s.close()


def extract(server, data, out, *extra):
    args = ["extract", "--endpoint", server.url, "--data", str(data), "--out", str(out),
            "--no-progress", "--backoff", "0.01", "--max-backoff", "0.05", *map(str, extra)]
    from sglang_ext.__main__ import main

    return main(args)


def assert_file(path, ids):
    rec = fmt.load(str(path))
    assert rec.token_ids.tolist() == ids
    assert torch.equal(rec.hidden_states, reference(ids))


def hs_indices(out) -> set:
    """The row indices i of the OUT/hs_<i>.safetensors files (listed, not through the client)."""
    return {int(m.group(1)) for m in map(re.compile(r"hs_(\d+)\.safetensors").fullmatch, os.listdir(out)) if m}


def manifest_indices(out):
    with open(os.path.join(out, MANIFEST_NAME)) as f:
        return [json.loads(line)["index"] for line in f]


# ---- extract ---------------------------------------------------------------------------------
def test_extract_writes_every_row_moves_files_and_records_a_manifest(server, tmp_path, capsys):
    data = rows(12)
    out = tmp_path / "out"
    assert extract(server, write_jsonl(tmp_path / "d.jsonl", data), out, "--concurrency", 4) == 0
    for i, ids in enumerate(data):
        assert_file(out / f"hs_{i}.safetensors", ids)
    # moved (renamed), not copied: the server's directory keeps no safetensors file
    assert not [n for n in os.listdir(server.dump_dir) if n.endswith(".safetensors")]
    assert sorted(manifest_indices(out)) == list(range(12))
    rec = {r["index"]: r for r in map(json.loads, open(out / MANIFEST_NAME))}
    assert rec[3]["num_tokens"] == len(data[3])
    assert rec[3]["source"].startswith(server.dump_dir)
    assert not [n for n in os.listdir(out) if n.startswith(".")]
    summary = json.loads(capsys.readouterr().out.split("extract summary: ")[1])
    assert summary["extracted"] == 12 and summary["failed"] == 0
    assert summary["tokens"] == sum(map(len, data))


def test_early_answers_let_the_next_prompt_go_while_files_are_written(server, tmp_path):
    """extract asks for early answers (custom_params hidden_states_wait=false) and waits on
    each file's lock itself: with --concurrency 1, a second prompt is sent while the first
    file is still being written (two files pending at once), and every file is right."""
    server.early_write_s = 0.3
    data = rows(6)
    write_jsonl(tmp_path / "d.jsonl", data)
    assert extract(server, tmp_path / "d.jsonl", tmp_path / "out", "--concurrency", 1) == 0
    assert server.asked_early == 6
    assert server.max_pending >= 2
    for i, ids in enumerate(data):
        assert_file(tmp_path / "out" / f"hs_{i}.safetensors", ids)
    # --no-early-answers: the requests do not ask, so the server answers after each write
    write_jsonl(tmp_path / "e.jsonl", rows(3, seed=7))
    assert extract(server, tmp_path / "e.jsonl", tmp_path / "out2", "--no-early-answers") == 0
    assert server.asked_early == 6


def test_write_failed_after_an_early_answer_is_retried_and_its_error_file_removed(
        server, tmp_path, capsys):
    """The server answered early, then the write failed (<path>.error): the try fails with
    the server's message, the row is extracted on the next try, and the consumed .error
    file is gone from the dump directory."""
    server.early_write_s = 0.05
    data = rows(4)
    server.fail_write_once = {data[1][0], data[3][0]}
    write_jsonl(tmp_path / "d.jsonl", data)
    assert extract(server, tmp_path / "d.jsonl", tmp_path / "out", "--backoff", "0.01") == 0
    for i, ids in enumerate(data):
        assert_file(tmp_path / "out" / f"hs_{i}.safetensors", ids)
    err = capsys.readouterr().err
    assert err.count("No space left on device") == 2, err
    assert not [n for n in os.listdir(server.dump_dir) if n.endswith(fmt.ERROR_SUFFIX)]


def test_retries_with_backoff_then_succeed(server, tmp_path, capsys):
    server.fail_first = 2  # an HTTP 500, then a hidden_states_error, then success
    data = rows(5)
    out = tmp_path / "out"
    t0 = time.monotonic()
    rc = extract(server, write_jsonl(tmp_path / "d.jsonl", data), out,
                 "--max-retries", 2, "--backoff", 0.2, "--max-backoff", 1)
    assert rc == 0
    assert time.monotonic() - t0 >= 0.2 + 0.4  # two back-offs: 0.2 s then 0.4 s
    assert set(server.counts.values()) == {3}
    for i, ids in enumerate(data):
        assert_file(out / f"hs_{i}.safetensors", ids)
    captured = capsys.readouterr()
    assert json.loads(captured.out.split("extract summary: ")[1])["retries"] == 10
    # each failed try that is retried is reported as it happens
    assert captured.err.count("failed, retrying: HTTP 500") == 5
    assert captured.err.count("failed, retrying: hidden_states_error: injected") == 5


def test_backoff_delay_doubles_and_caps():
    for attempt, base in [(1, 1.0), (2, 2.0), (3, 4.0), (6, 10.0), (9, 10.0)]:
        d = backoff_delay(attempt, 1.0, 10.0)
        assert base <= d <= base * 1.25


def test_too_few_retries_fail_the_samples(server, tmp_path):
    server.fail_first = 2
    out = tmp_path / "out"
    rc = extract(server, write_jsonl(tmp_path / "d.jsonl", rows(3)), out, "--max-retries", 1,
                 "--concurrency", 1)
    assert rc == EXIT_FAILED
    assert not [n for n in os.listdir(out) if n.startswith("hs_")]


def test_abort_after_consecutive_failures(server, tmp_path, capsys):
    server.always_fail = True
    out = tmp_path / "out"
    rc = extract(server, write_jsonl(tmp_path / "d.jsonl", rows(50)), out, "--max-retries", 1,
                 "--concurrency", 1, "--max-consecutive-failures", 3)
    assert rc == EXIT_ABORTED
    summary = json.loads(capsys.readouterr().out.split("extract summary: ")[1])
    # --concurrency 1 runs two workers (one may wait on a file): the sample the other one
    # holds when the third failure aborts tries no more (not counted as failed unless its
    # last try had failed already); nothing new starts.
    assert summary["failed"] in (3, 4) and "aborted" in summary
    assert len(server.counts) <= 4
    assert summary["failed"] * 2 <= sum(server.counts.values()) <= 8  # 1 try + 1 retry each


def test_sharding_by_index_modulo_world_size(server, tmp_path):
    data = rows(11)
    path = write_jsonl(tmp_path / "d.jsonl", data)
    out = tmp_path / "out"
    assert extract(server, path, out, "--world-size", 3, "--rank", 1) == 0
    assert sorted(hs_indices(out)) == [1, 4, 7, 10]
    assert extract(server, path, out, "--world-size", 3, "--rank", 0) == 0
    assert extract(server, path, out, "--world-size", 3, "--rank", 2) == 0
    assert sorted(hs_indices(out)) == list(range(11))
    assert sorted(manifest_indices(out)) == list(range(11))
    assert set(server.counts.values()) == {1}  # no row sent twice across ranks


def test_resume_skips_valid_files_and_redoes_a_wrong_one(server, tmp_path):
    data = rows(6)
    path = write_jsonl(tmp_path / "d.jsonl", data)
    out = tmp_path / "out"
    assert extract(server, path, out) == 0
    # hs_2 replaced by another row's file: token ids differ from row 2's
    os.replace(out / "hs_3.safetensors", out / "hs_2.safetensors")
    (out / ".hs_4.safetensors.tmp.deadbeef").write_bytes(b"partial")  # a killed run's leftover
    server.counts.clear()
    assert extract(server, path, out) == 0
    assert server.counts == {tuple(data[2]): 1, tuple(data[3]): 1}
    for i, ids in enumerate(data):
        assert_file(out / f"hs_{i}.safetensors", ids)
    assert not (out / ".hs_4.safetensors.tmp.deadbeef").exists()


def test_validate_catches_non_finite_and_wrong_ids(server, tmp_path):
    data = rows(4)
    server.nan_for = {data[1][0]}
    server.wrong_ids_for = {data[2][0]}
    path = write_jsonl(tmp_path / "d.jsonl", data)
    out = tmp_path / "out"
    # without --validate, wrong token ids are still caught (cheap check), a NaN is not
    assert extract(server, path, out, "--max-retries", 0) == EXIT_FAILED
    assert sorted(hs_indices(out)) == [0, 1, 3]
    os.unlink(out / "hs_1.safetensors")
    rc = extract(server, path, out, "--max-retries", 1, "--validate")
    assert rc == EXIT_FAILED
    assert sorted(hs_indices(out)) == [0, 3]
    assert server.counts[tuple(data[1])] == 3  # 1 (first run) + 2 tries with --validate
    with pytest.raises(CheckError, match="non-finite"):
        p = tmp_path / "nan.safetensors"
        hs = reference(data[1])
        hs[0, 0, 0] = float("inf")
        save_file({"hidden_states": hs, "token_ids": torch.tensor(data[1])}, str(p))
        check_file(str(p), data[1], full=True)


_CHECK_WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None  # 'import torch' raises ImportError, as on a client's light install
from sglang_ext.client.checks import CheckError, check_file
for path in sys.argv[2:]:
    try:
        print(check_file(path, [int(i) for i in sys.argv[1].split(",")], full=True))
    except CheckError as e:
        print("CheckError:", e)
"""


def test_validate_without_torch_catches_non_finite_bf16_and_fp8(tmp_path):
    """``--validate``'s full check where ``import torch`` fails (``pip install -e '.[client]'``):
    format.load's numpy arrays, bf16 widened and fp8 decoded exactly, so a bf16 infinity, an
    fp8 NaN byte (S.1111.111) and an fp8 file with a NaN scale are refused as with torch, and
    finite bf16 and fp8 files pass. (The check took numpy arrays since 5b57209; this is its
    first refusal without torch.)"""
    ids = [4, 5, 6]
    meta = fmt.build_metadata(rid="r", layer_ids=LAYERS, num_layers=NUM_LAYERS)
    fp8_meta = {**meta, **fmt.dtype_metadata(fmt.FP8)}
    good_bf16 = reference(ids).to(torch.bfloat16)
    inf_bf16 = good_bf16.clone()
    inf_bf16[1, 2, 3] = float("inf")
    good_fp8 = reference(ids).div(64).to(torch.float8_e4m3fn)
    nan_fp8 = good_fp8.view(torch.uint8).clone()
    nan_fp8[2, 0, 1] = 0x7F
    scales = torch.ones(len(ids), len(LAYERS), 1)
    nan_scales = scales.clone()
    nan_scales[0, 3] = float("nan")
    files = {"good_bf16": (good_bf16, None, meta), "inf_bf16": (inf_bf16, None, meta),
             "good_fp8": (good_fp8, scales, fp8_meta), "nan_fp8": (nan_fp8.view(torch.float8_e4m3fn), scales, fp8_meta),
             "nan_scale": (good_fp8, nan_scales, fp8_meta)}
    paths = []
    for name, (hs, sc, m) in files.items():
        tensors = {"hidden_states": hs, "token_ids": torch.tensor(ids)}
        if sc is not None:
            tensors["hidden_states_scales"] = sc
        paths.append(str(tmp_path / f"{name}.safetensors"))
        save_file(tensors, paths[-1], metadata=m)
    r = subprocess.run([sys.executable, "-c", _CHECK_WITHOUT_TORCH, ",".join(map(str, ids)), *paths],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "3", f"CheckError: {paths[1]}: hidden_states hold non-finite values",
        "3", f"CheckError: {paths[3]}: hidden_states hold non-finite values",
        f"CheckError: {paths[4]}: hidden_states hold non-finite values"], r.stdout


def test_move_across_filesystems_copies_then_unlinks(tmp_path, monkeypatch):
    """rename fails with EXDEV: the file is copied through a descriptor into a new file of
    the asked mode, then the server's file is unlinked."""
    ids = [1, 2, 3]
    dump = tmp_path / "dump"
    dump.mkdir()
    name = fmt.safe_stem("r") + fmt.SUFFIX
    src = dump / name
    save_file({"hidden_states": reference(ids), "token_ids": torch.tensor(ids)}, str(src))
    os.chmod(src, 0o644)
    out = tmp_path / "out"
    out.mkdir()
    real_rename = os.rename

    def rename(a, b, *args, **kw):
        if a == name:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_rename(a, b, *args, **kw)

    monkeypatch.setattr(os, "rename", rename)
    d = DumpDir(str(dump))
    try:
        move_into_place(d, name, str(out), 7, ids, full=True, mode=0o600)
    finally:
        d.close()
    assert not src.exists()
    assert_file(out / "hs_7.safetensors", ids)
    assert os.listdir(out) == ["hs_7.safetensors"]
    assert os.stat(out / "hs_7.safetensors").st_mode & 0o777 == 0o600


def test_messages_need_a_tokenizer(server, tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert extract(server, path, tmp_path / "out") == EXIT_BAD_INPUT
    assert "--tokenizer" in capsys.readouterr().err


def test_killed_half_way_then_rerun_writes_every_index_once(server, tmp_path):
    data = rows(40)
    path = write_jsonl(tmp_path / "d.jsonl", data)
    out = tmp_path / "out"
    server.delay = 0.03
    cmd = [sys.executable, "-m", "sglang_ext", "extract", "--endpoint", server.url, "--data",
           path, "--out", str(out), "--concurrency", "3", "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if out.exists() and len(hs_indices(out)) >= 10:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_at_kill = hs_indices(out)
    assert 10 <= len(done_at_kill) < 40, "kill came too late to test anything"
    for i in done_at_kill:  # whatever has a final name is complete and right
        assert_file(out / f"hs_{i}.safetensors", data[i])

    server.delay = 0.0
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.split("extract summary: ")[1])
    assert summary["resumed"] == len(done_at_kill)
    assert summary["resumed"] + summary["extracted"] == 40
    for i, ids in enumerate(data):
        assert_file(out / f"hs_{i}.safetensors", ids)
    assert sorted(manifest_indices(out)) == list(range(40))  # one line per index
    assert not [n for n in os.listdir(out) if n.startswith(".")]
    for i in done_at_kill:  # finished before the kill: never requested again
        assert server.counts[tuple(data[i])] == 1


# ---- speculators (its own reader and its own offline generator) -----------------------------
def _speculators():
    try:
        from datasets import Dataset
        from hs_connectors import FileTransfer
        from speculators.train.data import ArrowDataset
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"speculators' reader does not import here ({type(e).__name__}: {e})")
    return Dataset, FileTransfer, ArrowDataset


def _arrow_dataset(Dataset, path, data, masks):
    Dataset.from_dict({
        "input_ids": data, "loss_mask": masks, "seq_len": [len(d) for d in data],
    }).with_format("torch").save_to_disk(str(path))
    return str(path)


def test_speculators_reader_loads_what_extract_wrote(server, tmp_path):
    Dataset, FileTransfer, ArrowDataset = _speculators()
    data = rows(7)
    masks = [[k % 2 for k in range(len(d))] for d in data]
    ds_path = _arrow_dataset(Dataset, tmp_path / "prepared", data, masks)
    out = tmp_path / "hs"
    # extract reads the speculators prepared dataset directly
    assert extract(server, ds_path, out, "--validate") == 0
    ds = ArrowDataset(max_len=64, datapath=ds_path, transfer=FileTransfer(Path(out)),
                      on_missing="raise")
    assert len(ds) == 7
    for i, ids in enumerate(data):
        item = ds[i]
        ref = reference(ids)
        assert item["input_ids"].tolist() == ids
        assert torch.equal(item["hidden_states"], ref[:, :3, :].reshape(len(ids), 3 * HIDDEN))
        assert torch.equal(item["verifier_last_hidden_states"], ref[:, 3, :])
        assert item["loss_mask"].tolist() == masks[i]
        assert item["lengths"].tolist() == [len(ids)]


def test_speculators_offline_generator_runs_unchanged_against_the_completions_hook(server, tmp_path):
    Dataset, FileTransfer, ArrowDataset = _speculators()
    try:
        from speculators.cli.generate_offline_data import _generate_and_save_hidden_states
        from speculators.data_generation.vllm_client import extract_output
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"speculators' generator does not import here ({type(e).__name__}: {e})")
    data = rows(5)
    masks = [[1] * len(d) for d in data]
    ds_path = _arrow_dataset(Dataset, tmp_path / "prepared", data, masks)
    asyncio.run(_generate_and_save_hidden_states(
        model=None, endpoint=server.url + "/v1", preprocessed_data=ds_path, output=None,
        max_samples=None, concurrency=2, validate_outputs=True, request_timeout=30,
        max_retries=0, fail_on_error=True, max_consecutive_errors=None, world_size=1, rank=0))
    hs_dir = Path(ds_path) / "hidden_states"
    for i, ids in enumerate(data):
        assert_file(hs_dir / f"hs_{i}.safetensors", ids)
    ds = ArrowDataset(max_len=64, datapath=ds_path, on_missing="raise")
    assert torch.equal(ds[2]["verifier_last_hidden_states"], reference(data[2])[:, 3, :])
    # What its parser takes from our response: the path of a complete file, lock gone.
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as oc:
        res = oc.completions.create(model="fake-model", prompt=[1, 2, 3], max_tokens=1,
                                    extra_body={"return_token_ids": True})
    handle, params = extract_output(res, [1, 2, 3])
    assert params == {"hidden_states_path": handle}
    assert os.path.exists(handle) and not os.path.exists(handle + ".lock")


def test_completions_hook_passes_through_and_reports_errors():
    from sglang.srt.entrypoints.openai.protocol import (
        CompletionResponse,
        CompletionResponseChoice,
        UsageInfo,
    )

    r = CompletionResponse(id="c", model="m", choices=[CompletionResponseChoice(index=0, text="")],
                           usage=UsageInfo(prompt_tokens=1, total_tokens=1))
    assert hooks.openai_completion_extras(r, [{"meta_info": {}}]) is r  # dumping off
    with pytest.raises(HiddenStatesDumpError, match="disk full"):
        hooks.openai_completion_extras(r, [{"meta_info": {"hidden_states_error": "disk full"}}])
    two = hooks.openai_completion_extras(
        r, [{"meta_info": {"hidden_states_path": "/a"}}, {"meta_info": {"hidden_states_path": "/b"}}])
    assert two.model_dump(mode="json")["kv_transfer_params"] == {
        "hidden_states_path": "/a", "hidden_states_paths": ["/a", "/b"]}
    assert "kv_transfer_params" not in r.model_dump(mode="json")


# ---- SpecForge ----------------------------------------------------------------------------------
def _tiny_model(path, eps=1e-5):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"num_hidden_layers": NUM_LAYERS, "rms_norm_eps": eps}))
    weight = torch.linspace(0.5, 2.0, HIDDEN).to(torch.float32)
    save_file({"model.norm.weight": weight, "lm_head.weight": torch.zeros(4, HIDDEN)},
              str(path / "model.safetensors"))
    return weight


def test_convert_to_specforge_loads_in_its_own_reader(server, tmp_path, capsys):
    try:
        from specforge.data.preprocessing import build_offline_eagle3_dataset
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"specforge's reader does not import here ({type(e).__name__}: {e})")
    data = rows(6)
    masks = [[0] + [1] * (len(d) - 1) for d in data]
    path = write_jsonl(tmp_path / "d.jsonl", data, masks)
    out = tmp_path / "hs"
    assert extract(server, path, out) == 0
    weight = _tiny_model(tmp_path / "model", eps=1e-5)
    dst = tmp_path / "specforge"
    from sglang_ext.__main__ import main

    assert main(["convert", "--to", "specforge", str(out), str(dst), "--model",
                 str(tmp_path / "model"), "--loss-mask-from", path]) == 0
    assert (dst / "rows_0-5000" / "data_3.ckpt").exists()
    ds = build_offline_eagle3_dataset(str(dst), max_len=64)
    assert len(ds) == 6
    seen = set()
    for k in range(len(ds)):
        item = ds[k]
        ids = item["input_ids"][0].tolist()
        i = ids[0] - 1000
        seen.add(i)
        assert ids == data[i]
        ref = reference(ids).double()
        aux = torch.cat([ref[:, 0], ref[:, 1], ref[:, 2]], dim=-1)  # layers 2, 4, 5
        assert torch.equal(item["hidden_state"][0], aux.float())
        last = ref[:, 3]
        normed = last / torch.sqrt((last ** 2).mean(-1, keepdim=True) + 1e-5) * weight.double()
        assert torch.allclose(item["target"][0].double(), normed, rtol=1e-5, atol=1e-6)
        want_mask = list(masks[i])
        want_mask[-1] = 0  # SpecForge zeroes the last position itself
        assert item["loss_mask"][0].tolist() == want_mask
    assert seen == set(range(6))
    old = os.umask(0o022)
    os.umask(old)
    for d in (dst, dst / "rows_0-5000"):  # KIMI_SGLANG_FILE_MODE's 0600, searchable: 0700 (was 0755)
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700 & ~old, d
    # resume: nothing rewritten, and the run says the old records are kept
    before = (dst / "rows_0-5000" / "data_3.ckpt").read_bytes()
    capsys.readouterr()
    assert main(["convert", "--to", "specforge", str(out), str(dst), "--no-final-norm"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["skipped_existing"] == 6
    assert captured.err.strip() == (
        f"note: 6 record(s) already in {dst} were kept as they are, not rewritten with this "
        f"run's options (--loss-mask-from, --model); to redo them, delete {dst} (or those "
        f"data_<i>.ckpt files) and run again")
    assert (dst / "rows_0-5000" / "data_3.ckpt").read_bytes() == before


def test_convert_defaults_and_refusals(tmp_path, capsys):
    ids = [4, 5, 6]
    src = tmp_path / "hs"
    src.mkdir()
    meta = fmt.build_metadata(rid="r", layer_ids=LAYERS, num_layers=NUM_LAYERS)
    save_file({"hidden_states": reference(ids), "token_ids": torch.tensor(ids)},
              str(src / "hs_0.safetensors"), metadata=meta)
    from sglang_ext.__main__ import main

    assert main(["convert", "--to", "specforge", str(src), str(tmp_path / "a")]) == 2  # norm choice
    assert main(["convert", "--to", "specforge", str(src), str(tmp_path / "b"), "--no-final-norm"]) == 0
    rec = torch.load(tmp_path / "b" / "rows_0-5000" / "data_0.ckpt", weights_only=True)
    assert rec["loss_mask"].tolist() == [1, 1, 1] and rec["loss_mask"].dtype == torch.int64
    assert rec["hidden_state"].shape == (1, 3, HIDDEN)
    assert torch.equal(rec["hidden_state"][0], reference(ids)[:, 3])
    assert rec["aux_hidden_state"].shape == (1, 3, 3 * HIDDEN)
    bad = fmt.build_metadata(rid="r", layer_ids=[1, 2, 3, 7], num_layers=NUM_LAYERS)
    (tmp_path / "hs_bad").mkdir()  # alone: beside hs_0, the two layer sets are refused first
    save_file({"hidden_states": reference(ids), "token_ids": torch.tensor(ids)},
              str(tmp_path / "hs_bad" / "hs_1.safetensors"), metadata=bad)
    assert main(["convert", "--to", "specforge", str(tmp_path / "hs_bad"), str(tmp_path / "c"),
                 "--no-final-norm"]) == 1
    assert "not the last layer" in capsys.readouterr().err


def test_specforge_layout_groups_rows_by_5000():
    assert convert.specforge_path("/d", 0) == "/d/rows_0-5000/data_0.ckpt"
    assert convert.specforge_path("/d", 4999) == "/d/rows_0-5000/data_4999.ckpt"
    assert convert.specforge_path("/d", 5000) == "/d/rows_5000-10000/data_5000.ckpt"


def test_messages_rows_go_through_the_chat_template(server, tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "user": 1, "assistant": 2, "hi": 3, "hello": 4, "there": 5, "<s>": 6}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>")
    fast.chat_template = "<s> {% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    fast.save_pretrained(str(tmp_path / "tok"))
    path = tmp_path / "m.jsonl"
    chats = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
             [{"role": "user", "content": "hello"}]]
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    out = tmp_path / "out"
    assert extract(server, path, out, "--tokenizer", tmp_path / "tok") == 0
    assert_file(out / "hs_0.safetensors", [6, 1, 3, 2, 4, 5])
    assert_file(out / "hs_1.safetensors", [6, 1, 4])


def _word_tokenizer(path, chat_template=None):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({"[UNK]": 0, "user": 1, "hi": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.chat_template = chat_template
    fast.save_pretrained(str(path))


def test_a_tokenizer_that_cannot_be_loaded_is_one_sentence_before_anything_is_sent(
        server, tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (tmp_path / "empty").mkdir()
    for tok in (tmp_path / "nonexistent", tmp_path / "empty"):
        capsys.readouterr()
        assert extract(server, path, tmp_path / "out", "--tokenizer", tok) == EXIT_BAD_INPUT
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        if tok.name == "nonexistent":
            assert err == (f"error: --tokenizer {tok} does not exist: pass the folder holding "
                           f"the tokenizer's files (e.g. the model's checkpoint folder)")
        else:
            assert err.startswith(f"error: --tokenizer {tok}: transformers cannot load a "
                                  f"tokenizer from it ("), err
        assert server.counts == {} and not (tmp_path / "out").exists()
    # one that loads but has no chat template: the row is named, exit 2, no traceback
    _word_tokenizer(tmp_path / "tok")
    assert extract(server, path, tmp_path / "out", "--tokenizer", tmp_path / "tok") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: row 0 (line 1 of m.jsonl): --tokenizer cannot turn its "
                          "messages into tokens (ValueError: "), err
    assert len(err.splitlines()) == 1 and server.counts == {}


def test_out_that_is_a_file_is_bad_input(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": [1, 2]}\n')
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    r = subprocess.run([sys.executable, "-m", "sglang_ext", "extract", "--endpoint", "http://127.0.0.1:9",
                        "--data", str(data), "--out", str(not_a_dir), "--no-progress"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "is not a directory" in r.stderr, r.stderr
    assert not_a_dir.read_text() == "x"


def test_malformed_answers_fail_the_sample_without_hanging_the_run(server, tmp_path, monkeypatch):
    """Answers of the wrong shape (meta_info not an object, a path that is not a string)
    fail their samples with a message; the run ends (exit 1), no worker dies silently."""
    shapes = iter([{"meta_info": "oops"}, {"meta_info": {"hidden_states_path": 5}}] * 50)

    def odd(ids, rid, early=False):
        return 200, next(shapes)

    monkeypatch.setattr(server, "generate", odd)
    write_jsonl(tmp_path / "d.jsonl", rows(40))
    rc = extract(server, tmp_path / "d.jsonl", tmp_path / "out", "--concurrency", 2,
                 "--max-retries", 0, "--max-consecutive-failures", 100)
    assert rc == EXIT_FAILED


def test_endpoint_without_a_scheme_is_bad_input(tmp_path, capsys):
    write_jsonl(tmp_path / "d.jsonl", rows(1))
    from sglang_ext.__main__ import main

    rc = main(["extract", "--endpoint", "127.0.0.1:30000", "--data", str(tmp_path / "d.jsonl"),
               "--out", str(tmp_path / "out"), "--no-progress"])
    assert rc == EXIT_BAD_INPUT
    assert "must start with http:// or https://" in capsys.readouterr().err


def test_convert_names_a_corrupt_file_and_leaves_no_empty_dst(tmp_path, capsys):
    src = tmp_path / "hs"
    src.mkdir()
    (src / "hs_0.safetensors").write_bytes(b"xx")
    from sglang_ext.__main__ import main

    dst = tmp_path / "dst"
    assert main(["convert", "--to", "specforge", str(src), str(dst), "--no-final-norm"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {src / 'hs_0.safetensors'}: not a readable safetensors file (SafetensorError: "
                   f"Error while deserializing header: header too small); run extract again with the "
                   f"same --out to replace it")
    assert not dst.exists()
    # the good files before it are converted and kept (a rerun resumes); the bad one is named
    ids = [4, 5, 6]
    meta = fmt.build_metadata(rid="r", layer_ids=LAYERS, num_layers=NUM_LAYERS)
    os.rename(src / "hs_0.safetensors", src / "hs_1.safetensors")
    save_file({"hidden_states": reference(ids), "token_ids": torch.tensor(ids)},
              str(src / "hs_0.safetensors"), metadata=meta)
    masks = write_jsonl(tmp_path / "d.jsonl", [ids, [1]], [[1, 1, 1], [1]])
    assert main(["convert", "--to", "specforge", str(src), str(dst), "--no-final-norm",
                 "--loss-mask-from", masks]) == 1
    assert "hs_1.safetensors: not a readable safetensors file" in capsys.readouterr().err
    assert os.listdir(dst / "rows_0-5000") == ["data_0.ckpt"]


def test_input_ids_must_be_non_negative_integers(server, tmp_path, capsys):
    for bad in ("abc", 5, [1.7, 2.2], [True, False], [-1, 2], [1, 2 ** 63]):  # int64 in the files
        (tmp_path / "d.jsonl").write_text(json.dumps({"input_ids": bad}) + "\n")
        assert extract(server, tmp_path / "d.jsonl", tmp_path / "out") == EXIT_BAD_INPUT, bad
        assert "input_ids must be a list of non-negative integers" in capsys.readouterr().err


def test_waiting_for_a_request_slot_does_not_count_against_the_timeout(server, tmp_path):
    """--concurrency 1 with early answers runs two workers: the second waits for the slot
    while the first request takes 0.6 s; with --timeout 1 both must succeed."""
    server.delay = 0.6
    write_jsonl(tmp_path / "d.jsonl", rows(4))
    assert extract(server, tmp_path / "d.jsonl", tmp_path / "out", "--concurrency", 1,
                   "--timeout", 1, "--max-retries", 0) == 0


def test_extract_runs_from_a_thread_that_is_not_the_main_one(server, tmp_path):
    """Called as a library from a worker thread, where signal handlers cannot be set
    (SIGTERM's handling is the main thread's), extract runs as usual."""
    write_jsonl(tmp_path / "d.jsonl", rows(3))
    got = []
    t = threading.Thread(target=lambda: got.append(extract(server, tmp_path / "d.jsonl", tmp_path / "out")))
    t.start()
    t.join(60)
    assert got == [0]
    assert sorted(p.name for p in (tmp_path / "out").glob("hs_*")) == [f"hs_{i}.safetensors" for i in range(3)]


def test_a_request_past_the_timeout_says_which_limit(server, tmp_path, capsys):
    """A server slower than --timeout: the row fails with a sentence naming the limit
    (asyncio's TimeoutError has no message of its own: the retry line said only
    'TimeoutError: ')."""
    server.delay = 1.5
    write_jsonl(tmp_path / "d.jsonl", rows(1))
    assert extract(server, tmp_path / "d.jsonl", tmp_path / "out", "--timeout", 0.3,
                   "--max-retries", 0) == 1
    err = capsys.readouterr().err
    assert "1 tries failed; last: no answer within 0.3 s (--timeout)" in err, err


def test_convert_records_are_the_users_alone(tmp_path, monkeypatch, capsys):
    """convert's records hold hidden states, as extract's files: created 0600 under a
    umask of 022 (as extract's), KIMI_SGLANG_FILE_MODE when set, a bad value refused
    with one sentence (exit 2) before anything is written."""
    from sglang_ext.__main__ import main

    ids = [4, 5, 6, 7]
    src = tmp_path / "hs"
    src.mkdir()
    save_file({"hidden_states": reference(ids).to(torch.bfloat16), "token_ids": torch.tensor(ids)},
              str(src / "hs_0.safetensors"),
              metadata=fmt.build_metadata(rid="r", layer_ids=LAYERS, num_layers=NUM_LAYERS))
    old = os.umask(0o022)
    try:
        assert main(["convert", "--to", "specforge", str(src), str(tmp_path / "a"), "--no-final-norm"]) == 0
        monkeypatch.setenv("KIMI_SGLANG_FILE_MODE", "0640")
        assert main(["convert", "--to", "specforge", str(src), str(tmp_path / "b"), "--no-final-norm"]) == 0
        monkeypatch.setenv("KIMI_SGLANG_FILE_MODE", "0777x")
        capsys.readouterr()
        assert main(["convert", "--to", "specforge", str(src), str(tmp_path / "c"), "--no-final-norm"]) == 2
    finally:
        os.umask(old)
    assert "KIMI_SGLANG_FILE_MODE" in capsys.readouterr().err
    for dst, mode in (("a", 0o600), ("b", 0o640)):
        st = os.stat(tmp_path / dst / "rows_0-5000" / "data_0.ckpt")
        assert stat.S_IMODE(st.st_mode) == mode, (dst, oct(st.st_mode))
    assert not (tmp_path / "c").exists()


def test_validate_and_convert_take_fp8_files(tmp_path, capsys):
    """fp8 files (--dump-hidden-states-dtype fp8): extract --validate's full check and
    convert --to specforge see the dequantized values (bf16, as speculators' FP8Transfer)."""
    from sglang_ext import quant
    from sglang_ext.__main__ import main

    ids = [4, 5, 6, 7]
    src = tmp_path / "hs"
    src.mkdir()
    ref = reference(ids)
    q, scales = quant.quantize_fp8(ref.reshape(len(ids), -1), len(LAYERS))
    q, scales = q.reshape(ref.shape), scales[..., None]
    meta = {**fmt.build_metadata(rid="r", layer_ids=LAYERS, num_layers=NUM_LAYERS),
            **fmt.dtype_metadata(fmt.FP8)}
    path = str(src / "hs_0.safetensors")
    save_file({"hidden_states": q, "hidden_states_scales": scales, "token_ids": torch.tensor(ids)},
              path, metadata=meta)
    assert check_file(path, ids, full=True) == len(ids)
    assert main(["convert", "--to", "specforge", str(src), str(tmp_path / "sf"), "--no-final-norm"]) == 0
    rec = torch.load(tmp_path / "sf" / "rows_0-5000" / "data_0.ckpt", weights_only=True)
    deq = q.to(torch.bfloat16) * scales.to(torch.bfloat16)
    assert torch.equal(rec["hidden_state"][0], deq[:, 3])
    assert torch.equal(rec["aux_hidden_state"][0], deq[:, :3].reshape(len(ids), -1))
    # within quant.py's bound of the original, bf16 dequantization's 2^-7 relative added
    assert ((rec["hidden_state"][0].float() - ref[:, 3]).abs()
            <= (2 ** -4 + 2 ** -7) * ref[:, 3].abs() + 2 ** -10 * scales[:, 3]).all()
    bad = str(src / "hs_1.safetensors")
    scales[1, 2] = float("inf")
    save_file({"hidden_states": q, "hidden_states_scales": scales, "token_ids": torch.tensor(ids)},
              bad, metadata=meta)
    assert check_file(bad, ids, full=False) == len(ids)  # cheap check: header only
    with pytest.raises(CheckError, match="non-finite"):
        check_file(bad, ids, full=True)
