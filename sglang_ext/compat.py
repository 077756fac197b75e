"""The one adapter between ``sglang_ext`` and SGLang releases (the patches carry the rest).

Where releases differ in how sglang_ext must talk to them, this module detects the
mechanism (never a version number) and uses it:

- **server-args adjustments** (``check_server_args`` turns the radix cache off, ...):
  0.5.17 calls the check from ``ServerArgs.__post_init__`` and lets it assign fields;
  0.5.2x runs it as a step of the resolution pipeline (``arg_groups/pipeline.py``),
  seals the record while resolving and takes decisions through
  ``arg_groups.overrides.declare_resolution``; values are read through
  ``resolving_view`` so earlier steps' decisions are seen.
- **the attention-TP rank** of a model runner: ``model_runner.ps`` (0.5.17) or
  ``sglang.srt.runtime_context.get_parallel()`` (0.5.2x).

Without SGLang installed (unit tests with stand-in objects) the 0.5.17 behaviour
applies: plain attribute reads and writes.
"""

from __future__ import annotations

from typing import Any


def _overrides(name: str):
    try:
        from sglang.srt.arg_groups import overrides
    except ImportError:
        return None
    return getattr(overrides, name, None)


def _is_record(server_args) -> bool:
    """True for a real SGLang ``ServerArgs`` (not a test stand-in)."""
    return type(server_args).__module__ == "sglang.srt.server_args"


def server_args_view(server_args) -> Any:
    """What to read option values from while ``check_server_args`` runs."""
    view = _overrides("resolving_view")
    if view is None or not _is_record(server_args):
        return server_args
    return view(server_args)


def adjust_server_args(server_args, source: str, **fields: Any) -> None:
    """Change option values during start-up checks (``source`` names the decision)."""
    declare = _overrides("declare_resolution")
    if declare is None or not _is_record(server_args):
        for name, value in fields.items():
            setattr(server_args, name, value)
        return
    declare(server_args, source, **fields)


def attn_tp_rank(model_runner) -> int:
    """This process's rank in its attention-TP group."""
    ps = getattr(model_runner, "ps", None)
    if ps is None:
        from sglang.srt.runtime_context import get_parallel

        ps = get_parallel()
    rank = getattr(ps, "attn_tp_rank", None)
    return int(ps.tp_rank if rank is None else rank)
