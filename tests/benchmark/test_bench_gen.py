"""The benchmark's generate modes (issue 49; bench/gen.py): gen_nodump (g), gen_output (g out)
and gen_two_pass (g 2p). Their ratios and targets on hand-made cells (the expected values
worked out by hand in the comments), the plan and the servers' flags, the file check on files
written by the stand-in's writer (sglang_ext.tools.standin, the format's own steps), and a
whole run rehearsed against tests/fake_sglang_server.py, which generates without a model.
"""

from __future__ import annotations

import json
import math

import pytest

from bench import cli, gen, markdown, models, plan, report, servers, targets
from test_bench import _args, rehearse, sample

OUT = "(g out) output capture >= 0.95 x (g) no dump, output tok/s at conc 1, 8, 32, pooled, worst shape"
TWO = "(g 2p) two passes' wall per sample >= 1.2 x (g out) one pass's, pooled, worst shape"


def gcell(mode, plen, conc, reqs, wall, rep, gen_tokens=512, **kw):
    """A generate cell of ``reqs`` requests of ``gen_tokens`` tokens each, ``wall`` seconds."""
    c = {"mode": mode, "prompt_len": plen, "concurrency": conc, "requests": reqs, "rep": rep,
         "gen_tokens": gen_tokens, "prompt_tokens": reqs * plen, "output_tokens": reqs * gen_tokens,
         "wall_s": wall, "output_tps": reqs * gen_tokens / wall, "samples_per_s": reqs / wall,
         "p50_s": wall / reqs, "p99_s": wall / reqs}
    return c | kw


def _cells(walls):
    """``walls``: {(prompt, conc): [(g, g out, g 2p) seconds per round]}; requests = concurrency
    (4 at concurrency 1)."""
    out = []
    for (plen, conc), rounds in walls.items():
        for rep, trio in enumerate(rounds):
            for mode, wall in zip(("gen_nodump", "gen_output", "gen_two_pass"), trio):
                out.append(gcell(mode, plen, conc, max(conc, 4), wall, rep))
    return out


WALLS = {
    (512, 1): [(40, 41, 52), (44, 45, 56)],  # (g out)/(g) = 84/86 = 0.97674; 2p/1p = 108/86 = 1.25581
    (512, 8): [(10, 10.5, 13), (12, 12.5, 15)],  # 22/23 = 0.95652; 28/23 = 1.21739
    (512, 32): [(20, 21.5, 26), (20, 21.5, 26)],  # 40/43 = 0.93023 (the worst); 52/43 = 1.20930 (the worst)
    (512, 4): [(10, 20, 40), (10, 20, 40)],  # 0.5: not a target concurrency; 2p/1p = 2.0
}


def _rows(res):
    return {t["target"]: t for t in targets.targets(res, report.headline(res)) if t["target"] in (OUT, TWO)}


def test_gen_ratios_pool_the_rounds_both_modes_ran():
    """Per shape: (g out)/(g) as pooled output tokens over pooled seconds, and two passes'
    wall per sample over one pass's; a round of (g) alone (#2, the deadline cut the rest) is
    not pooled."""
    res = sample()
    cells = _cells(WALLS) + [gcell("gen_nodump", 512, 1, 4, 1000.0, 2)]
    res["models"]["m"]["cells"] = cells
    rows = {(x["prompt_len"], x["concurrency"]): x for x in report.headline(res)["m"]["gen"]}
    assert rows[(512, 1)]["output_vs_nodump"] == pytest.approx(84 / 86)
    assert rows[(512, 1)]["rounds_output_vs_nodump"] == 2
    assert rows[(512, 1)]["two_pass_vs_one_pass"] == pytest.approx(108 / 86)
    assert rows[(512, 8)]["output_vs_nodump"] == pytest.approx(22 / 23)
    assert rows[(512, 32)]["two_pass_vs_one_pass"] == pytest.approx(52 / 43)
    # the pooled rate is not the mean of the rounds' ratios: (10/10.5 + 12/12.5) / 2 = 0.95619
    assert not math.isclose(rows[(512, 8)]["output_vs_nodump"], (10 / 10.5 + 12 / 12.5) / 2, rel_tol=1e-4)
    assert "gen" not in report.headline(sample())["m"]  # no generate cell, no rows


