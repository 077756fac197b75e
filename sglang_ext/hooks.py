"""The only API SGLang's patched files call (patches/<base>/*.diff). Keep it small.

===========================  ====================================================
patched file (v0.5.17)       call
===========================  ====================================================
server_args.py               ``check_server_args(server_args)`` from __post_init__
  (v0.5.23: arg_groups/pipeline.py, a resolution step after the aux-capture one)
model_runner.py              ``setup_model(model_runner)`` before CUDA-graph capture
forward_batch_info.py        ``capture_hidden_mode(batch, model_runner, mode)``
scheduler.py                 ``is_enabled()``: keep per-request extend lengths
batch_result_processor.py    ``on_prefill_result(batch, logits_output, lens, defer=True)``
                             before the batch's outputs are streamed, then
                             ``on_prefill_output()`` after (v0.5.23: one call,
                             without ``defer``: both parts at once)
tokenizer_manager.py         ``await finish_response(meta_info)``
serving_completions.py       ``openai_completion_extras(response, ret)``
http_server.py               ``json_data = warmup_request(server_args, json_data)``
                             right before the server's warm-up POST
===========================  ====================================================

Every function returns at once when dumping is off. SGLang is imported lazily so this
module can be imported by the patched files without cycles.

Process model: the tokenizer manager (main process) calls ``check_server_args`` and
``finish_response``; each scheduler process (one per TP rank) calls the rest. Only the
attention-TP rank 0 of the target model writes; other ranks keep their rows on the GPU.
"""

from __future__ import annotations

import atexit
import logging
import os
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from sglang_ext import __version__, compat
from sglang_ext import format as fmt
from sglang_ext import trace
from sglang_ext.config import DumpConfig, DumpConfigError, resolve_layer_ids

logger = logging.getLogger(__name__)

PATH_KEY, ERROR_KEY, PENDING_KEY = fmt.PATH_KEY, fmt.ERROR_KEY, fmt.PENDING_KEY
WAIT_PARAM, DUMP_PARAM = fmt.WAIT_PARAM, fmt.DUMP_PARAM
_REQ_ATTR = "_kimi_sglang_dump"  # per-request state, stored on SGLang's Req
_SOURCE = "kimi-sglang: --dump-hidden-states-dir"  # names our server-args decisions
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # sglang.srt.constants.HEALTH_CHECK_RID_PREFIX
# Names SGLang's own start-up warm-up request (warmup_request), which must not leave a
# file and an index line in a user's dump directory at every start.
WARMUP_RID_PREFIX = "kimi-sglang-warmup-"

# Decoder-model classes whose patched forward can capture id N (patch 0002).
FINAL_NORM_CAPTURE_MODELS = ("LlamaModel", "DeepseekV2Model")


@dataclass
class _Dumper:
    """Per-process dump state, created by ``setup_model`` on the target model's ranks."""

    config: DumpConfig
    layer_ids: Tuple[int, ...]
    num_layers: int
    is_writer: bool
    metadata: dict
    capture_full: Any  # CaptureHiddenMode.FULL
    writer: Any = None  # DumpWriter on the writing rank
    dir_fd: Optional[int] = None
    handover: Any = None  # _HandOver: a batch on_prefill_result saw, for on_prefill_output


_DUMPER: Optional[_Dumper] = None


def is_enabled() -> bool:
    """True in a scheduler process whose model dumps hidden states."""
    return _DUMPER is not None


