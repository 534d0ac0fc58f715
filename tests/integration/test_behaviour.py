"""Delivery semantics over raw sockets: RDY, REQ/TOUCH/timeouts, deferral, channels,
heartbeats, fatality, many connections, ephemeral channels and message ids.

Tests taking ``any_broker``/``make_any_broker`` run the same assertions against pybroker
and a real nsqd 1.3.0; the pybroker-only tests say in their docstring why nsqd differs.
Short per-client timeouts (IDENTIFY msg_timeout=1000, heartbeat_interval=1000) keep the
module fast. Durations are measured with time.monotonic().
"""
from __future__ import annotations

import os
import re
import resource
import signal
import select
import socket
import time
from collections.abc import Callable

from tests.support import wire
from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.http import channel_stats
from tests.support.wire import ConnectionClosed, WireClient

Connect = Callable[..., WireClient]
# How late a timed redelivery may come. nsqd's queue scanner refreshes its list of
# channels only every 5 s, so a new channel's timeouts can wait that long; pybroker is
# expected to honour them within its scan interval.
SLACK_S = {"pybroker": 1.5, "nsqd": 5.5}


def consumer(connect: Connect, b: BrokerProcess, topic: str, channel: str = "ch",
             rdy: int = 0, **identify: object) -> WireClient:
    c = connect(b)
    if identify:
        c.identify(**identify)
    c.sub(topic, channel)
    if rdy:
        c.rdy(rdy)
    return c


def test_rdy_caps_in_flight_exactly(any_broker: BrokerProcess, connect: Connect) -> None:
    topic = unique_name()
    c = consumer(connect, any_broker, topic, rdy=3)
    c.mpub(topic, [b"%d" % i for i in range(10)])
    first = c.read_messages(3)
    c.expect_nothing(0.3)
    c.fin(first[0].id)
    fourth = c.read_message()
    c.expect_nothing(0.3)
    c.send(b"".join(wire.fin(m.id) for m in (*first[1:], fourth)))
    rest = c.read_messages(3)
    c.expect_nothing(0.2)
    seen = [m.body for m in (*first, fourth, *rest)]
    assert len(set(seen)) == 7


def test_lowering_rdy_caps_existing_in_flight(any_broker: BrokerProcess,
                                              connect: Connect) -> None:
    """RDY is a cap on in-flight, not a counter: after RDY 2 with 5 in flight, a new
    message comes only once fewer than 2 are in flight."""
    topic = unique_name()
    c = consumer(connect, any_broker, topic, rdy=5)
    c.mpub(topic, [b"%d" % i for i in range(10)])
    got = c.read_messages(5)
    c.rdy(2)
    c.send(b"".join(wire.fin(m.id) for m in got[:3]))
    c.expect_nothing(0.3)  # 2 in flight, RDY 2
    c.fin(got[3].id)
    c.read_message()
    c.expect_nothing(0.3)


def test_sample_rate_delivers_a_sample(any_broker: BrokerProcess, connect: Connect) -> None:
    """IDENTIFY sample_rate=1: nsqd keeps a message when rand(100) <= 1, about 2%."""
    topic = unique_name()
    c = consumer(connect, any_broker, topic, rdy=1000, sample_rate=1)
    c.mpub(topic, [b"%d" % i for i in range(500)])
    n = 0
    while True:
        try:
            msg = c.read_message(timeout=0.5)
        except TimeoutError:
            break
        c.fin(msg.id)
        n += 1
    assert 1 <= n <= 40, n


def test_rdy_zero_pauses_delivery(any_broker: BrokerProcess, connect: Connect) -> None:
    topic = unique_name()
    c = consumer(connect, any_broker, topic, rdy=5)
    c.rdy(0)
    c.pub(topic, b"held")
    c.expect_nothing(0.3)
    c.rdy(1)
    assert c.read_message().body == b"held"


