"""A dump session: what one SGLang scheduler process dumps, and each request's state.

``DumpSession.start(model_runner)`` turns on aux capture of the dump layers in the target
model and, on the attention-TP rank 0 (the one rank that writes), opens the dump
directory and starts the writer (``writer.DumpWriter``). Its ``on_prefill_result`` takes
each extend batch's rows, request by request, chunk by chunk, into that writer; with patch
0009 (``output_rows``) ``on_outputs`` takes each decode step's row of the requests that
asked for their output rows (``format.output``) and sends each such file at its end. The
per-request state lives on SGLang's ``Req`` (``REQ_ATTR``), so a request's chunks find it
batch after batch. ``hooks`` holds the process's live session and forwards SGLang's calls
to it; tests build sessions directly.

Also here, as the rules of a session: the server options it refuses
(``check_server_args``) and the requests it never dumps (``is_internal``: SGLang's health
checks and its start-up warm-up, named by ``name_warmup``).
"""

from __future__ import annotations

import logging
import os
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from sglang_ext import __version__, compat, trace
from sglang_ext import format as fmt
from sglang_ext.config import DumpConfig, DumpConfigError, check_store_reachable, resolve_layer_ids
from sglang_ext.sampling import DumpPolicy
from sglang_ext.responses import ERROR_KEY, MANIFEST_KEY, PATH_KEY, PENDING_KEY, drop_info, hold_info, set_info

logger = logging.getLogger(__name__)

REQ_ATTR = "_kimi_sglang_dump"  # per-request state (_ReqDump), stored on SGLang's Req
_SOURCE = "kimi-sglang: --dump-hidden-states-dir"  # names our server-args decisions
# SGLang's own requests (health checks, the warm-up) are not dumped: format.names owns the
# prefixes, shared with the stand-in server.
HEALTH_CHECK_RID_PREFIX, WARMUP_RID_PREFIX = fmt.HEALTH_CHECK_RID_PREFIX, fmt.WARMUP_RID_PREFIX
is_internal = fmt.is_internal

RETRACTED_MESSAGE = ("the request was retracted (SGLang re-prefills its prompt and generated tokens "
                     "under KV-cache pressure), so its output rows cannot be dumped")
OUT_OF_STEP_MESSAGE = "its decode rows came out of step with its generated tokens ({rows} rows, {fed} fed)"
INPUT_EMBEDS_MESSAGE = ("the request sent input_embeds, not token ids: SGLang runs it with made-up ids "
                        "(1 at every position), which its file would record as its token_ids")
BEAM_MESSAGE = ("the request is a beam search (beam_width > 1): SGLang replaces its sampling_params, "
                "custom_params with them, so what it asked of the dump cannot be read; send it without beam_width")

# Decoder-model classes whose patched forward can capture id N (patch 0002).
FINAL_NORM_CAPTURE_MODELS = ("LlamaModel", "DeepseekV2Model")


# ---- start-up (main process) ------------------------------------------------------------
def check_server_args(server_args) -> None:
    """Validate the --dump-hidden-states-* options at start-up; adjust what must be.

    Raises ``DumpConfigError`` (a ``ValueError``: SGLang prints it and exits) for a
    missing or unwritable directory, bad layer ids, a bad memory cap, and options the
    dump path does not support (``--enable-return-hidden-states`` /
    ``--return-hidden-states-mode``, speculative decoding, pipeline parallelism, PD
    disaggregation, attention context parallelism (``--attn-cp-size > 1``), embedding
    models, SGLang's Rust server (``SGLANG_RUST_SERVER``: ``compat.rust_server_on``)).
    Data parallelism, with or without DP attention, is accepted: every DP rank's
    attention-TP rank 0 writes the requests it served into the same directory (names are
    reserved through the file system, ``format.reserve``), each within its share of the
    host cap (``DumpConfig``); with DP attention the files equal a TP=1 server's (GPU
    runs: docs/verification.md). Turns the radix cache off (a
    request whose prefix is cached would compute, and so dump, only its suffix) and says
    so in the log; turns the prefill CUDA graph off (it cannot capture hidden states, so
    it would never run). Does nothing when dumping is off.

    A ``mooncake://`` value selects the store sink (docs/store.md): no directory is
    checked; the address must parse, the mooncake package be installed and the master
    accept a connection (``config.check_store_reachable``), else one sentence.
    """
    if getattr(server_args, "dump_hidden_states_dir", None) is None:
        return  # dumping off (0.5.2x runs this step unconditionally)
    config = DumpConfig.from_server_args(server_args)
    if config.store is not None:
        check_store_reachable(config.store)
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
        # its Rust HTTP server answers requests without customized_info or finish_response:
        # no path, no error, no wait for the file
        "SGLANG_RUST_SERVER": compat.rust_server_on(),
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


