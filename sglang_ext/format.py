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
   ``O_CREAT|O_EXCL|O_NOFOLLOW`` and holding an exclusive ``flock`` on it. Its cost does
   not grow with the number of earlier files of the rid (O(1) calls while one process
   names them, O(log n) after others took n names).
2. The writer process (``sglang_ext.writer_process``) writes the file under a temporary
   name (``tmp_name``: ``.kimi-<writer tag>-<key>-<random>.safetensors.tmp``) laid out
   by ``file_layout`` (``create_tmp``, ``pwrite_all``) and renames it to
   ``<name>.safetensors`` (``publish``): a reader never sees a partial file under the
   final name. Then one line goes to ``index.jsonl`` (``index_record``: ``rid``,
   ``file``, ``num_tokens``, ``bytes``, ``layer_ids``; ``append_index``), whole or not
   at all: under a ``flock`` on the index, a partial line an appender killed mid-write
   left is cut away first, and a write cut short (disk full) is truncated away and
   raised as ``OSError``. The lock file gets the line's offset first (its mark), so a
   file whose writer died is settled by reading one line (``indexed``), never the whole
   index. Past ``INDEX_PART_BYTES`` (64 MiB) the index is rotated to ``index-<k>.jsonl``
   (k = 1, 2, ...); ``read_index`` reads the parts in order, then ``index.jsonl``.
3. The lock file is unlinked and released (``complete``). On failure the temporary file
   is removed, ``<name>.safetensors.error`` receives the message, and the lock is
   released (``fail``). What a killed writer leaves (temporary files, unheld locks)
   ``clean_stale`` removes at the next start.

Every file created here (data, temporary, lock, error, index) gets mode ``file_mode()``:
0600 unless ``KIMI_SGLANG_FILE_MODE`` says otherwise (e.g. ``0640``), the umask applying
on top; a dump is not readable by other users by default. Every open of an entry in the
directory uses ``O_NOFOLLOW|O_NONBLOCK`` and accepts only a regular file
(``open_regular``): a FIFO, directory or socket planted at a name is refused with an
``OSError`` that says what was found, never waited on. Headers are read with
safetensors' 100 MB bound and parsed defensively (``read_header``): a crafted file is
``DumpFormatError``, never ``MemoryError`` or ``RecursionError``.

A client waits for a file by waiting on its lock (``wait_complete``): this is the
completion protocol of vLLM's hidden-states connector, which speculators' client uses.

The server answers a request once its file is complete, unless the request's
``sampling_params.custom_params`` holds ``{"hidden_states_wait": false}`` (``WAIT_PARAM``):
then it answers as soon as the name is reserved, with ``hidden_states_pending: true``
(``PENDING_KEY``), and the client waits on the lock itself, as ``sglang_ext.client.extract`` does,
sending its next prompt meanwhile. A request whose ``custom_params`` holds
``{"hidden_states_dump": false}`` (``DUMP_PARAM``) is not dumped: no file, no path.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import secrets
import stat
import struct
import threading
import time
import unicodedata
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

FORMAT_VERSION = "kimi-sglang/1"
# Request and response keys (the only place they are spelled).
WAIT_PARAM = "hidden_states_wait"  # request: custom_params key; false = answer early
DUMP_PARAM = "hidden_states_dump"  # request: custom_params key; false = not dumped
PATH_KEY = "hidden_states_path"  # response meta_info: the file (absolute path)
ERROR_KEY = "hidden_states_error"  # response meta_info: why there is no file
PENDING_KEY = "hidden_states_pending"  # response meta_info: true = wait on <path>.lock
# response meta_info (store sink): the version-1 transfer manifest of the request's object
MANIFEST_KEY = "hidden_states_manifest"
RESPONSE_KEYS = (PATH_KEY, ERROR_KEY, PENDING_KEY, MANIFEST_KEY)  # all a dumped request's meta_info may add
KEY_HIDDEN_STATES = "hidden_states"
KEY_TOKEN_IDS = "token_ids"
KEY_SCALES = "hidden_states_scales"  # fp8 files: float32 [T, L, 1] (hs-connectors' name)
FP8 = "float8_e4m3fn"
# Metadata of fp8 files (bf16 files carry neither: their dtype is in the header).
DTYPE_META_KEY = "hidden_states_dtype"
SCALE_LAYOUT_KEY = "scale_layout"
SCALE_LAYOUT = "per_token_per_layer"  # one float32 scale per token and layer slot (quant)
SUFFIX = ".safetensors"
LOCK_SUFFIX = ".lock"
ERROR_SUFFIX = ".error"
TMP_PREFIX = ".kimi-"  # temporary files: tmp_name; hidden, and ours by their prefix
TMP_SUFFIX = ".tmp"
INDEX_NAME = "index.jsonl"
# What a file still unwritten when the server shut down fails with (its ``.error``),
# whichever side settles it: the writer process at its drain deadline, the scheduler
# after the writer process exited.
SHUTDOWN_MESSAGE = "server shut down before the hidden-state file was written"

