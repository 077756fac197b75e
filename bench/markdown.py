"""A results file as Markdown (``render_markdown``: the ``.md`` beside each JSON) and as
the short plain-text table printed last (``summary_table``). The numbers come from
``report`` and ``targets``; a results file without ``headline`` or ``targets`` gets them computed.
"""

from __future__ import annotations

from typing import List

from bench.modes import MODES, is_gen, names
from bench.report import DUMP_MODES, HOOK_STAGES, STORE_MODES, gen_ratios, headline, mib, num
from bench.targets import targets


EARLY_MODES = names(early=True)


def render_markdown(results: dict) -> str:
    """The results as Markdown: ceilings, one table per model, ratios, the stages, targets."""
    head = results.get("headline") or headline(results)
    tgt = results.get("targets") or targets(results, head)
    lines = [
        f"# Hidden-state dump benchmark: {results.get('gpu', '?')}, {results.get('date', '?')}"
        f" (profile {results.get('profile', '?')})",
        "",
    ]
    lines += _ceilings(results.get("ceilings", {}))
    for model, m in results.get("models", {}).items():
        lines += _model(model, m, head.get(model, {}))
    lines += _peer(results, head)
    lines += _stages(results)
    lines += _store(results)
    lines += ["", "## Targets", "", "| model | target | value | pass |", "|---|---|---:|---|"]
    for t in tgt:
        v = t["value"]
        shown = mib(v) if "memory" in t["target"] else num(v, "{:.3f}")
        ok = {True: "PASS", False: "FAIL", None: "not measured"}[t["pass"]]
        lines.append(f"| {t['model']} | {t['target']} | {shown} | {ok} |")
    if results.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in results["notes"]]
    skipped = results.get("skipped") or []
    if skipped:
        lines += ["", "Skipped: " + "; ".join(skipped)]
    return "\n".join(lines) + "\n"


def _ceilings(ceil: dict) -> List[str]:
    lines = ["## Ceilings", "", f"- pinned device-to-host copy: {num(ceil.get('d2h_pinned_gbps'), '{:.1f}')} GB/s",
             f"- /dev/shm write, safetensors, {ceil.get('writer_threads', '?')} threads:"]
    for size, gbps in sorted(ceil.get("shm_write_gbps", {}).items(), key=lambda kv: float(kv[0])):
        lines.append(f"  - files of {float(size) / (1 << 20):.1f} MiB: {gbps:.1f} GB/s")
    for model, by_len in ceil.get("writer_alone", {}).items():
        for plen, wr in sorted(by_len.items(), key=lambda kv: int(kv[0])):
            lines.append(f"- writer alone, {model}, {plen}-token files ({wr['file_bytes'] / (1 << 20):.1f} MiB): "
                         f"{num(wr.get('gbps'), '{:.1f}')} GB/s")
    return lines


ORDER = {m.name: i for i, m in enumerate(MODES)}  # within a round: bench/modes.py


def _r3(x) -> str:
    return num(x, "{:.3f}")


