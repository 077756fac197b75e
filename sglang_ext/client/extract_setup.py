"""What ``sglang-ext extract`` checks and opens before its first row is sent (``prepare``),
in this order: the flags' values, the paths they name (DATA, --dump-dir, --summary, --out),
the client's packages (aiohttp, tqdm), DATA's rows (counted), the server (``GET /health``,
then ``GET /server_info`` for its dump directory), --out (made, held for this rank, an
interrupted run's temporary files and leftovers swept, the pending-files journal), and with
--store the Mooncake Store. ``client.extract``'s module doc says why each is checked.

Every refusal is one sentence: ``BadInput`` (extract exits 2: nothing was sent) or
``CannotStart`` (exit 3: the server or the store does not answer, another run holds --out).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import re
import stat
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from sglang_ext import format as fmt
from sglang_ext.client import generation
from sglang_ext.client.dataset import DataError, count_rows, load_tokenizer
from sglang_ext.client.dumpdir import DumpDirs
from sglang_ext.client.files import (
    JournalRefused,
    RunLock,
    RunLockHeld,
    dir_mode,
    file_mode,
    kind_of,
    regular_or_why,
)
from sglang_ext.client.http import PROBE_TIMEOUT_S, endpoint_error, probe, server_dump_dir
from sglang_ext.client.manifest import MANIFEST_NAME, clean_tmp
from sglang_ext.client.pending import PendingFiles
from sglang_ext.client.report import report_sweep


class BadInput(Exception):
    """A flag, a path, DATA or --out the run cannot start with (one sentence; exit 2)."""


class CannotStart(Exception):
    """The server is not reachable or not SGLang, another run holds --out for this rank,
    or the store's master does not answer (one sentence; exit 3)."""


@dataclass
class Setup:
    """What the run starts with."""

    sampling: Optional[Dict[str, Any]]  # --generate's sampling_params, None without it
    roots: List[str]  # --image-root, normalised absolute paths on the server's filesystem
    mode: int  # of every file created in --out (KIMI_SGLANG_FILE_MODE, umask applied)
    dump: DumpDirs  # --dump-dir opened, or the server's adopted (more from its answers)
    tokenizer: Any  # --tokenizer loaded, or None
    n_rows: int  # DATA's rows, every rank's
    pending: Optional[PendingFiles] = None  # the journal of the server's files this rank owns
    store: Any = None  # with --store: the connected fetch.StoreFetcher


def prepare(args, opened: List[Any], locks: List[RunLock]) -> Setup:
    """Check and open what the run needs (``args``: extract's parsed flags). What is opened
    goes into ``opened`` (the dump directories, the store: each to ``close()``) and ``locks``
    (--out's run lock: to ``release()``) as soon as it is, for the caller to close whatever
    happens. Raises ``BadInput`` or ``CannotStart``; prints the server's and the sweep's
    notes on stderr."""
    sampling, roots = _check_flags(args)
    mode, dump = _open_paths(args, opened)
    tokenizer, n_rows = _check_data(args)
    _check_rid_prefix(args, n_rows)
    setup = Setup(sampling, roots, mode, dump, tokenizer, n_rows)
    _reach_server(args, dump)
    setup.pending = _open_out(args, setup, locks)
    setup.store = _connect_store(args, mode, opened)
    return setup


def _check_flags(args) -> Tuple[Optional[Dict[str, Any]], List[str]]:
    """The flags' own values: ``(--generate's sampling_params or None, the --image-root
    directories normalised)``."""
    if args.world_size < 1 or not 0 <= args.rank < args.world_size:
        raise BadInput("need --world-size >= 1 and 0 <= --rank < --world-size")
    if args.concurrency < 1 or args.max_retries < 0 or args.max_consecutive_failures < 1:
        raise BadInput("--concurrency and --max-consecutive-failures must be >= 1, --max-retries >= 0")
    for flag, value in (("--backoff", args.backoff), ("--max-backoff", args.max_backoff)):
        if not (math.isfinite(value) and value >= 0):
            raise BadInput(f"{flag} {value} must be a number of seconds >= 0")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise BadInput(f"--timeout {args.timeout} must be a positive number of seconds")
    bad_endpoint = endpoint_error(args.endpoint)
    if bad_endpoint:
        raise BadInput(bad_endpoint)
    if not (math.isfinite(args.store_timeout) and args.store_timeout > 0):
        raise BadInput(f"--store-timeout {args.store_timeout} must be a positive number of seconds")
    try:
        sampling = generation.sampling_params(args)
    except ValueError as e:
        raise BadInput(str(e)) from None
    if sampling is not None and args.store is not None:
        raise BadInput("--generate takes files from the dump directory; with --store it is not supported yet")
    if args.store is not None:
        from sglang_ext.store import StoreConfig

        try:
            StoreConfig.from_url(args.store)
        except ValueError as e:
            raise BadInput(f"--store: {e}") from None
    roots = []
    for root in args.image_root or []:
        if not os.path.isabs(root):
            raise BadInput(f"--image-root {root} must be an absolute path on the server's filesystem")
        roots.append(os.path.normpath("/" + root.lstrip("/")))
    return sampling, roots


