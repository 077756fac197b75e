"""Rows whose ``messages`` hold images: checked and shaped for ``/v1/chat/completions``.

A row of DATA goes through SGLang's chat completions (not ``/generate``) when one of its
messages has a content list with an image part: token ids cannot carry pixels, the server's
multimodal processor turns each image into its placeholder run. Parts taken (OpenAI's shapes
and speculators 0.9's, its ``data_generation.media.get_image_ref`` /
``preprocessing._adapt_part_for_vllm``):

- ``{"type": "text", "text": S}`` and a bare string ``S`` (a text part);
- ``{"type": "image_url", "image_url": {"url": U}}`` or ``"image_url": U`` (OpenAI; also
  ``"type": "input_image"``, the Responses API's name);
- ``{"type": "image", "url": U}``, ``{"type": "image", "image": U}`` (speculators, Qwen's
  ``qwen_vl_utils``) and ``{"type": "image", "path": P}`` (speculators' prepared rows before
  ``_adapt_conv_for_vllm``; ``P`` is made absolute against this process's working directory
  and sent as ``file://P``, as speculators does).

``U`` is ``http(s)://HOST/...``, ``file:///ABSOLUTE/PATH`` or ``data:image/<type>;base64,<data>``;
a bare absolute path is taken as ``file://``. The server fetches or reads every image itself:
a ``file://`` path must name a file on the SERVER's filesystem, readable by it (SGLang reads
local paths as given). Every part is sent as OpenAI's ``image_url`` shape.

What is forwarded (``ImageAccess``; SGLang 0.5.23's loader opens whatever ``file://`` path
it is given, ``/dev/zero`` until its memory runs out, and fetches any http(s) host): http(s)
URLs except to a literal link-local or unspecified address (a cloud metadata service);
``data:`` URLs; ``file://`` paths only inside a directory the user names (``extract
--image-root DIR``; none by default), never under ``/proc``, ``/dev`` or ``/sys``, never
through ``..``. A refused URL fails its row with one sentence.

A malformed part (another ``type``, no URL, a scheme other than those, a relative
``file://`` path, a data URL that is not base64 image data) is ``ImagePartError``: one
sentence naming the message and part; ``extract`` fails that row alone with it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import socket
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import unquote, urlsplit

from sglang_ext import format as fmt

IMAGE_TYPES = ("image_url", "image", "input_image")
_DATA_URL = re.compile(r"data:(image/[A-Za-z0-9.+-]+)((?:;[A-Za-z0-9=._-]+)*);base64,(.*)", re.S)


class ImagePartError(ValueError):
    """A message's image part cannot be sent (one sentence: which message, which part, why)."""


NEVER_READ = ("/proc", "/dev", "/sys")  # no image there; /dev/zero never ends


@dataclass(frozen=True)
class ImageAccess:
    """The image URLs extract forwards to the server (see the module doc): ``roots`` the
    absolute directories (``--image-root``, normalized) whose files a ``file://`` URL may
    name; none: no ``file://`` URL at all."""

    roots: Tuple[str, ...] = ()

    def file_error(self, url: str, path: str) -> Optional[str]:
        """Why the ``file://`` URL ``url`` (its decoded ``path``) is not forwarded, or None."""
        if ".." in path.split("/"):
            return f"has the URL {url[:80]!r}, whose path climbs out through '..'"
        path = os.path.normpath("/" + path.lstrip("/"))  # "//proc" is /proc
        for top in NEVER_READ:
            if path == top or path.startswith(top + "/"):
                return (f"has the URL {url[:80]!r}, under {top}: the server would read its own "
                        f"{top} (SGLang's loader reads any file:// path, /dev/zero without end)")
        if not any(path == r or path.startswith(r.rstrip("/") + "/") for r in self.roots):
            where = ", ".join(self.roots) if self.roots else "none given"
            return (f"has the URL {url[:80]!r}, outside every --image-root ({where}): the server "
                    f"reads file:// paths from its own filesystem, so extract forwards only "
                    f"those under a directory you name with --image-root DIR")
        return None


