"""The run: rows go through a queue to asyncio workers, each row tried until its file is
``OUT/hs_<i>.safetensors`` (``extract_one``), with retries, resume and the abort rules of
``extract``'s doc. ``run`` needs aiohttp and tqdm (``extract`` checks both first). An
answer that names a file is taken from the dump directory (``dumpdir``); one that carries
a store manifest is taken from the Mooncake Store (``fetch``, imported only with
``--store``; ``store_rows`` takes its samples)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import sys
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

from sglang_ext import format as fmt
from sglang_ext.client import generation
from sglang_ext.client.checks import CheckError, check_file, sample_layout
from sglang_ext.client.dataset import Row
from sglang_ext.client.dumpdir import DumpDir, DumpDirs, move_into_place
from sglang_ext.client.files import unlink_regular
from sglang_ext.client.http import (
    MANIFEST_KEY,
    Answer,
    FatalError,
    RequestError,
    RowError,
    UsageError,
    backoff_delay,
    chat_completion,
    generate,
)
from sglang_ext.client.images import chat_body
from sglang_ext.client.manifest import Manifest, existing, final_name, record
from sglang_ext.client.pending import PendingFiles
from sglang_ext.client.progress import STORE

if TYPE_CHECKING:
    from sglang_ext.client.fetch import StoreFetcher
    from sglang_ext.client.progress import Progress



@dataclass
class Options:
    """The run's settings (``extract``'s flags; ``file_mode`` already has the umask applied)."""

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
    dump: DumpDirs = field(default_factory=lambda: DumpDirs([]))  # --dump-dir (repeatable), else adopted
    file_mode: int = fmt.DEFAULT_FILE_MODE  # of every file created in out_dir (umask applied)
    store: Optional["StoreFetcher"] = None  # --store: the connected reader
    store_timeout: float = 120.0  # --store-timeout: seconds to wait for an answer's object
    generate: Optional[Dict[str, Any]] = None  # --generate: the sampling_params sent (generation)
    decode: Optional[Callable[[List[int]], str]] = None  # --generate with --tokenizer: the text


@dataclass
class Stats:
    """What the run did, for ``extract``'s summary line (bytes: of the files in OUT)."""

    total: int = 0
    done: int = 0
    resumed: int = 0
    failed: int = 0
    retries: int = 0
    tokens: int = 0
    bytes: int = 0
    failed_indices: List[int] = field(default_factory=list)
    # rows whose file this run put into OUT (``put_in_out``), counted in the thread that
    # did it: a file put there after Ctrl-C cancelled its row's await still counts
    taken: Set[int] = field(default_factory=set)
    # what only the run knows of a row's manifest line (source, a chat row's images and
    # request_sha256) while its file is being taken; the line after Ctrl-C cancelled the
    # row (manifest.add_missing_lines)
    sources: Dict[int, Dict[str, Any]] = field(default_factory=dict)
    aborted: Optional[str] = None
    bad_input: bool = False  # the abort is the command line's (UsageError): exit 2


OUT_FULL = (errno.ENOSPC, errno.EDQUOT)  # no space (or quota) left where OUT is
NOT_ALLOWED = (errno.EACCES, errno.EPERM)  # this user may not take the server's files (or write OUT)


def out_full(e: OSError, out_dir: str) -> str:
    """The sentence that stops a run whose OUT is full (``e``: ENOSPC or EDQUOT)."""
    return (f"{e.filename or out_dir}: {e.strerror}: no sample can be written; free space "
            f"there (or fix the directory) and run the same command again to resume")


def not_allowed(e: OSError) -> str:
    """The sentence that stops a run refused a server's file, its dump directory or OUT
    (``e``: EACCES or EPERM): every next try would be refused alike."""
    return (f"{e}: extract must read the server's files, move them out of its dump directory "
            f"and write --out, so every try would fail alike; run it as the user the server "
            f"runs as (a container's server runs as root)")


def put_in_out(taken: Set[int], index: int, fn, *args):
    """``fn(*args)``, which puts row ``index``'s file into OUT (``move_into_place``,
    ``StoreFetcher.take``), then ``index`` added to ``taken``; run in a worker thread."""
    result = fn(*args)
    taken.add(index)
    return result


