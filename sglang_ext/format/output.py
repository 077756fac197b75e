"""Files of requests that asked for their output rows: the prompt's rows, then the rows of
every generated token that was fed back to the model.

A request with ``custom_params {"hidden_states_output": true}`` (``OUTPUT_PARAM``; on
``/v1/completions`` also vLLM's ``kv_transfer_params {"include_output_tokens": true}``,
``VLLM_OUTPUT_PARAM``) has a prompt ``p`` of P tokens and generates G >= 1 tokens ``g``.
The model computes rows for ``p`` and for ``g[:-1]``: the last sampled token is never fed
back. Its file holds

- ``hidden_states`` ``[T, L, H]`` and ``token_ids`` ``[T]`` int64 with ``T = P + G - 1``
  and ``token_ids == p + g[:-1]``, exactly the ids the rows were computed from (vLLM's
  hidden-states connector saves ``all_token_ids[:-1]`` alike), same layer slots and dtype
  as a prompt-only file;
- metadata ``num_prompt_tokens`` (P) and ``last_token_id`` (``g[-1]``), decimal strings
  (``NUM_PROMPT_TOKENS_KEY``, ``LAST_TOKEN_ID_KEY``).

So the generated ids are ``token_ids[P:] + [last_token_id]``, and a trainer masks the
prompt (positions ``< P``) or the response from the file alone. A file without
``num_prompt_tokens`` is a prompt-only file (``output_rows`` returns None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

from .keys import LAST_TOKEN_ID_KEY, NUM_PROMPT_TOKENS_KEY
from .files import DumpFormatError

__all__ = ["OutputRows", "output_metadata", "fed_token_ids", "output_rows", "check_output_rows"]

_MAX_DIGITS = 19  # int64 token ids and counts


@dataclass(frozen=True)
class OutputRows:
    """What a file with output rows says of its request: ``num_prompt_tokens`` (P) and
    ``output_ids``, every generated id (G >= 1 of them, the last one never fed back)."""

    num_prompt_tokens: int
    output_ids: List[int]


def output_metadata(num_prompt_tokens: int, last_token_id: int) -> Dict[str, str]:
    """The metadata a file with output rows adds (str -> str, for ``build_metadata``'s
    ``extra``)."""
    return {NUM_PROMPT_TOKENS_KEY: str(int(num_prompt_tokens)), LAST_TOKEN_ID_KEY: str(int(last_token_id))}


def fed_token_ids(prompt_ids: Sequence[int], output_ids: Sequence[int]) -> List[int]:
    """The ``token_ids`` of the file of a request with prompt ``prompt_ids`` that generated
    ``output_ids`` (>= 1): the prompt, then every generated id but the last."""
    return list(prompt_ids) + list(output_ids)[:-1]


def _decimal(meta: Mapping[str, str], key: str, shown: str) -> int:
    value = meta.get(key)
    if not (isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= _MAX_DIGITS):
        if isinstance(value, str) and len(value) > 80:  # a hostile file's: megabytes
            value = f"{value[:80]!r} ({len(value)} characters)"
        else:
            value = repr(value)
        raise DumpFormatError(f"{shown}: metadata {key} {value} is not a non-negative decimal integer")
    return int(value)


def output_rows(token_ids: Sequence[int], metadata: Mapping[str, str],
                shown: str = "file") -> Optional[OutputRows]:
    """The ``OutputRows`` of a file (its ``token_ids`` as ints and ``__metadata__``), None
    for a prompt-only file (neither key). Raises ``DumpFormatError`` (one sentence naming
    ``shown``) when only one key is there, a value is not a decimal integer, or
    ``num_prompt_tokens`` is not in ``1..T``."""
    has = [k in metadata for k in (NUM_PROMPT_TOKENS_KEY, LAST_TOKEN_ID_KEY)]
    if not any(has):
        return None
    if not all(has):
        missing = LAST_TOKEN_ID_KEY if has[0] else NUM_PROMPT_TOKENS_KEY
        raise DumpFormatError(f"{shown}: a file with output rows needs metadata {NUM_PROMPT_TOKENS_KEY} "
                              f"and {LAST_TOKEN_ID_KEY}; {missing} is missing")
    p = _decimal(metadata, NUM_PROMPT_TOKENS_KEY, shown)
    last = _decimal(metadata, LAST_TOKEN_ID_KEY, shown)
    ids = [int(t) for t in token_ids]
    if not 1 <= p <= len(ids):
        raise DumpFormatError(f"{shown}: metadata {NUM_PROMPT_TOKENS_KEY} {p} is not within the "
                              f"file's 1..{len(ids)} tokens")
    return OutputRows(p, ids[p:] + [last])


def check_output_rows(token_ids: Sequence[int], metadata: Mapping[str, str],
                      prompt_ids: Optional[Sequence[int]] = None,
                      output_ids: Optional[Sequence[int]] = None, shown: str = "file") -> OutputRows:
    """Check a file with output rows against its request: ``prompt_ids`` (the prompt sent)
    and ``output_ids`` (the ids the answer says were generated), each when given. Returns
    its ``OutputRows``. Raises ``DumpFormatError`` (one sentence naming ``shown``) for a
    prompt-only file, malformed keys (``output_rows``), ``num_prompt_tokens`` other than
    the prompt's length, token ids that are not the prompt's then the generated ids but
    the last, or ``last_token_id`` other than the last generated id."""
    got = output_rows(token_ids, metadata, shown)
    if got is None:
        raise DumpFormatError(f"{shown}: no metadata {NUM_PROMPT_TOKENS_KEY}: the server wrote the "
                              f"prompt's rows only, not the generated tokens' (does it take "
                              f"custom_params hidden_states_output?)")
    ids, p = [int(t) for t in token_ids], got.num_prompt_tokens
    if prompt_ids is not None:
        prompt_ids = list(prompt_ids)
        if p != len(prompt_ids):
            raise DumpFormatError(f"{shown}: metadata {NUM_PROMPT_TOKENS_KEY} is {p}, the prompt "
                                  f"sent has {len(prompt_ids)} tokens")
        if ids[:p] != prompt_ids:
            raise DumpFormatError(f"{shown}: token ids differ from the prompt's at position "
                                  f"{_first_difference(ids[:p], prompt_ids)}")
    if output_ids is not None:
        output_ids = list(output_ids)
        if not output_ids:
            raise DumpFormatError(f"{shown}: the answer names no generated token (a file with "
                                  f"output rows needs at least one)")
        if len(ids) != p + len(output_ids) - 1:
            raise DumpFormatError(f"{shown}: {len(ids)} rows, not the {p} prompt + "
                                  f"{len(output_ids)} generated - 1 = {p + len(output_ids) - 1} "
                                  f"the answer's output_ids call for")
        if got.output_ids != output_ids:
            k = _first_difference(got.output_ids, output_ids)
            where = (f"{LAST_TOKEN_ID_KEY} {got.output_ids[-1]}" if k == len(output_ids) - 1
                     else f"token id {got.output_ids[k]} at position {p + k}")
            raise DumpFormatError(f"{shown}: generated token {k} is {where} in the file, "
                                  f"{output_ids[k]} in the answer's output_ids")
    return got


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