def _model(model: str, m: dict, h: dict) -> List[str]:
    """One model's cells, its ratios, file check, host memory."""
    by_cell = {(c.get("mode", "dump"), c["prompt_len"], c["concurrency"], c.get("rep")): c for c in h.get("cells", [])}
    drained = any("drain_s" in c for c in m.get("cells", []))  # runs since the drain was measured
    title = ["", f"## {model} (hidden {m.get('hidden_size', '?')}, layers {m.get('layer_ids', '?')})"]
    prefill = [c for c in m.get("cells", []) if not is_gen(c.get("mode"))]
    generate = [c for c in m.get("cells", []) if is_gen(c.get("mode"))]
    if generate and not prefill:  # a run of generate modes alone
        return title + _gen(generate, h) + _model_tail(m)
    lines = title + ["",
             "The last two columns divide the row's tokens/s (a dump's (b)) by (a) of its round and by min((a), W/B)."
             + (" drain: the cell's wall time after its last answer (early answers: the last files' (or samples')"
                " write)." if drained else ""), "",
             "| prompt | conc | mode | reqs | prefill tok/s | p50 s | p99 s | " + ("drain ms | " if drained else "")
             + "GB/s written | JSON MB/resp | row/(a) | row/bound |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if drained else "")]
    for c in sorted(prefill, key=lambda c: (c["prompt_len"], c["concurrency"], c.get("rep") or 0,
                                            ORDER.get(c["mode"], len(ORDER)))):
        head = f"| {c['prompt_len']} | {c['concurrency']} | {c['mode']}" + (f" #{c['rep']}" if "rep" in c else "")
        if c.get("error"):
            lines.append(f"{head} | ERROR: {c['error'][:80]} |||||||||" + ("|" if drained else ""))
            continue
        hc = by_cell.get((c["mode"], c["prompt_len"], c["concurrency"], c.get("rep")), {})
        json_mb = (c["response_bytes"] / c["requests"] / 1e6) if c.get("response_bytes") else None
        drain = c["drain_s"] * 1e3 if c.get("drain_s") is not None else None
        lines.append(f"{head} | {c['requests']} | {num(c.get('prefill_tps'))} | {_r3(c.get('p50_s'))} | "
                     f"{_r3(c.get('p99_s'))} | " + (f"{num(drain, '{:.1f}')} | " if drained else "")
                     + f"{num(c.get('write_gbps'), '{:.2f}')} | {num(json_mb, '{:.1f}')} | "
                     f"{_r3(hc.get('dump_vs_nodump'))} | {_r3(hc.get('dump_vs_bound'))} |")
    lines += ["", f"- dump_vs_nodump: min {_r3(h.get('dump_vs_nodump_min'))}, geometric mean "
              f"{_r3(h.get('dump_vs_nodump_geomean'))}"
              + (f"; early answers (dump_early): min {_r3(h.get('dump_early_vs_nodump_min'))}, geometric mean "
                 f"{_r3(h.get('dump_early_vs_nodump_geomean'))}" if h.get("dump_early_vs_nodump_min") is not None
                 else "")]
    if h.get("nodump_again_vs_nodump_min") is not None:
        lines.append(f"- no change at all ((a') = server A again in the same round, over (a)): "
                     f"{_r3(h['nodump_again_vs_nodump_min'])} to {_r3(h.get('nodump_again_vs_nodump_max'))}: "
                     "this run's noise floor")
    lines += _pooled(h.get("pooled") or [])
    lines += [f"- {mode}_vs_nodump: min {_r3(h[f'{mode}_vs_nodump_min'])} (at concurrency >= 8: "
              f"{_r3(h.get(f'{mode}_vs_nodump_min_conc8'))}), geometric mean {_r3(h.get(f'{mode}_vs_nodump_geomean'))}"
              for mode in STORE_MODES if h.get(f"{mode}_vs_nodump_min") is not None]
    lines += [f"- dump_vs_json (2k, conc 8): {num(h.get('dump_vs_json'), '{:.1f}')}x",
              f"- writer_vs_ceiling (2k files): {num(h.get('writer_vs_ceiling'), '{:.2f}')}"]
    return lines + (_gen(generate, h) if generate else []) + _model_tail(m)


def _gen(cells: List[dict], h: dict) -> List[str]:
    """A model's generate cells (bench/gen.py) and issue 49's ratios, pooled per shape."""
    lines = ["", "Generate cells: each request generates the cell's tokens (ignore_eos, greedy; decode in CUDA "
             "graphs); (g) no dump, (g out) its output rows in the same request, (g 2p) generate on A then "
             "capture prompt + generated ids on B. Output tok/s: generated tokens over the cell's wall; "
             "s/sample: the wall over its requests; the files checked hold P + G - 1 rows (one pass), "
             "P + G (two).", "",
             "| prompt | conc | mode | reqs | gen tokens | output tok/s | s/sample | p50 s | p99 s | "
             "2p: generate / capture p50 s | files checked |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for c in sorted(cells, key=lambda c: (c["prompt_len"], c["concurrency"], c.get("rep") or 0,
                                          ORDER.get(c["mode"], len(ORDER)))):
        head = f"| {c['prompt_len']} | {c['concurrency']} | {c['mode']}" + (f" #{c['rep']}" if "rep" in c else "")
        if c.get("error"):
            lines.append(f"{head} | ERROR: {c['error'][:120]} |||||||")
            continue
        steps = (f"{_r3(c.get('generate_p50_s'))} / {_r3(c.get('capture_p50_s'))}"
                 if "capture_p50_s" in c else "")
        lines.append(f"{head} | {c['requests']} | {c.get('gen_tokens', '-')} | {num(c.get('output_tps'))} | "
                     f"{_r3(c['wall_s'] / c['requests'] if c.get('wall_s') else None)} | {_r3(c.get('p50_s'))} | "
                     f"{_r3(c.get('p99_s'))} | {steps} | {c.get('rows_checked', '-')} |")
    rows = h.get("gen") or gen_ratios(cells)
    lines += ["", "| prompt | conc | (g out)/(g) output tok/s | rounds | (g 2p)/(g out) wall per sample | rounds |",
              "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {x['prompt_len']} | {x['concurrency']} | {_r3(x['output_vs_nodump'])} | "
              f"{x['rounds_output_vs_nodump']} | {_r3(x['two_pass_vs_one_pass'])} | "
              f"{x['rounds_two_pass_vs_one_pass']} |" for x in rows]
    return lines + [""]


