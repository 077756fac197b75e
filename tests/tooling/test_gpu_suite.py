"""The GPU suite's plumbing, checked on the CPU (nobody runs tests/gpu before the one GPU
run): pytest collects the cases with the expected ids, markers and order; the default CPU
run leaves them out; without CUDA they are skipped with the reason; and the helpers the
GPU tests stand on (relative errors, the HF reference's pre-norm hook, the server's command
line and lifecycle, leftovers, log and results parsing) behave on hand-made inputs."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("requests")

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "tests" / "gpu"

from sglang_ext import format as fmt  # noqa: E402
from dumpfiles import write_dump  # noqa: E402
from testing import checks, reference, tiny_models  # noqa: E402
from testing import server as gpu_server  # noqa: E402

CORE = ["test_concurrent_32_mixed", "test_longer_than_chunk_700", "test_just_over_chunk_257",
        "test_shared_prefix_pair", "test_max_new_tokens_8", "test_same_rid_twice",
        "test_early_answers_mixed_16", "test_not_dumped_beside_dumped_16", "test_index_one_line_per_file"]
CLIENTS = ["test_openai_v1_completions_vllm_protocol", "test_extract_cli_200_validate",
           "test_speculators_own_generator"]
FAULTS = ["test_client_disconnect", "test_malformed_400", "test_hostile_rids_http", "test_same_rid_at_once",
          "test_metrics_endpoint", "test_writer_killed", "test_huge_rid", "test_writer_stopped",
          "test_sigterm_in_flight"]
PARALLEL = ["test_one_writer_rank", "test_one_rank_copies", "test_tp_equals_tp1"]
FP8 = CORE[:-1] + ["test_files_are_fp8_with_per_layer_scales", CORE[-1]]
STORE = ["test_concurrent_mixed_with_chunked_prefill", "test_one_rid_twice_then_again",
         "test_v1_completions_kv_transfer_params_is_the_manifest", "test_samples_outlive_the_server"]


def store_ids(m):
    """test_gpu_store.py's ids of model ``m``: per dump dtype (bf16, then fp8), the cases
    in file order; /v1/completions on llama only (deepseek has no tokenizer)."""
    return [f"tests/gpu/test_gpu_store.py::{t}[{d}-{m}]" for d in ("bf16", "fp8") for t in STORE
            if m == "llama" or "v1_completions" not in t]


VLM = ["test_chat_one_image_data_url", "test_chat_image_file_url_between_text", "test_chat_text_only",
       "test_kimi_chat_image_dump_file", "test_kimi_rows_match_sglang_json_hidden_states"]
# test_gpu_quant.py: the fused fp8 kernel against the torch form, no server
QUANT = ["test_kernel_is_ready_on_this_gpu",
         *[f"test_kernel_equals_the_torch_form[{c}]" for c in ("llama-8b-2k", "kimi-512", "fp16-odd", "fp32", "empty")],
         "test_probe_rows_equal_the_torch_form", "test_warm_up_takes_the_served_shape",
         "test_the_writer_path_takes_the_kernel"]
# test_gpu_kimi_slice.py: Kimi-K2.5's real dimensions, its own slice model (issue 48)
# test_gpu_output.py: output rows (issue 49; needs patches 0009-0012: patches/candidates/v0.5.23)
OUTPUT = ["test_greedy_8_concurrent", "test_sampled_4", "test_stop_token_and_stop_string_end_the_file",
          "test_max_new_tokens_1_is_the_prompt_file_with_its_one_token",
          "test_without_the_parameter_in_the_same_batches_prompt_only",
          "test_the_last_output_names_the_file_however_it_was_sent",
          "test_abort_mid_generation_leaves_a_whole_file_or_none"]
KIMI_SLICE = ["test_bf16_files", "test_bf16_bench", "test_fp8_files_and_bench",
              "test_store_objects[bf16]", "test_store_objects[fp8]", "test_nodump_bench",
              "test_dump_equals_sglang_own_rows", "test_files_match_reference"]


def expected_ids(models=("llama", "deepseek", "kimi"), multi_gpu=True, single_gpu=True):
    """The GPU suite's ids for ``--models`` = ``models``: per model its groups; then
    test_gpu_quant.py's and test_gpu_vlm.py's (no model_name), single GPU, only when
    ``models`` is every tiny model (a run narrowed by --models leaves them out)."""
    ids = []
    for m in models:
        if single_gpu:
            if m == "llama":
                ids += [f"tests/gpu/test_gpu_clients.py::{t}[{m}]" for t in CLIENTS]
            ids += [f"tests/gpu/test_gpu_core.py::TestCore::{t}[{m}]" for t in CORE]
            if m == "kimi":  # the core group only
                continue
            ids += [f"tests/gpu/test_gpu_faults.py::{t}[{m}]" for t in FAULTS]
            ids += [f"tests/gpu/test_gpu_fp8.py::TestCoreFp8::{t}[{m}]" for t in FP8]
            ids += store_ids(m)
            ids += [f"tests/gpu/test_gpu_output.py::{t}[{m}]" for t in OUTPUT]
            if m == "llama":
                ids.append(f"tests/gpu/test_gpu_fleet.py::test_three_servers_behind_the_router_one_killed[{m}]")
        if multi_gpu and m != "kimi":
            ids += [f"tests/gpu/test_gpu_parallel.py::TestCoreAtTP::{t}[{m}]" for t in CORE]
            ids += [f"tests/gpu/test_gpu_parallel.py::{t}[{m}]" for t in PARALLEL]
            if m == "deepseek":
                ids.append(f"tests/gpu/test_gpu_parallel.py::test_dp_attention_equals[{m}]")
    if single_gpu and set(models) == set(tiny_models.MODELS):
        ids += [f"tests/gpu/test_gpu_quant.py::{t}" for t in QUANT]
        ids += [f"tests/gpu/test_gpu_vlm.py::{t}" for t in VLM]
        ids += [f"tests/gpu/test_gpu_kimi_slice.py::{t}" for t in KIMI_SLICE]
    return ids


def run_pytest(*args, cwd=REPO, extra_path=()):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, extra_path), str(REPO),
                                                        os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def collected(*args):
    proc = run_pytest("--collect-only", "-q", *args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return [ln for ln in proc.stdout.splitlines() if "::" in ln]


# ---- collection --------------------------------------------------------------------
def test_collects_every_gpu_case_in_run_order():
    """Every case of the GPU suite, once per model, grouped by model (one build, reference
    and server per model and module), in the order the dependencies need."""
    got = collected("tests/gpu")
    assert sorted(got) == sorted(expected_ids()), (
        f"missing {sorted(set(expected_ids()) - set(got))}, unexpected {sorted(set(got) - set(expected_ids()))}")
    for m in ("llama", "deepseek", "kimi"):
        mine = [i for i in got if i.endswith(f"[{m}]") or i.endswith(f"-{m}]")]
        classes = ("test_gpu_core.py::TestCore",) + (() if m == "kimi" else ("test_gpu_parallel.py::TestCoreAtTP",))
        for cls in classes:
            core = [i for i in mine if cls in i]
            assert core[-1].split("::")[-1].startswith("test_index_one_line_per_file"), core
        if m != "kimi":  # kimi: the core group only
            faults = [i for i in mine if "test_gpu_faults" in i]
            assert faults[-1].split("::")[-1].startswith("test_sigterm_in_flight"), faults  # ends the server
            par = [i.split("::")[-1].split("[")[0] for i in mine if "test_gpu_parallel.py::test_" in i]
            assert par.index("test_one_rank_copies") < par.index("test_tp_equals_tp1")  # then the TP server stops
            for d in ("bf16", "fp8"):  # one store server per dtype, its cases together, the last ends it
                store = [i for i in mine if "test_gpu_store" in i and i.endswith(f"[{d}-{m}]")]
                assert store == [i for i in store_ids(m) if i.endswith(f"[{d}-{m}]")], store
                start = got.index(store[0])
                assert got[start:start + len(store)] == store
        # all of one model's tests run before the next model's (session-scoped model)
        first, last = got.index(mine[0]), got.index(mine[-1])
        assert got[first:last + 1] == mine


def test_markers_select_single_and_multi_gpu_groups():
    single = collected("tests/gpu", "-m", "gpu and not multi_gpu")
    assert sorted(single) == sorted(expected_ids(multi_gpu=False))
    multi = collected("tests/gpu", "-m", "multi_gpu")
    assert sorted(multi) == sorted(expected_ids(single_gpu=False))


def test_models_option_and_k_pick_one_model():
    """``--models llama`` leaves DeepseekV3-only tests out (deselected, not skipped),
    ``--models kimi`` leaves the core group, both leave test_gpu_vlm.py out; ``-k deepseek``
    picks by id, ``-k store`` the store group (bf16 then fp8), ``-k vlm`` the image module
    in file order; an unknown model is a usage error."""
    assert sorted(collected("tests/gpu", "--models", "llama")) == sorted(expected_ids(models=("llama",)))
    assert sorted(collected("tests/gpu", "--models", "kimi")) == sorted(expected_ids(models=("kimi",)))
    assert len(expected_ids(models=("kimi",))) == len(CORE)
    assert sorted(collected("tests/gpu", "-k", "deepseek")) == sorted(expected_ids(models=("deepseek",)))
    assert collected("tests/gpu", "--models", "llama", "-k", "store") == store_ids("llama")
    assert collected("tests/gpu", "-k", "vlm") == [f"tests/gpu/test_gpu_vlm.py::{t}" for t in VLM]
    assert collected("tests/gpu", "-k", "quant") == [f"tests/gpu/test_gpu_quant.py::{t}" for t in QUANT]
    proc = run_pytest("--collect-only", "-q", "tests/gpu", "--models", "llama,gpt")
    assert proc.returncode == 4 and "--models: unknown model(s) ['gpt']" in proc.stderr


def test_the_default_run_leaves_tests_gpu_out():
    """``pytest`` at the root (tests/run.sh, CI) collects the CPU suite and nothing under
    tests/gpu (pyproject's norecursedirs)."""
    got = collected()
    assert any(i.startswith("tests/tooling/test_gpu_suite.py::") for i in got)
    assert not [i for i in got if i.startswith("tests/gpu/")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: the GPU suite would run")
def test_without_cuda_every_gpu_test_is_skipped_with_the_reason(tmp_path):
    """Run (not just collect) on this CPU host: every test reported skipped with one clear
    reason, none set up (no model build, no server); the results JSON records them."""
    out = tmp_path / "r.json"
    proc = run_pytest("-q", "-rs", "tests/gpu", "--results-json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert f"{len(expected_ids())} skipped" in proc.stdout
    assert "CUDA is not available (torch.cuda.is_available() is False)" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["counts"] == {"skipped": len(expected_ids())}
    assert {t["id"] for t in doc["tests"]} == set(expected_ids())
    assert all("CUDA is not available" in t["message"] for t in doc["tests"])


# ---- the results plugin ---------------------------------------------------------------
def test_results_json_records_outcomes_durations_and_properties(tmp_path):
    (tmp_path / "test_demo.py").write_text(textwrap.dedent("""
        import pytest

        def test_ok(record_property):
            record_property("max_rel_err", 0.0081)

        def test_bad(record_property):
            record_property("max_rel_err", 0.5)
            assert 0.5 <= 0.02, "block relative error 5.000e-01 > 0.02"

        @pytest.mark.skip(reason="not here")
        def test_skipped():
            pass

        @pytest.fixture
        def broken():
            raise RuntimeError("server exited with 1")

        def test_setup_error(broken):
            pass
    """))
    out = tmp_path / "res.json"
    proc = run_pytest("-q", "-p", "record", "--results-json", str(out), str(tmp_path / "test_demo.py"),
                      cwd=tmp_path, extra_path=[GPU])
    assert proc.returncode == 1, proc.stdout[-2000:]
    doc = json.loads(out.read_text())
    tests = {t["id"].split("::")[-1]: t for t in doc["tests"]}
    assert {k: v["outcome"] for k, v in tests.items()} == {
        "test_ok": "passed", "test_bad": "failed", "test_skipped": "skipped", "test_setup_error": "error"}
    assert tests["test_ok"]["properties"] == {"max_rel_err": 0.0081}
    assert tests["test_bad"]["properties"] == {"max_rel_err": 0.5}
    assert "block relative error 5.000e-01 > 0.02" in tests["test_bad"]["message"]
    assert "server exited with 1" in tests["test_setup_error"]["message"]
    assert tests["test_skipped"]["message"] == "Skipped: not here"
    assert doc["counts"] == {"passed": 1, "failed": 1, "skipped": 1, "error": 1}
    assert doc["exitstatus"] == 1 and doc["versions"]["pytest"]
    assert all(t["duration_s"] >= 0 for t in doc["tests"])


# ---- relative errors and the reference --------------------------------------------------
def test_rel_errors_block_token_and_where():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(6, 3, 16, generator=g)
    got = ref.clone()
    got[4, 1] *= 1.1  # one row 10% off
    err = reference.rel_errors(got.to(torch.bfloat16), ref)
    assert err.at == (4, 1)
    assert err.token == pytest.approx(0.1, rel=0.05)
    want_block = ((got - ref).norm() / ref.norm()).item()
    assert err.block == pytest.approx(want_block, rel=0.1) and err.block < err.token
    with pytest.raises(ValueError, match=r"shape \(6, 3, 8\) != reference shape \(6, 3, 16\)"):
        reference.rel_errors(got[..., :8], ref)


def test_worst_reports_what_where_and_by_how_much():
    w = checks.Worst()
    w.add(reference.RelError(0.01, 0.03, (2, 0)), "request 0 (40 tokens)")
    w.add(reference.RelError(0.025, 0.06, (7, 2)), "request 3 (700 tokens)")
    w.add(reference.RelError(0.02, 0.04, (1, 1)), "request 5 (9 tokens)")
    assert (w.block, w.token, w.files) == (0.025, 0.06, 3)
    assert w.problems() == [
        "block relative error 2.500e-02 > 0.02 (request 3 (700 tokens))",
        "per-token relative error 6.000e-02 > 0.05 (request 3 (700 tokens), token row 7, layer slot 2)"]
    assert w.problems(tol_block=0.03, tol_token=None) == []
    props = []
    w.record(lambda k, v: props.append((k, v)))
    assert props == [("max_rel_err", 0.025), ("max_rel_err_per_token", 0.06), ("files_compared", 3)]


def _write(d, rid, hs, ids, layer_ids=(1, 2)):
    res = fmt.reserve(fmt.open_dump_dir(str(d)), rid)
    write_dump(res, hs, torch.tensor(ids),
                fmt.build_metadata(rid=rid, layer_ids=list(layer_ids), num_layers=4))
    fmt.complete(res)
    return os.path.join(str(d), res.name)


def test_compare_file_checks_shape_ids_layers_and_errors(tmp_path):
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(5, 2, 8, generator=g)
    ids = [3, 4, 5, 6, 7]
    rec = fmt.load(_write(tmp_path, "a", ref.to(torch.bfloat16), ids))
    w = checks.Worst()
    assert checks.compare_file(rec, ids, (1, 2), 8, ref, "a", w) == [] and w.problems() == []
    assert checks.compare_file(rec, [3, 4, 9, 6, 7], (1, 2), 8, ref, "b", w) == [
        "b: token_ids differ from the request's from position 2"]
    assert checks.compare_file(rec, ids, (1, 3), 8, ref, "c", w) == ["c: layer_ids [1, 2] != [1, 3]"]
    assert checks.compare_file(rec, ids, (1, 2), 16, ref, "d", w) == [
        "d: hidden_states shape (5, 2, 8) != (5, 2, 16) (tokens, layer slots, hidden)"]
    far = checks.Worst()
    checks.compare_file(rec, ids, (1, 2), 8, ref * 2, "e", far)
    assert far.block == pytest.approx(0.5, rel=0.01) and far.problems()[0].startswith("block relative error 4.99")


def test_worst_fails_a_file_with_nan_or_inf_whatever_comes_after():
    """A NaN (or inf) anywhere in a dumped block makes its relative errors NaN (inf); the
    worst over the files keeps it and every tolerance fails, even after clean files."""
    ref = torch.ones(4, 2, 8)
    bad = ref.clone()
    bad[1, 0, 3] = float("nan")
    w = checks.Worst()
    w.add(reference.rel_errors(ref * 1.001, ref), "clean")
    w.add(reference.rel_errors(bad, ref), "nan")
    w.add(reference.rel_errors(ref * 1.001, ref), "clean again")
    assert w.problems() == ["block relative error nan > 0.02 (nan)",
                            "per-token relative error nan > 0.05 (nan, token row 1, layer slot 0)"]
    # per layer slot: the NaN stays in slot 0, slot 1 keeps the clean files' 1e-3
    assert math.isnan(w.slots[0]) and w.slots[1] == pytest.approx(1e-3, rel=1e-2)
    bad[1, 0, 3] = float("inf")
    w = checks.Worst()
    w.add(reference.rel_errors(bad, ref), "inf")
    assert [p.split(" (")[0] for p in w.problems()] == ["block relative error inf > 0.02",
                                                        "per-token relative error inf > 0.05"]


def test_reference_layers_and_the_pre_norm_hook(tmp_path):
    """The tiny Llama built for real on the CPU: id k < N is the residual entering decoder
    layer k (checked with a pre-hook on that layer, independent of output_hidden_states),
    id N the final norm's input (norm(it) is HF's last hidden state), id 0 the embeddings."""
    n = tiny_models.build_llama(str(tmp_path / "llama"))
    assert n == 8 and (tmp_path / "llama" / "tokenizer.json").exists()
    ref = reference.Reference(str(tmp_path / "llama"), device="cpu")
    seen = {}
    for k in (2, 5):
        ref.model.model.layers[k].register_forward_pre_hook(
            lambda mod, args, kwargs, k=k: seen.__setitem__(k, args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True)
    ids = [5, 17, 300, 1023, 9, 42]
    got = ref(ids, (0, 2, 5, 8))
    assert got.shape == (6, 4, 256) and got.dtype == torch.float32
    emb = ref.model.model.embed_tokens(torch.tensor([ids]))[0]
    torch.testing.assert_close(got[:, 0], emb)
    torch.testing.assert_close(got[:, 1], seen[2][0])
    torch.testing.assert_close(got[:, 2], seen[5][0])
    with torch.no_grad():
        final = ref.model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(ref.model.model.norm(got[:, 3]), final)
    assert not torch.allclose(got[:, 3], final)  # the pre-norm stream, not the normed one


def test_reference_bf16_pass_is_hf_own_bf16_load(tmp_path):
    """``to_dtype(bf16)`` gives the forward of HF's own bf16 load of the checkpoint
    (``from_pretrained(dtype=torch.bfloat16)``, the independent reference here): the same
    hidden states at every id, the rotary ``inv_freq`` kept in float32 as that load keeps it
    (a whole-model cast rounds it to bf16 and moves the rope angles at far positions)."""
    from transformers import AutoModelForCausalLM

    tiny_models.build_llama(str(tmp_path / "llama"))
    ref = reference.Reference(str(tmp_path / "llama"), device="cpu")
    ids = [(7 * i + 3) % tiny_models.VOCAB for i in range(600)]
    f32 = ref(ids, (1, 4, 8))
    ref.to_dtype(torch.bfloat16)
    got = ref(ids, (1, 4, 8))
    assert ref.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert ref.model.model.rotary_emb.inv_freq.dtype == torch.float32
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "llama"), dtype=torch.bfloat16).eval()
    assert hf.model.rotary_emb.inv_freq.dtype == torch.float32
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.stack([out[1][0], out[4][0]], dim=1).float()
    torch.testing.assert_close(got[:, :2], want, rtol=0, atol=0)
    # bf16 rounding, not garbage: within the GPU suite's bf16 tolerance of float32
    assert 0 < reference.rel_errors(got, f32).block < 2e-2


def test_tiny_model_specs_and_build_resolve_layer_ids(tmp_path):
    """llama: default layers of 8 (2,4,5,8), entrypoint launcher, its own reference;
    deepseek and kimi: 1,3,4, direct."""
    built = tiny_models.build(tiny_models.MODELS["llama"], str(tmp_path))
    assert (built.name, built.num_layers, built.hidden_size, built.layer_ids) == ("llama", 8, 256, (2, 4, 5, 8))
    assert built.reference_path == built.path
    assert tiny_models.MODELS["llama"].launcher == "entrypoint"
    for name in ("deepseek", "kimi"):
        spec = tiny_models.MODELS[name]
        assert (spec.layers_flag, spec.launcher) == ("1,3,4", "direct")


def test_kimi_is_the_deepseek_text_model_plus_a_vision_tower(tiny_models_built):
    """The tiny Kimi-K2.5's language model is the tiny DeepseekV3, tensor for tensor (both
    built here, independently), under ``language_model.``; the rest is the vision tower and
    projector; its reference directory is a DeepseekV3 of the same weights and config; the
    served directory holds the processor stand-in and no tokenizer.json (served with
    --skip-tokenizer-init and --trust-remote-code)."""
    from safetensors.torch import load_file

    kimi, ds = tiny_models_built["kimi"], tiny_models_built["deepseek"]
    assert (kimi.num_layers, kimi.hidden_size, kimi.layer_ids) == (4, 1024, (1, 3, 4))
    assert kimi.reference_path == kimi.path + "-text" and ds.reference_path == ds.path
    want = load_file(os.path.join(ds.path, "model.safetensors"))
    got = load_file(os.path.join(kimi.path, "model.safetensors"))
    text = {k[len("language_model."):]: t for k, t in got.items() if k.startswith("language_model.")}
    assert sorted(text) == sorted(want)
    assert [k for k in want if not torch.equal(text[k], want[k])] == []
    vision = tiny_models.kimi_vision_shapes(tiny_models.kimi_vision_config(1024))
    assert {k: tuple(t.shape) for k, t in got.items() if k not in [f"language_model.{n}" for n in want]} == vision
    ref = load_file(os.path.join(kimi.reference_path, "model.safetensors"))
    assert sorted(ref) == sorted(want) and all(torch.equal(ref[k], want[k]) for k in want)

    def config(path):
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)

    cfg = config(kimi.path)
    assert (cfg["architectures"], cfg["model_type"]) == (["KimiK25ForConditionalGeneration"], "kimi_k25")
    assert cfg["text_config"] == {k: v for k, v in config(ds.path).items() if k != "transformers_version"}
    assert cfg["media_placeholder_token_id"] < cfg["text_config"]["vocab_size"]
    assert cfg["media_placeholder_token_id"] < 3  # prompts draw ids from 3 (test_gpu_core.rand_ids)
    cmd = gpu_server.server_command(kimi.path, "/dev/shm/d", "1,3,4", "direct")
    assert "--skip-tokenizer-init" in cmd and "--trust-remote-code" in cmd
    assert "--trust-remote-code" not in gpu_server.server_command(ds.path, "/dev/shm/d", "1,3,4", "direct")


# ---- the server: command line and lifecycle ---------------------------------------------
def test_cuda_graph_max_bs_is_spelled_as_the_installed_sglang_does(tmp_path, monkeypatch):
    """0.5.22+ split the flag (argparse rejects the old name there as an ambiguous prefix)."""
    monkeypatch.setattr(gpu_server, "sglang_srt_dir", lambda: str(tmp_path / "srt"))
    assert gpu_server.cuda_graph_max_bs_flags(8) == ["--cuda-graph-max-bs", "8"]  # 0.5.17's tree
    (tmp_path / "srt" / "arg_groups").mkdir(parents=True)
    (tmp_path / "srt" / "arg_groups" / "cuda_graph_hook.py").write_text("")
    assert gpu_server.cuda_graph_max_bs_flags(8) == ["--cuda-graph-max-bs-decode", "8"]
    monkeypatch.setattr(gpu_server, "sglang_srt_dir", lambda: None)  # no SGLang: the old name
    assert gpu_server.cuda_graph_max_bs_flags(8) == ["--cuda-graph-max-bs", "8"]


def test_server_command_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_server, "sglang_srt_dir", lambda: None)  # spelling: the test above
    with_tok, no_tok = tmp_path / "llama", tmp_path / "ds"
    with_tok.mkdir()
    no_tok.mkdir()
    (with_tok / "tokenizer.json").write_text("{}")
    base = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--port", "30011",
            "--mem-fraction-static", "0.3", "--chunked-prefill-size", "256", "--cuda-graph-max-bs", "8",
            "--enable-metrics"]
    cmd = gpu_server.server_command(str(with_tok), "/dev/shm/d", None, "entrypoint", python="py")
    assert cmd == ["py", "-m", "sglang_ext.tools.entrypoint", "--model-path", str(with_tok), *base,
                   "--dump-hidden-states-dir", "/dev/shm/d"]
    opts = gpu_server.ServerOptions(tp=2, dp_attention=True, cuda_graph=False, dump_dtype="fp8")
    cmd = gpu_server.server_command(str(no_tok), "/dev/shm/d", "1,3,4", "direct", opts, python="py")
    assert cmd == ["py", "-m", "sglang.launch_server", "--model-path", str(no_tok), *base,
                   "--skip-tokenizer-init", "--disable-cuda-graph",
                   "--tp-size", "2", "--enforce-disable-flashinfer-allreduce-fusion",
                   "--dp-size", "2", "--enable-dp-attention", "--dump-hidden-states-dir", "/dev/shm/d",
                   "--dump-hidden-states-layers", "1,3,4", "--dump-hidden-states-dtype", "fp8"]
    assert opts.tag == "tp2-dpattn-eager-fp8" and gpu_server.ServerOptions().tag == "tp1"
    with pytest.raises(ValueError, match="launcher must be 'direct' or 'entrypoint', not 'docker'"):
        gpu_server.server_command(str(no_tok), "/d", None, "docker")
    with pytest.raises(ValueError, match="tp must be >= 1, not 0"):
        gpu_server.server_command(str(no_tok), "/d", None, "direct", gpu_server.ServerOptions(tp=0))


