"""DATA, the dataset ``extract`` sends: its rows, counted from 0 (row ``i`` becomes ``hs_<i>``).

DATA is a JSONL file (one JSON object per line with ``input_ids``, or ``messages`` and a
``--tokenizer``) or a directory written by ``datasets.Dataset.save_to_disk``. Every problem
is a ``DataError``: one sentence naming the row (``row 3 (line 5 of data.jsonl)``), except a
malformed image part, which fails only its row (``Row.error``). A row whose ``messages``
hold image parts (``sglang_ext.client.images``) is sent through ``/v1/chat/completions``
(``Row.chat``; no tokenizer needed); its ``input_ids``, if it has them (speculators'
prepared rows), are what the server's prompt token ids must equal.
``convert --loss-mask-from`` reads the same rows through ``iter_rows``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from sglang_ext.client.images import (
    ChatPrompt,
    ImageAccess,
    ImagePartError,
    chat_prompt,
    has_image_parts,
)


class DataError(ValueError):
    """DATA cannot be read (bad row, messages without --tokenizer, ...)."""


@dataclass
class Row:
    """One row to send: its index in DATA (from 0) and its prompt's token ids; for a row
    with images, ``chat`` (its chat request) and ``input_ids`` None unless the row gives
    them; ``error``: why the row cannot be sent (a malformed image part), failing it alone."""

    index: int
    input_ids: Optional[List[int]]
    chat: Optional[ChatPrompt] = None
    error: Optional[str] = None
    where: str = ""  # the row in messages: "row 3 (line 5 of data.jsonl)" (iter_rows)

    @property
    def name(self) -> str:
        """How messages name the row: ``where``, else ``row <index>``."""
        return self.where or f"row {self.index}"


def _input_ids(row: Dict[str, Any], where: str) -> List[int]:
    ids = row["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2 ** 63 for t in ids
    ):
        raise DataError(f"{where}: input_ids must be a list of non-negative integers below 2**63 "
                        f"(the files' token_ids are int64)")
    if not ids:
        raise DataError(f"{where} has no tokens")
    return ids


def make_row(index: int, row: Dict[str, Any], where: str, tokenizer,
             access: ImageAccess = ImageAccess(), generate: bool = False) -> Row:
    """The ``Row`` to send for DATA's row. Raises ``DataError``; a malformed image part, or
    one whose URL ``access`` does not forward, gives a ``Row`` with ``error`` (that row
    alone fails). ``generate`` (``extract --generate``): the prompt only, ``messages``
    without their final assistant turn and with the chat template's generation prompt;
    a row with images fails alone."""
    if generate and has_image_parts(row.get("messages")):
        return Row(index, None, error=f"{where}: --generate sends token ids to /generate; rows "
                                      f"with images are not supported with --generate", where=where)
    if has_image_parts(row.get("messages")):
        try:
            chat = chat_prompt(row["messages"], access)
        except ImagePartError as e:
            return Row(index, None, error=f"{where}: {e}", where=where)
        ids = _input_ids(row, where) if row.get("input_ids") is not None else None
        return Row(index, ids, chat=chat, where=where)
    return Row(index, _ids_from_row(row, where, tokenizer, generate), where=where)


def _ids_from_row(row: Dict[str, Any], where: str, tokenizer, generate: bool = False) -> List[int]:
    if row.get("input_ids") is not None:
        ids = _input_ids(row, where)
    elif row.get("messages") is not None:
        if not isinstance(row["messages"], list):
            raise DataError(f"{where}: messages must be a list of {{role, content}} objects, "
                            f"not {type(row['messages']).__name__}")
        if tokenizer is None:
            raise DataError(f"{where} has messages without image parts but no --tokenizer was "
                            f"given (text-only chats are tokenized here; rows with images go "
                            f"through the server's chat template)")
        messages = row["messages"]
        if generate:  # the prompt of the response the server writes anew
            messages = list(messages)
            if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
                messages.pop()
                if not messages:
                    raise DataError(f"{where}: its messages are one assistant turn, which --generate "
                                    f"drops (the server writes the response anew): no prompt is left")
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generate)
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        except Exception as e:  # noqa: BLE001 - no chat template, messages of the wrong shape
            raise DataError(f"{where}: --tokenizer cannot turn its messages into tokens "
                            f"({type(e).__name__}: {one_line(e)})") from None
    else:
        raise DataError(f"{where} has neither input_ids nor messages")
    if not ids:
        raise DataError(f"{where} has no tokens")
    return ids


def load_dataset_dir(path: str):
    """The ``datasets.Dataset`` saved in directory ``path`` (``Dataset.save_to_disk``).

    Raises ``DataError`` (one sentence) when ``datasets`` is missing or ``path`` is not
    such a directory (a ``DatasetDict`` folder names its splits' folders)."""
    if not os.path.isfile(os.path.join(path, "state.json")):
        if os.path.isfile(os.path.join(path, "dataset_dict.json")):
            splits = sorted(n for n in os.listdir(path) if os.path.isdir(os.path.join(path, n)))
            raise DataError(f"--data {path} holds several splits (a DatasetDict): pass one of "
                            f"its folders, e.g. {os.path.join(path, splits[0] if splits else 'train')}")
        raise DataError(f"--data {path} is a directory but not a dataset saved by "
                        f"datasets' save_to_disk (no state.json in it); pass a JSONL file or "
                        f"such a directory")
    try:
        from datasets import load_from_disk
    except ImportError:
        raise DataError(f"--data {path} is a directory: reading it needs `pip install datasets`") from None
    try:
        return load_from_disk(path)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds for a damaged folder
        raise DataError(f"--data {path}: datasets cannot load it: {type(e).__name__}: {e}") from None


# The magic numbers of compressed files DATA may be given as (RFC 1952, RFC 8878, the xz
# and bzip2 formats), looked for only in a first line that is not UTF-8.
_COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"\xfd7zXZ\x00", "xz"),
               (b"BZh", "bzip2"))