def test_req_until_attempts_above_five(any_broker: BrokerProcess, connect: Connect) -> None:
    topic = unique_name()
    c = consumer(connect, any_broker, topic, rdy=1)
    c.pub(topic, b"retry me")
    deliveries = []
    while True:
        msg = c.read_message()
        deliveries.append(msg)
        if msg.attempts > 5:
            c.fin(msg.id)
            break
        c.req(msg.id, 0)
    assert [m.attempts for m in deliveries] == [1, 2, 3, 4, 5, 6]
    assert len({m.ts_ns for m in deliveries}) == 1, "timestamp must survive requeues"
    assert len({m.id for m in deliveries}) == 1
    assert {m.body for m in deliveries} == {b"retry me"}
    c.expect_nothing(0.3)
    c.fin(deliveries[-1].id)
    c.expect_error("E_FIN_FAILED")


def test_unfinished_redelivered_after_msg_timeout_and_touch_extends(
        any_broker: BrokerProcess, connect: Connect) -> None:
    """An un-FIN'd message comes back after msg_timeout with attempts 2; on the same
    channel (now certainly under scan, see SLACK_S) TOUCH keeps a message in flight
    for 2.5 x msg_timeout."""
    topic = unique_name()
    slack = SLACK_S[any_broker.kind]
    c = consumer(connect, any_broker, topic, rdy=1, msg_timeout=1000)
    c.pub(topic, b"slow")
    first = c.read_message()
    t0 = time.monotonic()
    again = c.read_message(timeout=1.0 + slack + 1)
    elapsed = time.monotonic() - t0
    assert (again.id, again.body, again.attempts) == (first.id, b"slow", 2)
    assert again.ts_ns == first.ts_ns
    assert 0.9 <= elapsed < 1.0 + slack, elapsed
    c.fin(again.id)
    c.expect_nothing(0.1)

    c.pub(topic, b"long job")
    msg = c.read_message()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 2.5:
        c.touch(msg.id)
        c.expect_nothing(0.3)  # no redelivery, no E_TOUCH_FAILED
    c.fin(msg.id)
    c.assert_alive()  # the FIN was accepted: still in flight after 2.5 s
    c.fin(msg.id)
    c.expect_error("E_FIN_FAILED")


def test_touch_capped_at_max_msg_timeout(make_any_broker: Callable[..., BrokerProcess],
                                         connect: Connect) -> None:
    """TOUCH cannot keep a message past delivery + max-msg-timeout; REQ clamps its
    timeout to max-req-timeout."""
    b = make_any_broker("--msg-timeout=1s", "--max-msg-timeout=2s", "--max-req-timeout=1s")
    slack = SLACK_S[b.kind]
    topic = unique_name()
    c = connect(b)
    c.sub(topic, "ch")
    c.rdy(1)
    t_pub = time.monotonic()   # the delivery, which max-msg-timeout counts from, is later
    c.pub(topic, b"capped")
    msg = c.read_message()
    t0 = time.monotonic()
    again = None
    while again is None and time.monotonic() - t0 < 2.0 + slack + 1:
        c.touch(msg.id)
        try:
            ftype, data = c.read_frame(0.3)
        except TimeoutError:
            continue
        if ftype == wire.FRAME_MESSAGE:
            again = wire.parse_message(data)
        else:  # a TOUCH racing the timeout may fail, without closing the connection
            assert data.startswith(b"E_TOUCH_FAILED"), data
    back = time.monotonic()
    assert again is not None, "message never came back despite max-msg-timeout"
    assert (again.id, again.attempts) == (msg.id, 2)
    assert back - t_pub >= 1.95, back - t_pub     # not before delivery + 2 s
    assert back - t0 < 2.0 + slack, back - t0

    # and a REQ timeout above max-req-timeout is clamped to it, not rejected
    t0 = time.monotonic()
    c.req(again.id, 999_999)
    third = c.read_message(timeout=1.0 + slack + 1)
    elapsed = time.monotonic() - t0
    assert (third.id, third.attempts) == (msg.id, 3)
    assert 0.95 <= elapsed < 1.0 + SLACK_S["pybroker"], elapsed  # channel is scanned now
    c.fin(third.id)


