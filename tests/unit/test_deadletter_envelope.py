"""Dead letters without a server: the envelope, and a channel's max_attempts decision
with an owner that records what it is asked to publish (the real owner loop's publish
is covered by tests/integration/test_dead_letters.py)."""
from __future__ import annotations

import json
from typing import Any

import pytest

from pybroker.core.channel import Channel
from pybroker.core.flight import Consumer
from pybroker.protocol.deadletter import (
    EnvelopeError,
    check_dead_letter_topic,
    closes_cycle,
    dead_letter_settings,
    dead_letter_target,
    envelope,
    is_dead_letter_topic,
    parse_envelope,
    wrap,
)
from pybroker.core.topic import Topic
from pybroker.storage.topiclog import TopicLog
from tests.unit.test_channel import WALL, Client, deliver_each, publish

S = 1_000_000_000
MS = 1_000_000


def _env(body: bytes, **kw: Any) -> bytes:
    args = dict(topic="orders", channel="billing", offset=42, attempts=5,
                first_delivery_ms=1000, last_delivery_ms=2000, dead_at_ms=3000,
                published_ms=900, body=body)
    args.update(kw)
    return envelope(**args)


@pytest.mark.parametrize("body", [b"", b"plain", b"\n\n{\"v\":1}\n", bytes(range(256)),
                                  "ünïcode".encode()])
def test_envelope_round_trips_any_body(body: bytes) -> None:
    raw = _env(body)
    header_line, rest = raw.split(b"\n", 1)
    assert rest == body                       # the body unchanged after the first newline
    header = json.loads(header_line)
    assert list(header) == ["v", "topic", "channel", "id", "attempts", "first_delivery_ms",
                            "last_delivery_ms", "dead_at_ms", "published_ms", "from", "hops",
                            "body_len"]
    assert header["from"] == ["orders"] and header["hops"] == []
    assert header["id"] == "000000000000002a" and header["body_len"] == len(body)
    d = parse_envelope(raw)
    assert (d.topic, d.channel, d.id, d.attempts, d.body) == \
        ("orders", "billing", "000000000000002a", 5, body)
    assert (d.first_delivery_ms, d.last_delivery_ms, d.dead_at_ms, d.published_ms) == \
        (1000, 2000, 3000, 900)


@pytest.mark.parametrize("raw, why", [
    (b"no newline", "no header line"),
    (b"not json\nbody", "not JSON"),
    (b"[1]\nbody", "not a JSON object"),
    (b'{"v":2}\nbody', "version"),
    (b'{"v":1,"topic":"t"}\nbody', "has no"),
])
def test_parse_envelope_refuses_what_is_not_one(raw: bytes, why: str) -> None:
    with pytest.raises(EnvelopeError, match=why):
        parse_envelope(raw)


def test_parse_envelope_checks_body_length() -> None:
    with pytest.raises(EnvelopeError, match="header says"):
        parse_envelope(_env(b"abc") + b"extra")


def test_dead_letter_names() -> None:
    assert dead_letter_target("orders", "") == "orders.dead"
    assert dead_letter_target("orders", "parked") == "parked"
    assert dead_letter_target("orders", "orders") is None
    assert dead_letter_target("orders", "x#ephemeral") is None
    assert dead_letter_target("a" * 60, "") is None          # 65 characters
    assert check_dead_letter_topic("a" * 60, "") is not None
    assert check_dead_letter_topic("orders", "") is None
    assert is_dead_letter_topic("orders.dead", "") and is_dead_letter_topic("parked", "parked")
    assert not is_dead_letter_topic("orders", "parked")
    assert dead_letter_settings({"max_attempts": 3, "dead_letter_topic": "p", "x": 1}) == \
        {"max_attempts": 3, "dead_letter_topic": "p"}
    assert dead_letter_settings({"max_attempts": True, "dead_letter_topic": "a b"}) == {}
    assert dead_letter_settings({"max_attempts": 70000}) == {}


