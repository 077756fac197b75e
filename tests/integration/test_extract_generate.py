"""``extract --generate`` end to end against the real stand-in process (``sglang-ext
standin``), through a small HTTP proxy that misbehaves on purpose (a try answered HTTP
502 after the stand-in wrote its file, an answer whose ``output_ids`` break the contract,
a server that does not capture generated tokens, a slow server to kill a run mid-way).

Every ``hs_<i>`` is checked against the stand-in's documented generation and values,
recomputed here (``test_standin.generated_reference``, ``test_tryit.reference``); then
``convert`` turns such output into SpecForge records whose loss mask is the response.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from sglang_ext import format as fmt
from sglang_ext.tools.standin import JsonReplyHandler
from test_standin import Standin, assert_output_file, generated_reference

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12], [13, 14, 15]]


class Proxy:
    """Forwards every request to the stand-in at ``target``; for ``/generate`` it records
    each try's rid and answer (``tries``: row index -> [(rid, answer)]) and sampling_params
    as sent (``params``: row index -> [sampling_params]) and misbehaves:
    ``fail_first`` rows get HTTP 502 for their first try (the stand-in has written its
    file), ``tamper`` rows an answer whose last output id is off by one, ``strip_output``
    drops ``hidden_states_output`` from every request (a server that does not capture
    generated tokens), ``delay_s`` before each answer."""

    def __init__(self, target: str):
        self.target, self.tries, self.params = target, {}, {}
        self.fail_first, self.tamper, self.strip_output, self.delay_s = set(), set(), False, 0.0
        proxy = self

        class Handler(JsonReplyHandler):  # the stand-in's answers' bytes, passed on
            def do_GET(self):
                self.reply(*proxy.forward("GET", self.path, None))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self.reply(*proxy.generate(self.path, body))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def forward(self, method, path, body):
        req = urllib.request.Request(self.target + path, None if body is None else json.dumps(body).encode(),
                                     {"Content-Type": "application/json"}, method=method)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def generate(self, path, body):
        time.sleep(self.delay_s)
        self.params.setdefault(int(body["rid"].split("-")[1]), []).append(json.loads(json.dumps(body["sampling_params"])))
        if self.strip_output:
            body["sampling_params"]["custom_params"].pop(fmt.OUTPUT_PARAM, None)
        code, raw = self.forward("POST", path, body)
        row = int(body["rid"].split("-")[1])  # extract's rids: <prefix>-<row>-<try>-<random>
        answer = json.loads(raw)
        tries = self.tries.setdefault(row, [])
        tries.append((body["rid"], answer))
        if row in self.fail_first and len(tries) == 1:
            return 502, b'{"error": "bad gateway"}'
        if row in self.tamper:
            answer["output_ids"][-1] += 1
        return code, json.dumps(answer).encode()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def served(tmp_path):
    standin = Standin(tmp_path, "--dump-dir", str(tmp_path / "dump"))
    proxy = Proxy(standin.url)
    yield proxy
    proxy.close()
    if standin.proc.poll() is None:
        standin.proc.kill()
        standin.proc.wait()


def word_tokenizer(path: Path) -> None:
    """A tokenizer of words w0..w31999 (the stand-in's generated ids) plus a chat's words,
    whose template adds ``assistant`` as the generation prompt."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(32000)}
    vocab.update({"[UNK]": 32000, "user": 32001, "assistant": 32002, "hi": 32003, "old": 32004, "<s>": 32005})
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>")
    fast.chat_template = ("<s> {% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant {% endif %}")
    fast.save_pretrained(str(path))


def write_data(path: Path, prompts, chat=False) -> Path:
    rows = [{"input_ids": p} for p in prompts]
    if chat:  # its final assistant turn is dropped: the server writes a new one
        rows.append({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old"}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cli(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "sglang_ext", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def extract_args(url, data, out, *extra):
    return ["extract", "--endpoint", url, "--data", data, "--out", out, "--no-progress", "--backoff", "0.01",
            "--max-backoff", "0.05", "--generate", "--max-new-tokens", 5, *extra]


def manifest(out: Path) -> dict:
    return {r["index"]: r for r in map(json.loads, (out / "manifest.jsonl").read_text().splitlines())}


def summary(stdout: str) -> dict:
    return json.loads(stdout.split("extract summary: ")[1])


def test_generate_a_retry_is_a_new_sample_and_a_broken_answer_fails_its_row(served, tmp_path):
    word_tokenizer(tmp_path / "tok")
    data = write_data(tmp_path / "d.jsonl", PROMPTS, chat=True)
    out, dump = tmp_path / "out", tmp_path / "dump"
    served.fail_first, served.tamper = {1}, {2}
    r = cli(*extract_args(served.url, data, out, "--temperature", 0.7, "--tokenizer", tmp_path / "tok"))
    assert r.returncode == 1, r.stderr  # row 2 failed
    broken = [line for line in r.stderr.splitlines() if line.startswith("row 2 ")]
    assert len(broken) == 1 and "breaks the output-rows contract" in broken[0], r.stderr
    assert f"generated token 4 is {fmt.LAST_TOKEN_ID_KEY}" in broken[0], broken
    assert len(served.tries[2]) == 1, "a row whose answer breaks the contract was retried"
    assert not (out / "hs_2.safetensors").exists()

    lines = manifest(out)
    prompts = PROMPTS + [[32005, 32001, 32003, 32002]]  # <s> user hi assistant
    assert sorted(lines) == [0, 1, 3, 4, 5, 6]
    for i in sorted(lines):
        path = out / f"hs_{i}.safetensors"
        rid = fmt.load(str(path)).metadata["rid"]
        want = generated_reference(prompts[i], 5, seed=rid)  # sampled: the rid seeds it
        assert_output_file(str(path), prompts[i], want)
        assert lines[i]["output_ids"] == want and lines[i]["num_prompt_tokens"] == len(prompts[i])
        assert lines[i]["num_tokens"] == len(prompts[i]) + 4
        assert lines[i]["text"] == " ".join(f"w{t}" for t in want), lines[i]
    # row 1: its first try was answered 502 after the stand-in generated; the retry is a new sample
    (first_rid, first), (second_rid, _) = served.tries[1]
    assert lines[1]["output_ids"] != first["output_ids"]
    assert fmt.load(str(out / "hs_1.safetensors")).metadata["rid"] == second_rid
    # nothing of the failed try, the broken answer or the early answers is left behind
    assert sorted(os.listdir(dump)) == ["index.jsonl"], os.listdir(dump)

    # a rerun resumes: only row 2 is sent again; once the server behaves, it is done
    served.tamper = set()
    before = {i: len(t) for i, t in served.tries.items()}
    r = cli(*extract_args(served.url, data, out, "--temperature", 0.7, "--tokenizer", tmp_path / "tok"))
    assert r.returncode == 0, r.stderr
    assert {i: len(t) for i, t in served.tries.items()} == {**before, 2: 2}
    assert summary(r.stdout)["resumed"] == 6
    rid = fmt.load(str(out / "hs_2.safetensors")).metadata["rid"]
    assert_output_file(str(out / "hs_2.safetensors"), PROMPTS[2], generated_reference(PROMPTS[2], 5, seed=rid))


def test_generate_resumes_after_a_kill_and_rebuilds_lost_manifest_lines_from_the_files(served, tmp_path):
    prompts = [[i, i + 1, i + 2][: 1 + i % 3] for i in range(24)]
    data = write_data(tmp_path / "d.jsonl", prompts)
    out = tmp_path / "out"
    served.delay_s = 0.1
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "sglang_ext", *map(str, extract_args(
        served.url, data, out, "--concurrency", 2))], cwd=REPO, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while len(list(out.glob("hs_*.safetensors"))) < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.kill()
    proc.wait(timeout=30)
    done_at_kill = {int(p.name[3:-12]) for p in out.glob("hs_*.safetensors")}
    assert 5 <= len(done_at_kill) < len(prompts), done_at_kill
    served.delay_s = 0.0
    r = cli(*extract_args(served.url, data, out))
    assert r.returncode == 0, r.stderr
    assert summary(r.stdout)["resumed"] == len(done_at_kill)
    for i in done_at_kill:  # finished before the kill: never requested again
        assert len(served.tries[i]) == 1, (i, served.tries[i])
    lines = manifest(out)
    assert sorted(lines) == list(range(len(prompts)))
    for i, prompt in enumerate(prompts):  # greedy (--temperature 0): the same ids on every try
        want = generated_reference(prompt, 5)
        assert_output_file(str(out / f"hs_{i}.safetensors"), prompt, want)
        assert lines[i]["output_ids"] == want and "text" not in lines[i]

    # a manifest lost (as a kill between a file's rename and its line): rebuilt from the files
    (out / "manifest.jsonl").unlink()
    sent = sum(len(t) for t in served.tries.values())
    r = cli(*extract_args(served.url, data, out))
    assert r.returncode == 0 and summary(r.stdout)["resumed"] == len(prompts), r.stderr
    assert sum(len(t) for t in served.tries.values()) == sent, "a kept file was requested again"
    rebuilt = manifest(out)
    assert {i: (rec["output_ids"], rec["num_prompt_tokens"]) for i, rec in rebuilt.items()} == {
        i: (generated_reference(p, 5), len(p)) for i, p in enumerate(prompts)}


def test_a_server_that_does_not_capture_generated_tokens_stops_the_run(served, tmp_path):
    served.strip_output = True
    r = cli(*extract_args(served.url, write_data(tmp_path / "d.jsonl", PROMPTS[:2]), tmp_path / "out"))
    assert r.returncode == 3, r.stderr
    assert "holds the prompt's rows only" in r.stderr and "run without --generate" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_generate_flags_are_checked_before_anything_is_sent(served, tmp_path):
    data = write_data(tmp_path / "d.jsonl", PROMPTS[:1])
    for extra, says in ((["--max-new-tokens", 0], "--max-new-tokens 0 must be at least 1"),
                        (["--temperature", -1], "--temperature -1.0 must be a number >= 0"),
                        (["--sampling-params", "[1]"], "--sampling-params must be a JSON object"),
                        (["--store", "mooncake://127.0.0.1:1"], "with --store it is not supported"),
                        # a key a flag sets was dropped for the flag's default (512 tokens, not 3)
                        (["--sampling-params", '{"max_new_tokens": 3}'],
                         "--sampling-params must not set max_new_tokens: pass --max-new-tokens"),
                        (["--sampling-params", '{"n": 2}'], "extract takes one sample per row"),
                        # SGLang's beam search drops the request's custom_params: the server
                        # answers each row with hidden_states_error (session.BEAM_MESSAGE)
                        (["--sampling-params", '{"beam_width": 4}'], "beam search is not dumped"),
                        # Python's json reads NaN: it was sent and recorded as non-JSON, and the
                        # same command's rerun stopped (NaN != NaN: 'other sampling settings')
                        (["--sampling-params", '{"frequency_penalty": NaN}'],
                         "--sampling-params is not JSON (NaN is not a JSON number)"),
                        (["--sampling-params", '{"top_k": -Infinity}'],
                         "--sampling-params is not JSON (-Infinity is not a JSON number)")):
        r = cli(*extract_args(served.url, data, tmp_path / "out", *extra))
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    # a generation flag without --generate was ignored: the prompt alone was captured (and a
    # --generate run's samples in that --out replaced by prompts)
    plain = [a for a in extract_args(served.url, data, tmp_path / "out") if a not in ("--generate",)]
    for extra in ([], ["--temperature", 0.7], ["--sampling-params", "{}"]):
        r = cli(*plain, *extra)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "only apply with --generate, which was not given" in r.stderr, r.stderr
        assert r.stderr.startswith("error: --max-new-tokens"), r.stderr
    assert served.tries == {}
    r = cli("extract", "--help")
    assert "A retried row is a new request: with --temperature > 0 a new sample" in " ".join(r.stdout.split())


def test_a_chat_of_one_assistant_turn_leaves_no_prompt_to_generate_from(served, tmp_path):
    """--generate drops a row's final assistant turn; a row that is only that turn has no
    prompt left: one sentence saying so (exit 2, nothing sent). Before, transformers' words
    for an empty chat ('list index out of range' here; 'Cannot apply chat template to an
    empty conversation' in 5.x) about messages the row did have."""
    word_tokenizer(tmp_path / "tok")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "assistant", "content": "old"}]}) + "\n")
    r = cli(*extract_args(served.url, data, tmp_path / "out", "--tokenizer", tmp_path / "tok"))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "error: row 0 (line 1 of d.jsonl): its messages are one assistant turn, which --generate drops "
        "(the server writes the response anew): no prompt is left"), r.stderr
    assert served.tries == {}