# Longest stem taken from the rid; the whole name stays far below NAME_MAX (255 bytes)
# even with the hash, a collision counter and the longest suffix.
MAX_STEM_CHARS = 96
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
# What safetensors >= 0.8 names its own temporary file while writing (".tmpXXXXXX").
_SAFETENSORS_TMP = re.compile(r"\.tmp[A-Za-z0-9_]{6,}")
# Temporary names of earlier releases, which wrote whole files beside the final name:
# ``.<name>.safetensors.tmp`` (``name`` from ``safe_stem``, so never starting with a dot).
_OLD_TMP = re.compile(r"\.[A-Za-z0-9_-][A-Za-z0-9._-]*" + re.escape(SUFFIX + TMP_SUFFIX))


class DumpFormatError(ValueError):
    """A file does not follow the contract above (missing key, bad shape or dtype)."""


# The permission bits of every file created here (data, temporary, lock, error, index):
# owner read and write only, unless the environment asks for more (e.g. 0640 to let a
# group of trainers read the dumps). It is the ``mode`` argument of ``os.open``, so the
# process's umask still applies.
FILE_MODE_ENV = "KIMI_SGLANG_FILE_MODE"
DEFAULT_FILE_MODE = 0o600
_FILE_MODE = re.compile(r"[0-7]{3,4}")


def file_mode() -> int:
    """The mode files are created with: ``KIMI_SGLANG_FILE_MODE`` (an octal string of 3 or
    4 digits, e.g. ``0640``) or 0o600 when it is unset or empty.

    Raises ``ValueError`` (one sentence naming the variable) for a value that is not 3-4
    octal digits, lacks owner read and write (0600: the server rewrites and the client
    reads its own files), or has bits beyond 0777 (setuid, setgid, sticky).
    """
    raw = os.environ.get(FILE_MODE_ENV, "")
    if not raw.strip():
        return DEFAULT_FILE_MODE
    mode = int(raw.strip(), 8) if _FILE_MODE.fullmatch(raw.strip()) else -1
    if mode < 0 or mode > 0o777 or mode & 0o600 != 0o600:
        raise ValueError(
            f"{FILE_MODE_ENV} must be an octal file mode of 3 or 4 digits that includes owner "
            f"read and write (0600) and nothing beyond 0777, such as 0600 or 0640; got {raw!r}"
        )
    return mode


# Every open of an entry in the dump directory: never through a symlink at the name, and
# never blocking on a FIFO (an open of a FIFO waits for its other end unless O_NONBLOCK;
# on a regular file O_NONBLOCK has no effect).
_OPEN_SAFE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISLNK, "a symbolic link"))


def kind_of(st_mode: int, unknown: str = "of an unknown type") -> str:
    """What a non-regular ``st_mode`` is, in words (``a FIFO``); ``unknown`` otherwise."""
    return next((word for test, word in _KINDS if test(st_mode)), unknown)


def _not_regular(name: str, st_mode: int) -> OSError:
    return OSError(f"{name} is {kind_of(st_mode)}, not a regular file")


def open_regular(
    name: str,
    flags: int,
    *,
    dir_fd: Optional[int] = None,
    mode: Optional[int] = None,
    follow: bool = False,
) -> int:
    """``os.open(name, flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)`` that returns only a
    regular file's descriptor; ``mode`` defaults to ``file_mode()``.

    Raises ``OSError`` "``<name>`` is a FIFO, not a regular file" (or a directory, a
    socket, ...) for anything else, without blocking on a FIFO; ``OSError`` (``ELOOP``)
    for a symlink at ``name`` unless ``follow`` (then its target must be regular); and
    what ``os.open`` raises otherwise (``FileNotFoundError``, ``FileExistsError`` with
    ``O_EXCL``, ``ENOSPC``, ...).
    """
    flags |= _OPEN_SAFE if not follow else (os.O_NONBLOCK | os.O_CLOEXEC)
    if mode is None:
        mode = file_mode() if flags & os.O_CREAT else 0
    try:
        fd = os.open(name, flags, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno != errno.ENXIO:  # ENXIO: a FIFO opened to write with nobody reading
            raise
        try:
            st_mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=follow).st_mode
        except OSError:
            raise e from None
        raise _not_regular(name, st_mode) from None
    try:
        st_mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st_mode):
        os.close(fd)
        raise _not_regular(name, st_mode)
    return fd


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


def is_name_for(rid: str, name: str) -> bool:
    """True when ``name`` (a bare file name) is one ``reserve`` may give ``rid``'s file:
    ``<safe_stem(rid)>[-n].safetensors``. Clients check a server's answer with it before
    they move or delete anything."""
    return re.fullmatch(re.escape(safe_stem(rid)) + r"(?:-[0-9]+)?" + re.escape(SUFFIX), name) is not None


@dataclass
class Reservation:
    """A name held for one request's file: the lock file exists and we hold its flock."""

    dir_fd: int
    name: str  # "<stem>[-n].safetensors", relative to the dump directory
    lock_fd: int

    @property
    def lock_name(self) -> str:
        return self.name + LOCK_SUFFIX


def tmp_prefix(tag: str) -> str:
    """The start of every temporary name of writer ``tag`` (``tmp_name``): what the
    scheduler removes when that writer process is gone."""
    return f"{TMP_PREFIX}{tag}-"


def tmp_name(tag: str, key: int) -> str:
    """The temporary file of request ``key`` of writer ``tag``:
    ``.kimi-<tag>-<key>-<12 hex>.safetensors.tmp``. The random part makes it
    unguessable, so nothing can be planted there in advance; ``is_tmp_name`` matches it."""
    return f"{tmp_prefix(tag)}{key}-{secrets.token_hex(6)}{SUFFIX}{TMP_SUFFIX}"


