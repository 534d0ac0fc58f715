"""A dispatch pass's deliveries, written at once or queued (server/loop.py,
``EventLoop.deliver``): consumers at RDY 1 (whose frames the loop writes straight from
the pass's buffer, many sockets in one C call) beside consumers whose output buffering
keeps their frames queued, in the same passes; and a consumer whose socket takes only
part of a write; consumers that reset. Every message must arrive whole (once, but for
those in flight to a consumer that reset). All but the second run against pybroker and
a real nsqd (when on PATH) with the same assertions."""
from __future__ import annotations

import select
import socket
import struct
import time
from collections.abc import Callable

from pybroker._native.batchio import C_FROM
from tests.support.broker import BrokerProcess, unique_name
from tests.support.wire import WireClient, publish, subscribe

Connect = Callable[..., WireClient]


def _take(c: WireClient, got: dict[bytes, int], wait: float) -> int:
    """Read the messages that begin to come to c within ``wait`` seconds (then within
    20 ms of the last), FIN them, count their bodies."""
    n = 0
    while c.pending or select.select([c.sock], [], [], wait)[0]:
        m = c.read_message(10)   # a frame begun is read whole, however slowly it comes
        got[m.body] = got.get(m.body, 0) + 1
        c.fin(m.id)
        n += 1
        wait = 0.02              # more may follow at once
    return n


def test_rdy1_consumers_beside_buffered_ones_get_every_message_once(
        any_broker: BrokerProcess, connect: Connect) -> None:
    topic = unique_name()
    bodies = [b"m%04d-" % i + b"x" * (i % 97) for i in range(600)]
    # first the consumers, then the messages: passes that serve all of them at once
    direct = [subscribe(connect(any_broker), topic, "ch", rdy=1) for _ in range(10)]
    # these keep frames in their output buffer (1 s) until RDY 50 is used up: queued
    buffered = [subscribe(connect(any_broker), topic, "ch", rdy=50,
                          output_buffer_timeout=1000) for _ in range(6)]
    consumers = [c for pair in zip(direct, buffered) for c in pair] + direct[6:]
    assert any_broker.tcp_address is not None
    publish(any_broker.tcp_address, topic, bodies[:300])
    with WireClient.connect(any_broker.tcp_address) as p:
        p.mpub(topic, bodies[300:])
    got: dict[bytes, int] = {}
    deadline = time.monotonic() + 30
    while len(got) < len(bodies) and time.monotonic() < deadline:
        for c in consumers:
            _take(c, got, 0.005)
    assert sorted(got) == sorted(bodies)
    assert set(got.values()) == {1}
    for c in consumers:
        c.assert_alive()
        c.expect_nothing(0.05)


def test_a_socket_that_takes_part_of_a_write_gets_the_rest(
        broker: BrokerProcess, connect: Connect) -> None:
    """pybroker only: nsqd gives each write to a client's socket 1 s (a write deadline)
    and stops sending to a consumer whose socket stays full longer, as this one's does
    while the messages are published (here the frames stop mid-message)."""
    any_broker = broker
    topic = unique_name()
    # 2,500 in flight to one socket (its RDY) of 2,000-byte frames, 5 MB: more than
    # loopback's buffers take from a sender whose peer does not read (about 4.2 MB)
    bodies = [b"b%04d:" % i + bytes([65 + i % 26]) * 1964 for i in range(3000)]
    assert any_broker.tcp_address is not None
    slow = connect(any_broker)
    # no output buffering: each pass's frames (under 64 KiB: an MPUB of 30) are written at
    # once, until the socket, not read meanwhile, takes only part of a write
    subscribe(slow, topic, "ch", rdy=2500, output_buffer_timeout=-1)
    # a second consumer: a channel's passes serve several at once
    mate = subscribe(connect(any_broker), topic, "ch", rdy=1)
    with WireClient.connect(any_broker.tcp_address) as p:
        # published without reading the consumers meanwhile
        for at in range(0, len(bodies), 30):
            p.mpub(topic, bodies[at:at + 30])
    got: dict[bytes, int] = {}
    deadline = time.monotonic() + 60
    # now read it all
    while len(got) < len(bodies) and time.monotonic() < deadline:
        _take(slow, got, 0.01)
        _take(mate, got, 0.01)
    assert sorted(got) == sorted(bodies)
    assert set(got.values()) == {1}
    slow.assert_alive()
    slow.close()


