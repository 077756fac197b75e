"""``sglang-ext extract``: send a dataset to a dumping server, collect ``hs_<i>.safetensors``.

For every row ``i`` of DATA that belongs to this rank (``i % world_size == rank``) the
client POSTs ``/generate`` with the row's token ids, asking to be answered before the
write (``format.WAIT_PARAM``; ``--no-early-answers`` does not ask), waits until the file
named by ``meta_info.hidden_states_path`` is complete (its ``.lock`` released), checks it
and moves it to ``OUT/hs_<i>.safetensors``, the layout speculators' training reader loads.
One line per sample goes to ``OUT/manifest.jsonl``.

Rows with images (``messages`` whose content holds image parts: OpenAI's ``image_url`` with
an http(s), ``file://`` or base64 ``data:`` URL, or speculators' ``{"type": "image", "path"
| "url" | "image": ...}``; ``sglang_ext.client.images``) go to ``POST /v1/chat/completions``
instead (``max_tokens`` 1, ``temperature`` 0, non-streaming, the same ``rid`` and early
answers, ``return_prompt_token_ids`` and ``return_meta_info``): the server applies its chat
template and expands each image into its placeholder tokens, and its answer names the file
in ``kv_transfer_params.hidden_states_path`` (or ``choices[0].meta_info``) or, with a store,
the transfer manifest. The file's token ids must equal ``choices[0].prompt_token_ids`` (and
the row's ``input_ids`` when it has them: else the row fails, not retried), and it goes to
``hs_<i>`` as any other, its manifest line with ``images`` and ``request_sha256``. The server
fetches the images itself: a ``file://`` path must name a file on the server's filesystem,
under a directory given with ``--image-root`` (none by default; ``images.ImageAccess``).
A malformed or refused image part fails its row with one sentence; the run goes on.

Guarantees:

- Start: one ``GET URL/health`` before any row is sent. Nothing answers: "cannot reach
  URL: is the server up?"; an answer that is not SGLang's (SGLang answers 200, or 503
  while starting): "URL is not an SGLang server", quoting at most a short brief of the
  answer. Either is one line and exit 3 at once.
- ``hs_<i>.safetensors`` only ever appears complete, checked and a regular file: the
  server's file is first moved to ``OUT/.hs_<i>.safetensors.tmp.<random>`` (``rename`` on the
  same filesystem, else a copy through a descriptor opened ``O_NOFOLLOW`` + unlink),
  checked there, then renamed onto the final name. Never a symlink kept as a result.
- The server's answer is not trusted: extract moves and deletes only regular files
  directly in a dump directory (``--dump-dir``, repeatable, else each directory an answer
  names; held open, files taken by name relative to it), whose name
  is the server's name for that request (``<safe_stem(rid)>[-n].safetensors``), never
  through a symlink (``lstat``, ``O_NOFOLLOW``, ``fstat``). An answer naming anything
  else (a path outside, a symlink, a FIFO, another name) is that row's error and the
  named file is left alone. The journal (``sglang_ext.client.pending``) deletes only such files.
- Bounds on what a server sends (each a try's error, one sentence naming it): an answer's
  body up to 16 MiB and its JSON up to Python's nesting limit (``http.read_answer``,
  ``parse_answer``; ``--timeout`` covers an answer that trickles); a file's header before
  anything of it is moved or copied (``checks.check_header``: ``[T, L, H]``, every
  dimension >= 1, T the row's tokens, L x H <= 4M, size <= T x (L x H x dtype bytes + 4 L
  + 8) + 1 MiB).
- A full OUT: manifest lines are appended whole or not at all; a failed append fails its
  row naming the manifest and stops the run (exit 3), the row's ``hs_<i>`` kept for the
  rerun.
- Files extract creates (``hs_<i>``, the manifest, the journal, temporary files) get
  mode 0600, or ``KIMI_SGLANG_FILE_MODE`` (octal, e.g. ``0640``; the server reads the
  same variable), the umask applied; an invalid value is one sentence, exit 2. The
  ``--out`` it makes gets that mode with search bits (0700 by default), and is removed
  again when the run leaves it empty.
- Resume: an index whose ``hs_<i>.safetensors`` is a regular file and passes the check
  is skipped (and gets a manifest line if a kill lost it); leftover ``.hs_*.tmp`` files
  are removed at start. A row with images is skipped only when its manifest line names
  the same request (``request_sha256``) and token count; else it is extracted again. A file that fails the check, or anything but a regular file at
  that name (a FIFO, a symlink: never opened), is extracted again and replaced atomically.
- Retries: a failed request (connection error, HTTP error, ``hidden_states_error``, a file
  that fails the check) is retried ``--max-retries`` times with exponential backoff
  (``--backoff * 2**(attempt-1)`` seconds, capped at ``--max-backoff``, with jitter). After
  ``--max-consecutive-failures`` samples in a row failed all their tries, the run aborts.
  HTTP 400 (the server refused the row) is not retried. An answer no retry can change
  (no ``hidden_states_path``: the server is not dumping; a dump directory this machine
  does not see; HTTP 404/405: not the server's base URL) aborts the run at once, one
  ``error:`` line on stderr giving the reason.
- Through SGLang's router (``--endpoint`` its URL; docs/fleet.md): the retries above send
  a row whose server died or timed out (connection reset, HTTP 5xx, timeout) again under a
  new rid, and the router gives it to a live server; a row is written and put in the
  manifest once whichever try succeeds. With the directory sink every server's dump
  directory must be on a filesystem this client sees (at another path: ``--dump-dir``,
  ``dumpdir.DumpDirs``); an answer naming a directory found nowhere stops the run (exit 3).
- Progress (``sglang_ext.client.progress``): rows/s, tokens/s and per worker (its dump
  directory, or ``store``) samples and failed tries; the same in the summary (``--summary``).
- Leftovers: the server's files of requests this client never took (killed or
  interrupted runs, tries that timed out while the server still wrote) are journaled and
  removed from the dump directory by ``sglang_ext.client.pending`` (at start and at the end);
  files still being written are reported. Ctrl-C ends with one line (exit 130), SIGTERM
  (a batch scheduler's time limit) the same way (exit 143).

- Store: a server started with ``--dump-hidden-states-dir mooncake://...`` answers with
  ``meta_info.hidden_states_manifest`` instead of a path; with ``--store mooncake://HOST:PORT?...``
  (the same URL form, trainer-side settings) each sample is waited for in the Mooncake
  Store (``--store-timeout``), checked, written as ``hs_<i>`` in the file sink's format and
  removed from the store once in the manifest (``sglang_ext.client.fetch``): no filesystem
  is shared with the server. Such an answer without ``--store`` stops the run (exit 2), and
  an answer naming a file with ``--store`` (a server writing files) stops it (exit 3), as
  does a master that stops answering mid-run and refuses connections (``fetch``).

- Generate (``--generate``, ``sglang_ext.client.generation``): the server writes each row's
  response and the rows of prompt and response in one request (``format.output``); the file
  is checked against the answer's ``output_ids`` before it is taken; a retry is a new sample.

Rows are counted from 0 as in ``hs_<i>``; messages name them ``row i (line L of FILE)``.
Checks: always token ids equal the request's and ``hidden_states`` has one row per token
(read from the file's header with numpy, without torch); with ``--validate`` (numpy alone will do)
also the whole file is loaded through ``sglang_ext.format.load`` and must be finite.
Exit codes: 0 all done, 1 some samples failed, 2 bad input, 3 aborted, 130 interrupted,
143 terminated (SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from typing import List, Optional

from sglang_ext.client import generation
from sglang_ext.client.dataset import DataError, rank_rows
from sglang_ext.client.extract_setup import BadInput, CannotStart, prepare
from sglang_ext.client.files import RunLock
from sglang_ext.client.images import ImageAccess
from sglang_ext.client.manifest import MANIFEST_NAME, add_missing_lines
from sglang_ext.client.pending import PendingFiles
from sglang_ext.client.report import report_sweep, sweep, write_summary
from sglang_ext.client.runner import Options, Stats, run

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_ABORTED = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT
EXIT_TERMINATED = 143  # SIGTERM (a batch scheduler's time limit, kill), as a shell reports it


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is: the same sweep, line and resume."""