def test_a_rerun_in_the_other_mode_keeps_the_samples_and_stops(served, tmp_path):
    """--generate samples in OUT and a rerun without --generate (or prompt samples and a
    rerun with it): before, each hs_<i> failed the other mode's check and was extracted
    again, the generated samples (GPU time, sampled: not reproducible) replaced by prompts."""
    data = write_data(tmp_path / "d.jsonl", PROMPTS[:3])
    gen_out, prompt_out = tmp_path / "gen", tmp_path / "prompt"
    assert cli(*extract_args(served.url, data, gen_out, "--temperature", 0.7)).returncode == 0
    def plain(out):  # the same command without --generate (and --max-new-tokens 5)
        return [a for a in extract_args(served.url, data, out) if a != "--generate"][:-2]

    assert cli(*plain(prompt_out)).returncode == 0
    kept = {p: p.read_bytes() for out in (gen_out, prompt_out) for p in out.glob("hs_*.safetensors")}
    assert len(kept) == 6
    sent = sum(len(t) for t in served.tries.values())

    for out, args, says in (
            (gen_out, plain(gen_out),
             "holds this row's prompt and generated rows, from a --generate run: not replaced; "
             "add --generate"),
            (prompt_out, extract_args(served.url, data, prompt_out),
             "holds this row's prompt rows alone, from a run without --generate: not replaced")):
        r = cli(*args)
        assert r.returncode == 3, r.stderr
        errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and says in errors[0] and "re-extracting" not in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    assert sum(len(t) for t in served.tries.values()) == sent, "a row was sent again"
    assert {p: p.read_bytes() for p in kept} == kept, "a sample of the other mode was replaced"
    for i, prompt in enumerate(PROMPTS[:3]):  # still the first runs' samples
        rid = fmt.load(str(gen_out / f"hs_{i}.safetensors")).metadata["rid"]
        assert_output_file(str(gen_out / f"hs_{i}.safetensors"), prompt,
                           generated_reference(prompt, 5, seed=rid))
        assert fmt.load(str(prompt_out / f"hs_{i}.safetensors")).token_ids.tolist() == prompt
    # the same command again resumes
    r = cli(*extract_args(served.url, data, gen_out, "--temperature", 0.7))
    assert r.returncode == 0 and summary(r.stdout)["resumed"] == 3, r.stderr


