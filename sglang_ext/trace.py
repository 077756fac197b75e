"""Stage timestamps of the dump path, for profiling (off unless ``KIMI_SGLANG_TRACE`` is set).

``KIMI_SGLANG_TRACE=/path/trace.jsonl`` in the server's environment makes every process
of the dump path append one JSON line per event to that file (``O_APPEND``, one
``write`` per line, so the scheduler and the tokenizer manager can share it). Times are
``time.monotonic()`` seconds: CLOCK_MONOTONIC, one clock for all processes of a host.

Events (``"event"`` key):

- ``hook``: one extend batch in ``hooks.on_prefill_result`` on the scheduler thread:
  ``reqs`` (requests given rows), ``t0``, ``t_take`` (each request's rows checked, the
  names of those it finishes reserved: ``format.reserve``), ``t_copy`` (new requests
  opened in the arena, the rows' copy enqueued (fp8: quantized first), finished files
  queued), ``t1`` (the batch's message sent to the writer process, its acknowledgements
  read).
- ``file``: one file, recorded by the writer process: ``name``, ``bytes``, ``rows``, and
  from the scheduler ``t_start`` (the request's first rows seen) and ``t_submit`` (last
  rows sent, ``FINISH`` queued); from the writer process ``t_rows`` (its first rows'
  write starts), ``spare`` (its temporary file was a spare made ahead,
  ``writer_process.Spares``), ``t_picked`` (a writer thread took
  the ``FINISH``), ``t_copied`` (every row already in the temporary file; rows are written
  chunk by chunk as they arrive), ``t_written`` (renamed to its final name),
  ``t_released`` (index line written, lock released).
- ``store``: one store object, recorded by the store sink's writer (store_writer.py):
  ``name`` (the handle), ``bytes``, ``rows``, ``t_start``/``t_submit`` as for files,
  ``t_picked``, ``t_written`` (the put returned: the object is visible), ``t_released``;
  ``bench/report.py`` reads ``t_submit -> t_written`` as forward end to sample visible.
- ``response``: ``hooks.finish_response`` in the tokenizer manager: ``name``, ``t_meta``
  (the finished request reached it), ``t_done`` (the file was seen complete).

``bench/report.py`` joins them by ``name`` into per-stage latencies.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Optional

ENV = "KIMI_SGLANG_TRACE"

_lock = threading.Lock()
_fd: Optional[int] = None
_path: Optional[str] = None


def enabled() -> bool:
    """True when ``KIMI_SGLANG_TRACE`` names a file (read on every call: cheap)."""
    return bool(os.environ.get(ENV))


now = time.monotonic


def record(event: str, **fields: Any) -> None:
    """Append ``{"event": event, "pid": ..., **fields}`` as one line; never raises (a file
    that cannot be opened is not retried until the variable names another)."""
    global _fd, _path
    path = os.environ.get(ENV)
    if not path:
        return
    line = (json.dumps({"event": event, "pid": os.getpid(), **fields}, default=str) + "\n").encode()
    with _lock:
        if _path != path:  # first use, or the variable changed: (re)open
            if _fd is not None:
                os.close(_fd)
            _fd, _path = None, path
            try:
                _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
            except OSError:
                pass  # _fd stays None: this path is not tried again
        if _fd is not None:
            try:
                os.write(_fd, line)
            except OSError:
                pass
