"""The only API SGLang's patched files call (patches/<base>/*.diff): a door that forwards.

===========================  ====================================================
patched file                 call
===========================  ====================================================
server_args.py               ``check_server_args(server_args)`` from __post_init__
  (v0.5.23: arg_groups/pipeline.py, a resolution step after the aux-capture one)
model_runner.py              ``setup_model(model_runner)`` before CUDA-graph capture
forward_batch_info.py        ``capture_hidden_mode(batch, model_runner, mode)``
scheduler.py                 ``is_enabled()``: keep per-request extend lengths
batch_result_processor.py    ``on_prefill_result(batch, logits_output, lens)``
                             before the batch's outputs are streamed
  (patch 0009)               ``on_outputs(batch, logits_output[, lens])`` after the
                             finish checks of a prefill or decode batch, before
                             its outputs are streamed
scheduler.py (0009)          ``wants_host_rows(batch)`` where the result's copy to
                             the host is queued behind its forward
model_runner.py (0009)       ``setup_model(model_runner, output_rows=True)``
tokenizer_manager.py         ``await finish_response(meta_info)``
  (patch 0010)               ``abort_response(server_args, obj, meta_info)`` in
                             the abort echo of a request ended while waiting
serving_completions.py       ``openai_completion_extras(response, ret)``
serving_chat.py              ``openai_chat_extras(response, ret)``
  (patch 0011; protocol.py   ``sampling_params = openai_sampling_params(server_args,
  declares kv_transfer_      request, sampling_params)`` where each converts an
  params on both requests)   OpenAI request for the tokenizer manager
  (patch 0012)               ``openai_stream_extras(chunk_cls, metas, **fields)``:
                             the stream's dump chunk, before its usage chunk
http_server.py               ``json_data = warmup_request(server_args, json_data)``
                             right before the server's warm-up POST
===========================  ====================================================

The work is done elsewhere: ``session.DumpSession`` (the scheduler side: capture, each
request's rows, the writer) and ``responses`` (the main-process side: what a response
carries). This module holds the process's live session, made by ``setup_model``, and
forwards to it. Every function returns at once when dumping is off. SGLang (and torch) is
imported lazily so the patched files can import this module without cycles.

Process model: the main process (tokenizer manager, HTTP server, OpenAI layer) calls
``check_server_args``, ``warmup_request``, ``finish_response``, ``abort_response`` and the
``openai_*`` functions; each scheduler process (one per TP rank) calls the rest. Only the
attention-TP rank 0 of the target model writes; other ranks keep their rows on the GPU.
"""

from __future__ import annotations

from typing import List, Optional

from sglang_ext import session as _session
from sglang_ext.responses import (  # noqa: F401 - re-exported: the patches call them here
    abort_response,
    finish_response,
    openai_chat_extras,
    openai_completion_extras,
    openai_sampling_params,
    openai_stream_extras,
)
from sglang_ext.session import DumpSession, check_server_args  # noqa: F401 - re-exported

_SESSION: Optional[DumpSession] = None  # this scheduler process's session (setup_model)


def is_enabled() -> bool:
    """True in a scheduler process whose model dumps hidden states."""
    return _SESSION is not None


def session() -> Optional[DumpSession]:
    """This process's live session, or None when it dumps nothing (for tools that read
    its writer's counters)."""
    return _SESSION


def warmup_request(server_args, json_data: dict) -> dict:
    """The body of SGLang's start-up warm-up request (``_execute_server_warmup``) with
    rids that keep its prompt out of the dump (``session.name_warmup``) when dumping is
    on; unchanged when it is off. Modified in place and returned. A client's own rid
    that starts with ``session.WARMUP_RID_PREFIX`` is not dumped either (docs/faults.md).
    """
    if getattr(server_args, "dump_hidden_states_dir", None) is None:
        return json_data
    return _session.name_warmup(json_data)


def setup_model(model_runner, output_rows: bool = False) -> None:
    """Start this process's session (``DumpSession.start``): aux capture of the dump
    layers in the target model, and the writer on the attention-TP rank 0.

    Called from ``ModelRunner.init_attention_backends`` before CUDA-graph capture; does
    nothing for a draft model or when dumping is off. Raises ``DumpConfigError`` for layer
    ids the model cannot give. ``output_rows`` (patch 0009 passes True): requests may ask
    for their generated tokens' rows (``format.OUTPUT_PARAM``), so this scheduler
    process's hidden-state mode is raised to LAST (``compat.capture_decode_rows``) and the
    decode CUDA graphs, captured after this call, hold each decode token's aux rows
    ``[bs, num_layers * hidden_size]``: decode batches replay them, never eager.
    """
    global _SESSION
    started = DumpSession.start(model_runner, output_rows=output_rows)
    if started is not None:
        _SESSION = started
        if output_rows:
            from sglang_ext import compat

            compat.capture_decode_rows("kimi-sglang: --dump-hidden-states-dir output rows")


def capture_hidden_mode(batch, model_runner, mode):
    """FULL for the target model's extend (prefill) batches while dumping, else ``mode``."""
    if _SESSION is None:
        return mode
    return _SESSION.capture_hidden_mode(batch, model_runner, mode)


def on_prefill_result(batch, logits_output, extend_input_len_per_req: Optional[List[int]]) -> None:
    """Hand this extend batch's rows to the writer (``DumpSession.on_prefill_result``):
    ``logits_output.hidden_states`` is ``[sum(extend lens), num_layers * hidden_size]``,
    requests in ``batch.reqs`` order; finished requests get their path (or
    ``hidden_states_error``) in ``customized_info``. Called once per batch, before its
    outputs are streamed (both series).
    """
    if _SESSION is not None:
        _SESSION.on_prefill_result(batch, logits_output, extend_input_len_per_req)


def wants_host_rows(batch) -> bool:
    """True when SGLang must copy this decode batch's hidden states to the host right
    behind its forward (``DumpSession.wants_host_rows``); False when dumping is off."""
    return _SESSION is not None and _SESSION.wants_host_rows(batch)


def on_outputs(batch, logits_output, extend_input_len_per_req: Optional[List[int]] = None) -> None:
    """After a prefill or decode batch's finish checks, before its outputs are streamed:
    decode rows of the requests that asked for their output rows, and the files of those
    that ended (``DumpSession.on_outputs``)."""
    if _SESSION is not None:
        _SESSION.on_outputs(batch, logits_output, extend_input_len_per_req)