def _open_paths(args, opened: List[Any]) -> Tuple[int, DumpDirs]:
    """DATA exists, KIMI_SGLANG_FILE_MODE, --dump-dir opened (into ``opened``), --summary
    writable, --out a directory if anything: ``(file mode, dump directories)``."""
    if not os.path.exists(args.data):
        raise BadInput(f"--data {args.data} does not exist")
    kind = os.stat(args.data).st_mode
    if not (stat.S_ISREG(kind) or stat.S_ISDIR(kind)):  # a pipe (<(...), /dev/stdin), a FIFO, a device
        raise BadInput(f"--data {args.data} is not a file ({kind_of(kind)}): extract reads DATA once to "
                       f"count its rows and again to send them, and a rerun reads it to resume; "
                       f"save it to a file first")
    try:
        mode = file_mode()
    except ValueError as e:
        raise BadInput(str(e)) from None
    for path in args.dump_dir or []:
        if not os.path.isdir(path):
            raise BadInput(f"--dump-dir {path} is not a directory (pass the server's "
                           f"--dump-hidden-states-dir as this machine sees it)")
    try:
        dump = DumpDirs(args.dump_dir or [])
    except OSError as e:
        raise BadInput(f"--dump-dir: cannot open {e.filename} ({e.strerror or e})") from None
    opened.append(dump)
    if args.summary is not None and os.path.isdir(args.summary):
        raise BadInput(f"--summary {args.summary} is a directory: name the JSON file to write")
    clash = _summary_clash(args.summary, args.out) if args.summary is not None else None
    if clash:
        raise BadInput(f"--summary {args.summary} {clash}: the summary would replace it; name another file")
    in_out = args.summary is not None and os.path.realpath(os.path.dirname(os.path.abspath(args.summary))) \
        == os.path.realpath(args.out)  # --out is made and checked later (_open_out)
    if args.summary is not None and not in_out:
        try:  # refused now, not after the whole dataset
            with tempfile.TemporaryFile(dir=os.path.dirname(os.path.abspath(args.summary)),
                                        prefix=".extract-summary-"):
                pass
        except OSError as e:
            raise BadInput(f"--summary {args.summary}: cannot write there ({e.strerror or e})") from None
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise BadInput(f"--out {args.out} exists and is not a directory")
    return mode, dump


SUMMARY_MAX_BYTES = 1 << 20  # a summary is a few KiB (at most 100 failed rows and files left named)
_OUT_NAMES = re.compile(r"hs_\d+\.safetensors|\.hs_.*|\.extract-.*|" + re.escape(MANIFEST_NAME))