# ---- start-up -------------------------------------------------------------------
def check_server_args(server_args) -> None:
    """Validate the --dump-hidden-states-* options at start-up; adjust what must be.

    Raises ``DumpConfigError`` (a ``ValueError``: SGLang prints it and exits) for a
    missing or unwritable directory, bad layer ids, a bad memory cap, and options the
    dump path does not support (``--enable-return-hidden-states`` /
    ``--return-hidden-states-mode``, speculative decoding, pipeline parallelism, PD
    disaggregation, attention context parallelism (``--attn-cp-size > 1``), embedding
    models). Data parallelism, with or without DP attention, is accepted: every DP rank's
    attention-TP rank 0 writes the requests it served into the same directory (names are
    reserved through the file system, ``format.reserve``), each within its share of the
    host cap (``DumpConfig``); with DP attention the files equal a TP=1 server's (GPU
    runs: docs/verification.md). Turns the radix cache off (a
    request whose prefix is cached would compute, and so dump, only its suffix) and says
    so in the log; turns the prefill CUDA graph off (it cannot capture hidden states, so
    it would never run).
    """
    if getattr(server_args, "dump_hidden_states_dir", None) is None:
        return  # dumping off (0.5.2x runs this step unconditionally)
    DumpConfig.from_server_args(server_args)
    view = compat.server_args_view(server_args)
    refused = {
        "--enable-return-hidden-states / --return-hidden-states-mode": bool(
            view.enable_return_hidden_states or view.return_hidden_states_mode
        ),
        "--enable-return-aux-hidden-states": bool(
            getattr(view, "enable_return_aux_hidden_states", False)
        ),
        "--speculative-algorithm": bool(getattr(view, "speculative_algorithm", None)),
        "--pp-size > 1": int(getattr(view, "pp_size", 1) or 1) > 1,
        "--disaggregation-mode": getattr(view, "disaggregation_mode", "null")
        not in (None, "null"),
        # each context-parallel rank is an attention-TP rank 0 too (dp_attention.py:
        # tp_rank = (dp * cp + cp_rank) * attn_tp + attn_tp_rank): one request, many
        # writers; not supported until verified
        "--attn-cp-size > 1": int(getattr(view, "attn_cp_size", 1) or 1) > 1,
        "--is-embedding": bool(getattr(view, "is_embedding", False)),
    }
    bad = [name for name, on in refused.items() if on]
    if bad:
        raise DumpConfigError(
            f"--dump-hidden-states-dir cannot be combined with {', '.join(bad)} "
            f"(not supported by the dump path yet)"
        )
    if not getattr(view, "disable_prefill_cuda_graph", True):
        # The prefill graphs are captured without hidden-state capture, so every
        # extend batch would fall back to eager anyway: skip capturing them.
        logger.info("--dump-hidden-states-dir: prefill CUDA graph off (extend batches run eager)")
        compat.adjust_server_args(server_args, _SOURCE, disable_prefill_cuda_graph=True)
    if not view.disable_radix_cache:
        logger.warning(
            "--dump-hidden-states-dir: turning the radix cache off (--disable-radix-cache) "
            "so every prompt token is computed and dumped"
        )
        compat.adjust_server_args(server_args, _SOURCE, disable_radix_cache=True)


def warmup_request(server_args, json_data: dict) -> dict:
    """The body of SGLang's start-up warm-up request (``_execute_server_warmup``), with a
    ``rid`` of ``WARMUP_RID_PREFIX`` + uuid hex when dumping is on, so its prompt leaves no
    file and no index line (``_is_internal``); unchanged when dumping is off.

    ``json_data``: a ``/generate`` body (``text`` a str or a list of str, ``input_ids`` a
    list of ints or a list of lists: a batch, one prompt per DP rank, gets a list of
    rids), or a ``/v1/chat/completions`` body (``messages``: one rid). Any other body (no
    prompt field) is returned unchanged. Modified in place and returned. A client's own
    rid that starts with ``WARMUP_RID_PREFIX`` is not dumped either (docs/faults.md).
    """
    if getattr(server_args, "dump_hidden_states_dir", None) is None:
        return json_data
    prompt = json_data.get("text", json_data.get("input_ids"))
    if prompt is None and "messages" not in json_data:
        return json_data
    batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    rids = [WARMUP_RID_PREFIX + uuid.uuid4().hex for _ in (prompt if batch else [None])]
    json_data["rid"] = rids if batch else rids[0]
    return json_data


