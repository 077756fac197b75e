"""The benchmark's peer, vLLM (bench/peer.py, bench/peerfiles.py), on a CPU: its servers'
command lines and environment, the request it sends and what it reads back, the wait on
vLLM's lock, the side-by-side table, the file comparison on synthetic files in vLLM's
layout (against HF transformers' forward of a tiny Llama), and the whole run rehearsed
against tests/fake_sglang_server.py and tests/fake_vllm_server.py.

Expected numbers are worked out by hand in the comments.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench import cli, markdown, peer, peerfiles, plan, report, servers, targets

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"

LLAMA_8B_IDS = [2, 16, 29, 32]


def _args(argv):
    return cli.build_parser().parse_args(argv)


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_vllm_servers_command_lines_and_environment(monkeypatch):
    """V and W: ``python -m vllm.entrypoints.openai.api_server`` on the same model files
    with the flags that match our servers; W adds extract_hidden_states with our layer
    ids and the example connector writing into its own dump directory; the interpreter
    and PYTHONPATH come from KIMI_BENCH_VLLM_PYTHON(PATH)."""
    monkeypatch.delenv(peer.ENV_PYTHON, raising=False)
    monkeypatch.delenv(peer.ENV_PYTHONPATH, raising=False)
    monkeypatch.delenv(peer.ENV_LD_LIBRARY_PATH, raising=False)
    monkeypatch.delenv("KIMI_SGLANG_WRITER_THREADS", raising=False)
    args = _args(["--modes", "nodump,dump,vllm_nodump,vllm_dump", "--mem-fraction-static", "0.2",
                  "--dump-root", "/r", "--workdir", "/w", "--ports", "1,2,3,5,6"])
    v, w = (servers.server_cmd(args, "llama-8b", k) for k in "VW")
    assert v[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(v, "--model") == "/w/llama-8b" and _flag(v, "--port") == "5" and _flag(w, "--port") == "6"
    assert _flag(v, "--served-model-name") == peer.SERVED_NAME == "kimi-bench"
    assert _flag(v, "--dtype") == "bfloat16" and _flag(v, "--gpu-memory-utilization") == "0.2"
    assert _flag(v, "--max-num-batched-tokens") == "8192"  # SGLang's chunk on an H200
    assert _flag(v, "--attention-backend") == "TRITON_ATTN"  # ours: --attention-backend triton
    for flag in ("--no-enable-prefix-caching", "--skip-tokenizer-init", "--enforce-eager"):
        assert flag in v and flag in w
    assert _flag(v, "--optimization-level") == "0"
    assert "--speculative-config" not in v and "--kv-transfer-config" not in v
    # W = V's flags plus the two configs
    tail = w[len(v):]
    assert w[:len(v)] == [x if x != "5" else "6" for x in v]
    assert tail[0] == "--speculative-config" and tail[2] == "--kv-transfer-config" and len(tail) == 4
    assert json.loads(tail[1]) == {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids":
                                                                        LLAMA_8B_IDS}}}
    assert json.loads(tail[3]) == {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                   "kv_connector_extra_config": {"shared_storage_path": "/r/kimi-bench-llama-8b-vllm",
                                                                 "num_writer_threads": 8}}
    assert servers.dump_dir(args, "llama-8b", "W") == "/r/kimi-bench-llama-8b-vllm"
    assert [servers.dumps(k) for k in "VW"] == [False, True]
    assert [servers.api_of(k) for k in "ABVW"] == ["sglang", "sglang", "vllm", "vllm"]
    # vLLM's own memory share
    o = servers.server_cmd(_args(["--vllm-gpu-memory-utilization", "0.15"]), "llama-mid", "V")
    assert _flag(o, "--gpu-memory-utilization") == "0.15"
    # environment: vLLM's (no writer variables of ours), its site when the staging says so
    env = servers.server_env("W", "/t.jsonl")
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert "PYTHONPATH" not in env and "LD_LIBRARY_PATH" not in env
    assert not any(k.startswith("KIMI_SGLANG") for k in env)
    monkeypatch.setenv(peer.ENV_PYTHONPATH, "/tmp/vsite")
    monkeypatch.setenv(peer.ENV_LD_LIBRARY_PATH, "/tmp/stack-nccl/nvidia/nccl/lib")
    monkeypatch.setenv(peer.ENV_PYTHON, "/opt/v/bin/python")
    env = servers.server_env("V", None)
    assert env["PYTHONPATH"] == "/tmp/vsite" and env["LD_LIBRARY_PATH"] == "/tmp/stack-nccl/nvidia/nccl/lib"
    assert servers.server_cmd(args, "llama-8b", "V")[0] == "/opt/v/bin/python"
    assert servers.server_env("B", None) == {"KIMI_SGLANG_STATS_INTERVAL_S": "5"}  # ours unchanged


def test_memory_share_and_ports_are_checked():
    """Four servers at 0.3 would ask for 1.2 of the GPU: a usage error that says what
    fits; at 0.2 (or vLLM's share lowered) they fit; vLLM's servers need five ports."""
    modes = ["nodump", "dump", "vllm_nodump", "vllm_dump"]
    msg = servers.memory_problem(_args([]), modes)
    assert msg.startswith("servers A, B, V, W together would take 1.20 of the GPU's memory (A 0.3, B 0.3, V 0.3, W 0.3")
    assert servers.memory_problem(_args(["--mem-fraction-static", "0.2"]), modes) is None
    assert servers.memory_problem(_args(["--vllm-gpu-memory-utilization", "0.15"]), modes) is None  # 0.9
    assert servers.memory_problem(_args([]), ["nodump", "dump", "dump_fp8"]) is None  # ours alone: not checked
    assert servers.ports_problem(_args(["--ports", "1,2,3"]), modes) == (
        "mode vllm_nodump runs on a fourth server (V): --ports needs four ports")
    with pytest.raises(SystemExit) as e:
        cli.main(["--dry-run", "--modes", ",".join(modes)])
    assert e.value.code == 2


def test_bad_input_to_the_peer_tools_is_one_sentence(tmp_path, capsys):
    """A pairs file that is missing, not JSON or not collect()'s: argparse errors (exit 2),
    no traceback."""
    (tmp_path / "bad.json").write_text("[1")
    (tmp_path / "other.json").write_text("{}")
    (tmp_path / "noids.json").write_text('{"layer_ids": [], "hidden_size": 8, "pairs": []}')
    for path, says in ((tmp_path / "none.json", "No such file or directory"),
                       (tmp_path / "bad.json", "Expecting"),
                       (tmp_path / "other.json", "it is not a pairs.json of collect()"),
                       (tmp_path / "noids.json", "its layer_ids list is empty")):
        with pytest.raises(SystemExit) as e:
            peerfiles.main([str(path), str(tmp_path / "out.json"), "--device", "cpu"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"error: {path}: " in err and says in err, err
    assert not (tmp_path / "out.json").exists()


def test_plan_runs_vllm_cells_after_ours_and_not_for_deepseek(capsys):
    """In every shape and round vLLM's cells follow ours; DeepseekV3 (MLA) gets none, and
    the plan says why; its servers stay ours."""
    args = _args(["--quick", "--models", "llama-mid,deepseek-tiny", "--modes", "nodump,dump,vllm_nodump,vllm_dump",
                  "--prompt-lens", "2048", "--concurrency", "8", "--repeat", "2", "--mem-fraction-static", "0.2"])
    planned = plan.make_plan(args)
    llama, ds = planned["models"]["llama-mid"], planned["models"]["deepseek-tiny"]
    assert [(c["mode"], c["rep"]) for c in llama["cells"]] == [
        (m, r) for r in (0, 1) for m in ("nodump", "dump", "vllm_nodump", "vllm_dump")]
    assert sorted(llama["servers"]) == ["A", "B", "V", "W"] and sorted(ds["servers"]) == ["A", "B"]
    assert {c["mode"] for c in ds["cells"]} == {"nodump", "dump"}
    assert "MLA" in ds["peer_unsupported"] and "peer_unsupported" not in llama
    assert [c for c in llama["cells"] if c["mode"] == "vllm_dump"][0]["dump_bytes"] > 0
    plan.print_plan(planned)
    out = capsys.readouterr().out
    assert "server W: " in out and "no vLLM cells: vLLM 0.33's extract_hidden_states has no MLA support" in out
    # the JSON configs are quoted for a shell
    line = next(x for x in out.splitlines() if x.startswith("  server W: "))
    assert json.loads(shlex.split(line)[shlex.split(line).index("--speculative-config") + 1])["method"] == \
        "extract_hidden_states"


def test_request_body_response_path_and_version():
    """What the peer's modes send (speculators' generator's request, without the echo in
    timed cells) and read back."""
    assert peer.completion_body([5, 6, 7]) == {"model": "kimi-bench", "prompt": [5, 6, 7], "max_tokens": 1,
                                               "temperature": 0}
    assert peer.completion_body([5], token_ids=True)["return_token_ids"] is True
    resp = {"choices": [{"text": ""}], "kv_transfer_params": {"hidden_states_path": "/d/cmpl-1-0.safetensors"}}
    assert peer.file_path(resp) == "/d/cmpl-1-0.safetensors"
    assert peer.file_path({"choices": [], "kv_transfer_params": None}) is None
    assert peer.version_of("INFO 12-01 [launcher.py:367] vLLM server version 0.33.0, serving model /m") == "0.33.0"
    assert peer.version_of("no such line") is None
    assert peer.unsupported("deepseek-tiny") and peer.unsupported("llama-8b") is None
    # its file stays in layer-id order whatever order the ids come in, as vLLM stores them
    assert peer.speculative_config([29, 2, 16])["draft_model_config"]["hf_config"][
        "eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]


def test_wait_file_blocks_until_the_writer_releases_the_lock(tmp_path):
    """vLLM's writer holds an exclusive flock on <file>.lock until the file is written
    and leaves the lock file behind: the wait ends at the release, not before; without a
    lock file it returns at once."""
    path = str(tmp_path / "cmpl-1.safetensors")
    fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    threading.Timer(0.3, os.close, (fd,)).start()
    t0 = time.monotonic()
    peer.wait_file(path)
    assert time.monotonic() - t0 >= 0.25
    t0 = time.monotonic()
    peer.wait_file(path)  # released, lock file still there
    peer.wait_file(str(tmp_path / "none.safetensors"))
    assert time.monotonic() - t0 < 0.1


def _cell(mode, plen, conc, tps, rep, reqs=4, **kw):
    tokens = plen * reqs
    return {"mode": mode, "prompt_len": plen, "concurrency": conc, "requests": reqs, "prompt_tokens": tokens,
            "wall_s": tokens / tps, "prefill_tps": tps, "p50_s": 0.1, "p99_s": 0.2, "rep": rep, **kw}


def test_peer_table_pairs_each_engine_with_itself_per_round():
    """Per shape and round: ours (b)/(a), vLLM's (b)/(a) against vLLM's own (a), and
    vLLM's tokens/s over ours; the headline's per-cell ratio of a vllm_dump cell divides by
    vllm_nodump, and the targets stay ours."""
    b = 32768  # bytes per prompt token of ours; vLLM's 32000 (hand-made)
    cells = [
        _cell("nodump", 2048, 8, 100_000.0, 0), _cell("dump", 2048, 8, 90_000.0, 0, file_bytes=4 * 2048 * b),
        _cell("vllm_nodump", 2048, 8, 80_000.0, 0), _cell("vllm_dump", 2048, 8, 40_000.0, 0,
                                                          file_bytes=4 * 2048 * 32000),
        _cell("nodump", 2048, 8, 100_000.0, 1), _cell("dump", 2048, 8, 95_000.0, 1, file_bytes=4 * 2048 * b),
        _cell("vllm_nodump", 2048, 8, 50_000.0, 1), _cell("vllm_dump", 2048, 8, 45_000.0, 1,
                                                          file_bytes=4 * 2048 * 32000),
    ]
    res = {"models": {"llama-8b": {"hidden_size": 4096, "layer_ids": LLAMA_8B_IDS, "cells": cells}}}
    h = report.headline(res)["llama-8b"]
    rows = {x["rep"]: x for x in h["peer"]}
    # rep 0: ours 90/100, vLLM 40/80; (a) 80/100, (b) 40/90; rep 1: 95/100, 45/50, 50/100, 45/95
    assert rows[0]["ours_dump_vs_nodump"] == pytest.approx(0.9) and rows[0]["vllm_dump_vs_nodump"] == pytest.approx(0.5)
    assert rows[0]["nodump_vllm_vs_ours"] == pytest.approx(0.8) and rows[0]["dump_vllm_vs_ours"] == pytest.approx(4 / 9)
    assert rows[1]["vllm_dump_vs_nodump"] == pytest.approx(0.9) and rows[1]["dump_vllm_vs_ours"] == pytest.approx(45 / 95)
    assert rows[0]["ours_bytes_per_token"] == b and rows[0]["vllm_bytes_per_token"] == 32000
    assert h["vllm_dump_vs_nodump_min"] == pytest.approx(0.5)
    assert h["vllm_dump_vs_nodump_geomean"] == pytest.approx((0.5 * 0.9) ** 0.5)
    assert h["vllm_dump_vs_ours_dump_min"] == pytest.approx(4 / 9)
    per_cell = {(c["mode"], c["rep"]): c["dump_vs_nodump"] for c in h["cells"]}
    assert per_cell[("vllm_dump", 1)] == pytest.approx(0.9) and per_cell[("dump", 1)] == pytest.approx(0.95)
    assert h["dump_vs_nodump_min"] == pytest.approx(0.9)  # ours only
    tg = targets.targets(res, report.headline(res))
    worst = next(t for t in tg if t["target"].startswith("(b) >= 0.95"))
    assert worst["value"] == pytest.approx(0.9)  # bound = (a) without ceilings: ours alone
    res["models"]["llama-8b"]["peer_files"] = {
        "prompts": 3, "prompt_lens": [512, 2048, 777], "layer_ids": LLAMA_8B_IDS, "pass": False,
        "tolerance": {"block": 0.02, "token": 0.05}, "reference": "none",
        "ours_vs_vllm": {"block": 0.031, "token": 0.2, "token_where": "prompt 1 (2048 tokens), token row 7, "
                                                                    "layer slot 3"},
        "problems": ["ours_vs_vllm: block relative error 3.100e-02 > 0.02 (prompt 1 (2048 tokens))"]}
    res["models"]["deepseek-tiny"] = {"hidden_size": 1024, "layer_ids": [1, 2, 3, 4], "cells": [],
                                      "peer_unsupported": peer.MLA_UNSUPPORTED}
    md = markdown.render_markdown(res)
    assert "## Side by side with vLLM" in md
    assert "| 2048 | 8 #0 | 0.900 | 0.500 | 0.800 | 0.444 | 32768 | 32000 |" in md
    assert "- dump/no-dump, min / geometric mean: ours 0.900 / 0.925, vLLM 0.500 / 0.671" in md
    assert "- files compared (3 prompts, lengths [512, 2048, 777], layer ids [2, 16, 29, 32]): FAIL" in md
    assert "  - ours vs vLLM: block 3.10e-02, token row 2.00e-01 (prompt 1 (2048 tokens), token row 7" in md
    assert "### deepseek-tiny" in md and "- ours alone: vLLM 0.33's extract_hidden_states has no MLA support" in md
    assert "| 2048 | 8 | vllm_dump #1 | 4 | 45000 |" in md
    summary = markdown.summary_table(res)
    assert "vLLM: dump/nodump min 0.500, its dump over ours min 0.444" in summary
    assert "llama-8b       files ours vs vLLM: FAIL" in summary and "deepseek-tiny  ours alone" in summary


def _save(path, hs, ids, metadata=None):
    import torch
    from safetensors.torch import save_file

    save_file({"hidden_states": hs.contiguous(), "token_ids": torch.tensor(ids, dtype=torch.int64)}, str(path),
              metadata=metadata)


def test_peer_files_compared_with_each_other_and_the_hf_reference(tmp_path):
    """Synthetic files: ours (with our layer-id metadata) = HF float32's block in bf16;
    vLLM's layout (no metadata) = the same block with a 0.5% perturbation in bf16 (within
    tolerance), and, in a second run, one prompt's block x1.1 (a 10% error) and wrong token
    ids. The reference is testing/reference.py on a tiny Llama built on the CPU."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from testing import reference, tiny_models

    model = tmp_path / "llama"
    tiny_models.build_llama(str(model))
    ref = reference.Reference(str(model), device="cpu")
    ids_list = [[5, 17, 300, 1023, 9, 42, 7], list(range(3, 40))]
    layer_ids = [2, 4, 5, 8]
    g = torch.Generator().manual_seed(0)
    pairs = []
    for i, ids in enumerate(ids_list):
        block = ref(ids, layer_ids)  # [T, 4, 256] float32
        noisy = block * (1 + 0.005 * torch.randn(block.shape, generator=g))
        _save(tmp_path / f"ours-{i}.safetensors", block.bfloat16(), ids, {"layer_ids": json.dumps(layer_ids)})
        _save(tmp_path / f"vllm-{i}.safetensors", noisy.bfloat16(), ids)
        pairs.append({"ids": ids, "ours": str(tmp_path / f"ours-{i}.safetensors"),
                      "vllm": str(tmp_path / f"vllm-{i}.safetensors"), "echoed_ids_equal": True})
    ref.close()
    doc = {"layer_ids": layer_ids, "hidden_size": 256, "pairs": pairs}
    (tmp_path / "pairs.json").write_text(json.dumps(doc))
    env = os.environ | {"PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "bench.peerfiles", str(tmp_path / "pairs.json"),
                           str(tmp_path / "out.json"), "--model-path", str(model), "--reference", "hf"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["pass"] is True and out["problems"] == [] and "PASS" in proc.stdout
    assert out["keys"] == {"ours": ["hidden_states", "token_ids"], "vllm": ["hidden_states", "token_ids"]}
    assert out["prompt_lens"] == [7, 37] and out["reference"] == "HF transformers float32 on cpu"
    # bf16 rounding alone: < 2^-8 relative; the 0.5% noise: ~5e-3 per row
    assert out["ours_vs_ref"]["block"] < 4e-3 and 3e-3 < out["vllm_vs_ref"]["block"] < 1e-2
    assert 3e-3 < out["ours_vs_vllm"]["block"] < 1e-2 and out["ours_vs_vllm"]["files"] == 2
    assert len(out["ours_vs_vllm"]["slots"]) == 4 and all(3e-3 < e < 1e-2 for e in out["ours_vs_vllm"]["slots"])
    # HF's own bf16 forward of the tiny model: rounding only, so the fixed tolerances govern
    assert 0 < out["hf_bf16_vs_ref"]["block"] < 1e-2 and out["hf_bf16_vs_ref"]["files"] == 2
    assert out["tolerance"]["slots"] == [0.02] * 4 and out["tolerance"]["token_scaled"] == 0.05
    # the second prompt's vLLM block 10% off and its token ids wrong; a file without token ids
    hs = json.loads(json.dumps(pairs[1]))
    import safetensors.torch as st

    t = st.load_file(pairs[1]["vllm"])
    _save(tmp_path / "vllm-1.safetensors", (t["hidden_states"].float() * 1.1).bfloat16(), [999] + ids_list[1][1:])
    st.save_file({"hidden_states": t["hidden_states"]}, str(tmp_path / "vllm-0.safetensors"))
    doc["pairs"][1] = dict(hs, echoed_ids_equal=False)
    got = peerfiles.compare(doc)  # no reference
    assert got["pass"] is False and got["reference"] == "none" and "ours_vs_ref" not in got
    assert got["ours_vs_vllm"]["block"] == pytest.approx(0.1, rel=0.05) and got["ours_vs_vllm"]["files"] == 1
    assert got["ours_vs_vllm"]["slots"] == pytest.approx([0.1] * 4, rel=0.05)  # every slot x1.1
    assert "prompt 0 (7 tokens), vllm: no ['token_ids'] (keys ['hidden_states'])" in got["problems"]
    assert "prompt 1 (37 tokens), vllm: token_ids (37,) differ from the prompt's from position 0" in got["problems"]
    assert "prompt 1 (37 tokens): vLLM's choices[0].prompt_token_ids differ from the prompt" in got["problems"]
    assert any(p.startswith("ours_vs_vllm: block relative error 1.0") for p in got["problems"])
    # with the reference: vLLM's second prompt 10% off float32 at every layer id
    got = peerfiles.compare(doc, str(model), "hf", "cpu")
    assert got["pass"] is False and got["hf_bf16_vs_ref"]["files"] == 2 and got["vllm_vs_ref"]["files"] == 1
    assert [p for p in got["problems"] if p.startswith("vllm_vs_ref: layer id")] == [
        f"vllm_vs_ref: layer id {k}: relative error {e:.3e} > 2.000e-02 (max(0.02, 1.5 x HF bf16's))"
        for k, e in zip(layer_ids, got["vllm_vs_ref"]["slots"])]
    assert all(e == pytest.approx(0.1, rel=0.1) for e in got["vllm_vs_ref"]["slots"])
    assert not any(p.startswith("ours_vs_ref") for p in got["problems"])
    doc["hidden_size"] = 128
    assert "prompt 0 (7 tokens), ours: hidden_states (7, 4, 256) != (7, 4, 128) (tokens, layer slots, hidden)" \
        in peerfiles.compare(doc)["problems"]


def rehearse_peer(tmp_path, *extra):
    """``python -m bench --quick`` on llama-mid and deepseek-tiny against both fake servers
    (test_bench.rehearse plus the fake vLLM); returns (process, out dir, dump root,
    results)."""
    from test_bench import rehearse

    work = tmp_path / "work"
    (work / "llama-mid").mkdir(parents=True)  # what the fakes serve: 64 wide (the files' check reads it)
    (work / "llama-mid" / "config.json").write_text(json.dumps({"hidden_size": 64}))
    proc, out, shm, res_path = rehearse(
        tmp_path, "--vllm-server-module", "fake_vllm_server", "--mem-fraction-static", "0.2",
        "--peer-reference", "none", *extra, models="llama-mid,deepseek-tiny", timeout=300,
        drop_env=(peer.ENV_PYTHONPATH, peer.ENV_LD_LIBRARY_PATH))
    return proc, out, shm, json.loads(res_path.read_text())


def test_rehearsal_side_by_side_with_a_fake_vllm(tmp_path):
    """Both engines' cells in the same run (vLLM's after ours in each shape), vLLM's files
    found through kv_transfer_params and waited for (its fake writes each 30 ms after
    answering: every vllm_dump latency includes that), the peer table, the files of both
    compared for the same prompts, DeepseekV3 ours alone, vLLM's memory sampled, nothing
    left in the dump root."""
    proc, out, shm, res = rehearse_peer(tmp_path, "--prompt-lens", "16,2048", "--concurrency", "1,8",
                                        "--cell-tokens", "4096", "--modes", "nodump,dump,vllm_nodump,vllm_dump")
    llama, ds = res["models"]["llama-mid"], res["models"]["deepseek-tiny"]
    assert not any(c.get("error") for c in llama["cells"] + ds["cells"]), llama["cells"]
    shapes = [(16, 1), (16, 8), (2048, 1), (2048, 8)]
    assert sorted((c["prompt_len"], c["concurrency"], c["mode"]) for c in llama["cells"]) == sorted(
        (p, c, m) for p, c in shapes for m in ("nodump", "dump", "vllm_nodump", "vllm_dump"))
    assert {c["mode"] for c in ds["cells"]} == {"nodump", "dump"} and "MLA" in ds["peer_unsupported"]
    w = next(c for c in llama["cells"] if (c["mode"], c["prompt_len"], c["concurrency"]) == ("vllm_dump", 2048, 8))
    d = next(c for c in llama["cells"] if (c["mode"], c["prompt_len"], c["concurrency"]) == ("dump", 2048, 8))
    assert w["files"] == w["requests"] == 8 and w["p50_s"] >= 0.03
    # vLLM's layout: 2048 x 4 x 64 bf16 + 2048 int64 + a header without metadata
    assert 8 * 2048 * (4 * 64 * 2 + 8) < w["file_bytes"] < d["file_bytes"]
    assert w["file_check"] == {"hidden_states": {"shape": [2048, 4, 64], "dtype": "BF16"}, "layer_ids": None,
                               "token_ids": {"shape": [2048], "dtype": "I64"}, "keys": ["hidden_states", "token_ids"]}
    assert llama["file_check"]["layer_ids"] == "[2, 4, 5, 8]"  # ours, from our cells
    h = res["headline"]["llama-mid"]
    assert len(h["peer"]) == 4 and all(x["dump_vllm_vs_ours"] for x in h["peer"])
    pf = llama["peer_files"]
    assert pf["pass"] is True and pf["prompt_lens"] == [16, 2048, peerfiles.ODD_LEN], pf
    assert pf["ours_vs_vllm"]["block"] == 0.0 and pf["ours_vs_vllm"]["files"] == 3  # the fakes' same values
    assert res["versions"]["vllm"] == "0.33.0+fake" and res["versions"]["sglang-ext"]  # installed or the tree's
    mem = llama["host_memory"]
    assert mem["rss_baseline_bytes_vllm_dump"] > 0 and "rss_delta_bytes_vllm_dump" in mem
    assert "--speculative-config" in llama["servers"]["W"] and res["config"]["peer_reference"] == "none"
    assert list(shm.iterdir()) == []  # dump directories (and vLLM's lock files) removed
    assert not (tmp_path / "work" / "peer-files" / "llama-mid").exists()
    md = next(out.glob("*-rehearsal.md")).read_text()
    assert "## Side by side with vLLM" in md and "- ours alone: vLLM 0.33" in md and ": PASS" in md
    assert (out / "server-llama-mid-W.log").exists() and not (out / "server-deepseek-tiny-W.log").exists()
    assert "files ours vs vLLM: PASS" in proc.stdout


def test_plot_draws_vllm_modes(tmp_path):
    pytest.importorskip("matplotlib")
    from bench import plot

    cells = [_cell(m, 2048, 8, tps, 0, file_bytes=4 * 2048 * 100 if "dump" in m else None)
             for m, tps in (("nodump", 1e5), ("dump", 9e4), ("vllm_nodump", 8e4), ("vllm_dump", 4e4))]
    res = {"gpu": "x", "date": "2026-12-01", "profile": "quick",
           "models": {"llama-8b": {"cells": cells, "layer_ids": LLAMA_8B_IDS}}}
    assert os.path.getsize(plot.plot(res, str(tmp_path / "p.png"))) > 1000


def test_cells_leave_the_file_comparison_its_time():
    """Once files are collected, a cell runs only if the comparison after the servers
    stop still fits before the deadline: 30 s, plus 30 + 2 s per layer for the float32
    reference (llama-8b: 32 layers -> 124 s in all)."""
    from bench.runner import Clock, ModelRun

    args = _args(["--quick", "--models", "llama-8b", "--modes", "nodump,dump,vllm_nodump,vllm_dump",
                  "--mem-fraction-static", "0.2"])
    planned = plan.make_plan(args)
    skipped = []
    run = ModelRun(args, planned, "llama-8b", Clock(3000), {"models": {}}, lambda: None, skipped)
    assert run.reserve_s() == 0
    run.peer_pairs = "/x/pairs.json"
    assert run.reserve_s() == 30 + 30 + 2 * 32
    cell = planned["models"]["llama-8b"]["cells"][0]
    run.clock = Clock(cell["est_s"] * 2 + 15 + 100)  # fits without the reserve, not with it
    run.run_cell(cell)
    assert len(skipped) == 1 and skipped[0].startswith("llama-8b nodump 2048x8 (deadline")
    args.peer_reference = "none"
    assert run.reserve_s() == 30


def test_file_comparison_keeps_ours_vs_vllm_when_the_reference_fails(monkeypatch):
    """The comparison runs without the reference first; the float32 reference then
    replaces it, and one that overruns or fails leaves the first with the reason; one the
    deadline leaves no time for is not started."""
    from bench.runner import Clock, ModelRun

    args = _args(["--quick", "--models", "llama-8b", "--modes", "nodump,dump,vllm_nodump,vllm_dump",
                  "--mem-fraction-static", "0.2"])
    run = ModelRun(args, plan.make_plan(args), "llama-8b", Clock(3000), {"models": {}, "phases": {}}, lambda: None, [])
    run.peer_pairs = "/x/pairs.json"
    calls = []

    def fake(reference):
        calls.append(reference)
        if reference == "hf":
            raise subprocess.TimeoutExpired(["peerfiles"], 20)
        return {"pass": False, "reference": "none", "problems": ["x"]}, "FAIL"

    monkeypatch.setattr(run, "_peerfiles", fake)
    run.compare_peer_files()
    assert calls == ["none", "hf"]
    assert run.m["peer_files"]["reference"] == "none" and "TimeoutExpired" in run.m["peer_files"]["reference_error"]
    assert "HF reference failed: TimeoutExpired" in "\n".join(markdown._peer_files(run.m["peer_files"]))
    calls.clear()
    run.clock = Clock(run.reference_s() - 1)
    run.compare_peer_files()
    assert calls == ["none"] and run.m["peer_files"]["reference_skipped"].startswith("deadline")
    calls.clear()
    monkeypatch.setattr(run, "_peerfiles", lambda ref: (calls.append(ref), ({"reference": ref, "pass": True}, "PASS"))[1])
    run.clock = Clock(3000)
    run.compare_peer_files()
    assert calls == ["none", "hf"] and run.m["peer_files"] == {"reference": "hf", "pass": True}


def test_deep_model_tolerances_scale_with_hf_bf16_error(tmp_path, monkeypatch):
    """With the reference, the tolerance of each layer id is max(the fixed one, 1.5 x HF's
    own bf16 error there): a stand-in reference whose bf16 pass is 5% off float32 (as a deep
    random model's is) admits a file 6% off and refuses one 10% off, slot by slot."""
    torch = pytest.importorskip("torch")
    import types

    from testing import reference as real

    g = torch.Generator().manual_seed(1)
    layer_ids, ids = [2, 16], [5, 6, 7, 8, 9]
    block = torch.randn(len(ids), 2, 64, generator=g)

    class FakeReference:
        def __init__(self, path, device):
            self.scale = 1.0

        def __call__(self, ids_, layer_ids_):
            return block * self.scale

        def to_dtype(self, dtype):
            self.scale = 1.05

        def close(self):
            pass

    fake = types.SimpleNamespace(Reference=FakeReference, rel_errors=real.rel_errors)
    monkeypatch.setattr(peerfiles, "refmod", fake)
    _save(tmp_path / "ours.safetensors", block * 1.06, ids, {"layer_ids": json.dumps(layer_ids)})
    _save(tmp_path / "vllm.safetensors", block * 1.10, ids)
    doc = {"layer_ids": layer_ids, "hidden_size": 64,
           "pairs": [{"ids": ids, "ours": str(tmp_path / "ours.safetensors"),
                      "vllm": str(tmp_path / "vllm.safetensors"), "echoed_ids_equal": True}]}
    got = peerfiles.compare(doc, "unused", "hf", "cpu")
    assert got["tolerance"]["slots"] == pytest.approx([0.075, 0.075], rel=1e-3)
    assert got["tolerance"]["token_scaled"] == pytest.approx(0.075, rel=1e-3)
    bad = got["problems"]
    assert [p.split(":")[0] for p in bad] == ["vllm_vs_ref"] * 3, bad  # two layer ids and the token rows
    assert got["pass"] is False and got["ours_vs_ref"]["slots"] == pytest.approx([0.06, 0.06], rel=0.05)
    assert "per layer id max(0.02, 1.5 x HF's own bf16 error there): 2: 7.5e-02, 16: 7.5e-02" in \
        "\n".join(markdown._peer_files(got))
    # a baseline that is not bf16 rounding (40% off float32) scales nothing and fails the check
    monkeypatch.setattr(FakeReference, "to_dtype", lambda self, dtype: setattr(self, "scale", 1.4))
    got = peerfiles.compare(doc, "unused", "hf", "cpu")
    assert got["tolerance"]["slots"] == [0.02, 0.02] and got["tolerance"]["token_scaled"] == 0.05
    assert got["pass"] is False and got["problems"][:2] == [
        "hf_bf16_vs_ref: layer id 2: HF's own bf16 forward is 4.000e-01 off float32 "
        "(> 0.15: not bf16 rounding; that layer id keeps the fixed tolerance)",
        "hf_bf16_vs_ref: layer id 16: HF's own bf16 forward is 4.000e-01 off float32 "
        "(> 0.15: not bf16 rounding; that layer id keeps the fixed tolerance)"]
    assert got["problems"][2].startswith("hf_bf16_vs_ref: per-token relative error 4.000e-01 > 0.3 (prompt 0 (5 ")
    assert got["problems"][2].endswith("): not bf16 rounding; token rows keep the fixed tolerance")
    assert [p.split(":")[0] for p in got["problems"][3:]] == ["ours_vs_vllm"] * 2 + ["ours_vs_ref"] * 3 + \
        ["vllm_vs_ref"] * 3
    # a NaN in HF's bf16 pass is a broken baseline too; a NaN in vLLM's file fails with or
    # without the reference; no pairs at all is a failure with a reason
    monkeypatch.setattr(FakeReference, "to_dtype", lambda self, dtype: setattr(self, "scale", float("nan")))
    got = peerfiles.compare(doc, "unused", "hf", "cpu")
    assert got["tolerance"]["slots"] == [0.02, 0.02] and got["pass"] is False
    assert got["problems"][0] == ("hf_bf16_vs_ref: layer id 2: HF's own bf16 forward is nan off float32 "
                                  "(> 0.15: not bf16 rounding; that layer id keeps the fixed tolerance)")
    nan_doc = json.loads(json.dumps(doc))
    _save(tmp_path / "vllm-nan.safetensors", block * float("nan"), ids)
    nan_doc["pairs"][0]["vllm"] = str(tmp_path / "vllm-nan.safetensors")
    got = peerfiles.compare(nan_doc)
    assert got["pass"] is False and got["problems"][0].startswith("ours_vs_vllm: block relative error nan > 0.02")
    monkeypatch.setattr(FakeReference, "to_dtype", lambda self, dtype: setattr(self, "scale", 1.05))
    got = peerfiles.compare(nan_doc, "unused", "hf", "cpu")
    assert got["pass"] is False and "vllm_vs_ref: layer id 2: relative error nan > 7.500e-02 " \
        "(max(0.02, 1.5 x HF bf16's))" in got["problems"]
    empty = peerfiles.compare(dict(doc, pairs=[]))
    assert empty["pass"] is False and empty["problems"] == ["no prompt pairs to compare"]
    # without the reference the fixed 2e-2 applies: the two files are 3.8% apart
    assert any(p.startswith("ours_vs_vllm: block relative error") for p in peerfiles.compare(doc)["problems"])


def test_a_model_without_cells_is_refused(capsys):
    """A model the modes leave without any cell (DeepseekV3 with vLLM's modes alone) is an
    error, not an empty run; so are servers that would not fit the GPU together."""
    modes = ["nodump", "dump", "vllm_nodump", "vllm_dump"]
    for argv, says in ((["--mem-fraction-static", "0.2", "--modes", ",".join(modes),
                         "--vllm-gpu-memory-utilization", "0.5"], "together would take 1.40"),
                       (["--models", "deepseek-tiny", "--modes", "vllm_dump"],
                        "gives model deepseek-tiny no cell (vLLM 0.33's extract_hidden_states has no MLA")):
        with pytest.raises(SystemExit) as e:
            cli.main(["--dry-run"] + argv)
        assert e.value.code == 2 and says in capsys.readouterr().err, argv