class Owner:
    def __init__(self) -> None:
        self.published: list[tuple[str, list[int], list[bytes]]] = []
        self.dirty: list[Channel] = []

    def mark_dirty(self, ch: Channel) -> None:
        self.dirty.append(ch)

    def deliver(self, sends: list[tuple[Consumer, int, int]], out: bytes | bytearray) -> None:
        deliver_each(sends, out)

    def dead_letter(self, ch: Channel, target: str, offsets: list[int],
                    bodies: list[bytes]) -> None:
        self.published.append((target, offsets, bodies))


def make(max_attempts: int) -> tuple[Topic, Channel, Owner]:
    log = TopicLog(None, max_bytes_per_file=1 << 20, mem_records=100, max_record_bytes=4096)
    owner = Owner()
    t = Topic("t", log, 100, lambda _t, _c: owner)
    t.dl_defaults = (max_attempts, "")
    ch, _ = t.get_channel("c")
    return t, ch, owner


def _req_all(ch: Channel, c: Client, now: int) -> None:
    for m in list(c.got):
        if ch.in_flight.get(int(m.id, 16)) is not None:
            ch.requeue(c, m.id, 0, now, WALL + now)


def test_third_requeue_goes_to_dead_letters_not_to_the_consumer() -> None:
    t, ch, owner = make(3)
    c = Client(rdy=10)
    ch.add_consumer(c, 0)
    publish(t, 2)
    for k in range(3):
        ch.dispatch(k * S, WALL + k * S)
        _req_all(ch, c, k * S + MS)
    assert [m.attempts for m in c.got] == [1, 1, 2, 2, 3, 3]
    ch.dispatch(10 * S, WALL + 10 * S)
    assert len(c.got) == 6                    # no 4th delivery
    (target, offsets, bodies), = owner.published
    assert target == "t.dead" and offsets == [0, 1]
    d = parse_envelope(bodies[0])
    assert (d.attempts, d.body, d.id) == (3, b"body0", "0000000000000000")
    assert d.first_delivery_ms == WALL // MS
    assert d.last_delivery_ms == (WALL + 2 * S) // MS
    assert d.dead_at_ms == (WALL + 10 * S) // MS
    # dying: neither deliverable nor finished, and kept in the saved state
    assert ch.depth(WALL) == 0 and not ch.in_flight and ch.floor() == 0
    assert sorted(p[0] for p in ch.snapshot(WALL, 0)["pending"]) == [0, 1]
    assert ch.dead_lettered([0], True) == 1
    assert ch.floor() == 1 and ch.dead_letter_count == 1 and 0 not in ch.delivery_times
    # a failed publish puts it back as it was: it is tried again at the next dispatch
    assert ch.dead_lettered([1], False) == 0
    assert [e[:2] for e in ch.requeued] == [(1, 3)]
    ch.dispatch(11 * S, WALL + 11 * S)
    assert owner.published[-1][1] == [1] and len(c.got) == 6


def test_zero_means_unlimited_and_no_times_are_kept() -> None:
    t, ch, owner = make(0)
    c = Client(rdy=1)
    ch.add_consumer(c, 0)
    publish(t, 1)
    for k in range(20):
        ch.dispatch(k, WALL + k)
        _req_all(ch, c, k)
    assert [m.attempts for m in c.got] == list(range(1, 21))
    assert not owner.published and not ch.delivery_times


