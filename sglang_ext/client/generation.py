"""``extract --generate``: the server writes each row's response and the rows of its tokens
in one request (``format.output``), instead of capturing a prompt alone.

Each row's prompt (its ``input_ids``, or its ``messages`` without the final assistant turn
and with the generation prompt, ``--tokenizer``'s chat template) goes to ``POST /generate``
with ``custom_params {"hidden_states_output": true}`` and the sampling parameters given
here (``sampling_params``). The answer's ``output_ids`` are the generated ids; the file
must hold the prompt then every generated id but the last (``check_answer``, before the
file is moved into OUT: a mismatch fails that row, one sentence). The manifest line adds
``num_prompt_tokens``, ``output_ids``, ``sampling_params`` (those sent) and, with
``--tokenizer``, ``text`` (``record_fields``). A rerun keeps an ``hs_<i>`` whose prompt is the
row's (``existing``) and rebuilds a lost manifest line from the file itself; one whose line
records other ``sampling_params`` stops the run (``other_mode``). A retried row is a new
request: with sampled decoding (``--temperature`` > 0) it is a new sample, other tokens
than the failed try's.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from sglang_ext import format as fmt
from sglang_ext.client.checks import CheckError, check_file, check_header
from sglang_ext.client.files import regular_or_why
from sglang_ext.client.http import FatalError, RowError
from sglang_ext.client.manifest import final_name

HELP = ("generate each row's response with the server and capture the rows of the prompt and "
        "of every generated token fed back (all but the last) in the same request; rows give "
        "input_ids of the prompt, or messages (the final assistant turn dropped, --tokenizer's "
        "chat template with the generation prompt). The manifest records output_ids and the "
        "sampling_params sent (and text with --tokenizer): a rerun with others stops. A "
        "retried row is a new request: with --temperature > 0 a new sample")


def add_arguments(p) -> None:
    """``extract``'s ``--generate`` flags (their defaults in ``DEFAULTS``: None here, so a
    flag given without ``--generate`` is told apart and refused)."""
    p.add_argument("--generate", action="store_true", help=HELP)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="with --generate: most tokens generated per row (SGLang's max_new_tokens; "
                        "default: 512)")
    p.add_argument("--temperature", type=float, default=None,
                   help="with --generate: sampling temperature; 0 is greedy decoding (default: 0)")
    p.add_argument("--top-p", type=float, default=None,
                   help="with --generate: nucleus sampling's top_p (default: 1)")
    p.add_argument("--sampling-params", default=None, metavar="JSON",
                   help="with --generate: more of SGLang's sampling_params as a JSON object, e.g. "
                        "'{\"stop_token_ids\": [2], \"top_k\": 20}' (not those the flags above "
                        "set, nor n)")


# the manifest line's record of the sampling_params a generated row was made with
SAMPLING_KEY = "sampling_params"

# sampling_params key -> (flag, default)
DEFAULTS = {"max_new_tokens": ("--max-new-tokens", 512), "temperature": ("--temperature", 0.0),
            "top_p": ("--top-p", 1.0)}


def _not_json(name: str) -> None:
    """``json.loads``' hook for ``NaN``, ``Infinity`` and ``-Infinity``, which Python reads
    but JSON has not: refused (they would be sent, and recorded in the manifest, as
    non-JSON, and NaN never equals itself: the same command's rerun would stop)."""
    raise ValueError(f"{name} is not a JSON number")


def sampling_params(args) -> Optional[Dict[str, Any]]:
    """The ``sampling_params`` each ``--generate`` request sends (None without
    ``--generate``). Raises ``ValueError`` (one sentence naming the flag), also for a
    generation flag without ``--generate`` (it would be ignored) and for ``--sampling-params``
    keys a flag sets or ``n`` (one sample per row)."""
    given = [flag for key, (flag, _) in DEFAULTS.items() if getattr(args, key) is not None]
    if args.sampling_params is not None:
        given.append("--sampling-params")
    if not args.generate:
        if given:
            raise ValueError(f"{' and '.join(given)} only apply with --generate, which was not given "
                             f"(without it each row's prompt alone is captured)")
        return None
    chosen = {key: default if getattr(args, key) is None else getattr(args, key)
              for key, (_, default) in DEFAULTS.items()}
    if chosen["max_new_tokens"] < 1:
        raise ValueError(f"--max-new-tokens {chosen['max_new_tokens']} must be at least 1")
    if not (math.isfinite(chosen["temperature"]) and chosen["temperature"] >= 0):
        raise ValueError(f"--temperature {chosen['temperature']} must be a number >= 0")
    if not (math.isfinite(chosen["top_p"]) and 0 < chosen["top_p"] <= 1):
        raise ValueError(f"--top-p {chosen['top_p']} must be in (0, 1]")
    extra: Any = {}
    if args.sampling_params is not None:
        try:
            extra = json.loads(args.sampling_params, parse_constant=_not_json)
        except ValueError as e:
            raise ValueError(f"--sampling-params is not JSON ({e})") from None
        if not isinstance(extra, dict):
            raise ValueError("--sampling-params must be a JSON object of SGLang's sampling_params")
        if "custom_params" in extra:
            raise ValueError("--sampling-params must not set custom_params (extract sets them)")
        for key, (flag, _) in DEFAULTS.items():
            if key in extra:
                raise ValueError(f"--sampling-params must not set {key}: pass {flag}")
        if extra.get("n", 1) != 1:
            raise ValueError(f"--sampling-params n {extra['n']!r}: extract takes one sample per "
                             f"row (n 1); repeat rows in DATA for more")
        if extra.get("beam_width") not in (None, 0, 1):  # SGLang: beam_width > 1 is beam search
            raise ValueError(f"--sampling-params beam_width {extra['beam_width']!r}: beam search is not "
                             f"dumped (SGLang replaces a beam request's sampling_params, custom_params "
                             f"with them); leave beam_width out")
    return {**extra, **chosen}


def decoder(tokenizer) -> Optional[Callable[[List[int]], str]]:
    """The manifest's ``text`` of generated ids (special tokens skipped), None without a
    tokenizer."""
    if tokenizer is None:
        return None
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def record_fields(rows: fmt.OutputRows, decode: Optional[Callable[[List[int]], str]],
                  sent: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """What a generated row's manifest line adds: ``num_prompt_tokens``, ``output_ids``
    (every generated id), ``sampling_params`` (``sent``: those of the request that made it;
    left out when unknown, a line rebuilt from a file) and, with a tokenizer, ``text``."""
    out: Dict[str, Any] = {"num_prompt_tokens": rows.num_prompt_tokens, "output_ids": rows.output_ids}
    if sent is not None:
        out[SAMPLING_KEY] = sent
    if decode is not None:
        out["text"] = decode(rows.output_ids)
    return out


def _ids_and_metadata(path: str, shown: str) -> Tuple[List[int], Dict[str, str]]:
    """A file's ``token_ids`` and ``__metadata__`` (its size bound checked first:
    ``check_header``). Raises ``CheckError``."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="numpy") as f:
            check_header(f, os.stat(path).st_size, None, shown)
            return f.get_tensor(fmt.KEY_TOKEN_IDS).tolist(), dict(f.metadata() or {})
    except CheckError:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise CheckError(f"{shown}: unreadable: {e}") from None


def check_answer(dump, name: str, prompt: List[int], output_ids: List[int],
                 decode: Optional[Callable[[List[int]], str]] = None,
                 sent: Optional[Dict[str, Any]] = None) -> Tuple[List[int], Dict[str, Any]]:
    """Check the server's file ``name`` (in ``dump``, a ``dumpdir.DumpDir``) against the
    contract before it is taken: ``(token ids it must hold, the manifest's fields)``
    (``sent``: the request's sampling_params, recorded there).
    Raises ``FatalError`` for a file of the prompt's rows only (the server does not
    capture generated tokens: every row would fail alike), ``RowError`` (one sentence)
    for any other mismatch, ``CheckError`` for an unreadable file."""
    from sglang_ext.client.dumpdir import open_regular

    shown = f"the server's file {os.path.join(dump.path, name)}"
    fd = open_regular(name, dump.fd, shown)
    try:
        ids, meta = _ids_and_metadata(f"/proc/self/fd/{fd}", shown)
    finally:
        os.close(fd)
    if fmt.NUM_PROMPT_TOKENS_KEY not in meta and fmt.LAST_TOKEN_ID_KEY not in meta:
        raise FatalError(f"{shown} holds the prompt's rows only (no metadata "
                         f"{fmt.NUM_PROMPT_TOKENS_KEY}): this server does not capture generated "
                         f"tokens ({fmt.OUTPUT_PARAM}); run without --generate")
    try:
        rows = fmt.check_output_rows(ids, meta, prompt, output_ids, shown)
    except fmt.DumpFormatError as e:
        raise RowError(f"the answer breaks the output-rows contract: {e}") from None
    return fmt.fed_token_ids(prompt, output_ids), record_fields(rows, decode, sent)


def existing(out_dir: str, index: int, prompt: List[int], full: bool, rec: Optional[Dict[str, Any]],
             decode: Optional[Callable[[List[int]], str]] = None,
             sent: Optional[Dict[str, Any]] = None
             ) -> Tuple[Optional[int], Optional[str], Optional[Dict[str, Any]]]:
    """``manifest.existing`` for ``--generate``: ``(tokens, None, manifest fields)`` for a
    regular ``hs_<index>`` of this prompt with output rows (``check_output_rows``, then
    ``check_file``), its generated ids taken from the file; ``(None, why, None)`` for one
    not to keep as it is (also when the manifest line ``rec`` names other output ids, or
    other sampling_params than ``sent``, this run's: ``other_mode`` then stops the run);
    ``(None, None, None)`` for none."""
    target = os.path.join(out_dir, final_name(index))
    try:
        not_regular = regular_or_why(target)
    except FileNotFoundError:
        return None, None, None
    if not_regular:
        return None, f"it is not a regular file ({not_regular})", None
    try:
        ids, meta = _ids_and_metadata(target, target)
        rows = fmt.check_output_rows(ids, meta, prompt, None, target)
        n = check_file(target, fmt.fed_token_ids(prompt, rows.output_ids), full)
    except (CheckError, fmt.DumpFormatError) as e:
        return None, str(e), None
    if rec is not None and rec.get("output_ids") not in (None, rows.output_ids):
        return None, "its manifest line names other output_ids than the file holds", None
    if _other_setting(rec, sent):
        return None, f"its manifest line records other {SAMPLING_KEY}", None
    return n, None, record_fields(rows, decode)


def _shown(key: str, params: Dict[str, Any]) -> str:
    """``key`` of ``params`` as the command line gives it: ``--temperature 0.7``,
    ``--sampling-params top_k 20`` (``unset`` when absent)."""
    flag = DEFAULTS[key][0] if key in DEFAULTS else f"--sampling-params {key}"
    return f"{flag} {json.dumps(params[key]) if key in params else 'unset'}"


def _other_setting(rec: Optional[Dict[str, Any]], sent: Optional[Dict[str, Any]]) -> Optional[str]:
    """The first sampling setting in which the manifest line ``rec`` and ``sent`` (this
    ``--generate`` run's sampling_params) differ, as ``'--temperature 0.7 (this run:
    --temperature 0.0)'``; None when they agree, or ``rec`` records none: a line of a run
    made before the record was added (older manifests), or rebuilt from a file."""
    made = rec.get(SAMPLING_KEY) if rec is not None else None
    if sent is None or not isinstance(made, dict):
        return None
    for key in sorted(set(made) | set(sent)):
        if key not in made or key not in sent or made[key] != sent[key]:
            return f"{_shown(key, made)} (this run: {_shown(key, sent)})"
    return None


def other_mode(out_dir: str, index: int, prompt: Optional[List[int]],
               sent: Optional[Dict[str, Any]], rec: Optional[Dict[str, Any]] = None) -> Optional[str]:
    """Why a rerun must not replace ``OUT/hs_<index>``, which ``existing`` (or
    ``manifest.existing``) refused: it is a sample of this row made in the other mode, the
    prompt's and generated tokens' rows (``format.output``) in a run without ``--generate``
    (``sent`` None), or the prompt's rows alone in a ``--generate`` run; or its manifest
    line ``rec`` records other sampling_params than ``sent``, this ``--generate`` run's; or
    it was made for this row (its rid's row index, ``_rid_row``) from another prompt than
    ``prompt`` (a rerun on other DATA), in either mode; another row's file is replaced. Such work is kept: the run stops (``runner``) instead of extracting the row again.
    None otherwise (no such file, an unreadable one, or ``prompt`` None: a row with images)."""
    target = os.path.join(out_dir, final_name(index))
    generate = sent is not None
    if prompt is None:
        return None
    try:
        if regular_or_why(target):
            return None
        ids, meta = _ids_and_metadata(target, target)
    except (OSError, CheckError):
        return None
    made = fmt.NUM_PROMPT_TOKENS_KEY in meta and ids[:len(prompt)] == prompt \
        and meta[fmt.NUM_PROMPT_TOKENS_KEY] == str(len(prompt))  # this row's, generated
    count = meta.get(fmt.NUM_PROMPT_TOKENS_KEY)
    if count is not None and not (count.isascii() and count.isdigit()):
        return None  # not a file of ours: replaced
    theirs = ids if count is None else ids[:int(count)]
    if theirs != prompt and _rid_row(meta.get("rid")) == index:
        return (f"{target} holds the rows of another prompt ({len(theirs)} tokens; this row's has "
                f"{len(prompt)}), from a run on other DATA: not replaced; extract into another --out, "
                f"or delete that file to extract this row again")
    differs = _other_setting(rec, sent) if made else None
    if differs:
        return (f"{target} was generated with {differs}: not replaced; run with the settings "
                f"it was made with to resume that dataset, or extract into another --out")
    if generate and fmt.NUM_PROMPT_TOKENS_KEY not in meta and ids == prompt:
        return (f"{target} holds this row's prompt rows alone, from a run without --generate: "
                f"not replaced; run without --generate to resume that dataset, or extract into "
                f"another --out")
    if not generate and made:
        return (f"{target} holds this row's prompt and generated rows, from a --generate run: "
                f"not replaced; add --generate (and its flags) to resume that dataset, or extract "
                f"into another --out")
    return None


def _rid_row(rid: Optional[str]) -> Optional[int]:
    """The row index in one of extract's rids, ``<prefix>-<row>-<try>-<8 hex>`` (``runner``),
    else None."""
    parts = rid.rsplit("-", 3) if isinstance(rid, str) else []
    if len(parts) == 4 and parts[1].isascii() and parts[1].isdigit():
        return int(parts[1])
    return None


def other_ranks_setting(out_dir: str, records: Dict[int, Dict[str, Any]], sent: Optional[Dict[str, Any]],
                        mine: Callable[[int], bool]) -> Optional[str]:
    """Why a run must not add to OUT, whose manifest ``records`` (index -> line) hold a row
    it does not take (``mine(index)`` False: another rank's, or of another --world-size)
    made in the other mode or, per its ``sampling_params``, with other settings than
    ``sent`` (this run's; None without ``--generate``), while that ``hs_<index>`` is still
    there: the ranks of one dataset would write two settings into one OUT, which
    ``other_mode`` sees only for a run's own rows. None otherwise. A line is of a generated
    row when it has ``num_prompt_tokens`` (``record_fields``); one without ``sampling_params``
    (older manifests, rebuilt from a file) agrees with any settings, as ``other_mode``'s."""
    for index in sorted(records):
        rec = records[index]
        if mine(index):
            continue
        made = fmt.NUM_PROMPT_TOKENS_KEY in rec
        if made and sent is not None:
            differs = _other_setting(rec, sent)
            what = f"was generated with {differs}" if differs else None
        elif made:
            what = "holds its prompt and generated rows, from a --generate run"
        elif sent is not None:
            what = "holds its prompt rows alone, from a run without --generate"
        else:
            what = None
        target = os.path.join(out_dir, final_name(index))
        if what is not None and os.path.isfile(target):
            return (f"{target} (row {index}, another rank's per the manifest) {what}: this run "
                    f"would add samples of other settings to that dataset; run every rank with the "
                    f"settings it was made with, or extract into another --out")
    return None

