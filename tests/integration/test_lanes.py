"""Many plain publishers, and many consumers finishing, at once (the cases server/lane.py
reads in one pass per loop turn): pipelined PUBs and MPUBs answered OK each, every
message delivered once, FINs freeing each consumer's slot for the next, and, in the same
turns, connections with bad or unusual input answered exactly as nsqd answers them. Runs against pybroker and a real nsqd (when on PATH) with the same
assertions."""
from __future__ import annotations

import select
import socket
import struct
import time
from collections.abc import Callable

from tests.support import wire
from tests.support.broker import BrokerProcess, unique_name
from tests.support.wire import WireClient, subscribe

Connect = Callable[..., WireClient]


def _drain(c: WireClient, n: int) -> list[bytes]:
    msgs = c.read_messages(n, timeout=20)
    c.send(b"".join(wire.fin(m.id) for m in msgs))
    return [m.body for m in msgs]


def test_many_connections_pipelining_publishes_get_an_ok_each(any_broker: BrokerProcess,
                                                             connect: Connect) -> None:
    topic = unique_name()
    conns = [connect(any_broker) for _ in range(24)]
    sent: list[bytes] = []
    per_conn: list[int] = []
    for i, c in enumerate(conns):
        bodies = [b"c%d-%d" % (i, j) for j in range(8)]
        # PUB, PUB, MPUB of 5, PUB: four commands in one send
        data = (wire.pub(topic, bodies[0]) + wire.pub(topic, bodies[1])
                + wire.mpub(topic, bodies[2:7]) + wire.pub(topic, bodies[7]))
        c.send(data)
        sent += bodies
        per_conn.append(4)
    for c, n in zip(conns, per_conn):
        for _ in range(n):
            c.expect_response(b"OK")
        c.assert_alive()
    reader = connect(any_broker)
    subscribe(reader, topic, "ch", rdy=len(sent))
    got = _drain(reader, len(sent))
    assert sorted(got) == sorted(sent)
    reader.expect_nothing(0.3)          # each message once


def test_bad_and_odd_publishers_beside_good_ones(any_broker: BrokerProcess,
                                                 connect: Connect) -> None:
    topic, other = unique_name(), unique_name()
    good = [connect(any_broker) for _ in range(6)]
    bad_name, zero, bad_count, two_topics, half, crlf, extra = (
        connect(any_broker) for _ in range(7))
    half_cmd = wire.pub(topic, b"half")
    for c in good:
        c.send(wire.pub(topic, b"good"))
    bad_name.send(wire.pub("bad*name", b"x"))
    zero.send(b"PUB " + topic.encode() + b"\n" + struct.pack(">i", 0))
    bad_count.send(b"MPUB " + topic.encode() + b"\n" + wire.sized(struct.pack(">i", 0)))
    two_topics.send(wire.pub(topic, b"two-a") + wire.pub(other, b"two-b"))
    half.send(half_cmd[:-2])
    crlf.send(b"PUB " + topic.encode() + b"\r\n" + wire.sized(b"crlf"))
    extra.send(b"PUB " + topic.encode() + b" extra\n" + wire.sized(b"extra"))
    for c in good:
        c.expect_response(b"OK")
    bad_name.expect_error("E_BAD_TOPIC")
    zero.expect_error("E_BAD_MESSAGE", prefix="E_BAD_MESSAGE PUB invalid message body size 0")
    bad_count.expect_error("E_BAD_BODY", prefix="E_BAD_BODY MPUB invalid message count 0")
    two_topics.expect_response(b"OK")
    two_topics.expect_response(b"OK")
    crlf.expect_response(b"OK")
    extra.expect_response(b"OK")
    half.expect_nothing(0.3)             # waits for the rest of its command
    half.send(half_cmd[-2:])
    half.expect_response(b"OK")
    reader = connect(any_broker)
    subscribe(reader, topic, "ch", rdy=20)
    want = [b"good"] * 6 + [b"two-a", b"half", b"crlf", b"extra"]
    assert sorted(_drain(reader, len(want))) == sorted(want)
    reader.expect_nothing(0.3)
    r2 = connect(any_broker)
    subscribe(r2, other, "ch", rdy=5)
    assert _drain(r2, 1) == [b"two-b"]


