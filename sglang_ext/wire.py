"""Messages between the scheduler (``writer.DumpWriter``) and the writer process
(``writer_process``), over one ``AF_UNIX`` ``SOCK_SEQPACKET`` socket pair.

Scheduler -> writer: ``(seq, ops)``, pickled, with the lock descriptors of the message's
``Finish`` ops attached (``SCM_RIGHTS``, in the order of those ops). The writer reads
arena data of a message only once the arena's sequence number reaches ``seq``
(``arena.wait_seq``); ``seq`` 0 means "no arena data".

Ops (scheduler -> writer) and acknowledgements (writer -> scheduler) are the named
tuples below; each side hands them to this module (``pack``/``recv_ops``,
``pack_acks``/``recv_acks``), so a field has one name and one place. On the socket each
travels as a plain tuple ``(code, *fields)`` (``CODES``) and is rebuilt on arrival:
pickling a named tuple costs a Python call per object, several times a plain tuple's, on the
scheduler thread.

- ``Begin(key, rid, num_tokens, row_width, dtype, piece, token_off, times)``: a
  request's first rows come; its token ids (int64 ``[num_tokens]``) are at arena offset
  ``token_off``. ``dtype`` is a torch dtype name (``"bfloat16"``), ``row_width`` the
  elements of one token's row (``num_layers * hidden_size``).
- ``Rows(key, row0, nrows, piece, off, scale_off=None)``: rows ``row0 .. row0 + nrows``
  of request ``key`` are at arena offset ``off``; for fp8 requests (``dtype``
  ``"float8_e4m3fn"``) their float32 scales (``[nrows, num_layers]``) at ``scale_off``
  of the same piece (``None`` otherwise).
- ``Finish(key, name, times)``: all rows were sent; write ``name`` (reserved by the
  scheduler: its lock descriptor rides along) and release it.
  The store sink's ``Finish`` names the object's handle and carries no descriptor.
- ``Abandon(key)``: the request went away; drop its temporary file, write nothing.
- ``MarkError(name, message)`` (store sink): put the error marker ``<name>:error``
  holding ``message``: the request was answered with its manifest, and its object will
  never come (the writer process that held it died, or its message was refused).
- ``Failures(count)``: ``count`` requests failed on the scheduler's side (refused
  before the writer saw them, or held by a writer process that died): the writer counts
  them with its own (its log line, ``kimi_sglang:dump_failures_total``). Carried out by
  the main thread, not a writer thread (no progress counted).
- ``Close(timeout_s)``: finish what was received within ``timeout_s``, then exit.

``piece`` ids name arena ranges; a range is given back when every op naming it is done.
``times``: stage timestamps while tracing (``trace``), else ``None``.

Writer -> scheduler: lists of acknowledgements, in the order they happened:

- ``DonePiece(piece, nbytes)``: one op naming arena range ``piece`` is done with it;
  ``nbytes`` is how much of it that op's data took (the writer's own gauge).
- ``Wrote(key, name, nbytes)``: file ``name`` of request ``key`` is in place and
  indexed, ``nbytes`` bytes.
- ``Failed(key, name, message)``: file ``name`` failed; ``<name>.error`` holds ``message``.
"""

from __future__ import annotations

import array
import errno
import os
import pickle
import socket
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union, get_type_hints

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


class Begin(NamedTuple):
    key: int
    rid: str
    num_tokens: int
    row_width: int
    dtype: str
    piece: int
    token_off: int
    times: Optional[Dict[str, float]] = None
    # metadata this file adds to the writer's (format.output_metadata: output rows)
    extra: Optional[Dict[str, str]] = None


class Rows(NamedTuple):
    key: int
    row0: int
    nrows: int
    piece: int
    off: int
    scale_off: Optional[int] = None  # fp8 rows only


class Finish(NamedTuple):
    key: int
    name: str
    times: Optional[Dict[str, float]] = None


class Abandon(NamedTuple):
    key: int


class Close(NamedTuple):
    timeout_s: float


class MarkError(NamedTuple):
    name: str
    message: str


class Failures(NamedTuple):
    count: int


class DonePiece(NamedTuple):
    piece: int
    nbytes: int


class Wrote(NamedTuple):
    key: int
    name: str
    nbytes: int


class Failed(NamedTuple):
    key: int
    name: str
    message: str


Op = Union[Begin, Rows, Finish, Abandon, Close, MarkError, Failures]
Ack = Union[DonePiece, Wrote, Failed]
OPS = (Begin, Rows, Finish, Abandon, Close, MarkError, Failures)
ACKS = (DonePiece, Wrote, Failed)
CODES = {cls: code for code, cls in enumerate(OPS + ACKS)}  # each type's first field on the wire
_TYPES = {code: cls for cls, code in CODES.items()}
ACKS_PER_MESSAGE = 2000  # acknowledgements in one message at most


class Message(NamedTuple):
    """One datagram: the pickled ``(seq, ops)``, the lock descriptors of its ``Finish``
    ops (in order) and the ops themselves (what fails if this message cannot be sent)."""

    blob: bytes
    fds: List[int]
    ops: List[Op]