def test_stuck_consumer_does_not_stall_others(any_broker: BrokerProcess,
                                              connect: Connect) -> None:
    """A consumer with a large RDY that never reads fills its socket; publishers and
    other consumers must still get prompt answers."""
    topic, other_topic = unique_name(), unique_name()
    stuck = connect(any_broker)
    stuck.sub(topic, "ch")
    stuck.rdy(2500)
    publisher = connect(any_broker)
    body = b"x" * 100_000
    for _ in range(5):  # 20 MB: more than the loopback socket buffers hold
        publisher.mpub(topic, [body] * 40)
    other = connect(any_broker)
    other.sub(other_topic, "ch")
    other.rdy(1)
    for i in range(20):
        t0 = time.monotonic()
        publisher.pub(other_topic, b"ping %d" % i)
        msg = other.read_message(timeout=2.0)
        other.fin(msg.id)
        assert msg.body == b"ping %d" % i
        assert time.monotonic() - t0 < 0.5, f"round trip {i} took {time.monotonic() - t0}s"


def test_dpub_and_req_delay_not_delivered_early(any_broker: BrokerProcess,
                                                connect: Connect) -> None:
    """DPUB 600 ms and REQ 600 ms arrive no earlier than asked (and not much later)."""
    topic = unique_name()
    slack = SLACK_S[any_broker.kind]
    c = consumer(connect, any_broker, topic, rdy=2)
    t0 = time.monotonic()
    c.dpub(topic, 600, b"deferred")
    c.pub(topic, b"now")
    now = c.read_message()
    assert now.body == b"now"
    c.fin(now.id)
    msg = c.read_message(timeout=0.6 + slack + 1)
    elapsed = time.monotonic() - t0
    assert (msg.body, msg.attempts) == (b"deferred", 1)
    assert 0.6 <= elapsed < 0.6 + slack, elapsed

    t0 = time.monotonic()
    c.req(msg.id, 600)
    again = c.read_message(timeout=0.6 + slack + 1)
    elapsed = time.monotonic() - t0
    assert (again.id, again.body, again.attempts) == (msg.id, b"deferred", 2)
    assert 0.6 <= elapsed < 0.6 + SLACK_S["pybroker"], elapsed  # channel is scanned now
    c.fin(again.id)
    c.expect_nothing(0.1)


def test_two_channels_each_get_every_message(any_broker: BrokerProcess,
                                             connect: Connect) -> None:
    topic = unique_name()
    a = consumer(connect, any_broker, topic, "ch1", rdy=50)
    b = consumer(connect, any_broker, topic, "ch2", rdy=50)
    bodies = [b"m%d" % i for i in range(20)]
    connect(any_broker).mpub(topic, bodies)
    for c in (a, b):
        assert sorted(m.body for m in c.read_messages(20)) == sorted(bodies)
        c.expect_nothing(0.1)


def test_consumers_of_one_channel_share_messages(any_broker: BrokerProcess,
                                                 connect: Connect) -> None:
    topic = unique_name()
    clients = [consumer(connect, any_broker, topic, rdy=100) for _ in range(2)]
    bodies = [b"s%d" % i for i in range(40)]
    connect(any_broker).mpub(topic, bodies)
    got: list[bytes] = []
    deadline = time.monotonic() + 5
    while len(got) < 40 and time.monotonic() < deadline:
        ready, _, _ = select.select([c.sock for c in clients], [], [], 0.2)
        for c in clients:
            if c.sock in ready:
                m = c.read_message()
                got.append(m.body)
                c.fin(m.id)
    assert sorted(got) == sorted(bodies)
    for c in clients:
        c.expect_nothing(0.1)


