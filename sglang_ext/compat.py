"""The one adapter between ``sglang_ext`` and SGLang releases (the patches carry the rest).

Where releases differ in how sglang_ext must talk to them, this module detects the
mechanism (never a version number) and uses it:

- **server-args adjustments** (``check_server_args`` turns the radix cache off, ...):
  0.5.17 calls the check from ``ServerArgs.__post_init__`` and lets it assign fields;
  0.5.2x runs it as a step of the resolution pipeline (``arg_groups/pipeline.py``),
  seals the record while resolving and takes decisions through
  ``arg_groups.overrides.declare_resolution``; values are read through
  ``resolving_view`` so earlier steps' decisions are seen.
- **SGLang's embedded Rust server** (``rust_server_on``): 0.5.23's ``SGLANG_RUST_SERVER``.
- **the attention-TP rank** of a model runner: ``model_runner.ps`` (0.5.17) or
  ``sglang.srt.runtime_context.get_parallel()`` (0.5.2x).
- **the hidden-state mode decode CUDA graphs capture** (``capture_decode_rows``): 0.5.2x
  reads it from the published config (``get_exec().features``), changed through
  ``get_context().override``.
- **a request's reference to itself** in its ``custom_params`` (``release_request_cycle``):
  0.5.17 puts a strong one into every dict; 0.5.22 only with a custom logit processor,
  0.5.23 a weak proxy.

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


def rust_server_on() -> bool:
    """Whether SGLang serves through its embedded Rust server (``SGLANG_RUST_SERVER``,
    0.5.23, read by SGLang's own ``environ.envs``): it replaces the tokenizer manager and
    the OpenAI layer, and its output frames (``rust_server/server.py`` ``push_generation``)
    carry no ``customized_info``. False where SGLang has no such variable (0.5.17)."""
    try:
        from sglang.srt.environ import envs
    except ImportError:
        return False
    field = getattr(envs, "SGLANG_RUST_SERVER", None)
    return bool(field.get()) if field is not None else False


def attn_tp_rank(model_runner) -> int:
    """This process's rank in its attention-TP group."""
    ps = getattr(model_runner, "ps", None)
    if ps is None:
        from sglang.srt.runtime_context import get_parallel

        ps = get_parallel()
    rank = getattr(ps, "attn_tp_rank", None)
    return int(ps.tp_rank if rank is None else rank)


# The key Req.__init__ adds to a request's custom_params for custom logit processors
# (python/sglang/srt/managers/schedule_batch.py; sampling/custom_logit_processor.py reads it).
_REQ_KEY = "__req__"


def is_aborting(req) -> bool:
    """Whether SGLang has already decided to abort ``req`` (``req.to_finish`` a
    ``FINISH_ABORT``) though it has not finished yet. Such a request still runs a forward:
    an invalid one (``Req.set_finish_with_abort``: a bad session id, an image that did not
    load, a grammar that failed, a prompt over the context length...) with its prompt
    replaced by the one token 0 "to skip the long prefill" (schedule_batch.py, 0.5.23), an
    aborted one (``/abort_request``, a KV-cache shortage) with its own. Its answer is the
    abort's error; a file would hold rows of a prompt nobody sent."""
    to_finish = getattr(req, "to_finish", None)
    if to_finish is None:
        return False
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return isinstance(to_finish, FINISH_ABORT)


def release_request_cycle(req) -> None:
    """Drop ``custom_params["__req__"]`` from SGLang's ``req`` where it is a strong
    reference that nothing will read.

    0.5.17's ``Req.__init__`` adds ``"__req__": self`` to the ``custom_params`` of every
    request that has a dict there: a reference cycle (Req -> sampling_params ->
    custom_params -> Req), so a finished request, with its token-id lists, is freed by a
    cyclic garbage collection pass instead of its refcount. Only custom logit processors
    read the entry; 0.5.22 adds it only for them, 0.5.23 as a ``weakref.proxy``. Dumped
    requests carry ``custom_params`` whenever they ask for an early answer
    (``format.WAIT_PARAM``) or no dump (``format.DUMP_PARAM``). The dict is the request's
    own (``Req.__init__`` built it with ``|`` on a copy of the sampling params), so the
    entry is removed in place; a request with a custom logit processor, or an entry that
    is not ``req`` itself (0.5.23's proxy), is left as it is.
    """
    if getattr(req, "custom_logit_processor", None) is not None:
        return
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    if isinstance(params, dict) and params.get(_REQ_KEY) is req:
        del params[_REQ_KEY]


def capture_decode_rows(source: str) -> bool:
    """Raise this process's server-wide hidden-state mode to LAST where it is lower
    (``--return-hidden-states-mode`` unset, which ``check_server_args`` requires), so
    SGLang's decode CUDA graphs, captured after this, write each decode token's aux rows
    (``BaseRunner.return_hidden_states_mode``) and a decode batch's LAST mode matches the
    graph's (``DecodeCudaGraphRunner.can_run``) instead of falling back to eager. Only this
    scheduler process's config changes: the tokenizer manager still refuses requests for
    ``return_hidden_states``. ``source`` names the decision in SGLang's override log.
    Returns False where SGLang has no published config (0.5.17, unit tests)."""
    try:
        from sglang.srt.runtime_context import get_context, get_exec
        features = get_exec().features
    except (ImportError, ValueError):
        return False
    if features.return_hidden_states_mode is None and not features.enable_return_hidden_states:
        get_context().override(source, return_hidden_states_mode="last")
    return True