async def request_once(session, opts: Options, row: Row, attempt: int,
                       http_slots: asyncio.Semaphore, pending: PendingFiles) -> Tuple[str, Answer]:
    """One try's request: POST /generate for ``row`` (``/v1/chat/completions`` for a row
    with images); returns ``(rid, answer)``. The wait for an HTTP slot is outside
    ``--timeout``, which bounds the HTTP request. ``pending`` journals the request (a store
    answer settles it at once: the server writes no file). Raises ``RequestError``
    (``RowError``; ``FatalError`` when retrying cannot help or for a file answer with
    ``--store``, ``UsageError`` for a store answer without ``--store``)."""
    rid = f"{opts.rid_prefix}-{row.index}-{attempt}-{uuid.uuid4().hex[:8]}"
    if opts.store is not None:
        opts.store.sent(row.index, rid)
    if row.chat is not None:
        answer = await chat_completion(session, opts.endpoint,
                                       chat_body(row.chat, rid, opts.early_answers),
                                       http_slots, pending)
    else:
        answer = await generate(session, opts.endpoint, rid, row.input_ids, opts.early_answers,
                                http_slots, pending, opts.generate)
    if answer.manifest is None and opts.store is not None:
        raise FatalError(f"the server at {opts.endpoint} writes files (its answers carry "
                         f"meta_info.{fmt.PATH_KEY}, e.g. {answer.path}), not samples into a "
                         f"Mooncake Store: --store has nothing to collect; run without --store "
                         f"(where this machine sees the server's dump directory), or start the "
                         f"server with --dump-hidden-states-dir mooncake://...")
    if answer.manifest is not None:
        pending.settled(rid)
        if opts.store is None:
            raise UsageError(f"the server at {opts.endpoint} puts its samples into a Mooncake Store "
                             f"(its answers carry meta_info.{MANIFEST_KEY}): pass --store "
                             f"mooncake://HOST:PORT, the master its --dump-hidden-states-dir names, "
                             f"to collect them")
    return rid, answer


async def wait_for_file(opts: Options, rid: str, path: str, pending: PendingFiles,
                        where: Optional[list] = None) -> Tuple[DumpDir, str]:
    """Wait for the server's file ``path`` (``rid``'s); returns the dump directory it is in
    (``opts.dump``'s, ``DumpDirs.take``) and its bare name there, complete. ``where`` (a
    list) gets that directory's path appended first, for a failure's worker. ``--timeout``
    bounds the wait for the file's lock. Raises ``RequestError`` (``FatalError``: the
    directory is not visible here) or ``CheckError`` (the answer names a file that is not
    taken)."""
    dump, name = opts.dump.take(rid, path, on_new=pending.dump_dir)  # else nothing is touched
    if where is not None:
        where.append(dump.path)
    local = os.path.join(dump.path, name)
    pending.named(rid, local)
    dump.require_waitable(name)
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
    return dump, name


def expected_ids(row: Row, answer: Answer) -> Optional[List[int]]:
    """The token ids ``row``'s file must hold: its ``input_ids`` (given, or tokenized
    here), else a chat answer's ``prompt_ids``, else None (the file's own, checked for one
    row each). Raises ``RowError`` when a row's ``input_ids`` differ from the prompt token
    ids the server says it ran: the row's loss mask would not fit the file (not retried)."""
    ids, ran = row.input_ids, answer.prompt_ids
    if ids is not None and ran is not None and ran != ids:
        pos = next((k for k, (a, b) in enumerate(zip(ids, ran)) if a != b), min(len(ids), len(ran)))
        raise RowError(f"the server ran {len(ran)} prompt token(s), which differ from the row's "
                       f"{len(ids)} input_ids at position {pos}: its chat template or image "
                       f"processing is not the one that made the row (its loss_mask would not "
                       f"fit); drop input_ids from such rows to take the server's")
    return ids if ids is not None else ran