def test_a_rerun_with_other_sampling_settings_keeps_the_samples_and_stops(served, tmp_path):
    """Each generated row's manifest line records the sampling_params its request sent; a
    rerun with other ones stops at the first kept row, naming the setting (before, it
    resumed: one dataset of samples from two sampling settings). A line without the record
    (an older manifest) is accepted."""
    data = write_data(tmp_path / "d.jsonl", PROMPTS[:3])
    out = tmp_path / "out"
    made = ["--temperature", 0.7, "--sampling-params", '{"top_k": 20}']
    assert cli(*extract_args(served.url, data, out, *made)).returncode == 0
    for i, rec in manifest(out).items():
        (params,) = served.params[i]
        assert params.pop("custom_params")[fmt.OUTPUT_PARAM] is True
        assert rec["sampling_params"] == params == {"max_new_tokens": 5, "temperature": 0.7,
                                                    "top_p": 1.0, "top_k": 20}, (rec, params)
    kept = {p: p.read_bytes() for p in out.glob("hs_*.safetensors")}
    for other, says in (
            (["--temperature", 0.5, "--sampling-params", '{"top_k": 20}'],
             "was generated with --temperature 0.7 (this run: --temperature 0.5): not replaced; "
             "run with the settings it was made with to resume that dataset, or extract into "
             "another --out"),
            ([*made, "--max-new-tokens", 6],
             "was generated with --max-new-tokens 5 (this run: --max-new-tokens 6)"),
            (["--temperature", 0.7, "--sampling-params", '{"top_k": 40}'],
             "was generated with --sampling-params top_k 20 (this run: --sampling-params top_k 40)"),
            (["--temperature", 0.7],
             "was generated with --sampling-params top_k 20 (this run: --sampling-params top_k unset)")):
        r = cli(*extract_args(served.url, data, out, *other))
        assert r.returncode == 3, r.stderr
        errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and says in errors[0], r.stderr
        assert "re-extracting" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert sum(len(t) for t in served.tries.values()) == 3, "a row was sent again"
    assert {p: p.read_bytes() for p in kept} == kept, "a sample of other settings was replaced"
    # the same settings resume
    r = cli(*extract_args(served.url, data, out, *made))
    assert r.returncode == 0 and summary(r.stdout)["resumed"] == 3, r.stderr
    # a manifest of a run before the record (no sampling_params): accepted as it is
    lines = (out / "manifest.jsonl").read_text().splitlines()
    old = [{k: v for k, v in json.loads(line).items() if k != "sampling_params"} for line in lines]
    (out / "manifest.jsonl").write_text("".join(json.dumps(rec) + "\n" for rec in old))
    r = cli(*extract_args(served.url, data, out, "--temperature", 0.5))
    assert r.returncode == 0 and summary(r.stdout)["resumed"] == 3, r.stderr
    assert sum(len(t) for t in served.tries.values()) == 3


