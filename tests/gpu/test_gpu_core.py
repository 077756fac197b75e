"""Core group: the patched server's files equal HF's forward (per model, one server).

Each case sends ``/generate`` requests with ``input_ids`` (concurrently unless stated) and
checks every answer: it names a file that exists and loads, token ids and layer ids are the
request's, the shape is (tokens, layer slots, hidden), and the hidden states are within the
bf16 tolerance of the float32 reference (checks.TOL_BLOCK per request block, TOL_TOKEN per
token row). The last case checks index.jsonl over the files the others made.

The class is reused at --tp N by test_gpu_parallel.py (same cases, another server)."""

from __future__ import annotations

import concurrent.futures as cf
import os
from dataclasses import dataclass
from typing import Optional

import pytest

from testing.checks import TOL_BLOCK, TOL_TOKEN, Problems, Worst, compare_file
from testing.server import CHUNK
from testing.tiny_models import VOCAB

pytestmark = pytest.mark.gpu


@dataclass
class Req:
    ids: list
    max_new_tokens: int = 1
    rid: Optional[str] = None
    early: bool = False  # answered once the name is reserved (hidden_states_pending)
    dump: bool = True  # False: asks not to be dumped (custom_params hidden_states_dump)


def rand_ids(rng, n):
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def send(server, reqs, sequential=False):
    """The answers (JSON) to ``reqs``, in order; concurrently unless ``sequential``."""
    if sequential:
        return [server.generate(q.ids, q.max_new_tokens, q.rid, q.early, q.dump) for q in reqs]
    with cf.ThreadPoolExecutor(len(reqs)) as pool:
        futs = [pool.submit(server.generate, q.ids, q.max_new_tokens, q.rid, q.early, q.dump) for q in reqs]
        return [f.result() for f in futs]


def check_answers(server, reqs, answers, reference, tiny_model, record_property, case,
                  tol=(TOL_BLOCK, TOL_TOKEN)):
    """Every answer's file against the reference (fp8 files dequantized to float32);
    fails with every problem found. ``tol``: (per request block, per token row)."""
    from sglang_ext import format as fmt

    problems, worst, paths = Problems(), Worst(), []
    for i, (q, res) in enumerate(zip(reqs, answers)):
        where = f"{case} request {i} ({len(q.ids)} tokens{', early' if q.early else ''})"
        meta = res["meta_info"]
        path = meta.get("hidden_states_path")
        if not q.dump:
            keys = sorted(k for k in meta if k.startswith("hidden_states"))
            if keys:
                problems.add(f"{where}: asked not to be dumped, answered with {keys}")
            continue
        if meta.get("hidden_states_pending", False) != q.early:
            problems.add(f"{where}: hidden_states_pending {meta.get('hidden_states_pending')!r}, "
                         f"want {q.early}")
        if path and q.early:
            err = fmt.wait_complete(path, timeout=60)
            if err:
                problems.add(f"{where}: early file not completed: {err}")
        if not path or not os.path.exists(path):
            problems.add(f"{where}: no file (path {path!r}, hidden_states_error "
                         f"{meta.get('hidden_states_error')!r})")
            continue
        paths.append(path)
        problems.extend(compare_file(fmt.load(path, dequantize=True), q.ids, tiny_model.layer_ids, tiny_model.hidden_size,
                                     reference(q.ids, tiny_model.layer_ids), where, worst))
    if len(set(paths)) != len(paths):
        problems.add(f"{case}: two answers name the same file")
    server.answered.update(os.path.basename(p) for p in paths)
    worst.record(record_property)
    record_property("requests", len(reqs))
    problems.extend(worst.problems(*tol))
    problems.check(f"{tiny_model.name} {case}")


