"""Which requests a serving deployment dumps: a sampled share of live traffic, within a
byte budget and above a free-space floor on the dump directory, never failing or slowing
a request (issue 49, "capture from live traffic").

``DumpPolicy.admit`` decides once per request, at its first extend chunk (the session
asks; ``session.DumpSession._take``). In order:

1. ``custom_params {"hidden_states_dump": false}``: never dumped (not counted here).
2. ``{"hidden_states_dump": true}``: always dumped (``extract`` keeps working against a
   sampling server); its bytes count against the budget all the same.
3. the rate (``KIMI_SGLANG_SAMPLE_RATE``): dumped when ``sample_point(rid) < rate``, a
   pure function of the rid, so a retried rid gets the same answer on any server;
4. the budget (``KIMI_SGLANG_DUMP_BUDGET_GB``): a request whose bytes would take the
   bytes admitted past it is skipped, and so is every sampled request after it (once
   the bytes that stay do: not while output requests' unsettled bounds, its own included,
   make the difference);
5. the free-space floor (``KIMI_SGLANG_MIN_FREE_GB``, a directory sink only):
   ``fstatvfs`` of the dump directory at most every ``DISK_CHECK_S``, less the bytes of
   files admitted before it and not written yet (the writer's ``unwritten_bytes``) and
   the bytes admitted since and its own; a request whose file would take it below the
   floor is skipped, and below the floor every one is, until a later check finds the
   space back.

A request that asked for its output rows (``format.OUTPUT_PARAM``) is decided at its
first chunk too, when its length is not known: it counts the file of ``P +
max_new_tokens - 1`` rows, the most it can write (``provisional``), until it ends and
``settle`` puts in the bytes of the file it wrote (none when it failed or was let go of).
Until then the free-space floor counts that bound as bytes still to be written.

A skipped request gets no file, no error and no dump keys in its response (as
``hidden_states_dump: false``). Skipping for the budget or the floor starts with one
warning line and the floor's ends with one info line. Counters: ``counts`` (``sampled``
and one per ``REASONS``), on ``/metrics`` too with ``--enable-metrics``
(``metrics.sampling_counters``). The settings are read and validated with the others
(``config.sampling_settings``).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)

GIB = 1 << 30  # the _GB settings are GiB
DISK_CHECK_S = 1.0  # the most often the dump directory's free space is asked (fstatvfs)
REASONS = ("rate", "budget", "disk_floor")  # the skipped counter's reason label


def sample_point(rid) -> float:
    """The rid's place in [0, 1): the first 8 bytes of sha256 of ``str(rid)`` in UTF-8
    (lone surrogates kept, ``surrogatepass``), big-endian, over 2**64. A request is
    sampled when this is below the rate."""
    digest = hashlib.sha256(str(rid).encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


class DumpPolicy:
    """One writing rank's sampling decisions.

    ``rate``: the share of requests dumped, 0 to 1; ``budget_bytes``: the most bytes of
    files this rank admits (None: no budget); ``min_free_bytes``: the free-space floor on
    ``dir_fd``'s file system (None, or ``dir_fd`` None for the store sink: no floor);
    ``metrics_model_name``: the ``model_name`` label of the Prometheus counters (None: no
    counters, as without ``--enable-metrics``); ``clock``: seconds, monotonic;
    ``unwritten``: bytes of admitted files not on disk yet (``DumpWriter.unwritten_bytes``;
    None: every file counts as written once its free-space reading is taken).
    """

    def __init__(self, rate: float = 1.0, budget_bytes: Optional[int] = None,
                 min_free_bytes: Optional[int] = None, dir_fd: Optional[int] = None,
                 metrics_model_name: Optional[str] = None, clock: Callable[[], float] = time.monotonic,
                 unwritten: Optional[Callable[[], int]] = None):
        self.rate = float(rate)
        self.budget_bytes = budget_bytes
        self.min_free_bytes = min_free_bytes if dir_fd is not None else None
        self.dir_fd = dir_fd
        self.clock = clock
        self.unwritten = unwritten
        self.admitted_bytes = 0
        self.provisional_bytes = 0  # upper bounds of admitted output files not settled yet
        self._settled = collections.deque()  # (bound, bytes) from settle, applied by the next admit
        self.counts = dict.fromkeys(("sampled",) + REASONS, 0)
        self._budget_spent = False
        self._below_floor = False
        self._free_at_check: Optional[int] = None  # bytes free at the last fstatvfs
        self._admitted_at_check = 0
        self._unwritten_at_check = 0  # bytes admitted before the last fstatvfs, not on disk then
        self._checked_at = -float("inf")
        self._prometheus = None
        if metrics_model_name is not None:
            from sglang_ext.metrics import sampling_counters

            self._prometheus = sampling_counters(metrics_model_name, REASONS)

    def describe(self) -> str:
        """The settings in words for the start line; "" when every request is dumped."""
        parts = [f"rate {self.rate:g}"] if self.rate < 1 else []
        if self.budget_bytes is not None:
            parts.append(f"budget {self.budget_bytes / GIB:g} GiB")
        if self.min_free_bytes is not None:
            parts.append(f"free-space floor {self.min_free_bytes / GIB:g} GiB")
        return ", ".join(parts)

    def admit(self, rid, asked: Optional[bool], nbytes: int, provisional: bool = False) -> bool:
        """Whether to dump request ``rid`` of ``nbytes`` bytes of file; ``asked``: its
        ``custom_params`` ``hidden_states_dump`` (True, False, or None when absent or
        not a JSON bool). ``provisional``: ``nbytes`` is an upper bound (a request with
        output rows) that its end will ``settle``. Counts the decision; never raises for a
        file-system error."""
        self._apply_settled()
        if asked is False:
            return False
        if asked is not True:
            reason = self._skip_reason(rid, nbytes, provisional)
            if reason is not None:
                self._count(reason)
                return False
        self.admitted_bytes += nbytes
        if provisional:
            self.provisional_bytes += nbytes
        self._count("sampled")
        return True

    def settle(self, bound: int, nbytes: int) -> None:
        """A request admitted with ``provisional`` bytes ``bound`` ended with a file of
        ``nbytes`` bytes handed to the writer (0: no file, it failed or was let go of): the
        budget counts ``nbytes`` instead of ``bound`` from now on. Only queues (safe from a
        ``weakref.finalize`` callback); the next ``admit`` applies it."""
        self._settled.append((int(bound), int(nbytes)))

    def _apply_settled(self) -> None:
        while self._settled:
            bound, nbytes = self._settled.popleft()
            self.provisional_bytes -= bound
            self.admitted_bytes += nbytes - bound

    def _skip_reason(self, rid, nbytes: int, provisional: bool = False) -> Optional[str]:
        if self.rate < 1 and sample_point(rid) >= self.rate:
            return "rate"
        if self.budget_bytes is not None and (
                self._budget_spent or self.admitted_bytes + nbytes > self.budget_bytes):
            # The budget is spent for good only by bytes that stay: an overflow that output
            # requests' bounds not settled yet cause (this request's own bound included)
            # skips this request alone.
            staying = 0 if provisional else nbytes
            if not self._budget_spent and (
                    self.admitted_bytes - self.provisional_bytes + staying > self.budget_bytes):
                self._budget_spent = True
                logger.warning(
                    "hidden-state dump: byte budget of %d bytes (KIMI_SGLANG_DUMP_BUDGET_GB) "
                    "spent (%d admitted); sampled requests are no longer dumped",
                    self.budget_bytes, self.admitted_bytes)
            return "budget"
        if self.min_free_bytes is not None and self._low_on_space(nbytes):
            return "disk_floor"
        return None

    def _low_on_space(self, nbytes: int) -> bool:
        """Whether a file of ``nbytes`` would take the dump directory's file system below
        the floor: its free space as of the last ``fstatvfs`` (asked again once
        ``DISK_CHECK_S`` have passed), less what files admitted before it still had to
        write then (``unwritten``, and the bounds of output files not handed to the writer
        yet: ``provisional_bytes``), the bytes admitted since (not all on disk yet; a
        settled bound gives back what it did not use) and ``nbytes``. Logs the turns of the free space itself across the floor (a file too
        large for what is left above it is skipped without a line, counted)."""
        now = self.clock()
        if now - self._checked_at >= DISK_CHECK_S:
            self._checked_at = now
            try:
                st = os.fstatvfs(self.dir_fd)
                self._free_at_check = st.f_bavail * st.f_frsize
            except OSError:
                self._free_at_check = None  # unknown: dumping goes on, as without a floor
            self._admitted_at_check = self.admitted_bytes
            self._unwritten_at_check = self.provisional_bytes + (
                self.unwritten() if self.unwritten is not None else 0)
        if self._free_at_check is None:
            return False
        free = (self._free_at_check - self._unwritten_at_check
                - (self.admitted_bytes - self._admitted_at_check))
        below = free < self.min_free_bytes
        if below != self._below_floor:
            self._below_floor = below
            if below:
                logger.warning(
                    "hidden-state dump: %d bytes free in the dump directory, below the floor "
                    "of %d (KIMI_SGLANG_MIN_FREE_GB); sampled requests are not dumped until "
                    "space is back", max(free, 0), self.min_free_bytes)
            else:
                logger.info("hidden-state dump: %d bytes free in the dump directory, above the "
                            "floor again; sampled requests are dumped again", free)
        return free - nbytes < self.min_free_bytes

    def _count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        if self._prometheus is not None:
            try:
                sampled, skipped = self._prometheus
                (sampled if outcome == "sampled" else skipped[outcome]).inc()
            except Exception:  # noqa: BLE001 - observability must not fail a request
                pass
