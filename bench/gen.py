"""The client side of a generate cell (issue 49, the modes with ``Mode.gen``): random prompts,
each generating ``gen_tokens`` tokens (``ignore_eos``, greedy), sent by ``concurrency``
client threads in a closed loop, and the files checked after the cell (not timed).

- ``gen_nodump`` (g), server A: SGLang's ``/generate`` with ``input_ids``.
- ``gen_output`` (g out), server B: the same with ``custom_params {"hidden_states_output":
  true}``; each response waits for its file, which must hold the prompt's rows then every
  generated token's but the last: P + G - 1 rows, ``token_ids`` the prompt then the answer's
  ``output_ids`` but the last (``sglang_ext.format.output``).
- ``gen_two_pass`` (g 2p), the field's recipe: generate on A, then send prompt + generated
  ids to B as ``input_ids`` (``max_new_tokens=1``) and wait for that file: P + G rows.
  A sample's latency is both requests'; ``generate_s`` and ``capture_s`` say which took what.

A cell's entry: ``output_tokens`` (generated, every request), ``output_tps`` (those over the
cell's wall seconds, first send to last answer), ``samples_per_s`` (requests over the wall),
``p50_s``/``p99_s`` per sample, ``files``/``file_bytes``/``rows_checked``; ``error`` when a
request failed, generated other than ``gen_tokens`` tokens or its file did not check.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import time

from bench import loadgen, modes, report

WARM_UP_TOKENS = 16


def body(ids, gen_tokens, output=False):
    """SGLang's ``/generate`` body: ``ids`` generating ``gen_tokens`` tokens, greedy,
    ``ignore_eos``; ``output``: with its output rows (``format.OUTPUT_PARAM``)."""
    from sglang_ext import format as fmt

    sampling = {"max_new_tokens": gen_tokens, "temperature": 0, "ignore_eos": True}
    if output:
        sampling["custom_params"] = {fmt.OUTPUT_PARAM: True}
    return {"input_ids": ids, "sampling_params": sampling}


def _post(port, obj, timeout):
    r = loadgen._session().post(f"http://127.0.0.1:{port}/generate", data=json.dumps(obj).encode(),
                                timeout=timeout, headers={"Content-Type": "application/json"})
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code} from port {port}: {r.content[:300]!r}")
    return r.json()


def _path(answer):
    meta = answer.get("meta_info") or {}
    if not meta.get("hidden_states_path"):
        raise RuntimeError(f"no file: {str(meta.get('hidden_states_error', 'no hidden_states_path'))[:300]}")
    return meta["hidden_states_path"]


def one_sample(kind, port, capture_port, ids, gen_tokens, timeout=600):
    """One sample of a cell of ``kind`` (``Mode.gen``): ``{"latency_s", "output_ids",
    "path"?, "generate_s"?, "capture_s"?}``. Raises RuntimeError (HTTP status, no file)."""
    t0 = time.perf_counter()
    answer = _post(port, body(ids, gen_tokens, output=kind == "output"), timeout)
    out = {"output_ids": list(answer.get("output_ids") or [])}
    if kind == "output":
        out["path"] = _path(answer)
    if kind == "two_pass":
        t1 = time.perf_counter()
        capture = {"input_ids": list(ids) + out["output_ids"],
                   "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        out["path"] = _path(_post(capture_port, capture, timeout))
        out.update(generate_s=t1 - t0, capture_s=time.perf_counter() - t1)
    out["latency_s"] = time.perf_counter() - t0
    return out


def read_rows(path):
    """``(rows, token_ids, metadata)`` of a dump file (``format.load``, its contract checked;
    numpy without torch): ``rows`` is ``hidden_states``' first dimension, ``token_ids`` its
    ids as ints."""
    from sglang_ext import format as fmt

    rec = fmt.load(path)
    return rec.hidden_states.shape[0], [int(t) for t in rec.token_ids.tolist()], rec.metadata


def check_file(kind, path, prompt, output_ids):
    """Check one sample's file against its request; raises ``DumpFormatError`` or
    ValueError (one sentence naming the file). ``output`` (one pass): P + G - 1 rows, the
    prompt then ``output_ids`` but the last, ``num_prompt_tokens`` and ``last_token_id``
    (``format.check_output_rows``); ``two_pass``: P + G rows of exactly prompt + ``output_ids``."""
    from sglang_ext.format.output import check_output_rows

    rows, token_ids, meta = read_rows(path)
    name = os.path.basename(path)
    if rows != len(token_ids):
        raise ValueError(f"{name}: {rows} rows of hidden_states but {len(token_ids)} token ids")
    if kind == "output":
        check_output_rows(token_ids, meta, prompt, output_ids, shown=name)
    elif token_ids != list(prompt) + list(output_ids):
        raise ValueError(f"{name}: {len(token_ids)} token ids, not the prompt's {len(prompt)} then the "
                         f"{len(output_ids)} generated ids sent to capture")


def run_cell(server, capture, cell, vocab, rng, mode, gen_tokens, timeout=600, trace_path=None):
    """One generate cell (``cell``: prompt_len, concurrency, requests) of ``mode`` against
    ``server`` (``capture``: gen_two_pass's capturing server, else None); its results entry
    (the module's docstring), with the files' ``stages`` (``report.stage_stats``) of the
    ``KIMI_SGLANG_TRACE`` lines appended to ``trace_path`` meanwhile."""
    kind = modes.BY_NAME[mode].gen
    prompts = loadgen.make_prompts(rng, cell["requests"], cell["prompt_len"], vocab)  # not timed
    offset = loadgen.trace_size(trace_path)
    port, capture_port = server.port, capture.port if capture is not None else None

    def one(ids):
        try:
            return one_sample(kind, port, capture_port, ids, gen_tokens, timeout)
        except Exception as e:  # noqa: BLE001 - the request's failure, counted below
            return {"error": f"{type(e).__name__}: {e}"}

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(cell["concurrency"]) as pool:
        results = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    out = {"mode": mode, "prompt_len": cell["prompt_len"], "concurrency": cell["concurrency"],
           "requests": len(prompts), "gen_tokens": gen_tokens}
    good = [r for r in results if "error" not in r]
    out.update(gen_stats([r["latency_s"] for r in good], sum(len(r["output_ids"]) for r in good),
                         len(good), sum(map(len, prompts)), wall))
    if kind == "two_pass" and good:
        for step in ("generate", "capture"):
            out[f"{step}_p50_s"] = report.percentile([r[f"{step}_s"] for r in good], 50)
    errors = [r["error"] for r in results if "error" in r]
    short = [len(r["output_ids"]) for r in good if len(r["output_ids"]) != gen_tokens]
    if short:
        errors.append(f"{len(short)} requests generated {short[0]} tokens, not --gen-tokens {gen_tokens} "
                      f"(ignore_eos)")
    paths = [(p, r) for p, r in zip(prompts, results) if r.get("path")]
    if paths and not short:
        try:
            for prompt, r in paths:
                check_file(kind, r["path"], prompt, r["output_ids"])
            out["rows_checked"] = len(paths)
        except (ValueError, OSError, KeyError) as e:  # DumpFormatError is a ValueError
            errors.append(f"file check: {e}")
        out.update(files=len(paths), file_bytes=sum(os.stat(r["path"]).st_size for _, r in paths))
    if trace_path and paths:
        time.sleep(0.3)  # the writer's trace line follows its lock release
        out["stages"] = report.stage_stats(loadgen.read_trace(trace_path, offset), wall)
    if errors:
        out["error"] = f"{len(errors)} problem(s) in {len(results)} requests: {errors[0][:300]}"
    return out


def gen_stats(latencies_s, output_tokens, samples, prompt_tokens, wall_s):
    """A generate cell's numbers: ``output_tokens`` generated by its ``samples`` good
    requests over ``wall_s`` seconds (``output_tps``, ``samples_per_s``), ``prompt_tokens``,
    and per-sample latency ``p50_s``, ``p99_s`` (seconds)."""
    return {"prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "wall_s": wall_s,
            "output_tps": output_tokens / wall_s if wall_s > 0 else float("nan"),
            "samples_per_s": samples / wall_s if wall_s > 0 else float("nan"),
            "p50_s": report.percentile(latencies_s, 50), "p99_s": report.percentile(latencies_s, 99)}


def warm_up(server, capture, mode, vocab, rng, plen, concs):
    """A burst at every concurrency of ``concs`` of ``mode``'s requests generating
    ``WARM_UP_TOKENS`` tokens (decode at every batch size before anything is timed); the
    files it leaves are the runner's to clear."""
    kind = modes.BY_NAME[mode].gen
    for conc in sorted(set(concs)):
        with cf.ThreadPoolExecutor(conc) as pool:
            list(pool.map(lambda ids: one_sample(kind, server.port, capture and capture.port, ids, WARM_UP_TOKENS),
                          loadgen.make_prompts(rng, conc, plen, vocab)))
