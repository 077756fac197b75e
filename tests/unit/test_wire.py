"""The messages between the scheduler and the writer process (sglang_ext/wire.py), over a
real socket pair: what one side packs, the other reads back as the same named types, with
the lock descriptors of the ``Finish`` ops in order; what is not a message of the
expected kind is refused as ``BadMessage`` with its descriptors closed."""

import os
import pickle
import socket

import pytest

from sglang_ext import wire


@pytest.fixture
def pair():
    a, b = wire.socket_pair()
    yield a, b
    a.close()
    b.close()


def _inode(fd):
    return os.fstat(fd).st_ino


def _open_to(path):
    """This process's descriptors of ``path``."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                out.append(int(fd))
        except OSError:
            pass  # the listing's own descriptor, gone
    return out


def test_ops_arrive_as_sent_with_their_locks_in_order(pair, tmp_path):
    sched, writer = pair
    locks = [os.open(tmp_path / f"lock{i}", os.O_CREAT | os.O_RDWR) for i in range(3)]
    want = [_inode(fd) for fd in locks]
    ops = [wire.Begin(0, "r0", 4, 16, "bfloat16", 0, 512, {"t_start": 1.5}),
           wire.Rows(0, 0, 4, 1, 1024),
           wire.Rows(1, 2, 3, 1, 2048, scale_off=4096),
           wire.Finish(0, "r0.safetensors"), wire.Abandon(2),
           wire.Finish(1, "r1.safetensors", {"t_submit": 2.0}), wire.Finish(3, "r3.safetensors"),
           wire.Close(5.0)]
    [msg] = wire.pack(7, ops, locks)
    wire.send(sched, msg.blob, msg.fds)
    for fd in locks:
        os.close(fd)
    seq, got, fds = wire.recv_ops(writer)
    assert seq == 7 and got == ops and [type(op) for op in got] == [type(op) for op in ops]
    assert got[1].scale_off is None and got[2].scale_off == 4096 and got[3].times is None
    assert [_inode(fd) for fd in fds] == want
    for fd in fds:
        os.close(fd)


def test_many_ops_split_into_messages_within_the_bounds(pair):
    sched, writer = pair
    ops = [wire.Rows(k, 0, 1, k, 512 * k) for k in range(5000)]
    msgs = wire.pack(1, ops, [])
    assert len(msgs) > 1 and all(len(m.blob) <= wire.MAX_MESSAGE for m in msgs)
    got = []
    for m in msgs:
        wire.send(sched, m.blob)
        seq, part, fds = wire.recv_ops(writer)
        assert seq == 1 and fds == [] and part == m.ops
        got += part
    assert got == ops


def test_acks_arrive_as_sent_in_messages_of_bounded_size(pair):
    sched, writer = pair
    acks = [wire.DonePiece(i, 64 * i) for i in range(4500)]
    acks += [wire.Wrote(1, "a.safetensors", 8192), wire.Failed(2, "b.safetensors", "disk full")]
    got, rest = [], list(acks)
    while rest:
        blob, n = wire.pack_acks(rest)
        assert 1 <= n <= wire.ACKS_PER_MESSAGE and len(blob) <= wire.MAX_MESSAGE
        writer.send(blob)
        del rest[:n]
        got += wire.recv_acks(sched)
    assert got == acks and type(got[-1]) is wire.Failed and got[-1].message == "disk full"


def test_a_message_of_the_wrong_kind_is_refused_and_its_descriptors_closed(pair, tmp_path):
    sched, writer = pair
    lock = os.open(tmp_path / "lock", os.O_CREAT | os.O_RDWR)
    # a Finish's descriptor sent with acks, and ops without their descriptor
    wire.send(writer, wire.pack_acks([wire.DonePiece(0, 1)])[0], [lock])
    wire.send(sched, wire.pack(1, [wire.Finish(0, "x.safetensors")], [lock])[0].blob)
    wire.send(sched, pickle.dumps([("piece", 0, 1)]))
    wire.send(sched, pickle.dumps((1, [wire.Rows(0, 0, 1, 0, 0)])))  # not as ops travel
    os.close(lock)
    assert wire.recv_acks(sched) == [wire.DonePiece(0, 1)]
    assert _open_to(tmp_path / "lock") == [], "the descriptor that came with acks is closed"
    with pytest.raises(wire.BadMessage, match="1 Finish ops came with 0 descriptors"):
        wire.recv_ops(writer)
    with pytest.raises(wire.BadMessage, match="not \\(seq"):
        wire.recv_ops(writer)
    with pytest.raises(wire.BadMessage, match="not \\(seq"):
        wire.recv_ops(writer)
    writer.close()
    assert wire.recv_acks(sched) is None


def test_the_peer_closing_reads_as_none(pair):
    sched, writer = pair
    sched.close()
    assert wire.recv_ops(writer, socket.MSG_DONTWAIT) is None
