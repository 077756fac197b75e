"""Talking to the server over HTTP: the start-up probe, ``POST /generate`` (token ids),
``POST /v1/chat/completions`` (rows with images), retry delays.

Errors: ``RequestError`` (one try failed: retry it), ``RowError`` (HTTP 400, the server
refused the row: do not retry) and ``FatalError`` (an answer no retry can change: stop the
run). A quoted answer body is cut to one short line (``dataset.one_line``).

Bounds on what a server sends: an answer's body is read up to ``MAX_ANSWER_BYTES`` (16 MiB)
and its JSON parsed up to the nesting Python's parser takes (about 1000 levels); past
either, the try fails with one sentence (``/server_info``: a note, the hint is dropped).
``--timeout`` (aiohttp's total timeout) bounds a whole request, an answer that trickles
included.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any, Dict, List, NamedTuple, Optional, Tuple
from urllib.parse import urlsplit

from sglang_ext import format as fmt
from sglang_ext.client.dataset import one_line
from sglang_ext.client.pending import PendingFiles


class RequestError(RuntimeError):
    """One try failed (HTTP, connection, server-side dump error, bad file)."""


class RowError(RequestError):
    """The server refused this row itself (HTTP 400): trying it again cannot succeed."""


class FatalError(RequestError):
    """An answer no retry can change (the server is not dumping, its dump directory is not
    visible here, the endpoint has no /generate): the run stops at once."""


class UsageError(FatalError):
    """An answer this command line cannot take (samples in a store, no ``--store``): the
    run stops at once, exit 2 (bad input)."""


# The answer's meta_info key of a server that puts samples into a Mooncake Store: the
# transfer manifest (sglang_ext.store.PackedLayout.manifest), where files give PATH_KEY.
MANIFEST_KEY = fmt.MANIFEST_KEY


# The most of one answer's body read: SGLang's answer to one prompt is a few KiB, a chat
# answer with ``prompt_token_ids`` about 7 bytes per prompt token (16 MiB: ~2M tokens).
MAX_ANSWER_BYTES = 16 << 20


class BoundError(RequestError):
    """An answer over a bound extract keeps (``read_answer``, ``parse_answer``)."""


async def read_answer(resp, what: str) -> bytes:
    """The body of ``resp`` (``what``: "POST URL", for the message), at most
    ``MAX_ANSWER_BYTES``. Raises ``BoundError`` past that bound (an announced
    Content-Length is refused before any byte is read), and what aiohttp raises."""
    too_long = BoundError(f"the answer to {what} is over {MAX_ANSWER_BYTES >> 20} MiB (extract "
                          f"reads at most {MAX_ANSWER_BYTES >> 20} MiB of an answer)")
    if resp.content_length is not None and resp.content_length > MAX_ANSWER_BYTES:
        raise too_long
    chunks, n = [], 0
    while True:
        chunk = await resp.content.read(1 << 16)
        if not chunk:
            return b"".join(chunks)
        n += len(chunk)
        if n > MAX_ANSWER_BYTES:
            raise too_long
        chunks.append(chunk)


def parse_answer(text: str, what: str) -> Any:
    """``json.loads(text)``. Raises ``ValueError`` for text that is not JSON and
    ``BoundError`` for JSON nested deeper than Python's parser takes (its recursion
    limit, about 1000 levels: a RecursionError otherwise)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise BoundError(f"the answer to {what} is JSON nested deeper than Python's parser "
                         f"takes (about 1000 levels)") from None


class Answer(NamedTuple):
    """What the server named for one request: a file ``path`` (not yet trusted), or a
    store ``manifest`` (a dict, not yet checked); for a chat request, ``prompt_ids``: the
    token ids the server says it ran (``choices[0].prompt_token_ids``), None if not given."""

    path: Optional[str]
    manifest: Optional[Dict[str, Any]]
    prompt_ids: Optional[List[int]] = None
    output_ids: Optional[List[int]] = None  # --generate: the ids the server generated