def test_consumers_reset_among_many_served_in_one_pass(any_broker: BrokerProcess,
                                                       connect: Connect) -> None:
    """More than C_FROM consumers at RDY 1, all served by each pass (pybroker then
    writes a pass on its loop's sender thread and settles it at the next pass, or
    before anything else touches those connections), and some of them reset (SO_LINGER
    0) mid-stream, a message of theirs in flight: the writes to them fail or vanish,
    the broker goes on, and the others receive every message (at least once)."""
    topic = unique_name()
    bodies = [b"k%05d" % i for i in range(4000)]
    many = [subscribe(connect(any_broker), topic, "ch", rdy=1, msg_timeout=1000)
            for _ in range(2 * C_FROM)]
    assert any_broker.tcp_address is not None
    with WireClient.connect(any_broker.tcp_address) as p:
        for at in range(0, len(bodies), 500):
            p.mpub(topic, bodies[at:at + 500])
    got: set[bytes] = set()
    deadline = time.monotonic() + 60
    rounds = 0
    while len(got) < len(bodies) and time.monotonic() < deadline:
        rounds += 1
        # each holds one message; then all FIN at once, so that one turn reads every
        # FIN and one pass serves them all
        held = []
        for c in many:
            if c.pending or select.select([c.sock], [], [], 0.05)[0]:
                m = c.read_message(10)
                got.add(m.body)
                held.append((c, m.id))
        if rounds % 7 == 0 and len(many) > C_FROM:
            # one goes away right after its FIN: its next message is on its way, in the
            # pass this burst of FINs brings (or written after the reset)
            gone = many.pop(rounds % len(many))
            gone.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                 struct.pack("ii", 1, 0))
        else:
            gone = None
        for c, mid in held:
            c.fin(mid)
        if gone is not None:
            gone.close()
    assert got == set(bodies)
    for c in many:
        c.assert_alive()


def test_consumers_reset_while_passes_write_to_them(any_broker: BrokerProcess,
                                                   connect: Connect) -> None:
    """Consumers at RDY 1 that go away with a reset (SO_LINGER 0), some right after a
    FIN (the next message may already be on its way to them), while the others hold
    theirs: the broker goes on, and the others then receive every message (at least
    once: those in flight to a reset consumer are delivered again). (A write that fails
    within a dispatch pass, closing its consumer there, is tested deterministically in
    tests/unit/test_channel.py.)"""
    topic = unique_name()
    bodies = [b"r%05d" % i for i in range(3000)]
    assert any_broker.tcp_address is not None
    with WireClient.connect(any_broker.tcp_address) as p:
        for at in range(0, len(bodies), 500):
            p.mpub(topic, bodies[at:at + 500])
    stay = [subscribe(connect(any_broker), topic, "ch", rdy=1) for _ in range(8)]
    got: set[bytes] = set()
    deadline = time.monotonic() + 60
    for k in range(60):
        # one that takes a message, and resets: at once (nsqd delivers that message
        # again when its msg_timeout passes, pybroker at once), or right after its FIN,
        # when the next message's write to it may fail
        gone = subscribe(connect(any_broker), topic, "ch", rdy=1, msg_timeout=1000)
        m = gone.read_message(timeout=10)
        got.add(m.body)
        gone.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        if k % 2:
            gone.fin(m.id)
        gone.close()
    # (meanwhile the others held their first message: the resets were served alone)
    while len(got) < len(bodies) and time.monotonic() < deadline:
        for c in stay:
            _take_set(c, got, 0.002)
    assert got == set(bodies)
    for c in stay:
        c.assert_alive()
    with WireClient.connect(any_broker.tcp_address) as p:
        p.pub(topic, b"still here")


def _take_set(c: WireClient, got: set[bytes], wait: float) -> None:
    counts: dict[bytes, int] = {}
    _take(c, counts, wait)
    got.update(counts)