def test_a_rerun_on_other_data_keeps_the_samples_and_stops(served, tmp_path):
    """Another DATA into an existing --out (prompts of other token ids at the same rows), with
    and without --generate: the run stops at the first such row (exit 3, one sentence naming
    the file, both prompts' lengths and the way out), nothing sent, every sample kept; once
    that file is deleted the row is extracted again. Before, each hs_<i> failed the check
    for its row and was extracted again: the earlier dataset replaced with exit 0."""
    old = write_data(tmp_path / "old.jsonl", PROMPTS[:3])
    new = write_data(tmp_path / "new.jsonl", PROMPTS[3:6])
    gen_out, prompt_out = tmp_path / "gen", tmp_path / "prompt"

    def plain(data, out):  # without --generate (and --max-new-tokens 5)
        return [a for a in extract_args(served.url, data, out) if a != "--generate"][:-2]

    assert cli(*extract_args(served.url, old, gen_out)).returncode == 0
    assert cli(*plain(old, prompt_out)).returncode == 0
    kept = {p: p.read_bytes() for out in (gen_out, prompt_out) for p in out.glob("hs_*.safetensors")}
    assert len(kept) == 6
    sent = sum(len(t) for t in served.tries.values())
    for out, args in ((gen_out, extract_args(served.url, new, gen_out)), (prompt_out, plain(new, prompt_out))):
        r = cli(*args)
        assert r.returncode == 3, r.stderr
        errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "holds the rows of another prompt" in errors[0] \
            and "re-extracting" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert sum(len(t) for t in served.tries.values()) == sent, "a row was sent"
    assert {p: p.read_bytes() for p in kept} == kept, "a sample of the earlier DATA was replaced"
    for p in prompt_out.glob("hs_*.safetensors"):
        p.unlink()
    r = cli(*plain(new, prompt_out))  # deleted: extracted from the new DATA
    assert r.returncode == 0 and summary(r.stdout)["extracted"] == 3, r.stderr
    for i, prompt in enumerate(PROMPTS[3:6]):
        assert fmt.load(str(prompt_out / f"hs_{i}.safetensors")).token_ids.tolist() == prompt