def test_topic_without_channel_keeps_messages(any_broker: BrokerProcess,
                                              connect: Connect) -> None:
    topic = unique_name()
    connect(any_broker).mpub(topic, [b"early1", b"early2"])
    first = consumer(connect, any_broker, topic, "first", rdy=10)
    assert sorted(m.body for m in first.read_messages(2)) == [b"early1", b"early2"]
    late = consumer(connect, any_broker, topic, "late", rdy=10)
    connect(any_broker).pub(topic, b"after")
    assert late.read_message().body == b"after"  # later channels see only new messages
    late.expect_nothing(0.2)
    assert first.read_message().body == b"after"


def test_silent_client_closed_after_two_heartbeats(any_broker: BrokerProcess,
                                                   connect: Connect) -> None:
    topic = unique_name()
    silent = connect(any_broker, answer_heartbeats=False)
    alive = connect(any_broker, answer_heartbeats=True)
    silent.identify(heartbeat_interval=1000)
    silent.sub(topic, "hb")
    alive.identify(heartbeat_interval=1000)  # a producer: it gets heartbeats too
    t0 = time.monotonic()
    closed_at = None
    while time.monotonic() - t0 < 4.5 and not (closed_at and len(alive.heartbeats) >= 3):
        socks = [c.sock for c in (silent, alive) if not (c is silent and closed_at)]
        ready, _, _ = select.select(socks, [], [], 0.1)
        if alive.sock in ready:
            alive.expect_nothing(0.01)  # reads and answers the heartbeat
        if silent.sock in ready:
            try:
                frame = wire.read_frame(silent.sock, 1.0)
            except ConnectionClosed:
                closed_at = time.monotonic() - t0
                continue
            assert frame == (wire.FRAME_RESPONSE, wire.HEARTBEAT), frame
            silent.heartbeats.append(time.monotonic())
    assert closed_at is not None, "silent client was never closed"
    assert 1.8 <= closed_at <= 4.0, closed_at
    assert len(silent.heartbeats) >= 1, "no heartbeat was sent before the close"
    assert len(alive.heartbeats) >= 3
    alive.assert_alive()


def test_client_that_kept_talking_survives_a_broker_stall(make_broker: Callable[..., BrokerProcess],
                                                         connect: Connect) -> None:
    """The broker is stopped for longer than two heartbeat intervals while the client
    keeps sending NOPs: its bytes wait in the socket, so it is not a silent peer."""
    b = make_broker()
    assert b.proc is not None
    c = connect(b, answer_heartbeats=False)
    c.identify(heartbeat_interval=1000)
    os.kill(b.proc.pid, signal.SIGSTOP)
    try:
        until = time.monotonic() + 3.0
        while time.monotonic() < until:
            c.send(b"NOP\n")
            time.sleep(0.2)   # the pace of a talking client, not a wait for a condition
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    c.pub(unique_name(), b"still here")   # answered OK: the connection was kept
    c.assert_alive()


def test_oversized_pub_is_bad_message(any_broker: BrokerProcess, connect: Connect) -> None:
    c = connect(any_broker)
    c.send(b"PUB " + unique_name().encode() + b"\n" + (1024 * 1024 + 1).to_bytes(4, "big"))
    c.expect_error("E_BAD_MESSAGE", prefix="E_BAD_MESSAGE PUB message too big 1048577 > 1048576")


def test_fatal_error_closes_and_non_fatal_does_not(any_broker: BrokerProcess,
                                                   connect: Connect) -> None:
    topic = unique_name()
    c = consumer(connect, any_broker, topic, rdy=1)
    for verb in (b"FIN", b"TOUCH"):
        c.send(verb + b" 0000000000000000\n")
        c.expect_error(b"E_" + verb + b"_FAILED")
    c.send(b"REQ 0000000000000000 10\n")
    c.expect_error("E_REQ_FAILED")
    c.send(wire.pub("bad*topic", b"x"))
    c.expect_error("E_BAD_TOPIC")  # and the server closes the connection


