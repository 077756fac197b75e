"""Clients group: the trainers' and our own clients against the patched server (issue 6;
docs/client.md). Llama only: these clients need a tokenizer on the server
(/v1/completions builds its response text), and the tiny Llama has a word-level one;
the DeepseekV3 is served with --skip-tokenizer-init."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from testing.checks import TOL_BLOCK, Problems, Worst, compare_file
from test_gpu_core import rand_ids

pytestmark = [pytest.mark.gpu, pytest.mark.models("llama")]


def test_openai_v1_completions_vllm_protocol(server, reference, tiny_model, rng, record_property):
    """vLLM's hidden-states protocol on /v1/completions (patch 0006), as speculators'
    offline generator uses it: prompt = token ids, max_tokens = 1, return_token_ids;
    reads choices[0].prompt_token_ids and kv_transfer_params.hidden_states_path."""
    from sglang_ext import format as fmt

    problems, worst = Problems(), Worst()
    for n in (17, 300, 701):
        ids = rand_ids(rng, n)
        where = f"/v1/completions prompt of {n} tokens"
        r = server.post({"model": tiny_model.path, "prompt": ids, "max_tokens": 1, "temperature": 0,
                         "return_token_ids": True}, path="/v1/completions")
        if r.status_code != 200:
            problems.add(f"{where}: HTTP {r.status_code} {r.text[:200]}")
            continue
        j = r.json()
        if j["choices"][0].get("prompt_token_ids") != ids:
            problems.add(f"{where}: choices[0].prompt_token_ids differ from the prompt")
        path = (j.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path or not os.path.exists(path) or os.path.exists(path + ".lock"):
            problems.add(f"{where}: kv_transfer_params {j.get('kv_transfer_params')} (no complete file)")
            continue
        problems.extend(compare_file(fmt.load(path), ids, tiny_model.layer_ids, tiny_model.hidden_size,
                                     reference(ids, tiny_model.layer_ids), where, worst))
    worst.record(record_property)
    problems.extend(worst.problems(TOL_BLOCK, tol_token=None))
    problems.check("/v1/completions")


def test_extract_cli_200_validate(server, reference, tiny_model, rng, record_property, tmp_path, scratch_dir):
    """``python -m sglang_ext extract --validate`` over 200 prompts against this server;
    8 of its files against the reference."""
    from sglang_ext import format as fmt

    data = tmp_path / "extract-data.jsonl"
    prompts = [rand_ids(rng, rng.randrange(16, 400)) for _ in range(200)]
    data.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in prompts))
    out = os.path.join(scratch_dir, "extract")
    proc = subprocess.run([sys.executable, "-m", "sglang_ext", "extract", "--endpoint", server.url,
                           "--data", str(data), "--out", out, "--validate", "--concurrency", "32",
                           "--no-progress"], capture_output=True, text=True, timeout=600)
    record_property("summary_tail", proc.stdout[-600:])
    problems, worst = Problems(), Worst()
    if proc.returncode != 0:
        problems.add(f"extract exited with {proc.returncode}: {proc.stderr[-400:]}")
    files = sorted(n for n in os.listdir(out) if n.startswith("hs_")) if os.path.isdir(out) else []
    if len(files) != 200:
        problems.add(f"{len(files)} hs_ files for 200 prompts")
    for i in rng.sample(range(200), 8):
        path = os.path.join(out, f"hs_{i}.safetensors")
        if os.path.exists(path):
            problems.extend(compare_file(fmt.load(path), prompts[i], tiny_model.layer_ids, tiny_model.hidden_size,
                                         reference(prompts[i], tiny_model.layer_ids), f"hs_{i}", worst))
    worst.record(record_property)
    problems.extend(worst.problems(TOL_BLOCK, tol_token=None))
    problems.check("sglang_ext extract")


def test_speculators_own_generator(server, reference, tiny_model, rng, record_property, scratch_dir):
    """speculators 0.9.0's own offline generator, unchanged, against this server's /v1:
    ``generate_offline_data``'s loop (its vLLM client ``generate_hidden_states_async``, its
    lock check, its move and ``check_hidden_states``) over a preprocessed dataset; then its
    trainer's ``ArrowDataset`` reads the files. Plus one call of its synchronous
    ``generate_hidden_states``. Needs speculators==0.9.0 and datasets (README)."""
    import asyncio

    import torch

    try:
        import openai
        from datasets import Dataset
        from speculators.cli.generate_offline_data import _generate_and_save_hidden_states
        from speculators.data_generation.vllm_client import generate_hidden_states
        from speculators.train.data import ArrowDataset
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"speculators 0.9.0 does not import ({type(e).__name__}: {e}); "
                    "pip install speculators==0.9.0 datasets")
    from sglang_ext import format as fmt

    problems, worst = Problems(), Worst()
    prompts = [rand_ids(rng, rng.randrange(16, 600)) for _ in range(24)]
    ds_path = os.path.join(scratch_dir, "speculators-prepared")
    Dataset.from_dict({"input_ids": prompts, "loss_mask": [[1] * len(p) for p in prompts],
                       "seq_len": [len(p) for p in prompts]}).with_format("torch").save_to_disk(ds_path)
    asyncio.run(_generate_and_save_hidden_states(
        model=None, endpoint=f"{server.url}/v1", preprocessed_data=ds_path, output=None,
        max_samples=None, concurrency=8, validate_outputs=True, request_timeout=300, max_retries=2,
        fail_on_error=False, max_consecutive_errors=5, world_size=1, rank=0))
    hs_dir = os.path.join(ds_path, "hidden_states")
    missing = [i for i in range(len(prompts)) if not os.path.exists(f"{hs_dir}/hs_{i}.safetensors")]
    if missing:
        problems.add(f"no hs_ file for samples {missing[:10]}")
    ds = ArrowDataset(max_len=1024, datapath=ds_path, on_missing="raise") if not missing else None
    for i in rng.sample(range(len(prompts)), 6):
        if i in missing:
            continue
        rec = fmt.load(f"{hs_dir}/hs_{i}.safetensors")
        n = len(prompts[i])
        found = compare_file(rec, prompts[i], tiny_model.layer_ids, tiny_model.hidden_size,
                             reference(prompts[i], tiny_model.layer_ids), f"hs_{i}", worst)
        problems.extend(found)
        if found:
            continue
        item = ds[i]
        if not (torch.equal(item["hidden_states"], rec.hidden_states[:, :-1, :].reshape(n, -1))
                and torch.equal(item["verifier_last_hidden_states"], rec.hidden_states[:, -1, :])
                and item["input_ids"].tolist() == prompts[i]):
            problems.add(f"ArrowDataset item {i} differs from hs_{i}.safetensors")
    ids = rand_ids(rng, 123)
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as client:
        path, params = generate_hidden_states(client, tiny_model.path, {"input_ids": ids}, timeout=300)
    if params.get("hidden_states_path") != path or os.path.exists(path + ".lock"):
        problems.add(f"generate_hidden_states: {path} {params}")
    else:
        problems.extend(compare_file(fmt.load(path), ids, tiny_model.layer_ids, tiny_model.hidden_size,
                                     reference(ids, tiny_model.layer_ids), "generate_hidden_states", worst))
    worst.record(record_property)
    record_property("requests", len(prompts) + 1)
    problems.extend(worst.problems(TOL_BLOCK, tol_token=None))
    problems.check("speculators' generator and reader")