def endpoint_error(url: str) -> Optional[str]:
    """Why ``--endpoint`` is not a usable base URL (one sentence), or None: it must be
    http(s), parse, name a host and, if it names a port, one in 1..65535, and hold no
    query or fragment (request paths are appended to it)."""
    if not url.startswith(("http://", "https://")):
        return f"--endpoint {url} must start with http:// or https://"
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError: not a number, or above 65535
    except ValueError as e:
        return (f"--endpoint {url} is not a valid URL ({e}): pass the server's base URL, "
                f"e.g. http://127.0.0.1:30000")
    if not parts.hostname:
        return (f"--endpoint {url} names no host: pass the server's base URL, "
                f"e.g. http://127.0.0.1:30000")
    if port is not None and not 1 <= port <= 65535:
        return f"--endpoint {url} has port {port}: a port is a number from 1 to 65535"
    if parts.query or parts.fragment:  # paths are appended to it: ?x=1/health
        return (f"--endpoint {url} has a query or fragment: pass the server's base URL, "
                f"e.g. http://127.0.0.1:30000")
    return None


def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """Seconds before retry ``attempt`` (1, 2, ...): ``base * 2**(attempt-1)``, capped,
    with up to 25% random jitter so that many workers do not retry in lockstep."""
    delay = min(cap, base * (2 ** (attempt - 1)))
    return delay * (1 + random.random() * 0.25)


BRIEF_CHARS = 200  # an answer's body quoted in a message: whitespace runs joined, then cut


def brief(text: str) -> str:
    """``text`` on one line, cut to ``BRIEF_CHARS`` with ``...``: an HTML error page must
    not flood stderr once per retry."""
    return one_line(text, BRIEF_CHARS)


PROBE_TIMEOUT_S = 30.0  # at most: a server that has not answered GET /health by then is not up


SERVER_INFO_PATHS = ("/server_info", "/get_server_info")  # SGLang 0.5.23's, then older releases


async def server_dump_dir(endpoint: str, timeout: float) -> Tuple[Optional[str], Optional[str]]:
    """``(directory, note)``: the server's ``--dump-hidden-states-dir`` as its ``GET
    /server_info`` gives it (the resolved server args; ``/get_server_info`` on releases
    without it), or None: no such answer within ``timeout``, not JSON, no string there (a
    server without the dump, a router that does not forward it). Only a hint, for a run
    given no ``--dump-dir``: the directory where requests sent before any answer leave
    their files. ``note``: one sentence when the answer broke a bound (``read_answer``,
    ``parse_answer``) and was dropped, else None."""
    import aiohttp

    base = endpoint.rstrip("/")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            for path in SERVER_INFO_PATHS:
                async with session.get(base + path) as resp:
                    what = f"GET {base + path}"
                    body = await read_answer(resp, what)  # read: a connection released unread is reset
                    if resp.status != 200:
                        continue
                    info = parse_answer(body.decode("utf-8", errors="replace"), what)
                    value = info.get("dump_hidden_states_dir") if isinstance(info, dict) else None
                    return (value if isinstance(value, str) and value else None), None
    except BoundError as e:
        return None, f"note: {e}: its dump directory is not taken from it"
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None, None
    return None, None


async def probe(endpoint: str, timeout: float) -> Tuple[Optional[str], Optional[str]]:
    """One ``GET <endpoint>/health`` before any row is sent: ``(error, note)``, each one
    sentence or None.

    error: nothing answers (refused, no route, no answer within ``timeout``): "cannot
    reach URL: is the server up?"; something answers but not as SGLang does (SGLang's
    ``/health`` answers 200, or 503 while it starts or is unhealthy): "URL is not an SGLang
    server", quoting a short brief of the answer (``brief``). note: the 503 case, where
    the run goes on (the rows' own retries cover a server that is starting)."""
    import aiohttp

    url = endpoint.rstrip("/") + "/health"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.get(url) as resp:
                status = resp.status
                body = (await resp.content.read(4096)).decode("utf-8", errors="replace")
    except asyncio.TimeoutError:
        return f"cannot reach {endpoint}: is the server up? (no answer to GET {url} within {timeout:g} s)", None
    except (aiohttp.ClientError, OSError) as e:
        return f"cannot reach {endpoint}: is the server up? ({type(e).__name__}: {one_line(e)})", None
    if status == 200:
        return None, None
    if status == 503:
        return None, (f"note: GET {url} answered HTTP 503: the server is starting or unhealthy; "
                      f"sending rows anyway")
    return (f"{endpoint} is not an SGLang server: GET {url} answered HTTP {status} "
            f"({brief(body) or 'empty body'}); pass the base URL of SGLang's server, e.g. "
            f"http://127.0.0.1:30000"), None