def is_tmp_name(name: str) -> bool:
    """True for a temporary file a dump leaves when cut off: ours (``tmp_name``, and the
    ``.<name>.safetensors.tmp`` of earlier releases) and safetensors' own
    (``.tmpXXXXXX``). ``clean_stale`` removes exactly these."""
    return ((name.startswith(TMP_PREFIX) and name.endswith(SUFFIX + TMP_SUFFIX))
            or _OLD_TMP.fullmatch(name) is not None or _SAFETENSORS_TMP.fullmatch(name) is not None)


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


# Where the next name of a stem is likely free, per (directory, stem), for the process:
# a rid reused 10k times must not cost 10k tries per request on the scheduler thread.
# Only a hint: the exclusive create decides, so a stale or racing hint costs tries, never
# a wrong name. Bounded (least recently used stems are forgotten).
_NEXT_HINT: "OrderedDict[Tuple[int, int, str], int]" = OrderedDict()
_NEXT_HINT_MAX = 4096
_NEXT_HINT_LOCK = threading.Lock()
_MAX_TRIES = 64  # galloping: covers counters up to 2**62 past the hint


def _candidate(stem: str, n: int) -> str:
    return f"{stem}{SUFFIX}" if n == 0 else f"{stem}-{n}{SUFFIX}"


def _take(dir_fd: int, name: str, mode: int) -> Optional[int]:
    """The held lock's descriptor if ``name`` was free and is now ours, else ``None``."""
    if lexists_at(dir_fd, name):
        return None
    try:
        lock_fd = open_regular(name + LOCK_SUFFIX, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                               dir_fd=dir_fd, mode=mode)
    except FileExistsError:
        return None
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    # A write of that name may have finished (or failed) between the check and the lock.
    if lexists_at(dir_fd, name) or lexists_at(dir_fd, name + ERROR_SUFFIX):
        _unlink_quiet(dir_fd, name + LOCK_SUFFIX)
        os.close(lock_fd)
        return None
    return lock_fd


def reserve(dir_fd: int, rid: str) -> Reservation:
    """Hold a fresh file name for ``rid``; never one a finished or in-flight file has.

    The name is ``<stem>.safetensors`` when that is free, else ``<stem>-<n>.safetensors``
    for some n >= 1 (not necessarily the smallest free one: names need not be dense).
    The lock file is created exclusively (a symlink or any entry already at that name
    counts as taken), with ``file_mode()``. n starts where this process last found a free
    one for the stem, then gallops (+1, +2, +4, ...): O(1) calls per reservation while
    this process names a rid's files, O(log n) after others took n names.
    Raises ``OSError`` when the directory cannot take a new entry (e.g. ``ENOSPC``),
    ``ValueError`` for a bad ``KIMI_SGLANG_FILE_MODE``.
    """
    stem = safe_stem(rid)
    mode = file_mode()
    st = os.fstat(dir_fd)
    key = (st.st_dev, st.st_ino, stem)
    n = 0
    lock_fd = _take(dir_fd, _candidate(stem, 0), mode)
    if lock_fd is None:
        with _NEXT_HINT_LOCK:
            base = _NEXT_HINT.get(key, 1)
        step = 0
        for _ in range(_MAX_TRIES):
            n = base + step
            lock_fd = _take(dir_fd, _candidate(stem, n), mode)
            if lock_fd is not None:
                break
            step = step * 2 if step else 1
        else:
            raise OSError(errno.EEXIST, f"no free file name for rid {rid!r}")
    with _NEXT_HINT_LOCK:
        _NEXT_HINT[key] = n + 1
        _NEXT_HINT.move_to_end(key)
        while len(_NEXT_HINT) > _NEXT_HINT_MAX:
            _NEXT_HINT.popitem(last=False)
    return Reservation(dir_fd=dir_fd, name=_candidate(stem, n), lock_fd=lock_fd)


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


def row_bytes(row_width: int, dtype: str) -> int:
    """Bytes of one token's ``hidden_states`` row: ``row_width`` (= layer slots x hidden
    size) elements of torch dtype name ``dtype``. The same in the arena and in the file.
    Raises ``DumpFormatError`` for a dtype safetensors cannot hold."""
    if dtype not in SAFETENSORS_DTYPES:
        raise DumpFormatError(f"dtype {dtype} has no safetensors code")
    return int(row_width) * SAFETENSORS_DTYPES[dtype][1]


def scale_row_bytes(num_slots: int, dtype: str) -> int:
    """Bytes of one token's ``hidden_states_scales``: ``num_slots`` float32 when ``dtype``
    is fp8 (``float8_e4m3fn``), else 0 (no scales)."""
    return 4 * int(num_slots) if dtype == FP8 else 0


def dtype_metadata(dtype: str) -> Dict[str, str]:
    """What a file of ``hidden_states`` dtype ``dtype`` adds to ``__metadata__``:
    ``hidden_states_dtype`` and ``scale_layout`` for fp8, nothing otherwise."""
    if dtype == FP8:
        return {DTYPE_META_KEY: FP8, SCALE_LAYOUT_KEY: SCALE_LAYOUT}
    return {}