def test_gen_targets_pass_and_fail():
    res = sample()
    res["models"]["m"]["cells"] = _cells(WALLS)
    rows = _rows(res)
    # worst at conc 1, 8, 32: 512 x 32's 40/43 (512 x 4's 0.5 is not a target concurrency)
    assert rows[OUT]["value"] == pytest.approx(40 / 43) and rows[OUT]["pass"] is False
    assert rows[OUT]["threshold"] == 0.95
    assert rows[TWO]["value"] == pytest.approx(52 / 43) and rows[TWO]["pass"] is True
    assert rows[TWO]["threshold"] == 1.2
    # one pass 0.5 s per sample faster at 512 x 32 (20.5 s): (g out) passes; two passes only
    # 1 s per round slower than one at 512 x 8: 24/23 = 1.04348 fails
    walls = {**WALLS, (512, 32): [(20, 20.5, 26)] * 2, (512, 8): [(10, 10.5, 11), (12, 12.5, 13)]}
    res["models"]["m"]["cells"] = _cells(walls)
    rows = _rows(res)
    assert rows[OUT]["value"] == pytest.approx(22 / 23) and rows[OUT]["pass"] is True
    assert rows[TWO]["value"] == pytest.approx(24 / 23) and rows[TWO]["pass"] is False
    # only where the modes ran: no (g 2p), no row for it; a failed (g out) cell pairs with nothing
    res["models"]["m"]["cells"] = [c for c in _cells(WALLS) if c["mode"] != "gen_two_pass"]
    assert set(_rows(res)) == {OUT}
    res["models"]["m"]["cells"] = [c | {"error": "boom"} if c["mode"] == "gen_output" else c for c in _cells(WALLS)]
    assert _rows(res) == {}
    res["models"]["m"]["cells"] = [c for c in _cells(WALLS) if c["concurrency"] == 4]
    assert _rows(res)[OUT]["value"] is None and _rows(res)[OUT]["pass"] is None  # no target concurrency ran


def test_gen_cells_in_the_markdown_and_the_summary():
    res = sample()
    res["models"]["m"]["cells"] += _cells(WALLS) + [
        {"mode": "gen_output", "prompt_len": 2048, "concurrency": 8, "requests": 8, "rep": 0,
         "error": "1 problem(s) in 8 requests: file check: x.safetensors: 3 rows"}]
    md = markdown.render_markdown(res)
    assert "| 2048 | 8 | dump | 4 | 96000 |" in md  # the prefill table as before
    # 512 x 32 (g 2p) #0: 32 requests of 512 tokens in 26 s: 630 tok/s, 26/32 = 0.8125 s a sample
    assert "| 512 | 32 | gen_two_pass #0 | 32 | 512 | 630 | 0.812 |" in md
    assert "| 512 | 32 | 0.930 | 2 | 1.209 | 2 |" in md
    assert "| 2048 | 8 | gen_output #0 | ERROR: 1 problem(s) in 8 requests: file check" in md
    assert f"| m | {OUT} | 0.930 | FAIL |" in md and f"| m | {TWO} | 1.209 | PASS |" in md
    assert "| 512 | 1 | gen" not in md.split("Generate cells")[0]  # not in the prefill table
    table = markdown.summary_table(res)
    # every shape's: 512 x 4's 0.5 too
    assert "generate: (g out)/(g) output tok/s min 0.500, (g 2p)/(g out) wall per sample min 1.209" in table
    alone = sample()  # generate modes alone: no prefill table, no prefill ratios
    alone["models"]["m"]["cells"] = _cells(WALLS)
    md = markdown.render_markdown(alone)
    assert "prefill tok/s" not in md and "dump_vs_json" not in md and "| 512 | 8 | 0.957 | 2 | 1.217 | 2 |" in md


