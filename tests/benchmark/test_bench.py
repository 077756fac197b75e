"""The benchmark's CPU parts (the bench/ package): ratio math, targets, Markdown, plot,
the plan, the server kinds, the sub-programs, and the whole run rehearsed against a fake
server.

The numbers below are hand-made, with the expected ratios worked out by hand in the
comments, not replayed from the code.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cli, loadgen, markdown, models, peer, plan, report, targets

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"

MiB = 1 << 20


def cell(mode, plen, conc, tps, reqs=4, **kw):
    tokens = plen * reqs
    c = {"mode": mode, "prompt_len": plen, "concurrency": conc, "requests": reqs,
         "prompt_tokens": tokens, "wall_s": tokens / tps, "prefill_tps": tps,
         "p50_s": 0.1, "p99_s": 0.2}
    c.update(kw)
    return c


def sample():
    # One model, B = 32 KiB per prompt token (4 layers x 4096 x bf16, rounded: token ids
    # and header ignored here); W = min(50, 10) = 10 GB/s at 64 MiB files, so
    # W/B = 10e9 / 32768 = 305_175.78 tokens/s.
    b = 32768
    return {
        "date": "2026-11-29T12:00:00+00:00", "gpu": "NVIDIA H200", "profile": "quick",
        "ceilings": {
            "d2h_pinned_gbps": 50.0, "writer_threads": 8,
            "shm_write_gbps": {str(64 * MiB): 10.0, str(256 * MiB): 20.0},
            "writer_alone": {"m": {"2048": {"gbps": 8.0, "file_bytes": 64 * MiB}}},
        },
        "models": {"m": {
            "hidden_size": 4096, "layer_ids": [2, 4, 5, 8],
            "cells": [
                cell("nodump", 2048, 8, 100_000.0),
                cell("dump", 2048, 8, 96_000.0, file_bytes=4 * 2048 * b, write_gbps=3.1),
                cell("json", 2048, 8, 2_000.0, response_bytes=4 * 160_000_000),
                # at 512/1, (a) = 400k is above W/B = 305k: the bound is W/B
                cell("nodump", 512, 1, 400_000.0),
                cell("dump", 512, 1, 290_000.0, file_bytes=4 * 512 * b),
            ],
            "host_memory": {"cap_bytes": 4096 * MiB, "log_host_bytes_peak": 1024 * MiB,
                            "rss_delta_bytes": 1500 * MiB},
        }},
    }


def test_percentile_matches_linear_interpolation():
    xs = [0.4, 0.1, 0.3, 0.2]
    assert report.percentile(xs, 50) == pytest.approx(0.25)
    assert report.percentile(xs, 99) == pytest.approx(0.3 + 0.1 * 0.97)
    assert report.percentile([7.0], 99) == 7.0
    assert math.isnan(report.percentile([], 50))


def test_cell_stats_throughput_is_tokens_over_wall():
    s = report.cell_stats([1.0, 2.0, 3.0], prompt_tokens=6144, wall_s=2.0)
    assert s["prefill_tps"] == 3072.0
    assert s["p50_s"] == 2.0


def test_cell_stats_drain_is_the_wall_after_the_last_answer():
    s = report.cell_stats([0.4, 0.4], prompt_tokens=4096, wall_s=1.0, last_answer_s=0.96)
    assert s["drain_s"] == pytest.approx(0.04) and s["prefill_tps"] == 4096.0
    assert "drain_s" not in report.cell_stats([0.4], prompt_tokens=1, wall_s=1.0)
    # the last answer can come after the last file only by the clock's grain: never negative
    assert report.cell_stats([0.4], 1, wall_s=1.0, last_answer_s=1.0000001)["drain_s"] == 0.0


def _issue39_cells(early_drain_s=0.0):
    """Two rounds of four shapes: (a), (b) waiting, (b') early, (b fp8). Each (b') cell is
    (a)'s wall plus ``early_drain_s`` of drain, every cell 32 requests."""
    out = []
    walls = {  # (prompt, conc): (a), (b), (b fp8) seconds per round
        (2048, 1): (2.0, 2.1, 2.05), (512, 1): (6.0, 6.5, 6.4),
        (2048, 8): (1.6, 1.64, 1.63), (512, 8): (2.0, 2.04, 2.1)}
    for rep in range(2):
        for (plen, conc), (a, b, f) in walls.items():
            tokens = 32 * plen
            for mode, wall, drain in (("nodump", a, 0.001), ("dump", b, 0.001),
                                      ("dump_early", a + early_drain_s, early_drain_s), ("dump_fp8", f, 0.001)):
                out.append(cell(mode, plen, conc, tokens / wall, reqs=32, rep=rep, drain_s=drain))
    return out


def test_latency_targets_on_the_pooled_rounds():
    """Issue 39's targets, each the worst shape pooled over the rounds: waiting answers at
    concurrency 1 (>= 0.90) and at >= 8 (>= 0.97), early answers (>= 0.98), fp8 against
    bf16 (>= 1): here 512 x 8's fp8 is slower than its bf16 (2.1 s against 2.04 s)."""
    res = sample()
    res["models"]["m"]["cells"] = _issue39_cells(early_drain_s=0.04)
    rows = {t["target"]: t for t in targets.targets(res, report.headline(res))}
    conc1 = rows["(b) waiting >= 0.90 x (a) at conc 1, pooled, worst shape"]
    assert conc1["value"] == pytest.approx(6.0 / 6.5) and conc1["pass"] is True
    conc8 = rows["(b) waiting >= 0.97 x (a) at conc >= 8, pooled, worst shape"]
    assert conc8["value"] == pytest.approx(1.6 / 1.64) and conc8["pass"] is True
    early = rows["(b') early >= 0.98 x (a), pooled, worst shape"]
    assert early["value"] == pytest.approx(1.6 / 1.64) and early["pass"] is False  # 40 ms on 1.6 s
    fp8 = rows["(b fp8) >= (b) bf16, pooled, worst shape"]
    assert fp8["value"] == pytest.approx(2.04 / 2.1) and fp8["pass"] is False
    # the pooled table says the early answers' cost up to their last answers: none here
    pooled = {(x["mode"], x["prompt_len"], x["concurrency"]): x for x in report.headline(res)["m"]["pooled"]}
    e = pooled[("dump_early", 2048, 8)]
    assert e["vs_nodump"] == pytest.approx(1.6 / 1.64)
    assert e["vs_nodump_to_last_answer"] == pytest.approx((1.6 - 0.001) / 1.6)
    md = markdown.render_markdown(res | {"headline": report.headline(res), "targets": list(rows.values())})
    assert "| dump | dump_early | dump_fp8 | dump_early to last answer |" in md
    assert "| 2048 | 8 | dump_early #1 | 32 | " in md and " | 40.0 | " in md  # the drain column, in ms
    assert "(b') early >= 0.98 x (a), pooled, worst shape" in md