def _model_tail(m: dict) -> List[str]:
    """A model's file check, error, KV pool and host memory lines."""
    lines = []
    if fc := m.get("file_check"):
        lines.append(f"- dump files: hidden_states {fc.get('hidden_states')}, layer_ids {fc.get('layer_ids')}")
    if m.get("error"):
        lines.append(f"- ERROR: {m['error'][:300]}")
    if kv := {w: n for w, n in (m.get("kv_tokens") or {}).items() if n}:
        most = max((c["prompt_len"] * c["concurrency"] for c in m.get("cells", []) if not c.get("error")), default=0)
        short = [w for w, n in kv.items() if n < most]
        lines.append("- KV pool (tokens): " + ", ".join(f"{w} {n}" for w, n in sorted(kv.items()))
                     + (f"; the largest cell sends {most} prompt tokens at once, more than the pool of "
                        f"{', '.join(short)} (requests wait for KV there; each frees its own after its prefill)"
                        if short else ""))
    if mem := m.get("host_memory", {}):
        lines.append(f"- host memory: writer budget peak {mib(mem.get('log_host_bytes_peak'))}, pinned pool peak "
                     f"{mib(mem.get('log_pinned_pool_peak'))}, server RSS growth {mib(mem.get('rss_delta_bytes'))} "
                     f"(without dump: {mib(mem.get('rss_delta_bytes_nodump'))}), cap {mib(mem.get('cap_bytes'))}")
    if "rss_delta_bytes_vllm_dump" in mem or "rss_delta_bytes_vllm_nodump" in mem:
        lines.append(f"- vLLM's host memory: server RSS growth {mib(mem.get('rss_delta_bytes_vllm_dump'))} with "
                     f"extraction (without: {mib(mem.get('rss_delta_bytes_vllm_nodump'))}); it has no cap of its "
                     "own (pinned buffers per request, cached by torch's host allocator)")
    return lines