def literal_address(host: str):
    """``host`` as the address a resolver takes it for, or None for a name: dotted, and
    inet_aton's other spellings (``2852039166``, ``0xa9fea9fe``, ``0251.0376.0251.0376``,
    ``169.254.43518``, ``0``), IPv6 (an IPv4-mapped one as its IPv4 address)."""
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        try:
            addr = ipaddress.ip_address(socket.inet_ntoa(socket.inet_aton(host)))
        except (OSError, ValueError):
            return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def host_error(url: str, host: str) -> Optional[str]:
    """Why an http(s) URL to ``host`` is not forwarded (a literal link-local or unspecified
    address: 169.254.169.254 is a cloud's metadata service, as the server sees it), or None.
    Names are left to the server's resolver."""
    addr = literal_address(host)
    if addr is None:
        return None
    if addr.is_link_local or addr.is_unspecified:
        return (f"has the URL {url[:80]!r}, whose host {host} is a link-local or unspecified "
                f"address (a cloud metadata service answers there to the server): not sent")
    return None


@dataclass(frozen=True)
class ChatPrompt:
    """One row's chat request: ``messages`` in OpenAI's shape (image parts as ``image_url``),
    ``continue_final`` (the last message is the assistant's: its text stays the prompt's end,
    SGLang's ``continue_final_message``), ``images`` (how many image parts) and ``digest``
    (sha256 hex of the request: a rerun keeps ``hs_<i>`` only for the same request)."""

    messages: List[Dict[str, Any]]
    continue_final: bool
    images: int
    digest: str


