"""``sglang-ext extract``: send a dataset to a dumping server, collect ``hs_<i>.safetensors``.

For every row ``i`` of DATA that belongs to this rank (``i % world_size == rank``) the
client POSTs ``/generate`` with the row's token ids, asking to be answered before the
write (``format.WAIT_PARAM``; ``--no-early-answers`` does not ask), waits until the file
named by ``meta_info.hidden_states_path`` is complete (its ``.lock`` released), checks it
and moves it to ``OUT/hs_<i>.safetensors``, the layout speculators' training reader loads.
One line per sample goes to ``OUT/manifest.jsonl``.

Guarantees:

- Start: one ``GET URL/health`` before any row is sent. Nothing answers: "cannot reach
  URL: is the server up?"; an answer that is not SGLang's (SGLang answers 200, or 503
  while starting): "URL is not an SGLang server", quoting at most a short brief of the
  answer. Either is one line and exit 3 at once.
- ``hs_<i>.safetensors`` only ever appears complete, checked and a regular file: the
  server's file is first moved to ``OUT/.hs_<i>.safetensors.tmp`` (``rename`` on the
  same filesystem, else a copy through a descriptor opened ``O_NOFOLLOW`` + unlink),
  checked there, then renamed onto the final name. Never a symlink kept as a result.
- The server's answer is not trusted: extract moves and deletes only regular files
  directly in the dump directory (``--dump-dir``, else the directory of the run's first
  answer, fixed for the run; held open, files taken by name relative to it), whose name
  is the server's name for that request (``<safe_stem(rid)>[-n].safetensors``), never
  through a symlink (``lstat``, ``O_NOFOLLOW``, ``fstat``). An answer naming anything
  else (a path outside, a symlink, a FIFO, another name) is that row's error and the
  named file is left alone. The journal (``sglang_ext.client.pending``) deletes only such files.
- Files extract creates (``hs_<i>``, the manifest, the journal, temporary files) get
  mode 0600, or ``KIMI_SGLANG_FILE_MODE`` (octal, e.g. ``0640``; the server reads the
  same variable), the umask applied; an invalid value is one sentence, exit 2.
- Resume: an index whose ``hs_<i>.safetensors`` is a regular file and passes the check
  is skipped (and gets a manifest line if a kill lost it); leftover ``.hs_*.tmp`` files
  are removed at start. A file that fails the check, or anything but a regular file at
  that name (a FIFO, a symlink: never opened), is extracted again and replaced atomically.
- Retries: a failed request (connection error, HTTP error, ``hidden_states_error``, a file
  that fails the check) is retried ``--max-retries`` times with exponential backoff
  (``--backoff * 2**(attempt-1)`` seconds, capped at ``--max-backoff``, with jitter). After
  ``--max-consecutive-failures`` samples in a row failed all their tries, the run aborts.
  HTTP 400 (the server refused the row) is not retried. An answer no retry can change
  (no ``hidden_states_path``: the server is not dumping; a dump directory this machine
  does not see; HTTP 404/405: not the server's base URL) aborts the run at once, the
  reason first on stderr.
- Leftovers: the server's files of requests this client never took (killed or
  interrupted runs, tries that timed out while the server still wrote) are journaled and
  removed from the dump directory by ``sglang_ext.client.pending`` (at start and at the end);
  files still being written are reported. Ctrl-C ends with one line (exit 130).

Rows are counted from 0 as in ``hs_<i>``; messages name them ``row i (line L of FILE)``.
Checks: always token ids equal the request's and ``hidden_states`` has one row per token
(read from the file's header with numpy, without torch); with ``--validate`` (needs torch)
also the whole file is loaded through ``sglang_ext.format.load`` and must be finite.
Exit codes: 0 all done, 1 some samples failed, 2 bad input, 3 aborted, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import importlib.util
import json
import math
import os
import random
import re
import stat
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple
from urllib.parse import urlsplit

from sglang_ext import format as fmt
from sglang_ext.client.pending import PendingFiles, server_name_ok, unlink_regular

MANIFEST_NAME = "manifest.jsonl"
_FINAL = re.compile(r"hs_(\d+)\.safetensors")
_TMP = re.compile(r"\.hs_\d+\.safetensors\.tmp(\.[0-9a-f]+)?")

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_ABORTED = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT


def final_name(index: int) -> str:
    return f"hs_{index}.safetensors"


# ---- data -----------------------------------------------------------------------------
class DataError(ValueError):
    """DATA cannot be read (bad row, messages without --tokenizer, ...)."""


@dataclass
class Row:
    index: int
    input_ids: List[int]


def _ids_from_row(row: Dict[str, Any], where: str, tokenizer) -> List[int]:
    if row.get("input_ids") is not None:
        ids = row["input_ids"]
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
        ):
            raise DataError(f"{where}: input_ids must be a list of non-negative integers")
    elif row.get("messages") is not None:
        if tokenizer is None:
            raise DataError(f"{where} has messages but no --tokenizer was given")
        try:
            text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        except Exception as e:  # noqa: BLE001 - no chat template, messages of the wrong shape
            raise DataError(f"{where}: --tokenizer cannot turn its messages into tokens "
                            f"({type(e).__name__}: {_one_line(e)})") from None
    else:
        raise DataError(f"{where} has neither input_ids nor messages")
    if not ids:
        raise DataError(f"{where} has no tokens")
    return ids


def load_dataset_dir(path: str):
    """The ``datasets.Dataset`` saved in directory ``path`` (``Dataset.save_to_disk``).

    Raises ``DataError`` (one sentence) when ``datasets`` is missing or ``path`` is not
    such a directory (a ``DatasetDict`` folder names its splits' folders)."""
    if not os.path.isfile(os.path.join(path, "state.json")):
        if os.path.isfile(os.path.join(path, "dataset_dict.json")):
            splits = sorted(n for n in os.listdir(path) if os.path.isdir(os.path.join(path, n)))
            raise DataError(f"--data {path} holds several splits (a DatasetDict): pass one of "
                            f"its folders, e.g. {os.path.join(path, splits[0] if splits else 'train')}")
        raise DataError(f"--data {path} is a directory but not a dataset saved by "
                        f"datasets' save_to_disk (no state.json in it); pass a JSONL file or "
                        f"such a directory")
    try:
        from datasets import load_from_disk
    except ImportError:
        raise DataError(f"--data {path} is a directory: reading it needs `pip install datasets`") from None
    try:
        return load_from_disk(path)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds for a damaged folder
        raise DataError(f"--data {path}: datasets cannot load it: {type(e).__name__}: {e}") from None


def _jsonl_lines(path: str) -> Iterator[Tuple[int, str]]:
    """``(line number from 1, text)`` of a UTF-8 file. Raises ``DataError`` naming the file,
    line and byte offset (from the file's start) of the first byte that is not UTF-8."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"--data {path} is not UTF-8 text: byte {offset + e.start} "
                                f"(line {lineno}) is 0x{raw[e.start]:02x}") from None
            offset += len(raw)
            yield lineno, text


def iter_rows(path: str, tokenizer=None) -> Iterator[Tuple[int, Dict[str, Any], str]]:
    """``(index, row, where)`` for every row of DATA, in order.

    DATA is a JSONL file (one JSON object per line; blank lines skipped and not counted)
    or a directory written by ``datasets.Dataset.save_to_disk`` (speculators'
    ``prepare-data`` output: columns ``input_ids``, ``loss_mask``, ...). ``index`` counts
    rows from 0 (row ``i`` becomes ``hs_<i>``); ``where`` names the row in messages the
    same way everywhere: ``row 3 (line 5 of data.jsonl)``, or ``row 3`` for a dataset.
    Raises ``DataError``.
    """
    if os.path.isdir(path):
        dataset = load_dataset_dir(path)
        for index in range(len(dataset)):
            yield index, dataset[index], f"row {index}"
        return
    index = 0
    name = os.path.basename(path)
    for lineno, line in _jsonl_lines(path):
        if not line.strip():
            continue
        where = f"row {index} (line {lineno} of {name})"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not JSON: {e}") from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: a row must be a JSON object")
        yield index, row, where
        index += 1


def count_rows(path: str) -> int:
    """Rows of DATA (blank JSONL lines not counted). Raises ``DataError`` (also for a
    file that is not UTF-8)."""
    if os.path.isdir(path):
        return len(load_dataset_dir(path))
    return sum(1 for _, line in _jsonl_lines(path) if line.strip())


def _one_line(e: BaseException, limit: int = 200) -> str:
    """An exception's message on one line, cut to ``limit`` characters."""
    line = " ".join(str(e).split())
    return line if len(line) <= limit else line[:limit] + "..."


def load_tokenizer(path: Optional[str]):
    """``transformers.AutoTokenizer`` from ``path`` (None for no path). Raises ``DataError``
    (one sentence naming the path) when transformers is not installed, ``path`` does not
    exist (and is no Hugging Face Hub id transformers can load) or holds no tokenizer."""
    if not path:
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(f"--tokenizer {path} needs transformers, which is not installed here "
                        f"(pip install transformers)") from None
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, ... here
        if not os.path.exists(path):
            raise DataError(f"--tokenizer {path} does not exist: pass the folder holding the "
                            f"tokenizer's files (e.g. the model's checkpoint folder)") from None
        raise DataError(f"--tokenizer {path}: transformers cannot load a tokenizer from it "
                        f"({type(e).__name__}: {_one_line(e)})") from None


def endpoint_error(url: str) -> Optional[str]:
    """Why ``--endpoint`` is not a usable base URL (one sentence), or None: it must be
    http(s), parse, name a host and, if it names a port, one in 1..65535."""
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
    return None


# ---- files ----------------------------------------------------------------------------
DEFAULT_FILE_MODE = fmt.DEFAULT_FILE_MODE


def file_mode() -> int:
    """The mode extract creates its files with: ``format.file_mode()`` (0600, or
    ``KIMI_SGLANG_FILE_MODE``, the same variable the server reads) with the umask applied,
    read once, at start-up, before any thread runs. Raises ``ValueError``, one sentence
    naming the variable."""
    mode = fmt.file_mode()
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


class CheckError(ValueError):
    """A hidden-state file does not match its request."""


class NotRegularError(CheckError):
    """A name holds something else than a regular file (a symlink, a FIFO, a directory)."""


def kind_of(mode: int) -> str:
    """What a non-regular ``st_mode`` is, in words (``a FIFO``): ``format.kind_of``."""
    return fmt.kind_of(mode, "not a regular file")


def open_regular(name: str, dir_fd: Optional[int] = None, shown: Optional[str] = None) -> int:
    """Open ``name`` read-only when it is a regular file; returns the descriptor.

    Never follows a symlink at the name (``O_NOFOLLOW``) and never blocks on a FIFO
    (``O_NONBLOCK``); the type is checked on the open descriptor (``fstat``), so what is
    checked is what is read. Raises ``NotRegularError`` naming ``shown`` (default
    ``name``) and what it is, ``FileNotFoundError`` when it is gone."""
    shown = shown or name
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotRegularError(f"{shown} is not a regular file (a symbolic link)") from None
        if e.errno in (errno.ENXIO, errno.EISDIR):
            raise NotRegularError(f"{shown} is not a regular file "
                                  f"({'a socket' if e.errno == errno.ENXIO else 'a directory'})") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularError(f"{shown} is not a regular file ({kind_of(st.st_mode)})")
    return fd


def regular_or_why(path: str) -> Optional[str]:
    """None when ``path`` is a regular file (not a symlink to one), else what it is, in
    words; FileNotFoundError when nothing is there. ``lstat`` only: never opens it."""
    mode = os.lstat(path).st_mode
    return None if stat.S_ISREG(mode) else kind_of(mode)


class DumpDir:
    """The server's dump directory as this machine sees it, pinned for the run.

    ``path`` as given (``--dump-dir``) or the directory of the run's first answer; ``fd``
    an open descriptor of it: every file is taken by its bare name relative to ``fd``
    (``rename``/``open``/``unlink`` ``*at``), so no symlink on the way redirects a move or
    a delete. An answer belongs to it when its directory is the same directory (device
    and inode) and its name is the server's name for the request (``server_name_of``)."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        st = os.fstat(self.fd)
        self.identity = (st.st_dev, st.st_ino)

    def close(self) -> None:
        os.close(self.fd)

    def server_name_of(self, rid: str, path: str) -> str:
        """The bare name of ``rid``'s file from the server's ``path``. Raises ``RequestError``
        (this row's error) when ``path`` is not in this directory or its name is not one
        the server gives ``rid`` (``<safe_stem(rid)>[-n].safetensors``)."""
        directory, name = os.path.split(path)
        try:
            st = os.stat(directory or ".")
            inside = (st.st_dev, st.st_ino) == self.identity
        except OSError:
            inside = False
        if not inside:
            raise RequestError(f"hidden_states_path {path} is not in the dump directory "
                               f"{self.path}: not taken")
        if not server_name_ok(rid, name):
            raise RequestError(f"hidden_states_path {path} is not the server's name for request "
                               f"{rid} ({fmt.safe_stem(rid)}[-n]{fmt.SUFFIX}): not taken")
        return name


def check_file(path: str, input_ids: List[int], full: bool) -> int:
    """Check a file against the request's token ids; returns its number of tokens.

    Cheap check (always, without torch): keys, ``token_ids == input_ids``,
    ``hidden_states`` is ``[len(input_ids), L, H]`` (shape from the header, tensor not
    loaded). ``full`` (needs torch): also load everything through ``format.load`` and
    require finite values (fp8 files: dequantized, so a NaN or infinite scale counts).
    Raises ``CheckError``.
    """
    from safetensors import safe_open

    try:
        with safe_open(path, framework="numpy") as f:
            keys = set(f.keys())
            missing = {fmt.KEY_HIDDEN_STATES, fmt.KEY_TOKEN_IDS} - keys
            if missing:
                raise CheckError(f"{path}: missing keys {sorted(missing)}")
            ids = f.get_tensor(fmt.KEY_TOKEN_IDS)
            shape = list(f.get_slice(fmt.KEY_HIDDEN_STATES).get_shape())
    except CheckError:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise CheckError(f"{path}: unreadable: {e}") from None
    if ids.tolist() != list(input_ids):
        raise CheckError(f"{path}: token ids differ from the request's")
    if len(shape) != 3 or shape[0] != len(input_ids):
        raise CheckError(f"{path}: hidden_states shape {shape} for {len(input_ids)} tokens")
    if full:
        import torch

        try:
            record = fmt.load(path, dequantize=True)  # fp8 files: values = fp8 * scale
        except Exception as e:  # noqa: BLE001
            raise CheckError(f"{path}: {e}") from None
        if not bool(torch.isfinite(record.hidden_states).all()):
            raise CheckError(f"{path}: hidden_states hold non-finite values")
    return len(input_ids)


def _copy_fd(src_fd: int, out_fd: int, tmp_name: str, mode: int) -> None:
    """Copy an open file into a new ``tmp_name`` in ``out_fd``'s directory (created
    ``O_EXCL|O_NOFOLLOW`` with ``mode``), flushed to disk."""
    dst = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                  mode, dir_fd=out_fd)
    try:
        offset = 0
        while True:
            chunk = os.pread(src_fd, 1 << 20, offset)
            if not chunk:
                break
            view = memoryview(chunk)
            while view:
                view = view[os.write(dst, view):]
            offset += len(chunk)
        os.fsync(dst)
    finally:
        os.close(dst)


def move_into_place(dump: DumpDir, name: str, out_dir: str, index: int, input_ids: List[int],
                    full: bool, mode: int = DEFAULT_FILE_MODE) -> int:
    """Move the server's file ``name`` (in ``dump``) to ``out_dir/hs_<index>.safetensors``;
    returns its size.

    Only a regular file is taken (a symlink, FIFO, ... raises ``NotRegularError`` and is
    left where it is). It goes to a temporary name in ``out_dir`` first (rename, or across
    filesystems a copy through a descriptor opened ``O_NOFOLLOW`` and then the unlink of
    that same file), is made a regular file of this user with ``mode`` (copied when another
    name links it or another user owns it), is checked there,
    and only then renamed onto the final name: the final name never holds a partial,
    unchecked or linked file. On a failed check the temporary file is removed and
    ``CheckError`` raised.
    """
    shown = os.path.join(dump.path, name)
    tmp = f".{final_name(index)}.tmp.{uuid.uuid4().hex[:8]}"
    out_fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st_mode = os.stat(name, dir_fd=dump.fd, follow_symlinks=False).st_mode
        if not stat.S_ISREG(st_mode):
            raise NotRegularError(f"the server's file {shown} is not a regular file "
                                  f"({kind_of(st_mode)}): left where it is")
        try:
            os.rename(name, tmp, src_dir_fd=dump.fd, dst_dir_fd=out_fd)
            moved = True
        except OSError as e:
            if e.errno != errno.EXDEV:  # another filesystem
                raise
            moved = False
        if moved:
            # What was renamed is checked in OUT, where nobody else swaps it any more.
            fd = open_regular(tmp, out_fd, shown=f"the server's file {shown}")
            try:
                st = os.fstat(fd)
                if st.st_nlink != 1 or st.st_uid != os.geteuid():
                    # Another name links it (a hard link elsewhere) or another user owns it:
                    # whoever holds that could change it after the check, and a chmod would
                    # reach through the link. Keep a copy of our own instead.
                    kept = f".{final_name(index)}.tmp.{uuid.uuid4().hex[:8]}"  # clean_tmp's pattern
                    _copy_fd(fd, out_fd, kept, mode)
                    os.unlink(tmp, dir_fd=out_fd)
                    tmp = kept
                else:
                    os.fchmod(fd, mode)
            finally:
                os.close(fd)
        else:
            fd = open_regular(name, dump.fd, shown=f"the server's file {shown}")
            try:
                _copy_fd(fd, out_fd, tmp, mode)
                st = os.fstat(fd)
                now = os.stat(name, dir_fd=dump.fd, follow_symlinks=False)
                if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):  # the file copied, not a swap
                    os.unlink(name, dir_fd=dump.fd)
            finally:
                os.close(fd)
        tmp_path = os.path.join(out_dir, tmp)
        check_file(tmp_path, input_ids, full)
        size = os.stat(tmp, dir_fd=out_fd, follow_symlinks=False).st_size
        os.rename(tmp, final_name(index), src_dir_fd=out_fd, dst_dir_fd=out_fd)
    except BaseException:
        unlink_regular(out_fd, tmp) or _unlink_quiet(out_fd, tmp)
        os.close(out_fd)
        raise
    os.close(out_fd)
    return size


def _unlink_quiet(dir_fd: int, name: str) -> bool:
    """Remove our own temporary name whatever it holds (a swapped-in link or FIFO that was
    moved into OUT: the entry goes, never what it points to)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        return False


def clean_tmp(out_dir: str) -> int:
    """Remove ``.hs_<i>.safetensors.tmp*`` left by a killed run; returns how many."""
    n = 0
    for name in os.listdir(out_dir):
        if _TMP.fullmatch(name):
            try:
                os.unlink(os.path.join(out_dir, name))
                n += 1
            except FileNotFoundError:
                pass
    return n


def existing_indices(out_dir: str) -> set:
    return {int(m.group(1)) for m in map(_FINAL.fullmatch, os.listdir(out_dir)) if m}


def read_manifest(out_dir: str) -> Dict[int, Dict[str, Any]]:
    """``index -> last record`` of ``manifest.jsonl`` (a torn last line is ignored)."""
    path = os.path.join(out_dir, MANIFEST_NAME)
    records: Dict[int, Dict[str, Any]] = {}
    if not os.path.exists(path):
        return records
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("index"), int):
                records[rec["index"]] = rec
    return records