def test_plot_draws_the_prefill_cells_only(tmp_path):
    pytest.importorskip("matplotlib")
    from bench import plot

    res = sample()
    res["models"]["m"]["cells"] += _cells(WALLS)
    assert plot.plot(res, str(tmp_path / "r.png"))
    res["models"]["m"]["cells"] = _cells(WALLS)
    with pytest.raises(ValueError, match="generate cells are in the Markdown"):
        plot.plot(res, str(tmp_path / "g.png"))


def test_plan_of_the_generate_modes():
    """Servers A and B, both decoding in CUDA graphs (every other run keeps them off); the
    generate cells' concurrency 1, 8, 32 where none is given (kimi-slice's own grid is
    1, 8); requests for ~2k generated tokens (quick), at least one per client; their file
    sizes and time estimates."""
    modes = "gen_nodump,gen_output,gen_two_pass"
    planned = plan.make_plan(_args(["--quick", "--models", "llama-8b", "--modes", modes, "--prompt-lens", "512"]))
    m = planned["models"]["llama-8b"]
    assert sorted(m["servers"]) == ["A", "B"] and planned["gen_tokens"] == 512
    for cmd in m["servers"].values():
        assert "--disable-decode-cuda-graph" not in cmd and "--disable-prefill-cuda-graph" in cmd
    assert m["servers"]["B"][-2:] == ["--dump-hidden-states-dir", "/dev/shm/kimi-bench-llama-8b"]
    prefill = plan.make_plan(_args(["--quick", "--models", "llama-8b", "--modes", "nodump,dump"]))
    assert all("--disable-decode-cuda-graph" in c for c in prefill["models"]["llama-8b"]["servers"].values())
    cells = {(c["mode"], c["concurrency"]): c for c in m["cells"]}
    assert len(cells) == 9 and {c["gen_tokens"] for c in cells.values()} == {512}
    assert [cells[("gen_nodump", k)]["requests"] for k in (1, 8, 32)] == [4, 8, 32]  # 2048 / 512 = 4
    spec = models.MODELS["llama-8b"]
    assert cells[("gen_output", 8)]["dump_bytes"] == 8 * models.file_bytes(spec, 512 + 512 - 1)
    assert cells[("gen_two_pass", 8)]["dump_bytes"] == 8 * models.file_bytes(spec, 512 + 512)
    assert "dump_bytes" not in cells[("gen_nodump", 8)]
    # 4 waves of one request: a 512-token prefill at 40k tok/s, then 512 steps of 10 ms
    assert cells[("gen_nodump", 1)]["est_s"] == pytest.approx(4 * (512 / 40_000 + 5.12) + 0.5, abs=0.05)
    # two passes add the capture's 1024-token prefill per wave: one wave of 32
    assert cells[("gen_two_pass", 32)]["est_s"] == pytest.approx(
        32 * 512 / 40_000 + 32 * 1024 / 40_000 + 5.12 + 0.5, abs=0.05)
    slice_ = plan.make_plan(_args(["--quick", "--models", "kimi-slice", "--modes", "nodump,gen_output",
                                   "--prompt-lens", "2048", "--gen-tokens", "64", "--gen-requests", "16"]))
    shapes = {(c["mode"], c["concurrency"]): c["requests"] for c in slice_["models"]["kimi-slice"]["cells"]}
    assert shapes == {("nodump", 1): 32, ("nodump", 8): 32, ("gen_output", 1): 16, ("gen_output", 8): 16,
                      ("gen_output", 32): 32}
    given = plan.make_plan(_args(["--quick", "--models", "llama-8b", "--modes", "gen_nodump", "--concurrency", "2"]))
    assert {c["concurrency"] for c in given["models"]["llama-8b"]["cells"]} == {2}


