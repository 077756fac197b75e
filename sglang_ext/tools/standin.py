"""``sglang-ext standin``: a stand-in server for trying the client without a GPU.

Not SGLang and no model: an HTTP server that answers as the patched SGLang server does
for what ``extract`` (and speculators' client) send, and writes each request's file
exactly as the patched server names and lays it out, through ``sglang_ext.format`` itself:
the name (``reserve``: ``<safe_stem(rid)>[-n].safetensors``, its ``.lock`` held until the
file is in place), the layout and metadata (``file_layout``, ``build_metadata``), a
temporary name then a rename (``tmp_name``, ``create_tmp``, ``publish``), the
``index.jsonl`` line, then ``complete`` (or ``fail``: ``<name>.error``). Only the values
differ: ``hidden_states[t, j, h]`` is ``values(token_ids, layer_ids, hidden_size)``
(``standin_model``), a pseudo-random number from (token id, position, layer id,
channel), and the metadata says so (``model_path`` is ``"kimi-sglang standin"``). Needs numpy alone (the ``[client]``
install); ``mooncake://`` also needs requirements/store.txt.

Endpoints:
- ``GET /health`` (200), ``GET /server_info`` (``dump_hidden_states_dir`` absolute, the
  layers, ``model_path``), ``GET /v1/models``.
- ``POST /generate`` ``{"input_ids": [int, ...], "rid"?, "sampling_params"?, "stream"?}``: one
  prompt (no tokenizer: ``text`` is refused, HTTP 400); ``stream`` true: the answer as one
  ``data:`` chunk then ``data: [DONE]`` (an error: an error chunk), as SGLang streams. ``meta_info.hidden_states_path`` once the
  file is complete; with ``custom_params {"hidden_states_wait": false}`` at once with
  ``hidden_states_pending: true`` (the file is complete when ``<path>.lock`` is gone);
  ``{"hidden_states_dump": false}``: no file. A failed write: ``hidden_states_error``.
  ``{"hidden_states_output": true}``: it "generates" ``max_new_tokens`` (default 128) ids
  (``standin_model.generated_ids``: a hash of the prompt and position, and of the rid when
  ``temperature`` > 0, SGLang's default 1.0; stops after an id of ``stop_token_ids``),
  answers them as ``output_ids``, and the file holds the prompt's rows then those of every
  generated id but the last, ``num_prompt_tokens`` and ``last_token_id`` in its metadata
  (``format.output``), the rows from the same ``values``.
- ``POST /v1/completions`` ``{"prompt": [int, ...]}``: the OpenAI answer plus top-level
  ``kv_transfer_params {"hidden_states_path": P}`` (speculators' client); a failed dump is
  HTTP 500; output rows with ``custom_params`` as above or vLLM's ``kv_transfer_params
  {"include_output_tokens": true}`` (``max_tokens``, default 16; ``return_token_ids``
  adds ``choices[0].token_ids``); ``stream`` true is HTTP 400. ``/v1/chat/completions`` is
  HTTP 400: no chat template.
- Both refuse, HTTP 400 in SGLang's words, a prompt of ``--context-length`` tokens or more
  or one whose ``max_new_tokens`` (``max_tokens``) would run past it, as the server does.
- Store sink (``--dump-dir mooncake://HOST:PORT?...``, as the server's flag): each sample
  is put into the Mooncake Store in ``sglang_ext.store``'s packed layout, the answer (always
  at once) carries ``meta_info.hidden_states_manifest``; a failed put leaves the
  ``<handle>:error`` marker. The store connection is ``sglang_ext.store_client``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from sglang_ext import __version__
from sglang_ext import format as fmt
from sglang_ext.tools.standin_model import bf16_bytes, generated_ids, values  # noqa: F401 - re-exported

MODEL_PATH = "kimi-sglang standin"  # the files' model_path: these are not a model's values
VERSION = "standin"  # the files' sglang_version and series: no SGLang ran
DTYPE = "bfloat16"

class Dump:
    """Where samples go: the directory sink (``dir_fd`` open) or the store sink
    (``store``: a connected ``store_client.StoreClient``). ``metadata(rid)``: a file's
    ``__metadata__``."""

    def __init__(self, target: str, layer_ids: Tuple[int, ...], num_layers: int, hidden_size: int):
        from sglang_ext import config

        self.layer_ids, self.num_layers, self.hidden_size = layer_ids, num_layers, hidden_size
        self.dir_fd: Optional[int] = None
        self.store = None
        self.closing = False  # set at shutdown: failed puts get no marker (put)
        store_config = config.store_target(target)
        if store_config is None:
            if not os.path.lexists(target):
                try:
                    os.makedirs(target, mode=0o700)
                except OSError as e:
                    raise config.DumpConfigError(f"--dump-dir {target}: cannot create it ({e.strerror})") from None
            self.target = config.check_directory(target)
            self.dir_fd = fmt.open_dump_dir(self.target)
            fmt.clean_stale(self.dir_fd)
        else:
            from sglang_ext.store_client import StoreClient

            self.target = target
            self.store = StoreClient(store_config).connect("the stand-in's store sink", probe_s=5.0)

    def metadata(self, rid: str, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        return fmt.build_metadata(rid=rid, layer_ids=self.layer_ids, num_layers=self.num_layers, extra={
            "model_path": MODEL_PATH, "sglang_version": VERSION, "sglang_ext_version": __version__,
            "series": VERSION, **(extra or {})})

    def tensors(self, ids: List[int]) -> Dict[str, bytes]:
        return {fmt.KEY_HIDDEN_STATES: bf16_bytes(values(ids, self.layer_ids, self.hidden_size)),
                fmt.KEY_TOKEN_IDS: np.asarray(ids, dtype="<i8").tobytes()}

    # -- directory sink: the writer process's steps (writer_process._begin, _finish, _index)
    def write(self, res: fmt.Reservation, rid: str, ids: List[int],
              extra: Optional[Dict[str, str]] = None) -> None:
        """Write ``res``'s file, index it, release the lock; on any failure ``fmt.fail``
        (``<name>.error``). Never raises."""
        tmp = fmt.tmp_name("standin", os.getpid())
        fd = None
        try:
            specs = fmt.dump_tensors(len(ids), len(self.layer_ids), self.hidden_size, DTYPE)
            layout = fmt.file_layout(specs, self.metadata(rid, extra))
            data = self.tensors(ids)
            fd = fmt.create_tmp(res.dir_fd, tmp)
            fmt.pwrite_all(fd, layout.header, 0)
            for spec in specs:
                fmt.pwrite_all(fd, data[spec.name], layout.offsets[spec.name])
            os.close(fd)
            fd = None
            fmt.publish(res.dir_fd, tmp, res.name)
            tmp = ""
            try:
                fmt.append_index(res.dir_fd, fmt.index_record(rid, res.name, len(ids), layout.size,
                                                              json.dumps(list(self.layer_ids))))
            except OSError:
                os.unlink(res.name, dir_fd=res.dir_fd)  # one outcome per request: no unindexed file
                raise
        except Exception as e:  # noqa: BLE001 - the request's error, as the writer reports it
            if fd is not None:
                os.close(fd)
            if tmp:
                try:
                    os.unlink(tmp, dir_fd=res.dir_fd)
                except OSError:
                    pass
            fmt.fail(res, f"{type(e).__name__}: {e}")
            return
        fmt.complete(res)

    # -- store sink: the store writer's put (store_writer._finish, _fail)
    def put(self, handle: str, layout, rid: str, ids: List[int]) -> None:
        """Put the packed sample under ``handle``; on failure the ``<handle>:error``
        marker (not while shutting down: ``closing``, so a dead master is waited for once
        per put, not twice). Never raises."""
        try:
            self.store.put_packed(handle, layout, {k: [v] for k, v in self.tensors(ids).items()})
        except Exception as e:  # noqa: BLE001
            if self.closing:
                return
            try:
                self.store.put_error(handle, f"{type(e).__name__}: {e}")
            except Exception:  # noqa: BLE001 - the reader times out on the handle instead
                pass

    def close(self) -> None:
        if self.dir_fd is not None:
            os.close(self.dir_fd)
        if self.store is not None:
            self.store.close()


class BadRequest(ValueError):
    """HTTP 400 with this sentence."""


def _token_ids(value: Any, key: str) -> List[int]:
    if not (isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2 ** 63 for t in value)):
        raise BadRequest(f"{key} must be one non-empty list of token ids (ints >= 0); the stand-in "
                         f"takes one prompt per request and has no tokenizer")
    return value


def _rid(rid: Any) -> str:
    rid = uuid.uuid4().hex if rid is None else rid
    if not isinstance(rid, str):
        raise BadRequest(f"rid must be a string, not {type(rid).__name__}")
    return rid


def _check_length(ids: List[int], max_new_tokens: Any, context_len: int) -> None:
    """``BadRequest`` in SGLang's words (``TokenizerManager._validate_one_request``) for a
    prompt of ``context_len`` tokens or more, or an int ``max_new_tokens`` that with the
    prompt exceeds ``context_len``: a real server answers HTTP 400, never generating."""
    if len(ids) >= context_len:
        raise BadRequest(f"The input ({len(ids)} tokens) is longer than the model's context length "
                         f"({context_len} tokens).")
    if isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool) \
            and max_new_tokens + len(ids) > context_len:
        raise BadRequest(f"Requested token count exceeds the model's maximum context length of "
                         f"{context_len} tokens. You requested a total of {max_new_tokens + len(ids)} "
                         f"tokens: {len(ids)} tokens from the input messages and {max_new_tokens} "
                         f"tokens for the completion. Please reduce the number of tokens in the "
                         f"input messages or the completion to fit within the limit.")


def _generation(ids: List[int], rid: str, max_new_tokens: Any, temperature: Any,
                stop_token_ids: Any) -> Tuple[List[int], dict]:
    """``generated_ids`` for a request's sampling parameters (temperature > 0: sampled,
    the rid seeds it). Raises ``BadRequest`` for values SGLang would refuse."""
    if not (isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool) and max_new_tokens >= 1):
        raise BadRequest(f"max_new_tokens must be an int >= 1 with hidden_states_output, not {max_new_tokens!r}")
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature >= 0):
        raise BadRequest(f"temperature must be a number >= 0, not {temperature!r}")
    stops = [] if stop_token_ids is None else stop_token_ids
    if not (isinstance(stops, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in stops)):
        raise BadRequest("stop_token_ids must be a list of token ids")
    return generated_ids(ids, max_new_tokens, stops, seed=rid if temperature > 0 else None)


CONTEXT_LEN = 32768  # the pretend model's context length (--context-length), in tokens
MAX_BODY_BYTES = 256 << 20  # the largest request body the stand-in reads (413 above it)


def _body_refusal(headers) -> Optional[Tuple[int, str]]:
    """(HTTP code, sentence) for a request body the stand-in will not read, else None: a
    chunked one (411: it reads ``Content-Length`` bytes only, and would see an empty body),
    a ``Content-Length`` that is not a non-negative integer (400) or above
    ``MAX_BODY_BYTES`` (413, instead of allocating it)."""
    if "chunked" in (headers.get("Transfer-Encoding") or "").lower():
        return 411, "send the request body with a Content-Length (the stand-in does not read chunked bodies)"
    length = headers.get("Content-Length") or "0"
    if not (length.isascii() and length.isdigit()):
        return 400, f"Content-Length {length[:40]!r} is not a non-negative integer"
    if int(length) > MAX_BODY_BYTES:
        return 413, f"a request body of {int(length)} bytes is over the stand-in's {MAX_BODY_BYTES} bytes"
    return None


class _HTTPServer(ThreadingHTTPServer):
    request_queue_size = 1024  # listen backlog: socketserver's 5 reset connections at --concurrency 5000


class JsonReplyHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 (connections kept alive), TCP_NODELAY, no access log, JSON replies (``reply``):
    the stand-in's handler, and the base of the tests' fake servers and proxies."""

    protocol_version = "HTTP/1.1"
    # TCP_NODELAY (socketserver's setting): headers and body go out as two writes, and
    # without it Nagle's algorithm and the client's delayed ACK add ~40 ms to every reply
    disable_nagle_algorithm = True

    def log_message(self, *args):
        pass

    def reply(self, code: int, obj: Any, content_type: str = "application/json") -> None:
        """Send HTTP ``code`` with ``Content-Type: content_type`` and the body: ``obj``
        as JSON, ``bytes`` as they are (a body already encoded), None an empty body."""
        body = b"" if obj is None else obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Server:
    """The stand-in: ``dump`` (``Dump``) behind a threading HTTP server on ``host:port``
    (0: any free port; ``url`` says which). Writes run on ``writers`` threads after the
    name is reserved, as the writer process's do."""

    def __init__(self, dump: Dump, host: str, port: int, writers: int = 2, policy=None,
                 context_len: int = CONTEXT_LEN):
        from sglang_ext.sampling import DumpPolicy

        self.dump = dump
        self.context_len = context_len  # prompt + max_new_tokens above it: HTTP 400 (_check_length)
        # the server's sampling settings (KIMI_SGLANG_SAMPLE_RATE, ..._DUMP_BUDGET_GB,
        # ..._MIN_FREE_GB), decided per request as the server does (sglang_ext.sampling)
        self.policy = policy or DumpPolicy(dir_fd=dump.dir_fd)
        self.pool = ThreadPoolExecutor(writers, thread_name_prefix="standin-writer")
        self.queued: List[Any] = []  # the store sink's puts not done yet (dropped at shutdown if not started)
        server = self

        class Handler(JsonReplyHandler):
            def do_GET(self):
                self.reply(*server.get(self.path))

            def stream(self, chunks: List[Any]) -> None:
                """A streamed ``/generate`` answer as SGLang sends it (``text/event-stream``):
                ``data: <json>`` per chunk, then ``data: [DONE]``; the stand-in has the
                whole answer at once, so it is one chunk, whose meta_info names the file."""
                self.reply(200, b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
                           + b"data: [DONE]\n\n", content_type="text/event-stream")

            def do_POST(self):
                refused = _body_refusal(self.headers)
                if refused is not None:  # its body is left unread: the connection closes
                    self.close_connection = True
                    code, message = refused
                    self.reply(code, {"error": {"message": message}, "object": "error", "code": code})
                    return
                streamed = False
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                    if not isinstance(body, dict):
                        raise BadRequest("the request body must be a JSON object")
                    streamed = self.path == "/generate" and body.get("stream") is True
                    code, answer = server.post(self.path, body)
                    if streamed and code == 200:
                        self.stream([answer])
                    else:
                        self.reply(code, answer)
                except (BadRequest, ValueError) as e:
                    if streamed:  # SGLang's stream_results: an error chunk, HTTP 200
                        self.stream([{"error": {"message": str(e), "type": "invalid_request_error",
                                                "code": 400, "retryable": False}}])
                    else:
                        self.reply(400, {"error": {"message": str(e)}, "object": "error", "code": 400})
                except Exception as e:  # noqa: BLE001 - e.g. custom_params not an object: a sentence
                    self.reply(500, {"error": {"message": f"{type(e).__name__}: {e}"}, "object": "error",
                                     "code": 500})

        self.httpd = _HTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"

    def get(self, path: str) -> Tuple[int, Any]:
        d = self.dump
        if path == "/health":  # SGLang's: 200, no body
            return 200, None
        if path == "/server_info":
            return 200, {"model_path": MODEL_PATH, "version": VERSION, "dump_hidden_states_dir": d.target,
                         "dump_hidden_states_layers": ",".join(map(str, d.layer_ids)),
                         "num_hidden_layers": d.num_layers, "hidden_size": d.hidden_size}
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": MODEL_PATH, "object": "model", "owned_by": "kimi-sglang"}]}
        return 404, {"detail": "Not Found"}

    def post(self, path: str, body: Dict[str, Any]) -> Tuple[int, Any]:
        if path == "/generate":
            ids = _token_ids(body.get("input_ids"), "input_ids")
            sampling = body.get("sampling_params") or {}
            _check_length(ids, sampling.get("max_new_tokens"), self.context_len)
            params = sampling.get("custom_params") or {}
            rid = _rid(body.get("rid"))
            out = None
            if params.get(fmt.OUTPUT_PARAM) is True:
                out = _generation(ids, rid, sampling.get("max_new_tokens", 128),
                                  sampling.get("temperature", 1.0), sampling.get("stop_token_ids"))
            meta = self.generate(ids, rid, params, out)
            return 200, {"text": "", "output_ids": out[0] if out else [0], "meta_info": meta}
        if path == "/v1/completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
                prompt = prompt[0]
            if body.get("stream") is True:
                raise BadRequest("the stand-in does not stream /v1/completions: send stream false, "
                                 "or POST /generate with stream true")
            ids = _token_ids(prompt, "prompt")
            _check_length(ids, body.get("max_tokens"), self.context_len)
            params = body.get("custom_params") or {}
            rid = _rid(body.get("rid"))
            out = None
            if params.get(fmt.OUTPUT_PARAM) is True or (body.get("kv_transfer_params") or {}).get(
                    fmt.VLLM_OUTPUT_PARAM) is True:
                out = _generation(ids, rid, body.get("max_tokens", 16), body.get("temperature", 1.0),
                                  body.get("stop_token_ids"))
            meta = self.generate(ids, rid, params, out)
            return self.completion(ids, meta, body, out)
        if path == "/v1/chat/completions":
            raise BadRequest("the stand-in has no chat template or tokenizer: send token ids to "
                             "/generate (extract: rows with input_ids)")
        return 404, {"detail": "Not Found"}

    def generate(self, ids: List[int], rid: str, params: Dict[str, Any],
                 out: Optional[Tuple[List[int], dict]] = None) -> Dict[str, Any]:
        """One request's ``meta_info``: its file's path (or manifest, or error). ``out``:
        ``(output_ids, finish_reason)`` of a request that asked for its output rows; its
        file then holds the prompt and every generated id but the last (``format.output``)."""
        n_out = len(out[0]) if out else 1
        meta: Dict[str, Any] = {"id": rid, "prompt_tokens": len(ids), "completion_tokens": n_out,
                                "finish_reason": out[1] if out else {"type": "length", "length": 1}}
        if params.get(fmt.DUMP_PARAM) is False or fmt.is_internal(rid):  # as the server
            return meta
        fed = len(ids) + (len(out[0]) - 1 if out else 0)
        specs = fmt.dump_tensors(fed, len(self.dump.layer_ids), self.dump.hidden_size, DTYPE)
        if not self.policy.admit(rid, params.get(fmt.DUMP_PARAM), sum(s.nbytes for s in specs)):  # sampled out
            return meta
        try:
            fmt.check_rid(rid)
        except ValueError as e:
            return {**meta, fmt.ERROR_KEY: f"ValueError: {e}"}
        extra = None
        if out:
            extra = fmt.output_metadata(len(ids), out[0][-1])
            ids = fmt.fed_token_ids(ids, out[0])
        d = self.dump
        if d.store is not None:
            from sglang_ext.store import pack_layout, unique_handle

            layout = pack_layout(len(ids), len(d.layer_ids), d.hidden_size, DTYPE)
            handle = unique_handle(rid)
            self.queued = [f for f in self.queued if not f.done()]
            self.queued.append(self.pool.submit(d.put, handle, layout, rid, ids))
            return {**meta, fmt.MANIFEST_KEY: layout.manifest(handle, d.metadata(rid, extra))}
        try:
            res = fmt.reserve(d.dir_fd, rid)
        except OSError as e:
            return {**meta, fmt.ERROR_KEY: f"{type(e).__name__}: {e}"}
        path = os.path.join(d.target, res.name)
        if params.get(fmt.WAIT_PARAM) is False:
            self.pool.submit(d.write, res, rid, ids, extra)
            return {**meta, fmt.PATH_KEY: path, fmt.PENDING_KEY: True}
        self.pool.submit(d.write, res, rid, ids, extra).result()
        error = fmt.wait_complete(path)
        return {**meta, fmt.ERROR_KEY: error} if error is not None else {**meta, fmt.PATH_KEY: path}

    @staticmethod
    def completion(ids: List[int], meta: Dict[str, Any], body: Dict[str, Any],
                   out: Optional[Tuple[List[int], dict]] = None) -> Tuple[int, Any]:
        """The ``/v1/completions`` answer with the dump's ``kv_transfer_params``
        (``responses.openai_completion_extras``: a failed dump is HTTP 500)."""
        if meta.get(fmt.ERROR_KEY):
            return 500, {"object": "error", "message": f"hidden-state dump failed: {meta[fmt.ERROR_KEY]}",
                         "code": 500}
        finish = "stop" if out and out[1]["type"] == "stop" else "length"
        choice: Dict[str, Any] = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish}
        if body.get("return_token_ids"):
            choice["prompt_token_ids"] = ids
            if out:
                choice["token_ids"] = out[0]
        n_out = meta["completion_tokens"]
        answer = {"id": f"cmpl-{meta['id']}", "object": "text_completion", "created": 0,
                  "model": MODEL_PATH, "choices": [choice],
                  "usage": {"prompt_tokens": len(ids), "completion_tokens": n_out,
                            "total_tokens": len(ids) + n_out}}
        if fmt.MANIFEST_KEY in meta:
            answer["kv_transfer_params"] = meta[fmt.MANIFEST_KEY]
        elif fmt.PATH_KEY in meta:
            answer["kv_transfer_params"] = {fmt.PATH_KEY: meta[fmt.PATH_KEY]}
        return 200, answer

    def serve(self) -> None:
        """Serve until SIGTERM or Ctrl-C, then let the writes in flight finish."""
        def stop(signum, frame):
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, stop)
        try:
            self.httpd.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.httpd.server_close()
            self.dump.closing = True
            # Store sink: puts not started are dropped (each may wait Mooncake's RPC timeout
            # on a master that died, so a queue of them took minutes); their answers are
            # out, their readers time out. Files are fast and never dropped: a reserved
            # name left unsettled would hold its reader's lock.
            self.pool.shutdown(wait=True, cancel_futures=self.dump.store is not None)
            dropped = sum(f.cancelled() for f in self.queued)
            if dropped:
                print(f"stand-in: {dropped} store puts not started at shutdown were dropped; "
                      f"their readers time out", file=sys.stderr, flush=True)
            self.dump.close()


