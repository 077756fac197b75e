"""Our files and vLLM's for the same prompts, compared.

While the servers are up, ``collect`` sends a few prompts (the run's two shortest lengths
and 777 tokens, a multiple of neither vLLM's 16-token blocks nor a chunk) to our server B
and to vLLM's W, and copies both files with ``pairs.json``. After the servers stop (the
GPU is free for the reference), ``python -m bench.peerfiles PAIRS OUT [--model-path P]
[--reference hf|none]`` runs ``compare``: keys, shapes, token ids, vLLM's hidden states
against ours and, with ``--reference hf``, each against HF transformers' float32 forward
(testing/reference.py), within testing/checks.py's bf16 tolerances. Both engines store the
same slots for the same layer ids, so slot i of one file is compared with slot i of the other."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import List, Optional

from bench import peer
from testing import checks
from testing import reference as refmod

ODD_LEN = 777  # 48 x 16 + 9: ends inside one of vLLM's KV blocks


def prompt_lens(run_lens: List[int]) -> List[int]:
    """The prompts compared: the run's two shortest lengths and ``ODD_LEN``."""
    return sorted(set(run_lens))[:2] + [ODD_LEN]


def collect(ours, vllm, vocab: int, rng, run_lens: List[int], out_dir: str, layer_ids: List[int],
            hidden_size: int, timeout: float = 300) -> str:
    """Send each prompt of ``prompt_lens(run_lens)`` to ``ours`` (server B) and ``vllm``
    (server W; testing/server.py ``Server``s), copy both files into ``out_dir`` and write
    ``out_dir/pairs.json``; returns its path. Raises ``requests.HTTPError`` for a failed
    request, ``KeyError``/``FileNotFoundError`` when an answer names no complete file."""
    os.makedirs(out_dir, exist_ok=True)
    pairs = []
    for i, plen in enumerate(prompt_lens(run_lens)):
        ids = [rng.randrange(3, vocab) for _ in range(plen)]
        r = ours.post({"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
                      timeout=timeout)
        r.raise_for_status()
        ours_path = r.json()["meta_info"]["hidden_states_path"]
        r = vllm.post(peer.completion_body(ids, token_ids=True), timeout=timeout, path="/v1/completions")
        r.raise_for_status()
        body = r.json()
        vllm_path = peer.file_path(body)
        if not vllm_path:
            raise KeyError(f"vLLM's answer names no file: {json.dumps(body)[:300]}")
        peer.wait_file(vllm_path)
        if not os.path.exists(vllm_path):
            raise FileNotFoundError(f"vLLM's file {vllm_path} is missing after its lock was released")
        pair = {"ids": ids, "ours": os.path.join(out_dir, f"ours-{i}.safetensors"),
                "vllm": os.path.join(out_dir, f"vllm-{i}.safetensors"),
                "echoed_ids_equal": body["choices"][0].get("prompt_token_ids") == ids}
        shutil.copyfile(ours_path, pair["ours"])
        shutil.copyfile(vllm_path, pair["vllm"])
        pairs.append(pair)
    path = os.path.join(out_dir, "pairs.json")
    with open(path, "w") as f:
        json.dump({"layer_ids": list(layer_ids), "hidden_size": hidden_size, "pairs": pairs}, f)
    return path


def _load(path: str, ids: List[int], layer_ids: List[int], hidden_size: int, who: str, problems: List[str]):
    """``hidden_states`` of one file when its keys, shapes and token ids are right, else
    None (with the reason in ``problems``); and its keys."""
    from safetensors.torch import load_file

    t = load_file(path)
    missing = sorted({"hidden_states", "token_ids"} - set(t))
    if missing:
        problems.append(f"{who}: no {missing} (keys {sorted(t)})")
        return None, sorted(t)
    hs, tok = t["hidden_states"], t["token_ids"]
    want = (len(ids), len(layer_ids), hidden_size)
    if tuple(hs.shape) != want:
        problems.append(f"{who}: hidden_states {tuple(hs.shape)} != {want} (tokens, layer slots, hidden)")
        return None, sorted(t)
    got = tok.tolist()
    if tuple(tok.shape) != (len(ids),) or got != list(ids):
        first = next((i for i, (a, b) in enumerate(zip(got, ids)) if a != b), min(len(got), len(ids)))
        problems.append(f"{who}: token_ids {tuple(tok.shape)} differ from the prompt's from position {first}")
    return hs, sorted(t)


# With the reference, an error may be this many times HF's own bf16 error against float32
# at that layer id: a deep random-weight model's bf16 rounding grows with depth, which no
# engine can beat, while a wrong layer or token shows as a multiple of it.
BASELINE_FACTOR = 1.5
# ... only where HF's bf16 error is rounding: above these the baseline is itself broken.
BASELINE_MAX = 0.15
BASELINE_TOKEN_MAX = 0.3


def _scaled(fixed: float, baseline: float, cap: float) -> float:
    """A tolerance: max(``fixed``, ``BASELINE_FACTOR`` x HF bf16's ``baseline`` error) where
    that baseline is bf16 rounding (at most ``cap``), else ``fixed`` (NaN too)."""
    return max(fixed, BASELINE_FACTOR * baseline) if baseline <= cap else fixed


def _over(key: str, w, layer_ids: List[int], slot_tols: List[float], token_tol: float, slot_text: str,
          token_text: str) -> List[str]:
    """The problems of ``w`` (a ``checks.Worst``): each layer id's error above its
    tolerance (``slot_text`` formatted with ``e``, ``tol``), the worst token row's above
    ``token_tol`` (``token_text`` with ``tol``, ``where``); NaN is above every tolerance."""
    out = [f"{key}: layer id {k}: " + slot_text.format(e=e, tol=tol)
           for k, e, tol in zip(layer_ids, w.slots, slot_tols) if not e <= tol]
    if not w.token <= token_tol:
        out.append(f"{key}: per-token relative error {w.token:.3e} > " + token_text.format(tol=token_tol,
                                                                                         where=w.token_where))
    return out


def compare(doc: dict, model_path: Optional[str] = None, reference: str = "none", device: str = "cuda") -> dict:
    """Compare the pairs of ``doc`` (``pairs.json``'s content). Returns ``{"prompts",
    "prompt_lens", "layer_ids", "keys", "ours_vs_vllm", "ours_vs_ref", "vllm_vs_ref",
    "hf_bf16_vs_ref" (each the largest relative errors, ``testing/checks.Worst``, per layer
    slot too), "tolerance", "reference", "problems", "pass"}``.

    Without the reference, ``pass`` when every file has the right keys, shapes and token ids
    and vLLM's is within the bf16 tolerances of ours. With ``reference="hf"``, every error
    must be within max(the fixed tolerance, ``BASELINE_FACTOR`` x HF's own bf16 error) per
    layer slot (token rows alike); an HF bf16 error above ``BASELINE_MAX`` (token rows:
    ``BASELINE_TOKEN_MAX``) or NaN is not rounding: a problem, and it scales nothing."""
    layer_ids, hidden = doc["layer_ids"], doc["hidden_size"]
    ref = refmod.Reference(model_path, device) if reference == "hf" else None
    worst = {k: checks.Worst() for k in ("ours_vs_vllm", "ours_vs_ref", "vllm_vs_ref", "hf_bf16_vs_ref")}

    def add(key, got, want, where):
        worst[key].add(refmod.rel_errors(got, want), where)

    problems: List[str] = []
    keys = {}
    blocks = []  # the float32 reference's, kept for HF's bf16 pass
    try:
        for i, p in enumerate(doc["pairs"]):
            ids = p["ids"]
            where = f"prompt {i} ({len(ids)} tokens)"
            hs = {}
            for side in ("ours", "vllm"):
                hs[side], keys[side] = _load(p[side], ids, layer_ids, hidden, f"{where}, {side}", problems)
            if p.get("echoed_ids_equal") is False:
                problems.append(f"{where}: vLLM's choices[0].prompt_token_ids differ from the prompt")
            if hs["ours"] is not None and hs["vllm"] is not None:
                add("ours_vs_vllm", hs["vllm"], hs["ours"].float(), where)
            if ref is not None:
                block = ref(ids, layer_ids)  # [T, L, H] float32
                blocks.append((ids, block, where))
                for side in ("ours", "vllm"):
                    if hs[side] is not None:
                        add(f"{side}_vs_ref", hs[side], block, where)
        if ref is not None:
            import torch

            ref.to_dtype(torch.bfloat16)
            for ids, block, where in blocks:
                add("hf_bf16_vs_ref", ref(ids, layer_ids), block, where)
    finally:
        if ref is not None:
            ref.close()
    out = {"prompts": len(doc["pairs"]), "prompt_lens": [len(p["ids"]) for p in doc["pairs"]],
           "layer_ids": layer_ids, "keys": keys,
           "tolerance": {"block": checks.TOL_BLOCK, "token": checks.TOL_TOKEN},
           "reference": f"HF transformers float32 on {device}" if ref is not None else "none"}
    for key, w in worst.items():
        if w.files:
            out[key] = {"block": w.block, "token": w.token, "block_where": w.block_where,
                        "token_where": w.token_where, "files": w.files, "slots": w.slots}
    base = worst["hf_bf16_vs_ref"]
    if base.files:  # tolerances scaled by HF's own bf16 error, slot by slot
        problems += _over("hf_bf16_vs_ref", base, layer_ids, [BASELINE_MAX] * len(layer_ids), BASELINE_TOKEN_MAX,
                          "HF's own bf16 forward is {e:.3e} off float32 (> {tol:g}: not bf16 rounding; that layer "
                          "id keeps the fixed tolerance)", "{tol:g} ({where}): not bf16 rounding; token rows keep "
                          "the fixed tolerance")
        tol_slots = [_scaled(checks.TOL_BLOCK, e, BASELINE_MAX) for e in base.slots]
        tol_token = _scaled(checks.TOL_TOKEN, base.token, BASELINE_TOKEN_MAX)
        out["tolerance"].update({"slots": tol_slots, "token_scaled": tol_token, "factor": BASELINE_FACTOR})
        for key in ("ours_vs_vllm", "ours_vs_ref", "vllm_vs_ref"):
            if worst[key].files:
                problems += _over(key, worst[key], layer_ids, tol_slots, tol_token,
                                  "relative error {e:.3e} > {tol:.3e} (max(%g, %g x HF bf16's))"
                                  % (checks.TOL_BLOCK, BASELINE_FACTOR), "{tol:.3e} ({where})")
    else:
        for key in ("ours_vs_vllm", "ours_vs_ref", "vllm_vs_ref"):
            if worst[key].files:
                problems += [f"{key}: {x}" for x in worst[key].problems()]
    if not doc["pairs"]:
        problems.append("no prompt pairs to compare")
    out["problems"] = problems
    out["pass"] = not problems and "ours_vs_vllm" in out
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.peerfiles",
                                 description="compare our dump files with vLLM's for the same prompts")
    ap.add_argument("pairs", help="pairs.json written by collect()")
    ap.add_argument("out", help="where the comparison (JSON) goes")
    ap.add_argument("--model-path", help="the HF model directory both engines served")
    ap.add_argument("--reference", choices=["hf", "none"], default="none",
                    help="hf: also compare each file with HF transformers' float32 forward")
    ap.add_argument("--device", default="auto", help="the reference's device (auto: cuda when there is one)")
    args = ap.parse_args(argv)
    if args.reference == "hf" and not args.model_path:
        ap.error("--reference hf needs --model-path")
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        with open(args.pairs) as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or not {"layer_ids", "hidden_size", "pairs"} <= set(doc):
            raise ValueError("it is not a pairs.json of collect() (layer_ids, hidden_size, pairs)")
        if not doc["layer_ids"]:
            raise ValueError("its layer_ids list is empty")
    except (OSError, ValueError) as e:
        ap.error(f"{args.pairs}: {getattr(e, 'strerror', None) or e}")
    out = compare(doc, args.model_path, args.reference, device)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{out['prompts']} prompts compared: {'PASS' if out['pass'] else 'FAIL'}"
          + "".join(f"\n  {p}" for p in out["problems"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