def name_warmup(json_data: dict) -> dict:
    """Give SGLang's start-up warm-up body a ``rid`` of ``WARMUP_RID_PREFIX`` + uuid hex,
    so its prompt leaves no file and no index line (``is_internal``).

    ``json_data``: a ``/generate`` body (``text`` a str or a list of str, ``input_ids`` a
    list of ints or a list of lists: a batch, one prompt per DP rank, gets a list of
    rids), or a ``/v1/chat/completions`` body (``messages``: one rid). Any other body (no
    prompt field) is returned unchanged. Modified in place and returned.
    """
    prompt = json_data.get("text", json_data.get("input_ids"))
    if prompt is None and "messages" not in json_data:
        return json_data
    batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    rids = [WARMUP_RID_PREFIX + uuid.uuid4().hex for _ in (prompt if batch else [None])]
    json_data["rid"] = rids if batch else rids[0]
    return json_data


def find_decoder(model) -> Tuple[Any, Any]:
    """(causal LM with ``capture_aux_hidden_states``, decoder with ``layers_to_capture``).

    Multimodal wrappers such as Kimi-K2.5's ``KimiK25ForConditionalGeneration`` hold the
    causal LM in ``language_model``. Raises ``DumpConfigError`` for a model without them.
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


def writer_cpus_note(is_writer: bool, writer_cpus) -> str:
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


# ---- per-request state -----------------------------------------------------------------
@dataclass
class _ReqDump:
    pending: Any = None  # writer.PendingDump while rows arrive
    release: Any = None  # weakref.finalize abandoning the request if the Req is dropped
    done: bool = False  # file named (or error recorded): later prefills are ignored
    output: bool = False  # asked for its output rows (format.OUTPUT_PARAM): named at its end
    num_prompt: int = 0  # its prompt's tokens (P), for output rows
    bound: int = 0  # file bytes the sampling policy holds for it until its end (output rows)


@dataclass
class _Take:
    """One request's rows of an extend batch, from its checks to its file's hand-over."""

    req: Any
    state: _ReqDump
    start: int  # first row in the batch's packed rows
    rows: int  # how many of them
    reservation: Any = None  # format.Reservation when these are the request's last rows
    settled: bool = False  # its file queued or failed


def dumped_token_ids(req):
    """The token ids a request's file records: the ids the model ran, one per row.

    For a text prompt that is ``req.origin_input_ids``. For a multimodal one (an
    ``image_url`` part of ``/v1/chat/completions``) SGLang 0.5.23 builds the prompt in its
    multimodal processor (e.g. ``multimodal/processors/qwen_vl.py``: chat template applied,
    each image placeholder expanded to one image token per vision token, as HF's processor
    does) and hands those ids to the scheduler, whose ``Req`` keeps them in
    ``origin_input_ids_unpadded``; the scheduler then replaces
    ``origin_input_ids`` by a copy whose image positions hold per-image pad values (hashes
    of the image, ``MultimodalDataItem.pad_value``, for the radix cache and for
    ``embed_mm_inputs`` to find where each image's embeddings go:
    ``scheduler.py`` ``duplicate_pad_mm_input_ids`` -> ``mm_utils.pad_mm_tokens``). The
    language model runs the vision tower's merged embeddings at those positions; the pad
    values are no token of the vocabulary. So the file records the unpadded ids, the image
    token id at every vision-token position, which is what HF's processor returns, when
    they are as long as the padded ones (every padding pattern of 0.5.23 keeps the
    length); otherwise (none known) the padded ids, as before.
    """
    ids = req.origin_input_ids
    unpadded = getattr(req, "origin_input_ids_unpadded", None)
    if unpadded is not None and unpadded is not ids and len(unpadded) == len(ids):
        return unpadded
    return ids


def image_token_metadata(model_config) -> dict:
    """``{"image_token_id": "<id>"}`` for a model whose prompts can hold images, else ``{}``.

    The id is the one the file's ``token_ids`` hold at every vision-token position
    (``dumped_token_ids``): ``hf_config.image_token_id`` (Qwen2-VL family; SGLang's
    ``ModelConfig`` reads it too), else ``media_placeholder_token_id`` (Kimi-K2.5, Kimi-VL),
    read from the top-level config. A trainer masks image rows with
    ``token_ids == image_token_id`` (docs/images.md)."""
    hf_config = getattr(model_config, "hf_config", None)
    for key in ("image_token_id", "media_placeholder_token_id"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return {"image_token_id": str(value)}
    return {}


def _custom_param(req, key: str):
    """``sampling_params.custom_params[key]`` of SGLang's Req, or None."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return params.get(key) if isinstance(params, dict) else None