def test_server_command_flags_are_the_patched_sglang_flags():
    """Every dump flag the launcher passes (the suite's servers and, through
    ``dump_flags``, the benchmark's) is one the series adds to SGLang's server args
    (patch 0001), spelled as there."""
    diff = next((REPO / "patches" / "v0.5.17").glob("0001-*.diff")).read_text()
    cmd = gpu_server.server_command("/m", "/d", "1,3,4", "direct")
    cmd += gpu_server.dump_flags("/d", "1,3,4", max_host_mb=64, dtype="fp8")
    flags = {a for a in cmd if a.startswith("--dump-hidden-states")}
    assert len(flags) == 4, flags
    for flag in flags:
        assert flag.removeprefix("--").replace("-", "_") in diff, flag


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shim(tmp_path, body):
    """A ``sglang.launch_server`` module that shadows SGLang's on PYTHONPATH."""
    pkg = tmp_path / "shim" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(body)
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path / "shim"), str(REPO)])}


@pytest.mark.parametrize("launcher", ["direct", "entrypoint"])
def test_start_server_serves_then_stop_ends_the_process_group(tmp_path, launcher):
    """The launcher against tests/fake_sglang_server.py behind ``python -m
    sglang.launch_server`` (directly, or exec'd by the container entrypoint): /health polled
    until up, /generate answered with a file, a client that closes early, then stop()
    ends it (idempotent)."""
    env = _shim(tmp_path, f"import runpy, sys\nsys.argv[0] = 'fake'\n"
                          f"runpy.run_path({str(REPO / 'tests' / 'fake_sglang_server.py')!r}, run_name='__main__')\n")
    model = tmp_path / "model"
    model.mkdir()
    port = _free_port()
    srv = gpu_server.start_server(str(model), str(tmp_path / "dump"), "1,3,4", launcher,
                                  str(tmp_path / "logs" / "s.log"), port=port, env=env, timeout_s=60)
    try:
        assert srv.alive() and srv.startup_s > 0 and "--skip-tokenizer-init" in srv.command
        if launcher == "entrypoint":  # what the entrypoint exec'd, as it printed it
            assert srv.printed is not None and "-m sglang.launch_server" in srv.printed
            assert f"--port {port}" in srv.printed and "--dump-hidden-states-layers 1,3,4" in srv.printed
        else:
            assert srv.printed is None
        res = srv.generate([5, 6, 7], rid="r1")
        path = res["meta_info"]["hidden_states_path"]
        assert os.path.dirname(path) == str(tmp_path / "dump") and os.path.exists(path)
        srv.send_and_close({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}, 0.0)
        assert srv.post({"input_ids": [8, 9]}).status_code == 200
    finally:
        srv.stop()
    assert srv.proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(srv.proc.pid, 0)  # nothing of its process group is left
    srv.stop()  # again: nothing left to stop, no error