def test_pooled_ratios_pair_the_rounds_both_sides_ran():
    """A round the deadline cut from the dump (its #2) drops from the base too: the ratio
    is the shared rounds' tokens over their seconds, both sides, and says 2 rounds; a run
    without the drain measured has no "to last answer" ratio."""
    res = sample()
    res["models"]["m"]["cells"] = [
        cell("nodump", 512, 1, 100.0, rep=0), cell("dump", 512, 1, 90.0, rep=0),
        cell("nodump", 512, 1, 200.0, rep=1), cell("dump", 512, 1, 180.0, rep=1),
        cell("nodump", 512, 1, 50.0, rep=2),  # a slow round of the base alone
    ]
    h = report.headline(res)["m"]
    (x,) = [p for p in h["pooled"] if p["mode"] == "dump"]
    toks = 512 * 4
    want = (2 * toks / (toks / 90 + toks / 180)) / (2 * toks / (toks / 100 + toks / 200))
    assert x["rounds"] == 2 and x["vs_nodump"] == pytest.approx(want) and want == pytest.approx(0.9)
    assert x["vs_nodump_to_last_answer"] is None
    rows = {t["target"]: t for t in targets.targets(res, report.headline(res))}
    assert rows["(b) waiting >= 0.90 x (a) at conc 1, pooled, worst shape"]["value"] == pytest.approx(0.9)
    assert report.paired_ratio(res["models"]["m"]["cells"], "dump", "nodump", (2048, 8)) == (None, 0)


def test_kimi_slice_runs_are_held_to_issue_48s_targets():
    """A kimi-slice-2 run (and only a Kimi slice's) gets issue 48's rows: early answers at
    concurrency 8, bf16 and fp8, >= 0.97 x (a) at every length (here fp8's early 2k x 8
    drains 60 ms on 1.6 s: 0.964, fails), fp8 >= 0.97 x bf16 in every shape (512 x 8:
    2.04 / 2.1 = 0.971, passes, where issue 39's fp8 >= bf16 fails)."""
    cells = _issue39_cells(early_drain_s=0.04)
    cells += [dict(c, mode="dump_fp8_early", wall_s=c["wall_s"] + (0.02 if c["prompt_len"] == 2048 else 0))
              for c in cells if c["mode"] == "dump_early"]
    res = sample()
    res["models"] = {"kimi-slice-2": dict(res["models"]["m"], cells=cells), "m": dict(res["models"]["m"], cells=cells)}
    rows = targets.targets(res, report.headline(res))
    kimi = {t["target"]: t for t in rows if t["model"] == "kimi-slice-2"}
    early = kimi["(b') early >= 0.97 x (a) at conc >= 8, pooled, worst length"]
    assert early["value"] == pytest.approx(1.6 / 1.64) and early["pass"] is True
    early8 = kimi["(b' fp8) early >= 0.97 x (a) at conc >= 8, pooled, worst length"]
    assert early8["value"] == pytest.approx(1.6 / 1.66) and early8["pass"] is False
    fp8 = kimi["(b fp8) >= 0.97 x (b) bf16, pooled, worst shape"]
    assert fp8["value"] == pytest.approx(2.04 / 2.1) and fp8["pass"] is True
    assert kimi["(b' fp8) >= 0.97 x (b') bf16, pooled, worst shape"]["value"] == pytest.approx(1.64 / 1.66)
    assert kimi["(b fp8) >= (b) bf16, pooled, worst shape"]["pass"] is False  # issue 39's row stays
    assert not any("0.97 x" in t["target"] and "(b) waiting" not in t["target"]
                   for t in rows if t["model"] == "m")


def test_latency_targets_only_for_modes_that_ran():
    res = sample()  # dump and nodump only, one round
    names = {t["target"] for t in targets.targets(res, report.headline(res))}
    assert "(b) waiting >= 0.90 x (a) at conc 1, pooled, worst shape" in names
    assert not any("early" in n or "fp8" in n for n in names)


def test_headline_ratios():
    h = report.headline(sample())["m"]
    # (b)/(a) at 2k/8: 96k / 100k; at 512/1: 290k / 400k
    by = {(c["prompt_len"], c["concurrency"]): c for c in h["cells"]}
    assert by[(2048, 8)]["dump_vs_nodump"] == pytest.approx(0.96)
    assert by[(512, 1)]["dump_vs_nodump"] == pytest.approx(0.725)
    assert h["dump_vs_nodump_min"] == pytest.approx(0.725)
    assert h["dump_vs_nodump_geomean"] == pytest.approx(math.sqrt(0.96 * 0.725))
    # W at 64 MiB files = min(50, 10) = 10 GB/s; B = 32768 B/token -> 305_175.78 tok/s
    assert by[(2048, 8)]["w_gbps"] == 10.0
    assert by[(2048, 8)]["w_tps"] == pytest.approx(10e9 / 32768)
    # 512-token files (16 MiB) are nearest to the 64 MiB measurement (log scale)
    assert by[(512, 1)]["w_gbps"] == 10.0
    # bound at 2k/8 = min(100k, 305k) = 100k; at 512/1 = min(400k, 305k) = 305k
    assert by[(2048, 8)]["dump_vs_bound"] == pytest.approx(0.96)
    assert by[(512, 1)]["dump_vs_bound"] == pytest.approx(290_000 / (10e9 / 32768))
    assert h["dump_vs_json"] == pytest.approx(48.0)  # 96k / 2k
    assert h["writer_vs_ceiling"] == pytest.approx(0.8)  # 8 / min(50, 10)


def test_repetitions_pair_with_their_own_nodump_cells():
    res = sample()
    res["models"]["m"]["cells"] = [
        cell("nodump", 2048, 32, 100_000.0, rep=0),
        cell("dump", 2048, 32, 50_000.0, rep=0, file_bytes=4 * 2048 * 16384, write_gbps=3.0),
        cell("nodump", 2048, 32, 200_000.0, rep=1),
        cell("dump", 2048, 32, 150_000.0, rep=1, file_bytes=4 * 2048 * 8192, write_gbps=4.0),
    ]
    h = report.headline(res)["m"]
    # rep 0: 50k / 100k; rep 1: 150k / 200k (never 50k / 200k)
    assert sorted((c["rep"], c["dump_vs_nodump"]) for c in h["cells"]) == [(0, 0.5), (1, 0.75)]
    assert h["dump_vs_nodump_min"] == pytest.approx(0.5)
    md = markdown.render_markdown(res | {"headline": report.headline(res), "targets": []})
    assert "| 2048 | 32 | dump #1 | 4 | 150000 |" in md and "| 4.00 |" in md