def test_two_passes_need_both_servers_and_sizes_are_checked(capsys):
    short = _args(["--modes", "gen_two_pass", "--ports", "1"])
    assert servers.servers_of(short, "gen_two_pass") == ("A", "B")
    assert servers.ports_problem(short, ["gen_two_pass"]) == (
        "mode gen_two_pass runs on a second server (B): --ports needs two ports")
    for argv in (["--modes", "gen_two_pass", "--ports", "1"], ["--modes", "gen_nodump", "--gen-tokens", "0"]):
        with pytest.raises(SystemExit) as e:
            cli.main(["--dry-run", *argv])
        assert e.value.code == 2
    assert "--gen-tokens must be >= 1" in capsys.readouterr().err


def test_a_generate_cell_waits_for_generate_cells_only():
    """The deadline's guess of a cell: twice its shape's longest wall so far, generate cells
    by generate cells (a minute of decode says nothing of a prefill cell)."""
    done = [{"mode": "gen_nodump", "prompt_len": 512, "concurrency": 8, "wall_s": 60.0},
            {"mode": "nodump", "prompt_len": 512, "concurrency": 8, "wall_s": 2.0}]
    assert plan.cell_need_s({"mode": "dump", "prompt_len": 512, "concurrency": 8, "est_s": 1}, done) == 19.0
    assert plan.cell_need_s({"mode": "gen_output", "prompt_len": 512, "concurrency": 8, "est_s": 1}, done) == 135.0


def _standin_file(tmp_path, ids, extra=None):
    """A file written by the stand-in's writer (its steps are the format's own) for ``ids``."""
    from sglang_ext import format as fmt
    from sglang_ext.tools.standin import Dump

    d = Dump(str(tmp_path / "dump"), (1, 2), 2, 8)
    try:
        res = fmt.reserve(d.dir_fd, f"r{len(ids)}-{len(extra or {})}")
        d.write(res, res.name, ids, extra)
        return str(tmp_path / "dump" / res.name)
    finally:
        d.close()


def test_file_check_of_one_and_two_passes(tmp_path):
    from sglang_ext import format as fmt
    from sglang_ext.format.files import DumpFormatError

    prompt, out = [5, 6, 7], [40, 41, 42, 43]
    one = _standin_file(tmp_path, fmt.fed_token_ids(prompt, out), fmt.output_metadata(3, 43))
    assert gen.read_rows(one)[:2] == (6, [5, 6, 7, 40, 41, 42])  # P + G - 1 rows
    gen.check_file("output", one, prompt, out)
    with pytest.raises(DumpFormatError, match="generated token 3 is last_token_id 43 in the file, 44"):
        gen.check_file("output", one, prompt, out[:3] + [44])
    prompt_only = _standin_file(tmp_path, prompt)  # a server that dumped the prompt alone
    with pytest.raises(DumpFormatError, match="no metadata num_prompt_tokens: the server wrote the prompt's rows"):
        gen.check_file("output", prompt_only, prompt, out)
    both = _standin_file(tmp_path, prompt + out)  # two passes: the capture of prompt + every generated id
    gen.check_file("two_pass", both, prompt, out)
    with pytest.raises(ValueError, match="6 token ids, not the prompt's 3 then the 4 generated ids"):
        gen.check_file("two_pass", one, prompt, out)