def test_start_server_failure_raises_with_the_log_tail(tmp_path):
    env = _shim(tmp_path, "import sys\nprint('CUDA error: out of memory')\nsys.exit(3)\n")
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(RuntimeError, match=r"(?s)server exited with 3 during start-up.*CUDA error: out of memory"):
        gpu_server.start_server(str(model), str(tmp_path / "dump"), None, "direct", str(tmp_path / "s.log"),
                                port=_free_port(), env=env, timeout_s=60)


def test_log_tail_leaves_out_our_health_polls(tmp_path):
    """A start-up that times out while /health answers 503 shows what the server printed
    last, not 40 lines of the access log of our own polls."""
    import types

    log = tmp_path / "s.log"
    log.write_text("[t] Uvicorn running on http://127.0.0.1:1\n"
                   + '[t] INFO:     127.0.0.1:5 - "GET /health HTTP/1.1" 503 Service Unavailable\n' * 60
                   + "[t] Disable CP decode attention TP\n"
                   + '[t] INFO:     127.0.0.1:5 - "GET /health HTTP/1.1" 503 Service Unavailable\n' * 3)
    tail = gpu_server.Server.log_tail(types.SimpleNamespace(log_path=str(log)))
    assert tail == "[t] Uvicorn running on http://127.0.0.1:1\n[t] Disable CP decode attention TP\n"