def _find_decoder(model) -> Tuple[Any, Any]:
    """(causal LM with ``capture_aux_hidden_states``, decoder with ``layers_to_capture``).

    Multimodal wrappers such as Kimi-K2.5's ``KimiK25ForConditionalGeneration`` hold the
    causal LM in ``language_model``.
    """
    for lm in (model, getattr(model, "language_model", None)):
        inner = getattr(lm, "model", None)
        if lm is not None and hasattr(lm, "capture_aux_hidden_states") and hasattr(
            inner, "layers_to_capture"
        ):
            return lm, inner
    raise DumpConfigError(
        f"--dump-hidden-states-dir: model {type(model).__name__} has no aux hidden-state "
        f"capture (capture_aux_hidden_states / model.layers_to_capture)"
    )


def setup_model(model_runner) -> None:
    """Turn on aux capture of the dump layers in the target model; start the writer.

    Called from ``ModelRunner.init_attention_backends`` before CUDA-graph capture.
    Raises ``DumpConfigError`` for layer ids the model cannot give.
    """
    global _DUMPER
    server_args = model_runner.server_args
    if not getattr(server_args, "dump_hidden_states_dir", None) or model_runner.is_draft_worker:
        return
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.version import __version__ as sglang_version

    config = DumpConfig.from_server_args(server_args)
    lm, decoder = _find_decoder(model_runner.model)
    num_layers = int(model_runner.model_config.num_hidden_layers)
    layer_ids = resolve_layer_ids(config.layer_ids, num_layers)
    decoder_classes = {cls.__name__ for cls in type(decoder).__mro__}
    if num_layers in layer_ids and not decoder_classes & set(FINAL_NORM_CAPTURE_MODELS):
        raise DumpConfigError(
            f"--dump-hidden-states-layers: id {num_layers} (before the final norm) is "
            f"patched for {', '.join(FINAL_NORM_CAPTURE_MODELS)} only, not "
            f"{type(decoder).__name__}; pass ids below {num_layers}"
        )
    lm.capture_aux_hidden_states = True
    decoder.layers_to_capture = list(layer_ids)

    is_writer = compat.attn_tp_rank(model_runner) == 0
    dumper = _Dumper(
        config=config,
        layer_ids=layer_ids,
        num_layers=num_layers,
        is_writer=is_writer,
        capture_full=CaptureHiddenMode.FULL,
        metadata={
            "model_path": server_args.model_path,
            "sglang_version": sglang_version,
            "sglang_ext_version": __version__,
            "series": f"v{sglang_version}",
        },
    )
    if is_writer:
        import torch

        from sglang_ext.metrics import model_name
        from sglang_ext.writer import DumpWriter

        dumper.dir_fd = fmt.open_dump_dir(config.directory)
        removed = fmt.clean_stale(dumper.dir_fd)
        if any(removed.values()):
            logger.warning("hidden-state dump: removed leftovers of an earlier run: %s", removed)
        device = torch.device(model_runner.device, model_runner.gpu_id) if str(
            model_runner.device
        ).startswith("cuda") else None
        dumper.writer = DumpWriter(
            dumper.dir_fd,
            arena_bytes=config.max_host_bytes,
            threads=config.writer_threads,
            layer_ids=layer_ids,
            num_layers=num_layers,
            metadata=dumper.metadata,
            device=device,
            metrics_model_name=model_name(server_args),
            drain_timeout_s=config.drain_timeout_s,
            stats_interval_s=config.stats_interval_s,
            hidden_states_dtype=config.hidden_states_dtype,
            cpus=config.writer_cpus,
            watchdog_s=config.watchdog_s,
        )
    _DUMPER = dumper
    logger.info(
        "hidden-state dump: layers %s of %d into %s (writer rank: %s%s)",
        list(layer_ids), num_layers, config.directory, is_writer, _writer_cpus_note(is_writer, config.writer_cpus),
    )