def test_a_publisher_that_subscribes_later_is_served_as_a_consumer(
        any_broker: BrokerProcess, connect: Connect) -> None:
    topic = unique_name()
    c = connect(any_broker)
    c.send(wire.pub(topic, b"one") + wire.mpub(topic, [b"two", b"three"]))
    c.expect_response(b"OK")
    c.expect_response(b"OK")
    c.send(wire.sub(topic, "ch") + wire.rdy(3))
    c.expect_response(b"OK")
    assert sorted(_drain(c, 3)) == [b"one", b"three", b"two"]
    c.send(wire.pub(topic, b"four"))     # a consumer may still publish
    c.expect_response(b"OK")
    assert _drain(c, 1) == [b"four"]


def test_many_consumers_finishing_at_once_each_get_the_next(any_broker: BrokerProcess,
                                                          connect: Connect) -> None:
    """Consumers at RDY 1 whose input is nothing but FINs (read together at the end of a
    turn): each FIN frees the slot for the next message; a FIN of an id not in flight
    gets E_FIN_FAILED naming that id, and the connection stays."""
    bodies = [b"m%d" % i for i in range(60)]
    consumers = _rdy1_consumers(any_broker, connect, bodies, 6)
    got: list[bytes] = []
    for _ in range(9):
        msgs = [c.read_message(timeout=10) for c in consumers]
        got += [m.body for m in msgs]
        for c, m in zip(consumers, msgs):
            c.send(wire.fin(m.id))
    bad = consumers[0]
    m = bad.read_message(timeout=10)
    bad.send(wire.fin(b"00000000000000ff"))
    bad.expect_error("E_FIN_FAILED", prefix="E_FIN_FAILED FIN 00000000000000ff failed")
    bad.send(wire.fin(m.id))
    got.append(m.body)
    # the rest from whichever consumer has one (each of the others, mostly; nsqd once
    # gave one of them none within 10 s on a loaded CI machine)
    got += _drain_rdy1(consumers, 60 - len(got))
    assert sorted(got) == sorted(bodies)
    for c in consumers:
        c.assert_alive()


def test_one_fin_each_with_another_consumers_id_and_an_unknown_one_among_them(
        any_broker: BrokerProcess, connect: Connect) -> None:
    """Consumers at RDY 1 each sending one FIN at once (read together in one turn, the
    steady state at RDY 1), one of them naming the message another consumer holds and
    one an id never sent: those two get E_FIN_FAILED and keep their own message; the
    other's message stays in flight to it; every other FIN frees its slot."""
    bodies = [b"s%d" % i for i in range(40)]
    consumers = _rdy1_consumers(any_broker, connect, bodies, 8)
    msgs = [c.read_message(timeout=10) for c in consumers]
    thief, stranger = consumers[0], consumers[1]
    fins = [wire.fin(m.id) for m in msgs]
    fins[0] = wire.fin(msgs[2].id)              # consumers[2]'s message
    fins[1] = wire.fin(b"00000000000fffff")     # never sent
    fins[2] = b""                               # (its owner waits)
    for c, fin in zip(consumers, fins):
        if fin:
            c.send(fin)
    thief.expect_error("E_FIN_FAILED", prefix=b"E_FIN_FAILED FIN " + msgs[2].id + b" failed")
    stranger.expect_error("E_FIN_FAILED",
                          prefix="E_FIN_FAILED FIN 00000000000fffff failed")
    got = [m.body for m in msgs]
    for c in consumers[3:]:                     # their slots are free: the next comes
        m = c.read_message(timeout=10)
        got.append(m.body)
        c.send(wire.fin(m.id))
    for c, m in zip(consumers[:3], msgs):       # still theirs: their own FINs work
        c.send(wire.fin(m.id))
    got += _drain_rdy1(consumers, len(bodies) - len(got))
    assert sorted(got) == sorted(bodies)
    for c in consumers:
        c.assert_alive()
        c.expect_nothing(0.05)


def _rdy1_consumers(b: BrokerProcess, connect: Connect, bodies: list[bytes],
                    n: int) -> list[WireClient]:
    """bodies published to a new topic, then n consumers of its channel "ch" at RDY 1."""
    topic = unique_name()
    assert b.tcp_address is not None
    wire.publish(b.tcp_address, topic, bodies)
    consumers = [connect(b) for _ in range(n)]
    for c in consumers:
        subscribe(c, topic, "ch", rdy=1)
    return consumers