def test_a_rank_with_other_settings_than_the_other_ranks_in_its_out_stops(served, tmp_path):
    """Ranks of one dataset share one --out; a rank run without --generate, or with other
    sampling settings, than another rank's samples there stops before any row (exit 3, one
    sentence naming that sample and the setting). Before, each rank saw only its own rows:
    the second rank wrote its samples beside the first's, one dataset of two settings."""
    data = write_data(tmp_path / "d.jsonl", PROMPTS[:4])
    out = tmp_path / "out"
    ranks = ["--world-size", 2, "--rank"]
    assert cli(*extract_args(served.url, data, out, *ranks, 0)).returncode == 0
    sent = sum(len(t) for t in served.tries.values())
    plain = [a for a in extract_args(served.url, data, out, *ranks, 1) if a != "--generate"]
    plain = plain[:plain.index("--max-new-tokens")] + plain[plain.index("--max-new-tokens") + 2:]
    for args, says in (
            (plain, "holds its prompt and generated rows, from a --generate run"),
            ([*extract_args(served.url, data, out, *ranks, 1), "--max-new-tokens", 6],
             "was generated with --max-new-tokens 5 (this run: --max-new-tokens 6)")):
        r = cli(*args)
        assert r.returncode == 3, r.stderr
        errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and errors[0] == (
            f"error: {out / 'hs_0.safetensors'} (row 0, another rank's per the manifest) {says}: this "
            f"run would add samples of other settings to that dataset; run every rank with the settings "
            f"it was made with, or extract into another --out"), r.stderr
    assert sum(len(t) for t in served.tries.values()) == sent, "a row was sent"
    assert sorted(p.name for p in out.glob("hs_*")) == ["hs_0.safetensors", "hs_2.safetensors"]
    r = cli(*extract_args(served.url, data, out, *ranks, 1))  # the same settings: the dataset grows
    assert r.returncode == 0 and summary(r.stdout)["extracted"] == 2, r.stderr
    assert {i: rec["sampling_params"]["max_new_tokens"] for i, rec in manifest(out).items()} == {
        0: 5, 1: 5, 2: 5, 3: 5}