def _on_sigterm(signum, frame):  # outside the run's event loop (set-up, the summary)
    raise _Terminated()


async def _run_until_sigterm(coro) -> None:
    """Await the run ``coro``; a SIGTERM meanwhile cancels it at an await (as asyncio does
    for Ctrl-C), so no task is cut inside aiohttp's own code, and raises ``_Terminated``.
    Then the process-wide handler is back (the loop's removal would leave SIGTERM's default)."""
    if threading.current_thread() is not threading.main_thread():  # signals are the main thread's
        await coro
        return
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    terminated = []

    def on_sigterm():
        terminated.append(True)
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        await coro
    except asyncio.CancelledError:
        if terminated:
            raise _Terminated() from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)


def main(args) -> int:
    """``sglang-ext extract``: the exit codes of the module doc."""
    opened: List = []  # the dump directories, the store: closed at the end
    locks: List[RunLock] = []  # the run's hold on --out, released last
    main_thread = threading.current_thread() is threading.main_thread()  # (called as a library)
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    made_out = not os.path.lexists(args.out)  # --out is this run's to remove if left empty
    try:
        return _main(args, opened, locks)
    except _Terminated:  # before or after the run's own handling: still one line, no traceback
        print("extract: terminated (SIGTERM); run the same command again to resume", file=sys.stderr)
        return EXIT_TERMINATED
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        for thing in opened:
            thing.close()
        for lock in locks:
            lock.release()
        if made_out:  # a run stopped before any file (a bad row, an abort) leaves no empty --out
            try:
                os.rmdir(args.out)
            except OSError:  # not empty (samples, a journal), or never made
                pass