def _drain_rdy1(consumers: list[WireClient], n: int, timeout: float = 30) -> list[bytes]:
    """Read and FIN n messages from whichever consumer has one (a broker may give the
    last ones to any of them)."""
    out: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        left = deadline - time.monotonic()
        assert left > 0, f"{len(out)} of {n} messages in {timeout} s"
        ready = [c for c in consumers if c.pending]
        if not ready:
            readable = select.select([c.sock for c in consumers], [], [], left)[0]
            ready = [c for c in consumers if c.sock in readable]
        for c in ready:
            if len(out) < n:
                m = c.read_message(timeout=10)
                out.append(m.body)
                c.send(wire.fin(m.id))
    return out


def test_a_stalled_and_a_vanished_consumer_beside_ones_finishing(
        any_broker: BrokerProcess, connect: Connect) -> None:
    """The end of a turn writes its plain connections' frames together: a consumer that
    stops reading (the socket takes part of its frames, the rest is owed) and one that
    resets its connection (the write fails) are in the same turns as consumers at RDY 1
    finishing; those get every message once, the stalled one gets all of its messages
    intact once it reads again, and the broker still answers everyone."""
    topic = unique_name()
    bodies = [b"%05d" % i + b"x" * 2000 for i in range(400)]
    stalled, gone = connect(any_broker), connect(any_broker)
    consumers = [connect(any_broker) for _ in range(6)]
    # every channel exists before the messages come (nsqd copies a message only to the
    # channels its topic has then)
    for c, ch in [(stalled, "stalled"), *((c, "ch") for c in consumers)]:
        subscribe(c, topic, ch, rdy=0)
    # its messages in flight come back after a second (as nsqd does it: by timeout)
    subscribe(gone, topic, "gone", rdy=0, msg_timeout=1000)
    assert any_broker.tcp_address is not None
    wire.publish(any_broker.tcp_address, topic, bodies)
    stalled.send(wire.rdy(400))           # ~800 KB of frames, read only later
    gone.send(wire.rdy(50))
    gone.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    gone.sock.close()                     # a reset, with frames on their way
    for c in consumers:
        c.send(wire.rdy(1))
    got = _drain_rdy1(consumers, len(bodies))
    assert sorted(got) == sorted(bodies)
    late = stalled.read_messages(len(bodies), timeout=30)
    assert sorted(m.body for m in late) == sorted(bodies)
    for c in [stalled, *consumers]:
        c.assert_alive()
    again = connect(any_broker)          # the vanished one's messages are not lost
    subscribe(again, topic, "gone", rdy=400)
    assert sorted(m.body for m in again.read_messages(len(bodies), timeout=30)) == \
        sorted(bodies)


def test_publishers_that_read_their_oks_late_get_every_one_whole(
        any_broker: BrokerProcess) -> None:
    """Publishers with a small receive buffer pipeline tens of thousands of PUBs before
    reading a byte (their OKs pile up in the broker's send buffers while more of their
    publishes come in through the lane): each then reads exactly one whole OK frame per
    PUB, nothing else, and every message is stored once."""
    topic = unique_name()
    n, k = 20000, 4
    socks = []
    for _ in range(k):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)     # before connect
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(20)
        assert any_broker.tcp_address is not None
        s.connect(any_broker.tcp_address)
        s.sendall(b"  V2")
        socks.append(s)
    for start in range(0, n, 250):          # in sends of 250, all connections in turn
        for i, s in enumerate(socks):
            s.sendall(b"".join(wire.pub(topic, b"%d-%d" % (i, j))
                               for j in range(start, start + 250)))
    # a heartbeat may come between the OKs when this outlasts its interval (30 s: a
    # slow machine under the suite's workers); the rest must be OKs, whole, one a PUB
    heartbeat = wire.encode_frame(0, wire.HEARTBEAT)
    for s in socks:
        got = b""
        while len(got.replace(heartbeat, b"")) < 10 * n:
            chunk = s.recv(65536)
            assert chunk, f"closed after {len(got)} bytes"
            got += chunk
        assert got.replace(heartbeat, b"") == wire.encode_frame(0, b"OK") * n
        s.settimeout(0.3)
        try:
            extra = s.recv(64)
        except socket.timeout:
            extra = b""
        assert extra == b"", extra
        s.close()
    c = WireClient.connect(any_broker.tcp_address)
    subscribe(c, topic, "ch", rdy=2500)
    got_bodies = []
    while len(got_bodies) < n * k:
        got_bodies += _drain(c, min(2500, n * k - len(got_bodies)))
    assert sorted(got_bodies) == sorted(b"%d-%d" % (i, j) for i in range(k)
                                        for j in range(n))
    c.expect_nothing(0.3)