class TestCore:
    """Issue 3's cases, then the index check over the files they made."""

    TOL = (TOL_BLOCK, TOL_TOKEN)  # test_gpu_fp8.py widens it by fp8's quantization bound

    def _run(self, server, reqs, reference, tiny_model, record_property, case, sequential=False):
        answers = send(server, reqs, sequential)
        check_answers(server, reqs, answers, reference, tiny_model, record_property, case, self.TOL)

    def test_concurrent_32_mixed(self, server, reference, tiny_model, rng, record_property):
        """32 concurrent prompts of 8-599 tokens (batched together, some chunked)."""
        reqs = [Req(rand_ids(rng, rng.randrange(8, 600))) for _ in range(32)]
        self._run(server, reqs, reference, tiny_model, record_property, "concurrent_32_mixed")

    def test_longer_than_chunk_700(self, server, reference, tiny_model, rng, record_property):
        """One 700-token prompt: three chunks of --chunked-prefill-size 256."""
        self._run(server, [Req(rand_ids(rng, 700))], reference, tiny_model, record_property,
                  "longer_than_chunk_700")

    def test_just_over_chunk_257(self, server, reference, tiny_model, rng, record_property):
        """One prompt of CHUNK + 1 tokens: the last chunk holds one token."""
        self._run(server, [Req(rand_ids(rng, CHUNK + 1))], reference, tiny_model, record_property,
                  "just_over_chunk_257")

    def test_shared_prefix_pair(self, server, reference, tiny_model, rng, record_property):
        """Two prompts sharing a 400-token prefix, one after the other (the radix cache
        would serve the second's prefix: the dump turns it off)."""
        prefix = rand_ids(rng, 400)
        reqs = [Req(prefix + rand_ids(rng, 50)), Req(prefix + rand_ids(rng, 70))]
        self._run(server, reqs, reference, tiny_model, record_property, "shared_prefix_pair", sequential=True)

    def test_max_new_tokens_8(self, server, reference, tiny_model, rng, record_property):
        """Decode steps after the prefill: the file holds the prompt's rows only."""
        reqs = [Req(rand_ids(rng, 120), max_new_tokens=8), Req(rand_ids(rng, 300), max_new_tokens=8)]
        self._run(server, reqs, reference, tiny_model, record_property, "max_new_tokens_8")

    def test_same_rid_twice(self, server, reference, tiny_model, rng, record_property):
        """The same rid twice, one after the other: two files, each the right prompt."""
        reqs = [Req(rand_ids(rng, 90), rid="dup-rid"), Req(rand_ids(rng, 60), rid="dup-rid")]
        self._run(server, reqs, reference, tiny_model, record_property, "same_rid_twice", sequential=True)

    def test_early_answers_mixed_16(self, server, reference, tiny_model, rng, record_property):
        """16 concurrent prompts of 8-899 tokens, every other one answered before the write
        (hidden_states_pending, then the file completes); the plain ones in the same
        batches carry no pending flag and wait as before."""
        reqs = [Req(rand_ids(rng, rng.randrange(8, 900)), early=i % 2 == 0) for i in range(16)]
        self._run(server, reqs, reference, tiny_model, record_property, "early_answers_mixed_16")

    def test_not_dumped_beside_dumped_16(self, server, reference, tiny_model, rng, record_property):
        """16 concurrent prompts of 8-899 tokens, every third asking not to be dumped
        (custom_params hidden_states_dump=false): those answers carry no dump keys and
        leave no file; the others, in the same batches, still equal the reference."""
        from sglang_ext import format as fmt

        def files():
            return sum(n.endswith(".safetensors") for n in os.listdir(server.dump_dir))

        reqs = [Req(rand_ids(rng, rng.randrange(8, 900)), dump=i % 3 != 0) for i in range(16)]
        before, lines = files(), len(fmt.read_index(server.dump_dir))
        self._run(server, reqs, reference, tiny_model, record_property, "not_dumped_beside_dumped_16")
        dumped = sum(q.dump for q in reqs)
        assert (files() - before, len(fmt.read_index(server.dump_dir)) - lines) == (dumped, dumped)

    def test_index_one_line_per_file(self, server, record_property):
        """index.jsonl has one line per file; every file an answer named exists; no other
        file: SGLang's start-up warm-up request (http_server._execute_server_warmup) is
        named by patch 0007 (hooks.warmup_request) and not dumped."""
        from sglang_ext import format as fmt

        index = fmt.read_index(server.dump_dir)
        files = sorted(x for x in os.listdir(server.dump_dir) if x.endswith(".safetensors"))
        extra = [f for f in files if f not in server.answered]
        record_property("files", len(files))
        record_property("index_lines", len(index))
        record_property("responses_with_file", len(server.answered))
        record_property("warmup_token_ids", [fmt.load(os.path.join(server.dump_dir, f)).token_ids.tolist()[:16]
                                             for f in extra])
        indexed = sorted(r["file"] for r in index)
        problems = Problems()
        if indexed != files:
            problems.add(f"index lines name {len(indexed)} files, the directory holds {len(files)}; "
                         f"only indexed: {sorted(set(indexed) - set(files))[:5]}, "
                         f"only on disk: {sorted(set(files) - set(indexed))[:5]}")
        missing = sorted(server.answered - set(files))
        if missing:
            problems.add(f"answered files missing from the directory: {missing[:5]}")
        if extra:
            problems.add(f"{len(extra)} files no answer named (the warm-up leaves none): {extra[:5]}")
        problems.check(f"index of {server.dump_dir}")
