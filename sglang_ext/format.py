"""The dump file contract: names, keys, metadata, atomic write, completion lock, index, reader.

One finished request gives one file ``<dump dir>/<name>.safetensors`` holding

- ``hidden_states``: ``[num_prompt_tokens, num_layers, hidden_size]``, the model dtype
  (bf16 for most checkpoints). Slot ``j`` is layer id ``layer_ids[j]``: the residual
  stream *entering* decoder layer ``k`` (what HF transformers' ``output_hidden_states[k]``
  holds), and id ``N`` (= num_hidden_layers) the last layer's output *before* the final
  norm. Layer ids are sorted ascending, so with the default ``[2, N//2, N-3, N]`` the
  last slot is what speculators' EAGLE-3/DFlash trainers read as the verifier's last
  hidden state (they apply the verifier's final norm to it themselves).
- ``token_ids``: ``[num_prompt_tokens]`` int64, the prompt's token ids.

With ``--dump-hidden-states-dtype fp8`` (``sglang_ext.quant``), ``hidden_states`` is
``float8_e4m3fn`` and ``hidden_states_scales`` float32 ``[T, L, 1]`` follows it (one
scale per token and layer slot; value = ``fp8 * scale``), and the metadata adds
``hidden_states_dtype`` (``float8_e4m3fn``) and ``scale_layout``
(``per_token_per_layer``): hs-connectors' ``FP8HiddenStatesConnector`` keys, which its
``FP8Transfer`` (speculators' ``--hidden-states-backend fp8``) dequantizes. ``load``
returns them as stored, or dequantized on request.

These are the keys and layout vLLM's hidden-states connector writes and speculators'
offline reader loads (``hs_<i>.safetensors``). ``__metadata__`` (str -> str) holds
``format``, ``rid``, ``layer_ids`` (JSON list), ``num_layers`` (of the model),
``model_path``, ``sglang_version``, ``sglang_ext_version`` and ``series``.

Writing (all relative to an open directory descriptor, so nothing follows a symlink
planted at a name or swapped in for the directory after start-up):

1. ``reserve()`` picks a name from the rid (``safe_stem``) that neither a finished file
   nor a write in flight holds, by creating ``<name>.safetensors.lock`` with
   ``O_CREAT|O_EXCL|O_NOFOLLOW`` and holding an exclusive ``flock`` on it.
2. ``write_reserved()`` writes ``.<name>.safetensors.tmp`` and
   renames it to ``<name>.safetensors``: a reader never sees a partial file under the
   final name. Then one line goes to ``index.jsonl`` (``rid``, ``file``, ``num_tokens``,
   ``bytes``, ``layer_ids``).
3. The lock file is unlinked and released. On failure the temporary file is removed,
   ``<name>.safetensors.error`` receives the message, and the lock is released.

A client waits for a file by waiting on its lock (``wait_complete``): this is the
completion protocol of vLLM's hidden-states connector, which speculators' client uses.

The server answers a request once its file is complete, unless the request's
``sampling_params.custom_params`` holds ``{"hidden_states_wait": false}`` (``WAIT_PARAM``):
then it answers as soon as the name is reserved, with ``hidden_states_pending: true``
(``PENDING_KEY``), and the client waits on the lock itself, as ``sglang_ext.client`` does,
sending its next prompt meanwhile. A request whose ``custom_params`` holds
``{"hidden_states_dump": false}`` (``DUMP_PARAM``) is not dumped: no file, no path.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import hashlib
import json
import os
import re
import struct
import time
import unicodedata
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

FORMAT_VERSION = "kimi-sglang/1"
# Request and response keys (the only place they are spelled).
WAIT_PARAM = "hidden_states_wait"  # request: custom_params key; false = answer early
DUMP_PARAM = "hidden_states_dump"  # request: custom_params key; false = not dumped
PATH_KEY = "hidden_states_path"  # response meta_info: the file (absolute path)
ERROR_KEY = "hidden_states_error"  # response meta_info: why there is no file
PENDING_KEY = "hidden_states_pending"  # response meta_info: true = wait on <path>.lock
RESPONSE_KEYS = (PATH_KEY, ERROR_KEY, PENDING_KEY)  # all a dumped request's meta_info may add
KEY_HIDDEN_STATES = "hidden_states"
KEY_TOKEN_IDS = "token_ids"
KEY_SCALES = "hidden_states_scales"  # fp8 files: float32 [T, L, 1] (hs-connectors' name)
FP8 = "float8_e4m3fn"
# Metadata of fp8 files (bf16 files carry neither: their dtype is in the header).
DTYPE_META_KEY = "hidden_states_dtype"
SCALE_LAYOUT_KEY = "scale_layout"
SCALE_LAYOUT = "per_token_per_layer"  # = sglang_ext.quant.SCALE_LAYOUT
SUFFIX = ".safetensors"
LOCK_SUFFIX = ".lock"
ERROR_SUFFIX = ".error"
TMP_PREFIX = "."
TMP_SUFFIX = ".tmp"
INDEX_NAME = "index.jsonl"

# Longest stem taken from the rid; the whole name stays far below NAME_MAX (255 bytes)
# even with the hash, a collision counter and the longest suffix.
MAX_STEM_CHARS = 96
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
# What safetensors >= 0.8 names its own temporary file while writing (".tmpXXXXXX").
_SAFETENSORS_TMP = re.compile(r"\.tmp[A-Za-z0-9_]{6,}")


class DumpFormatError(ValueError):
    """A file does not follow the contract above (missing key, bad shape or dtype)."""


def safe_stem(rid: str) -> str:
    """File stem for a request id: readable, bounded, and never a path.

    Characters outside ``[A-Za-z0-9._-]`` become ``_`` (after NFKC folding), leading dots
    are dropped (no hidden files, no ``..``), the result is cut to ``MAX_STEM_CHARS``, and
    ``-<8 hex of sha256(rid)>`` is appended so that rids which sanitise alike (``a/b`` and
    ``a_b``) still get different names. Accepts any str, including empty, NUL and
    separators; the result matches ``[A-Za-z0-9._-]+`` and contains no ``/``.
    """
    if not isinstance(rid, str):
        raise TypeError(f"rid must be str, got {type(rid).__name__}")
    digest = hashlib.sha256(rid.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    text = unicodedata.normalize("NFKC", rid)
    text = _UNSAFE.sub("_", text).lstrip(".")[:MAX_STEM_CHARS]
    return f"{text}-{digest}" if text else f"req-{digest}"


@dataclass
class Reservation:
    """A name held for one request's file: the lock file exists and we hold its flock."""

    dir_fd: int
    name: str  # "<stem>[-n].safetensors", relative to the dump directory
    lock_fd: int

    @property
    def lock_name(self) -> str:
        return self.name + LOCK_SUFFIX

    @property
    def tmp_name(self) -> str:
        return TMP_PREFIX + self.name + TMP_SUFFIX


