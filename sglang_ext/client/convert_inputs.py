"""What ``sglang-ext convert`` reads besides the hs_<i> files, each checked before a record
is written (``client.convert``'s module doc says what it does with them):

- the hs_<i> files themselves: one dump's, one layer set, hidden size and record dtype
  (``check_one_dump``);
- ``--model DIR``: the final RMSNorm's weight and eps (``load_final_norm``) and the layer
  count every file's metadata must agree with (``check_num_layers``);
- ``--loss-mask-from DATA``: one ``loss_mask`` per row, its ``input_ids`` compared with the
  file's ``token_ids`` (``load_loss_masks``);
- images: the rows ``SRC/manifest.jsonl`` marks as prompts with images (``image_rows``) and
  the image token ids a file's metadata names (``image_token_ids``, ``check_image_ids``).

Every refusal is a ``ConvertError`` of one sentence (``convert`` exits 2 before writing,
or 1 naming the file).
"""

from __future__ import annotations

import json
import os
from typing import Dict, Optional, Sequence, Tuple

from sglang_ext import format as fmt
from sglang_ext.client.dataset import DataError, iter_rows
from sglang_ext.client.files import regular_or_why

MANIFEST = "manifest.jsonl"  # extract's (client.manifest.MANIFEST_NAME), in SRC
NORM_KEYS = (
    "model.norm.weight",
    "language_model.model.norm.weight",
    "model.language_model.norm.weight",
)


class ConvertError(ValueError):
    """A refusal of ``convert`` (one sentence)."""


def model_config(model_dir: str) -> dict:
    """``--model``'s ``config.json`` as a dict. Raises ``ConvertError`` when the folder is
    missing, has no ``config.json``, or it is not readable JSON."""
    if not os.path.isdir(model_dir):
        raise ConvertError(f"--model {model_dir} is not a directory: pass the model's Hugging "
                           f"Face checkpoint folder (config.json + *.safetensors)")
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ConvertError(f"--model {model_dir} has no config.json: pass the model's Hugging "
                           f"Face checkpoint folder (config.json + *.safetensors)")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
        return config
    except (OSError, ValueError, RecursionError) as e:
        raise ConvertError(f"{config_path} is not readable JSON: {e}") from None


def load_final_norm(model_dir: str, key: Optional[str] = None) -> Tuple["object", float]:
    """``(weight [H] float32, eps)`` of the model's final RMSNorm from a HF checkpoint dir.

    Raises ``ConvertError`` (the folder lacks ``config.json``, ``rms_norm_eps`` or the
    weight)."""
    from safetensors import safe_open

    config = model_config(model_dir)
    eps = config.get("rms_norm_eps")
    if eps is None:
        eps = (config.get("text_config") or {}).get("rms_norm_eps")
    if eps is None:
        raise ConvertError(f"{model_dir}/config.json has no rms_norm_eps")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise ConvertError(f"{model_dir}/config.json's rms_norm_eps {str(eps)[:80]!r} is not a "
                           f"number")
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (OSError, ValueError, RecursionError, TypeError, KeyError):
            raise ConvertError(f"--model {model_dir}: model.safetensors.index.json is not JSON "
                               f"with a weight_map (tensor name -> file)") from None
    else:
        single = os.path.join(model_dir, "model.safetensors")
        if not os.path.exists(single):
            raise ConvertError(f"{model_dir}: no model.safetensors(.index.json)")
        try:
            with safe_open(single, framework="pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - SafetensorError and the OS's words alike
            raise ConvertError(f"--model {model_dir}: cannot read model.safetensors "
                               f"({_first_line(e)})") from None
    candidates = [key] if key else [k for k in NORM_KEYS if k in weight_map]
    if not candidates or candidates[0] not in weight_map:
        raise ConvertError(
            f"{model_dir}: final norm weight not found (tried {list(NORM_KEYS) if not key else key}); "
            f"pass --norm-key"
        )
    name, file = candidates[0], str(weight_map[candidates[0]])
    try:
        with safe_open(os.path.join(model_dir, file), framework="pt") as f:
            weight = f.get_tensor(name).float()
    except Exception as e:  # noqa: BLE001 - a missing shard, a truncated file
        raise ConvertError(f"--model {model_dir}: cannot read {name} from {file} "
                           f"({_first_line(e)})") from None
    if weight.dim() != 1:
        raise ConvertError(f"--model {model_dir}: {name} has shape {list(weight.shape)}, not "
                           f"[hidden_size]; pass --norm-key naming the final norm")
    return weight, float(eps)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def model_num_layers(model_dir: str) -> Optional[int]:
    """``num_hidden_layers`` of ``--model``'s ``config.json`` (or its ``text_config``), None
    when it names none. Raises ``ConvertError`` (not a folder, no readable config.json)."""
    config = model_config(model_dir)
    n = config.get("num_hidden_layers")
    if n is None and isinstance(config.get("text_config"), dict):
        n = config["text_config"].get("num_hidden_layers")
    return int(n) if isinstance(n, int) else None


def read_file_headers(src: str, indices: Sequence[int]) -> Dict[int, Tuple[list, dict]]:
    """``index -> (token_ids, metadata)`` of ``SRC/hs_<i>.safetensors`` (token ids as a
    list of ints, the ``__metadata__`` dict), read with safetensors' numpy reader (no
    torch; hidden states are not read). A file that cannot be read is left out: the
    conversion names it (exit 1)."""
    from safetensors import safe_open

    out: Dict[int, Tuple[list, dict]] = {}
    for index in indices:
        try:
            path = os.path.join(src, f"hs_{index}.safetensors")
            if regular_or_why(path, follow_symlinks=True):  # a FIFO would block the open:
                continue  # reported when converted
            with safe_open(path, framework="numpy") as f:
                out[index] = (f.get_tensor(fmt.KEY_TOKEN_IDS).tolist(), dict(f.metadata() or {}))
        except Exception:  # noqa: BLE001 - a truncated or foreign file: reported when converted
            continue
    return out


_RECORD_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "bfloat16",  # fp8: dequantized to bf16
                  "F16": "float16", "F32": "float32", "F64": "float64"}


