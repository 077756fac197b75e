"""extract and convert for prompts with images, against the fake server of test_client.py.

Rows whose ``messages`` hold image parts go through ``/v1/chat/completions``; the fake
server renders them with ``render_chat`` (its stand-in chat template and image processor:
each image becomes IMAGE_START, a run of IMAGE_TOKEN whose length depends on the image's
bytes, IMAGE_END), dumps the file of those ids and answers as the chat patch will
(``kv_transfer_params.hidden_states_path``, ``choices[0].prompt_token_ids``). Expected
files come from ``render_chat`` and ``reference``, never from the client.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_client import (
    IMAGE_TOKEN,
    REPO,
    FakeServer,
    assert_file,
    extract,
    hs_indices,
    manifest_indices,
    render_chat,
)

from sglang_ext import format as fmt
from sglang_ext.client.extract import EXIT_ABORTED, EXIT_FAILED
from sglang_ext.client.images import ImageAccess, ImagePartError, chat_prompt
from sglang_ext.client.manifest import MANIFEST_NAME


@pytest.fixture
def server(tmp_path):
    s = FakeServer(tmp_path / "server")
    yield s
    s.close()


def data_url(payload: bytes, kind="png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(payload).decode()


def image_row(i, payload=None):
    """A user turn with a number (identifies the row), an image, a question."""
    payload = payload if payload is not None else bytes(range(i % 7 + 3))
    return {"messages": [{"role": "user", "content": [
        {"type": "text", "text": f"{i} look"},
        {"type": "image_url", "image_url": {"url": data_url(payload)}},
        {"type": "text", "text": "what is it"}]}]}


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def expected_ids(row):
    p = chat_prompt(row["messages"], ImageAccess(("/",)))
    return render_chat(p.messages, p.continue_final)


def manifest_records(out):
    with open(out / MANIFEST_NAME) as f:
        return [json.loads(line) for line in f]


def test_image_rows_go_through_chat_completions_and_text_rows_keep_generate(
        server, tmp_path, monkeypatch):
    """Every accepted image shape is sent as OpenAI's image_url, through chat completions
    (one new token, greedy, non-streaming, early answer, prompt token ids asked for); each
    file holds the ids the server ran and their hidden states; text rows still go to
    /generate; the manifest has one line per row, image rows with images and request_sha256."""
    server.early_write_s = 0.05
    picture = tmp_path / "cat.png"
    picture.write_bytes(b"\x89PNG fake image bytes")
    monkeypatch.chdir(tmp_path)
    rows = [
        {"input_ids": [5, 6, 7]},
        image_row(1),
        {"messages": [{"role": "user", "content": [  # a file the server reads
            {"type": "image_url", "image_url": {"url": f"file://{picture}"}}, "2 describe"]}]},
        {"messages": [{"role": "user", "content": [  # speculators' prepared row, relative path
            {"type": "image", "path": "cat.png"}, {"type": "text", "text": "3 and"},
            {"type": "image", "url": data_url(b"abcdefgh", "jpeg")}]},
            {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]}]},
        {"messages": [{"role": "system", "content": "4 be brief"}, {"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(b"xyz")}, {"type": "image", "image": str(picture)}]}]},
        {"input_ids": [8, 9, 10, 11]},
    ]
    out = tmp_path / "out"
    assert extract(server, write_rows(tmp_path / "d.jsonl", rows), out, "--concurrency", 2,
                   "--image-root", str(tmp_path)) == 0
    assert server.generate_calls == 2 and len(server.chat_bodies) == 4
    assert server.asked_early == 6  # chat requests asked for early answers too
    bodies = {b["messages"][-1]["content"][0].get("text", "") if isinstance(b["messages"][-1]["content"], list)
              else b["messages"][-1]["content"]: b for b in server.chat_bodies}
    for body in server.chat_bodies:
        assert body["max_tokens"] == 1 and body["temperature"] == 0 and body["stream"] is False
        assert body["return_prompt_token_ids"] is True and body["rid"].startswith("extract-")
        assert body["custom_params"] == {fmt.DUMP_PARAM: True, fmt.WAIT_PARAM: False}  # asked explicitly
        for m in body["messages"]:
            for part in m["content"] if isinstance(m["content"], list) else []:
                assert part["type"] in ("text", "image_url")
                if part["type"] == "image_url":
                    assert set(part["image_url"]) == {"url"}
    # the assistant-final row is continued (its text ends the prompt), the others are not
    continued = bodies["a cat"]
    assert continued["continue_final_message"] is True
    assert continued["messages"][0]["content"][0] == {"type": "image_url", "image_url": {"url": f"file://{picture}"}}
    assert sum("continue_final_message" in b for b in server.chat_bodies) == 1
    assert_file(out / "hs_0.safetensors", [5, 6, 7])
    assert_file(out / "hs_5.safetensors", [8, 9, 10, 11])
    want = {1: expected_ids(rows[1]), 2: expected_ids(rows[2]), 3: expected_ids(rows[3]),
            4: expected_ids(rows[4])}
    for i, ids in want.items():
        assert IMAGE_TOKEN in ids
        assert_file(out / f"hs_{i}.safetensors", ids)
    # the image run's length follows the image bytes: 'cat.png' (21 bytes) -> 2 + 21 % 5 = 3
    assert want[2][:7] == [1, 11, 7, 9, 9, 9, 8]
    recs = {r["index"]: r for r in manifest_records(out)}
    assert sorted(manifest_indices(out)) == list(range(6))
    assert recs[3]["images"] == 2 and recs[4]["images"] == 2 and recs[1]["images"] == 1
    assert recs[1]["num_tokens"] == len(want[1])
    assert len(recs[1]["request_sha256"]) == 64 and "images" not in recs[0]
    assert recs[1]["source"].startswith(server.dump_dir)
    assert not [n for n in os.listdir(server.dump_dir) if n.endswith(".safetensors")]


def test_a_malformed_image_part_fails_its_row_in_one_sentence_and_the_run_goes_on(
        server, tmp_path, capsys):
    good = image_row(0)
    bad = [
        ({"type": "image_url", "image_url": {}}, "has no image URL"),
        ({"type": "image_url", "image_url": {"url": "ftp://h/x.png"}}, "starts with http://, https://, file:// or data:image/"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@not base64@@"}}, "not valid base64"),
        ({"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}, "not data:image/<type>;base64"),
        ({"type": "image_url", "image_url": {"url": "file://relative/x.png"}}, "file:///ABSOLUTE/PATH"),
        ({"type": "image_url", "image_url": {"url": "https:///x.png"}}, "names no host"),
        ({"type": "image", "base64": "aGk="}, "data:image/<type>;base64"),
        ({"type": "image", "image": {"bytes": "..."}}, "has no image URL"),
        ({"type": "video_url", "video_url": {"url": "https://h/v.mp4"}}, "text and image parts"),
        (42, "is a int, not an object or a string"),
    ]
    rows = [good] + [{"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(b"ok")}}, part]}]} for part, _ in bad]
    rows.append(image_row(11))
    path = write_rows(tmp_path / "d.jsonl", rows)
    assert extract(server, path, tmp_path / "out") == EXIT_FAILED
    captured = capsys.readouterr()
    err = captured.err
    assert "Traceback" not in err
    for k, (_, why) in enumerate(bad, start=1):
        line = next(ln for ln in err.splitlines() if ln.startswith(f"row {k} (line {k + 1} of d.jsonl): "))
        assert "message 0 part 1" in line and why in line, line
    summary = json.loads(captured.out.split("extract summary: ")[1])
    assert summary["failed"] == len(bad) and summary["extracted"] == 2
    assert summary["failed_indices"] == list(range(1, len(bad) + 1))
    assert len(server.chat_bodies) == 2  # nothing was sent for the malformed rows
    assert hs_indices(tmp_path / "out") == {0, len(bad) + 1}
    assert_file(tmp_path / "out" / "hs_0.safetensors", expected_ids(good))


def test_chat_prompt_shapes_and_refusals():
    srv = ImageAccess(("/srv/img",))
    shaped = chat_prompt([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "low"}},
        {"type": "image_url", "image_url": "/srv/img/b.png"}, "hi"]}], srv)
    assert shaped.messages[0]["content"] == [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "low"}},
        {"type": "image_url", "image_url": {"url": "file:///srv/img/b.png"}},
        {"type": "text", "text": "hi"}]
    assert shaped.images == 2 and not shaped.continue_final
    # the digest follows the image, not only the text
    other = chat_prompt([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/c.png", "detail": "low"}},
        {"type": "image_url", "image_url": "/srv/img/b.png"}, "hi"]}], srv)
    assert other.digest != shaped.digest
    with pytest.raises(ImagePartError, match="message 1 is not an object with a role string"):
        chat_prompt([{"role": "user", "content": [{"type": "image", "url": "https://h/x"}]}, "x"])
    with pytest.raises(ImagePartError, match="message 0 has content of type int"):
        chat_prompt([{"role": "user", "content": 3}, {"role": "user", "content": [
            {"type": "image", "url": "https://h/x"}]}])


def test_an_image_the_server_cannot_read_fails_that_row_once(server, tmp_path, capsys):
    """The server answers HTTP 400 for an image it cannot read (file:// on its side): the
    row fails at once, not retried; the others are extracted."""
    rows = [image_row(0), {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/missing.png"}}]}]}, image_row(2)]
    assert extract(server, write_rows(tmp_path / "d.jsonl", rows), tmp_path / "out",
                   "--image-root", str(tmp_path)) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "row 1 (line 2 of d.jsonl): the server refused the row (HTTP 400)" in err and "cannot read the image" in err
    assert len(server.chat_bodies) == 3
    assert hs_indices(tmp_path / "out") == {0, 2}


def test_retries_and_a_dump_error_answer_for_image_rows(server, tmp_path):
    server.fail_first = 2  # HTTP 500, then the dump error the chat hook turns into HTTP 500
    rows = [image_row(i) for i in range(3)]
    assert extract(server, write_rows(tmp_path / "d.jsonl", rows), tmp_path / "out") == 0
    assert len(server.chat_bodies) == 9
    for i, row in enumerate(rows):
        assert_file(tmp_path / "out" / f"hs_{i}.safetensors", expected_ids(row))


def test_row_input_ids_must_equal_the_ids_the_server_ran(server, tmp_path, capsys):
    """A speculators prepared row carries input_ids (and a loss mask for them) beside its
    messages: the server's prompt token ids must equal them, else the row fails, once,
    and the server's file is removed from the dump directory."""
    same = image_row(0) | {"input_ids": expected_ids(image_row(0))}
    wrong_ids = list(expected_ids(image_row(1)))
    wrong_ids[3] += 1
    differ = image_row(1) | {"input_ids": wrong_ids}
    path = write_rows(tmp_path / "d.jsonl", [same, differ])
    assert extract(server, path, tmp_path / "out") == EXIT_FAILED
    err = capsys.readouterr().err
    n = len(wrong_ids)
    assert (f"row 1 (line 2 of d.jsonl): the server ran {n} prompt token(s), which differ from the row's {n} "
            f"input_ids at position 3") in err
    assert len(server.chat_bodies) == 2
    assert hs_indices(tmp_path / "out") == {0}
    assert_file(tmp_path / "out" / "hs_0.safetensors", same["input_ids"])
    assert not [n for n in os.listdir(server.dump_dir) if n.endswith(".safetensors")]


def test_a_server_without_kv_transfer_params_is_read_through_meta_info_else_stops(server, tmp_path, capsys):
    server.chat_kv = False  # chat answers name the file in choices[0].meta_info only
    rows = [image_row(i) for i in range(3)]
    path = write_rows(tmp_path / "d.jsonl", rows)
    assert extract(server, path, tmp_path / "out") == 0
    for i, row in enumerate(rows):
        assert_file(tmp_path / "out" / f"hs_{i}.safetensors", expected_ids(row))
    server.chat_meta = False  # neither: not a dumping server for chat requests
    capsys.readouterr()
    assert extract(server, path, tmp_path / "out2") == EXIT_ABORTED
    err = capsys.readouterr().err
    assert "is not dumping chat requests" in err and "kv_transfer_params.hidden_states_path" in err


def test_rerun_keeps_image_rows_of_the_same_request_and_redoes_a_changed_image(server, tmp_path, capsys):
    rows = [image_row(i) for i in range(4)]
    path = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out"
    assert extract(server, path, out) == 0
    assert extract(server, path, out) == 0
    assert len(server.chat_bodies) == 4  # all four kept
    # row 2's image changes to another of the same size: same token ids, another request
    rows[2] = image_row(2, payload=b"\xff" * len(bytes(range(2 % 7 + 3))))
    assert expected_ids(rows[2]) == expected_ids(image_row(2))
    write_rows(tmp_path / "d.jsonl", rows)
    capsys.readouterr()
    assert extract(server, path, out) == 0
    assert len(server.chat_bodies) == 5
    assert "re-extracting hs_2.safetensors: manifest.jsonl does not record it" in capsys.readouterr().err
    recs = manifest_records(out)
    assert [r["index"] for r in recs].count(2) == 2  # the new line wins
    assert recs[-1]["request_sha256"] == chat_prompt(rows[2]["messages"]).digest


def test_killed_half_way_then_rerun_writes_every_image_row_once(server, tmp_path):
    rows = [image_row(i, payload=bytes([i]) * (i % 9 + 1)) if i % 4 else {"input_ids": [1000 + i, 5, 6]}
            for i in range(40)]
    ids = [r["input_ids"] if "input_ids" in r else expected_ids(r) for r in rows]
    path = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out"
    server.delay = 0.03
    cmd = [sys.executable, "-m", "sglang_ext", "extract", "--endpoint", server.url, "--data",
           str(path), "--out", str(out), "--concurrency", "3", "--no-progress"]
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
    in_manifest = set(manifest_indices(out))
    server.delay = 0.0
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.split("extract summary: ")[1])
    assert summary["resumed"] + summary["extracted"] == 40
    for i in range(40):
        assert_file(out / f"hs_{i}.safetensors", ids[i])
    assert sorted(manifest_indices(out)) == list(range(40))  # one line per index
    assert not [n for n in os.listdir(out) if n.startswith(".")]
    assert not [n for n in os.listdir(server.dump_dir) if n.endswith(".safetensors")]
    for i in done_at_kill & in_manifest:  # finished before the kill: never requested again
        assert server.counts[tuple(ids[i])] == 1


