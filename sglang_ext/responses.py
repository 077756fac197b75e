"""What a dumped request's response carries, in SGLang's main process.

The scheduler records a request's path (or error) with ``set_info`` (``hold_info`` first
for a request streamed with ``--incremental-streaming-output``); SGLang carries it to
the tokenizer manager in ``meta_info``, where ``finish_response`` waits for the file and
turns the entry into a plain value; ``openai_completion_extras`` then shapes a
``/v1/completions`` response as vLLM's hidden-states connector does, and
``openai_chat_extras`` a ``/v1/chat/completions`` one the same way. ``hooks`` forwards
SGLang's calls here. pydantic (SGLang's) is imported only when a response is shaped.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

from sglang_ext import format as fmt
from sglang_ext import trace

PATH_KEY, ERROR_KEY, PENDING_KEY = fmt.PATH_KEY, fmt.ERROR_KEY, fmt.PENDING_KEY
MANIFEST_KEY = fmt.MANIFEST_KEY


class TokenFill:
    """A ``customized_info`` entry that stays aligned with the output tokens however far
    SGLang slices it: None at output positions before ``start``, ``value`` from ``start``
    on (all None while ``value`` is None: a key held, not set yet).

    For a request streamed with ``--incremental-streaming-output``: the tokenizer manager
    cuts each output's ``meta_info[key]`` to that output's tokens
    (``_slice_streaming_output_meta_info``: the list received so far, from
    ``ReqState.last_output_offset``), so a plain ``[value]`` recorded once is in the first
    output only, and a key first sent late is cut away whole (nothing was received for the
    outputs before it). Holding the key from the first output and answering every slice
    ``[a:b]`` with one entry per position keeps the list as long as the output ids, so
    the last output carries the value. A slice with no position (``b <= a``: an output
    without new tokens, a stop string trimmed them) gets the entry at ``a``: one more
    entry only shifts what later outputs carry by one, the value still comes last."""

    __slots__ = ("start", "value")

    def __init__(self, start: int = 0, value=None):
        self.start, self.value = start, value

    def _at(self, position: int):
        return None if position < self.start else self.value

    def __getitem__(self, index):
        if isinstance(index, int):
            return self._at(index)
        if not isinstance(index, slice) or index.step not in (None, 1) or index.stop is None:
            raise TypeError(f"TokenFill takes an index or a slice [a:b], not {index!r}")
        a = index.start or 0
        return [self._at(p) for p in range(a, max(index.stop, a + 1))]

    def __repr__(self) -> str:
        return f"TokenFill({self.start}, {self.value!r})"


def hold_info(req, keys) -> None:
    """Make ``req`` carry each of ``keys`` (None until ``set_info`` records it) from its
    next output on, aligned with its tokens (``TokenFill``): for a request streamed with
    ``--incremental-streaming-output``, held before its first output (the prefill hook).
    A key already recorded is left as it is."""
    if req.customized_info is None:
        req.customized_info = {}
    for key in keys:
        req.customized_info.setdefault(key, TokenFill())


def set_info(req, key: str, value) -> None:
    """Record a per-request value where SGLang carries it to ``meta_info``.

    Upstream ships ``req.customized_info[key]``, a list aligned with the output tokens, to
    the tokenizer manager in each output, sliced to the tokens that output carries
    (``values[send_token_offset:len(output_ids_through_stop)]``,
    ``output_streamer._GenerationStreamAccumulator.accept``); the tokenizer manager adds
    the slices up into ``meta_info[key]`` and ``finish_response`` turns the list back into
    the single value. A request is sent before it ends when it streams, and every
    ``SGLANG_FORCE_STREAM_INTERVAL`` (50) tokens when it does not, so the value fills every
    position not sent yet (``req.send_token_offset`` on): ``[None] * sent + [value] *
    max(1, len(output_ids) - sent)``. The next output carries it, whether it is recorded
    before the step's token is appended (the prefill hook) or after (``on_outputs``).
    A key ``hold_info`` held (incremental streaming) becomes ``TokenFill(sent, value)``:
    every later output carries it too, as the tokenizer manager then keeps only each
    output's own slice.
    """
    if req.customized_info is None:
        req.customized_info = {}
    sent = int(getattr(req, "send_token_offset", 0) or 0)
    if isinstance(req.customized_info.get(key), TokenFill):
        req.customized_info[key] = TokenFill(sent, value)
        return
    unsent = max(1, len(getattr(req, "output_ids", None) or ()) - sent)
    req.customized_info[key] = [None] * sent + [value] * unsent


def drop_info(req, *keys: str) -> None:
    """Remove ``keys`` that ``set_info`` recorded on ``req`` (absent ones are ignored); a
    held key (``hold_info``) stays held, None from now on."""
    info = req.customized_info or {}
    for key in keys:
        if isinstance(info.get(key), TokenFill):
            info[key] = TokenFill()
        else:
            info.pop(key, None)


def _first(value):
    """The first non-None item of a list (SGLang's per-token padding), else ``value``."""
    if isinstance(value, list):
        return next((v for v in value if v is not None), None)
    return value


# ---- tokenizer manager (main process, asyncio) -----------------------------------------
async def finish_response(meta_info: dict) -> None:
    """Before a finished request's response goes out: wait for its file, report it.

    ``meta_info[hidden_states_path]`` becomes the file's absolute path once the writer
    has released it; if the write failed, the key is replaced by ``hidden_states_error``.
    A request that asked not to wait (``custom_params`` ``hidden_states_wait: false``)
    is answered at once with the path and ``hidden_states_pending: true``; a failed write
    then shows as ``<path>.error`` when the lock goes (``format.wait_complete``).
    A store-sink request (``hidden_states_manifest``) is always answered at once: the
    reader polls the store for the object or its error marker (docs/store.md).
    """
    # Upstream pads a key that another request of the same output batch has with None
    # (output_streamer): [None] means "not set for this request".
    for key in fmt.RESPONSE_KEYS:
        if key in meta_info:
            value = _first(meta_info[key])
            if value is None:
                del meta_info[key]
            else:
                meta_info[key] = value
    if PATH_KEY not in meta_info or meta_info.get(PENDING_KEY):
        return
    path = meta_info[PATH_KEY]
    t_meta = trace.now()
    try:
        error = await fmt.wait_complete_async(path)
    except TimeoutError as e:
        error = str(e)
    if trace.enabled():
        trace.record("response", name=os.path.basename(path), t_meta=t_meta, t_done=trace.now(),
                     error=error)
    if error is not None:
        del meta_info[PATH_KEY]
        meta_info[ERROR_KEY] = error


ABORTED_MESSAGE = ("the request was aborted while it waited (never scheduled, or retracted under "
                   "KV-cache pressure and not scheduled again), so its output rows were not dumped")


def _custom_params(obj) -> dict:
    """``custom_params`` of a ``GenerateReqInput``'s ``sampling_params`` (a dict), else {}."""
    sampling = getattr(obj, "sampling_params", None)
    params = sampling.get("custom_params") if isinstance(sampling, dict) else None
    return params if isinstance(params, dict) else {}


def abort_response(server_args, obj, meta_info: dict) -> None:
    """The response of a request the scheduler ended outside its output stream (SGLang's
    abort echo, ``TokenizerManager._handle_abort_req``: aborted while it waited, whether
    never scheduled or retracted under KV-cache pressure and not scheduled again, or
    refused by a full queue). Such a request never reaches ``DumpSession.on_outputs``, and
    the echo carries no ``customized_info``, so without this a request that asked for its
    output rows would end with neither a file nor an error: it gets
    ``hidden_states_error`` = ``ABORTED_MESSAGE`` in ``meta_info`` (modified in place).

    ``obj``: its ``GenerateReqInput`` (``sampling_params`` a dict). Nothing happens when
    dumping is off (``server_args.dump_hidden_states_dir`` unset), for SGLang's own
    requests (``format.is_internal``), for a request without ``custom_params``
    ``hidden_states_output: true``, or one that the server would not dump anyway
    (``hidden_states_dump: false``, or outside ``KIMI_SGLANG_SAMPLE_RATE``: the rate is a
    function of the rid, ``sampling.sample_point``). A prompt-only request is left as it
    was (an abort before its prompt ran has no rows to name)."""
    if getattr(server_args, "dump_hidden_states_dir", None) is None:
        return
    rid = meta_info.get("id", getattr(obj, "rid", None))
    params = _custom_params(obj)
    if params.get(fmt.OUTPUT_PARAM) is not True or not isinstance(rid, str) or fmt.is_internal(rid):
        return
    asked = params.get(fmt.DUMP_PARAM)
    if asked is False:
        return
    if asked is not True:
        from sglang_ext.config import sampling_settings
        from sglang_ext.sampling import sample_point

        try:
            rate = sampling_settings()["sample_rate"]
        except ValueError:  # checked at start-up; a later change of the variable is not ours
            rate = 1.0
        if rate < 1 and sample_point(rid) >= rate:
            return
    meta_info[ERROR_KEY] = ABORTED_MESSAGE


# ---- OpenAI-compatible /v1/completions and /v1/chat/completions (main process) ---------------------------------
def openai_sampling_params(server_args, request, sampling_params: dict) -> dict:
    """The sampling parameters of an OpenAI ``/v1/completions`` or ``/v1/chat/completions``
    request, as SGLang converts it for the tokenizer manager, with vLLM's spelling of
    "dump the output rows too" taken as ours: ``kv_transfer_params``
    ``{"include_output_tokens": true}`` (vLLM's hidden-states connector;
    ``format.VLLM_OUTPUT_PARAM``) sets ``custom_params`` ``{"hidden_states_output": true}``
    (``format.OUTPUT_PARAM``), whatever ``custom_params`` said of it, as the stand-in
    server does (``tools.standin``). Only JSON true turns it on; any other value, and every
    other key of ``kv_transfer_params``, is ignored.

    ``request``: SGLang's pydantic request (``kv_transfer_params``: a dict or None, the
    field patch 0011 declares); ``sampling_params``: the dict SGLang built (not modified:
    a new dict is returned when something changes, with a new ``custom_params``). Returned
    unchanged when dumping is off (``server_args.dump_hidden_states_dir`` unset)."""
    if getattr(server_args, "dump_hidden_states_dir", None) is None:
        return sampling_params
    kv = getattr(request, "kv_transfer_params", None)
    if not isinstance(kv, dict) or kv.get(fmt.VLLM_OUTPUT_PARAM) is not True:
        return sampling_params
    custom = sampling_params.get("custom_params")
    custom = dict(custom) if isinstance(custom, dict) else {}
    custom[fmt.OUTPUT_PARAM] = True
    return {**sampling_params, "custom_params": custom}


class HiddenStatesDumpError(RuntimeError):
    """The dump of a request failed; SGLang's OpenAI layer answers HTTP 500 (retryable)."""


_KV_RESPONSE_CLASSES: dict = {}


def _with_kv_transfer_params(cls):
    """``cls`` (a pydantic response model) plus a ``kv_transfer_params`` field, cached."""
    sub = _KV_RESPONSE_CLASSES.get(cls)
    if sub is None:
        import pydantic

        sub = pydantic.create_model(
            cls.__name__,
            __base__=cls,
            kv_transfer_params=(Optional[Dict[str, Any]], None),
        )
        _KV_RESPONSE_CLASSES[cls] = sub
    return sub


def openai_completion_extras(response, ret):
    """Make a non-streaming ``/v1/completions`` response look like vLLM's with its
    hidden-states connector, so speculators' offline client works unchanged.

    ``ret``: the generate results the response was built from (their ``meta_info`` holds
    ``hidden_states_path`` after ``finish_response``). Adds top-level
    ``kv_transfer_params = {"hidden_states_path": <first choice's file>}`` (plus
    ``hidden_states_paths``, one per choice, when there are several). The file is complete
    and its ``.lock`` already gone when this runs (``finish_response`` waited), which
    speculators reads as "done". (A request with ``custom_params``
    ``{"hidden_states_wait": false}`` gets the path while the ``.lock`` still exists;
    speculators' client cannot use that: its lock wait removes the lock file itself.)
    ``prompt_token_ids`` per choice needs nothing here: SGLang already returns it
    when the request says ``return_token_ids``.

    Store sink (``meta_info`` holds ``hidden_states_manifest``): ``kv_transfer_params``
    is the first choice's transfer manifest itself (version 1, as vLLM's Mooncake
    hidden-states connector returns it: speculators takes ``handle`` from it and hands
    the whole dict to ``MooncakeTransfer.get_generated``), plus
    ``hidden_states_manifests``, one per choice, when there are several.

    A failed dump raises ``HiddenStatesDumpError``: SGLang answers HTTP 500, which
    speculators' client retries. Without dump keys in ``meta_info`` (dumping off) the
    response is returned unchanged; so is one that is not a pydantic model (SGLang's
    error responses, ``ORJSONResponse``).
    """
    return _with_dump_extras(response, ret)


def openai_chat_extras(response, ret):
    """The same extras as ``openai_completion_extras`` on a non-streaming
    ``/v1/chat/completions`` response (patch 0008): top-level ``kv_transfer_params``
    with the file's ``hidden_states_path`` (or the store sink's manifest), one per choice
    in ``hidden_states_paths`` / ``hidden_states_manifests`` when ``n > 1``; a failed dump
    raises ``HiddenStatesDumpError`` (HTTP 500); dumping off, or an error response, is
    returned unchanged.

    Chat is how a prompt with images comes in (``image_url`` parts: http(s) URLs,
    ``file://`` paths, base64 data URLs): the file's ``token_ids`` are the ids the model
    ran, chat template applied and each image placeholder expanded to its vision tokens
    (``session.dumped_token_ids``); with ``return_prompt_token_ids`` (or
    ``return_token_ids``) SGLang returns the same ids per choice as ``prompt_token_ids``.
    """
    return _with_dump_extras(response, ret)


def openai_stream_extras(chunk_cls, metas: Dict[int, dict], **fields):
    """The dump's chunk of a streaming ``/v1/completions`` or ``/v1/chat/completions``
    response (patch 0012), sent after every choice's last chunk and before the usage one:
    a response-level chunk (``chunk_cls``, SGLang's stream response model, with
    ``choices=[]`` and ``fields``: ``created``, ``model``; ``id`` the first choice's, as
    its ``sglext`` chunk) plus top-level ``kv_transfer_params``, as the non-streaming
    response has it (``openai_completion_extras``): the first choice's
    ``hidden_states_path`` (or the store sink's manifest), all of them in
    ``hidden_states_paths`` / ``hidden_states_manifests`` when there are several. A failed
    dump cannot be an HTTP 500 once the stream has begun: ``kv_transfer_params`` then says
    ``hidden_states_error`` (the first failed choice's; ``hidden_states_errors``, one per
    choice, None where none failed, when there are several).

    ``metas``: choice index -> the ``meta_info`` of its last output (``finish_response``
    has made the dump keys plain values). Returns None when no choice has a dump key
    (dumping off, skipped requests, no output at all), so nothing is sent."""
    last = [metas[i] or {} for i in sorted(metas)]
    if not any(m.get(k) for m in last for k in (PATH_KEY, ERROR_KEY, MANIFEST_KEY)):
        return None
    chunk = chunk_cls(id=last[0].get("id"), choices=[], **fields)
    errors = [m.get(ERROR_KEY) for m in last]
    if any(errors):
        params: Dict[str, Any] = {ERROR_KEY: next(e for e in errors if e)}
        if len(errors) > 1:
            params[ERROR_KEY + "s"] = errors
        return _extended(chunk, params)
    return _with_dump_extras(chunk, [{"meta_info": m} for m in last])


def _with_dump_extras(response, ret):
    """``response`` with the dump's ``kv_transfer_params`` (see ``openai_completion_extras``)."""
    items = ret if isinstance(ret, list) else [ret]
    metas = [(item or {}).get("meta_info") or {} for item in items]
    errors = [str(m[ERROR_KEY]) for m in metas if m.get(ERROR_KEY)]
    if errors:
        raise HiddenStatesDumpError(f"hidden-state dump failed: {errors[0]}")
    manifests = [m.get(MANIFEST_KEY) for m in metas]
    paths = [m.get(PATH_KEY) for m in metas]
    if any(manifests):
        params = dict(manifests[0] or {})
        if len(manifests) > 1:
            params[MANIFEST_KEY + "s"] = manifests
    elif any(paths):
        params = {PATH_KEY: paths[0]}
        if len(paths) > 1:
            params[PATH_KEY + "s"] = paths
    else:
        return response
    return _extended(response, params)


def _extended(response, params: dict):
    """``response`` (a pydantic model) as its subclass with ``kv_transfer_params`` =
    ``params``; returned unchanged when it is not one (an error response SGLang built)."""
    cls = type(response)
    if not hasattr(cls, "model_fields"):  # an error response SGLang built instead
        return response
    sub = _with_kv_transfer_params(cls)
    fields = {name: getattr(response, name) for name in cls.model_fields}
    return sub.model_construct(
        _fields_set=set(response.model_fields_set) | {"kv_transfer_params"},
        kv_transfer_params=params,
        **fields,
    )