def open_dump_dir(path: str) -> int:
    """Open the dump directory for the ``*_at`` operations below; returns a descriptor.

    Raises ``FileNotFoundError`` / ``NotADirectoryError`` / ``PermissionError`` with the
    path in the message. The descriptor pins the directory: renaming it or replacing its
    path with a symlink later does not redirect writes.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        raise FileNotFoundError(f"dump directory {path!r} does not exist") from None
    except NotADirectoryError:
        raise NotADirectoryError(f"dump directory {path!r} is not a directory") from None
    if not os.access(f"/proc/self/fd/{fd}", os.W_OK | os.X_OK):
        os.close(fd)
        raise PermissionError(f"dump directory {path!r} is not writable")
    return fd


def reserve(dir_fd: int, rid: str) -> Reservation:
    """Hold a fresh file name for ``rid``; never one a finished or in-flight file has.

    Tries ``<stem>.safetensors``, then ``<stem>-1.safetensors``, ... The lock file is
    created exclusively (a symlink or any entry already at that name counts as taken).
    Raises ``OSError`` when the directory cannot take a new entry (e.g. ``ENOSPC``).
    """
    stem = safe_stem(rid)
    for n in range(0, 1 << 20):
        name = f"{stem}{SUFFIX}" if n == 0 else f"{stem}-{n}{SUFFIX}"
        try:
            lock_fd = os.open(
                name + LOCK_SUFFIX,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o644,
                dir_fd=dir_fd,
            )
        except FileExistsError:
            continue
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        if lexists_at(dir_fd, name) or lexists_at(dir_fd, name + ERROR_SUFFIX):
            os.unlink(name + LOCK_SUFFIX, dir_fd=dir_fd)
            os.close(lock_fd)
            continue
        return Reservation(dir_fd=dir_fd, name=name, lock_fd=lock_fd)
    raise OSError(errno.EEXIST, f"no free file name for rid {rid!r}")


def lexists_at(dir_fd: int, name: str) -> bool:
    """True when ``name`` exists in the directory (a symlink counts; never followed)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def printable_rid(rid: str) -> str:
    """``rid`` as valid UTF-8 text: equal to ``rid`` unless it holds lone surrogates
    (possible from JSON ``\\udcff`` escapes), which become ``\\udcff`` literally."""
    return rid.encode("utf-8", "backslashreplace").decode("utf-8")