def _writer_cpus_note(is_writer: bool, writer_cpus) -> str:
    """The start line's word on where the writer process runs: the CPUs asked for, or,
    when the scheduler is confined to fewer CPUs than the host has (taskset, a cpuset),
    that the writer shares them, which can cost the dump much of its speed on a busy
    scheduler (docs/performance.md, "the writer on the server's CPUs"). Nothing where
    the platform has no CPU affinity (``os.sched_getaffinity``: Linux)."""
    if not is_writer:
        return ""
    if writer_cpus:
        return f"; writer process on CPUs {list(writer_cpus)}"
    affinity = getattr(os, "sched_getaffinity", None)
    mine = sorted(affinity(0)) if affinity else []
    if mine and len(mine) < (os.cpu_count() or len(mine)):
        return (f"; writer process on the scheduler's {len(mine)} CPUs {mine}: "
                "KIMI_SGLANG_WRITER_CPUS can name others it may use")
    return ""


# ---- every forward ------------------------------------------------------------------
def capture_hidden_mode(batch, model_runner, mode):
    """FULL for the target model's extend (prefill) batches while dumping, else ``mode``."""
    if (
        _DUMPER is None
        or model_runner.is_draft_worker
        or not batch.forward_mode.is_extend()
        or batch.forward_mode.is_target_verify()
    ):
        return mode
    return _DUMPER.capture_full


# ---- result processing (scheduler thread) --------------------------------------------
@dataclass
class _ReqDump:
    pending: Any = None  # writer.PendingDump while rows arrive
    release: Any = None  # weakref.finalize abandoning the request if the Req is dropped
    done: bool = False  # file named (or error recorded): later prefills are ignored


@dataclass
class _Take:
    """One request's rows of an extend batch, between ``on_prefill_result`` and the hand-over."""

    req: Any
    state: _ReqDump
    start: int  # first row in the batch's packed rows
    rows: int  # how many of them
    reservation: Any = None  # format.Reservation when these are the request's last rows
    settled: bool = False  # on_prefill_output queued its file or failed it


@dataclass
class _HandOver:
    """What ``on_prefill_result(..., defer=True)`` leaves for ``on_prefill_output``."""

    hidden: Any  # the batch's packed rows (kept alive until they are copied)
    takes: List[_Take]
    deferred: bool  # the batch's outputs are (being) streamed before on_prefill_output
    t0: Optional[float] = None  # trace: when on_prefill_result began
    t_named: Optional[float] = None  # trace, deferred: when it returned