def create_tmp(dir_fd: int, tmp: str) -> int:
    """Create ``tmp`` (a ``tmp_name``) in the dump directory for writing; returns its descriptor.

    Exclusive and not following symlinks, with ``file_mode()``: an entry already at that
    name (a planted symlink, a leftover) is unlinked (the link itself, never its target)
    and the create retried once. Raises ``OSError`` (e.g. ``ENOSPC``).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    mode = file_mode()
    try:
        return open_regular(tmp, flags, dir_fd=dir_fd, mode=mode)
    except FileExistsError:
        _unlink_quiet(dir_fd, tmp)
        return open_regular(tmp, flags, dir_fd=dir_fd, mode=mode)


def pwrite_all(fd: int, data, offset: int) -> None:
    """Write all of ``data`` (any buffer) at ``offset``; raises ``OSError``."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        view, offset = view[n:], offset + n


def publish(dir_fd: int, tmp: str, name: str) -> None:
    """Rename a fully written temporary file to its final name (atomic)."""
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


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


# How long ``append_index`` waits for another process's lock on the index (each holds it
# for one write) before it gives up.
INDEX_LOCK_TIMEOUT_S = 10.0
# The longest index line (bytes, newline included): a rid of ``MAX_RID_CHARS`` characters
# each escaped as a JSON surrogate pair (12 bytes) and the rest of the record fit.
MAX_INDEX_LINE = 128 * 1024
# ``index.jsonl`` is rotated past this size: renamed to ``index-<k>.jsonl`` (k = 1, 2, ...)
# by the append that finds it this long, so no one part grows without bound (~300k lines
# of ~200 bytes a part); ``read_index`` reads the parts in order, then ``index.jsonl``.
INDEX_PART_BYTES = 64 << 20


def index_part_name(k: int) -> str:
    """The name of the ``k``-th rotated part of the index (k >= 1): ``index-<k>.jsonl``."""
    return f"index-{k}.jsonl"


def _index_parts(dir_fd: int) -> List[str]:
    """The rotated parts that exist, oldest first (they are numbered without gaps)."""
    parts = []
    while lexists_at(dir_fd, index_part_name(len(parts) + 1)):
        parts.append(index_part_name(len(parts) + 1))
    return parts