def _jsonl_lines(path: str) -> Iterator[Tuple[int, str]]:
    """``(line number from 1, text)`` of a UTF-8 file, a byte order mark at its start left
    out (Windows tools and Excel's "CSV UTF-8" write one; RFC 8259 lets a reader ignore it).
    Raises ``DataError`` naming the file, line and byte offset (from the file's start) of
    the first byte that is not UTF-8, or a compressed file (``_COMPRESSED``) as such."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            skip = 3 if lineno == 1 and raw.startswith(b"\xef\xbb\xbf") else 0
            try:
                text = raw[skip:].decode("utf-8")
            except UnicodeDecodeError as e:
                kind = next((k for magic, k in _COMPRESSED if raw.startswith(magic)), None) if lineno == 1 else None
                if kind is not None:
                    raise DataError(f"--data {path} is {kind}-compressed, not JSONL text: decompress it "
                                    f"first") from None
                raise DataError(f"--data {path} is not UTF-8 text: byte {offset + skip + e.start} "
                                f"(line {lineno}) is 0x{raw[skip + e.start]:02x}") from None
            offset += len(raw)
            yield lineno, text


def iter_rows(path: str, tokenizer=None) -> Iterator[Tuple[int, Dict[str, Any], str]]:
    """``(index, row, where)`` for every row of DATA, in order.

    DATA is a JSONL file (one JSON object per line; blank lines skipped and not counted)
    or a directory written by ``datasets.Dataset.save_to_disk`` (speculators'
    ``prepare-data`` output: columns ``input_ids``, ``loss_mask``, ...). ``index`` counts
    rows from 0 (row ``i`` becomes ``hs_<i>``); ``where`` names the row in messages the
    same way everywhere: ``row 3 (line 5 of data.jsonl)``, or ``row 3`` for a dataset.
    Raises ``DataError``.
    """
    if os.path.isdir(path):
        dataset = load_dataset_dir(path)
        for index in range(len(dataset)):
            yield index, dataset[index], f"row {index}"
        return
    index = 0
    name = os.path.basename(path)
    for lineno, line in _jsonl_lines(path):
        if not line.strip():
            continue
        where = f"row {index} (line {lineno} of {name})"
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, a 5000-digit int, deep nesting
            raise DataError(f"{where}: not JSON this reader takes: {e}") from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: a row must be a JSON object")
        yield index, row, where
        index += 1


def count_rows(path: str) -> int:
    """Rows of DATA (blank JSONL lines not counted). Raises ``DataError`` (also for a
    file that is not UTF-8)."""
    if os.path.isdir(path):
        return len(load_dataset_dir(path))
    return sum(1 for _, line in _jsonl_lines(path) if line.strip())


def one_line(text: Any, limit: int = 200) -> str:
    """``str(text)`` on one line (whitespace runs -> one space), cut to ``limit`` characters
    with ``...``: an exception's message or an HTTP answer's body quoted in a message must
    not flood stderr (an HTML error page, a traceback)."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit] + "..."


def load_tokenizer(path: Optional[str]):
    """``transformers.AutoTokenizer`` from ``path`` (None for no path). Raises ``DataError``
    (one sentence naming the path) when transformers is not installed, ``path`` does not
    exist (and is no Hugging Face Hub id transformers can load) or holds no tokenizer."""
    if not path:
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(f"--tokenizer {path} needs transformers, which is not installed here "
                        f"(pip install transformers jinja2: chat templates need jinja2)") from None
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, ... here
        if not os.path.exists(path):
            raise DataError(f"--tokenizer {path} does not exist: pass the folder holding the "
                            f"tokenizer's files (e.g. the model's checkpoint folder)") from None
        raise DataError(f"--tokenizer {path}: transformers cannot load a tokenizer from it "
                        f"({type(e).__name__}: {one_line(e)})") from None


def rank_rows(data: str, tokenizer, world_size: int, rank: int,
              access: ImageAccess = ImageAccess(), generate: bool = False) -> Iterator[Row]:
    """The rows of DATA this rank sends (``index % world_size == rank``), as token ids;
    image URLs forwarded under ``access``; ``generate``: prompts only (``make_row``).
    Raises ``DataError``."""
    for index, row, where in iter_rows(data, tokenizer):
        if index % world_size == rank:
            yield make_row(index, row, where, tokenizer, access, generate)
