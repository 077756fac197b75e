"""``sglang-ext convert [--to specforge] SRC DST``: hs_<i>.safetensors -> SpecForge EAGLE-3 records.

SpecForge's offline EAGLE-3 trainer (``OfflineEagle3Dataset``, ``build_offline_eagle3_dataset``
in ``specforge/data/preprocessing.py``) reads every ``*.ckpt`` under a directory, each a
``torch.save``d dict written by its ``scripts/prepare_hidden_states.py``:

==================  ======================  =============================================
key                 shape                   content
==================  ======================  =============================================
``input_ids``       ``[T]`` int64           the prompt's token ids
``loss_mask``       ``[T]`` int64           1 where the drafter is trained
``aux_hidden_state`` ``[1, T, k*H]``         the aux layers, concatenated in layer order
``hidden_state``    ``[1, T, H]``           the last layer's output **after** the final
                                            norm (what SGLang hands its logits processor;
                                            SpecForge feeds it to the bare ``lm_head``)
==================  ======================  =============================================

Our files hold the aux layers plus the last layer's output **before** the final norm (id
N, for speculators, which applies the norm itself). So the converter needs the model's
final RMSNorm (``--model DIR``: ``config.json``'s ``rms_norm_eps`` and the norm weight
from the checkpoint's safetensors), or ``--no-final-norm`` to write the pre-norm stream
as is (wrong for SpecForge's stock trainer; only for a trainer that norms itself).
The norm is computed in float32 as HF's ``LlamaRMSNorm``/``DeepseekV3RMSNorm`` do.
fp8 files (``--dump-hidden-states-dtype fp8``) are dequantized to bf16 first
(``fp8.to(bf16) * scale.to(bf16)``, what speculators' ``FP8Transfer`` hands its trainer):
SpecForge's records hold bf16 as for a bf16 dump.

Slots: ``aux_hidden_state`` is every slot but the last, in file order (ascending layer
ids; the default ``[2, N//2, N-3]`` is SpecForge's default aux set), ``hidden_state``
the last slot, which must be id N (``metadata.layer_ids[-1] == num_layers``; files
without our metadata, e.g. vLLM's, are taken to follow the same convention).

``loss_mask``: from ``--loss-mask-from DATA`` (the JSONL / datasets directory given to
``extract``, row i -> hs_<i>; its ``loss_mask`` must have T entries), else all ones
(every position trained; SpecForge itself zeroes the last one when it loads a record),
except in a file with output rows (``extract --generate``, ``format.output``): 0 on its
``num_prompt_tokens`` prompt positions, 1 on the generated tokens, as SpecForge's own
template masks mark the assistant's tokens.

Images: SpecForge is text-only (its trainer embeds ``input_ids`` with the drafter's own
embedding and has no vision tower), but a record of a prompt with images is still a valid
record: ``input_ids`` holds the server's ids, each image as its run of placeholder ids, and
the hidden states at those positions are the verifier's (its layers over the vision
embeddings). The drafter cannot learn to predict image tokens, so ``loss_mask`` is 0 at
every position whose id is an image token id: ``--image-token-id`` (repeatable), else the
file's metadata ``image_token_id`` (an int, or a JSON list of ints, which the server writes
for a multimodal model). The positions stay in the record as context. A file that
``SRC/manifest.jsonl`` marks as a prompt with images (``images`` > 0) needs such an id
(exit 2 before anything is written when neither names one) and must hold it at one
position at least (else exit 1: the id is wrong).

Layout: ``DST/rows_<g>-<g+5000>/data_<i>.ckpt`` as SpecForge writes it. Each record is
written to a temporary name and renamed; existing records are skipped (resume) and the
run says so on stderr: they keep the loss masks and norm they were written with (delete
DST to redo them). A record there whose ``input_ids`` are not its file's token ids
(another dataset's), or that ``torch.load`` cannot read, is refused (exit 2).

Exit status: 0 every record written or already there, 1 a file could not be converted,
2 bad input (SRC without hs_<i> files, DST not a directory, or SRC or inside it, a model
folder without config.json or whose ``num_hidden_layers`` differs from the files' ``num_layers``, a
``--loss-mask-from`` that does not exist, loss masks missing for some rows or given for
rows whose ``input_ids`` differ from the file's ``token_ids``, a prompt with images and no
image token id, torch not installed, a DST record of another dataset, SRC files of two
dumps: other layer ids, hidden size or dtype, ``--loss-mask-from`` with generated files), each with one sentence on stderr. Exit 1 names the file (e.g. one that is not a readable
safetensors file, or an ``hs_<i>.safetensors`` that is not a regular file: a FIFO there
is never opened, so it cannot hang the run).
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import re
import sys
from typing import Dict, Optional, Sequence, Tuple

from sglang_ext import format as fmt
from sglang_ext.client.convert_inputs import (
    NORM_KEYS,
    ConvertError,
    check_image_ids,
    check_num_layers,
    check_one_dump,
    image_rows,
    image_token_ids,
    load_final_norm,
    load_loss_masks,
    read_file_headers,
)
from sglang_ext.client.files import Staged, dir_mode, file_mode, regular_or_why

GROUP_SIZE = 5000  # prepare_hidden_states.py: rows_{start}-{start + 5000}
_SRC = re.compile(r"hs_(0|[1-9][0-9]*)\.safetensors")  # extract's names alone: not hs_01, no non-ASCII digit


def require_regular(path: str) -> None:
    """Raise ``ConvertError`` (one sentence) unless ``path`` is a regular file."""
    what = regular_or_why(path, follow_symlinks=True)
    if what:
        raise ConvertError(f"{path} is not a regular file ({what}); remove it and run extract "
                           f"again with the same --out to replace it")


def specforge_path(dst: str, index: int) -> str:
    start = (index // GROUP_SIZE) * GROUP_SIZE
    return os.path.join(dst, f"rows_{start}-{start + GROUP_SIZE}", f"data_{index}.ckpt")


def rms_norm(x, weight, eps: float):
    """HF LlamaRMSNorm: float32 math, result cast back to ``x``'s dtype."""
    import torch

    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)



