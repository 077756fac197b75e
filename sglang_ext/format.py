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

These are the keys and layout vLLM's hidden-states connector writes and speculators'
offline reader loads (``hs_<i>.safetensors``). ``__metadata__`` (str -> str) holds
``format``, ``rid``, ``layer_ids`` (JSON list), ``num_layers`` (of the model),
``model_path``, ``sglang_version``, ``sglang_ext_version`` and ``series``.

Writing (all relative to an open directory descriptor, so nothing follows a symlink
planted at a name or swapped in for the directory after start-up):

1. ``reserve()`` picks a name from the rid (``safe_stem``) that neither a finished file
   nor a write in flight holds, by creating ``<name>.safetensors.lock`` with
   ``O_CREAT|O_EXCL|O_NOFOLLOW`` and holding an exclusive ``flock`` on it.
2. ``write_reserved()`` writes a temporary file ``.~<pid>-<n>.safetensors.tmp`` (made
   by ``create_tmp``, ideally ahead of time, with its pages already allocated) and
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
sending its next prompt meanwhile.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import hashlib
import itertools
import json
import os
import re
import struct
import time
import unicodedata
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

FORMAT_VERSION = "kimi-sglang/1"
WAIT_PARAM = "hidden_states_wait"  # request: custom_params key; false = answer early
PENDING_KEY = "hidden_states_pending"  # response meta_info: true = wait on <path>.lock
KEY_HIDDEN_STATES = "hidden_states"
KEY_TOKEN_IDS = "token_ids"
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
        if _lexists_at(dir_fd, name) or _lexists_at(dir_fd, name + ERROR_SUFFIX):
            os.unlink(name + LOCK_SUFFIX, dir_fd=dir_fd)
            os.close(lock_fd)
            continue
        return Reservation(dir_fd=dir_fd, name=name, lock_fd=lock_fd)
    raise OSError(errno.EEXIST, f"no free file name for rid {rid!r}")


def _lexists_at(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def printable_rid(rid: str) -> str:
    """``rid`` as valid UTF-8 text: equal to ``rid`` unless it holds lone surrogates
    (possible from JSON ``\\udcff`` escapes), which become ``\\udcff`` literally."""
    return rid.encode("utf-8", "backslashreplace").decode("utf-8")


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


# safetensors' dtype names (https://github.com/huggingface/safetensors, "Format"; the
# library's own table is safetensors.torch._TYPES) for the dtypes a dump can hold.
SAFETENSORS_DTYPES = {
    "torch.bfloat16": "BF16", "torch.float16": "F16", "torch.float32": "F32",
    "torch.float64": "F64", "torch.float8_e4m3fn": "F8_E4M3", "torch.float8_e5m2": "F8_E5M2",
    "torch.int64": "I64", "torch.int32": "I32", "torch.int16": "I16", "torch.int8": "I8",
    "torch.uint8": "U8", "torch.bool": "BOOL",
}
# Bytes create_tmp reserves for the header beyond the tensors' data (a dump's header,
# metadata included, is well under 1 KiB; a longer one is still written, only the bytes
# past the allowance are allocated by the write itself).
HEADER_ALLOWANCE = 4096
_tmp_counter = itertools.count()


def encode_header(tensors: Sequence[Tuple[str, Any]], metadata: Mapping[str, str],
                  size: int = 0) -> bytes:
    """The safetensors header for ``tensors`` (name, CPU tensor), data in the order given.

    Returns the 8-byte little-endian header length followed by the JSON header
    (``__metadata__`` first, then each tensor's ``dtype``, ``shape`` and ``data_offsets``
    relative to the end of the header), padded with spaces (0x20, which the safetensors
    format allows after the JSON) to ``size`` bytes in all when ``size`` is a multiple
    of 8 that holds it, else to a multiple of 8, as safetensors' own writer (its Rust
    ``serialize``) does, so data stays 8-byte aligned.
    Raises ``DumpFormatError`` for a dtype safetensors has no name for.
    """
    header: Dict[str, Any] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    offset = 0
    for name, t in tensors:
        dtype = SAFETENSORS_DTYPES.get(str(t.dtype))
        if dtype is None:
            raise DumpFormatError(f"{name}: dtype {t.dtype} has no safetensors name")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if size % 8 == 0 and size >= 8 + len(text):
        text += b" " * (size - 8 - len(text))
    else:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


@dataclass
class TmpFile:
    """A temporary file in the dump directory, open for writing, its first ``allocated``
    bytes already backed by pages (0 where the file system cannot preallocate)."""

    dir_fd: int
    name: str
    fd: int
    allocated: int


def file_bytes_estimate(num_tokens: int, row_bytes: int) -> int:
    """Bytes ``create_tmp`` should preallocate for a dump of ``num_tokens`` rows of
    ``row_bytes`` hidden-state bytes each (plus int64 token ids and ``HEADER_ALLOWANCE``)."""
    return int(num_tokens) * (int(row_bytes) + 8) + HEADER_ALLOWANCE


def create_tmp(dir_fd: int, nbytes: int) -> TmpFile:
    """Create a fresh temporary file in the dump directory and preallocate ``nbytes``.

    Why ahead of time: filling pages that already exist is the only part of a write left
    for when the rows are on the host. Measured on the H200 host's ``/dev/shm`` (tmpfs,
    2026-12-01, one thread, 64 MiB): writing a new file 2.6 GB/s, ``posix_fallocate``
    10.9 GB/s, writing into the preallocated file 4.1 GB/s (16 MiB: 3.8, 11.6, 5.7).
    The name ``.~<pid>-<n>.safetensors.tmp`` cannot collide with a dump's (``safe_stem``
    never yields ``~``), and ``clean_stale`` removes it after a crash. Raises ``OSError``
    (e.g. ``ENOSPC`` when the file system cannot hold ``nbytes``); nothing is left then.
    """
    for _ in range(1000):
        name = f"{TMP_PREFIX}~{os.getpid()}-{next(_tmp_counter)}{SUFFIX}{TMP_SUFFIX}"
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644, dir_fd=dir_fd)
            break
        except FileExistsError:  # left by an earlier process with this pid
            continue
    else:
        raise OSError(errno.EEXIST, "no free temporary file name in the dump directory")
    tmp = TmpFile(dir_fd=dir_fd, name=name, fd=fd, allocated=0)
    try:
        if nbytes > 0:
            os.posix_fallocate(fd, 0, nbytes)
            tmp.allocated = nbytes
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            discard_tmp(tmp)
            raise
    except BaseException:
        discard_tmp(tmp)
        raise
    return tmp