def chat_record(row: Row, rec: Dict[str, Any]) -> Dict[str, Any]:
    """``rec`` plus, for a row with images, ``images`` (its image parts) and
    ``request_sha256`` (``ChatPrompt.digest``: what a rerun checks before keeping hs_<i>)."""
    if row.chat is not None:
        rec.update(images=row.chat.images, request_sha256=row.chat.digest)
    return rec


async def extract_one(session, opts: Options, row: Row, stats: Stats,
                      http_slots: asyncio.Semaphore, pending: PendingFiles,
                      abort: asyncio.Event, progress: Optional[Progress] = None
                      ) -> Optional[Tuple[Dict[str, Any], str]]:
    """All tries for one row; returns its manifest record and the worker that wrote it
    (``progress``' names), ``None`` if the run was aborted meanwhile, or raises the last
    error (``FatalError`` / ``RowError`` at once). Each failed try is counted against its
    worker in ``progress``: a try that fails on a server that died (connection reset, HTTP
    5xx from a router, timeout) is sent again, through the router to a live one."""
    last: Optional[Exception] = None
    stats.sources[row.index] = chat_record(row, {})
    if opts.generate is not None:  # the line after Ctrl-C records the settings too
        stats.sources[row.index][generation.SAMPLING_KEY] = opts.generate
    for attempt in range(opts.max_retries + 1):
        where: List[str] = []  # the try's worker, once an answer names it
        if attempt:
            stats.retries += 1
            await asyncio.sleep(backoff_delay(attempt, opts.backoff, opts.max_backoff))
        if abort.is_set():
            return None
        if opts.store is not None:
            from sglang_ext.client import store_rows  # imports this module: not at its top
        try:
            if attempt == 0 and opts.store is not None and opts.store.resumable(row.index):
                rec = await store_rows.resume_from_store(opts, row, stats.taken)
                if rec is not None:
                    return rec, STORE
            rid, answer = await request_once(session, opts, row, attempt, http_slots, pending)
            if answer.manifest is not None:
                where.append(STORE)
                return await store_rows.take_from_store(opts, row, rid, answer, stats.taken), STORE
            dump, name = await wait_for_file(opts, rid, answer.path, pending, where)
            ids = expected_ids(row, answer)  # RowError: the file stays journaled, swept at the end
            stats.sources[row.index]["source"] = os.path.join(dump.path, name)
            extra: Dict[str, Any] = {}
            if opts.generate is not None:  # the prompt's then the generated tokens' rows
                ids, extra = await asyncio.to_thread(generation.check_answer, dump, name, ids,
                                                     answer.output_ids, opts.decode, opts.generate)
            try:
                size = await asyncio.to_thread(
                    put_in_out, stats.taken, row.index, move_into_place, dump, name, opts.out_dir,
                    row.index, ids,
                    opts.validate, opts.file_mode,
                )
            finally:
                if not fmt.lexists_at(dump.fd, name):
                    pending.settled(rid)
            n = len(ids) if ids is not None else await asyncio.to_thread(
                check_file, os.path.join(opts.out_dir, final_name(row.index)), None, False)
            rec = record(row.index, n, os.path.join(dump.path, name), size)
            return chat_record(row, {**rec, **extra}), dump.path
        except FatalError:
            raise
        except RowError as e:
            raise RowError(f"{row.name}: {e}") from None
        except (RequestError, CheckError, OSError) as e:
            if isinstance(e, OSError) and e.errno in OUT_FULL:  # every next try would fail alike
                raise FatalError(out_full(e, opts.out_dir)) from None
            if isinstance(e, OSError) and e.errno in NOT_ALLOWED:  # so would these
                raise FatalError(not_allowed(e)) from None
            last = e
            if progress is not None:
                progress.failed_try(where[-1] if where else None)
            if abort.is_set():
                return None
            if attempt < opts.max_retries:  # the last try's error is reported by the caller
                print(f"{row.name}: try {attempt + 1} failed, retrying: {e}", file=sys.stderr)
    raise RequestError(f"{row.name}: {opts.max_retries + 1} tries failed; last: {last}")