def test_gen_body_is_greedy_ignores_eos_and_asks_for_the_output_rows():
    assert gen.body([1, 2], 512) == {"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 512, "temperature": 0, "ignore_eos": True}}
    assert gen.body([1], 8, output=True)["sampling_params"]["custom_params"] == {"hidden_states_output": True}


def test_rehearsal_of_the_generate_modes(tmp_path):
    """The whole run on a CPU against tests/fake_sglang_server.py: two rounds of every
    generate mode at two concurrencies; every file checked (P + G - 1 rows one pass, P + G
    two), the ratios and targets computed, the dump directories left empty."""
    proc, out, shm, res_path = rehearse(
        tmp_path, "--modes", "gen_nodump,gen_output,gen_two_pass", "--prompt-lens", "16", "--concurrency", "1,4",
        "--gen-tokens", "8", "--gen-requests", "4", "--repeat", "2")
    res = json.loads(res_path.read_text())
    m = res["models"]["deepseek-tiny"]
    assert not any(c.get("error") for c in m["cells"]), m["cells"]
    assert len(m["cells"]) == 12 and res["config"]["gen_tokens"] == 8
    for c in m["cells"]:
        assert c["requests"] == 4 and c["output_tokens"] == 32 and c["output_tps"] > 0, c
        if c["mode"] != "gen_nodump":
            assert c["files"] == c["rows_checked"] == 4, c
    one = next(c for c in m["cells"] if c["mode"] == "gen_output")
    # where one pass's time goes: the writer's stages of its 4 files (the fake's trace events)
    assert one["stages"]["files"] == 4 and one["stages"]["write"]["p50"] >= 0, one["stages"]
    # 4 files of (16 + 8 - 1) rows x 4 layers x 64 bf16 + 8-byte ids, plus headers
    assert 4 * 23 * (4 * 64 * 2 + 8) < one["file_bytes"] < 4 * (23 * (4 * 64 * 2 + 8) + 1024)
    two = next(c for c in m["cells"] if c["mode"] == "gen_two_pass")
    assert two["generate_p50_s"] >= 0.008 and two["capture_p50_s"] > 0  # the fake's 1 ms a token
    assert all("--disable-decode-cuda-graph" not in cmd for cmd in m["servers"].values())
    gen_rows = res["headline"]["deepseek-tiny"]["gen"]
    assert [(x["concurrency"], x["rounds_output_vs_nodump"], x["rounds_two_pass_vs_one_pass"])
            for x in gen_rows] == [(1, 2, 2), (4, 2, 2)]
    rows = {t["target"]: t for t in res["targets"]}
    assert rows[OUT]["value"] is not None and rows[TWO]["value"] is not None
    md = (out / res_path.name.replace(".json", ".md")).read_text()
    assert "| prompt | conc | (g out)/(g) output tok/s |" in md and "generate:" in proc.stdout
    assert "| deepseek-tiny (gen_output) | 16 | 4 |" in md  # "Where the time goes"
    assert list(shm.iterdir()) == []


def test_one_pass_cell_against_the_stand_in(tmp_path):
    """bench/gen.py's one-pass client against ``sglang-ext standin`` (the documented
    stand-in: with hidden_states_output it generates ``max_new_tokens`` ids and writes the
    output-row file through sglang_ext.format; without, it answers one id, so the other
    modes are the rehearsal's): every file holds P + G - 1 rows and checks against its
    answer's output_ids."""
    import random
    import re
    import subprocess
    import sys
    import types

    pytest.importorskip("requests")
    proc = subprocess.Popen([sys.executable, "-m", "sglang_ext", "standin", "--port", "0", "--dump-dir",
                             str(tmp_path / "dump"), "--num-layers", "4", "--hidden-size", "16"],
                            stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("stand-in server"):
            line = proc.stderr.readline()
            assert line, "the stand-in did not start"
        server = types.SimpleNamespace(port=int(re.search(r":(\d+),", line).group(1)))
        cell = gen.run_cell(server, None, {"prompt_len": 12, "concurrency": 3, "requests": 6}, 1000,
                            random.Random(0), "gen_output", gen_tokens=5)
    finally:
        proc.kill()
        proc.wait()
    assert cell.get("error") is None, cell["error"]
    assert (cell["output_tokens"], cell["files"], cell["rows_checked"]) == (30, 6, 6)
    # 6 files of 12 + 5 - 1 = 16 rows x 3 layer slots (the default ids of 4 layers: 1, 2, 4)
    # x 16 channels bf16
    from bench import loadgen

    files = sorted((tmp_path / "dump").glob("*.safetensors"))
    assert [loadgen.safetensors_header(str(f))[0]["hidden_states"]["shape"] for f in files] == [[16, 3, 16]] * 6
    assert cell["file_bytes"] == sum(f.stat().st_size for f in files)