def test_control_rounds_and_pooled_ratios():
    """(a') is server A again in its round: its ratio to (a) is the run's noise floor, never
    a dump's cost; the pooled ratios are a shape's tokens over its seconds, every round."""
    res = sample()
    res["models"]["m"]["cells"] = [
        cell("nodump", 2048, 8, 100_000.0, rep=0),
        cell("dump", 2048, 8, 90_000.0, rep=0),
        cell("nodump_again", 2048, 8, 104_000.0, rep=0),
        cell("nodump_again", 2048, 8, 98_000.0, rep=1),
        cell("dump", 2048, 8, 60_000.0, rep=1),
        cell("nodump", 2048, 8, 50_000.0, rep=1),
    ]
    h = report.headline(res)["m"]
    assert [c["mode"] for c in h["cells"]] == ["dump", "dump"]  # the control is no dump cell
    assert h["nodump_again_vs_nodump_min"] == pytest.approx(1.04)  # 104k / 100k
    assert h["nodump_again_vs_nodump_max"] == pytest.approx(1.96)  # 98k / 50k
    pooled = {x["mode"]: x for x in h["pooled"]}
    # each cell holds tokens = 2048 x its requests; pooled = sum(tokens) / sum(seconds)
    toks = res["models"]["m"]["cells"][0]["prompt_tokens"]
    a = 2 * toks / (toks / 100_000 + toks / 50_000)
    assert pooled["dump"]["vs_nodump"] == pytest.approx((2 * toks / (toks / 90_000 + toks / 60_000)) / a)
    assert pooled["nodump_again"]["vs_nodump"] == pytest.approx((2 * toks / (toks / 104_000 + toks / 98_000)) / a)
    assert pooled["dump"]["rounds"] == 2
    md = markdown.render_markdown(res | {"headline": report.headline(res), "targets": []})
    assert "this run's noise floor" in md
    row = f"| 2048 | 8 | 2 | {pooled['dump']['vs_nodump']:.3f} | {pooled['nodump_again']['vs_nodump']:.3f} |"
    assert row in md


def test_counterbalance_reverses_odd_rounds():
    argv = ["--quick", "--models", "llama-mid", "--prompt-lens", "512", "--concurrency", "1",
            "--modes", "nodump,dump,nodump_again", "--repeat", "3"]
    order = [(c.get("rep"), c["mode"]) for c in plan.make_plan(_args(argv + ["--counterbalance"]))["models"]["llama-mid"]["cells"]]
    assert order == [(0, "nodump"), (0, "dump"), (0, "nodump_again"),
                     (1, "nodump_again"), (1, "dump"), (1, "nodump"),
                     (2, "nodump"), (2, "dump"), (2, "nodump_again")]
    plain = [c["mode"] for c in plan.make_plan(_args(argv))["models"]["llama-mid"]["cells"]]
    assert plain == ["nodump", "dump", "nodump_again"] * 3
    # the control is served by A, as (a): no extra server on the GPU
    servers_ = plan.make_plan(_args(argv))["models"]["llama-mid"]["servers"]
    assert sorted(servers_) == ["A", "B"]


def test_targets_pass_and_fail():
    res = sample()
    rows = {t["target"]: t for t in targets.targets(res, report.headline(res))}
    bound = rows["(b) >= 0.95 x min((a), W/B), worst cell"]
    assert bound["value"] == pytest.approx(290_000 / (10e9 / 32768))  # 0.950272
    assert bound["pass"] is True
    assert rows["(b) >= 30 x (c) at 2k/conc 8"]["pass"] is True
    assert rows["writer alone >= 0.70 W (2k files)"]["pass"] is True
    assert rows["host memory under the cap"]["pass"] is True
    # RSS growth is reported, not checked, while the writer's own numbers are there...
    res["models"]["m"]["host_memory"]["rss_delta_bytes"] = 5 * 1024 * MiB
    rows = {t["target"]: t for t in targets.targets(res, report.headline(res))}
    assert rows["host memory under the cap"]["pass"] is True
    assert "RSS growth 5120 MiB" in rows["host memory under the cap"]["note"]
    # ...a pinned pool over the cap fails...
    res["models"]["m"]["host_memory"]["log_pinned_pool_peak"] = 4097 * MiB
    res["models"]["m"]["cells"][4]["prefill_tps"] = 200_000.0
    rows = {t["target"]: t for t in targets.targets(res, report.headline(res))}
    assert rows["host memory under the cap"]["pass"] is False
    assert rows["host memory under the cap"]["value"] == 4097 * MiB
    # ...and without them, RSS growth over the cap + 512 MiB fails
    del res["models"]["m"]["host_memory"]["log_pinned_pool_peak"]
    del res["models"]["m"]["host_memory"]["log_host_bytes_peak"]
    rows = {t["target"]: t for t in targets.targets(res, report.headline(res))}
    assert rows["host memory under the cap"]["pass"] is False
    assert rows["(b) >= 0.95 x min((a), W/B), worst cell"]["pass"] is False


def test_targets_not_measured_when_missing():
    res = sample()
    res["models"]["m"]["cells"] = [c for c in res["models"]["m"]["cells"] if c["mode"] != "json"]
    res["models"]["m"]["host_memory"] = {}
    res["ceilings"]["writer_alone"] = {}
    rows = {t["target"]: t for t in targets.targets(res, report.headline(res))}
    assert rows["(b) >= 30 x (c) at 2k/conc 8"]["pass"] is None
    assert rows["writer alone >= 0.70 W (2k files)"]["pass"] is None
    assert rows["host memory under the cap"]["pass"] is None


def test_markdown_has_every_cell_and_the_targets():
    res = sample()
    res["models"]["m"]["cells"].append({"mode": "dump", "prompt_len": 8192, "concurrency": 32,
                                        "requests": 32, "error": "HTTP 500 boom"})
    md = markdown.render_markdown(res)
    assert "| 2048 | 8 | dump | 4 | 96000 |" in md
    assert "| 2048 | 8 | json | 4 | 2000 |" in md and "| 160.0 |" in md
    assert "ERROR: HTTP 500 boom" in md
    assert "dump_vs_json (2k, conc 8): 48.0x" in md
    assert md.count("PASS") == 4
    assert "files of 64.0 MiB: 10.0 GB/s" in md
    table = markdown.summary_table(res)
    assert "0.725" in table and "48.0" in table


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from bench import plot

    src = tmp_path / "r.json"
    src.write_text(json.dumps(sample()))
    assert plot.main([str(src), "--markdown"]) == 0
    png = tmp_path / "r.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "r.md").read_text().startswith("# Hidden-state dump benchmark")