# Longest rid a dump takes: it is stored in the file's metadata and travels to the writer
# process in one socket message (``wire.MAX_MESSAGE``); a longer one fails its own request.
MAX_RID_CHARS = 8192


def check_rid(rid) -> None:
    """Raise ``TypeError`` for a rid that is not a str and ``ValueError`` for one longer
    than ``MAX_RID_CHARS`` characters (that request fails; nothing else does)."""
    if not isinstance(rid, str):
        raise TypeError(f"rid must be str, got {type(rid).__name__}")
    if len(rid) > MAX_RID_CHARS:
        raise ValueError(f"rid is {len(rid)} characters long; a dumped request's rid may have "
                         f"at most {MAX_RID_CHARS} (it is stored in the file's metadata)")


def brief_rid(rid, limit: int = 120) -> str:
    """``repr(rid)`` cut to about ``limit`` characters, for log lines (a client picks the rid)."""
    text = repr(rid)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def build_metadata(
    *,
    rid: str,
    layer_ids: Sequence[int],
    num_layers: int,
    extra: Optional[Mapping[str, str]] = None,
) -> Dict[str, str]:
    """The ``__metadata__`` dict (all values str, as safetensors requires)."""
    meta = {
        "format": FORMAT_VERSION,
        "rid": printable_rid(rid),
        "layer_ids": json.dumps([int(k) for k in layer_ids]),
        "num_layers": str(int(num_layers)),
    }
    for key, value in (extra or {}).items():
        meta[key] = str(value)
    return meta