async def run(args, opts: Options, rows: Iterator[Row], total: int, stats: Stats,
              pending: PendingFiles, progress: Progress) -> None:
    """Extract ``rows`` (``total`` of them, for ``progress``, the view and per-worker counts):
    ``2 * concurrency`` workers with early answers (one waits for its file while another's
    prompt prefills), else ``concurrency``; counts go to ``stats``. Returns when every row
    is done or failed, or after an abort (``stats.aborted``). Raises what ``rows`` raises
    (``DataError``) and ``KeyboardInterrupt``, after cancelling the workers."""
    import aiohttp

    stats.total = total
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * opts.concurrency)
    abort = asyncio.Event()
    consecutive = 0
    manifest = Manifest(opts.out_dir, opts.file_mode)

    def tick():
        progress.tick(stats)

    first: List[Tuple[str, Tuple[str, Tuple[int, ...], str]]] = []  # the run's first sample and its layout

    async def same_layout(row, taken: bool) -> bool:
        """Whether row's sample in OUT (``taken``: just taken; else resumed) has the
        layout of the run's first one; if not, the run stops (one server's samples beside
        another's: other layer ids, hidden size or dtype, e.g. a rerun against a server
        started with other flags) and a sample just taken is removed again, so OUT keeps one
        layout. A file that cannot be read now (removed under the run) is let pass: it was
        checked a moment ago, and the next run checks it again."""
        name = final_name(row.index)
        path = os.path.join(opts.out_dir, name)
        try:
            layout = await asyncio.to_thread(sample_layout, path)
        except CheckError:
            return True
        if not first:
            first.append((name, layout))
        if layout == first[0][1]:
            return True
        if taken:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            stats.taken.discard(row.index)
        if not abort.is_set():
            stats.aborted = (f"{name} holds layers {layout[0]} x {list(layout[1])} {layout[2]}, "
                             f"but {first[0][0]} in {opts.out_dir} holds {first[0][1][0]} x "
                             f"{list(first[0][1][1])} {first[0][1][2]}: one dataset of two server "
                             f"configurations{' (so it was not kept)' if taken else ''}; extract "
                             f"into a fresh --out, or remove the samples of the other server first")
            print(f"error: {stats.aborted}", file=sys.stderr)
            abort.set()
        return False

    def stop(why: str) -> None:
        """Abort the run for ``why`` (one sentence, first on stderr), once."""
        if not abort.is_set():
            stats.aborted = why
            print(f"error: {why}", file=sys.stderr)
            abort.set()

    def add_line(row: Row, rec: Dict[str, Any]) -> bool:
        """Append ``rec`` to the manifest; False when OUT cannot take it (a full disk): the
        row fails, its hs_<i> stays for the next run, and the run stops (the next rows
        would fail alike)."""
        try:
            manifest.add(rec)
            return True
        except OSError as e:
            stats.failed += 1
            stats.failed_indices.append(row.index)
            print(f"{row.name}: cannot append its line to {manifest.path} ({e.strerror or e}); "
                  f"{final_name(row.index)} is kept for the next run", file=sys.stderr)
            stop(out_full(e, opts.out_dir))
            return False

    async def worker(session):
        while True:
            row = await queue.get()
            try:
                if row is not None and not abort.is_set():
                    await one_row(session, row)
            except Exception as e:  # noqa: BLE001 - a worker must never die: the run would hang
                stop(f"{row.name}: {type(e).__name__}: {e}")
            finally:
                queue.task_done()
            if row is None:
                return

    async def one_row(session, row: Row) -> None:
        """All of one row: resume, tries, the manifest line; counts go to ``stats``."""
        nonlocal consecutive
        if row.error is not None:  # a malformed image part: this row alone fails
            stats.failed += 1
            stats.failed_indices.append(row.index)  # bad data, not a failing server:
            print(row.error, file=sys.stderr)        # not a consecutive failure
            tick()
            return
        extra = None
        if opts.generate is not None:
            n, redo, extra = await asyncio.to_thread(
                generation.existing, opts.out_dir, row.index, row.input_ids, opts.validate,
                manifest.records.get(row.index), opts.decode, opts.generate)
        else:
            n, redo = await asyncio.to_thread(
                existing, opts.out_dir, row.index, row.input_ids, opts.validate,
                row.chat.digest if row.chat is not None else None,
                manifest.records.get(row.index))
        if redo:  # a file that fails the check, a FIFO, a symlink: replaced atomically
            kept = await asyncio.to_thread(generation.other_mode, opts.out_dir, row.index,
                                           row.input_ids, opts.generate,
                                           manifest.records.get(row.index))
            if kept:  # the other mode's (or settings') sample of this row: work a rerun must not throw away
                stop(f"{row.name}: {kept}")
                return
            print(f"re-extracting {final_name(row.index)}: {redo}", file=sys.stderr)
        elif n is not None:
            if not await same_layout(row, taken=False):
                return
            stats.resumed += 1
            if row.index not in manifest:
                size = os.stat(os.path.join(opts.out_dir, final_name(row.index))).st_size
                if not add_line(row, {**record(row.index, n, None, size), **(extra or {})}):
                    return
            if opts.store is not None:  # taken before a kill: its objects go now
                await opts.store.consumed(row.index)
            tick()
            return
        try:
            got = await extract_one(session, opts, row, stats, http_slots, pending, abort,
                                    progress)
        except FatalError as e:
            if not abort.is_set():
                stats.bad_input = isinstance(e, UsageError)
            stop(f"{row.name}: {e}")
            return
        except Exception as e:  # noqa: BLE001 - a row's error: the run goes on
            stats.sources.pop(row.index, None)
            if not isinstance(e, RequestError):
                e = RequestError(f"{row.name}: {type(e).__name__}: {e}")
            stats.failed += 1
            stats.failed_indices.append(row.index)
            consecutive += 1
            print(str(e), file=sys.stderr)
            if consecutive >= opts.max_consecutive_failures:
                stop(f"{consecutive} consecutive samples failed (--max-consecutive-failures); "
                     f"last: {e}")
        else:
            if got is None:  # aborted while it was being tried
                return
            rec, worker = got
            if not await same_layout(row, taken=True):
                return
            if not add_line(row, rec):
                return
            stats.sources.pop(row.index, None)
            progress.sample(worker, rec["num_tokens"])
            consecutive = 0
            if opts.store is not None:  # in OUT and in the manifest: remove the object(s)
                await opts.store.consumed(row.index)
            stats.done += 1
            stats.tokens += rec["num_tokens"]
            stats.bytes += rec["bytes"]
        tick()

    timeout = aiohttp.ClientTimeout(total=opts.timeout)
    # Twice as many workers as HTTP requests in flight: while one waits for its file
    # (answered early, see request_once) another's prompt is already prefilling.
    n_workers = 2 * opts.concurrency if opts.early_answers else opts.concurrency
    http_slots = asyncio.Semaphore(opts.concurrency)
    connector = aiohttp.TCPConnector(limit=n_workers)
    clash = generation.other_ranks_setting(opts.out_dir, manifest.records, opts.generate,
                                           lambda i: i % args.world_size == args.rank)
    if clash is not None:  # before any row: nothing is sent
        stop(clash)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        workers = [asyncio.create_task(worker(session)) for _ in range(n_workers)]
        try:
            fed, grown = 0, False
            for row in rows:
                if abort.is_set():
                    break
                if fed == total:  # DATA appended to since its rows were counted: not read
                    grown = True
                    break
                await queue.put(row)
                fed += 1
            for _ in workers:
                await queue.put(None)
            await asyncio.gather(*workers)
            if grown and not abort.is_set():
                stop(f"--data {args.data} has more than the {total} rows of this rank counted at the "
                     f"start: it grew during the run; those {total} were sent: run the same command "
                     f"again to extract the rows added")
            if fed < total and not abort.is_set():  # DATA cut short since its rows were counted
                stop(f"--data {args.data} ended after {fed} of this rank's {total} rows counted at "
                     f"the start: it changed during the run (rewritten, truncated?); the rows "
                     f"sent are kept: run the same command again on the whole DATA to resume")
        except BaseException:  # Ctrl-C (cancelled) or bad DATA: stop the workers now
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            raise
        finally:
            progress.close()