def to_specforge_record(path: str, norm, loss_mask: Optional[list],
                        image_ids: Optional[Sequence[int]] = None,
                        images: int = 0) -> Tuple[Dict[str, object], bool]:
    """One SpecForge record of ``path`` (module doc), and whether its default loss mask
    is a generated file's (0 on the prompt). ``image_ids``: ``--image-token-id``
    (else the file's metadata ``image_token_id``); ``images``: the image parts the
    manifest gives the row (0: none known). Raises ``ConvertError``."""
    import torch

    from safetensors import SafetensorError

    require_regular(path)
    try:
        rec = fmt.load(path, dequantize=torch.bfloat16)  # fp8 files: fp8 * scale, as FP8Transfer
    except SafetensorError as e:  # a truncated or foreign file
        detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConvertError(f"{path} is not a readable safetensors file ({detail}); run extract "
                           f"again with the same --out to replace it") from None
    except fmt.DumpFormatError as e:  # format.load names the file and what it found
        raise ConvertError(f"{(str(e).strip().splitlines() or [type(e).__name__])[0]}; run extract "
                           f"again with the same --out to replace it") from None
    hs, ids = rec.hidden_states, rec.token_ids
    if hs.dtype not in (torch.bfloat16, torch.float16, torch.float32):  # fp8: bf16 by now
        raise ConvertError(f"{path}: hidden_states of {hs.dtype}, not a dtype the server writes "
                           f"(bfloat16, float16, float32, or float8_e4m3fn with its scales); run "
                           f"extract again with the same --out to replace it")
    if hs.shape[0] == 0 or hs.shape[2] == 0:  # extract never writes one: a prompt has a token
        raise ConvertError(f"{path}: hidden_states {list(hs.shape)} holds no "
                           f"{'token' if hs.shape[0] == 0 else 'channel'}, not a sample; run "
                           f"extract again with the same --out to replace it")
    if bool((ids < 0).any()):  # extract sends none; SpecForge's embedding cannot look one up
        k = int((ids < 0).nonzero()[0, 0])
        raise ConvertError(f"{path}: token id {int(ids[k])} at position {k} is negative, not a "
                           f"token id; run extract again with the same --out to replace it")
    if hs.shape[1] < 2:
        raise ConvertError(f"{path}: {hs.shape[1]} layer slot(s); need aux layers plus the last")
    if "layer_ids" in rec.metadata and "num_layers" in rec.metadata:
        try:
            num_layers = int(rec.metadata["num_layers"])
        except ValueError:
            raise ConvertError(f"{path}: metadata num_layers {rec.metadata['num_layers'][:80]!r} "
                               f"is not a layer count; run extract again with the same --out to "
                               f"replace it") from None
        if rec.layer_ids[-1] != num_layers:
            raise ConvertError(
                f"{path}: last slot is layer id {rec.layer_ids[-1]}, not the last layer "
                f"({num_layers}); dump with id N in --dump-hidden-states-layers"
            )
    t = ids.shape[0]
    last = hs[:, -1, :]
    if norm is not None:
        weight, eps = norm
        if weight.shape[0] != last.shape[-1]:
            raise ConvertError(f"{path}: norm weight has {weight.shape[0]} entries, hidden size {last.shape[-1]}")
        last = rms_norm(last, weight, eps)
    generated = False
    if loss_mask is None:
        mask = torch.ones(t, dtype=torch.long)
        try:
            rows = fmt.output_rows(ids.tolist(), rec.metadata, path)
        except fmt.DumpFormatError as e:
            raise ConvertError(f"{e}; run extract again with the same --out to replace it") from None
        if rows is not None:  # the response alone is trained (module doc)
            mask[:rows.num_prompt_tokens] = 0
            generated = True
    else:
        if len(loss_mask) != t:
            raise ConvertError(f"{path}: loss_mask has {len(loss_mask)} entries for {t} tokens")
        mask = torch.tensor(loss_mask, dtype=torch.long)
    try:
        masked = frozenset(image_ids) if image_ids else image_token_ids(rec.metadata)
    except ConvertError as e:
        raise ConvertError(f"{path}: {e}") from None
    if masked:
        at = torch.isin(ids.to(torch.long), torch.tensor(sorted(masked), dtype=torch.long))
        if images and not bool(at.any()):
            raise ConvertError(f"{path}: a prompt with {images} image(s), but no position holds "
                               f"image token id {sorted(masked)}: pass the model's image "
                               f"placeholder id as --image-token-id")
        mask = mask.masked_fill(at, 0)
    elif images:
        raise ConvertError(f"{path}: a prompt with {images} image(s) and no image token id to "
                           f"mask: pass --image-token-id")
    return {
        "input_ids": ids.to(torch.long).clone(),
        "loss_mask": mask,
        # One copy each, of exactly its bytes (torch.save writes a view's whole storage):
        # clone() of a slice with gaps is contiguous; a dense one (T = 1) is copied too.
        "hidden_state": (last if norm is not None  # rms_norm's result is a new tensor
                         else last.clone(memory_format=torch.contiguous_format)).unsqueeze(0),
        "aux_hidden_state": hs[:, :-1, :].clone(memory_format=torch.contiguous_format)
                                         .reshape(t, -1).unsqueeze(0),
    }, generated