def _pooled(pooled: List[dict]) -> List[str]:
    """The pooled ratios (report.pooled_ratios) as a table: a row per shape, a column per mode."""
    if not pooled:
        return []
    shown = [m for m in ORDER if any(x["mode"] == m for x in pooled)]
    shapes = sorted({(x["prompt_len"], x["concurrency"]) for x in pooled})
    by = {(x["mode"], x["prompt_len"], x["concurrency"]): x for x in pooled}
    # early answers again, each cell up to its last answer (its final drain aside)
    answered = [m for m in EARLY_MODES if m in shown
                and any(x.get("vs_nodump_to_last_answer") is not None for x in pooled if x["mode"] == m)]
    lines = ["", "Pooled over the rounds (a shape's tokens over its seconds, every round, over (a)'s"
             " likewise; (a') is no change at all"
             + ("; a mode's rounds are those its base ran too" if any(
                 len({by[(m, p, c)]["rounds"] for m in shown if (m, p, c) in by}) > 1 for p, c in shapes) else "")
             + ("; \"to last answer\": both sides' seconds up to each cell's last answer, the"
                " final drain of the early answers' last files aside" if answered else "") + "):", "",
             "| prompt | conc | rounds | " + " | ".join(shown + [f"{m} to last answer" for m in answered]) + " |",
             "|---:|---:|---:|" + "---:|" * (len(shown) + len(answered))]
    for plen, conc in shapes:
        counts = sorted({by[(m, plen, conc)]["rounds"] for m in shown if (m, plen, conc) in by})
        rounds = f"{counts[0]}-{counts[-1]}" if len(counts) > 1 else counts[0]  # paired per mode
        cols = [_r3(by.get((m, plen, conc), {}).get("vs_nodump")) for m in shown]
        cols += [_r3(by.get((m, plen, conc), {}).get("vs_nodump_to_last_answer")) for m in answered]
        lines.append(f"| {plen} | {conc} | {rounds} | " + " | ".join(cols) + " |")
    return lines