RESULTS = sorted((BENCH / "results").glob("*.json"))


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_committed_results_still_render_as_committed(path, tmp_path):
    """Each results JSON kept in bench/results/ is still read as written: the Markdown made
    from it now is the .md committed beside it, byte for byte (the schema report and plot
    read has not drifted from the runs of record), the summary table builds, and the plot
    draws it (where matplotlib is installed)."""
    res = json.loads(path.read_text())
    assert markdown.render_markdown(res) == path.with_suffix(".md").read_text()
    assert markdown.summary_table(res).startswith("model")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    from bench import plot

    png = tmp_path / "r.png"
    if not any(m.get("cells") for m in res["models"].values()):  # a run the deadline left no cell
        with pytest.raises(ValueError, match="no model with measured cells"):
            plot.plot(res, str(png))
        return
    plot.plot(res, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_results_folder_holds_no_raw_dumps():
    """bench/results/ keeps the evidence lean: JSON, its Markdown and a plot per run (and
    its README); py-spy samples, torch traces and server logs stay out (git history)."""
    names = [p.name for p in (BENCH / "results").iterdir() if not p.name.startswith(".")]
    assert {Path(n).suffix for n in names if n != "README.md"} <= {".json", ".md", ".png"}, names
    assert RESULTS and all(p.with_suffix(".md").exists() for p in RESULTS)


def test_plan_sizes_and_server_flags():
    planned = plan.make_plan(_args(["--quick", "--dry-run"]))
    llama = planned["models"]["llama-mid"]
    a, b = llama["servers"]["A"], llama["servers"]["B"]
    # same flags, A adds the JSON switch, B the dump
    assert a[: a.index("--port")] == b[: b.index("--port")]
    assert "--enable-return-hidden-states" in a and "--dump-hidden-states-dir" not in a
    assert "--dump-hidden-states-dir" in b and "--enable-return-hidden-states" not in b
    assert "--dump-hidden-states-layers" not in b  # Llama: default 2,4,5,8
    plain = plan.make_plan(_args(["--quick", "--modes", "nodump,dump"]))["models"]["llama-mid"]["servers"]
    assert "--enable-return-hidden-states" not in plain["A"]
    ds_b = planned["models"]["deepseek-tiny"]["servers"]["B"]
    assert ds_b[ds_b.index("--dump-hidden-states-layers") + 1] == "1,2,3,4"
    cells = {(c["mode"], c["prompt_len"], c["concurrency"]): c for c in llama["cells"]}
    assert len(cells) == 28  # 3 lengths x 3 concurrencies x 3 modes (nodump, dump, dump_early) + JSON
    assert cells[("json", 2048, 8)]["requests"] == 8
    assert cells[("dump", 512, 1)]["requests"] == 128  # 64k tokens / 512
    assert cells[("dump", 8192, 32)]["requests"] == 32  # one per client at least
    ds = {(c["mode"], c["prompt_len"], c["concurrency"]): c for c in planned["models"]["deepseek-tiny"]["cells"]}
    assert ds[("dump", 2048, 8)]["requests"] == 256  # cell_scale 8: 8 x 64k tokens / 2048
    # 2048 tokens x (4 x 4096 x 2 + 8) bytes + header
    assert models.file_bytes(models.MODELS["llama-mid"], 2048) == 2048 * 32776 + 1024
    # the headline cells come first: a run cut short by the deadline still has them
    assert [(c["mode"], c["prompt_len"], c["concurrency"]) for c in llama["cells"][:4]] == [
        ("nodump", 2048, 8), ("dump", 2048, 8), ("dump_early", 2048, 8), ("json", 2048, 8)]
    full = plan.make_plan(_args(["--dry-run"]))
    [json_cell] = [c for c in full["models"]["llama-mid"]["cells"] if c["mode"] == "json"]
    assert json_cell["requests"] == 16


def test_a_model_is_one_registry_entry(monkeypatch, tmp_path):
    """A workload added as one ``models.Model`` (a checkpoint built into a directory by a
    function, its own server flags and grid) reaches every part of a run: our servers carry
    its flags before the kind's, its cells follow its prompt lengths and concurrencies
    unless the flags name others, the ceilings and vLLM's batched tokens take its prefill
    chunk, its MLA keeps vLLM out, and ``bench.models`` builds it once."""
    built = []

    def build(path):
        os.makedirs(path, exist_ok=True)
        (Path(path) / "model.safetensors").write_bytes(b"x")
        built.append(path)

    flags = ("--context-length", "132000", "--chunked-prefill-size", "16384")
    monkeypatch.setitem(models.MODELS, "slice", models.Model(
        build, hidden_size=7168, num_layers=4, vocab=163840, layers_flag="1,2,3,4", mla=True, server_flags=flags,
        prompt_lens=(2048, 8192, 32768, 131072), concurrency=(1, 8)))
    planned = plan.make_plan(_args(["--quick", "--models", "slice", "--modes", "nodump,dump,vllm_dump"]))
    m = planned["models"]["slice"]
    a, b = m["servers"]["A"], m["servers"]["B"]
    assert a[-4:] == list(flags)  # no JSON cells: A has no flag of its own
    at = b.index("--context-length")
    assert b[at:at + 5] == [*flags, "--dump-hidden-states-dir"]
    assert "W" not in m["servers"] and "vLLM 0.33's extract_hidden_states has no MLA" in m["peer_unsupported"]
    shapes = {(c["prompt_len"], c["concurrency"]) for c in m["cells"]}
    assert shapes == {(p, c) for p in (2048, 8192, 32768, 131072) for c in (1, 8)}
    assert [c["mode"] for c in m["cells"][:2]] == ["nodump", "dump"] and m["cells"][0]["prompt_len"] == 2048
    big = next(c for c in m["cells"] if c["mode"] == "dump" and c["prompt_len"] == 131072 and c["concurrency"] == 8)
    assert big["dump_bytes"] == 8 * (131072 * (4 * 7168 * 2 + 8) + 1024)
    assert planned["phases"][0]["file_sizes"][-1] == models.file_bytes(models.MODELS["slice"], 131072)
    given = plan.make_plan(_args(["--quick", "--models", "slice", "--modes", "nodump", "--prompt-lens", "512",
                                  "--concurrency", "2"]))
    assert {(c["prompt_len"], c["concurrency"]) for c in given["models"]["slice"]["cells"]} == {(512, 2)}
    assert models.MODELS["slice"].chunk == 16384 and models.MODELS["llama-8b"].chunk == 8192
    vllm = peer.vllm_command(_args([]), "slice", 1, [])
    assert vllm[vllm.index("--max-num-batched-tokens") + 1] == "16384"
    models.main(["slice", str(tmp_path / "ckpt")])
    models.main(["slice", str(tmp_path / "ckpt")])  # reused: the build finished there
    assert built == [str(tmp_path / "ckpt")]
    cut = tmp_path / "cut"  # a checkpoint left by a build cut short (no marker): built again
    cut.mkdir()
    (cut / "model.safetensors").write_bytes(b"half")
    models.main(["slice", str(cut)])
    assert built[-1] == str(cut) and (cut / models.BUILT).read_text() == "slice"


def _args(argv):
    return cli.build_parser().parse_args(argv)


def test_dry_run_prints_the_plan_without_torch():
    # a plan for a larger host: the writer's CPUs are the GPU host's, not this one's
    env = dict(os.environ, KIMI_SGLANG_WRITER_CPUS=f"{os.cpu_count()}-{os.cpu_count() + 3}")
    out = subprocess.run([sys.executable, "-m", "bench", "--dry-run", "--quick"],
                         capture_output=True, text=True, check=True, env=env, cwd=REPO).stdout
    assert "server B:" in out and "--dump-hidden-states-dir /dev/shm/kimi-bench-llama-mid" in out
    assert "estimated total" in out


def test_server_kinds_serve_their_modes_and_differ_only_in_their_last_flags():
    """Every mode has its server (A: nodump, json; B: dump, dump_early; D: dump_fp8, dump_fp8_early;
    vLLM's V and W, tests/benchmark/test_bench_peer.py);
    all of our kinds carry testing/server.py's shared flags and the run's options, then
    only what makes the kind; dumping kinds get their own directory and the writer's
    environment."""
    from bench import servers
    from testing import server as launcher

    prefill = [m for m in plan.MODES if not m.startswith("gen_")]  # generate modes: tests/benchmark/test_bench_gen.py
    args = _args(["--modes", ",".join(prefill), "--max-host-mb", "1024",
                  "--dump-root", "/r", "--workdir", "/w", "--ports", "1,2,3"])
    assert {m: servers.server_for(args, m) for m in plan.MODES} == {
        "nodump": "A", "dump": "B", "dump_early": "B", "dump_fp8": "D", "dump_fp8_early": "D", "json": "A",
        "vllm_nodump": "V", "vllm_dump": "W", "dump_store": "S", "dump_store_early": "S",
        "nodump_again": "A", "gen_nodump": "A", "gen_output": "B", "gen_two_pass": "A"}
    cmds = {w: servers.server_cmd(args, "deepseek-tiny", w) for w in "ABD"}
    assert servers.launcher is launcher  # the GPU suite's module, not a copy
    shared = launcher.base_command("sglang.launch_server", "/w/deepseek-tiny", 1, 0.3, python=sys.executable)
    assert cmds["A"][: len(shared)] == shared
    common = cmds["A"][len(shared):-1]  # A's own flag last: json runs
    assert "--disable-radix-cache" in common and "--disable-decode-cuda-graph" in common
    assert "--skip-tokenizer-init" in common
    tails = {w: c[len(shared) + len(common):] for w, c in cmds.items()}
    for port, (w, c) in enumerate(cmds.items(), 1):  # same flags but the port (--ports 1,2,3)
        assert c[:len(shared) + len(common)] == launcher.base_command(
            "sglang.launch_server", "/w/deepseek-tiny", port, 0.3, python=sys.executable) + common, w
    assert tails == {
        "A": ["--enable-return-hidden-states"],
        "B": ["--dump-hidden-states-dir", "/r/kimi-bench-deepseek-tiny", "--dump-hidden-states-layers", "1,2,3,4",
              "--dump-hidden-states-max-host-mb", "1024"],
        "D": ["--dump-hidden-states-dir", "/r/kimi-bench-deepseek-tiny-fp8", "--dump-hidden-states-layers",
              "1,2,3,4", "--dump-hidden-states-max-host-mb", "1024", "--dump-hidden-states-dtype", "fp8"],
    }
    # S (the store modes, tests/benchmark/test_bench_store.py): B's tail with the store's address
    store_args = _args(["--modes", ",".join(prefill), "--max-host-mb", "1024", "--mooncake-port", "7",
                        "--ports", "1,2,3,4,5,6"])
    s = servers.server_cmd(store_args, "deepseek-tiny", "S")
    assert s[len(shared) + len(common):] == [
        "--dump-hidden-states-dir", "mooncake://127.0.0.1:7?protocol=tcp&global_segment_size=0"
        "&local_buffer_size=1073741824&local_hostname=127.0.0.1", "--dump-hidden-states-layers", "1,2,3,4",
        "--dump-hidden-states-max-host-mb", "1024"]
    assert [servers.dumps(w) for w in "ABDS"] == [False, True, True, False]  # no directory for S
    assert servers.server_env("S", None) == {"KIMI_SGLANG_STATS_INTERVAL_S": "5"}
    assert servers.server_env("B", "/t.jsonl") == {"KIMI_SGLANG_STATS_INTERVAL_S": "5",
                                                   "KIMI_SGLANG_TRACE": "/t.jsonl"}
    assert servers.server_env("D", None) == {"KIMI_SGLANG_STATS_INTERVAL_S": "5"}
    assert servers.server_env("A", "/t.jsonl") is None
    # a server beyond --ports is a usage error that names it
    short = _args(["--modes", "nodump,dump_fp8", "--ports", "1,2"])
    assert servers.ports_problem(short, ["nodump", "dump_fp8"]) == (
        "mode dump_fp8 runs on a third server (D): --ports needs three ports")
    assert servers.ports_problem(short, ["nodump", "dump"]) is None
    with pytest.raises(SystemExit) as e:
        cli.main(["--dry-run", "--modes", "nodump,dump_fp8", "--ports", "1,2"])
    assert e.value.code == 2


def test_next_server_starts_once_the_one_before_loads_its_weights():
    """The start-up gate is the first line of a server's GPU phase, as SGLang 0.5.17/0.5.23
    (model_runner.py) and vLLM 0.33 (v1/worker/gpu/model_runner.py) print it in the H200
    logs, not a line of its import phase; servers printing only later lines still pass."""
    from bench import servers

    gate = servers.READY_FOR_NEXT.search
    for line in ("[2026-12-01 21:56:34] Load weight begin. avail mem=139.13 GB",
                 "(EngineCore pid=2194) INFO 12-01 21:41:34 [model_runner.py:399] Loading model from scratch...",
                 "Memory pool end. avail mem=1.00 GB",
                 "init engine (profile, create kv cache, warmup model) took 0.01 seconds"):
        assert gate(line), line
    for line in ("[2026-12-01 21:56:28] Init parallel begin.",
                 "[2026-12-01 21:56:29] Memory baseline taken. mem usage=0.00 GB",
                 "(APIServer pid=2046) INFO 12-01 21:40:40 [startup.py:38] vLLM server version 0.33.0, serving model m",
                 "(EngineCore pid=2194) INFO 12-01 21:41:31 [core.py:139] Initializing a V1 LLM engine (v0.33.0)"):
        assert not gate(line), line


def test_start_pair_staggers_and_retries_a_server_that_died_alone(tmp_path, capsys):
    """Servers start one after another (the next once the one before has sized its KV
    cache); one that exits while another starts is stopped and started once more, alone.
    Against tests/fake_sglang_server.py."""
    import socket
    import time

    from bench import servers

    pytest.importorskip("requests")
    fake = str(REPO / "tests" / "fake_sglang_server.py")
    ports = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    # B exits with 3 on its first start (no marker yet), then serves
    flaky = ("import os, runpy, sys\nmarker = sys.argv.pop(1)\nif not os.path.exists(marker):\n"
             "    open(marker, 'w').close()\n    sys.exit(3)\n"
             f"runpy.run_path({fake!r}, run_name='__main__')\n")
    specs = {"A": ([sys.executable, fake, "--port", str(ports[0])], str(tmp_path / "a.log"), None),
             "B": ([sys.executable, "-c", flaky, str(tmp_path / "marker"), "--port", str(ports[1])],
                   str(tmp_path / "b.log"), None)}
    started = {}
    try:
        servers.start_pair(specs, started, timeout=60)
        assert list(started) == ["A", "B"] and all(s.healthy() for s in started.values())
        assert started["A"].startup_s > 0 and started["B"].startup_s > 0
        assert "server B failed (server exited with 3 during start-up" in capsys.readouterr().out
        assert (tmp_path / "marker").exists()
    finally:
        t0 = time.monotonic()
        servers.stop_all(list(started.values()))
    assert time.monotonic() - t0 < 20 and not any(s.alive() for s in started.values())


def test_defaults_are_sglang_ext_configs(monkeypatch, capsys):
    """The writer threads and the host-memory cap the plan (and the ceilings) use are
    sglang_ext.config's, read as the server reads them: not copies."""
    from sglang_ext import config

    monkeypatch.delenv("KIMI_SGLANG_WRITER_THREADS", raising=False)
    monkeypatch.setattr(config, "DEFAULT_WRITER_THREADS", 5)
    monkeypatch.setattr(config, "DEFAULT_MAX_HOST_MB", 1234)
    planned = plan.make_plan(_args(["--quick"]))
    assert planned["writer_threads"] == 5 and planned["max_host_mb"] == 1234
    monkeypatch.setenv("KIMI_SGLANG_WRITER_THREADS", "3")
    assert plan.make_plan(_args(["--quick", "--max-host-mb", "64"]))["writer_threads"] == 3
    monkeypatch.setenv("KIMI_SGLANG_WRITER_THREADS", "0")  # the server refuses it: so does the plan
    with pytest.raises(SystemExit) as e:
        cli.main(["--dry-run"])
    assert e.value.code == 2 and "KIMI_SGLANG_WRITER_THREADS must be >= 1" in capsys.readouterr().err


def test_sub_programs_are_modules_and_the_plan_needs_no_torch(tmp_path):
    """The bench is ``python -m bench`` from any folder with the repository on
    PYTHONPATH; the sub-programs (models, ceilings, peerfiles) are modules with their own
    command line, and no hidden flag is left; the dry run imports no torch."""
    import os

    env = os.environ | {"PYTHONPATH": str(REPO)}
    module = subprocess.run([sys.executable, "-m", "bench", "--dry-run", "--quick"],
                            capture_output=True, text=True, check=True, cwd=tmp_path, env=env).stdout
    assert "estimated total" in module
    usage = subprocess.run([sys.executable, "-m", "bench", "--help"],
                           capture_output=True, text=True, check=True, cwd=tmp_path, env=env).stdout
    assert usage.startswith("usage: python -m bench") and "--internal" not in usage and "--peer-reference" in usage
    assert not (BENCH / "bench.py").exists()  # no script beside the package (its sys.path shim is gone)
    for name, word in (("models", "llama-mid"), ("ceilings", "job"), ("peerfiles", "pairs")):
        out = subprocess.run([sys.executable, "-m", f"bench.{name}", "--help"], capture_output=True,
                             text=True, cwd=tmp_path, env=env)
        assert out.returncode == 0 and f"python -m bench.{name}" in out.stdout, out.stderr
        assert word.lower() in out.stdout.lower()
    probe = ("import sys\nfrom bench import cli\ncli.main(['--dry-run', '--quick'])\n"
             "assert 'torch' not in sys.modules, 'the dry run imported torch'\n")
    subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env)