def _open_index_locked(dir_fd: int, part_bytes: int) -> Tuple[int, int]:
    """Open ``index.jsonl`` for appending and take its lock; returns ``(fd, size)`` with
    any partial last line (its writer was killed mid-line) cut away, and the index
    rotated first when it holds ``part_bytes`` or more. The lock is on the file, so after
    taking it the name is checked to still be this file (another append may have rotated
    it meanwhile); if not, the new one is opened."""
    while True:
        fd = open_regular(INDEX_NAME, os.O_RDWR | os.O_CREAT | os.O_APPEND, dir_fd=dir_fd)
        try:
            _lock_bounded(fd, INDEX_LOCK_TIMEOUT_S, INDEX_NAME)
            st = os.fstat(fd)
            try:
                named = os.stat(INDEX_NAME, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                named = None
            if named is None or (named.st_dev, named.st_ino) != (st.st_dev, st.st_ino):
                os.close(fd)
                continue
            size = _cut_partial_line(fd, st.st_size)
            if size < part_bytes:
                return fd, size
            os.rename(INDEX_NAME, index_part_name(len(_index_parts(dir_fd)) + 1),
                      src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.close(fd)
        except BaseException:
            _close_never_raises(fd)
            raise


def _cut_partial_line(fd: int, size: int) -> int:
    """Truncate the index back to the end of its last whole line (after its last
    newline); returns the new size. Called under the index lock."""
    end = size
    while end > 0:
        start = max(0, end - MAX_INDEX_LINE)
        cut = os.pread(fd, end - start, start).rfind(b"\n")
        if cut >= 0:
            end = start + cut + 1
            break
        end = start
    if end != size:
        os.ftruncate(fd, end)
    return end


def append_index(dir_fd: int, record: Mapping[str, Any], *, mark_fd: Optional[int] = None,
                 part_bytes: int = INDEX_PART_BYTES) -> None:
    """Append one JSON line (at most ``MAX_INDEX_LINE`` bytes) to ``index.jsonl``, whole
    or not at all.

    Under an exclusive ``flock`` on the index (writers of several servers may share a
    directory): a partial last line a killed appender left is cut away first, the index
    is rotated past ``part_bytes`` (``INDEX_PART_BYTES``), then the line goes in one
    ``write``; one cut short (disk full, file size limit) or failed is undone by
    truncating the index back to its size before it. ``mark_fd`` (the request's lock
    file, open for writing) receives where the line goes (``index_mark``) before it is
    written, so that ``indexed`` can tell without reading the index whether a writer
    that died later had appended it. Raises ``OSError`` naming ``index.jsonl`` then (the
    caller makes it the request's error), for a longer line (``EFBIG``), when the index
    is not a regular file (a FIFO planted there: refused without blocking), or when its
    lock stays held longer than ``INDEX_LOCK_TIMEOUT_S``.
    """
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode("ascii")
    if len(line) > MAX_INDEX_LINE:
        raise OSError(errno.EFBIG, f"{INDEX_NAME}: a line of {len(line)} bytes is over the "
                      f"bound of {MAX_INDEX_LINE}")
    fd, size = _open_index_locked(dir_fd, part_bytes)
    try:
        if mark_fd is not None:
            st = os.fstat(fd)
            mark = f"{st.st_dev} {st.st_ino} {size}\n".encode("ascii")
            if os.pwrite(mark_fd, mark, 0) != len(mark):
                raise OSError(errno.ENOSPC, f"{INDEX_NAME}: the lock file took only part of "
                              f"the index mark")
        try:
            written = os.write(fd, line)
            if written != len(line):
                raise OSError(errno.ENOSPC, f"only {written} of {len(line)} bytes were written")
        except OSError as e:
            why = e.strerror or str(e)
            try:
                os.ftruncate(fd, size)
            except OSError as t:
                raise OSError(e.errno, f"{INDEX_NAME}: a line of {len(line)} bytes could not be "
                              f"written ({why}), and cutting the index back to {size} bytes "
                              f"failed too ({t.strerror}): the next append cuts the partial "
                              f"line") from None
            raise OSError(e.errno, f"{INDEX_NAME}: a line of {len(line)} bytes could not be "
                          f"written ({why}); the index is left as it was") from None
    finally:
        os.close(fd)  # also releases the flock


def indexed(dir_fd: int, name: str, lock_fd: int) -> bool:
    """Whether file ``name``'s index line is in the index, from the mark ``append_index``
    left in its lock file (``lock_fd``, open for reading): True when the line that starts
    where the mark says (in ``index.jsonl`` or, rotated since, a part) is whole and names
    ``name``; False when there is no mark (the writer died before its append) or the line
    there is not this file's (cut away as partial, then another file's line went there).
    Reads one line, never the whole index. Raises ``OSError`` when the lock or the index
    cannot be read."""
    try:
        dev, ino, offset = (int(v) for v in os.pread(lock_fd, 64, 0).split())
    except ValueError:
        return False
    for part in [INDEX_NAME] + _index_parts(dir_fd)[::-1]:
        try:
            fd = open_regular(part, os.O_RDONLY, dir_fd=dir_fd)
        except FileNotFoundError:
            continue
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (dev, ino):
                continue
            text = os.pread(fd, MAX_INDEX_LINE, offset)
        finally:
            os.close(fd)
        line, newline, _ = text.partition(b"\n")
        try:
            record = json.loads(line) if newline else None
        except ValueError:
            return False
        return isinstance(record, dict) and record.get("file") == name
    return False


def _lock_bounded(fd: int, timeout: float, name: str) -> None:
    """Take an exclusive ``flock`` on ``fd``, polling; ``OSError`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    delay = POLL_FIRST_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise OSError(errno.EAGAIN, f"{name} stayed locked by another process for "
                              f"more than {timeout:g} s") from None
            time.sleep(delay)
            delay = min(delay * 1.5, POLL_MAX_S)


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

    The message is written to a temporary name and renamed onto ``<name>.error``, so the
    error file is never seen empty: a waiter may look the moment the lock is released,
    and a writer killed mid-``fail`` releases it (the kernel drops the flock) at any point.
    Never raises: if even the error file cannot be written (disk full), or something not
    a regular file sits at its name (left alone), a waiter that finds neither the file nor
    a readable error reports the file as missing.
    """
    error_name = res.name + ERROR_SUFFIX
    tmp = tmp_name("error", 0)
    try:
        try:
            st = os.lstat(error_name, dir_fd=res.dir_fd)
        except FileNotFoundError:
            st = None
        if st is None or stat.S_ISREG(st.st_mode):
            fd = create_tmp(res.dir_fd, tmp)
            try:
                os.write(fd, message.encode("utf-8", "replace")[:ERROR_MAX_BYTES])
            finally:
                os.close(fd)
            os.rename(tmp, error_name, src_dir_fd=res.dir_fd, dst_dir_fd=res.dir_fd)
    except (OSError, ValueError):  # ValueError: a bad KIMI_SGLANG_FILE_MODE
        _unlink_never_raises(res.dir_fd, tmp)
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

    Temporary files are those ``is_tmp_name`` matches: ours (``.kimi-...safetensors.tmp``,
    and earlier releases' ``.<name>.safetensors.tmp``) and safetensors' own
    (``.tmpXXXXXX``); only the writing ranks of one server may use a dump directory (one
    per DP rank: they all start before the server takes requests).

    Called once at start-up by each writing rank. A lock is stale when an exclusive
    non-blocking ``flock`` on it succeeds; an entry with a lock's name that is not a
    regular file (a planted FIFO) is left alone. Returns counts ``{"tmp": n, "lock": m}``.
    """
    removed = {"tmp": 0, "lock": 0}
    for name in os.listdir(dir_fd):
        if is_tmp_name(name):
            _unlink_never_raises(dir_fd, name)  # a directory planted there stays: never fatal
            removed["tmp"] += 1
        elif name.endswith(SUFFIX + LOCK_SUFFIX):
            try:
                fd = open_regular(name, os.O_RDONLY, dir_fd=dir_fd)
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


# The longest message ``fail`` leaves (bytes of UTF-8) and ``_wait_outcome`` reads back.
ERROR_MAX_BYTES = 4096

# Lock polling: first check after 0.2 ms, then 1.5x longer each time, at most 5 ms
# apart. Where inotify works (``_LockWatch``) a waiter is also woken the moment the lock
# is unlinked or its writer's descriptor closes, so a finished write is seen within
# microseconds and the polling is only the fallback (a lock on NFS, no inotify left);
# without it a finished write is seen within ~5 ms: the cap is added to a waiting
# response's latency, which at concurrency 1 is throughput (docs/verification.md).
POLL_FIRST_S = 0.0002
POLL_MAX_S = 0.005

# inotify (inotify(7)): what on a lock file means its holder may be done. IN_ATTRIB: its
# link count dropped (``complete``, ``fail``, ``cancel`` unlink it before they close the
# descriptor); IN_CLOSE_WRITE: the last descriptor of its open for writing closed (the
# writer process died holding it). Never IN_OPEN/IN_CLOSE_NOWRITE: a waiter's own check
# opens the lock read-only and must not wake itself.
_IN_ATTRIB, _IN_CLOSE_WRITE, _IN_DELETE_SELF, _IN_MOVE_SELF = 0x4, 0x8, 0x400, 0x800
_IN_DONT_FOLLOW = 0x02000000
_LOCK_EVENTS = _IN_ATTRIB | _IN_CLOSE_WRITE | _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_DONT_FOLLOW
_EVENT_HEAD = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then name)


class _LockWatch:
    """One inotify instance per process and one thread reading it: ``add(lock, wake)``
    calls ``wake()`` (on that thread; it must not block) at every event on the lock file
    until ``remove``. Waiters of the same file share its watch descriptor."""

    def __init__(self):
        libc = ctypes.CDLL(None, use_errno=True)
        self._add = libc.inotify_add_watch
        self._add.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
        self._rm = libc.inotify_rm_watch
        self._rm.argtypes = (ctypes.c_int, ctypes.c_int)
        self.fd = libc.inotify_init1(os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self._lock = threading.Lock()
        self._wakers: Dict[int, List[Callable[[], None]]] = {}
        threading.Thread(target=self._run, name="hs-lock-watch", daemon=True).start()

    def add(self, lock_path: str, wake: Callable[[], None]) -> Optional[int]:
        """Watch ``lock_path`` for ``wake``; its watch descriptor, or None where it cannot
        be watched (gone already, the watch limit reached): the waiter then only polls."""
        with self._lock:
            wd = self._add(self.fd, os.fsencode(lock_path), _LOCK_EVENTS)
            if wd < 0:
                return None
            self._wakers.setdefault(wd, []).append(wake)
            return wd

    def remove(self, wd: int, wake: Callable[[], None]) -> None:
        with self._lock:
            wakers = self._wakers.get(wd, [])
            if wake in wakers:
                wakers.remove(wake)
            if not wakers:
                self._wakers.pop(wd, None)
                self._rm(self.fd, wd)  # EINVAL when the kernel dropped it already: fine

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except InterruptedError:
                continue
            except OSError:
                return
            pos, woken = 0, set()
            while pos + _EVENT_HEAD.size <= len(data):
                wd, _, _, n = _EVENT_HEAD.unpack_from(data, pos)
                pos += _EVENT_HEAD.size + n
                woken.add(wd)
            with self._lock:
                calls = [w for wd in woken for w in self._wakers.get(wd, ())]
            for wake in calls:
                try:
                    wake()
                except Exception:  # noqa: BLE001 - a waiter gone (its loop closed) polls on
                    pass


_WATCH: Optional[_LockWatch] = None
_WATCH_TRIED = False
_WATCH_LOCK = threading.Lock()


def _lock_watch() -> Optional[_LockWatch]:
    """The process's ``_LockWatch``, started at first use; None where inotify is missing
    (not Linux, no instance left: ``fs.inotify.max_user_instances``)."""
    global _WATCH, _WATCH_TRIED
    with _WATCH_LOCK:
        if not _WATCH_TRIED:
            _WATCH_TRIED = True
            try:
                _WATCH = _LockWatch()
            except (OSError, AttributeError, RuntimeError):
                _WATCH = None
        return _WATCH


def _forget_watch_after_fork() -> None:
    global _WATCH, _WATCH_TRIED, _WATCH_LOCK
    if _WATCH is not None:
        _close_never_raises(_WATCH.fd)  # its reader thread did not come along
    _WATCH, _WATCH_TRIED, _WATCH_LOCK = None, False, threading.Lock()


os.register_at_fork(after_in_child=_forget_watch_after_fork)


@contextlib.contextmanager
def _woken_on_release(path: str, wake: Callable[[], None]):
    """While inside: ``wake()`` (from the watch thread) whenever ``<path>.lock`` may have
    been released; nothing where it cannot be watched."""
    watch = _lock_watch()
    wd = watch.add(path + LOCK_SUFFIX, wake) if watch is not None else None
    try:
        yield
    finally:
        if wd is not None:
            watch.remove(wd, wake)


def _wait_outcome(path: str) -> Optional[str]:
    """After the lock is gone: ``None`` if the file is there (a regular file: anything else
    at its name is not the writer's), else the error message."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if stat.S_ISREG(st.st_mode):
            return None
        return f"hidden-state file {path} is not a regular file ({kind_of(st.st_mode)}): not the writer's file"
    try:
        fd = open_regular(path + ERROR_SUFFIX, os.O_RDONLY)
    except FileNotFoundError:
        return f"hidden-state file {path} is missing"
    except OSError as e:
        return f"hidden-state file {path} is missing, and its error file cannot be read: {e}"
    try:
        text = os.read(fd, ERROR_MAX_BYTES).decode("utf-8", "replace")
    finally:
        os.close(fd)
    return text or "hidden-state write failed"


def _try_lock_released(path: str) -> bool:
    """True when nobody holds ``<path>.lock`` (it is gone, or a shared flock succeeds).
    Raises ``OSError`` when the lock's name holds something not a regular file."""
    try:
        fd = open_regular(path + LOCK_SUFFIX, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


# A lock file that nobody holds while neither the file nor its error exists: its writer
# died holding it (the kernel dropped the flock). The server's side settles it (writes the
# error, removes the lock) within about a second (writer.DumpWriter's watchdog thread);
# a waiter gives it this long before it reports the file missing.
SETTLE_S = 3.0


def _settled(path: str, unsettled_since: Optional[float]) -> Tuple[bool, Optional[float]]:
    """``(done, unsettled_since)``: done once the lock is released and its outcome is
    there (the file, its error, or the lock gone), or ``SETTLE_S`` after it was first seen
    released without one."""
    if not _try_lock_released(path):
        return False, None
    if os.path.lexists(path) or os.path.lexists(path + ERROR_SUFFIX) or not os.path.lexists(path + LOCK_SUFFIX):
        return True, unsettled_since
    now = time.monotonic()
    if unsettled_since is None:
        return False, now
    return now - unsettled_since >= SETTLE_S, unsettled_since


def wait_complete(path: str, timeout: float = 600.0) -> Optional[str]:
    """Block until the writer has released ``path``; ``None`` on success, else the error
    (``<path>.error``'s text; if the writer died and nobody settled the file within
    ``SETTLE_S``, that it is missing).

    Raises ``TimeoutError`` after ``timeout`` seconds, ``OSError`` when something not a
    regular file sits at the lock's name. Woken by inotify on the lock file where it
    works (``_LockWatch``), else by polling with a short back-off (``POLL_MAX_S``); a
    blocking ``flock`` would hold a thread per waiter and could not time out.
    """
    deadline = time.monotonic() + timeout
    delay = POLL_FIRST_S
    woken = threading.Event()
    with _woken_on_release(path, woken.set):
        done, since = _settled(path, None)
        while not done:
            if time.monotonic() > deadline:
                raise TimeoutError(f"hidden-state file {path} not complete after {timeout}s")
            woken.wait(delay)
            woken.clear()  # before the check: an event during it wakes the next wait
            delay = min(delay * 1.5, POLL_MAX_S)
            done, since = _settled(path, since)
    return _wait_outcome(path)


def _resolve(fut: "asyncio.Future") -> None:
    if not fut.done():
        fut.set_result(None)


async def wait_complete_async(path: str, timeout: float = 600.0) -> Optional[str]:
    """``wait_complete`` for an event loop (never blocks the loop): the watch thread's
    wake-up reaches the loop through ``call_soon_threadsafe``."""
    loop = asyncio.get_running_loop()
    state: Dict[str, Any] = {"fut": None, "woken": False}

    def on_loop() -> None:
        state["woken"] = True
        if state["fut"] is not None:
            _resolve(state["fut"])

    def wake() -> None:  # the watch thread
        try:
            loop.call_soon_threadsafe(on_loop)
        except RuntimeError:  # the loop is closed: nothing waits any more
            pass

    deadline = time.monotonic() + timeout
    delay = POLL_FIRST_S
    with _woken_on_release(path, wake):
        done, since = _settled(path, None)
        while not done:
            if time.monotonic() > deadline:
                raise TimeoutError(f"hidden-state file {path} not complete after {timeout}s")
            if not state["woken"]:
                fut = state["fut"] = loop.create_future()
                timer = loop.call_later(delay, _resolve, fut)
                try:
                    await fut
                finally:
                    timer.cancel()
                    state["fut"] = None
            state["woken"] = False
            delay = min(delay * 1.5, POLL_MAX_S)
            done, since = _settled(path, since)
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

    Anything the safetensors library refuses (a header too long or not JSON, offsets past
    the end of a truncated file, an unknown dtype) is ``DumpFormatError`` naming ``path``
    too. ``path`` may be a symlink; what it names must be a regular file (a FIFO is
    refused with ``OSError``, never waited on). ``FileNotFoundError`` and other
    ``OSError`` when it cannot be opened.
    """
    from safetensors import SafetensorError, safe_open

    fd = open_regular(path, os.O_RDONLY, follow=True)
    try:
        # Through the descriptor checked above, so nothing swapped in at ``path`` since
        # (a FIFO) is opened by the library.
        with safe_open(f"/proc/self/fd/{fd}", framework="pt") as f:
            keys = set(f.keys())
            missing = {KEY_HIDDEN_STATES, KEY_TOKEN_IDS} - keys
            if missing:
                raise DumpFormatError(f"{path}: missing keys {sorted(missing)}")
            meta = f.metadata() or {}
            hs = f.get_tensor(KEY_HIDDEN_STATES)
            ids = f.get_tensor(KEY_TOKEN_IDS)
            scales = f.get_tensor(KEY_SCALES) if KEY_SCALES in keys else None
    except DumpFormatError:
        raise
    except (SafetensorError, ValueError, TypeError, RuntimeError, OverflowError,
            RecursionError, KeyError) as e:
        # RuntimeError / TypeError: torch refusing what the header declares.
        raise DumpFormatError(f"{path}: not a readable safetensors file "
                              f"({type(e).__name__}: {e})") from None
    finally:
        os.close(fd)
    check_tensors(hs, ids, scales)
    if "layer_ids" in meta:
        try:
            layer_ids = json.loads(meta["layer_ids"])
        except (ValueError, RecursionError):
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


# The longest header read: safetensors' own limit (``MAX_HEADER_SIZE = 100_000_000`` in
# the Rust crate's src/tensor.rs; its readers refuse a longer one as ``HeaderTooLarge``).
MAX_HEADER_BYTES = 100_000_000
# safetensors' numbers are u64 (shapes, offsets): at most 20 digits.
_MAX_INT_DIGITS = 20


def _header_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise ValueError(f"integer of {len(text)} digits")
    return int(text)


def _header_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:32]} out of range")
    return value


def _header_constant(text: str) -> float:
    raise ValueError(f"{text} is not JSON")


def read_header(dir_fd: int, name: str) -> Dict[str, Any]:
    """The JSON header of safetensors file ``name`` in the dump directory (tensor entries
    and ``__metadata__``), without reading the tensors.

    Raises ``DumpFormatError`` naming the file for a file too short, a header length over
    ``MAX_HEADER_BYTES`` (safetensors' limit) or past the end of the file, a header that
    is not UTF-8 JSON (nesting too deep for the parser, NaN/Infinity, numbers no u64 or
    finite float holds), not an object, or whose ``__metadata__`` is not a str -> str
    object; ``OSError`` when it cannot be read or is not a regular file (never blocks on
    a FIFO, never follows a symlink).
    """
    fd = open_regular(name, os.O_RDONLY, dir_fd=dir_fd)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise DumpFormatError(f"{name}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise DumpFormatError(f"{name}: header length {n} is over safetensors' limit of "
                                  f"{MAX_HEADER_BYTES} bytes")
        if n > size - 8:
            raise DumpFormatError(f"{name}: header length {n} runs past the end of the file "
                                  f"({size} bytes)")
        text = os.pread(fd, n, 8)
    finally:
        os.close(fd)
    if len(text) != n:
        raise DumpFormatError(f"{name}: the file shrank while its header was read")
    try:
        header = json.loads(text.decode("utf-8"), parse_int=_header_int,
                            parse_float=_header_float, parse_constant=_header_constant)
    except (ValueError, RecursionError, OverflowError) as e:
        # ValueError includes UnicodeDecodeError; RecursionError: '[[[[...' deeper than
        # the parser's stack.
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise DumpFormatError(f"{name}: the safetensors header is not valid JSON ({why})") from None
    if not isinstance(header, dict):
        raise DumpFormatError(f"{name}: the safetensors header is a JSON "
                              f"{type(header).__name__}, not an object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise DumpFormatError(f"{name}: the header's __metadata__ is not an object of strings")
    return header


def index_record(rid: str, name: str, num_tokens: int, size: int, layer_ids: str) -> Dict[str, Any]:
    """The ``index.jsonl`` record of file ``name``: its request's ``rid``, ``num_tokens``
    prompt tokens, ``size`` bytes, ``layer_ids`` as the metadata holds them (a JSON list
    in a string). The one place its keys are spelled."""
    return {"rid": rid, "file": name, "num_tokens": num_tokens, "bytes": size, "layer_ids": layer_ids}


def index_record_from_header(dir_fd: int, name: str, size: int) -> Dict[str, Any]:
    """``index_record`` of file ``name`` (``size`` bytes), from its header (for a file
    whose writer died before it appended the line). Raises what ``read_header`` raises,
    and ``DumpFormatError`` when the header has no ``hidden_states`` entry whose
    ``shape`` is a non-empty list of non-negative ints."""
    header = read_header(dir_fd, name)
    meta = header.get("__metadata__", {})
    entry = header.get(KEY_HIDDEN_STATES)
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if not (isinstance(shape, list) and shape
            and all(type(d) is int and d >= 0 for d in shape)):
        raise DumpFormatError(f"{name}: the header has no {KEY_HIDDEN_STATES} entry with a "
                              f"shape of non-negative ints")
    return index_record(meta.get("rid"), name, shape[0], size, meta.get("layer_ids"))


def read_index(directory: str) -> list:
    """All records of the index of ``directory``, in write order: its rotated parts
    (``index-1.jsonl``, ``index-2.jsonl``, ...) then ``index.jsonl`` (``[]`` when there is
    none). A last line without its newline (an append in progress, or one whose writer was
    killed: the next append cuts it) is skipped. Raises ``OSError`` when a part is not a
    regular file (never blocks on a FIFO) and ``ValueError`` naming the part and line for
    a whole line that is not JSON."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    try:
        records: list = []
        for part in _index_parts(dir_fd) + [INDEX_NAME]:
            try:
                fd = open_regular(part, os.O_RDONLY, dir_fd=dir_fd)
            except FileNotFoundError:
                continue
            with os.fdopen(fd, "rb") as f:
                for number, line in enumerate(f, 1):
                    if not line.endswith(b"\n") or not line.strip():
                        continue
                    try:
                        records.append(json.loads(line))
                    except ValueError:
                        raise ValueError(f"{os.path.join(directory, part)} line {number} is not "
                                         f"JSON: {line[:80]!r}") from None
        return records
    finally:
        os.close(dir_fd)
