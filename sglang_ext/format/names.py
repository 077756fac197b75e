"""File names: the stem of a rid (``safe_stem``), reserving a name under its lock
(``reserve``), temporary names (``tmp_name``), the dump directory (``open_dump_dir``), rids."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import secrets
import threading
import unicodedata
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Tuple

from .keys import SUFFIX, LOCK_SUFFIX, ERROR_SUFFIX, TMP_PREFIX, TMP_SUFFIX
from .files import file_mode, open_regular, lexists_at, _unlink_quiet

__all__ = [
    "MAX_STEM_CHARS", "safe_stem", "is_name_for", "Reservation", "tmp_prefix", "tmp_name",
    "is_tmp_name", "open_dump_dir", "reserve", "printable_rid", "MAX_RID_CHARS",
    "check_rid", "brief_rid", "HEALTH_CHECK_RID_PREFIX", "WARMUP_RID_PREFIX", "is_internal",
]


# Longest stem taken from the rid; the whole name stays far below NAME_MAX (255 bytes)
# even with the hash, a collision counter and the longest suffix.
MAX_STEM_CHARS = 96
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
# What safetensors >= 0.8 names its own temporary file while writing (".tmpXXXXXX").
_SAFETENSORS_TMP = re.compile(r"\.tmp[A-Za-z0-9_]{6,}")
# Temporary names of earlier releases, which wrote whole files beside the final name:
# ``.<name>.safetensors.tmp`` (``name`` from ``safe_stem``, so never starting with a dot).
_OLD_TMP = re.compile(r"\.[A-Za-z0-9_-][A-Za-z0-9._-]*" + re.escape(SUFFIX + TMP_SUFFIX))


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


def printable_rid(rid: str) -> str:
    """``rid`` as valid UTF-8 text: equal to ``rid`` unless it holds lone surrogates
    (possible from JSON ``\\udcff`` escapes), which become ``\\udcff`` literally."""
    return rid.encode("utf-8", "backslashreplace").decode("utf-8")


# Longest rid a dump takes: it is stored in the file's metadata and travels to the writer
# process in one socket message (``wire.MAX_MESSAGE``); a longer one fails its own request.
MAX_RID_CHARS = 8192

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # sglang.srt.constants.HEALTH_CHECK_RID_PREFIX
# Names SGLang's own start-up warm-up request (name_warmup), which must not leave a
# file and an index line in a user's dump directory at every start.
WARMUP_RID_PREFIX = "kimi-sglang-warmup-"


def is_internal(rid) -> bool:
    """SGLang's own requests are not dumped (the server's ``session``, the stand-in): health
    checks (``/health_generate``) and the start-up warm-up (``name_warmup``). A client rid
    with either prefix is not either."""
    return isinstance(rid, str) and rid.startswith((HEALTH_CHECK_RID_PREFIX, WARMUP_RID_PREFIX))


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