def test_no_bench_module_over_400_lines():
    """bench/ stays a package of small modules (one job each; SpecForge's benchmarks keep
    theirs under ~300 lines)."""
    long = {p.name: n for p in BENCH.glob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_writer_log_peak_parses_the_snapshot_lines():
    log = (
        "[2026-11-29 12:00:00] hidden-state dump: {'files_written': 3, 'bytes_written': 10, "
        "'failures': 0, 'queue_depth': 0, 'host_bytes_in_use': 0, 'host_bytes_peak': 1048576, "
        "'backpressure_waits': 0}\nother line\n"
        "hidden-state dump: {'files_written': 9, 'host_bytes_peak': 4194304}\n"
        "hidden-state dump: layers [2, 4, 5, 8] of 8 into /dev/shm/x (writer rank: True)\n"
    )
    assert loadgen.writer_log_peak(log) == 4194304
    assert loadgen.writer_log_peak("nothing") is None
    assert loadgen.writer_log_peak(log + "hidden-state dump: {'pinned_pool_peak': 7}\n", "pinned_pool_peak") == 7


def test_safetensors_header_reader(tmp_path):
    # a hand-built file: 8-byte little-endian header length, JSON header, data
    header = {"__metadata__": {"layer_ids": "[2, 4]"},
              "hidden_states": {"dtype": "BF16", "shape": [3, 2, 4], "data_offsets": [0, 48]},
              "token_ids": {"dtype": "I64", "shape": [3], "data_offsets": [48, 72]}}
    raw = json.dumps(header).encode()
    path = tmp_path / "f.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(72))
    tensors, meta = loadgen.safetensors_header(str(path))
    assert tensors["hidden_states"]["shape"] == [3, 2, 4]
    assert meta == {"layer_ids": "[2, 4]"}


def test_short_gpu_name():
    assert cli.short_gpu("NVIDIA H200") == "h200"
    assert cli.short_gpu("NVIDIA H100 80GB HBM3") == "h100"
    assert cli.short_gpu("NVIDIA RTX PRO 6000 Blackwell Server Edition") == "rtxpro6000"


def rehearse(tmp_path, *extra, models="deepseek-tiny", timeout=120, drop_env=()):
    """``python -m bench --quick`` on ``models`` against tests/fake_sglang_server.py (``extra`` may
    add the fake vLLM: tests/benchmark/test_bench_peer.py), deadline and process timeout
    ``timeout`` seconds, without the environment variables ``drop_env``; returns (process,
    out dir, dump root, results JSON path)."""
    import os
    import socket

    pytest.importorskip("requests")
    ports = []
    for _ in range(5):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    out, work, shm = tmp_path / "out", tmp_path / "work", tmp_path / "shm"
    shm.mkdir()
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(BENCH.parent / "tests"), str(BENCH.parent)])}
    for name in drop_env:
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--server-module", "fake_sglang_server",
         "--no-build", "--skip-ceilings", "--models", models,
         "--out", str(out), "--workdir", str(work), "--dump-root", str(shm),
         "--ports", ",".join(map(str, ports)), "--deadline-s", str(timeout), "--case", "rehearsal", *extra],
        capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [res_path] = out.glob("*-rehearsal.json")
    return proc, out, shm, res_path