def pack(seq: int, ops: Sequence[Op], fds: Sequence[int]) -> List[Message]:
    """Split ``ops`` (with the descriptors of their ``Finish`` ops, in order) into
    messages of at most ``MAX_MESSAGE`` bytes and ``MAX_FDS`` descriptors each. An op
    larger than ``MAX_MESSAGE`` by itself goes alone (its send may then fail with
    ``EMSGSIZE``, a fault of that message: ``is_message_fault``)."""
    out: List[Message] = []
    fd_iter = iter(fds)
    group: List[Op] = []
    group_fds: List[int] = []
    size = 0
    for op in ops:
        blob = _estimate(op)
        finish = type(op) is Finish
        if group and (size + blob > MAX_MESSAGE or (finish and len(group_fds) >= MAX_FDS)):
            out.append(Message(_dumps((seq, _flat(group))), group_fds, group))
            group, group_fds, size = [], [], 0
        group.append(op)
        size += blob
        fd = next(fd_iter, None) if finish else None
        if fd is not None:  # the file sink's lock; the store sink's Finish has none
            group_fds.append(fd)
    if group:
        out.append(Message(_dumps((seq, _flat(group))), group_fds, group))
    return out


def pack_acks(acks: Sequence[Ack]) -> Tuple[bytes, int]:
    """The next message of ``acks`` (non-empty): ``(blob, n)``, the first ``n`` of them
    pickled, at most ``ACKS_PER_MESSAGE`` and about ``MAX_MESSAGE`` bytes (at least one)."""
    size = n = 0
    for ack in acks[:ACKS_PER_MESSAGE]:
        size += _estimate(ack)
        if n and size > MAX_MESSAGE:
            break
        n += 1
    return _dumps(_flat(acks[:n])), n


def _dumps(payload: Any) -> bytes:
    return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)


def _flat(msgs: Sequence[tuple]) -> List[tuple]:
    """Named tuples as they travel: ``(code, *fields)``."""
    return [(CODES[type(m)],) + m for m in msgs]


def _named(rows: Any, kinds: tuple) -> Optional[list]:
    """``_flat``'s rows as their named tuples; ``None`` unless ``rows`` is a list of
    rows of types in ``kinds`` with all their fields."""
    if not isinstance(rows, list):
        return None
    out = []
    for row in rows:
        cls = _TYPES.get(row[0]) if isinstance(row, tuple) and row and type(row[0]) is int else None
        if cls not in kinds or len(row) != len(cls._fields) + 1:
            return None
        out.append(tuple.__new__(cls, row[1:]))  # C-level: no Python __new__ per row
    return out


def _estimate(msg: tuple) -> int:
    """An upper bound of ``msg``'s pickled size, without pickling it: 64 bytes for the
    type and a field, plus 4 bytes a character of its str fields (``_STR_FIELDS``)."""
    cls = type(msg)
    n = _BASE_BYTES[cls]
    for i in _STR_FIELDS[cls]:
        n += 4 * len(msg[i])
    if cls is Begin and msg.extra:
        n += sum(4 * (len(k) + len(v)) + 16 for k, v in msg.extra.items())
    return n


_STR_FIELDS = {cls: tuple(i for i, t in enumerate(get_type_hints(cls).values()) if t is str)
               for cls in OPS + ACKS}
_BASE_BYTES = {cls: 64 * (1 + len(cls._fields)) for cls in OPS + ACKS}


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


def recv_ops(sock: socket.socket, flags: int = 0,
             locks: bool = True) -> Optional[Tuple[int, List[Op], List[int]]]:
    """(Writer side) one message of ops: ``(seq, ops, lock descriptors of its Finish
    ops)``; ``None`` when the scheduler's end closed. Raises what ``recv`` raises, and
    ``BadMessage`` for a message that is not ``(seq, [op, ...])`` or whose descriptors
    do not match its ``Finish`` ops (its descriptors closed): one per ``Finish`` with
    ``locks`` (the file sink), none without (the store sink)."""
    payload, fds = recv(sock, flags)
    if payload is None:
        return None
    why = None
    ok = isinstance(payload, tuple) and len(payload) == 2 and isinstance(payload[0], int)
    ops = _named(payload[1], OPS) if ok else None
    if ops is None:
        why = f"a message of ops is not (seq, [op, ...]) but a {type(payload).__name__}"
    else:
        finishes = sum(type(op) is Finish for op in ops) if locks else 0
        if finishes != len(fds):
            why = (f"a message of {finishes} Finish ops came with {len(fds)} descriptors "
                   f"(one per Finish expected)")
    if why is not None:
        for fd in fds:
            close_quiet(fd)
        raise BadMessage(why)
    return payload[0], ops, fds


def recv_acks(sock: socket.socket, flags: int = 0) -> Optional[List[Ack]]:
    """(Scheduler side) one message of acknowledgements; ``None`` when the writer's end
    closed. Raises what ``recv`` raises, and ``BadMessage`` for anything but a list of
    ``DonePiece``/``Wrote``/``Failed`` (descriptors, which acks never carry, closed)."""
    payload, fds = recv(sock, flags)
    for fd in fds:
        close_quiet(fd)
    if payload is None:
        return None
    acks = _named(payload, ACKS)
    if acks is None:
        raise BadMessage(f"a message of acknowledgements is not a list of them: {type(payload).__name__}")
    return acks


class BadMessage(ValueError):
    """A message that arrived but cannot be read (cut short, not a pickle)."""


def close_quiet(fd: int) -> None:
    """Close ``fd``, ignoring errors (a descriptor that may already be gone)."""
    try:
        os.close(fd)
    except OSError:
        pass