def _peer(results: dict, head: dict) -> List[str]:
    """Side by side with vLLM: per model, each engine's dump/no-dump ratio and vLLM's
    tokens/s over ours per cell, the file comparison, and the models vLLM does not serve."""
    models = {k: m for k, m in results.get("models", {}).items()
              if head.get(k, {}).get("peer") or m.get("peer_unsupported") or m.get("peer_files")}
    if not models:
        return []
    lines = ["", "## Side by side with vLLM (extract_hidden_states + ExampleHiddenStatesConnector)", "",
             "Both dumps count a request done when its file is complete; both engines without CUDA "
             "graphs, prefix cache off, the same chunk of tokens per forward (bench/README.md)."]
    for model, m in models.items():
        h = head.get(model, {})
        lines += ["", f"### {model}", ""]
        if m.get("peer_unsupported"):
            lines.append(f"- ours alone: {m['peer_unsupported']}")
        if h.get("peer"):
            lines += ["| prompt | conc | ours (b)/(a) | vLLM (b)/(a) | (a) vLLM/ours | (b) vLLM/ours |"
                      " ours B/token | vLLM B/token |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
            lines += [f"| {x['prompt_len']} | {x['concurrency']}" + (f" #{x['rep']}" if "rep" in x else "") + " | "
                      + " | ".join(_r3(x[k]) for k in ("ours_dump_vs_nodump", "vllm_dump_vs_nodump",
                                                       "nodump_vllm_vs_ours", "dump_vllm_vs_ours"))
                      + f" | {num(x['ours_bytes_per_token'])} | {num(x['vllm_bytes_per_token'])} |" for x in h["peer"]]
            lines += ["", f"- dump/no-dump, min / geometric mean: ours {_r3(h.get('dump_vs_nodump_min'))} / "
                      f"{_r3(h.get('dump_vs_nodump_geomean'))}, vLLM {_r3(h.get('vllm_dump_vs_nodump_min'))} / "
                      f"{_r3(h.get('vllm_dump_vs_nodump_geomean'))}",
                      f"- vLLM's dump tokens/s over ours: min {_r3(h.get('vllm_dump_vs_ours_dump_min'))}, geometric "
                      f"mean {_r3(h.get('vllm_dump_vs_ours_dump_geomean'))}"]
            if fc := next((c["file_check"] for c in m.get("cells", [])
                           if c.get("mode") == "vllm_dump" and c.get("file_check")), None):
                lines.append(f"- vLLM's files: keys {fc.get('keys')}, hidden_states {fc.get('hidden_states')}, "
                             f"token_ids {fc.get('token_ids')}")
        lines += _peer_files(m.get("peer_files"))
    return lines


def _per_id(layer_ids, values) -> str:
    """``id: value`` per layer id, e.g. "2: 1.5e-02, 16: 4.6e-02"."""
    return ", ".join(f"{k}: {v:.1e}" for k, v in zip(layer_ids or [], values))


def _peer_files(pf) -> List[str]:
    """The comparison of ours and vLLM's files for the same prompts (``bench.peerfiles``)."""
    if not pf:
        return []
    if pf.get("error"):
        return [f"- files compared: ERROR {pf['error'][:300]}"]
    tol = pf.get("tolerance", {})
    out = [f"- files compared ({pf.get('prompts')} prompts, lengths {pf.get('prompt_lens')}, layer ids "
           f"{pf.get('layer_ids')}): {'PASS' if pf.get('pass') else 'FAIL'} (relative error per request "
           f"<= {tol.get('block')}, per token row <= {tol.get('token')}); reference: {pf.get('reference')}"]
    if tol.get("slots"):
        out.append(f"  - tolerance with the reference: per layer id max({tol.get('block')}, {tol.get('factor')} x HF's "
                   f"own bf16 error there): "
                   + _per_id(pf.get("layer_ids"), tol["slots"])
                   + f"; per token row {num(tol.get('token_scaled'), '{:.1e}')}")
    for key, label in (("ours_vs_vllm", "ours vs vLLM"), ("ours_vs_ref", "ours vs reference"),
                       ("vllm_vs_ref", "vLLM vs reference"), ("hf_bf16_vs_ref", "HF bf16 vs reference")):
        e = pf.get(key)
        if e:
            out.append(f"  - {label}: block {num(e.get('block'), '{:.2e}')}, token row "
                       f"{num(e.get('token'), '{:.2e}')} ({e.get('token_where', '')})"
                       + (f"; per layer id {_per_id(pf.get('layer_ids'), e['slots'])}" if e.get("slots") else ""))
    out += [f"  - {p}" for p in pf.get("problems", [])]
    for key, label in (("reference_skipped", "HF reference skipped"), ("reference_error", "HF reference failed")):
        if pf.get(key):
            out.append(f"  - {label}: {pf[key][:300]}")
    return out


def _pair(d: dict) -> str:
    """A stage's "p50 / p99" in ms."""
    return num((d or {}).get("p50"), "{:.1f}") + " / " + num((d or {}).get("p99"), "{:.1f}")


def _stages(results: dict) -> List[str]:
    """"Where the time goes": per dump cell, the stage trace's p50 / p99."""
    rows = []
    cells_of = [(model, c) for model, m in results.get("models", {}).items() for c in m.get("cells", [])
                if (c.get("mode") in DUMP_MODES and c.get("mode") not in STORE_MODES or is_gen(c.get("mode")))
                and c.get("stages")]
    parts = any("hook_take" in c["stages"] for _, c in cells_of)  # traces since the hook's parts
    for model, c in cells_of:
        st = c["stages"]
        cells = [_pair(st.get(k)) for k in ("hook", "queue", "d2h", "write", "release", "response_wait", "poll_lag")]
        if parts:  # the hook's parts, p50 in ms, after the hook's own cell
            cells.insert(1, " / ".join(num(st.get(k, {}).get("p50"), "{:.2f}") for k, _, _ in HOOK_STAGES))
        note = "" if c["mode"] == "dump" else f" ({c['mode'].removeprefix('dump_')})"  # early, fp8...
        rows.append(f"| {model}{note} | {c['prompt_len']} | {c['concurrency']} | " + " | ".join(cells)
                    + f" | {num(st.get('hook_share'), '{:.2f}')} | {num(st.get('ready_before_response'), '{:.2f}')} |")
    if not rows:
        return []
    return ["", "## Where the time goes (dump cells, KIMI_SGLANG_TRACE; ms p50 / p99)", "",
            "| model | prompt | conc | hook (per batch) | " + ("hook: take / copy / send (p50) | " if parts else "")
            + "queue | d2h | write | release | response wait | poll lag | hook share | file ready first |",
            "|---|---:|---:|---|" + ("---|" if parts else "") + "---|---|---|---|---|---|---:|---:|"] + rows


def _store(results: dict) -> List[str]:
    """The store sink's cells: forward end to sample visible (the trace's ``visible``:
    Finish queued after the last rows -> put returned), its queue and put, the client's
    response-to-visible (``visible_ms``, mode dump_store) and the samples deleted."""
    rows = []
    for model, m in results.get("models", {}).items():
        for c in m.get("cells", []):
            if c.get("mode") not in STORE_MODES or c.get("error"):
                continue
            st, vis = c.get("stages") or {}, c.get("visible_ms") or {}
            rows.append(f"| {model} | {c['mode']}{' #' + str(c['rep']) if 'rep' in c else ''} | {c['prompt_len']} | "
                        f"{c['concurrency']} | {num(c.get('prefill_tps'))} | {_pair(st.get('visible'))} | "
                        f"{_pair(st.get('queue'))} | {_pair(st.get('put'))} | {_pair(vis)} | "
                        f"{num(vis.get('at_response'), '{:.2f}')} | {c.get('objects', '-')} | {c.get('removed', '-')} |")
    if not rows:
        return []
    return ["", "## Store sink: forward end to sample visible (ms p50 / p99)", "",
            "Forward end: the scheduler queued the request's Finish after its last rows (KIMI_SGLANG_TRACE); "
            "visible: the writer's put returned (Mooncake makes the key visible at its end). Client: the "
            "answer to `is_exist(handle)` true, polled every 2 ms (mode dump_store).", "",
            "| model | mode | prompt | conc | prefill tok/s | forward end -> visible | queue | put |"
            " client: answer -> visible | visible at answer | objects | deleted |",
            "|---|---|---:|---:|---:|---|---|---|---|---:|---:|---:|"] + rows


def summary_table(results: dict) -> str:
    """The short plain-text table printed last by the benchmark."""
    head = results.get("headline") or headline(results)
    tgt = results.get("targets") or targets(results, head)
    out = [f"{'model':14} {'dump/nodump min':>15} {'early min':>9} {'dump/json':>9} {'writer/W':>8}"]
    for model, h in head.items():
        out.append(f"{model:14} {_r3(h.get('dump_vs_nodump_min')):>15} {_r3(h.get('dump_early_vs_nodump_min')):>9} "
                   f"{num(h.get('dump_vs_json'), '{:.1f}'):>9} {num(h.get('writer_vs_ceiling'), '{:.2f}'):>8}")
        for mode in STORE_MODES:
            if h.get(f"{mode}_vs_nodump_min") is not None:
                out.append(f"{'':14} {mode}/nodump min {_r3(h[f'{mode}_vs_nodump_min'])}, at conc >= 8 "
                           f"{_r3(h.get(f'{mode}_vs_nodump_min_conc8'))}")
        if h.get("gen"):
            worst = {k: min((x[k] for x in h["gen"] if x[k] is not None), default=None)
                     for k in ("output_vs_nodump", "two_pass_vs_one_pass")}
            out.append(f"{'':14} generate: (g out)/(g) output tok/s min {_r3(worst['output_vs_nodump'])}, "
                       f"(g 2p)/(g out) wall per sample min {_r3(worst['two_pass_vs_one_pass'])}")
        if h.get("peer"):
            out.append(f"{'':14} vLLM: dump/nodump min {_r3(h.get('vllm_dump_vs_nodump_min'))}, "
                       f"its dump over ours min {_r3(h.get('vllm_dump_vs_ours_dump_min'))}")
    for model, m in results.get("models", {}).items():
        if m.get("peer_unsupported"):
            out.append(f"{model:14} ours alone: {m['peer_unsupported']}")
        pf = m.get("peer_files") or {}
        if pf:
            out.append(f"{model:14} files ours vs vLLM: "
                       + (f"ERROR {pf['error'][:200]}" if pf.get("error") else "PASS" if pf.get("pass") else "FAIL"))
    for t in tgt:
        ok = {True: "PASS", False: "FAIL", None: "n/a "}[t["pass"]]
        out.append(f"  {ok} {t['model']}: {t['target']}")
    return "\n".join(out)
