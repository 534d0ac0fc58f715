"""Channel: delivery under RDY, FIN/REQ/TOUCH, timeouts and requeue on disconnect.

Time is passed in as now_ns; a small consumer object records what it was sent.
"""
from __future__ import annotations

import pytest

from pybroker.core.channel import Channel
from pybroker.core.message import Message
from pybroker.errors import NotInFlight, NotOwner, TooManyConsumers

S = 1_000_000_000


class Client:
    def __init__(self, rdy: int, msg_timeout_ns: int = 10 * S) -> None:
        self.rdy = rdy
        self.msg_timeout_ns = msg_timeout_ns
        self.sample_rate = 0
        self.in_flight_count = 0
        self.got: list[Message] = []

    def ready_room(self) -> int:
        return self.rdy - self.in_flight_count

    def send_messages(self, msgs: list[Message]) -> None:
        self.got.extend(msgs)


def msgs(n: int, defer_ns: int = 0) -> list[Message]:
    return [Message(b"%016x" % i, b"body%d" % i, 1000 + i, 0, defer_ns) for i in range(n)]


def make() -> Channel:
    return Channel("t", "c", owner=None, mem_queue_size=100, ephemeral=False)


def test_rdy_caps_in_flight_and_fin_frees_a_slot() -> None:
    ch, c = make(), Client(rdy=3)
    ch.add_consumer(c, 0)
    ch.put(msgs(10), 0)
    ch.dispatch(0)
    assert [m.attempts for m in c.got] == [1, 1, 1] and c.in_flight_count == 3
    ch.dispatch(0)
    assert len(c.got) == 3
    ch.finish(c, c.got[0].id)
    ch.dispatch(0)
    assert len(c.got) == 4 and ch.depth() == 6


def test_round_robin_between_ready_consumers() -> None:
    ch, a, b = make(), Client(rdy=1), Client(rdy=1)
    ch.add_consumer(a, 0)
    ch.add_consumer(b, 0)
    ch.put(msgs(4), 0)
    ch.dispatch(0)
    assert len(a.got) == 1 and len(b.got) == 1


def test_fin_errors() -> None:
    ch, a, b = make(), Client(rdy=1), Client(rdy=1)
    ch.add_consumer(a, 0)
    ch.add_consumer(b, 0)
    ch.put(msgs(1), 0)
    ch.dispatch(0)
    owner, other = (a, b) if a.got else (b, a)
    mid = owner.got[0].id
    with pytest.raises(NotOwner):
        ch.finish(other, mid)
    ch.finish(owner, mid)
    with pytest.raises(NotInFlight):
        ch.finish(owner, mid)


def test_requeue_now_and_deferred_keep_timestamp_and_count_attempts() -> None:
    ch, c = make(), Client(rdy=1)
    ch.add_consumer(c, 0)
    ch.put(msgs(1), 0)
    ch.dispatch(0)
    m = c.got[-1]
    ch.requeue(c, m.id, 0, 0)
    ch.dispatch(0)
    assert c.got[-1] is m and m.attempts == 2
    ch.requeue(c, m.id, 5 * S, 1 * S)
    assert ch.expire(6 * S - 1) == ([], [])
    timed_out, due = ch.expire(6 * S)
    assert due == [m] and timed_out == []
    ch.requeue_expired(timed_out, due)
    ch.dispatch(6 * S)
    assert c.got[-1] is m and m.attempts == 3 and m.ts_ns == 1000
    assert ch.requeue_count == 2


def test_timeout_requeues_and_counts() -> None:
    ch, c = make(), Client(rdy=1, msg_timeout_ns=2 * S)
    ch.add_consumer(c, 0)
    ch.put(msgs(1), 0)
    ch.dispatch(0)
    timed_out, due = ch.expire(2 * S)
    assert len(timed_out) == 1 and not due
    ch.requeue_expired(timed_out, due)
    assert c.in_flight_count == 0 and ch.timeout_count == 1
    with pytest.raises(NotInFlight):
        ch.finish(c, timed_out[0].id)


def test_touch_extends_but_not_past_max_msg_timeout() -> None:
    ch, c = make(), Client(rdy=1, msg_timeout_ns=2 * S)
    ch.add_consumer(c, 0)
    ch.put(msgs(1), 0)
    ch.dispatch(0)
    mid = c.got[0].id
    ch.touch(c, mid, 1 * S, max_msg_timeout_ns=4 * S)   # deadline 3 s
    assert ch.expire(2 * S) == ([], [])
    ch.touch(c, mid, 3 * S, max_msg_timeout_ns=4 * S)   # capped at delivery + 4 s
    assert ch.expire(4 * S - 1) == ([], [])
    assert len(ch.expire(4 * S)[0]) == 1


def test_deferred_put_is_not_delivered_early() -> None:
    ch, c = make(), Client(rdy=5)
    ch.add_consumer(c, 0)
    ch.put(msgs(2, defer_ns=3 * S), 0)
    ch.dispatch(0)
    assert c.got == [] and len(ch.deferred) == 2
    ch.requeue_expired(*ch.expire(3 * S))
    ch.dispatch(3 * S)
    assert len(c.got) == 2


def test_disconnect_requeues_in_flight_at_once_in_delivery_order() -> None:
    ch, a, b = make(), Client(rdy=3), Client(rdy=0)
    ch.add_consumer(a, 0)
    ch.add_consumer(b, 0)
    ch.put(msgs(5), 0)
    ch.dispatch(0)
    assert ch.remove_consumer(a) == 3
    b.rdy = 10
    ch.dispatch(1)
    assert [m.body for m in b.got] == [b"body%d" % i for i in range(5)]
    assert [m.attempts for m in b.got] == [2, 2, 2, 1, 1]


def test_max_consumers() -> None:
    ch = make()
    ch.add_consumer(Client(1), 1)
    with pytest.raises(TooManyConsumers):
        ch.add_consumer(Client(1), 1)


def test_ephemeral_overflow_is_discarded_but_durable_is_not() -> None:
    eph = Channel("t", "c#ephemeral", None, mem_queue_size=3, ephemeral=True)
    eph.put(msgs(10), 0)
    assert eph.depth() == 3
    ch = make()
    ch.put(msgs(500), 0)
    assert ch.depth() == 500


def test_drain_all_and_empty() -> None:
    ch, c = make(), Client(rdy=2)
    ch.add_consumer(c, 0)
    ch.put(msgs(4), 0)
    ch.put(msgs(1, defer_ns=S), 0)
    ch.dispatch(0)
    assert len(ch.drain_all()) == 5
    ch.empty()
    assert ch.drain_all() == [] and c.in_flight_count == 0