def on_prefill_result(batch, logits_output, extend_input_len_per_req: Optional[List[int]],
                      defer: bool = False) -> None:
    """Hand this extend batch's rows to the writer.

    ``logits_output.hidden_states``: ``[sum(extend lens), num_layers * hidden_size]``,
    the packed aux hidden states of the dump layers, requests in ``batch.reqs`` order.
    With ``--dump-hidden-states-dtype fp8`` the writer quantizes them on the device
    (``sglang_ext.quant``, on its copy stream) before the device-to-host copy.
    The rows of the batch's dumped requests go to the arena in one copy per contiguous
    run (``DumpWriter.copy_rows``); chunked prefill: each chunk's rows go to their place
    in the request's file; a request whose last prompt row is in this batch gets its name
    reserved and its path recorded for the response. Requests that fail before their
    name is reserved get ``hidden_states_error`` instead of a path; after it, the failure
    is the file's (``<path>.error``: a waiting response reports it as
    ``hidden_states_error``, an early answer's client finds it when the lock goes). The
    batch is never interrupted. A request whose ``custom_params`` holds
    ``{"hidden_states_dump": false}`` (``format.DUMP_PARAM``; only JSON false) is skipped:
    its rows were captured with the batch's, nothing is copied or written, its response
    carries no dump keys.

    ``defer=True`` (a series that also calls ``on_prefill_output`` once the batch's
    outputs are streamed): only what the responses need happens here (checks, the name
    reservations, the paths); opening new requests in the arena, the rows copy and the
    message to the writer wait for ``on_prefill_output``, off the answers' path.
    """
    d = _DUMPER
    if d is None or not d.is_writer or not batch.forward_mode.is_extend():
        return
    if d.handover is not None:  # the previous batch's on_prefill_output never came
        on_prefill_output()
    d.writer.poll()  # a writer that ended since the last batch is replaced before this one
    t0 = trace.now() if trace.enabled() else None
    hidden = logits_output.hidden_states
    lens = extend_input_len_per_req or []
    decoding = set(map(id, batch.decoding_reqs or []))
    prefix_lens = batch.prefix_lens or [0] * len(batch.reqs)
    takes = []
    offset = 0
    for i, req in enumerate(batch.reqs):
        n = lens[i] if i < len(lens) else 0
        start, offset = offset, offset + n
        if id(req) in decoding or req.is_retracted or n == 0 or _is_internal(req.rid):
            continue
        state = getattr(req, _REQ_ATTR, None)
        if state is None:
            # done at once: the request asked not to be dumped (decided at its first chunk)
            state = _ReqDump(done=_custom_param(req, DUMP_PARAM) is False)
            setattr(req, _REQ_ATTR, state)
            compat.release_request_cycle(req)
        if state.done:
            continue
        if req.finished():  # aborted while its prefill was in flight
            _drop(d, state)
            continue
        try:
            take = _Take(req, state, start, _check(d, req, state, hidden, n, prefix_lens[i]))
            if prefix_lens[i] + take.rows == len(req.origin_input_ids):
                take.reservation = _name(d, req, state)
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the batch
            _fail(d, req, state, e)
            continue
        takes.append(take)
    d.handover = _HandOver(hidden, takes, defer, t0, trace.now() if defer and t0 is not None else None)
    if not defer:
        on_prefill_output()


def on_prefill_output() -> None:
    """The rest of the batch that ``on_prefill_result`` saw: open its new requests in the
    arena (their token ids), copy its rows, queue the finished files and send it all to
    the writer process. Called by ``on_prefill_result`` itself unless deferred; a series
    that defers calls it after the batch's outputs are streamed. Returns at once when
    nothing is handed over."""
    d = _DUMPER
    work = d.handover if d is not None else None
    if work is None:
        return
    d.handover = None
    t0 = trace.now() if trace.enabled() else None
    try:
        opened = []
        for take in work.takes:
            try:
                _open(d, take.req, take.state, work.hidden)
            except Exception as e:  # noqa: BLE001
                _fail_take(d, take, e, work.deferred)
                take.settled = True
                continue
            opened.append(take)
        if opened:
            try:
                # ready=True: the forward that produced these rows has finished when this hook
                # runs. Under overlap scheduling, process_batch_result_prefill first
                # synchronizes result.copy_done, recorded on the copy stream after it waited
                # for the forward stream; without overlap (copy_done None) its
                # next_token_ids.tolist() has synchronized the stream the forward ran on.
                # (0.5.17 and 0.5.23; tests/test_patches.py and tests/test_nightly.py check
                # that the sync precedes the hook.) So the copy need not queue behind what the
                # scheduler stream holds now, e.g. the next batch's forward.
                d.writer.copy_rows(work.hidden, [(t.state.pending, t.start, t.rows) for t in opened], ready=True)
            except Exception as e:  # noqa: BLE001 - the batch's dumped requests fail, it goes on
                for take in opened:
                    _fail_take(d, take, e, work.deferred)
                    take.settled = True
                opened = []
            for take in opened:
                if take.reservation is not None:
                    try:
                        d.writer.finish(take.state.pending, take.reservation)
                    except Exception as e:  # noqa: BLE001
                        _fail_take(d, take, e, work.deferred)
                        continue
                    finally:
                        take.settled = True
                    take.state.pending = None
                    _detach(take.state)
    except BaseException as e:  # an unexpected error: no named file may be left unsettled
        for take in work.takes:
            if take.reservation is not None and not take.settled:
                _fail_take(d, take, e, work.deferred)
        raise
    d.writer.flush()
    if t0 is not None:
        # deferred: t_named (on_prefill_result returned) and t_output (this call began)
        # bound the outputs' streaming, which is not the hook's time
        deferred = {"t_named": work.t_named, "t_output": t0} if work.t_named is not None else {}
        trace.record("hook", reqs=len(opened), t0=t0 if work.t0 is None else work.t0, t1=trace.now(), **deferred)


