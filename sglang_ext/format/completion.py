"""The completion lock: releasing a reservation (``complete``, ``cancel``, ``fail``) and
waiting for it (``wait_complete``, ``wait_complete_async``; inotify where it works)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import os
import stat
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .keys import LOCK_SUFFIX, ERROR_SUFFIX
from .files import kind_of, open_regular, _unlink_never_raises, _close_never_raises
from .names import Reservation, tmp_name
from .write import create_tmp

__all__ = [
    "complete", "cancel", "fail", "ERROR_MAX_BYTES", "POLL_FIRST_S", "POLL_MAX_S",
    "SETTLE_S", "wait_complete", "wait_complete_async",
]


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