def test_convert_masks_the_prompt_of_generated_files(served, tmp_path):
    """SpecForge records of ``--generate`` output: loss_mask 0 on the prompt, 1 on the
    generated tokens, as convert's summary line says (files of prompts alone keep all ones:
    test_client)."""
    import torch

    out, dst = tmp_path / "out", tmp_path / "sf"
    r = cli(*extract_args(served.url, write_data(tmp_path / "d.jsonl", PROMPTS[:3]), out))
    assert r.returncode == 0, r.stderr
    r = cli("convert", out, dst, "--no-final-norm")
    assert r.returncode == 0, r.stderr
    # the summary says so (it said "all ones")
    assert json.loads(r.stdout)["loss_mask"] == ("0 on the prompt, 1 on the response in the 3 generated "
                                                 "file(s); all ones in the others"), r.stdout
    for i, prompt in enumerate(PROMPTS[:3]):
        rec = torch.load(dst / "rows_0-5000" / f"data_{i}.ckpt")
        fed = prompt + generated_reference(prompt, 5)[:-1]
        assert rec["input_ids"].tolist() == fed
        assert rec["loss_mask"].tolist() == [0] * len(prompt) + [1] * 4, rec["loss_mask"]
        hs = fmt.load(str(out / f"hs_{i}.safetensors")).hidden_states
        assert torch.equal(rec["hidden_state"][0], hs[:, -1, :])
        assert torch.equal(rec["aux_hidden_state"][0], hs[:, :-1, :].reshape(len(fed), -1))


def test_speculators_reader_loads_generated_files_unchanged(served, tmp_path):
    import torch

    try:
        from datasets import Dataset
        from hs_connectors import FileTransfer
        from speculators.train.data import ArrowDataset
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"speculators' reader does not import here ({type(e).__name__}: {e})")
    out = tmp_path / "out"
    r = cli(*extract_args(served.url, write_data(tmp_path / "d.jsonl", PROMPTS), out))
    assert r.returncode == 0, r.stderr
    fed = [p + generated_reference(p, 5)[:-1] for p in PROMPTS]
    masks = [[0] * len(p) + [1] * 4 for p in PROMPTS]  # the response, from num_prompt_tokens
    Dataset.from_dict({"input_ids": fed, "loss_mask": masks, "seq_len": [len(f) for f in fed]}
                      ).with_format("torch").save_to_disk(str(tmp_path / "prepared"))
    ds = ArrowDataset(max_len=64, datapath=str(tmp_path / "prepared"), transfer=FileTransfer(out),
                      on_missing="raise")
    for i, ids in enumerate(fed):
        item, hs = ds[i], fmt.load(str(out / f"hs_{i}.safetensors")).hidden_states
        assert item["input_ids"].tolist() == ids and item["loss_mask"].tolist() == masks[i]
        assert torch.equal(item["hidden_states"], hs[:, :3, :].reshape(len(ids), -1))
        assert torch.equal(item["verifier_last_hidden_states"], hs[:, 3, :])