def _main(args, opened: List, locks: List[RunLock]) -> int:
    """Set up (``extract_setup.prepare``), run the rows, report."""
    try:
        setup = prepare(args, opened, locks)
    except (BadInput, CannotStart) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ABORTED if isinstance(e, CannotStart) else EXIT_BAD_INPUT
    opts = Options(
        endpoint=args.endpoint, out_dir=args.out, concurrency=args.concurrency,
        max_retries=args.max_retries, backoff=args.backoff, max_backoff=args.max_backoff,
        max_consecutive_failures=args.max_consecutive_failures, timeout=args.timeout,
        validate=args.validate, rid_prefix=args.rid_prefix, early_answers=not args.no_early_answers,
        dump=setup.dump, file_mode=setup.mode, store=setup.store, store_timeout=args.store_timeout,
        generate=setup.sampling,
        decode=generation.decoder(setup.tokenizer) if setup.sampling is not None else None,
    )
    stats = Stats()
    total = len(range(args.rank, setup.n_rows, args.world_size))
    rows = rank_rows(args.data, setup.tokenizer, args.world_size, args.rank, ImageAccess(tuple(setup.roots)),
                     generate=setup.sampling is not None)
    t0 = time.monotonic()
    from sglang_ext.client.progress import Progress  # tqdm: checked by prepare

    progress = Progress(total, args.no_progress)
    stopped = _run_rows(args, opts, rows, total, stats, setup.pending, progress)
    if stopped is not None:
        return stopped
    return _report(args, opts, stats, setup.pending, progress, time.monotonic() - t0)