def test_fins_and_reqs_sent_together_act_in_their_order(any_broker: BrokerProcess,
                                                       connect: Connect) -> None:
    """A consumer's FINs and REQs in one write (pybroker reads such a write in one pass:
    docs/io.md, "REQs in the FIN lane") act line by line: a REQ of a message FINed or
    requeued by an earlier line fails with E_REQ_FAILED naming it, in order, and the
    lines after it still act (a redelivery, a deferral, a FIN, a failed FIN naming
    its own message)."""
    topic = unique_name()
    c = consumer(connect, any_broker, topic, rdy=4)
    c.mpub(topic, [b"%d" % i for i in range(4)])
    m = sorted(c.read_messages(4), key=lambda x: x.body)
    c.rdy(0)            # no redelivery between the lines (nsqd's pump runs beside them)
    c.assert_alive()
    c.send(wire.fin(m[0].id) + wire.req(m[1].id) + wire.req(m[0].id) + wire.req(m[1].id)
           + wire.req(m[2].id, 60_000) + wire.fin(m[3].id) + wire.fin(m[0].id))
    errors = []
    while len(errors) < 3:
        ftype, data = c.read_frame(5)
        if ftype == wire.FRAME_MESSAGE:
            c.pending.append(wire.parse_message(data))
        else:
            errors.append(data)
    assert [e[:len(b"E_REQ_FAILED REQ ") + 16] for e in errors] == \
        [b"E_REQ_FAILED REQ " + m[0].id, b"E_REQ_FAILED REQ " + m[1].id,
         b"E_FIN_FAILED FIN " + m[0].id]
    c.assert_alive()
    c.rdy(1)
    again = c.read_message()
    assert (again.body, again.attempts) == (b"1", 2)
    c.fin(again.id)
    c.expect_nothing(0.3)       # the third is deferred for a minute

    def settled() -> dict[str, int] | None:
        st = channel_stats(any_broker, topic, "ch")
        if st is None or st["in_flight_count"] or st["deferred_count"] != 1:
            return None
        return st
    st = wait_until(settled, 5, what="the deferral and the FINs in /stats")
    assert isinstance(st, dict)
    assert st["requeue_count"] == 2 and st["message_count"] == 4


def test_a_flood_of_failing_reqs_and_fins_is_answered_line_by_line(
        any_broker: BrokerProcess, connect: Connect) -> None:
    """One write of 4,000 FIN and REQ lines naming no message in flight (more than a
    turn's piece of a subscribed connection: lines cut across reads): every line gets
    its E_FIN_FAILED or E_REQ_FAILED, in order, naming its id, and the connection
    still works. (Its cost to the loop is measured, not timed here: docs/io.md.)"""
    topic = unique_name()
    c = consumer(connect, any_broker, topic, rdy=1)
    ids = [b"%016x" % (10**9 + i) for i in range(4000)]
    c.send(b"".join((b"REQ " + m + b" 0\n") if i % 3 else (b"FIN " + m + b"\n")
                    for i, m in enumerate(ids)))
    got = []
    while len(got) < len(ids):
        ftype, data = c.read_frame(10)
        assert ftype == wire.FRAME_ERROR, data
        got.append(data)
    assert [g.split(b" ")[:3] for g in got] == \
        [[b"E_REQ_FAILED", b"REQ", m] if i % 3 else [b"E_FIN_FAILED", b"FIN", m]
         for i, m in enumerate(ids)]
    c.pub(topic, b"after")
    assert c.read_message().body == b"after"


def test_thousand_concurrent_connections(make_any_broker: Callable[..., BrokerProcess]) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2500:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    b = make_any_broker()  # started after raising the limit, so it inherits it
    assert b.tcp_address is not None
    topic = unique_name()
    socks: list[socket.socket] = []
    try:
        for _ in range(1000):
            socks.append(socket.create_connection(b.tcp_address, timeout=10))
        for i, s in enumerate(socks):
            if i % 2:
                s.sendall(wire.MAGIC_V2 + wire.pub(topic, b"c%d" % i))
            else:
                s.sendall(wire.MAGIC_V2 + wire.nop() + wire.identify(client_id=f"c{i}"))
        for s in socks:
            assert wire.read_frame(s, 10.0) == (wire.FRAME_RESPONSE, b"OK")
    finally:
        for s in socks:
            s.close()
    with WireClient.connect(b.tcp_address) as c:
        c.sub(topic, "ch")
        c.rdy(1000)
        got = {m.body for m in c.read_messages(500, timeout=10)}
        assert got == {b"c%d" % i for i in range(1, 1000, 2)}


