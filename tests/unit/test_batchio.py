"""pybroker._native.batchio: batched reads and writes over real socket pairs, the C calls
(csrc/nsqio.c) and the pure twin giving the same per-socket results: bytes, 0 for a
closed peer, -errno (EAGAIN for nothing now, EPIPE/ECONNRESET for a broken one), and a
socket that takes only part of its bytes."""
from __future__ import annotations

import errno
import socket
import time
from collections.abc import Iterator

import pytest

from pybroker._native import batchio
from pybroker._native.batchio import BatchIO, Sender
from pybroker.testing import wait_until

MODES = ["c", "pure"] if batchio._C else ["pure"]


@pytest.fixture(params=MODES)
def bio(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> BatchIO:
    monkeypatch.setattr(batchio, "_C", request.param == "c")
    return BatchIO()


@pytest.fixture(autouse=True)
def c_for_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C calls for any number of sockets here (the loop leaves a few to Python)."""
    monkeypatch.setattr(batchio, "C_FROM", 1)


@pytest.fixture
def pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    made = [socket.socketpair() for _ in range(4)]
    for a, b in made:
        a.setblocking(False)
        b.setblocking(False)
    yield made
    for a, b in made:
        a.close()
        b.close()


def fds(socks: list[socket.socket]) -> list[int]:
    return [s.fileno() for s in socks]


def test_recv_many_packs_each_sockets_bytes(bio: BatchIO,
                                            pairs: list[tuple[socket.socket, socket.socket]]
                                            ) -> None:
    mine = [a for a, _ in pairs]
    pairs[0][1].send(b"hello")
    pairs[2][1].send(b"x" * 300)          # more than a piece: the rest waits
    pairs[3][1].close()                   # the peer closed
    buf = bytearray(1024)
    starts, got = bio.recv_many(mine, fds(mine), buf, 256)
    assert got == [5, -errno.EAGAIN, 256, 0]
    assert bytes(buf[starts[0]:starts[0] + 5]) == b"hello"
    assert bytes(buf[starts[2]:starts[2] + 256]) == b"x" * 256
    assert starts[2] == 5                 # packed one after another
    # the next read has the rest
    assert bio.recv_many([mine[2]], fds([mine[2]]), buf, 256)[1] == [44]


def test_recv_many_stops_before_a_piece_that_may_not_fit(
        bio: BatchIO, pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    mine = [a for a, _ in pairs]
    for _, b in pairs:
        b.send(b"a" * 40)
    buf = bytearray(100)
    # two full pieces of 40 used 80 bytes: a third could pass 100, so it waits
    assert bio.recv_many(mine, fds(mine), buf, 40)[1] == [40, 40]
    # short reads leave room: all are read (packed, not a piece apart)
    for _, b in pairs:
        b.send(b"abc")
    assert bio.recv_many(mine, fds(mine), buf, 40)[1] == [3, 3, 40, 40]


def test_send_many_reports_each_socket(bio: BatchIO,
                                       pairs: list[tuple[socket.socket, socket.socket]]
                                       ) -> None:
    mine = [a for a, _ in pairs]
    pairs[1][1].close()                   # a broken peer: EPIPE (no SIGPIPE)
    big = b"y" * (8 << 20)                # more than a socket buffer: a partial write
    datas = [b"one", b"two", big, b""]
    sent = bio.send_many(mine, fds(mine), b"".join(datas), [len(d) for d in datas])
    assert sent[0] == 3 and pairs[0][1].recv(10) == b"one"
    assert sent[1] in (-errno.EPIPE, -errno.ECONNRESET)
    assert 0 < sent[2] < len(big)
    assert sent[3] == 0
    # a socket whose buffer is full takes none now
    rest = big[sent[2]:]
    assert bio.send_many([mine[2]], fds([mine[2]]), rest, [len(rest)]) == [-errno.EAGAIN]


def test_many_sockets_grow_the_arrays(bio: BatchIO) -> None:
    made = [socket.socketpair() for _ in range(100)]
    try:
        mine = [a for a, _ in made]
        for a, b in made:
            a.setblocking(False)
            b.send(b"ab")
        starts, got = bio.recv_many(mine, fds(mine), bytearray(100 * 64), 64)
        assert got == [2] * 100 and starts == list(range(0, 200, 2))
        assert bio.send_many(mine, fds(mine), b"xy" * 100, [2] * 100) == [2] * 100
        assert all(b.recv(4) == b"xy" for _, b in made)
    finally:
        for a, b in made:
            a.close()
            b.close()


# -- the sender: send_many on a thread of its own ------------------------------------------
needs_sender = pytest.mark.skipif(not batchio._SENDER,
                                  reason="the sender thread needs the compiled codec")


@pytest.fixture(params=[0, batchio.SENDER_SPIN_NS], ids=["sleeps", "spins"])
def sender(request: pytest.FixtureRequest) -> Iterator[Sender]:
    """A thread that sleeps between jobs at once, or looks for the next one first."""
    s = Sender(request.param)
    yield s
    s.close()


@needs_sender
def test_sender_reports_each_socket_as_send_many_does(
        sender: Sender, pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    mine = [a for a, _ in pairs]
    pairs[1][1].close()
    big = b"y" * (8 << 20)
    datas = [b"one", b"two", big, b""]
    assert sender.available()
    assert not sender.busy()              # nothing posted
    sender.post(fds(mine), bytearray(b"".join(datas)), [len(d) for d in datas])
    wait_until(lambda: not sender.busy(), timeout_s=5, what="the job done")
    sent = sender.wait()                  # done: at once
    assert sent[0] == 3 and pairs[0][1].recv(10) == b"one"
    assert sent[1] in (-errno.EPIPE, -errno.ECONNRESET)
    assert 0 < sent[2] < len(big)
    assert sent[3] == 0
    # jobs one after another, the arrays grown for more sockets than before
    made = [socket.socketpair() for _ in range(100)]
    try:
        for a, _ in made:
            a.setblocking(False)
        for k in range(3):
            data = bytes([65 + k]) * 200
            sender.post(fds([a for a, _ in made]), data, [2] * 100)
            assert sender.wait() == [2] * 100
            time.sleep(0.3 * k)   # the next job finds the thread asleep (past any spin)
        assert all(b.recv(16) == b"AABBCC" for _, b in made)
    finally:
        for a, b in made:
            a.close()
            b.close()


@needs_sender
def test_a_sender_closed_with_a_job_posted_finishes_it(
        sender: Sender, pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    mine = [a for a, _ in pairs]
    assert sender.available()
    sender.post(fds(mine), b"abcd" * 4, [4, 4, 4, 4])
    sender.close()          # joins the thread after the job
    assert [b.recv(8) for _, b in pairs] == [b"abcd"] * 4
    sender.close()          # twice: nothing more


def test_no_sender_without_the_compiled_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batchio, "_SENDER", False)
    s = Sender()
    assert not s.available()   # the loop then writes its jobs itself
    s.close()