def append_manifest(out_dir: str, record: Dict[str, Any], mode: int = DEFAULT_FILE_MODE) -> None:
    """One ``write`` with ``O_APPEND``: lines from concurrent writers never interleave.
    A new manifest is created with ``mode`` (umask applied)."""
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode("utf-8")
    fd = os.open(os.path.join(out_dir, MANIFEST_NAME),
                 os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


# ---- requests -------------------------------------------------------------------------
class RequestError(RuntimeError):
    """One try failed (HTTP, connection, server-side dump error, bad file)."""


class RowError(RequestError):
    """The server refused this row itself (HTTP 400): trying it again cannot succeed."""


class FatalError(RequestError):
    """An answer no retry can change (the server is not dumping, its dump directory is not
    visible here, the endpoint has no /generate): the run stops at once."""


@dataclass
class Options:
    endpoint: str
    out_dir: str
    concurrency: int = 32
    max_retries: int = 5
    backoff: float = 1.0
    max_backoff: float = 30.0
    max_consecutive_failures: int = 32
    timeout: float = 600.0
    validate: bool = False
    rid_prefix: str = "extract"
    early_answers: bool = True
    dump: Optional[DumpDir] = None  # --dump-dir, else the first answer's directory (set then)
    file_mode: int = DEFAULT_FILE_MODE  # of every file created in out_dir (umask applied)


@dataclass
class Stats:
    total: int = 0
    done: int = 0
    resumed: int = 0
    failed: int = 0
    retries: int = 0
    tokens: int = 0
    bytes: int = 0
    failed_indices: List[int] = field(default_factory=list)
    aborted: Optional[str] = None


def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """Seconds before retry ``attempt`` (1, 2, ...): ``base * 2**(attempt-1)``, capped,
    with up to 25% random jitter so that many workers do not retry in lockstep."""
    delay = min(cap, base * (2 ** (attempt - 1)))
    return delay * (1 + random.random() * 0.25)


BRIEF_CHARS = 200  # an answer's body quoted in a message: whitespace runs joined, then cut


def _brief(text: str) -> str:
    """``text`` on one line (whitespace runs -> one space), cut to ``BRIEF_CHARS`` with
    ``...``: an HTML error page must not flood stderr once per retry."""
    flat = " ".join(text.split())
    return flat if len(flat) <= BRIEF_CHARS else flat[:BRIEF_CHARS] + "..."


PROBE_TIMEOUT_S = 30.0  # at most: a server that has not answered GET /health by then is not up


async def probe(endpoint: str, timeout: float) -> Tuple[Optional[str], Optional[str]]:
    """One ``GET <endpoint>/health`` before any row is sent: ``(error, note)``, each one
    sentence or None.

    error: nothing answers (refused, no route, no answer within ``timeout``): "cannot
    reach URL: is the server up?"; something answers but not as SGLang does (SGLang's
    ``/health`` answers 200, or 503 while it starts or is unhealthy): "URL is not an SGLang
    server", quoting a short brief of the answer (``_brief``). note: the 503 case, where
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
        return f"cannot reach {endpoint}: is the server up? ({type(e).__name__}: {_one_line(e)})", None
    if status == 200:
        return None, None
    if status == 503:
        return None, (f"note: GET {url} answered HTTP 503: the server is starting or unhealthy; "
                      f"sending rows anyway")
    return (f"{endpoint} is not an SGLang server: GET {url} answered HTTP {status} "
            f"({_brief(body) or 'empty body'}); pass the base URL of SGLang's server, e.g. "
            f"http://127.0.0.1:30000"), None


async def request_once(session, opts: Options, row: Row, attempt: int,
                       http_slots: asyncio.Semaphore, pending: PendingFiles) -> Tuple[str, str]:
    """POST /generate for one row; returns ``(rid, the server's complete file path)``.

    ``http_slots`` bounds the requests in flight (``--concurrency``); the wait for a slot
    is outside ``--timeout``, which bounds the HTTP request and then, separately, the
    wait for the file's lock. ``pending`` journals the request until its file is taken.
    Raises ``RequestError`` (``RowError``, ``FatalError`` when retrying cannot help)."""
    import aiohttp

    sampling = {"max_new_tokens": 1, "temperature": 0}
    if opts.early_answers:
        # Answer once the file's name is reserved (format.WAIT_PARAM); the wait below
        # covers the write, so this worker's HTTP slot is free for the next prompt.
        sampling["custom_params"] = {fmt.WAIT_PARAM: False}
    payload = {
        "input_ids": row.input_ids,
        "sampling_params": sampling,
        "rid": f"{opts.rid_prefix}-{row.index}-{attempt}-{uuid.uuid4().hex[:8]}",
    }
    rid = payload["rid"]
    url = opts.endpoint.rstrip("/") + "/generate"
    async with http_slots:
        pending.sent(rid)
        try:
            async with session.post(url, json=payload) as resp:
                body = await resp.read()
                text = body.decode("utf-8", errors="replace")
                brief = _brief(text)
                if resp.status in (404, 405):
                    raise FatalError(f"POST {url} answered HTTP {resp.status}: --endpoint must be "
                                     f"the server's base URL (e.g. http://127.0.0.1:30000)")
                if resp.status == 400:
                    raise RowError(f"the server refused the row (HTTP 400): {brief}")
                if resp.status != 200:
                    raise RequestError(f"HTTP {resp.status}: {brief}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise RequestError(f"{type(e).__name__}: {e}") from None
    try:
        meta = json.loads(text)["meta_info"]
    except (ValueError, KeyError, TypeError):
        raise RequestError(f"response without meta_info: {_brief(text)}") from None
    if not isinstance(meta, dict):
        raise RequestError(f"meta_info is not an object: {_brief(text)}")
    if meta.get(fmt.ERROR_KEY):
        raise RequestError(f"{fmt.ERROR_KEY}: {meta[fmt.ERROR_KEY]}")
    path = meta.get(fmt.PATH_KEY)
    if path is not None and (not isinstance(path, str) or not path):
        raise RequestError(f"hidden_states_path is not a file path: {_brief(text)}")
    if path is None:
        raise FatalError(f"the server at {opts.endpoint} is not dumping hidden states: its "
                         f"answer has no meta_info.hidden_states_path (start it with "
                         f"--dump-hidden-states-dir DIR); answer: {_brief(text)}")
    if opts.dump is None:  # no --dump-dir: the first answer's directory, fixed for the run
        directory = os.path.dirname(path)
        if not os.path.isdir(directory):
            raise FatalError(f"the server writes to {directory}, which does not exist "
                             f"on this machine: run extract where the server's "
                             f"--dump-hidden-states-dir is visible under the same path")
        opts.dump = DumpDir(directory)
        pending.dump_dir(opts.dump.path)
    dump = opts.dump
    name = dump.server_name_of(rid, path)  # else this row's error: nothing is touched
    local = os.path.join(dump.path, name)
    pending.named(rid, local)
    for suffix in (fmt.LOCK_SUFFIX, fmt.ERROR_SUFFIX):  # a FIFO there would block the wait
        try:
            mode = os.stat(name + suffix, dir_fd=dump.fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(mode):
            raise RequestError(f"{local}{suffix} is not a regular file ({kind_of(mode)}): "
                               f"not waited on")
    # Complete once <path>.lock is gone (at once from a server that waited itself).
    error = await fmt.wait_complete_async(local, timeout=opts.timeout)
    if error is not None:
        # The message is in hand and the row is tried again under a new rid: remove the
        # server's <path>.error so failed tries do not pile up in the dump directory.
        try:
            unlink_regular(dump.fd, name + fmt.ERROR_SUFFIX)
        except OSError:
            pass
        if not fmt.lexists_at(dump.fd, name):
            pending.settled(rid)
        raise RequestError(error)
    return rid, name


async def extract_one(session, opts: Options, row: Row, stats: Stats,
                      http_slots: asyncio.Semaphore, pending: PendingFiles,
                      abort: asyncio.Event) -> Optional[Dict[str, Any]]:
    """All tries for one row; returns its manifest record, ``None`` if the run was aborted
    meanwhile, or raises the last error (``FatalError`` / ``RowError`` at once)."""
    last: Optional[Exception] = None
    for attempt in range(opts.max_retries + 1):
        if attempt:
            stats.retries += 1
            await asyncio.sleep(backoff_delay(attempt, opts.backoff, opts.max_backoff))
        if abort.is_set():
            return None
        try:
            rid, name = await request_once(session, opts, row, attempt, http_slots, pending)
            try:
                size = await asyncio.to_thread(
                    move_into_place, opts.dump, name, opts.out_dir, row.index, row.input_ids,
                    opts.validate, opts.file_mode,
                )
            finally:
                if not fmt.lexists_at(opts.dump.fd, name):
                    pending.settled(rid)
            return {
                "index": row.index,
                "num_tokens": len(row.input_ids),
                "source": os.path.join(opts.dump.path, name),
                "file": final_name(row.index),
                "bytes": size,
            }
        except FatalError:
            raise
        except RowError as e:
            raise RowError(f"row {row.index}: {e}") from None
        except (RequestError, CheckError, OSError) as e:
            last = e
            if abort.is_set():
                return None
            if attempt < opts.max_retries:  # the last try's error is reported by the caller
                print(f"row {row.index}: try {attempt + 1} failed, retrying: {e}", file=sys.stderr)
    raise RequestError(f"row {row.index}: {opts.max_retries + 1} tries failed; last: {last}")


# ---- the run --------------------------------------------------------------------------
def _progress(total: int, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="sample", dynamic_ncols=True, disable=disable,
                file=sys.stderr, smoothing=0.1)


async def run(args, opts: Options, rows: Iterator[Row], total: int, stats: Stats,
              pending: PendingFiles) -> None:
    import aiohttp

    stats.total = total
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * opts.concurrency)
    abort = asyncio.Event()
    consecutive = 0
    manifest = read_manifest(opts.out_dir)
    start = time.monotonic()
    bar = _progress(total, args.no_progress)

    def tick():
        elapsed = max(time.monotonic() - start, 1e-9)
        bar.set_postfix_str(
            f"{stats.tokens / elapsed:,.0f} tok/s, {stats.bytes / 1e9:.2f} GB, "
            f"{stats.failed} failed", refresh=False)
        bar.update(1)

    async def worker(session):
        nonlocal consecutive
        while True:
            row = await queue.get()
            try:
                if row is None:
                    return
                if abort.is_set():
                    continue
                target = os.path.join(opts.out_dir, final_name(row.index))
                try:
                    not_regular = regular_or_why(target)
                except FileNotFoundError:
                    not_regular = exists = None
                else:
                    exists = True
                if not_regular:  # a FIFO, a symlink, ...: never opened, replaced atomically
                    print(f"re-extracting {final_name(row.index)}: it is not a regular file "
                          f"({not_regular})", file=sys.stderr)
                elif exists:
                    try:
                        n = await asyncio.to_thread(check_file, target, row.input_ids, opts.validate)
                    except CheckError as e:
                        print(f"re-extracting {final_name(row.index)}: {e}", file=sys.stderr)
                    else:
                        stats.resumed += 1
                        if row.index not in manifest:
                            rec = {"index": row.index, "num_tokens": n, "source": None,
                                   "file": final_name(row.index),
                                   "bytes": os.stat(target).st_size}
                            append_manifest(opts.out_dir, rec, opts.file_mode)
                            manifest[row.index] = rec
                        tick()
                        continue
                try:
                    rec = await extract_one(session, opts, row, stats, http_slots, pending, abort)
                except FatalError as e:
                    if not abort.is_set():
                        stats.aborted = f"row {row.index}: {e}"
                        print(f"error: {stats.aborted}", file=sys.stderr)
                        abort.set()
                    continue
                except Exception as e:  # noqa: BLE001 - a worker must never die: the run would hang
                    if not isinstance(e, RequestError):
                        e = RequestError(f"row {row.index}: {type(e).__name__}: {e}")
                    stats.failed += 1
                    stats.failed_indices.append(row.index)
                    consecutive += 1
                    print(str(e), file=sys.stderr)
                    if consecutive >= opts.max_consecutive_failures and not abort.is_set():
                        stats.aborted = (f"{consecutive} consecutive samples failed "
                                         f"(--max-consecutive-failures); last: {e}")
                        print(f"error: {stats.aborted}", file=sys.stderr)
                        abort.set()
                else:
                    if rec is None:  # aborted while it was being tried
                        continue
                    consecutive = 0
                    append_manifest(opts.out_dir, rec, opts.file_mode)
                    manifest[row.index] = rec
                    stats.done += 1
                    stats.tokens += rec["num_tokens"]
                    stats.bytes += rec["bytes"]
                tick()
            finally:
                queue.task_done()

    timeout = aiohttp.ClientTimeout(total=opts.timeout)
    # Twice as many workers as HTTP requests in flight: while one waits for its file
    # (answered early, see request_once) another's prompt is already prefilling.
    n_workers = 2 * opts.concurrency if opts.early_answers else opts.concurrency
    http_slots = asyncio.Semaphore(opts.concurrency)
    connector = aiohttp.TCPConnector(limit=n_workers)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        workers = [asyncio.create_task(worker(session)) for _ in range(n_workers)]
        try:
            for row in rows:
                if abort.is_set():
                    break
                await queue.put(row)
            for _ in workers:
                await queue.put(None)
            await asyncio.gather(*workers)
        except BaseException:  # Ctrl-C (cancelled) or bad DATA: stop the workers now
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            raise
        finally:
            bar.close()


def rank_rows(data: str, tokenizer, world_size: int, rank: int) -> Iterator[Row]:
    for index, row, where in iter_rows(data, tokenizer):
        if index % world_size == rank:
            yield Row(index=index, input_ids=_ids_from_row(row, where, tokenizer))


def main(args) -> int:
    """``sglang-ext extract``: the exit codes of the module doc."""
    held: List[Options] = []  # whose dump directory (if any) is closed at the end
    try:
        return _main(args, held)
    finally:
        for opts in held:
            if opts.dump is not None:
                opts.dump.close()


def _main(args, held: List["Options"]) -> int:
    if args.world_size < 1 or not 0 <= args.rank < args.world_size:
        print("error: need --world-size >= 1 and 0 <= --rank < --world-size", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.concurrency < 1 or args.max_retries < 0 or args.max_consecutive_failures < 1:
        print("error: --concurrency and --max-consecutive-failures must be >= 1, "
              "--max-retries >= 0", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        print(f"error: --timeout {args.timeout} must be a positive number of seconds",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    bad_endpoint = endpoint_error(args.endpoint)
    if bad_endpoint:
        print(f"error: {bad_endpoint}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not os.path.exists(args.data):
        print(f"error: --data {args.data} does not exist", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        mode = file_mode()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    dump = None
    if args.dump_dir is not None:
        try:
            dump = DumpDir(args.dump_dir)
            held.append(Options(endpoint=args.endpoint, out_dir=args.out, dump=dump))
        except OSError:
            print(f"error: --dump-dir {args.dump_dir} is not a directory (pass the server's "
                  f"--dump-hidden-states-dir as this machine sees it)", file=sys.stderr)
            return EXIT_BAD_INPUT
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        print(f"error: --out {args.out} exists and is not a directory", file=sys.stderr)
        return EXIT_BAD_INPUT
    missing = [m for m in ("aiohttp", "tqdm") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"error: extract needs {' and '.join(missing)} (pip install {' '.join(missing)})",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.validate:
        try:
            import torch  # noqa: F401 - format.load, behind --validate, needs it
        except ImportError:
            print("error: --validate loads every file with torch, which is not installed "
                  "here (pip install torch), or leave --validate out", file=sys.stderr)
            return EXIT_BAD_INPUT
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        n_rows = count_rows(args.data)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if n_rows == 0:
        print(f"error: --data {args.data} has no rows; nothing to extract", file=sys.stderr)
        return EXIT_BAD_INPUT
    unreachable, note = asyncio.run(probe(args.endpoint, min(args.timeout, PROBE_TIMEOUT_S)))
    if unreachable:
        print(f"error: {unreachable}", file=sys.stderr)
        return EXIT_ABORTED
    if note:
        print(note, file=sys.stderr)
    try:
        os.makedirs(args.out, exist_ok=True)
        removed = clean_tmp(args.out)
        with tempfile.TemporaryFile(dir=args.out, prefix=".extract-probe-"):
            pass  # hs_<i>, the manifest and the journal are all written here
        manifest_kind = None
        try:
            manifest_kind = regular_or_why(os.path.join(args.out, MANIFEST_NAME))
        except FileNotFoundError:
            pass
        pending = PendingFiles(args.out, args.rank, mode)
        if dump is not None:
            pending.dump_dir(dump.path)
    except OSError as e:
        print(f"error: --out {args.out}: cannot write there ({e.strerror or e})", file=sys.stderr)
        return EXIT_BAD_INPUT
    if manifest_kind:
        print(f"error: --out {args.out}: {MANIFEST_NAME} is not a regular file ({manifest_kind}); "
              f"remove it and run again", file=sys.stderr)
        return EXIT_BAD_INPUT
    if removed:
        print(f"removed {removed} temporary file(s) of an interrupted run", file=sys.stderr)
    _report_sweep(pending, forget_unanswered=True, when="an earlier run of this command left")
    opts = Options(
        endpoint=args.endpoint, out_dir=args.out, concurrency=args.concurrency,
        max_retries=args.max_retries, backoff=args.backoff, max_backoff=args.max_backoff,
        max_consecutive_failures=args.max_consecutive_failures, timeout=args.timeout,
        validate=args.validate, rid_prefix=args.rid_prefix, early_answers=not args.no_early_answers,
        dump=dump, file_mode=mode,
    )
    held[:] = [opts]
    stats = Stats()
    total = len(range(args.rank, n_rows, args.world_size))
    rows = rank_rows(args.data, tokenizer, args.world_size, args.rank)
    t0 = time.monotonic()
    try:
        asyncio.run(run(args, opts, rows, total, stats, pending))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        _report_sweep(pending, forget_unanswered=False, when="stopped tries left")
        if stats.done:
            print(f"extract: stopped at that row; the {stats.done} sample(s) extracted before it "
                  f"are kept in {args.out}: fix the row and run the same command again to resume",
                  file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        left = _report_sweep(pending, forget_unanswered=False, when="interrupted tries left")
        print(f"extract: interrupted: {stats.done} sample(s) extracted in this run, "
              f"{stats.done + stats.resumed} of {total} done for rank {args.rank}; run the same "
              f"command again to resume" + (f" (it also removes the {len(left)} file(s) the "
                                            f"server is still writing)" if left else ""),
              file=sys.stderr)
        return EXIT_INTERRUPTED
    elapsed = time.monotonic() - t0
    left = _report_sweep(pending, forget_unanswered=False, when="timed-out tries left")
    summary = {
        "rank": args.rank, "world_size": args.world_size, "rows_for_rank": stats.total,
        "extracted": stats.done, "resumed": stats.resumed, "failed": stats.failed,
        "retries": stats.retries, "tokens": stats.tokens, "gb_written": round(stats.bytes / 1e9, 3),
        "seconds": round(elapsed, 1), "tokens_per_s": round(stats.tokens / elapsed, 1) if elapsed else 0,
        "out": os.path.abspath(args.out),
    }
    if stats.failed_indices:
        summary["failed_indices"] = sorted(stats.failed_indices)[:100]
    if left:
        summary["server_files_left"] = left[:100]
    if stats.aborted:
        summary["aborted"] = stats.aborted
    print("extract summary: " + json.dumps(summary))
    if stats.aborted:
        return EXIT_ABORTED
    return EXIT_FAILED if stats.failed else EXIT_OK


def _report_sweep(pending: PendingFiles, forget_unanswered: bool, when: str) -> List[str]:
    """Sweep the server files this rank's requests left (see ``sglang_ext.client.pending``); say
    what was removed and what is still being written. Returns the latter."""
    removed, busy = pending.sweep(forget_unanswered)
    if removed:
        print(f"removed {removed} file(s) {when} in the server's dump directory "
              f"({', '.join(pending.dump_dirs)})", file=sys.stderr)
    if busy:
        print(f"{len(busy)} file(s) {when} are still being written by the server (e.g. "
              f"{busy[0]}); the next run of this command removes them", file=sys.stderr)
    return busy


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except where there is none to show (required flags, None)."""

    def _get_help_string(self, action):
        if action.required or action.default is None:
            return action.help
        return super()._get_help_string(action)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "extract",
        help="send a dataset to a dumping server; collect hs_<i>.safetensors",
        description=__doc__.split("\n\n")[0],
        formatter_class=_DefaultsHelp,
    )
    p.add_argument("--endpoint", required=True,
                   help="server base URL, e.g. http://127.0.0.1:30000; probed once with GET "
                        "/health before any row: unreachable or not SGLang is one line, exit 3")
    p.add_argument("--data", required=True,
                   help="JSONL with input_ids (or messages + --tokenizer), or a "
                        "datasets.save_to_disk directory (speculators prepare-data output)")
    p.add_argument("--out", required=True,
                   help="output directory (hs_<i>.safetensors, manifest.jsonl), files created "
                        "with mode 0600 or env KIMI_SGLANG_FILE_MODE (octal, e.g. 0640), the "
                        "umask applied; results are always regular files")
    p.add_argument("--dump-dir", default=None,
                   help="the server's --dump-hidden-states-dir as this machine sees it: extract "
                        "moves and deletes only regular files directly in it that carry the "
                        "server's name for the request; an answer naming anything else fails "
                        "its row (default: the directory of the first answer, fixed for the run)")
    p.add_argument("--tokenizer", default=None, help="tokenizer path for rows with messages (apply_chat_template)")
    p.add_argument("--concurrency", type=int, default=32,
                   help="HTTP requests in flight; up to as many more files may be waited on "
                        "while the server writes them")
    p.add_argument("--max-retries", type=int, default=5, help="retries per sample after its first try")
    p.add_argument("--backoff", type=float, default=1.0, help="first retry delay (s); doubles per retry")
    p.add_argument("--max-backoff", type=float, default=30.0, help="retry delay cap (s)")
    p.add_argument("--max-consecutive-failures", type=int, default=32,
                   help="abort after this many samples in a row failed all their tries")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="per try (s, finite, > 0): bounds the HTTP request, then separately the wait for the "
                        "file's lock")
    p.add_argument("--world-size", type=int, default=1, help="number of extract processes sharing DATA")
    p.add_argument("--rank", type=int, default=0, help="this process: rows with index %% world_size == rank")
    p.add_argument("--validate", action="store_true",
                   help="also load every file fully and require finite hidden states")
    p.add_argument("--rid-prefix", default="extract", help="prefix of the request ids sent")
    p.add_argument("--no-early-answers", action="store_true",
                   help="let the server answer only once each file is complete (needed where "
                        "this host does not share the dump directory's file locks with the "
                        "server, e.g. NFS without locking); by default the server answers when "
                        "the name is reserved and this client waits on <path>.lock")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=main)


def cli(argv: Optional[List[str]] = None) -> int:
    """The ``sglang-ext-extract`` console script (same as ``sglang-ext extract``)."""
    from sglang_ext.__main__ import main as ext_main

    return ext_main(["extract", *(sys.argv[1:] if argv is None else argv)])