async def _post(session, url: str, payload: Any, http_slots: asyncio.Semaphore,
                pending: PendingFiles, rid: str) -> str:
    """POST ``payload`` as JSON; returns the body of an HTTP 200 answer. ``pending``
    journals ``rid`` before it is sent. Raises ``RequestError`` (``RowError`` on HTTP 400,
    ``FatalError`` on 404/405)."""
    import aiohttp

    async with http_slots:
        pending.sent(rid)
        try:
            async with session.post(url, json=payload) as resp:
                body = await read_answer(resp, f"POST {url}")
                pending.answered(rid)
                text = body.decode("utf-8", errors="replace")
                if resp.status in (404, 405):
                    raise FatalError(f"POST {url} answered HTTP {resp.status}: --endpoint must be "
                                     f"the server's base URL (e.g. http://127.0.0.1:30000)")
                if resp.status == 400:
                    raise RowError(f"the server refused the row (HTTP 400): {brief(text)}")
                if resp.status != 200:
                    raise RequestError(f"HTTP {resp.status}: {brief(text)}")
        except asyncio.TimeoutError:  # its message is empty: say which limit it was
            total = getattr(getattr(session, "timeout", None), "total", None)
            raise RequestError(f"no answer within {total:g} s (--timeout)" if total
                               else "no answer in time (--timeout)") from None
        except aiohttp.ClientError as e:
            raise RequestError(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from None
    return text


def _answer_of(keys: Dict[str, Any], text: str, where: str) -> Optional[Answer]:
    """The path or manifest in ``keys`` (``meta_info`` or ``kv_transfer_params``), None
    when it names neither. Raises ``RequestError`` for the server's dump error or a path
    that is not a non-empty string (``where``: the keys' place, for the message)."""
    if keys.get(fmt.ERROR_KEY):
        raise RequestError(f"{fmt.ERROR_KEY}: {keys[fmt.ERROR_KEY]}")
    manifest = keys.get(MANIFEST_KEY)
    if manifest is not None:
        return Answer(None, manifest)
    path = keys.get(fmt.PATH_KEY)
    if path is not None and (not isinstance(path, str) or not path):
        raise RequestError(f"{where}.{fmt.PATH_KEY} is not a file path: {brief(text)}")
    return None if path is None else Answer(path, None)


async def generate(session, endpoint: str, rid: str, input_ids: List[int], early_answers: bool,
                   http_slots: asyncio.Semaphore, pending: PendingFiles,
                   sampling: Optional[Dict[str, Any]] = None) -> Answer:
    """``POST <endpoint>/generate`` for one prompt; returns the answer's
    ``meta_info.hidden_states_path`` (a non-empty string, not yet trusted) or, from a
    server that puts samples into a Mooncake Store, its ``hidden_states_manifest``.

    ``early_answers`` asks to be answered once the file's name is reserved
    (``format.WAIT_PARAM``), before the write. ``http_slots`` bounds the requests in
    flight (``--concurrency``); ``pending`` journals ``rid`` before it is sent. Raises
    ``RequestError``: ``RowError`` on HTTP 400, ``FatalError`` on HTTP 404/405 (not the
    server's base URL) or an answer with neither (the server is not dumping).

    ``sampling`` (``extract --generate``): these sampling parameters and
    ``format.OUTPUT_PARAM``, the answer's ``output_ids`` (a non-empty list of token ids,
    else ``RequestError``) in ``Answer.output_ids``."""
    # Asked explicitly: a server that samples live traffic (KIMI_SGLANG_SAMPLE_RATE, a byte
    # budget, a free-space floor) dumps every request that asks (sglang_ext.sampling).
    custom: dict = {fmt.DUMP_PARAM: True}
    if sampling is not None:
        custom[fmt.OUTPUT_PARAM] = True
        sampling = dict(sampling)
    else:
        sampling = {"max_new_tokens": 1, "temperature": 0}
    if early_answers:
        # Answer once the file's name is reserved (format.WAIT_PARAM); the wait for the
        # write is the caller's, so this HTTP slot is free for the next prompt.
        custom[fmt.WAIT_PARAM] = False
    sampling["custom_params"] = custom
    payload: Any = {"input_ids": input_ids, "sampling_params": sampling, "rid": rid}
    url = endpoint.rstrip("/") + "/generate"
    text = await _post(session, url, payload, http_slots, pending, rid)
    try:
        body = parse_answer(text, f"POST {url}")
        meta = body["meta_info"]
    except (ValueError, KeyError, TypeError):
        raise RequestError(f"response without meta_info: {brief(text)}") from None
    if not isinstance(meta, dict):
        raise RequestError(f"meta_info is not an object: {brief(text)}")
    answer = _answer_of(meta, text, "meta_info")
    if answer is None:
        raise FatalError(f"the server at {endpoint} is not dumping hidden states: its "
                         f"answer has no meta_info.hidden_states_path (start it with "
                         f"--dump-hidden-states-dir DIR); answer: {brief(text)}")
    if custom.get(fmt.OUTPUT_PARAM):
        output_ids = _token_ids(body.get("output_ids"))
        if output_ids is None:
            raise RequestError(f"the answer's output_ids is not a non-empty list of token ids: "
                               f"{brief(text)}")
        answer = answer._replace(output_ids=output_ids)
    return answer


def _token_ids(value: Any) -> Optional[List[int]]:
    """``value`` when it is a non-empty list of non-negative ints, else None."""
    if isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        return value
    return None


async def chat_completion(session, endpoint: str, body: Dict[str, Any],
                          http_slots: asyncio.Semaphore, pending: PendingFiles) -> Answer:
    """``POST <endpoint>/v1/chat/completions`` with ``body`` (``images.chat_body``: its
    ``rid`` is journaled first); returns the file or manifest it names and the prompt
    token ids the server ran.

    Where the answer names them: the top-level ``kv_transfer_params`` (the patched
    server, as on ``/v1/completions``: ``{"hidden_states_path": P}``, or the store's
    transfer manifest itself), else ``choices[0].meta_info`` (``return_meta_info``:
    ``hidden_states_path``, ``hidden_states_manifest`` or ``hidden_states_error``).
    ``prompt_ids``: ``choices[0].prompt_token_ids`` (``return_prompt_token_ids``), None
    when absent. Raises ``RequestError`` (``RowError`` on HTTP 400, e.g. an image the
    server cannot fetch; ``FatalError`` on HTTP 404/405 or an answer naming no dump)."""
    url = endpoint.rstrip("/") + "/v1/chat/completions"
    text = await _post(session, url, body, http_slots, pending, body["rid"])
    try:
        answer = parse_answer(text, f"POST {url}")
        choice = answer["choices"][0]
        if not isinstance(answer, dict) or not isinstance(choice, dict):
            raise TypeError
    except (ValueError, KeyError, IndexError, TypeError):
        raise RequestError(f"chat completion without choices[0]: {brief(text)}") from None
    prompt_ids = choice.get("prompt_token_ids")
    if prompt_ids is not None and _token_ids(prompt_ids) is None:
        raise RequestError(f"choices[0].prompt_token_ids is not a list of token ids: {brief(text)}")
    found = None
    kv = answer.get("kv_transfer_params")
    if isinstance(kv, dict) and kv:
        if kv.get(fmt.PATH_KEY) is not None or kv.get(fmt.ERROR_KEY):
            found = _answer_of(kv, text, "kv_transfer_params")
        elif "handle" in kv:  # the store's transfer manifest itself, as vLLM's connector
            found = Answer(None, {k: v for k, v in kv.items() if k != MANIFEST_KEY + "s"})
    if found is None and isinstance(choice.get("meta_info"), dict):
        found = _answer_of(choice["meta_info"], text, "choices[0].meta_info")
    if found is None:
        raise FatalError(f"the server at {endpoint} is not dumping chat requests: its answer "
                         f"has neither kv_transfer_params.hidden_states_path nor "
                         f"choices[0].meta_info.hidden_states_path (start it with "
                         f"--dump-hidden-states-dir DIR); answer: {brief(text)}")
    return found._replace(prompt_ids=prompt_ids)