def _run_rows(args, opts: Options, rows, total: int, stats: Stats, pending: PendingFiles,
              progress) -> Optional[int]:
    """Run the rows (``runner.run``) to the end or an abort: None. A bad DATA row, Ctrl-C or
    SIGTERM stops it: the manifest lines and the sweep such a stop owes, one line, and the
    exit code (2, 130, 143)."""
    try:
        asyncio.run(_run_until_sigterm(run(args, opts, rows, total, stats, pending, progress)))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        _add_missing_lines(args.out, stats, opts.file_mode)
        report_sweep(pending, forget_unanswered=False, of="stopped tries")
        if stats.done:
            print(f"extract: stopped at that row; the {stats.done} sample(s) extracted before it "
                  f"are kept in {args.out}: fix the row and run the same command again to resume",
                  file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as e:
        _add_missing_lines(args.out, stats, opts.file_mode)
        _, notes = sweep(pending, forget_unanswered=False, of="interrupted tries")
        how = "terminated (SIGTERM)" if isinstance(e, _Terminated) else "interrupted"
        # stats.taken, not stats.done: rows cancelled after their file reached OUT count
        # (a new user's review saw 813 said, 829 in OUT, 829 resumed by the next run).
        # One line: the sweep's sentences go into it.
        print(f"extract: {how}: {len(stats.taken)} sample(s) extracted in this run, "
              f"{len(stats.taken) + stats.resumed} of {total} done for rank {args.rank}; "
              + "".join(f"{n}; " for n in notes) + "run the same command again to resume",
              file=sys.stderr)
        return EXIT_TERMINATED if isinstance(e, _Terminated) else EXIT_INTERRUPTED
    return None


def _report(args, opts: Options, stats: Stats, pending: PendingFiles, progress, elapsed: float) -> int:
    """After a run that was not stopped: sweep the server's files (and the store's objects)
    of tries given up on, print the summary line (and write --summary); the exit code (0,
    1, or 2 or 3 after an abort)."""
    left = report_sweep(pending, forget_unanswered=False, of="tries given up on")
    if opts.store is not None and not stats.aborted:
        _, kept = asyncio.run(opts.store.sweep())
        if kept:
            print(f"{kept} object(s) of tries given up on could not be removed from the Mooncake "
                  f"store (the master did not answer); the next run of this command removes them",
                  file=sys.stderr)
    summary = {
        "rank": args.rank, "world_size": args.world_size, "rows_for_rank": stats.total,
        "extracted": stats.done, "resumed": stats.resumed, "failed": stats.failed,
        "retries": stats.retries, "tokens": stats.tokens, "gb_written": round(stats.bytes / 1e9, 3),
        "seconds": round(elapsed, 1), "tokens_per_s": round(stats.tokens / elapsed, 1) if elapsed else 0,
        **progress.summary(stats), "out": os.path.abspath(args.out),
    }
    if stats.failed_indices:
        summary["failed_indices"] = sorted(stats.failed_indices)[:100]
    if left:
        summary["server_files_left"] = left[:100]
    if stats.aborted:
        summary["aborted"] = stats.aborted
    print("extract summary: " + json.dumps(summary))
    if args.summary is not None:
        try:
            write_summary(args.summary, summary, opts.file_mode)
        except OSError as e:
            print(f"error: --summary {args.summary}: cannot write it ({e.strerror or e}); the "
                  f"summary is the line above", file=sys.stderr)
    if stats.aborted:
        return EXIT_BAD_INPUT if stats.bad_input else EXIT_ABORTED
    return EXIT_FAILED if stats.failed else EXIT_OK


def _add_missing_lines(out_dir: str, stats: Stats, mode: int) -> None:
    """After a run cut short (Ctrl-C, SIGTERM, bad DATA): the manifest line of each file
    this run put into OUT whose row was cancelled before writing it (``add_missing_lines``)."""
    try:
        add_missing_lines(out_dir, stats.taken, stats.sources, mode)
    except OSError as e:  # a full disk: the next run adds them (without their source)
        print(f"cannot append to {os.path.join(out_dir, MANIFEST_NAME)} ({e.strerror or e}); "
              f"the next run of this command adds the missing lines", file=sys.stderr)


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
        description=__doc__.split("\n\n")[0].replace("``", ""),
        epilog="Row i becomes OUT/hs_<i>.safetensors (hidden_states [T, L, H] in the server's "
               "dtype, token_ids [T] int64) plus a line of OUT/manifest.jsonl; a rerun resumes. "
               "Exit codes: 0 every row done, 1 some rows failed all their tries (rerun to "
               "retry them), 2 bad input (nothing sent), 3 aborted (one error: line on stderr "
               "gives the reason), 130 Ctrl-C, 143 SIGTERM. More: docs/client.md.",
        formatter_class=_DefaultsHelp,
    )
    p.add_argument("--endpoint", required=True,
                   help="server base URL, e.g. http://127.0.0.1:30000; probed once with GET "
                        "/health before any row: unreachable or not SGLang is one line, exit 3")
    p.add_argument("--data", required=True,
                   help="JSONL with input_ids (or messages + --tokenizer), or a "
                        "datasets.save_to_disk directory (speculators prepare-data output); "
                        "rows whose messages hold image parts (image_url with an http(s), "
                        "file:// or data: URL; speculators' image path/url) go through "
                        "/v1/chat/completions: the server fetches the images, so a file:// "
                        "path must name a file the SERVER can read, under an --image-root")
    p.add_argument("--image-root", default=None, action="append", metavar="DIR",
                   help="absolute directory on the server's filesystem whose files image "
                        "rows may name as file:// URLs or paths (repeatable; default: none, "
                        "every file:// image is refused: SGLang's loader reads any path it is "
                        "given, e.g. /dev/zero without end); /proc, /dev and /sys never, "
                        "http(s) to link-local addresses never")
    p.add_argument("--out", required=True,
                   help="output directory (hs_<i>.safetensors, manifest.jsonl), files created "
                        "with mode 0600 or env KIMI_SGLANG_FILE_MODE (octal, e.g. 0640), the "
                        "umask applied; results are always regular files")
    p.add_argument("--dump-dir", default=None, action="append",
                   help="the server's --dump-hidden-states-dir as this machine sees it, at the "
                        "server's path or another (a bind mount, a share mounted elsewhere: a "
                        "file is then found by its name and taken only if its metadata names "
                        "the request's rid): extract "
                        "moves and deletes only regular files directly in it that carry the "
                        "server's name for the request: an answer naming another name stops "
                        "the run (exit 3), one naming no regular file fails its try. Repeat it "
                        "for servers behind a router that write to directories of their own "
                        "(default: the one the server's GET /server_info names and each one an "
                        "answer names, when this machine sees it; one that it does not see "
                        "stops the run)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer path for rows with text-only messages (apply_chat_template); "
                        "rows with images use the server's chat template")
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
    p.add_argument("--store", default=None, metavar="URL",
                   help="collect samples from a Mooncake Store: mooncake://HOST:PORT?protocol=tcp&... "
                        "(the master the server's --dump-hidden-states-dir names, this node's "
                        "settings; docs/store.md), for a server whose answers carry "
                        "meta_info.hidden_states_manifest; needs pip install -r requirements/store.txt")
    p.add_argument("--store-timeout", type=float, default=120.0,
                   help="with --store: seconds to wait for each answer's object (or its :error)")
    generation.add_arguments(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--summary", default=None, metavar="PATH",
                   help="also write the final summary (rows/s, tokens/s, per-worker samples and "
                        "failed tries) as JSON to PATH")
    p.set_defaults(func=main)