def test_delivery_times_survive_a_saved_state() -> None:
    t, ch, owner = make(2)
    c = Client(rdy=1)
    ch.add_consumer(c, 0)
    publish(t, 1)
    ch.dispatch(0, WALL)
    _req_all(ch, c, S)
    state = ch.snapshot(WALL + 5 * S, 5 * S)
    assert state["deliveries"] == [[0, WALL // MS, WALL // MS]]
    t2, ch2, owner2 = make(2)
    publish(t2, 1)
    ch2.restore(state, 100 * S, WALL + 5 * S)
    c2 = Client(rdy=1)
    ch2.add_consumer(c2, 0)
    ch2.dispatch(100 * S, WALL + 5 * S)        # 2nd delivery
    _req_all(ch2, c2, 101 * S)
    ch2.dispatch(102 * S, WALL + 7 * S)        # would be the 3rd: dead-lettered
    d = parse_envelope(owner2.published[0][2][0])
    assert d.attempts == 2 and d.first_delivery_ms == WALL // MS
    assert d.last_delivery_ms == (WALL + 5 * S) // MS


# -- bursts, hops, cycles ---------------------------------------------------------------
class ConfirmingOwner(Owner):
    """memory mode: the publish is confirmed within the call."""

    def dead_letter(self, ch: Channel, target: str, offsets: list[int],
                    bodies: list[bytes]) -> None:
        super().dead_letter(ch, target, offsets, bodies)
        ch.dead_lettered(offsets, True)


def test_a_burst_is_published_in_bounded_batches() -> None:
    from pybroker.core.channel import DEAD_BATCH

    log = TopicLog(None, max_bytes_per_file=1 << 20, mem_records=1000, max_record_bytes=4096)
    owner = ConfirmingOwner()
    t = Topic("t", log, 1000, lambda _t, _c: owner)
    t.dl_defaults = (1, "")
    ch, _ = t.get_channel("c")
    c = Client(rdy=1000)
    ch.add_consumer(c, 0)
    publish(t, 600)
    ch.dispatch(0, WALL)
    _req_all(ch, c, MS)
    rounds = 0
    owner.dirty.clear()
    ch.dispatch(S, WALL + S)
    while owner.dirty:
        owner.dirty.clear()
        ch.dispatch(S, WALL + S)
        rounds += 1
    sizes = [len(offs) for _, offs, _ in owner.published]
    assert sizes == [DEAD_BATCH, DEAD_BATCH, 600 - 2 * DEAD_BATCH] and rounds == 2
    assert all(type(b) is bytes for _, _, bodies in owner.published for b in bodies)
    assert ch.dead_letter_count == 600 and ch.depth(WALL) == 0 and len(c.got) == 600


def _hop_env(from_: list[str], body: bytes = b"orig") -> bytes:
    raw = envelope(topic=from_[0], channel="c0", offset=7, attempts=3, first_delivery_ms=1,
                   last_delivery_ms=2, dead_at_ms=3, published_ms=0, body=body)
    for i, topic in enumerate(from_[1:], 1):
        got = wrap(topic=topic, channel=f"c{i}", offset=i, attempts=2, first_delivery_ms=10,
                   last_delivery_ms=20, dead_at_ms=30, published_ms=5, body=raw,
                   target="somewhere-else")
        assert got is not None
        raw = got
    return raw


def test_dead_lettering_a_dead_letter_extends_its_header() -> None:
    raw = _hop_env(["a", "b", "c"])
    d = parse_envelope(raw)
    assert d.body == b"orig" and raw.count(b"\n") == 1        # never nested
    assert (d.topic, d.channel, d.id) == ("c", "c2", "0000000000000002")
    assert d.from_topics == ("a", "b", "c")
    assert [(h["topic"], h["channel"], h["attempts"]) for h in d.hops] == \
        [("a", "c0", 3), ("b", "c1", 2)]
    # going back to a topic it left: refused; elsewhere: one more hop
    kw = dict(channel="x", offset=1, attempts=1, first_delivery_ms=0, last_delivery_ms=0,
              dead_at_ms=0, published_ms=0, body=raw)
    assert wrap(topic="d", target="b", **kw) is None
    assert wrap(topic="d", target="a", **kw) is None
    assert parse_envelope(wrap(topic="d", target="e", **kw) or b"").from_topics == \
        ("a", "b", "c", "d")


def test_an_old_envelope_without_from_counts_its_topic() -> None:
    old = b'{"v":1,"topic":"a","channel":"c","id":"0000000000000001","attempts":2,' \
        b'"first_delivery_ms":1,"last_delivery_ms":2,"dead_at_ms":3,"published_ms":0,' \
        b'"body_len":2}\nhi'
    assert parse_envelope(old).from_topics == ("a",)
    kw = dict(channel="x", offset=1, attempts=1, first_delivery_ms=0, last_delivery_ms=0,
              dead_at_ms=0, published_ms=0, body=old)
    assert wrap(topic="b", target="a", **kw) is None
    assert parse_envelope(wrap(topic="b", target="z", **kw) or b"").body == b"hi"


@pytest.mark.parametrize("body", [
    b"[" * 100_000 + b"\n",                         # nesting past the recursion limit
    b"{" + b" " * (70 * 1024) + b"}\n",             # a header line over MAX_HEADER
    b'{"v":1,"from":"a"}\nx',                       # fields of the wrong shape
    b'{"v":1,"topic":"a","channel":"c","id":"1","attempts":1,"first_delivery_ms":1,'
    b'"last_delivery_ms":1,"dead_at_ms":1,"published_ms":1,"from":[1],"body_len":1}\nx',
])
def test_a_body_that_is_not_quite_an_envelope_is_wrapped_whole(body: bytes) -> None:
    got = wrap(topic="t", channel="c", offset=1, attempts=1, first_delivery_ms=0,
               last_delivery_ms=0, dead_at_ms=0, published_ms=0, body=body, target="a")
    assert got is not None
    d = parse_envelope(got)
    assert d.body == body and d.from_topics == ("t",)


def test_closes_cycle_follows_the_configured_targets() -> None:
    graph = {"b": ["c"], "c": ["d", "a"], "x": ["x2"]}
    assert closes_cycle("a", "b", lambda t: graph.get(t, []))
    assert not closes_cycle("a", "x", lambda t: graph.get(t, []))
    loop = {"p": ["q"], "q": ["p"]}          # a cycle not through "a": the walk ends
    assert not closes_cycle("a", "p", lambda t: loop.get(t, []))


def _cycling(keep: bool) -> tuple[Topic, Channel, Owner, Client]:
    """Topic "u"'s channel dead-letters to "t"; its message already left "t"."""
    log = TopicLog(None, max_bytes_per_file=1 << 20, mem_records=100, max_record_bytes=4096)
    owner = Owner()
    t = Topic("u", log, 100, lambda _t, _c: owner)
    t.dl_defaults = (2, "t")
    ch, _ = t.get_channel("c")
    if keep:
        t.get_channel("dead-letters")
    c = Client(rdy=1)
    ch.add_consumer(c, 0)
    t.publish([_hop_env(["t"])], WALL)
    t.write()
    return t, ch, owner, c


def test_a_message_that_would_cycle_stays_kept_by_the_dead_letters_channel() -> None:
    t, ch, owner, c = _cycling(keep=True)
    for k in range(3):
        ch.dispatch(k * S, WALL + k * S)
        _req_all(ch, c, k * S + MS)
    assert [m.attempts for m in c.got] == [1, 2]
    assert not owner.published and ch.dead_letter_cycles == 1
    assert ch.depth(WALL) == 0 and not ch.in_flight and ch.floor() == 1   # finished here
    assert t.channels["dead-letters"].depth(WALL) == 1                    # kept there


def test_a_message_that_would_cycle_with_nothing_keeping_it_is_delivered_on() -> None:
    t, ch, owner, c = _cycling(keep=False)
    for k in range(5):
        ch.dispatch(k * S, WALL + k * S)
        _req_all(ch, c, k * S + MS)
    assert [m.attempts for m in c.got] == [1, 2, 3, 4, 5]
    assert not owner.published and ch.dead_letter_cycles == 1             # counted once