def _is_internal(rid) -> bool:
    """SGLang's own requests are not dumped: health checks (``/health_generate``) and the
    start-up warm-up (``warmup_request``). A client rid with either prefix is not either."""
    return isinstance(rid, str) and rid.startswith((HEALTH_CHECK_RID_PREFIX, WARMUP_RID_PREFIX))


def _check(d: _Dumper, req, state: _ReqDump, hidden, n: int, prefix_len: int) -> int:
    """Check this chunk against what was sent. Returns how many of its ``n`` rows to
    take (rows past the prompt are not dumped)."""
    num_tokens = len(req.origin_input_ids)
    fmt.check_rid(req.rid)
    if hidden is None:
        raise RuntimeError("the forward captured no hidden states for this batch")
    if prefix_len == 0 and state.pending is not None and state.pending.rows:
        _drop(d, state)  # retracted mid-prefill and started over
    if state.pending is not None:
        d.writer.check_current(state.pending)
    done_rows = state.pending.rows if state.pending is not None else 0
    if prefix_len != done_rows:
        raise RuntimeError(
            f"extend starts at token {prefix_len} but {done_rows} rows were dumped "
            f"(prefix reuse is not supported while dumping)"
        )
    return min(n, num_tokens - done_rows)


def _open(d: _Dumper, req, state: _ReqDump, hidden) -> None:
    """Open the request in the writer at its first chunk (its token ids into the arena)."""
    if state.pending is not None:
        return
    state.pending = d.writer.start(req.rid, req.origin_input_ids, hidden.shape[1], hidden.dtype)
    # A request dropped between chunks (aborted while waiting or retracted) never
    # reaches this hook again: drop its file when SGLang lets go of the Req.
    state.release = weakref.finalize(req, d.writer.abandon, state.pending)
    state.release.atexit = False


def _fail(d: _Dumper, req, state: _ReqDump, e: BaseException) -> None:
    logger.error("hidden-state dump for rid %s failed: %s", fmt.brief_rid(req.rid), e)
    _drop(d, state)
    state.done = True
    _set_info(req, ERROR_KEY, f"{type(e).__name__}: {e}")


def _fail_take(d: _Dumper, take: _Take, e: BaseException, streamed: bool) -> None:
    """A failure in ``on_prefill_output``. Before the request's name was reserved (a middle
    chunk), or while its response is not sent yet (``streamed`` False: one call), the
    response says it (``hidden_states_error``; the reservation is given back); once the
    response may be out (deferred), the file's ``<name>.error`` does."""
    if take.reservation is None or not streamed:
        if take.reservation is not None:
            fmt.cancel(take.reservation)
            for key in (PATH_KEY, PENDING_KEY):
                (take.req.customized_info or {}).pop(key, None)
        _fail(d, take.req, take.state, e)
        return
    logger.error("hidden-state dump for rid %s failed: %s", fmt.brief_rid(take.req.rid), e)
    _drop(d, take.state)
    fmt.fail(take.reservation, f"{type(e).__name__}: {e}")
    d.writer.stats.failures += 1


