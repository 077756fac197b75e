"""Messages between the scheduler (``writer.DumpWriter``) and the writer process
(``writer_process``), over one ``AF_UNIX`` ``SOCK_SEQPACKET`` socket pair.

Scheduler -> writer: ``(seq, ops)``, pickled, with the lock descriptors of the message's
``FINISH`` ops attached (``SCM_RIGHTS``, in the order of those ops). The writer reads
arena data of a message only once the arena's sequence number reaches ``seq``
(``arena.wait_seq``); ``seq`` 0 means "no arena data".

Ops are tuples, first element the kind:

- ``(BEGIN, key, rid, num_tokens, row_width, dtype, piece, token_off, times)``: a
  request's first rows come; its token ids (int64 ``[num_tokens]``) are at arena offset
  ``token_off``. ``dtype`` is a torch dtype name (``"bfloat16"``), ``row_width`` the
  elements of one token's row (``num_layers * hidden_size``).
- ``(ROWS, key, row0, nrows, piece, off)``: rows ``row0 .. row0 + nrows`` of request
  ``key`` are at arena offset ``off``. fp8 requests (``dtype`` ``"float8_e4m3fn"``):
  ``(ROWS, key, row0, nrows, piece, off, scale_off)``, the rows' float32 scales
  (``[nrows, num_layers]``) at arena offset ``scale_off`` of the same piece.
- ``(FINISH, key, name, times)``: all rows were sent; write ``name`` (reserved by the
  scheduler: its lock descriptor rides along) and release it.
- ``(ABANDON, key)``: the request went away; drop its temporary file, write nothing.
- ``(CLOSE, timeout_s)``: finish what was received within ``timeout_s``, then exit.

``piece`` ids name arena ranges; a range is given back when every op naming it is done.

Writer -> scheduler (acknowledgements), pickled lists of events:
``(DONE_PIECE, piece)``, ``(WROTE, key, name, nbytes)``, ``(FAILED, key, name, message)``.
"""

from __future__ import annotations

import array
import errno
import os
import pickle
import socket
from typing import Any, List, NamedTuple, Sequence, Tuple

BEGIN, ROWS, FINISH, ABANDON, CLOSE = "begin", "rows", "finish", "abandon", "close"
DONE_PIECE, WROTE, FAILED = "piece", "wrote", "failed"

# One datagram at most: Linux caps a SOCK_SEQPACKET message by the socket's send buffer
# (net.core.wmem_max, 208 KiB by default); stay well below.
MAX_MESSAGE = 64 * 1024
RECV_BYTES = 1 << 20  # larger than any message the kernel lets through
MAX_FDS = 200  # SCM_MAX_FD is 253
BUFFER_BYTES = 4 << 20


def socket_pair() -> Tuple[socket.socket, socket.socket]:
    """(scheduler end, writer end); buffers enlarged as far as the host allows."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (a, b):
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                s.setsockopt(socket.SOL_SOCKET, opt, BUFFER_BYTES)
            except OSError:
                pass
    return a, b


class Message(NamedTuple):
    """One datagram: the pickled ``(seq, ops)``, the lock descriptors of its FINISH ops
    (in order) and the ops themselves (what fails if this message cannot be sent)."""

    blob: bytes
    fds: List[int]
    ops: List[tuple]


def pack(seq: int, ops: Sequence[tuple], fds: Sequence[int]) -> List[Message]:
    """Split ``ops`` (with the descriptors of their FINISH ops, in order) into messages
    of at most ``MAX_MESSAGE`` bytes and ``MAX_FDS`` descriptors each. An op larger than
    ``MAX_MESSAGE`` by itself goes alone (its send may then fail with ``EMSGSIZE``, a
    fault of that message: ``is_message_fault``)."""
    out: List[Message] = []
    fd_iter = iter(fds)
    group: List[tuple] = []
    group_fds: List[int] = []
    size = 0
    for op in ops:
        blob = _estimate(op)
        if group and (size + blob > MAX_MESSAGE or (op[0] == FINISH and len(group_fds) >= MAX_FDS)):
            out.append(Message(pickle.dumps((seq, group), protocol=pickle.HIGHEST_PROTOCOL), group_fds, group))
            group, group_fds, size = [], [], 0
        group.append(op)
        size += blob
        if op[0] == FINISH:
            group_fds.append(next(fd_iter))
    if group:
        out.append(Message(pickle.dumps((seq, group), protocol=pickle.HIGHEST_PROTOCOL), group_fds, group))
    return out


def _estimate(op: tuple) -> int:
    """An upper bound of ``op``'s pickled size, without pickling it (strings at 4 bytes
    per character, anything else at 64 bytes a field)."""
    return sum(4 * len(x) + 16 if isinstance(x, str) else 64 for x in op)


# errnos of a send that failed for a reason of the message itself (too large, too many
# descriptors), not of the peer: the writer is healthy and must not be replaced for it.
MESSAGE_FAULTS = (errno.EMSGSIZE, errno.ETOOMANYREFS, errno.EINVAL)


def is_message_fault(e: OSError) -> bool:
    """True when a failed ``send`` says nothing about the peer (see ``MESSAGE_FAULTS``)."""
    return not isinstance(e, BlockingIOError) and e.errno in MESSAGE_FAULTS


def send(sock: socket.socket, blob: bytes, fds: Sequence[int] = ()) -> None:
    """One message; raises ``OSError`` (``BrokenPipeError`` when the peer is gone,
    ``EMSGSIZE`` for a message the socket or the receiver (``RECV_BYTES``) cannot take:
    ``is_message_fault``)."""
    if len(blob) > RECV_BYTES:
        raise OSError(errno.EMSGSIZE, f"a {len(blob)}-byte message is larger than the "
                                      f"{RECV_BYTES} bytes the receiver reads")
    if fds:
        sock.sendmsg([blob], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(blob)


def recv(sock: socket.socket, flags: int = 0) -> Tuple[Any, List[int]]:
    """One message: ``(payload, descriptors)``; ``(None, [])`` when the peer closed.
    Raises ``BlockingIOError`` for ``MSG_DONTWAIT`` with nothing to read and
    ``BadMessage`` for a message cut short or not unpicklable (its descriptors closed)."""
    fds = array.array("i")
    data, anc, msg_flags, _ = sock.recvmsg(RECV_BYTES, socket.CMSG_SPACE(MAX_FDS * fds.itemsize), flags)
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if not data:
        for fd in fds:
            close_quiet(fd)
        return None, []
    try:
        if msg_flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise ValueError("the message was cut short")
        return pickle.loads(data), list(fds)
    except Exception as e:  # noqa: BLE001 - whatever unpickling raises
        for fd in fds:
            close_quiet(fd)
        raise BadMessage(f"a {len(data)}-byte message could not be read: {e}") from None


class BadMessage(ValueError):
    """A message that arrived but cannot be read (cut short, not a pickle)."""


def close_quiet(fd: int) -> None:
    """Close ``fd``, ignoring errors (a descriptor that may already be gone)."""
    try:
        os.close(fd)
    except OSError:
        pass