def check_kept_records(src: str, dst: str, indices: Sequence[int],
                       headers: Dict[int, Tuple[list, dict]]) -> None:
    """Raise ``ConvertError`` unless every record already at ``DST`` for ``indices`` (kept
    on resume) is one ``torch.load`` reads whose ``input_ids`` equal its ``hs_<i>`` file's
    token ids (``headers``: ``read_file_headers``; a file left out there is named when
    converted, its record kept as it is). Records are loaded with ``mmap`` (their hidden
    states not read), torch's legacy non-zip ones whole."""
    import torch

    for index in indices:
        path = specforge_path(dst, index)
        if not os.path.exists(path) or index not in headers:
            continue
        what = regular_or_why(path, follow_symlinks=True)
        try:
            if what:
                raise ValueError(f"not a regular file: {what}")
            try:
                rec = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except RuntimeError:  # torch's legacy (non-zip) format cannot be mmapped: read whole
                rec = torch.load(path, map_location="cpu", weights_only=True)
            ids = rec["input_ids"]
            same = ids.tolist() == headers[index][0]
        except Exception as e:  # noqa: BLE001 - pickle, zip and key errors all say the same
            detail = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ConvertError(f"DST {dst} already holds {path}, which is not a record "
                               f"torch.load reads ({detail}): pass another DST, or delete that "
                               f"record to convert it again") from None
        if not same:
            raise ConvertError(f"DST {dst} already holds {path}, whose input_ids are not "
                               f"hs_{index}.safetensors' token_ids (another dataset's record): "
                               f"pass another DST, or delete that record to convert it again")