def _settle_at_exit() -> None:
    """At the scheduler process's exit (atexit; a normal exit or an exception that ends the
    scheduler, not a signal that kills it): the named
    files of a batch whose ``on_prefill_output`` never came fail with a message instead
    of leaving their waiters a lock that goes with nothing behind it."""
    d = _DUMPER
    work = d.handover if d is not None else None
    if work is None:
        return
    d.handover = None
    for take in work.takes:
        if take.reservation is not None:
            fmt.fail(take.reservation, "the server stopped before the hidden-state file was written")


atexit.register(_settle_at_exit)


def _name(d: _Dumper, req, state: _ReqDump):
    """Reserve the finished request's file name and record its path for the response."""
    reservation = fmt.reserve(d.dir_fd, req.rid)
    state.done = True
    _set_info(req, PATH_KEY, os.path.join(d.config.directory, reservation.name))
    if not _wants_wait(req):
        _set_info(req, PENDING_KEY, True)
    return reservation


def _wants_wait(req) -> bool:
    """False when the request asked to be answered before its file is complete."""
    return _custom_param(req, WAIT_PARAM) is not False


def _custom_param(req, key: str):
    """``sampling_params.custom_params[key]`` of SGLang's Req, or None."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return params.get(key) if isinstance(params, dict) else None


def _drop(d: _Dumper, state: _ReqDump) -> None:
    _detach(state)
    if state.pending is not None:
        d.writer.abandon(state.pending)
        state.pending = None


def _detach(state: _ReqDump) -> None:
    if state.release is not None:
        state.release.detach()
        state.release = None


def _set_info(req, key: str, value) -> None:
    """Record a per-request value where SGLang carries it to ``meta_info``.

    Upstream ships ``req.customized_info[key]`` (a list aligned with output tokens) to
    the tokenizer manager, which puts it into ``meta_info[key]``;
    ``finish_response`` turns the list back into the single value.
    """
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info[key] = [value]


# ---- tokenizer manager (main process, asyncio) -----------------------------------------
def _first(value):
    if isinstance(value, list):
        return next((v for v in value if v is not None), None)
    return value


async def finish_response(meta_info: dict) -> None:
    """Before a finished request's response goes out: wait for its file, report it.

    ``meta_info[hidden_states_path]`` becomes the file's absolute path once the writer
    has released it; if the write failed, the key is replaced by ``hidden_states_error``.
    A request that asked not to wait (``custom_params`` ``hidden_states_wait: false``)
    is answered at once with the path and ``hidden_states_pending: true``; a failed write
    then shows as ``<path>.error`` when the lock goes (``format.wait_complete``).
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


# ---- OpenAI-compatible /v1/completions (main process) ---------------------------------
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
    ``prompt_token_ids`` per choice needs nothing here: SGLang 0.5.17 already returns it
    when the request says ``return_token_ids``.

    A failed dump raises ``HiddenStatesDumpError``: SGLang answers HTTP 500, which
    speculators' client retries. Without dump keys in ``meta_info`` (dumping off) the
    response is returned unchanged.
    """
    items = ret if isinstance(ret, list) else [ret]
    metas = [(item or {}).get("meta_info") or {} for item in items]
    errors = [str(m[ERROR_KEY]) for m in metas if m.get(ERROR_KEY)]
    if errors:
        raise HiddenStatesDumpError(f"hidden-state dump failed: {errors[0]}")
    paths = [m.get(PATH_KEY) for m in metas]
    if not any(paths):
        return response
    params = {PATH_KEY: paths[0]}
    if len(paths) > 1:
        params[PATH_KEY + "s"] = paths
    cls = type(response)
    sub = _with_kv_transfer_params(cls)
    fields = {name: getattr(response, name) for name in cls.model_fields}
    return sub.model_construct(
        _fields_set=set(response.model_fields_set) | {"kv_transfer_params"},
        kv_transfer_params=params,
        **fields,
    )