def test_wait_until_times_out_and_stop_all_ends_every_group(tmp_path):
    """The lifecycle the benchmark uses for its two to four servers: launch returns at
    once; a server that never gets ready is a StartupTimeout with its log's tail; one that
    exits is a ServerExited; stop_all SIGTERMs every group at once and SIGKILLs one that
    ignores SIGTERM after the grace period; again, it does nothing."""
    import signal
    import time

    stubborn = ("import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "print('loading weights', flush=True)\ntime.sleep(600)\n")
    servers = [gpu_server.launch([sys.executable, "-c", body, "--port", str(_free_port())],
                                 str(tmp_path / f"s{i}.log"))
               for i, body in enumerate([stubborn, "import time; time.sleep(600)"])]
    try:
        servers[0].wait_until(lambda: "loading weights" in servers[0].log_text(), timeout=60)
        with pytest.raises(gpu_server.StartupTimeout, match=r"(?s)did not come up in 1 s.*loading weights"):
            servers[0].wait_until(lambda: False, timeout=1)
        assert servers[0].alive() and servers[1].alive()
        t0 = time.monotonic()
        gpu_server.stop_all(servers, grace=2)
        assert time.monotonic() - t0 < 15
        assert [s.proc.returncode for s in servers] == [-signal.SIGKILL, -signal.SIGTERM]
        for s in servers:
            with pytest.raises(ProcessLookupError):
                os.killpg(s.proc.pid, 0)
        gpu_server.stop_all(servers)  # nothing left: no error
    finally:
        for s in servers:
            if s.alive():
                s.proc.kill()
    gone = gpu_server.launch([sys.executable, "-c", "raise SystemExit(4)", "--port", "1"],
                             str(tmp_path / "gone.log"))
    with pytest.raises(gpu_server.ServerExited, match="server exited with 4 during start-up"):
        gone.wait_healthy(timeout=60)


# ---- leftovers, files, logs ------------------------------------------------------------
def test_leftovers_and_unloadable_files(tmp_path):
    good = _write(tmp_path, "good", torch.zeros(3, 2, 4, dtype=torch.bfloat16), [3, 4, 5])
    for name in ("x.safetensors.tmp", "y.safetensors.lock", ".tmp-z", "index.jsonl"):
        (tmp_path / name).write_text("")
    data = Path(good).read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    assert checks.leftovers(str(tmp_path)) == [".tmp-z", "x.safetensors.tmp", "y.safetensors.lock"]
    problems = checks.unloadable_files(str(tmp_path))
    assert len(problems) == 1 and problems[0].startswith("cut.safetensors: ")
    for name in ("x.safetensors.tmp", "y.safetensors.lock", ".tmp-z"):
        (tmp_path / name).unlink()
    assert checks.wait_no_leftovers(str(tmp_path), timeout=1) == []


def test_writer_ranks_from_the_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("[TP0] hidden-state dump: layers (1, 3, 4) -> /dev/shm/d, writer rank: True\n"
                   "[TP1] hidden-state dump: layers (1, 3, 4) -> /dev/shm/d, writer rank: False\n"
                   "[TP1] something else, writer rank: True\n")
    assert checks.writer_ranks(str(log)) == (1, 1)


def test_problems_fail_with_every_line():
    p = checks.Problems()
    p.check("nothing")
    p.extend([f"request {i}: no file" for i in range(12)])
    with pytest.raises(AssertionError, match=r"(?s)llama case: 12 problem\(s\):\n  request 0: no file.*and 2 more"):
        p.check("llama case")


# ---- rehearsal: the fixtures wired end to end against the fake server ------------------
REHEARSAL_PLUGIN = '''
import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Pretend this host can run the GPU suite: tests/gpu/conftest.py's check says yes,
    the reference runs on the CPU."""
    for plugin in config.pluginmanager.get_plugins():
        if str(getattr(plugin, "__file__", "")).endswith("tests/gpu/conftest.py"):
            plugin.gpu_unavailable_reason = lambda: None
    from testing import reference

    class CPUReference(reference.Reference):
        def __init__(self, path, device="cuda"):
            super().__init__(path, device="cpu")

    reference.Reference = CPUReference
'''


def test_rehearsal_fault_tests_run_against_a_stand_in_server(tmp_path):
    """Two fault tests through the real fixtures (model build, entrypoint launcher, module
    server, teardown, results JSON) with ``sglang.launch_server`` shadowed by
    tests/fake_sglang_server.py and the CUDA check answered yes: they pass, and the one
    server of the module started once and was stopped."""
    (tmp_path / "rehearsal.py").write_text(REHEARSAL_PLUGIN)
    _shim(tmp_path, f"import runpy\nrunpy.run_path({str(REPO / 'tests' / 'fake_sglang_server.py')!r}, "
                    "run_name='__main__')\n")
    out = tmp_path / "out"
    proc = run_pytest("tests/gpu", "-p", "rehearsal", "-q", "--models", "llama", "-k",
                      "test_client_disconnect or test_same_rid_at_once", "--results-json", str(out / "r.json"),
                      "--server-log-dir", str(out), "--model-dir", str(tmp_path / "models"),
                      extra_path=[tmp_path, tmp_path / "shim"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    doc = json.loads((out / "r.json").read_text())
    assert doc["counts"] == {"passed": 2}
    assert [s["name"] for s in doc["servers"]] == ["llama-faults-tp1"]
    assert "-m sglang.launch_server" in doc["servers"][0]["entrypoint_command"]
    props = {t["id"].split("::")[-1]: t["properties"] for t in doc["tests"]}
    assert props["test_same_rid_at_once[llama]"]["accepted"] >= 1
    assert (out / "server-llama-faults-tp1.log").exists()
    with pytest.raises(ConnectionRefusedError):  # the module's server was stopped at teardown
        socket.create_connection(("127.0.0.1", gpu_server.PORT), timeout=5).close()
    shutil.rmtree("/dev/shm/hs-llama-faults-tp1", ignore_errors=True)


def _gpu_conftest(monkeypatch):
    """tests/gpu/conftest.py as a module; its sibling ``record`` (the suite's results
    plugin) imports from tests/gpu, as pytest puts it on sys.path for the suite."""
    import importlib.util

    monkeypatch.syspath_prepend(str(GPU))
    spec = importlib.util.spec_from_file_location("gpu_conftest", GPU / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("patched", [True, False])
def test_patched_sglang_is_recognized_from_its_server_args(tmp_path, monkeypatch, patched):
    """The skip rule reads SGLang's srt/server_args.py: the series adds
    ``dump_hidden_states_dir`` there (patch 0001); an unpatched SGLang is named with the fix."""
    import importlib

    srt = tmp_path / "sglang" / "srt"
    srt.mkdir(parents=True)
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (srt / "server_args.py").write_text("class ServerArgs:\n"
                                        + ("    dump_hidden_states_dir = None\n" if patched else "    port = 30000\n"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    importlib.invalidate_caches()
    reason = _gpu_conftest(monkeypatch).patched_sglang_reason()
    if patched:
        assert reason is None
    else:
        assert reason == (f"SGLang at {tmp_path / 'sglang'} is not patched "
                          "(python -m sglang_ext patches apply --site-packages)")