def check_one_dump(src: str, indices: Sequence[int]) -> None:
    """Raise ``ConvertError`` when ``SRC``'s files are not of one dump: a file whose layer
    ids (metadata ``layer_ids``, else its slot count), hidden size or record dtype (fp8:
    bfloat16) differ from the first file's. Only headers are read; a file that cannot be
    read is left out (the conversion names it)."""
    from safetensors import safe_open

    first: Optional[Tuple[int, list, int, str]] = None
    for index in indices:
        path = os.path.join(src, f"hs_{index}.safetensors")
        try:
            if regular_or_why(path, follow_symlinks=True):
                continue
            with safe_open(path, framework="numpy") as f:
                hs = f.get_slice(fmt.KEY_HIDDEN_STATES)
                shape, dtype = hs.get_shape(), hs.get_dtype()
                meta = f.metadata() or {}
            layers = json.loads(meta["layer_ids"]) if "layer_ids" in meta else f"{shape[1]} slots"
            got = (index, layers, int(shape[2]), _RECORD_DTYPES.get(dtype, dtype.lower()))
        except Exception:  # noqa: BLE001 - a truncated or foreign file: reported when converted
            continue
        if first is None:
            first = got
            continue
        for k, what in ((1, "layer ids"), (2, "hidden size"), (3, "dtype")):
            if got[k] != first[k]:
                raise ConvertError(
                    f"hs_{index}.safetensors has {what} {str(got[k])[:80]}, "
                    f"hs_{first[0]}.safetensors {str(first[k])[:80]}: SRC holds files of two dumps, whose records one drafter "
                    f"cannot train on together; convert each dump's files into its own DST")


def check_num_layers(model_dir: str, headers: Dict[int, Tuple[list, dict]]) -> None:
    """Raise ``ConvertError`` when ``--model``'s ``num_hidden_layers`` differs from a
    file's metadata ``num_layers`` (the norm of another model would be applied)."""
    n_model = model_num_layers(model_dir)
    if n_model is None:
        return
    for index, (_, meta) in sorted(headers.items()):
        try:
            n_file = int(meta["num_layers"])
        except (KeyError, ValueError):
            continue
        if n_file != n_model:
            raise ConvertError(
                f"--model {model_dir} has num_hidden_layers {n_model}, but hs_{index}.safetensors "
                f"was dumped from a model with {n_file} layers (metadata num_layers): pass the "
                f"model the files were dumped from")