def _answers_early(req) -> bool:
    """Whether ``req`` asked not to wait for its file (``hidden_states_wait`` false): its
    answer then says ``hidden_states_pending`` beside the path."""
    return _custom_param(req, fmt.WAIT_PARAM) is False


def _detach(state: _ReqDump) -> None:
    if state.release is not None:
        state.release.detach()
        state.release = None


class DumpSession:
    """One scheduler process's dump of the target model's prompt hidden states (and, with
    ``output_rows``, of the generated tokens fed back, for the requests that ask).

    ``config``: the validated options; ``layer_ids``: the captured ids (resolved against
    ``num_layers``; id N is the last layer's output before the final norm);
    ``metadata``: the file header's strings; ``capture_full``: SGLang's
    ``CaptureHiddenMode.FULL``. ``writer`` (a ``DumpWriter``) and ``dir_fd`` (the dump
    directory, ``format.open_dump_dir``) are given on the writing rank only; a session
    without a writer captures (its rank's forward needs the layers) but writes nothing.
    """

    def __init__(self, config: DumpConfig, layer_ids: Sequence[int], num_layers: int, metadata: dict,
                 capture_full: Any, writer: Any = None, dir_fd: Optional[int] = None,
                 output_rows: bool = False):
        self.config = config
        # the patched SGLang calls on_outputs (patch 0009): requests may ask for output rows
        self.output_rows = output_rows
        self.layer_ids = tuple(layer_ids)
        self.num_layers = num_layers
        self.metadata = metadata
        self.capture_full = capture_full
        self.writer = writer
        self.dir_fd = dir_fd
        self.policy = None  # sampling.DumpPolicy on the writing rank (None: every request)

    @property
    def is_writer(self) -> bool:
        return self.writer is not None

    # ---- start and end ------------------------------------------------------------------
    @classmethod
    def start(cls, model_runner, output_rows: bool = False) -> Optional["DumpSession"]:
        """The session of SGLang's ``model_runner``, or None when it dumps nothing
        (dumping off, or a draft model's runner). ``output_rows``: the patched SGLang
        hands decode batches to ``on_outputs`` (patch 0009), so a request may ask for the
        rows of its generated tokens (``format.OUTPUT_PARAM``); without it that parameter
        is ignored (a prompt-only file, as before).

        Turns on aux capture of the dump layers in the target model; on the attention-TP
        rank 0 opens the dump directory, removes an earlier run's leftovers (logged) and
        starts the writer process. Raises ``DumpConfigError`` for layer ids the model
        cannot give and for a directory that cannot be used.
        """
        server_args = model_runner.server_args
        if not getattr(server_args, "dump_hidden_states_dir", None) or model_runner.is_draft_worker:
            return None
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.version import __version__ as sglang_version

        config = DumpConfig.from_server_args(server_args)
        lm, decoder = find_decoder(model_runner.model)
        num_layers = int(model_runner.model_config.num_hidden_layers)
        layer_ids = resolve_layer_ids(config.layer_ids, num_layers)
        decoder_classes = {c.__name__ for c in type(decoder).__mro__}
        if num_layers in layer_ids and not decoder_classes & set(FINAL_NORM_CAPTURE_MODELS):
            raise DumpConfigError(
                f"--dump-hidden-states-layers: id {num_layers} (before the final norm) is "
                f"patched for {', '.join(FINAL_NORM_CAPTURE_MODELS)} only, not "
                f"{type(decoder).__name__}; pass ids below {num_layers}"
            )
        lm.capture_aux_hidden_states = True
        decoder.layers_to_capture = list(layer_ids)

        session = cls(config, layer_ids, num_layers, capture_full=CaptureHiddenMode.FULL, metadata={
            "model_path": server_args.model_path,
            "sglang_version": sglang_version,
            "sglang_ext_version": __version__,
            "series": f"v{sglang_version}",
            **image_token_metadata(model_runner.model_config),
        }, output_rows=output_rows)
        is_writer = compat.attn_tp_rank(model_runner) == 0
        if is_writer:
            session._start_writer(model_runner)
        sampling = session.policy.describe() if session.policy is not None else ""
        logger.info(
            "hidden-state dump: layers %s of %d into %s (writer rank: %s%s)%s",
            list(layer_ids), num_layers, config.directory, is_writer,
            writer_cpus_note(is_writer, config.writer_cpus), f"; sampling: {sampling}" if sampling else "",
        )
        return session

    def _start_writer(self, model_runner) -> None:
        import torch

        from sglang_ext.metrics import model_name
        from sglang_ext.writer import DumpWriter

        config = self.config
        if config.store is None:
            self.dir_fd = fmt.open_dump_dir(config.directory)
            removed = fmt.clean_stale(self.dir_fd)
            if any(removed.values()):
                logger.warning("hidden-state dump: removed leftovers of an earlier run: %s", removed)
        on_cuda = str(model_runner.device).startswith("cuda")
        device = torch.device(model_runner.device, model_runner.gpu_id) if on_cuda else None
        self.writer = DumpWriter(
            self.dir_fd,
            arena_bytes=config.max_host_bytes,
            threads=config.writer_threads,
            layer_ids=self.layer_ids,
            num_layers=self.num_layers,
            metadata=self.metadata,
            device=device,
            metrics_model_name=model_name(model_runner.server_args),
            drain_timeout_s=config.drain_timeout_s,
            stats_interval_s=config.stats_interval_s,
            hidden_states_dtype=config.hidden_states_dtype,
            cpus=config.writer_cpus,
            spares=config.writer_spares,
            watchdog_s=config.watchdog_s,
            store_url=config.directory if config.store is not None else None,
        )
        self.policy = DumpPolicy(config.sample_rate, config.budget_bytes, config.min_free_bytes,
                                 dir_fd=self.dir_fd, metrics_model_name=model_name(model_runner.server_args),
                                 unwritten=self.writer.unwritten_bytes)
        hidden = getattr(model_runner.model_config, "hidden_size", None)
        if config.hidden_states_dtype == "fp8" and on_cuda and isinstance(hidden, int):
            from sglang_ext import quant

            # the fused fp8 kernel decided and compiled now, not in the first batch's hook
            fused = quant.warm_up(device, len(self.layer_ids), hidden,
                                  getattr(model_runner, "dtype", None) or torch.bfloat16)
            logger.info("hidden-state dump: fp8 rows quantized %s", "in one fused kernel" if fused
                        else "by torch kernels")

    def close(self, timeout: Optional[float] = None) -> bool:
        """Close the writer (``DumpWriter.close``: queued files are written within
        ``timeout`` s, the drain timeout by default) and the directory. True when every
        file was written or failed cleanly; True at once for a session without a writer
        or one already closed."""
        ok = True
        if self.writer is not None:
            ok = self.writer.close(timeout=timeout)
        if self.dir_fd is not None:
            os.close(self.dir_fd)
            self.dir_fd = None
        return ok

    # ---- every forward --------------------------------------------------------------------
    def capture_hidden_mode(self, batch, model_runner, mode):
        """``capture_full`` for the target model's extend (prefill) batches, else ``mode``."""
        if (
            model_runner.is_draft_worker
            or not batch.forward_mode.is_extend()
            or batch.forward_mode.is_target_verify()
        ):
            return mode
        return self.capture_full

    # ---- result processing (scheduler thread) --------------------------------------------
    def on_prefill_result(self, batch, logits_output, extend_input_len_per_req: Optional[List[int]]) -> None:
        """Hand this extend batch's rows to the writer, before its outputs are streamed.

        ``logits_output.hidden_states``: ``[sum(extend lens), num_layers * hidden_size]``,
        the packed aux hidden states of the dump layers, requests in ``batch.reqs`` order.
        With ``--dump-hidden-states-dtype fp8`` the writer quantizes them on the device
        (``sglang_ext.quant``, on its copy stream) before the device-to-host copy.
        The rows of the batch's dumped requests go to the arena in one copy per contiguous
        run (``DumpWriter.copy_rows``); chunked prefill: each chunk's rows go to their place
        in the request's file; a request whose last prompt row is in this batch gets its
        name reserved and its path recorded for the response, and its file queued. A
        request that fails gets ``hidden_states_error`` instead of a path (a reserved name
        is given back: its response is not out yet), as does one of ``input_embeds`` (no
        token ids to record: ``INPUT_EMBEDS_MESSAGE``) or a beam search (its custom_params
        are gone: ``BEAM_MESSAGE``); the batch is never interrupted. A
        request whose ``custom_params`` holds ``{"hidden_states_dump": false}``
        (``format.DUMP_PARAM``; only JSON false) is skipped: its rows were captured with the
        batch's, nothing is copied or written, its response carries no dump keys; so is one
        the sampling settings skip (``sampling.DumpPolicy``, decided at its first chunk).
        Nothing happens on a rank without a writer, or for a batch that is not an extend.

        An exception that escapes (one that is not an ``Exception``, e.g.
        ``KeyboardInterrupt``) first fails the batch's named requests that were not
        queued, so no lock is left with nothing behind it.
        """
        if self.writer is None or not batch.forward_mode.is_extend():
            return
        self.writer.poll()  # a writer that ended since the last batch is replaced before this one
        t0 = trace.now() if trace.enabled() else None
        hidden = logits_output.hidden_states
        takes: List[_Take] = []
        opened: List[_Take] = []
        try:
            self._take(batch, hidden, extend_input_len_per_req or [], takes)
            t_take = trace.now() if t0 is not None else None
            opened = self._hand_over(hidden, takes)
            t_copy = trace.now() if t0 is not None else None
        except BaseException as e:  # an unexpected error: no named file may be left unsettled
            for take in takes:
                if take.reservation is not None and not take.settled:
                    self._fail_take(take, e)
            raise
        self.writer.flush()
        if t0 is not None:
            trace.record("hook", reqs=len(opened), t0=t0, t_take=t_take, t_copy=t_copy, t1=trace.now())

    def _take(self, batch, hidden, lens: List[int], takes: List[_Take]) -> None:
        """Check each request's rows of the batch and reserve the names of those it
        finishes; appends their ``_Take`` to ``takes``. A request that fails here gets
        its error and is left out. A dumped request that streams under
        ``--incremental-streaming-output`` has its response keys held at its first chunk
        (``responses.hold_info``), before its first output."""
        decoding = set(map(id, batch.decoding_reqs or []))
        prefix_lens = batch.prefix_lens or [0] * len(batch.reqs)
        offset = 0
        for i, req in enumerate(batch.reqs):
            n = lens[i] if i < len(lens) else 0
            start, offset = offset, offset + n
            if id(req) in decoding or req.is_retracted or n == 0 or is_internal(req.rid):
                continue
            state = getattr(req, REQ_ATTR, None)
            if state is None:
                # decided once, at its first chunk: done at once when it is not dumped
                # (it asked not to be, or the sampling settings skip it)
                state = _ReqDump(output=self.output_rows and _custom_param(req, fmt.OUTPUT_PARAM) is True,
                                 num_prompt=len(req.origin_input_ids))
                state.done = not self._admit(req, state, hidden)
                setattr(req, REQ_ATTR, state)
                if not state.done and self.config.incremental_stream and getattr(req, "stream", False):
                    hold_info(req, self._response_keys(req))
                compat.release_request_cycle(req)
            if state.done:
                continue
            if req.finished() or compat.is_aborting(req):  # aborted (before or while its prefill ran)
                self._drop(state)
                self._settle(state, 0)
                continue
            try:
                take = _Take(req, state, start, self._check(req, state, hidden, n, prefix_lens[i]))
                if prefix_lens[i] + take.rows == len(req.origin_input_ids) and not state.output:
                    take.reservation = self._name(req, state, hidden.shape[1], hidden.dtype,
                                                  len(req.origin_input_ids))
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the batch
                self._fail(req, state, e)
                continue
            takes.append(take)

    def _response_keys(self, req) -> Tuple[str, ...]:
        """The ``meta_info`` keys ``req``'s answer may get: its manifest (store sink) or its
        path (and ``hidden_states_pending`` when it asked not to wait), or its error."""
        if self.config.store is not None:
            return (MANIFEST_KEY, ERROR_KEY)
        pending = (PENDING_KEY,) if _answers_early(req) else ()
        return (PATH_KEY, *pending, ERROR_KEY)

    def _admit(self, req, state: _ReqDump, hidden) -> bool:
        """Whether to dump ``req``: its ``custom_params`` ``hidden_states_dump``, then the
        sampling settings (``sampling.DumpPolicy``, given its file's bytes: its tokens x the
        file's bytes per token, ``hidden_states`` row, fp8 scales and token id). The tokens
        are the prompt's, or for a request with output rows the most its file can hold,
        ``P + max_new_tokens - 1`` (SGLang's ``sampling_params.max_new_tokens``; the prompt's
        alone when that is not an int), held as ``state.bound`` until ``_settle``."""
        asked = _custom_param(req, fmt.DUMP_PARAM)
        if self.policy is None:
            return asked is not False
        tokens = len(req.origin_input_ids)
        limit = getattr(getattr(req, "sampling_params", None), "max_new_tokens", None)
        if state.output and isinstance(limit, int) and limit > 1:
            tokens += limit - 1
        nbytes = self._file_bytes(tokens, hidden.shape[1], hidden.dtype)
        admitted = self.policy.admit(req.rid, asked if isinstance(asked, bool) else None, nbytes,
                                     provisional=state.output)
        if admitted and state.output:
            state.bound = nbytes
        return admitted

    def _file_bytes(self, tokens: int, width: int, dtype) -> int:
        """Bytes of a file of ``tokens`` rows of ``width`` elements (``fmt.dump_tensors``);
        0 when they cannot be told (such a request fails later, in ``_check`` or ``_open``)."""
        try:
            slots = len(self.layer_ids)
            return sum(s.nbytes for s in fmt.dump_tensors(tokens, slots, width // slots,
                                                          self.writer.file_dtype(dtype)))
        except Exception:  # noqa: BLE001
            return 0

    def _settle(self, state: _ReqDump, nbytes: int) -> None:
        """Tell the sampling policy what an output request's file came to (0: none);
        safe from a ``weakref.finalize`` callback (``DumpPolicy.settle`` only queues)."""
        if state.bound and self.policy is not None:
            self.policy.settle(state.bound, nbytes)
        state.bound = 0

    def _let_go(self, state: _ReqDump) -> None:
        """SGLang let go of a request before its end (``weakref.finalize``): its file is
        dropped (``DumpWriter.abandon`` only queues) and its bound given back."""
        if state.pending is not None:
            self.writer.abandon(state.pending)
        self._settle(state, 0)

    def _hand_over(self, hidden, takes: List[_Take]) -> List[_Take]:
        """Open the new requests in the arena (their token ids), copy the rows and queue
        the finished files. Returns the takes whose rows were copied."""
        opened = []
        held = 0  # rows of output requests this batch holds
        for take in takes:
            try:
                self._open(take.req, take.state, hidden)
                if take.state.output:
                    held += take.rows
                    err = self.writer.hold_error(take.state.pending, held)
                    if err is not None:
                        held -= take.rows
                        raise RuntimeError(err)
            except Exception as e:  # noqa: BLE001
                self._fail_take(take, e)
                continue
            opened.append(take)
        if not opened:
            return opened
        try:
            # ready=True: the forward that produced these rows has finished when this hook
            # runs. Under overlap scheduling, process_batch_result_prefill first
            # synchronizes result.copy_done, recorded on the copy stream after it waited
            # for the forward stream; without overlap (copy_done None) its
            # next_token_ids.tolist() has synchronized the stream the forward ran on.
            # (tests/tooling/test_patches.py and tests/tooling/test_nightly.py check that the sync
            # precedes the hook.) So the copy need not queue behind what the scheduler
            # stream holds now, e.g. the next batch's forward.
            self.writer.copy_rows(hidden, [(t.state.pending, t.start, t.rows) for t in opened], ready=True)
        except Exception as e:  # noqa: BLE001 - the batch's dumped requests fail, it goes on
            for take in opened:
                self._fail_take(take, e)
            return []
        for take in opened:
            if take.reservation is None:
                continue
            try:
                self.writer.finish(take.state.pending, take.reservation)
            except Exception as e:  # noqa: BLE001
                self._fail_take(take, e)
                continue
            take.settled = True
            take.state.pending = None
            _detach(take.state)
        return opened

    def _check(self, req, state: _ReqDump, hidden, n: int, prefix_len: int) -> int:
        """Check this chunk against what was sent. Returns how many of its ``n`` rows to
        take (rows past the prompt are not dumped)."""
        num_tokens = len(req.origin_input_ids)
        fmt.check_rid(req.rid)
        if getattr(req, "input_embeds", None) is not None:  # scheduler.py: input_ids = [1] * len
            raise RuntimeError(INPUT_EMBEDS_MESSAGE)
        if getattr(req, "beam_group", None) is not None:  # beam_search/coordinator.py validate_and_init
            raise RuntimeError(BEAM_MESSAGE)
        if state.output and getattr(req, "output_ids", None):
            raise RuntimeError(RETRACTED_MESSAGE)
        if hidden is None:
            raise RuntimeError("the forward captured no hidden states for this batch")
        if prefix_len == 0 and state.pending is not None and state.pending.rows:
            self._drop(state)  # retracted mid-prefill and started over
        if state.pending is not None:
            self.writer.check_current(state.pending)
        done_rows = state.pending.rows if state.pending is not None else 0
        if prefix_len != done_rows:
            raise RuntimeError(
                f"extend starts at token {prefix_len} but {done_rows} rows were dumped "
                f"(prefix reuse is not supported while dumping)"
            )
        return min(n, num_tokens - done_rows)

    def _open(self, req, state: _ReqDump, hidden) -> None:
        """Open the request in the writer at its first chunk (its token ids into the arena)."""
        if state.pending is not None:
            return
        if state.output:  # its row count is known at its end: finish_deferred sends it then
            state.pending = self.writer.start_deferred(req.rid, hidden.shape[1], hidden.dtype)
        else:
            state.pending = self.writer.start(req.rid, dumped_token_ids(req), hidden.shape[1], hidden.dtype)
        # A request dropped between chunks (aborted while waiting or retracted) never
        # reaches this hook again: drop its file when SGLang lets go of the Req.
        state.release = weakref.finalize(req, self._let_go, state)
        state.release.atexit = False

    def _name(self, req, state: _ReqDump, width: int, dtype, num_tokens: int,
              extra: Optional[dict] = None):
        """Reserve the finished request's file name and record its path for the response
        (and ``hidden_states_pending`` when it asked not to wait). ``width``: the row's
        elements, ``dtype``: the rows' torch dtype, ``num_tokens``: the file's rows,
        ``extra``: metadata a file with output rows adds (``format.output_metadata``).

        Store sink: reserve its handle (``DumpWriter.reserve_handle``) and record its
        transfer manifest (``store.PackedLayout.manifest``: the writer gives the stored
        dtype) as ``hidden_states_manifest``; the answer is
        always early, whatever the request's ``hidden_states_wait``: a reader polls the
        store for the object or its error marker (docs/store.md)."""
        if self.config.store is not None:
            from sglang_ext.store import pack_layout

            slots = len(self.layer_ids)
            dtype = self.writer.file_dtype(dtype)
            layout = pack_layout(num_tokens, slots, width // slots, dtype)
            handle = self.writer.reserve_handle(req.rid)
            state.done = True
            meta = {**self.writer.file_metadata(req.rid, dtype), **(extra or {})}
            set_info(req, MANIFEST_KEY, layout.manifest(handle, meta))
            return handle
        reservation = fmt.reserve(self.dir_fd, req.rid)
        state.done = True
        set_info(req, PATH_KEY, os.path.join(self.config.directory, reservation.name))
        if _answers_early(req):
            set_info(req, PENDING_KEY, True)
        return reservation

    def _fail(self, req, state: _ReqDump, e: BaseException) -> None:
        logger.error("hidden-state dump for rid %s failed: %s", fmt.brief_rid(req.rid), e)
        if self.writer is not None:
            self.writer.failed_here()
        self._drop(state)
        self._settle(state, 0)
        state.done = True
        set_info(req, ERROR_KEY, f"{type(e).__name__}: {e}")

    def _fail_take(self, take: _Take, e: BaseException) -> None:
        """A failure after the checks: a reserved name is given back and its path taken
        out of the response, which says ``hidden_states_error`` instead."""
        if isinstance(take.reservation, str):  # a store handle: its manifest goes
            drop_info(take.req, MANIFEST_KEY)
        elif take.reservation is not None:
            fmt.cancel(take.reservation)
            drop_info(take.req, PATH_KEY, PENDING_KEY)
        take.settled = True
        self._fail(take.req, take.state, e)

    def _drop(self, state: _ReqDump) -> None:
        _detach(state)
        if state.pending is not None:
            self.writer.abandon(state.pending)
            state.pending = None

    # ---- output rows (scheduler thread; patch 0009) ----------------------------------------
    def wants_host_rows(self, batch) -> bool:
        """Whether SGLang should copy this decode batch's hidden states to the host right
        behind its forward (``Scheduler._copy_result_to_cpu``'s ``return_hidden_states``):
        under overlap scheduling the next decode graph replay rewrites them before
        ``on_outputs`` sees this batch. True for a decode batch holding a request that asked
        for its output rows and is not done (one whose prefill result is not processed yet
        counts: under overlap its first decode step is launched before that)."""
        if self.writer is None or not self.output_rows or batch.forward_mode.is_extend():
            return False
        for req in batch.reqs:
            state = getattr(req, REQ_ATTR, None)
            if state is None:
                if _custom_param(req, fmt.OUTPUT_PARAM) is True:
                    return True
            elif state.output and not state.done:
                return True
        return False

    def on_outputs(self, batch, logits_output, extend_input_len_per_req: Optional[List[int]] = None) -> None:
        """After each request's finish check of this batch, before its outputs are streamed:
        the decode rows of the requests that asked for their output rows, and the files of
        those that ended.

        Decode batch: ``logits_output.hidden_states`` ``[bs, num_layers * hidden_size]``
        (SGLang's LAST capture: one row per request, ``batch.reqs`` order; on the host when
        ``wants_host_rows`` had SGLang copy it, else on the device), row ``i`` computed from
        the token fed at this step, the one sampled at the step before. Extend batch (the
        prefill's door): ``extend_input_len_per_req`` locates each request's rows; a request
        decoding in a mixed batch (``batch.decoding_reqs``) adds its one row there.

        A request's row is taken when SGLang appended a token for it in this step (its
        output ids are one ahead of its decode rows), so an overlap scheduler's extra tick
        after a finish adds nothing. A request that finished (``req.finished()``: EOS, stop
        string or token, ``max_new_tokens``, abort) gets its file now
        (``DumpWriter.finish_deferred``: ``T = P + G - 1`` rows, ``token_ids`` = prompt +
        output ids but the last, ``format.output_metadata``) and its path (or
        ``hidden_states_error``) in ``customized_info``. Rows out of step (a retraction)
        fail the request with a sentence. Nothing happens on a rank without a writer."""
        if self.writer is None or not self.output_rows:
            return
        extend = batch.forward_mode.is_extend()
        hidden = getattr(logits_output, "hidden_states", None) if logits_output is not None else None
        decoding = set(map(id, batch.decoding_reqs or [])) if extend else set()
        lens = extend_input_len_per_req or []
        rows: List[Tuple[Any, _ReqDump, int]] = []
        ends: List[Tuple[Any, _ReqDump]] = []
        offset = 0
        for i, req in enumerate(batch.reqs):
            row = i
            if extend:
                row, offset = offset, offset + (lens[i] if i < len(lens) else 0)
            state = getattr(req, REQ_ATTR, None)
            if state is None or not state.output or state.done or state.pending is None or req.is_retracted:
                continue
            have = state.pending.rows - state.num_prompt  # decode rows so far
            if have < 0:
                continue  # prompt rows still coming (chunked prefill)
            fed = len(req.output_ids) - 1  # generated tokens fed back, this step's included
            try:
                self.writer.check_current(state.pending)  # its writer process died: it fails
                if have == fed - 1 and (not extend or id(req) in decoding):
                    if hidden is None:
                        raise RuntimeError("the decode batch captured no hidden states")
                    rows.append((req, state, row))
                elif have != fed:
                    raise RuntimeError(OUT_OF_STEP_MESSAGE.format(rows=have, fed=fed))
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the batch
                self._fail(req, state, e)
                continue
            if req.finished():
                ends.append((req, state))
        if rows:
            self._copy_decode_rows(hidden, rows)
        for req, state in ends:
            if not state.done:
                self._end_output(req, state)
        if rows or ends:
            self.writer.flush()

    def _copy_decode_rows(self, hidden, rows) -> None:
        """Copy one row each of ``hidden`` (``rows``: ``(req, state, row)``) to the arena,
        held for their requests. The rows are gathered first (a device ``hidden``, a decode
        graph's output buffer that the next replay rewrites, on the current stream), so the
        copy reads rows that stay and fp8 quantizes only theirs."""
        import torch

        kept = []
        held = 0
        for req, state, row in rows:
            err = self.writer.hold_error(state.pending, held + 1)
            if err is not None:
                self._fail(req, state, RuntimeError(err))
                continue
            held += 1
            kept.append((req, state, row))
        if not kept:
            return
        # Only the kept rows go on: the whole batch would be quantized under fp8 (on the
        # scheduler's CPU for host rows) for a few requests' rows.
        index = torch.tensor([r for _, _, r in kept], dtype=torch.int64)
        if hidden.is_cuda:
            index = index.to(hidden.device, non_blocking=True)
        src = hidden.index_select(0, index)
        segments = [(s.pending, j, 1) for j, (_, s, _) in enumerate(kept)]
        ready = not hidden.is_cuda  # a device gather is on the current stream: the copy waits for it
        try:
            self.writer.copy_rows(src, segments, ready=ready)
        except Exception as e:  # noqa: BLE001 - the batch's output requests fail, it goes on
            for req, state, _ in kept:
                self._fail(req, state, e)

    def _end_output(self, req, state: _ReqDump) -> None:
        """Name the ended request's file and send it (``DumpWriter.finish_deferred``)."""
        pending = state.pending
        take = _Take(req, state, 0, 0)
        try:
            # the ids its answer names (SGLang's output_ids_through_stop): a request with
            # max_new_tokens 0 appends the step's token (a dummy 0 in a prefill-only batch)
            # and ends with finished_len 0, so it names none
            out = [int(t) for t in getattr(req, "output_ids_through_stop", req.output_ids)]
            if not out:
                raise RuntimeError("the request ended without generating a token (as with max_new_tokens 0): "
                                   "a file with output rows needs one")
            ids = list(dumped_token_ids(req)) + out[:-1]
            extra = fmt.output_metadata(state.num_prompt, out[-1])
            take.reservation = self._name(req, state, pending.row_width, pending.dtype, len(ids), extra)
            self.writer.finish_deferred(pending, take.reservation, ids, extra)
        except Exception as e:  # noqa: BLE001
            self._fail_take(take, e)
            return
        state.pending = None
        _detach(state)
        self._settle(state, self._file_bytes(len(ids), pending.row_width, pending.dtype))
