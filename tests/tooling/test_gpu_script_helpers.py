"""The CPU-checkable parts of the GPU suite's TP checks (tests/gpu/test_gpu_parallel.py,
issue 9), so that the one two-GPU run is not lost to a parsing bug: per-rank device-to-host
bytes read from torch profiler chrome traces as SGLang's /stop_profile exports them, and
the file-against-file comparison of two servers' dumps (testing/checks.py)."""

from __future__ import annotations

import gzip
import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("requests")

from sglang_ext import format as fmt  # noqa: E402
from dumpfiles import write_dump  # noqa: E402
from testing import checks, tiny_models  # noqa: E402


def _trace(path, events):
    with gzip.open(path, "wt") as f:
        json.dump({"schemaVersion": 1, "traceEvents": events}, f)


def test_dtoh_bytes_per_rank_counts_only_device_to_host_copies(tmp_path):
    """A real torch profiler trace of this process (CPU only: no memcpy events) plus
    hand-made CUPTI memcpy records, named as SGLang's profile_utils names them."""
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with prof:
        torch.ones(64).sum()
    prof.export_chrome_trace(str(tmp_path / "real.json"))
    real = json.loads((tmp_path / "real.json").read_text())["traceEvents"]
    copy = {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 1, "dur": 2}
    _trace(tmp_path / "tp-TP-0.trace.json.gz", real + [
        dict(copy, args={"bytes": 3 << 20}), dict(copy, args={"bytes": 1 << 20}),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "args": {"bytes": 9 << 20}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "args": {}},
    ])
    _trace(tmp_path / "tp-TP-1-DP-1.trace.json.gz", real + [dict(copy, args={"bytes": 8})])
    (tmp_path / "cuda_graph_capture-x-TP-0.json.gz").write_bytes(b"not read")
    got = checks.dtoh_bytes_per_rank(str(tmp_path))
    assert {r: (v["dtoh_bytes"], v["dtoh_copies"]) for r, v in got.items()} == {
        0: (4 << 20, 2), 1: (8, 1)}


def _write(d, rid, hs, ids):
    res = fmt.reserve(fmt.open_dump_dir(str(d)), rid)
    write_dump(res, hs, torch.tensor(ids), fmt.build_metadata(rid=rid, layer_ids=[1, 2], num_layers=4))
    fmt.complete(res)
    return os.path.join(str(d), res.name)


def test_compare_kept_finds_value_id_and_missing_differences(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(5, 2, 8, generator=g).to(torch.bfloat16)
    near = (hs.float() * (1 + 1e-3)).to(torch.bfloat16)
    far = (hs.float() + 0.5 * torch.randn(5, 2, 8, generator=g)).to(torch.bfloat16)
    ids = [3, 4, 5, 6, 7]
    prompts = [("same", ids), ("far", ids), ("ids", ids), ("gone", ids)]
    want = {rid: _write(a, rid, hs, ids) for rid, _ in prompts}
    got = {"same": _write(b, "same", near, ids), "far": _write(b, "far", far, ids),
           "ids": _write(b, "ids", hs, [3, 4, 5, 6, 8])}
    problems, worst = checks.compare_kept(prompts[:1], got, want)
    assert problems == [] and worst.files == 1 and worst.block < checks.TOL_BLOCK and worst.problems() == []
    problems, worst = checks.compare_kept(prompts[1:2], got, want)
    assert problems == [] and worst.block > checks.TOL_BLOCK  # the caller fails it on the tolerance
    [line, *_] = worst.problems()
    assert line.startswith("block relative error") and "(far)" in line
    problems, _ = checks.compare_kept(prompts[2:], got, want)
    assert problems == ["ids: token_ids or layer_ids differ", "gone: missing on one side"]


def test_gpu_suite_and_bench_build_the_same_tiny_deepseek(tmp_path):
    """The GPU suite and the benchmark (bench/models.py) build the one DeepseekV3 of
    testing/tiny_models (the benchmark measures the model the GPU tests verified): both
    saved configs agree but for the context length, and every routed expert is selected
    (what makes the fp32 reference exact, see tiny_models). Built for real, on the CPU
    (~40 M parameters)."""
    from bench import models

    tiny_models.build_deepseek(str(tmp_path / "e2e"))
    models.build("deepseek-tiny", str(tmp_path / "bench"))
    got = [json.load(open(tmp_path / d / "config.json")) for d in ("e2e", "bench")]
    assert got[0]["max_position_embeddings"] == 4096 and got[1]["max_position_embeddings"] == 16384
    skip = {"max_position_embeddings", "transformers_version"}
    assert {k: v for k, v in got[0].items() if k not in skip} == {
        k: v for k, v in got[1].items() if k not in skip}
    assert got[0]["num_experts_per_tok"] == got[0]["n_routed_experts"] == 8
    assert got[0]["moe_layer_freq"] == 1 and got[0]["kv_lora_rank"] == 512


def test_store_samples_read_back_as_records_compare_file_takes(tmp_path):
    """testing/store.py against a real mooncake_master and a store node: samples put in
    our manifest's layout (hs-connectors' put_sample), read with ``get_generated``; the
    bf16 record compares exact, the fp8 one within fp8's bound after dequantizing with
    its scales; a wrong dtype or a missing scale is a layout problem."""
    pytest.importorskip("hs_connectors.transfer")
    from mooncake_fixture import HAVE_MOONCAKE, Master

    if not HAVE_MOONCAKE:
        pytest.skip("mooncake not importable")
    from sglang_ext import quant, store
    from testing import store as st

    assert st.missing_reason() is None
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(7, 2, 16, generator=g)
    ids = torch.arange(3, 10)
    m = Master(tmp_path)
    node = st.StoreNode(m.address, 32 << 20, str(tmp_path / "node.log"))
    try:
        reader = st.reader(m.address, 16 << 20)
        q, s = quant.quantize_fp8(ref.reshape(7, 32), 2)
        fp8, scales = q.view(7, 2, 16), s.view(7, 2, 1)
        for dtype, tensors in (("bfloat16", {"hidden_states": ref.bfloat16(), "token_ids": ids}),
                               ("float8_e4m3fn", {"hidden_states": fp8, "hidden_states_scales": scales,
                                                  "token_ids": ids})):
            manifest = store.pack_layout(7, 2, 16, dtype).manifest(f"probe-{dtype}")
            reader.store.put_sample(manifest, tensors)
            sample = reader.get_generated(manifest)
            is_fp8 = dtype != "bfloat16"
            assert st.sample_problems(sample, manifest, 7, is_fp8, "w") == []
            assert st.sample_problems(sample, manifest, 7, not is_fp8, "w") != []
            worst = checks.Worst()
            rec = st.sample_record(sample, [1, 2])
            assert checks.compare_file(rec, ids.tolist(), [1, 2], 16, ref, "w", worst) == []
            assert worst.block <= (2.0 ** -4 if is_fp8 else 4e-3) and worst.block > 0
            assert checks.compare_file(rec, ids.tolist()[::-1], [1, 2], 16, ref, "w", worst) != []
            reader.delete(manifest["handle"])
    finally:
        node.stop()
        m.kill()