def save_atomic(obj, path: str, mode: int) -> None:
    """``torch.save(obj)`` to ``path`` through a temporary name (``files.Staged``): ``path``
    only ever holds a complete record; ``ConvertError`` (one sentence naming ``path``) when
    it cannot be written (a full disk), the temporary name removed. Temporary names are
    this run's own (``.data_<i>.ckpt.tmp.<8 hex>``): another convert into DST keeps its
    own, and a killed run's stays, hidden, never matching SpecForge's ``*.ckpt``. Made
    with ``mode`` before the umask (``main``: the ``KIMI_SGLANG_FILE_MODE`` of extract's
    files, 0600: hidden states stay the user's)."""
    import torch

    directory, name = os.path.split(path)
    try:
        os.makedirs(directory, mode=dir_mode(mode), exist_ok=True)
        with Staged(directory, name) as staged:
            tmp, fd = staged.create(mode)
            with open(fd, "wb") as f:
                torch.save(obj, f)
            staged.publish(tmp)
    except (OSError, RuntimeError) as e:
        # torch.save's zip writer turns a full disk (ENOSPC) into its own RuntimeError
        # ("unexpected pos ..."): the OSError that caused it is its context.
        cause = e if isinstance(e, OSError) else e.__context__
        why = (cause.strerror or str(cause)) if isinstance(cause, OSError) else str(e)
        full = isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)
        raise ConvertError(f"DST {os.path.dirname(directory)}: cannot write {path} "
                           f"({why.strip().splitlines()[0] if why.strip() else type(e).__name__}); "
                           + ("free space there, or pass another DST," if full else
                              "pass another DST, or fix this one,")
                           + " and run again: the records written are kept") from None