def test_fake_server_names_files_as_the_patched_server(tmp_path):
    """tests/fake_sglang_server.py names each file from the request's rid (format.reserve),
    so ``extract`` takes every answer: it named them ``req-N``, and extract stopped at the
    first one (exit 3, not the server's name for the request)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dump, data = tmp_path / "dump", tmp_path / "data.jsonl"
    dump.mkdir(mode=0o700)
    data.write_text("".join(json.dumps({"input_ids": list(range(i, i + 3 + i))}) + "\n" for i in range(3)))
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    server = subprocess.Popen([sys.executable, str(REPO / "tests" / "fake_sglang_server.py"), "--port", str(port),
                               "--dump-hidden-states-dir", str(dump)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().startswith("Memory pool end")
        for early in ([], ["--no-early-answers"]):
            out = tmp_path / f"out{len(early)}"
            done = subprocess.run([sys.executable, "-m", "sglang_ext", "extract", "--data", str(data), "--out",
                                   str(out), "--endpoint", f"http://127.0.0.1:{port}", *early],
                                  env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr[-2000:]
            assert sorted(p.name for p in out.glob("hs_*")) == [f"hs_{i}.safetensors" for i in range(3)]
    finally:
        server.kill()
        server.wait()
    assert sorted(p.name for p in dump.iterdir()) == [], "files, locks or temporaries left in the dump directory"


def test_rehearsal_against_a_fake_server(tmp_path):
    """The bench end to end on a CPU: start two (fake) servers, warm up, every cell, the
    dump files' bytes, the JSON bytes, the log's writer peak, results JSON + Markdown."""
    proc, out, shm, res_path = rehearse(
        tmp_path, "--prompt-lens", "16,2048", "--concurrency", "1,8", "--cell-tokens", "256")
    res = json.loads(res_path.read_text())
    m = res["models"]["deepseek-tiny"]
    cells = {(c["mode"], c["prompt_len"], c["concurrency"]): c for c in m["cells"]}
    assert len(cells) == 13 and not any(c.get("error") for c in cells.values()), m["cells"]
    d = cells[("dump", 2048, 8)]
    assert d["requests"] == 8 and d["files"] == 8
    # fake files: 8 x (2048 x 4 x 64 x 2 + 2048 x 8 + header)
    assert 8 * 2048 * (4 * 64 * 2 + 8) < d["file_bytes"] < 8 * (2048 * (4 * 64 * 2 + 8) + 1024)
    assert d["file_check"]["hidden_states"]["shape"] == [2048, 4, 64]
    assert d["file_check"]["layer_ids"] == "[1, 2, 3, 4]"
    assert cells[("dump", 16, 1)]["requests"] == 16  # 256 tokens / 16
    # early answers: the fake writes each file 50 ms after answering; the cell's wall time
    # ends when every file is complete, so all 16 are there and counted
    e = cells[("dump_early", 16, 1)]
    assert e["files"] == 16 and e["wall_s"] >= 0.05
    # ...and the last file is written 50 ms after the last answer: the cell's drain. The
    # fake's 50 ms begin before its answer leaves it and the client stamps the answer once
    # read, so the drain is 50 ms less that transit (a CI run saw 49.998 ms): 10 ms allowed
    assert 0.04 <= e["drain_s"] < e["wall_s"] and cells[("nodump", 16, 1)]["drain_s"] < 0.04
    assert e["file_bytes"] == cells[("dump", 16, 1)]["file_bytes"]
    j = cells[("json", 2048, 8)]
    assert j["requests"] == 8 and j["json_check"] == [1, 2048, 8] and j["response_bytes"] > 8 * 2048 * 8 * 5
    assert m["host_memory"]["log_host_bytes_peak"] == 2048 * 4 * 64 * 2
    assert m["host_memory"]["rss_peak_bytes"] >= m["host_memory"]["rss_baseline_bytes"] > 0
    assert res["headline"]["deepseek-tiny"]["dump_vs_json"] is not None
    assert list(shm.iterdir()) == []  # dump directory removed
    assert (out / res_path.name.replace(".json", ".md")).exists()
    assert (out / "server-deepseek-tiny-B.log").exists()
    assert "dump/nodump min" in proc.stdout


def test_rehearsal_with_the_control_and_counterbalanced_rounds(tmp_path):
    """(a') runs on server A in the grid, odd rounds reversed; the results carry its noise
    floor and the pooled table."""
    proc, out, shm, res_path = rehearse(
        tmp_path, "--prompt-lens", "16", "--concurrency", "1", "--cell-tokens", "64",
        "--modes", "nodump,dump,nodump_again", "--repeat", "2", "--counterbalance")
    res = json.loads(res_path.read_text())
    cells = res["models"]["deepseek-tiny"]["cells"]
    forward = ["nodump", "dump", "nodump_again"]
    assert [(c["rep"], c["mode"]) for c in cells] == [(0, m) for m in forward] + [(1, m) for m in forward[::-1]]
    assert not any(c.get("error") for c in cells), cells
    assert [c.get("files") for c in cells if c["mode"] == "dump"] == [4, 4]
    assert sum(1 for f in shm.rglob("*.safetensors")) == 0  # each cell's files removed after it
    h = res["headline"]["deepseek-tiny"]
    assert h["nodump_again_vs_nodump_min"] > 0
    assert {x["mode"] for x in h["pooled"]} == {"dump", "nodump_again"}
    assert res["config"]["counterbalance"] is True
    md = (out / res_path.name.replace(".json", ".md")).read_text()
    assert "| prompt | conc | rounds | dump | nodump_again |" in md and "noise floor" in md


def test_ceilings_phase_runs_on_cpu(tmp_path):
    """The ceilings sub-program (``python -m bench.ceilings``: safetensors writes from
    threads, DumpWriter start/copy_rows/finish) on CPU tensors: without CUDA the copy
    ceiling is skipped; the numbers mean nothing here, the accounting does. Its thread
    count is KIMI_SGLANG_WRITER_THREADS's, read as the server reads it."""
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    import os

    sizes = [{"model": "m", "prompt_len": 64, "rows": 64, "layers": 4, "hidden": 32,
              "layer_ids": [2, 4, 5, 8], "num_layers": 8, "chunk": 8192}]
    part = tmp_path / "part.json"
    env = os.environ | {"PYTHONPATH": str(BENCH.parent), "KIMI_SGLANG_WRITER_THREADS": "2",
                        "CUDA_VISIBLE_DEVICES": ""}
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"sizes": sizes, "reps": 2, "ceiling_mib": 1, "root": str(tmp_path)}))
    proc = subprocess.run([sys.executable, "-m", "bench.ceilings", str(job), str(part)], capture_output=True,
                          text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = json.loads(part.read_text())
    assert out["cuda"] is False and "d2h_pinned_gbps" not in out and out["writer_threads"] == 2
    hs = 64 * 4 * 32 * 2
    [(size, gbps)] = out["shm_write_gbps"].items()
    assert hs + 64 * 8 < int(size) < hs + 64 * 8 + 1024 and gbps > 0
    w = out["writer_alone"]["m"]["64"]
    # ceil(1 MiB / (16384 + 512) bytes) = 63 files per repetition, none failed
    assert w["files_per_rep"] == 63 and w["failures"] == 0 and len(w["gbps_reps"]) == 2
    assert hs < w["file_bytes"] <= hs + 64 * 8 + 4096  # header padded to format.DATA_ALIGN
    assert not (tmp_path / "kimi-bench-ceiling").exists()


def test_stage_stats_joins_file_and_response_events():
    """Two files (hand-made trace lines): per-stage medians in ms, the response wait,
    the poll lag, the share of files complete before their request finished."""
    ev = [
        {"event": "hook", "reqs": 2, "t0": 0.0, "t_take": 0.0005, "t_copy": 0.0015, "t1": 0.002},
        {"event": "file", "name": "a.safetensors", "t_start": 0.0, "t_submit": 0.001, "t_picked": 0.002,
         "t_copied": 0.004, "t_written": 0.014, "t_released": 0.015},
        {"event": "file", "name": "b.safetensors", "t_start": 0.0, "t_submit": 0.001, "t_picked": 0.011,
         "t_copied": 0.013, "t_written": 0.043, "t_released": 0.044},
        {"event": "response", "name": "a.safetensors", "t_meta": 0.020, "t_done": 0.021},
        {"event": "response", "name": "b.safetensors", "t_meta": 0.020, "t_done": 0.046},
    ]
    st = report.stage_stats(ev, wall_s=0.1)
    assert st["files"] == 2
    assert st["queue"]["p50"] == pytest.approx(5.5) and st["write"]["p50"] == pytest.approx(20.0)
    assert st["d2h"]["p50"] == pytest.approx(2.0) and st["file"]["p99"] == pytest.approx(42.71, abs=0.01)
    assert st["response_wait"]["p50"] == pytest.approx(13.5)
    assert st["poll_lag"]["p50"] == pytest.approx(4.0)
    assert st["ready_before_response"] == 0.5
    assert st["hook"]["p50"] == pytest.approx(2.0) and st["hook_share"] == pytest.approx(0.02)
    # the hook's parts: names reserved, copies enqueued, the message sent
    assert [st[k]["p50"] for k in ("hook_take", "hook_copy", "hook_send")] == pytest.approx([0.5, 1.0, 0.5])
    assert report.stage_stats([{"event": "hook", "t0": 0, "t1": 1}]) == {}
    # a trace from before the parts were recorded: the hook alone
    old = report.stage_stats([{**e, "t_take": None, "t_copy": None} if e["event"] == "hook" else e for e in ev])
    assert old["hook"]["p50"] == pytest.approx(2.0) and "hook_take" not in old


def test_plot_pools_the_rounds_of_a_shape():
    """The plot's bar of a shape run in several rounds is their tokens over their wall
    seconds (not the last round's drawn over the others)."""
    from bench.report import shape_tps

    cells = [{"mode": "nodump", "prompt_len": 2048, "concurrency": 8, "prompt_tokens": 1000, "wall_s": 1.0,
              "prefill_tps": 1000.0},
             {"mode": "nodump", "prompt_len": 2048, "concurrency": 8, "prompt_tokens": 1000, "wall_s": 3.0,
              "prefill_tps": 333.3},
             {"mode": "dump", "prompt_len": 2048, "concurrency": 8, "prompt_tokens": 500, "wall_s": 1.0,
              "prefill_tps": 500.0}]
    assert shape_tps(cells, "nodump") == {(2048, 8): pytest.approx(500.0)}
    assert shape_tps(cells, "dump") == {(2048, 8): pytest.approx(500.0)}
    assert shape_tps(cells, "json") == {}


def test_rehearsal_fp8_cells_report_half_the_bytes_per_token(tmp_path):
    """mode dump_fp8 runs on a fourth server (D, --dump-hidden-states-dtype fp8) beside
    dump on B; the cells report bytes per prompt token and the headline their ratio."""
    proc, out, shm, res_path = rehearse(
        tmp_path, "--prompt-lens", "2048", "--concurrency", "8", "--cell-tokens", "16384",
        "--modes", "nodump,dump,dump_fp8")
    res = json.loads(res_path.read_text())
    m = res["models"]["deepseek-tiny"]
    assert "--dump-hidden-states-dtype" not in m["servers"]["B"]
    d = m["servers"]["D"]
    assert d[d.index("--dump-hidden-states-dtype") + 1] == "fp8"
    assert d[d.index("--dump-hidden-states-dir") + 1].endswith("-fp8")
    cells = {c["mode"]: c for c in m["cells"]}
    assert set(cells) == {"nodump", "dump", "dump_fp8"} and not any(c.get("error") for c in cells.values())
    f8, bf = cells["dump_fp8"], cells["dump"]
    assert f8["file_check"]["hidden_states"]["dtype"] == "F8_E4M3"
    assert f8["file_check"]["hidden_states_scales"]["shape"] == [2048, 4, 1]
    # the fake's files, 4 layers x 64: bf16 512 + 8 B/token; fp8 256 + 16 (scales) + 8, + headers
    assert 520 < bf["bytes_per_token"] < 521 and 280 < f8["bytes_per_token"] < 281
    h = res["headline"]["deepseek-tiny"]
    assert h["fp8_vs_bf16_bytes_per_token_max"] == pytest.approx(f8["bytes_per_token"] / bf["bytes_per_token"])
    assert h["dump_fp8_vs_nodump_min"] is not None
    assert list(shm.iterdir()) == []  # both dump directories removed
    assert (out / "server-deepseek-tiny-D.log").exists()
    assert "B/token" in proc.stdout


def test_kv_pool_read_from_both_engines_logs_and_a_short_one_is_said():
    """The KV pool each server states in its log (SGLang 0.5.23 and vLLM 0.33, lines from
    the H200 logs) is recorded, and the Markdown says where a cell's tokens in flight exceed
    it (B started after A got 57590 tokens: 2k x 32 sends 65536 at once)."""
    from bench import servers

    assert servers.kv_tokens("[2026-12-01 21:57:58] KV Cache is allocated. dtype: torch.bfloat16, "
                             "#tokens: 57590, K size: 3.52 GB, V size: 3.52 GB") == 57590
    assert servers.kv_tokens("(EngineCore pid=2194) INFO 12-01 21:41:50 [kv_cache_utils.py:1147] GPU KV cache "
                             "size: 94,272 tokens, Maximum concurrency for 16,384 tokens per request: 5.75x") == 94272
    assert servers.kv_tokens("Memory pool end. avail mem=1.00 GB") is None
    m = {"cells": [{"prompt_len": 2048, "concurrency": 32, "mode": "dump", "requests": 32, "prefill_tps": 4e4}],
         "kv_tokens": {"A": 104806, "B": 57590, "V": 94272, "W": None}}
    lines = [ln for ln in markdown._model("llama-8b", m, {}) if "KV pool" in ln]
    assert lines == ["- KV pool (tokens): A 104806, B 57590, V 94272; the largest cell sends 65536 prompt "
                     "tokens at once, more than the pool of B (requests wait for KV there; each frees "
                     "its own after its prefill)"], lines
    m["cells"][0]["concurrency"] = 8
    assert [ln for ln in markdown._model("llama-8b", m, {}) if "KV pool" in ln] == [
        "- KV pool (tokens): A 104806, B 57590, V 94272"]


def test_a_cell_needs_twice_its_shapes_longest_measured_run():
    """Before its shape has run, a cell needs twice the plan's estimate plus 15 s before
    the deadline; after, twice the longest error-free wall time of its shape (any mode
    but json), so a run whose cells go faster than assumed starts more of them."""
    cell = {"mode": "dump_early", "prompt_len": 2048, "concurrency": 8, "est_s": 7.7}
    done = [{"mode": "nodump", "prompt_len": 2048, "concurrency": 8, "wall_s": 3.0},
            {"mode": "dump_early", "prompt_len": 2048, "concurrency": 8, "wall_s": 3.9},
            {"mode": "dump", "prompt_len": 2048, "concurrency": 8, "wall_s": 60.0, "error": "x"},
            {"mode": "json", "prompt_len": 2048, "concurrency": 8, "wall_s": 90.0},
            {"mode": "nodump", "prompt_len": 512, "concurrency": 8, "wall_s": 14.2}]
    assert plan.cell_need_s(cell, []) == pytest.approx(2 * 7.7 + 15)
    assert plan.cell_need_s(cell, done) == pytest.approx(2 * 3.9 + 15)
    assert plan.cell_need_s(dict(cell, prompt_len=512), done) == pytest.approx(2 * 14.2 + 15)
    assert plan.cell_need_s(dict(cell, mode="json"), done) == pytest.approx(2 * 7.7 + 15)