def _summary_clash(summary: str, out: str) -> Optional[str]:
    """Why ``--summary`` must not be written at ``summary`` (None: it may): a file there
    that is not an earlier summary (DATA, a sample, a manifest: the summary's rename would
    replace it), or a name extract writes in ``out`` (a sample, the manifest, a journal)."""
    if os.path.realpath(os.path.dirname(os.path.abspath(summary))) == os.path.realpath(out) \
            and _OUT_NAMES.fullmatch(os.path.basename(summary)):
        return "is a name extract writes in --out"
    try:
        kind = regular_or_why(summary, follow_symlinks=True)
    except FileNotFoundError:
        return None
    if kind:
        return f"is not a regular file ({kind})"
    try:
        with open(summary, "rb") as f:
            earlier = json.loads(f.read(SUMMARY_MAX_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        earlier = None
    if not (isinstance(earlier, dict) and "rows_for_rank" in earlier and "out" in earlier):
        return "exists and is not an extract summary"
    return None


def _check_data(args) -> Tuple[Any, int]:
    """The client's packages, --tokenizer loaded, DATA's rows counted (not read yet):
    ``(tokenizer or None, rows)``."""
    missing = [m for m in ("aiohttp", "tqdm") if importlib.util.find_spec(m) is None]
    if missing:
        raise BadInput(f"extract needs {' and '.join(missing)}: pip install -e '.[client]' in a clone "
                       f"of kimi-sglang (else pip install {' '.join(missing)})")
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        n_rows = count_rows(args.data)
    except DataError as e:
        raise BadInput(str(e)) from None
    if n_rows == 0:
        raise BadInput(f"--data {args.data} has no rows; nothing to extract")
    return tokenizer, n_rows


def _check_rid_prefix(args, n_rows: int) -> None:
    """The longest rid the run sends, ``<--rid-prefix>-<row>-<try>-<8 hex digits>``
    (``runner.request_once``), within the server's bound (``format.MAX_RID_CHARS``): a
    longer one is refused by the server for every row alike."""
    longest = len(f"{args.rid_prefix}-{n_rows - 1}-{args.max_retries}-") + 8
    if longest > fmt.MAX_RID_CHARS:
        room = fmt.MAX_RID_CHARS - (longest - len(args.rid_prefix))
        raise BadInput(f"--rid-prefix is {len(args.rid_prefix)} characters long; this run's rids would "
                       f"have up to {longest}, the server refuses those over {fmt.MAX_RID_CHARS}: "
                       f"use at most {room}")


def _reach_server(args, dump: DumpDirs) -> None:
    """``GET /health`` once; without --dump-dir and --store, ``dump`` adopts the directory
    ``GET /server_info`` names (where requests not yet answered leave files)."""
    unreachable, note = asyncio.run(probe(args.endpoint, min(args.timeout, PROBE_TIMEOUT_S)))
    if unreachable:
        raise CannotStart(unreachable)
    if note:
        print(note, file=sys.stderr)
    if not args.dump_dir and args.store is None:
        server_dir, note = asyncio.run(server_dump_dir(args.endpoint, min(args.timeout, PROBE_TIMEOUT_S)))
        if note:
            print(note, file=sys.stderr)
        if server_dir:
            dump.adopt(server_dir)


def _open_out(args, setup: Setup, locks: List[RunLock]) -> PendingFiles:
    """Make --out, hold it for this rank (into ``locks``), remove an interrupted run's
    temporary files, check it can be written and its manifest is a regular file, open the
    pending-files journal and sweep an earlier run's leftovers."""
    try:
        os.makedirs(args.out, mode=dir_mode(setup.mode), exist_ok=True)
        locks.append(RunLock(args.out, args.rank, setup.mode).acquire())  # before touching what is there
        removed = clean_tmp(args.out)
        with tempfile.TemporaryFile(dir=args.out, prefix=".extract-probe-"):
            pass  # hs_<i>, the manifest and the journal are all written here
        manifest_kind = None
        try:
            manifest_kind = regular_or_why(os.path.join(args.out, MANIFEST_NAME))
        except FileNotFoundError:
            pass
        pending = PendingFiles(args.out, args.rank, setup.mode, store=args.store is not None)
        for d in setup.dump.dirs:
            pending.dump_dir(d.path)
    except RunLockHeld as e:
        raise CannotStart(str(e)) from None
    except JournalRefused as e:
        raise BadInput(str(e)) from None
    except OSError as e:
        raise BadInput(f"--out {args.out}: cannot write there ({e.strerror or e})") from None
    if manifest_kind:
        raise BadInput(f"--out {args.out}: {MANIFEST_NAME} is not a regular file ({manifest_kind}); "
                       f"remove it and run again")
    if removed:
        print(f"removed {removed} temporary file(s) of an interrupted run", file=sys.stderr)
    report_sweep(pending, forget_unanswered=True, of="an earlier run of this command")
    return pending


def _connect_store(args, mode: int, opened: List[Any]):
    """With --store: the connected ``fetch.StoreFetcher`` (into ``opened``), its journal
    read; else None. Without mooncake: ``BadInput``."""
    if args.store is None:
        return None
    from sglang_ext.client.fetch import MooncakeMissing, StoreFetcher, StoreUnreachable

    try:
        fetcher = StoreFetcher(args.store, args.out, args.rank, mode)
        opened.append(fetcher.connect())
    except MooncakeMissing as e:
        raise BadInput(str(e)) from None
    except StoreUnreachable as e:
        raise CannotStart(str(e)) from None
    except JournalRefused as e:
        raise BadInput(str(e)) from None
    except OSError as e:  # the journal: not a regular file, unreadable
        raise BadInput(f"--out {args.out}: cannot read the store journal ({e.strerror or e})") from None
    return fetcher