def main(args) -> int:
    if args.to != "specforge":
        print(f"error: unknown --to {args.to!r}", file=sys.stderr)
        return 2
    if bool(args.model) == bool(args.no_final_norm):
        print("error: pass --model DIR (to apply the final norm SpecForge expects) "
              "or --no-final-norm", file=sys.stderr)
        return 2
    if not os.path.isdir(args.src):
        print(f"error: SRC {args.src} is not a directory (it is extract's --out, holding "
              f"hs_<i>.safetensors)", file=sys.stderr)
        return 2
    indices = sorted(int(m.group(1)) for m in map(_SRC.fullmatch, os.listdir(args.src)) if m)
    if not indices:
        print(f"error: SRC {args.src} holds no hs_<i>.safetensors files (extract --out "
              f"writes them); nothing to convert", file=sys.stderr)
        return 2
    real_src = os.path.realpath(args.src)
    if os.path.commonpath([real_src, os.path.realpath(args.dst)]) == real_src:
        print(f"error: DST {args.dst} is extract's --out SRC {args.src} or a folder inside it: "
              f"its records would mix with the hs_<i> files; pass a DST outside SRC",
              file=sys.stderr)
        return 2
    if os.path.exists(args.dst) and not os.path.isdir(args.dst):
        print(f"error: DST {args.dst} exists and is not a directory", file=sys.stderr)
        return 2
    if args.loss_mask_from and not os.path.exists(args.loss_mask_from):
        print(f"error: --loss-mask-from {args.loss_mask_from} does not exist (pass the DATA "
              f"given to extract)", file=sys.stderr)
        return 2
    if any(not 0 <= t < 2 ** 63 for t in args.image_token_id or []):  # input_ids are int64
        print("error: --image-token-id must be a non-negative token id (int64)", file=sys.stderr)
        return 2
    try:
        mode = file_mode()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with_images = image_rows(args.src)
    try:
        check_image_ids(args.src, with_images, args.image_token_id)
        check_one_dump(args.src, indices)
        headers = (read_file_headers(args.src, indices)
                   if args.model or args.loss_mask_from else {})
        if args.model:
            check_num_layers(args.model, headers)
        generated = next((i for i, (_, meta) in sorted(headers.items())
                          if fmt.NUM_PROMPT_TOKENS_KEY in meta), None) if args.loss_mask_from else None
        if generated is not None:  # DATA's mask covers the prompt alone (format.output)
            raise ConvertError(f"--loss-mask-from {args.loss_mask_from}: hs_{generated}.safetensors "
                               f"holds generated tokens (extract --generate): its loss mask is the "
                               f"file's own (0 on the prompt, 1 on the response); run convert "
                               f"without --loss-mask-from")
        masks = (load_loss_masks(args.loss_mask_from, indices,
                                 {i: ids for i, (ids, _) in headers.items()})
                 if args.loss_mask_from else None)
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("torch") is None:
        print("error: convert writes torch.save records and needs torch, which is not "
              "installed here (pip install torch)", file=sys.stderr)
        return 2
    try:
        norm = load_final_norm(args.model, args.norm_key) if args.model else None
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kept = [i for i in indices if os.path.exists(specforge_path(args.dst, i))]
    try:
        check_kept_records(args.src, args.dst, kept,
                           {i: headers[i] for i in kept if i in headers} if args.model or
                           args.loss_mask_from else read_file_headers(args.src, kept))
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    made_dst = not os.path.isdir(args.dst)
    try:
        os.makedirs(args.dst, mode=dir_mode(mode), exist_ok=True)
    except OSError as e:
        print(f"error: DST {args.dst}: cannot make the directory ({e.strerror or e})",
              file=sys.stderr)
        return 2
    try:
        written = skipped = image_records = generated = 0
        for index in indices:
            dst = specforge_path(args.dst, index)
            if os.path.exists(dst):
                skipped += 1
                continue
            mask = masks[index] if masks is not None else None
            record, response_only = to_specforge_record(
                os.path.join(args.src, f"hs_{index}.safetensors"), norm, mask, args.image_token_id,
                with_images.get(index, 0))
            save_atomic(record, dst, mode)
            written += 1
            generated += response_only
            if with_images.get(index):
                image_records += 1
    except (ConvertError, fmt.DumpFormatError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        if made_dst and not written:
            _remove_empty_dirs(args.dst)  # nothing converted: leave no empty DST behind
        return 1
    if skipped:
        print(f"note: {skipped} record(s) already in {args.dst} were kept as they are, not "
              f"rewritten with this run's options (--loss-mask-from, --model); to redo them, "
              f"delete {args.dst} (or those data_<i>.ckpt files) and run again", file=sys.stderr)
    print(json.dumps({"written": written, "skipped_existing": skipped, "dst": os.path.abspath(args.dst),
                      "loss_mask": "from " + args.loss_mask_from if args.loss_mask_from else
                      f"0 on the prompt, 1 on the response in the {generated} generated file(s); all ones "
                      f"in the others" if generated else "all ones",
                      "final_norm": "applied" if norm is not None else "not applied",
                      "with_images": image_records}))
    return 0


def _remove_empty_dirs(dst: str) -> None:
    """Remove DST and its ``rows_*`` folders if they hold no file (best effort)."""
    try:
        for name in os.listdir(dst):
            path = os.path.join(dst, name)
            if os.path.isdir(path) and not os.listdir(path):
                os.rmdir(path)
        os.rmdir(dst)  # fails, as intended, when something is left in it
    except OSError:
        pass


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "convert",
        help="convert hs_<i>.safetensors to another trainer's format (SpecForge)",
        description="Convert extract's hs_<i>.safetensors (hidden_states [T, L, H], token_ids "
                    "[T] int64) into SpecForge's offline EAGLE-3 records: "
                    "DST/rows_<g>-<g+5000>/data_<i>.ckpt, each a torch.save'd dict of "
                    "input_ids [T] int64, loss_mask [T] int64, aux_hidden_state [1, T, (L-1)*H] "
                    "(every slot but the last) and hidden_state [1, T, H] (the last slot, after "
                    "the model's final norm), in the files' dtype (fp8 files: bf16). Existing "
                    "records are kept (resume).",
        epilog="Exit codes: 0 every record written or already there, 1 a file could not be "
               "converted (named), 2 bad input (nothing written). More: "
               "docs/client.md.",
    )
    p.add_argument("--to", default="specforge", choices=["specforge"],
                   help="target format; specforge, the only one, is the default")
    p.add_argument("src", help="directory with hs_<i>.safetensors (extract --out)")
    p.add_argument("dst", help="output directory (rows_<g>-<g+5000>/data_<i>.ckpt)")
    p.add_argument("--model", default=None, help="HF checkpoint dir: final norm weight + rms_norm_eps; its num_hidden_layers "
                        "must equal the files' num_layers (this or --no-final-norm is required)")
    p.add_argument("--norm-key", default=None, help="tensor name of the final norm weight in --model (default: the first of "
                        + ", ".join(NORM_KEYS) + " found)")
    p.add_argument("--no-final-norm", action="store_true",
                   help="write the pre-norm last layer as hidden_state (not what stock SpecForge expects)")
    p.add_argument("--loss-mask-from", default=None,
                   help="DATA given to extract, with loss_mask per row (default: all ones); "
                        "refused for files with output rows (extract --generate), whose mask is "
                        "their own: 0 on the prompt, 1 on the generated tokens")
    p.add_argument("--image-token-id", type=int, action="append", default=None, metavar="ID",
                   help="token id of image placeholder positions, given loss_mask 0 (repeatable; "
                        "default: each file's metadata image_token_id); needed for prompts with "
                        "images whose files do not name it")
    p.set_defaults(func=main)