# safetensors' dtype codes (its ``Dtype`` enum, as the header names them) and sizes.
SAFETENSORS_DTYPES = {
    "bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4),
    "float64": ("F64", 8), "int64": ("I64", 8), "int32": ("I32", 4), "int16": ("I16", 2),
    "int8": ("I8", 1), "uint8": ("U8", 1), "bool": ("BOOL", 1),
    "float8_e4m3fn": ("F8_E4M3", 1), "float8_e5m2": ("F8_E5M2", 1),
}
# Tensor data starts on a page boundary: rows are written with ``pwrite`` at page-aligned
# offsets, and a reader that maps the file gets page-aligned tensors. The header's JSON
# is padded with spaces to get there, as the safetensors format allows.
DATA_ALIGN = 4096


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a file: ``dtype`` is a torch dtype name (``"bfloat16"``), ``shape``
    its shape. Raises ``DumpFormatError`` for a dtype safetensors cannot hold."""

    name: str
    dtype: str
    shape: Tuple[int, ...]

    def __post_init__(self):
        if self.dtype not in SAFETENSORS_DTYPES:
            raise DumpFormatError(f"tensor {self.name!r}: dtype {self.dtype} has no safetensors code")

    @property
    def nbytes(self) -> int:
        n = SAFETENSORS_DTYPES[self.dtype][1]
        for d in self.shape:
            n *= int(d)
        return n


@dataclass(frozen=True)
class FileLayout:
    """Where everything of one safetensors file goes: ``header`` (the 8-byte length, the
    JSON, padding) at offset 0, tensor ``name``'s data at ``offsets[name]`` (absolute, in
    bytes), ``size`` bytes in all."""

    header: bytes
    offsets: Dict[str, int]
    size: int


def file_layout(tensors: Sequence[TensorSpec], metadata: Mapping[str, str]) -> FileLayout:
    """The layout of a safetensors file holding ``tensors`` in the given order.

    The format (huggingface/safetensors' README): a little-endian u64 N, N bytes of JSON
    (``{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [begin, end]}}``,
    offsets relative to the end of the header), then the tensors' bytes, contiguous.
    """
    header: Dict[str, Any] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    pos = 0
    for t in tensors:
        header[t.name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype][0],
            "shape": [int(d) for d in t.shape],
            "data_offsets": [pos, pos + t.nbytes],
        }
        pos += t.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    data_start = -(-(8 + len(text)) // DATA_ALIGN) * DATA_ALIGN
    text += b" " * (data_start - 8 - len(text))
    offsets, pos = {}, data_start
    for t in tensors:
        offsets[t.name] = pos
        pos += t.nbytes
    return FileLayout(header=struct.pack("<Q", len(text)) + text, offsets=offsets, size=pos)


def dump_tensors(num_tokens: int, num_slots: int, hidden_size: int, dtype: str) -> Tuple[TensorSpec, ...]:
    """The tensors of one dump file: ``hidden_states`` ``[T, L, H]`` of ``dtype``, for
    ``dtype == "float8_e4m3fn"`` then ``hidden_states_scales`` ``[T, L, 1]`` float32, and
    ``token_ids`` ``[T]`` int64, in that order."""
    hs = TensorSpec(KEY_HIDDEN_STATES, dtype, (num_tokens, num_slots, hidden_size))
    ids = TensorSpec(KEY_TOKEN_IDS, "int64", (num_tokens,))
    if dtype == FP8:
        return (hs, TensorSpec(KEY_SCALES, "float32", (num_tokens, num_slots, 1)), ids)
    return (hs, ids)


def dtype_metadata(dtype: str) -> Dict[str, str]:
    """What a file of ``hidden_states`` dtype ``dtype`` adds to ``__metadata__``:
    ``hidden_states_dtype`` and ``scale_layout`` for fp8, nothing otherwise."""
    if dtype == FP8:
        return {DTYPE_META_KEY: FP8, SCALE_LAYOUT_KEY: SCALE_LAYOUT}
    return {}


def create_tmp(dir_fd: int, tmp_name: str) -> int:
    """Create ``tmp_name`` in the dump directory for writing; returns its descriptor.

    Exclusive and not following symlinks: an entry already at that name (a planted
    symlink, a leftover) is unlinked (the link itself, never its target) and the create
    retried once. Raises ``OSError`` (e.g. ``ENOSPC``).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(tmp_name, flags, 0o644, dir_fd=dir_fd)
    except FileExistsError:
        _unlink_quiet(dir_fd, tmp_name)
        return os.open(tmp_name, flags, 0o644, dir_fd=dir_fd)