def has_image_parts(messages: Any) -> bool:
    """True when a message's content is a list holding a part whose ``type`` is an image one
    (anything else, even malformed, is left to the text path and its own errors)."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
                isinstance(p, dict) and p.get("type") in IMAGE_TYPES for p in content):
            return True
    return False


def _url_of(part: Dict[str, Any]) -> Any:
    """The image reference of a part in any accepted shape (not yet checked)."""
    if part.get("type") == "image":
        if part.get("path") is not None:
            path = part["path"]
            if not isinstance(path, str) or not path:
                return path
            return "file://" + os.path.abspath(path)
        for key in ("url", "image"):
            if part.get(key) is not None:
                return part[key]
        if part.get("base64") is not None:
            raise ImagePartError("has base64 data without a type: pass it as an image_url part "
                                 "with a data:image/<type>;base64,... URL")
        return None
    ref = part.get("image_url")
    return ref.get("url") if isinstance(ref, dict) else ref


def check_url(url: Any, access: ImageAccess = ImageAccess()) -> str:
    """``url`` as sent, or ``ImagePartError`` (why, without the part's place): malformed,
    or not forwarded under ``access``."""
    if not isinstance(url, str) or not url.strip():
        raise ImagePartError("has no image URL (image_url.url, url, image or path)")
    if url.startswith("/"):
        url = "file://" + url
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        host = urlsplit(url).hostname
        if not host:
            raise ImagePartError(f"has the URL {url[:80]!r}, which names no host")
        why = host_error(url, host)
        if why:
            raise ImagePartError(why)
    elif scheme == "file":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ImagePartError(f"has the URL {url[:80]!r}: a file URL is file:///ABSOLUTE/PATH "
                                 f"on the server's filesystem")
        if not unquote(parts.path).strip("/"):
            raise ImagePartError(f"has the URL {url[:80]!r}, which names no file")
        why = access.file_error(url, unquote(parts.path))
        if why:
            raise ImagePartError(why)
    elif scheme == "data":
        m = _DATA_URL.fullmatch(url)
        if not m:
            raise ImagePartError(f"has a data URL that is not data:image/<type>;base64,<data> "
                                 f"({url[:40]!r}...)")
        try:
            raw = base64.b64decode(m.group(3), validate=True)
        except (binascii.Error, ValueError):
            raise ImagePartError(f"has a data URL ({m.group(1)}) whose payload is not valid "
                                 f"base64") from None
        if not raw:
            raise ImagePartError(f"has a data URL ({m.group(1)}) with no data")
    else:
        raise ImagePartError(f"has the URL {url[:80]!r}: an image URL starts with http://, "
                             f"https://, file:// or data:image/")
    return url


def _part(part: Any, where: str, access: ImageAccess) -> Tuple[Any, bool]:
    """One content part in OpenAI's shape and whether it is an image."""
    if isinstance(part, str):
        return {"type": "text", "text": part}, False
    if not isinstance(part, dict):
        raise ImagePartError(f"{where} is a {type(part).__name__}, not an object or a string")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ImagePartError(f"{where} is a text part without a text string")
        return {"type": "text", "text": part["text"]}, False
    if kind in IMAGE_TYPES:
        try:
            url = check_url(_url_of(part), access)
        except ImagePartError as e:
            raise ImagePartError(f"{where} (type {kind}) {e}") from None
        image_url: Dict[str, Any] = {"url": url}
        ref = part.get("image_url")
        if isinstance(ref, dict) and isinstance(ref.get("detail"), str):
            image_url["detail"] = ref["detail"]
        return {"type": "image_url", "image_url": image_url}, True
    raise ImagePartError(f"{where} has type {str(kind)[:40]!r}: extract sends text and image "
                         f"parts ({', '.join(IMAGE_TYPES)}) only")


def chat_prompt(messages: Any, access: ImageAccess = ImageAccess()) -> ChatPrompt:
    """Check a row's ``messages`` (at least one image part, each URL forwarded under
    ``access``) and shape them for the chat request. Raises ``ImagePartError`` (one
    sentence naming message ``m`` and part ``p``, both from 0)."""
    if not isinstance(messages, list) or not messages:
        raise ImagePartError("messages must be a non-empty list of {role, content} objects")
    out: List[Dict[str, Any]] = []
    images = 0
    for m, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ImagePartError(f"message {m} is not an object with a role string")
        content = message.get("content")
        shaped = {k: v for k, v in message.items() if k != "content"}
        if isinstance(content, list):
            parts = []
            for p, part in enumerate(content):
                shaped_part, is_image = _part(part, f"message {m} part {p}", access)
                parts.append(shaped_part)
                images += is_image
            shaped["content"] = parts
        elif isinstance(content, str) or content is None:
            shaped["content"] = content
        else:
            raise ImagePartError(f"message {m} has content of type {type(content).__name__}: "
                                 f"a string or a list of parts")
        out.append(shaped)
    if not images:
        raise ImagePartError("has no image part")
    last = out[-1]
    continue_final = last["role"] == "assistant"
    if continue_final and isinstance(last.get("content"), list) and all(
            p["type"] == "text" for p in last["content"]):
        # SGLang continues only a string final message (else it adds a generation prompt)
        last["content"] = "".join(p["text"] for p in last["content"])
    digest = hashlib.sha256(json.dumps([out, continue_final], sort_keys=True,
                                       separators=(",", ":")).encode("utf-8")).hexdigest()
    return ChatPrompt(out, continue_final, images, digest)


def chat_body(prompt: ChatPrompt, rid: str, early_answers: bool) -> Dict[str, Any]:
    """The ``POST /v1/chat/completions`` body for one try: one new token, greedy,
    non-streaming; ``return_prompt_token_ids`` (SGLang's ids after the chat template and
    the image placeholders' expansion, ``choices[0].prompt_token_ids``) and
    ``return_meta_info`` (``choices[0].meta_info``: the dump's keys, for a server whose
    chat answers carry no ``kv_transfer_params``)."""
    body: Dict[str, Any] = {
        "messages": prompt.messages, "max_tokens": 1, "temperature": 0, "stream": False,
        "rid": rid, "return_prompt_token_ids": True, "return_meta_info": True,
    }
    if prompt.continue_final:
        body["continue_final_message"] = True
    # asked explicitly, as /generate's: a server that samples live traffic dumps it
    body["custom_params"] = {fmt.DUMP_PARAM: True, **({fmt.WAIT_PARAM: False} if early_answers else {})}
    return body