def _run(args) -> int:
    from sglang_ext import config

    try:
        if not 0 <= args.port <= 65535:  # else the socket layer's OverflowError, a traceback
            raise ValueError(f"--port must be 0 to 65535, not {args.port}")
        layer_ids = config.resolve_layer_ids(config.parse_layer_ids(args.layers), args.num_layers)
        if args.hidden_size < 1:
            raise ValueError(f"--hidden-size must be at least 1, not {args.hidden_size}")
        if args.context_length < 2:
            raise ValueError(f"--context-length must be at least 2, not {args.context_length}")
        sampling = config.sampling_settings()
        dump = Dump(args.dump_dir, layer_ids, args.num_layers, args.hidden_size)
    except (ValueError, OSError, RuntimeError) as e:  # DumpConfigError; the store's StoreError
        print(f"error: {e}", file=sys.stderr)
        return 2
    from sglang_ext.sampling import DumpPolicy

    policy = DumpPolicy(sampling["sample_rate"], sampling["budget_bytes"], sampling["min_free_bytes"],
                        dir_fd=dump.dir_fd)
    try:
        server = Server(dump, args.host, args.port, policy=policy, context_len=args.context_length)
    except OSError as e:
        dump.close()
        print(f"error: cannot listen on {args.host}:{args.port} ({e.strerror or e})", file=sys.stderr)
        return 2
    print(f"stand-in server (not SGLang, no model: values from the token ids) at {server.url}, "
          f"layers {list(layer_ids)}, hidden size {args.hidden_size}, dumping into {dump.target}",
          file=sys.stderr, flush=True)
    server.serve()
    return 0


def add_parser(subparsers) -> None:
    """Add ``standin`` to the top-level CLI's subparsers."""
    p = subparsers.add_parser("standin", help="a stand-in server for trying extract without a GPU",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dump-dir", "--dump-hidden-states-dir", dest="dump_dir", required=True,
                   help="directory for the files (created 0700 when missing; the server's rules "
                        "otherwise), or mooncake://HOST:PORT?... for the store sink")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port (default 30000, SGLang's; 0: any free one)")
    p.add_argument("--num-layers", type=int, default=8,
                   help="N, the pretend model's decoder layers (default 8)")
    p.add_argument("--layers", "--dump-hidden-states-layers", dest="layers",
                   help="layer ids, e.g. 2,4,5,8 (default: [2, N//2, N-3, N], as the server)")
    p.add_argument("--hidden-size", type=int, default=64, help="channels per layer (default 64)")
    p.add_argument("--context-length", type=int, default=CONTEXT_LEN,
                   help=f"the pretend model's context length in tokens (default {CONTEXT_LEN}): a prompt "
                        f"that long, or a prompt plus max_new_tokens (max_tokens) over it, is HTTP 400 "
                        f"in SGLang's words, as the server refuses it")
    p.set_defaults(func=_run)