def discard_tmp(tmp: TmpFile) -> None:
    """Close and remove a temporary file that will not become a dump; never raises."""
    try:
        os.close(tmp.fd)
    except OSError:
        pass
    try:
        os.unlink(tmp.name, dir_fd=tmp.dir_fd)
    except OSError:
        pass


def _pwrite_all(fd: int, parts: Sequence[memoryview]) -> int:
    """Write ``parts`` back to back from offset 0 with ``pwritev`` (one system call for a
    whole file unless the kernel writes less, e.g. past 2 GiB: then the rest follows);
    returns the bytes written. The GIL is released while the kernel copies."""
    parts = [p.cast("B") for p in parts if len(p)]
    offset = 0
    while parts:
        n = os.pwritev(fd, parts, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        while parts and n >= len(parts[0]):
            n -= len(parts[0])
            parts.pop(0)
        if parts and n:
            parts[0] = parts[0][n:]
    return offset


def _raw_bytes(t: Any) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    import torch

    if not t.is_contiguous():
        raise DumpFormatError(f"tensor of shape {tuple(t.shape)} is not contiguous")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_reserved(
    res: Reservation,
    hidden_states: Any,
    token_ids: Any,
    metadata: Mapping[str, str],
    tmp: Optional[TmpFile] = None,
) -> int:
    """Write the file for a reservation atomically; returns its size in bytes.

    ``hidden_states``: torch ``[T, L, H]`` (CPU, contiguous); ``token_ids``: torch int64
    ``[T]``. ``tmp``: a ``create_tmp`` file to write into (taken over: closed, and renamed
    or removed); without one, one is made here. Raises ``DumpFormatError`` on inconsistent
    shapes and ``OSError`` on I/O failure; in both cases nothing is left under the final
    name and the temporary file is removed. Does not release the reservation (see
    ``complete`` / ``fail``).

    The file is what ``safetensors.torch.save_file`` would write (same header fields, data
    order ``token_ids`` then ``hidden_states``, as its writer orders by alignment), but
    for the order of the metadata keys (unordered in its writer) and, in a prepared file,
    the header's padding (up to ``HEADER_ALLOWANCE``, see ``encode_header``); it is written
    here because ``save_file`` (>= 0.8) always creates its own temporary file, so it
    cannot fill one whose pages were allocated ahead (see ``create_tmp``). The temporary
    file is renamed within the directory descriptor, so a symlink planted at the final
    name or swapped in for the directory is never followed.
    """
    try:
        check_tensors(hidden_states, token_ids)
        parts = [(KEY_TOKEN_IDS, token_ids), (KEY_HIDDEN_STATES, hidden_states)]
        views = [_raw_bytes(t) for _, t in parts]
        data = sum(len(v) for v in views)
        # A prepared file's header allowance is filled with the header's padding, so the
        # file ends where its preallocation does (no truncation) and the data starts on
        # a page boundary; a header that does not fit is padded as safetensors pads it.
        room = tmp.allocated - data if tmp is not None else 0
        header = encode_header(parts, metadata, room if room <= HEADER_ALLOWANCE else 0)
    except BaseException:
        if tmp is not None:
            discard_tmp(tmp)
        raise
    size = len(header) + data
    if tmp is None:
        tmp = create_tmp(res.dir_fd, size)
    try:
        _pwrite_all(tmp.fd, [memoryview(header)] + views)
        if tmp.allocated > size:
            os.ftruncate(tmp.fd, size)  # give back what was allocated beyond the file
        os.close(tmp.fd)
        tmp.fd = -1
        os.rename(tmp.name, res.name, src_dir_fd=tmp.dir_fd, dst_dir_fd=res.dir_fd)
    except BaseException:
        discard_tmp(tmp)
        raise
    return size


def check_tensors(hidden_states: Any, token_ids: Any) -> None:
    """Raise ``DumpFormatError`` unless shapes and dtypes follow the contract."""
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
    """Release a reservation whose file is in place: unlink the lock, then drop the flock."""
    _unlink_quiet(res.dir_fd, res.lock_name)
    os.close(res.lock_fd)


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
    _unlink_quiet(res.dir_fd, res.lock_name)
    try:
        os.close(res.lock_fd)
    except OSError:
        pass


def _unlink_quiet(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def clean_stale(dir_fd: int) -> Dict[str, int]:
    """Remove what an interrupted run left: temporary files and locks nobody holds.

    Temporary files are ours (``.~<pid>-<n>.safetensors.tmp``; ``.<name>.safetensors.tmp``
    before 2026-12) and safetensors' own (``.tmpXXXXXX``, from ``save_file``, which wrote
    dumps before then); only the writing rank of one server may use a dump directory.

    Called once at start-up by the writing rank. A lock is stale when an exclusive
    non-blocking ``flock`` on it succeeds. Returns counts ``{"tmp": n, "lock": m}``.
    """
    removed = {"tmp": 0, "lock": 0}
    for name in os.listdir(dir_fd):
        if (name.startswith(TMP_PREFIX) and name.endswith(SUFFIX + TMP_SUFFIX)) or (
            _SAFETENSORS_TMP.fullmatch(name)
        ):
            _unlink_quiet(dir_fd, name)
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
# apart, so a finished write is seen within ~5 ms (a 50 ms cap added up to 50 ms to
# every response, seen at concurrency 1 in bench/results/2026-11-29-h200-quick.json).
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

    @property
    def layer_ids(self) -> list:
        return json.loads(self.metadata["layer_ids"])


def load(path: str) -> DumpRecord:
    """Read one dump file; raises ``DumpFormatError`` if it breaks the contract: missing
    keys, shapes or dtypes (``check_tensors``), or ``layer_ids`` metadata that is not a
    sorted list of distinct ids, one per layer slot. Files without our metadata (e.g.
    vLLM's) load with ``metadata == {}``."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        keys = set(f.keys())
        missing = {KEY_HIDDEN_STATES, KEY_TOKEN_IDS} - keys
        if missing:
            raise DumpFormatError(f"{path}: missing keys {sorted(missing)}")
        meta = f.metadata() or {}
        hs = f.get_tensor(KEY_HIDDEN_STATES)
        ids = f.get_tensor(KEY_TOKEN_IDS)
    check_tensors(hs, ids)
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
    return DumpRecord(hidden_states=hs, token_ids=ids, metadata=dict(meta))


def read_index(directory: str) -> list:
    """All records of ``<directory>/index.jsonl``, in write order."""
    path = os.path.join(directory, INDEX_NAME)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