def pwrite_all(fd: int, data, offset: int) -> None:
    """Write all of ``data`` (any buffer) at ``offset``; raises ``OSError``."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        view, offset = view[n:], offset + n


def publish(dir_fd: int, tmp_name: str, name: str) -> None:
    """Rename a fully written temporary file to its final name (atomic)."""
    os.rename(tmp_name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def write_reserved(
    res: Reservation,
    hidden_states: Any,
    token_ids: Any,
    metadata: Mapping[str, str],
    scales: Any = None,
) -> int:
    """Write the whole file for a reservation at once; returns its size in bytes.

    ``hidden_states``: torch ``[T, L, H]`` (CPU); ``token_ids``: torch int64 ``[T]``;
    ``scales``: float32 ``[T, L, 1]`` when ``hidden_states`` is float8_e4m3fn (its
    ``dtype_metadata`` is added to ``metadata``), else ``None``.
    The same layout and steps as the writer process (``file_layout``, ``create_tmp``,
    ``pwrite_all``, ``publish``), for callers that hold the whole tensors. Raises
    ``DumpFormatError`` on inconsistent shapes and ``OSError`` on I/O failure; in both
    cases nothing is left under the final name and the temporary file is removed. Does
    not release the reservation (see ``complete`` / ``fail``).
    """
    import torch

    check_tensors(hidden_states, token_ids, scales)
    dtype = str(hidden_states.dtype).replace("torch.", "")
    specs = dump_tensors(*hidden_states.shape, dtype)
    layout = file_layout(specs, {**metadata, **dtype_metadata(dtype)})
    tensors = (hidden_states, token_ids) if scales is None else (hidden_states, scales, token_ids)
    fd = None
    try:
        fd = create_tmp(res.dir_fd, res.tmp_name)
        pwrite_all(fd, layout.header, 0)
        for spec, tensor in zip(specs, tensors):
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            pwrite_all(fd, raw, layout.offsets[spec.name])
        os.close(fd)
        fd = None
        publish(res.dir_fd, res.tmp_name, res.name)
    except BaseException:
        if fd is not None:
            os.close(fd)
        _unlink_quiet(res.dir_fd, res.tmp_name)
        raise
    return layout.size


def check_tensors(hidden_states: Any, token_ids: Any, scales: Any = None) -> None:
    """Raise ``DumpFormatError`` unless shapes and dtypes follow the contract (fp8
    ``hidden_states`` come with float32 ``scales`` ``[T, L, 1]``, other dtypes without)."""
    if hidden_states.dim() != 3:
        raise DumpFormatError(
            f"hidden_states must be [num_tokens, num_layers, hidden_size], "
            f"got shape {tuple(hidden_states.shape)}"
        )
    if token_ids.dim() != 1 or str(token_ids.dtype) != "torch.int64":
        raise DumpFormatError(
            f"token_ids must be int64 [num_tokens], got {token_ids.dtype} "
            f"{tuple(token_ids.shape)}"
        )
    if hidden_states.shape[0] != token_ids.shape[0]:
        raise DumpFormatError(
            f"hidden_states has {hidden_states.shape[0]} rows for "
            f"{token_ids.shape[0]} token ids"
        )
    is_fp8 = str(hidden_states.dtype) == "torch." + FP8
    if is_fp8 != (scales is not None):
        raise DumpFormatError(
            f"hidden_states of {hidden_states.dtype} "
            + ("need float32 scales [T, L, 1] (hidden_states_scales)" if is_fp8
               else "take no hidden_states_scales")
        )
    want = (hidden_states.shape[0], hidden_states.shape[1], 1)
    if scales is not None and (str(scales.dtype) != "torch.float32" or tuple(scales.shape) != want):
        raise DumpFormatError(
            f"hidden_states_scales must be float32 {list(want)}, got {scales.dtype} "
            f"{list(scales.shape)}"
        )


def append_index(dir_fd: int, record: Mapping[str, Any]) -> None:
    """Append one JSON line to ``index.jsonl`` (one ``write`` with ``O_APPEND``)."""
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode("ascii")
    fd = os.open(
        INDEX_NAME,
        os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o644,
        dir_fd=dir_fd,
    )
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def complete(res: Reservation) -> None:
    """Release a reservation whose file is in place: unlink the lock, then drop the flock.
    Never raises: a lock file that cannot be unlinked (a directory made read-only) is
    released all the same (waiters test the flock) and ``clean_stale`` removes it later."""
    _unlink_never_raises(res.dir_fd, res.lock_name)
    _close_never_raises(res.lock_fd)


def cancel(res: Reservation) -> None:
    """Give back a reservation that nothing was written for and whose name no response
    carries: drop the lock, leave no file. Never raises."""
    _unlink_never_raises(res.dir_fd, res.lock_name)
    _close_never_raises(res.lock_fd)


def fail(res: Reservation, message: str) -> None:
    """Release a reservation whose write failed: leave ``<name>.error``, drop the lock.

    Never raises: if even the error file cannot be written (disk full), a waiter that
    finds neither the file nor the error reports the file as missing.
    """
    try:
        fd = os.open(
            res.name + ERROR_SUFFIX,
            os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o644,
            dir_fd=res.dir_fd,
        )
        try:
            os.write(fd, message.encode("utf-8", "replace")[:4096])
        finally:
            os.close(fd)
    except OSError:
        pass
    _unlink_never_raises(res.dir_fd, res.tmp_name)
    _unlink_never_raises(res.dir_fd, res.lock_name)
    _close_never_raises(res.lock_fd)


def _unlink_quiet(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _unlink_never_raises(dir_fd: int, name: str) -> None:
    """Unlink ``name`` if possible (a read-only directory, a directory planted at the
    name: it stays, and the lock is released all the same)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def _close_never_raises(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def clean_stale(dir_fd: int) -> Dict[str, int]:
    """Remove what an interrupted run left: temporary files and locks nobody holds.

    Temporary files are ours (``.<name>.safetensors.tmp``) and safetensors' own
    (``.tmpXXXXXX``); only the writing ranks of one server may use a dump directory (one
    per DP rank: they all start before the server takes requests).

    Called once at start-up by each writing rank. A lock is stale when an exclusive
    non-blocking ``flock`` on it succeeds. Returns counts ``{"tmp": n, "lock": m}``.
    """
    removed = {"tmp": 0, "lock": 0}
    for name in os.listdir(dir_fd):
        if (name.startswith(TMP_PREFIX) and name.endswith(SUFFIX + TMP_SUFFIX)) or (
            _SAFETENSORS_TMP.fullmatch(name)
        ):
            _unlink_never_raises(dir_fd, name)  # a directory planted there stays: never fatal
            removed["tmp"] += 1
        elif name.endswith(SUFFIX + LOCK_SUFFIX):
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            _unlink_quiet(dir_fd, name)
            os.close(fd)
            removed["lock"] += 1
    return removed


# Lock polling: first check after 0.2 ms, then 1.5x longer each time, at most 5 ms
# apart, so a finished write is seen within ~5 ms: the cap is added to a waiting
# response's latency, which at concurrency 1 is throughput (docs/verification.md).
POLL_FIRST_S = 0.0002
POLL_MAX_S = 0.005


def _wait_outcome(path: str) -> Optional[str]:
    """After the lock is gone: ``None`` if the file is there, else the error message."""
    if os.path.lexists(path):
        return None
    try:
        with open(path + ERROR_SUFFIX, encoding="utf-8", errors="replace") as f:
            return f.read() or "hidden-state write failed"
    except FileNotFoundError:
        return f"hidden-state file {path} is missing"


def _try_lock_released(path: str) -> bool:
    """True when nobody holds ``<path>.lock`` (it is gone, or a shared flock succeeds)."""
    try:
        fd = os.open(path + LOCK_SUFFIX, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def wait_complete(path: str, timeout: float = 600.0) -> Optional[str]:
    """Block until the writer has released ``path``; ``None`` on success, else the error.

    Raises ``TimeoutError`` after ``timeout`` seconds. Blocking ``flock`` would be
    simplest, but polling with a short back-off lets the same code serve asyncio.
    """
    deadline = time.monotonic() + timeout
    delay = POLL_FIRST_S
    while not _try_lock_released(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"hidden-state file {path} not complete after {timeout}s")
        time.sleep(delay)
        delay = min(delay * 1.5, POLL_MAX_S)
    return _wait_outcome(path)


async def wait_complete_async(path: str, timeout: float = 600.0) -> Optional[str]:
    """``wait_complete`` for an event loop (never blocks the loop)."""
    deadline = time.monotonic() + timeout
    delay = POLL_FIRST_S
    while not _try_lock_released(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"hidden-state file {path} not complete after {timeout}s")
        await asyncio.sleep(delay)
        delay = min(delay * 1.5, POLL_MAX_S)
    return _wait_outcome(path)


@dataclass
class DumpRecord:
    """One file, loaded: torch tensors plus the metadata dict."""

    hidden_states: Any  # torch.Tensor [T, L, H]
    token_ids: Any  # torch.Tensor int64 [T]
    metadata: Dict[str, str]
    scales: Any = None  # fp8 files loaded as stored: torch.Tensor float32 [T, L, 1]

    @property
    def layer_ids(self) -> list:
        return json.loads(self.metadata["layer_ids"])


def load(path: str, dequantize: Any = False) -> DumpRecord:
    """Read one dump file; raises ``DumpFormatError`` if it breaks the contract: missing
    keys, shapes or dtypes (``check_tensors``), or ``layer_ids`` metadata that is not a
    sorted list of distinct ids, one per layer slot. Files without our metadata (e.g.
    vLLM's) load with ``metadata == {}``.

    fp8 files (``hidden_states_scales`` present): ``dequantize=False`` returns
    ``hidden_states`` float8_e4m3fn and ``scales`` float32 ``[T, L, 1]`` as stored;
    ``True`` returns float32 ``hidden_states = fp8 * scale`` (``quant.dequantize``) and
    ``scales=None``; a torch dtype (``torch.bfloat16``) dequantizes to that dtype, as
    hs-connectors' ``FP8Transfer`` does. Other files ignore ``dequantize``.
    """
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        keys = set(f.keys())
        missing = {KEY_HIDDEN_STATES, KEY_TOKEN_IDS} - keys
        if missing:
            raise DumpFormatError(f"{path}: missing keys {sorted(missing)}")
        meta = f.metadata() or {}
        hs = f.get_tensor(KEY_HIDDEN_STATES)
        ids = f.get_tensor(KEY_TOKEN_IDS)
        scales = f.get_tensor(KEY_SCALES) if KEY_SCALES in keys else None
    check_tensors(hs, ids, scales)
    if "layer_ids" in meta:
        try:
            layer_ids = json.loads(meta["layer_ids"])
        except ValueError:
            layer_ids = None
        if (
            not isinstance(layer_ids, list)
            or not all(isinstance(k, int) for k in layer_ids)
            or layer_ids != sorted(set(layer_ids))
            or len(layer_ids) != hs.shape[1]
        ):
            raise DumpFormatError(
                f"{path}: metadata layer_ids {meta['layer_ids']!r} is not a sorted list of "
                f"{hs.shape[1]} distinct layer ids (one per slot)"
            )
    if scales is not None and dequantize is not False:
        import torch

        from sglang_ext.quant import dequantize as dequantize_fp8

        hs = dequantize_fp8(hs, scales, torch.float32 if dequantize is True else dequantize)
        scales = None
    return DumpRecord(hidden_states=hs, token_ids=ids, metadata=dict(meta), scales=scales)


def read_header(dir_fd: int, name: str) -> Dict[str, Any]:
    """The JSON header of safetensors file ``name`` in the dump directory (tensor entries
    and ``__metadata__``), without reading the tensors. Raises ``DumpFormatError`` for a
    file too short or whose header is not JSON, ``OSError`` when it cannot be read."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise DumpFormatError(f"{name}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        text = os.pread(fd, n, 8)
    finally:
        os.close(fd)
    try:
        return json.loads(text)
    except ValueError:
        raise DumpFormatError(f"{name}: the safetensors header is not JSON") from None


def index_record(dir_fd: int, name: str, size: int) -> Dict[str, Any]:
    """The ``index.jsonl`` record of file ``name`` (``size`` bytes), from its header."""
    header = read_header(dir_fd, name)
    meta = header.get("__metadata__", {})
    return {"rid": meta.get("rid"), "file": name,
            "num_tokens": header[KEY_HIDDEN_STATES]["shape"][0], "bytes": size,
            "layer_ids": meta.get("layer_ids")}


def read_index(directory: str) -> list:
    """All records of ``<directory>/index.jsonl``, in write order."""
    path = os.path.join(directory, INDEX_NAME)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