def test_ephemeral_channel_removed_with_last_consumer(any_broker: BrokerProcess,
                                                      connect: Connect) -> None:
    topic = unique_name()
    keeper = consumer(connect, any_broker, topic, "keep", rdy=10)
    eph = consumer(connect, any_broker, topic, "ch#ephemeral", rdy=10)
    keeper.pub(topic, b"both")
    assert eph.read_message().body == b"both"
    assert keeper.read_message().body == b"both"
    eph.close()
    # removal is asynchronous after the disconnect: both servers show it in /stats
    wait_until(lambda: channel_stats(any_broker, topic, "ch#ephemeral") is None, 5,
               what="the ephemeral channel to go")
    keeper.pub(topic, b"nobody listening")
    assert keeper.read_message().body == b"nobody listening"
    again = consumer(connect, any_broker, topic, "ch#ephemeral", rdy=10)
    again.expect_nothing(0.3)
    keeper.pub(topic, b"new")
    assert again.read_message().body == b"new"


def test_message_ids_unique_hex(any_broker: BrokerProcess, connect: Connect) -> None:
    topic = unique_name()
    c = consumer(connect, any_broker, topic, rdy=600)
    for batch in range(5):
        c.mpub(topic, [b"%d-%d" % (batch, i) for i in range(100)])
    msgs = c.read_messages(500, timeout=10)
    ids = [m.id for m in msgs]
    assert len(set(ids)) == 500
    assert all(re.fullmatch(rb"[0-9a-f]{16}", i) for i in ids), ids[:3]


def test_disconnected_consumer_in_flight_requeued_at_once(broker: BrokerProcess,
                                                          connect: Connect) -> None:
    """pybroker only: it requeues a disconnected consumer's in-flight messages at once,
    whereas nsqd leaves them in flight until msg_timeout (60 s here) expires."""
    topic = unique_name()
    first = consumer(connect, broker, topic, rdy=5)
    first.mpub(topic, [b"a", b"b", b"c"])
    got = first.read_messages(3)
    first.close()
    t0 = time.monotonic()
    second = consumer(connect, broker, topic, rdy=5)
    again = second.read_messages(3, timeout=5.0)
    assert time.monotonic() - t0 < 2.0
    assert sorted(m.body for m in again) == [b"a", b"b", b"c"]
    assert {m.id for m in again} == {m.id for m in got}
    assert all(m.attempts == 2 for m in again)


def test_consumers_leaving_together_all_requeued(broker: BrokerProcess,
                                                 connect: Connect) -> None:
    """pybroker only, as above: a fleet that leaves at once has what it held requeued,
    each message once, also when that is more than a turn requeues (4,096 messages:
    ``EventLoop._requeue_leavers``) and when some were TOUCHed (flights of one)."""
    topic = unique_name()
    fleet = [consumer(connect, broker, topic, rdy=2000) for _ in range(3)]
    fleet[0].mpub(topic, [b"%d" % i for i in range(6000)])
    held = [c.read_messages(2000, timeout=10) for c in fleet]
    for m in held[1][:50]:
        fleet[1].touch(m.id)
    fleet[1].nop()
    for c in fleet:
        c.close()
    d = consumer(connect, broker, topic, rdy=2500)
    again: list[wire.Message] = []
    while len(again) < 6000:
        got = d.read_messages(min(2500, 6000 - len(again)), timeout=10)
        d.send(b"".join(wire.fin(m.id) for m in got))
        again += got
    d.expect_nothing(0.3)
    assert sorted(int(m.body) for m in again) == list(range(6000))
    assert {m.id for m in again} == {m.id for ms in held for m in ms}
    assert all(m.attempts == 2 for m in again)