def load_loss_masks(data: str, indices: Sequence[int],
                    token_ids: Optional[Dict[int, list]] = None) -> Dict[int, list]:
    """``index -> loss_mask`` of DATA's rows ``indices`` (row i belongs to hs_<i>, rows
    counted from 0 as ``extract`` counts them). Raises ``ConvertError`` when DATA has too
    few rows, one of those rows has no ``loss_mask``, or (``token_ids``: index -> the
    file's token ids) a row's ``input_ids`` differ from its file's token ids (the message
    names the row and the first differing position), a ``loss_mask`` that is not 0s and 1s,
    or (``token_ids``) one of another length than its file's tokens. Rows with ``messages``
    instead of ``input_ids`` are not compared to the file's ids."""
    wanted = set(indices)
    masks: Dict[int, list] = {}
    n_rows = 0
    try:
        for index, row, where in iter_rows(data):
            n_rows = index + 1
            if index not in wanted:
                continue
            mask = row.get("loss_mask")
            if mask is None:
                raise ConvertError(f"--loss-mask-from {data}: {where} has no loss_mask")
            if hasattr(mask, "tolist"):  # a datasets / numpy column
                mask = mask.tolist()
            if not isinstance(mask, list) or not all(isinstance(v, int) and v in (0, 1) for v in mask):
                raise ConvertError(f"--loss-mask-from {data}: {where}'s loss_mask must be a list "
                                   f"of 0 and 1 (one per token)")
            masks[index] = mask
            ids = row.get("input_ids")
            if token_ids is not None and ids is not None and index in token_ids:
                _require_same_ids(data, where, index, list(ids.tolist() if hasattr(ids, "tolist")
                                                           else ids), token_ids[index])
            if token_ids is not None and index in token_ids and len(mask) != len(token_ids[index]):
                raise ConvertError(f"--loss-mask-from {data}: {where}'s loss_mask has {len(mask)} "
                                   f"values for hs_{index}.safetensors' {len(token_ids[index])} "
                                   f"tokens")
    except DataError as e:
        raise ConvertError(f"--loss-mask-from: {e}") from None
    except OSError as e:
        raise ConvertError(f"--loss-mask-from {data}: cannot read it ({e.strerror or e})") from None
    if indices and max(indices) >= n_rows:
        raise ConvertError(
            f"--loss-mask-from {data} has {n_rows} row(s), but SRC holds hs_{max(indices)}: it "
            f"needs at least {max(indices) + 1} rows (row i is hs_<i>'s, counted from 0); pass "
            f"the DATA given to extract")
    return masks


def _require_same_ids(data: str, where: str, index: int, row_ids: list, file_ids: list) -> None:
    if row_ids == file_ids:
        return
    pos = next((k for k, (a, b) in enumerate(zip(row_ids, file_ids)) if a != b),
               min(len(row_ids), len(file_ids)))
    at = (f"position {pos} (row {row_ids[pos]}, file {file_ids[pos]})"
          if pos < min(len(row_ids), len(file_ids))
          else f"position {pos} (row has {len(row_ids)} tokens, file {len(file_ids)})")
    raise ConvertError(f"--loss-mask-from {data}: {where}'s input_ids differ from "
                       f"hs_{index}.safetensors' token_ids at {at}: its loss_mask belongs to "
                       f"another prompt; pass the DATA given to extract")


def image_token_ids(meta: Dict[str, str]) -> Optional[frozenset]:
    """The image token ids a file's metadata names (``image_token_id``: an int or a JSON
    list of ints, as text), None when it names none. Raises ``ConvertError`` for a value
    that is neither."""
    value = meta.get("image_token_id")
    if value is None:
        return None
    try:
        got = json.loads(value)
        got = [got] if isinstance(got, int) else got
        if not isinstance(got, list) or not got or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2 ** 63 for t in got):
            raise ValueError
    except (ValueError, RecursionError):  # RecursionError: nested past Python's limit
        raise ConvertError(f"metadata image_token_id {value[:80]!r} is not a token id or a "
                           f"list of them; pass --image-token-id") from None
    return frozenset(got)


def image_rows(src: str) -> Dict[int, int]:
    """``index -> image parts`` of the rows ``SRC/manifest.jsonl`` (extract's) marks as
    prompts with images (the last line of an index wins); empty without a readable
    manifest (a SRC copied without it: then only the files' metadata tells)."""
    out: Dict[int, int] = {}
    path = os.path.join(src, MANIFEST)
    try:
        if regular_or_why(path, follow_symlinks=True):
            return out
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except (ValueError, RecursionError):  # a line nested past Python's limit too
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("index"), int):
                    n = rec.get("images")
                    out[rec["index"]] = n if isinstance(n, int) and n > 0 else 0
    except OSError:
        return {}
    return {i: n for i, n in out.items() if n}


def check_image_ids(src: str, rows: Dict[int, int], flag: Optional[Sequence[int]]) -> None:
    """Raise ``ConvertError`` when a row with images has no image token id to mask: no
    ``--image-token-id`` and its file's metadata names none."""
    if flag or not rows:
        return
    headers = read_file_headers(src, sorted(rows))
    for index in sorted(rows):
        if index in headers and image_token_ids(headers[index][1]) is None:
            raise ConvertError(f"hs_{index}.safetensors holds a prompt with {rows[index]} image(s) "
                               f"({MANIFEST}), but its metadata names no image_token_id: pass "
                               f"--image-token-id ID (the model's image placeholder id, e.g. "
                               f"config.json's image_token_id) so that those positions are "
                               f"left out of the loss")