def test_convert_masks_image_positions_out_of_the_loss(server, tmp_path, capsys):
    from sglang_ext.__main__ import main

    rows = [image_row(0), {"input_ids": [5, 6, 7]}, image_row(2)]
    data = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "hs"
    assert extract(server, data, out) == 0
    dst = tmp_path / "sf"
    capsys.readouterr()
    assert main(["convert", "--to", "specforge", str(out), str(dst), "--no-final-norm"]) == 0
    assert json.loads(capsys.readouterr().out)["with_images"] == 2
    for i, row in enumerate(rows):
        ids = row.get("input_ids") or expected_ids(row)
        rec = torch.load(dst / "rows_0-5000" / f"data_{i}.ckpt", weights_only=True)
        assert rec["input_ids"].tolist() == ids
        assert rec["loss_mask"].tolist() == [0 if t == IMAGE_TOKEN else 1 for t in ids]
        assert rec["hidden_state"].shape == (1, len(ids), 8)
    assert rec["loss_mask"].tolist().count(0) >= 2

    # files whose metadata names no image token id: --image-token-id, else one sentence
    server.image_meta = False
    out2, dst2 = tmp_path / "hs2", tmp_path / "sf2"
    assert extract(server, data, out2) == 0
    capsys.readouterr()
    assert main(["convert", "--to", "specforge", str(out2), str(dst2), "--no-final-norm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: hs_0.safetensors holds a prompt with 1 image(s) (manifest.jsonl), "
                          "but its metadata names no image_token_id: pass --image-token-id ID")
    assert not dst2.exists()
    assert main(["convert", "--to", "specforge", str(out2), str(dst2), "--no-final-norm",
                 "--image-token-id", "4242"]) == 1
    assert "no position holds image token id [4242]" in capsys.readouterr().err
    assert main(["convert", "--to", "specforge", str(out2), str(dst2), "--no-final-norm",
                 "--image-token-id", str(IMAGE_TOKEN)]) == 0
    rec = torch.load(dst2 / "rows_0-5000" / "data_2.ckpt", weights_only=True)
    assert rec["loss_mask"].tolist() == [0 if t == IMAGE_TOKEN else 1 for t in expected_ids(rows[2])]


@pytest.mark.parametrize("url,roots,why", [
    ("file:///dev/zero", (), "under /dev: the server would read its own /dev (SGLang's loader "
                             "reads any file:// path, /dev/zero without end)"),
    ("/proc/self/environ", ("/",), "under /proc"),
    ("file:////sys/kernel/x", ("/",), "under /sys"),
    ("file:///srv/img/x.png", (), "outside every --image-root (none given): the server reads "
                                  "file:// paths from its own filesystem"),
    ("file:///etc/passwd", ("/srv/img",), "outside every --image-root (/srv/img)"),
    ("file:///srv/img-other/x.png", ("/srv/img",), "outside every --image-root (/srv/img)"),
    ("file:///srv/img/../../etc/passwd", ("/srv/img",), "whose path climbs out through '..'"),
    ("file:///srv/img/%2e%2e/x", ("/srv/img",), "whose path climbs out through '..'"),
    ("http://169.254.169.254/latest/meta-data/", (), "whose host 169.254.169.254 is a link-local"),
    ("http://[fe80::1]/x.png", (), "whose host fe80::1 is a link-local"),
    ("https://0.0.0.0/x.png", (), "is a link-local or unspecified address"),
    # other spellings the server's resolver takes for the same addresses (a review sent them)
    ("http://2852039166/", (), "whose host 2852039166 is a link-local"),
    ("http://0xa9fea9fe/", (), "whose host 0xa9fea9fe is a link-local"),
    ("http://0251.0376.0251.0376/", (), "is a link-local"),
    ("http://169.254.43518/", (), "is a link-local"),
    ("http://[::ffff:169.254.169.254]/", (), "is a link-local"),
    ("http://0/", (), "is a link-local or unspecified address"),
])
def test_image_urls_the_server_must_not_read_are_refused(url, roots, why):
    """What extract forwards (issue 50 item 14): SGLang 0.5.23's loader reads any file://
    path (a review read /dev/zero to 3 GB in 5 s) and fetches any host, so file:// only
    under --image-root, never /proc, /dev, /sys or through '..', never a link-local host."""
    with pytest.raises(ImagePartError) as e:
        chat_prompt([{"role": "user", "content": [{"type": "image_url", "image_url": url}]}],
                    ImageAccess(roots))
    assert why in str(e.value), str(e.value)
    assert str(e.value).startswith("message 0 part 0 (type image_url) has the URL "), str(e.value)


def test_file_urls_under_an_image_root_are_forwarded(server, tmp_path, capsys):
    """A real run: a file:// image outside --image-root and /dev/zero fail their rows with
    one sentence each and are never sent; the one under it is sent as given."""
    pictures = tmp_path / "pictures"
    pictures.mkdir()
    (pictures / "cat.png").write_bytes(b"\x89PNG fake image bytes")
    (tmp_path / "secret.png").write_bytes(b"not for the server")

    def row(url):
        return {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, "what is it"]}]}

    rows = [row(f"file://{pictures}/cat.png"), row(f"file://{tmp_path}/secret.png"),
            row("file:///dev/zero")]
    assert extract(server, write_rows(tmp_path / "d.jsonl", rows), tmp_path / "out",
                   "--image-root", str(pictures)) == EXIT_FAILED
    err = capsys.readouterr().err
    assert f"row 1 (line 2 of d.jsonl): message 0 part 0 (type image_url) has the URL " \
           f"'file://{tmp_path}/secret.png', outside every --image-root ({pictures})" in err, err
    assert "row 2 (line 3 of d.jsonl): message 0 part 0 (type image_url) has the URL " \
           "'file:///dev/zero', under /dev" in err, err
    assert [b["messages"][0]["content"][0]["image_url"]["url"] for b in server.chat_bodies] == [
        f"file://{pictures}/cat.png"]
    assert hs_indices(tmp_path / "out") == {0}


def test_a_relative_image_root_is_refused(server, tmp_path, capsys):
    assert extract(server, write_rows(tmp_path / "d.jsonl", [image_row(0)]), tmp_path / "out",
                   "--image-root", "pictures") == 2
    assert capsys.readouterr().err.strip() == (
        "error: --image-root pictures must be an absolute path on the server's filesystem")
