"""What both sinks of a writer process share: ``writer_process.Writer`` (files) and
``store_writer.StoreWriter`` (Mooncake Store objects) are ``Sink``s."""

from __future__ import annotations

import logging
import os
from typing import Any, Deque, Dict, Optional

from sglang_ext import wire

logger = logging.getLogger("sglang_ext.writer_process")


class Sink:
    """What both sinks of a writer process share (``Writer``: files; ``store_writer.StoreWriter``:
    Mooncake Store objects): ``handle(op, fd, lost, final)`` runs on one writer thread per
    request; acknowledgements go to ``acks`` (``wire`` events) and a byte on ``wake`` wakes
    the main thread. A sink gives back what a request holds in ``_release`` and fails a
    ``Finish`` the way its readers see (``_finish_failed``)."""

    def __init__(self, acks: Deque[wire.Ack], wake, metrics=None):
        self.acks = acks
        self.wake = wake
        self.metrics = metrics  # sglang_ext.metrics.DumpMetrics, or None
        self.abort = False  # drain deadline passed: fail finishes, skip the rest
        self.jobs: Dict[int, Any] = {}

    def _release(self, job) -> None:
        raise NotImplementedError

    def _finish_failed(self, op: wire.Finish, fd: Optional[int], message: str) -> None:
        raise NotImplementedError

    def failed_op(self, op: wire.Op, fd: Optional[int], e: BaseException) -> None:
        """What an op that raised past ``handle``'s own handling leaves: its request fails
        (a ``Finish`` through ``_finish_failed``). An op of no request (``MarkError``) is
        only logged."""
        message = f"{type(e).__name__}: {e}"
        key = getattr(op, "key", None)
        logger.error("hidden-state dump: op %s of request %s failed: %s", type(op).__name__, key, message)
        if key is None:
            return
        ends = type(op) in (wire.Finish, wire.Abandon)
        job = self.jobs.pop(key, None) if ends else self.jobs.get(key)
        if job is not None:
            job.error = job.error or message
            self._release(job)
        if type(op) is wire.Finish:
            self._finish_failed(op, fd, message)

    def discard_all(self) -> None:
        """Give back what requests that never got their ``Finish`` hold."""
        for job in list(self.jobs.values()):
            self._release(job)
        self.jobs.clear()

    def _ack(self, event: wire.Ack) -> None:
        self.acks.append(event)
        try:
            os.write(self.wake, b"!")
        except BlockingIOError:
            pass  # the pipe is full: the main thread is already awake
