"""Plot a results JSON (``python -m bench``'s output) to a PNG, on any machine with matplotlib.

    python -m bench.plot RESULTS.json [-o out.png] [--markdown]

Top row, per model: prefill tokens/s per (prompt length, concurrency) and mode (vLLM's
hatched), with each cell's hardware bound W/B as a marker. Bottom row: each dump mode's
(b)/min((a), W/B) against the 0.95 target (the lowest over rounds) and, where vLLM ran, its
(b) over ours (black diamonds)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from bench import markdown, modes, report, targets

# drawn: the modes with a label (bench/modes.py), in its order; the peer's bars: our colours, hatched
MODES = tuple(m.name for m in modes.MODES if m.label)
COLORS = {m.name: m.color for m in modes.MODES if m.label}
LABELS = {m.name: m.label for m in modes.MODES if m.label}
STYLE = {m.name: {"hatch": "//", "edgecolor": "white"} for m in modes.MODES if m.peer}
RATIOS = tuple((m.name, m.ratio_label) for m in modes.MODES if m.ratio_label)


def _label(prompt_len, concurrency):
    """'2k/8' for 2048 tokens at concurrency 8, '512/1' below 1k."""
    p = f"{prompt_len // 1024}k" if prompt_len >= 1024 and prompt_len % 1024 == 0 else str(prompt_len)
    return f"{p}/{concurrency}"


def plot(results: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    head = results.get("headline") or report.headline(results)
    # prefill cells only: generate cells (output tokens/s) are the Markdown's
    models = [m for m, v in results.get("models", {}).items()
              if any(not modes.is_gen(c.get("mode")) for c in v.get("cells", []))]
    if not models:
        raise ValueError("no model with measured cells in these results (the plot draws prefill cells; "
                         "generate cells are in the Markdown)")
    fig, axes = plt.subplots(2, len(models), figsize=(7 * len(models), 8), squeeze=False)
    for j, model in enumerate(models):
        cells = [c for c in results["models"][model]["cells"] if not c.get("error") and not modes.is_gen(c["mode"])]
        keys = sorted({(c["prompt_len"], c["concurrency"]) for c in cells})
        x = {k: i for i, k in enumerate(keys)}
        ax = axes[0][j]
        shown = [mode for mode in MODES if any(c["mode"] == mode for c in cells)]
        bars = {mode: report.shape_tps(cells, mode) for mode in shown}
        width = 0.8 / max(len(shown), 1)
        for k, mode in enumerate(shown):
            pts = [(x[key], tps) for key, tps in bars[mode].items()]
            ax.bar([p[0] + (k - (len(shown) - 1) / 2) * width for p in pts], [p[1] for p in pts],
                   width, label=LABELS[mode], color=COLORS[mode], **STYLE.get(mode, {}))
        hc = [c for c in head.get(model, {}).get("cells", [])
              if c.get("w_tps") and c.get("mode", "dump") == "dump"]
        if hc:
            ax.scatter([x[(c["prompt_len"], c["concurrency"])] for c in hc],
                       [c["w_tps"] for c in hc], marker="_", s=400, color="k", label="W/B bound")
        # log only where the bars span orders of magnitude (the JSON path's ~1k tokens/s
        # beside ~40k): on a narrow range a log axis cut above zero makes 0.8x look like 0.1x
        drawn = [t for b in bars.values() for t in b.values()] + [c["w_tps"] for c in hc]
        if drawn and max(drawn) > 10 * min(drawn):
            ax.set_yscale("log")
        ax.set_xticks(range(len(keys)), [_label(p, c) for p, c in keys], rotation=45)
        ax.set_xlabel("prompt tokens / concurrency")
        ax.set_ylabel("prefill prompt tokens/s")
        alone = results["models"][model].get("peer_unsupported")
        ax.set_title(f"{model}" + (" (ours alone: vLLM has no MLA support)" if alone else ""))
        ax.legend(fontsize=8)
        ax = axes[1][j]
        hcells = head.get(model, {}).get("cells", [])
        ratios = [(mode, label) for mode, label in RATIOS
                  if any(c.get("mode", "dump") == mode and c.get("dump_vs_bound") is not None for c in hcells)]
        rw = 0.8 / max(len(ratios), 1)
        drawn_ratios = []
        for k, (mode, label) in enumerate(ratios):
            r = {}
            for c in hcells:  # one bar per shape: its (b)/bound, the lowest over the rounds
                if c.get("mode", "dump") == mode and c.get("dump_vs_bound") is not None:
                    key = (c["prompt_len"], c["concurrency"])
                    r[key] = min(r.get(key, c["dump_vs_bound"]), c["dump_vs_bound"])
            r = [(x[key], v) for key, v in r.items()]
            drawn_ratios += [v for _, v in r]
            ax.bar([p[0] + (k - (len(ratios) - 1) / 2) * rw for p in r], [p[1] for p in r], rw,
                   color=COLORS[mode], label=label, **STYLE.get(mode, {}))
        # the peer's own dump throughput over ours, shape by shape (vLLM's modes ran)
        pr = [(x[(p["prompt_len"], p["concurrency"])], p["dump_vllm_vs_ours"])
              for p in head.get(model, {}).get("peer", [])
              if p.get("dump_vllm_vs_ours") is not None and (p["prompt_len"], p["concurrency"]) in x]
        if pr:
            ax.scatter([p[0] for p in pr], [p[1] for p in pr], marker="D", color="k", zorder=3,
                       label="(b) vLLM / (b) ours")
        if ratios:  # the target is the dump's against its bound, not the engines' ratio
            ax.axhline(targets.TARGET_DUMP_VS_BOUND, color="k", ls="--", lw=1, label="0.95 target")
        ax.set_ylim(0, max([1.2] + [v + 0.05 for v in drawn_ratios]))
        ax.set_xticks(range(len(keys)), [_label(p, c) for p, c in keys], rotation=45)
        ax.set_ylabel("dump throughput ratio")
        ax.legend(fontsize=8)
    fig.suptitle(f"hidden-state dump, {results.get('gpu', '?')}, {results.get('date', '?')[:10]}, "
                 f"profile {results.get('profile', '?')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results")
    ap.add_argument("-o", "--output", help="PNG path (default: the JSON's, .png)")
    ap.add_argument("--markdown", action="store_true",
                    help="also (re)write the Markdown table next to the JSON")
    args = ap.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    out = args.output or os.path.splitext(args.results)[0] + ".png"
    print(plot(results, out))
    if args.markdown:
        md = os.path.splitext(args.results)[0] + ".md"
        with open(md, "w") as f:
            f.write(markdown.render_markdown(results))
        print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
