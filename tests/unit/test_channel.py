"""Channel: a cursor over a real (in-memory) topic log — delivery under RDY, FIN/REQ/
TOUCH, timeouts, deferral, requeue on disconnect, empty, rewind, saved state.

Time is passed in as now_ns; a small consumer object decodes the frames it is sent
with the tests' own codec (tests/support/wire.py).
"""
from __future__ import annotations

import array
import gc
import struct
from pathlib import Path

import pytest

from pybroker.core import channel as channel_mod
from pybroker.core import lifecycle
from pybroker.core.channel import Channel
from pybroker.core.flight import Consumer, offset_of
from pybroker.core.topic import Topic
from pybroker.errors import NotInFlight, NotOwner, TooManyConsumers
from pybroker.storage.topiclog import TopicLog
from tests.support.wire import Message, parse_message

S = 1_000_000_000
WALL = 1_700_000_000 * S


def deliver_each(sends: list[tuple[Consumer, int, int]], out: bytes | bytearray) -> None:
    """A fake owner's Owner.deliver: one send_frames per consumer (the layout:
    core/seams.py)."""
    at = 0
    for c, n, end in sends:
        c.send_frames(bytes(out[at:end]), n)
        at = end


class Owner:
    def __init__(self) -> None:
        self.dirty: list[Channel] = []
        # consumers whose write fails in deliver: closed there, as the loop closes them
        self.failing: dict[Consumer, Channel] = {}

    def mark_dirty(self, ch: Channel) -> None:
        self.dirty.append(ch)

    def deliver(self, sends: list[tuple[Consumer, int, int]], out: bytes | bytearray) -> None:
        if not self.failing:
            deliver_each(sends, out)
            return
        at = 0
        for c, n, end in sends:
            ch = self.failing.pop(c, None)
            if ch is None:
                c.send_frames(bytes(out[at:end]), n)
            else:
                ch.remove_consumer(c)
            at = end


class Client:
    def __init__(self, rdy: int, msg_timeout_ns: int = 10 * S) -> None:
        self.rdy = rdy
        self.msg_timeout_ns = msg_timeout_ns
        self.sample_rate = 0
        self.in_flight_count = 0
        self.got: list[Message] = []

    def ready_room(self) -> int:
        return self.rdy - self.in_flight_count

    def send_frames(self, frames: bytes, n: int) -> None:
        pos = 0
        before = len(self.got)
        while pos < len(frames):
            size, kind = struct.unpack_from(">ii", frames, pos)
            assert kind == 2
            self.got.append(parse_message(frames[pos + 8:pos + 4 + size]))
            pos += 4 + size
        assert len(self.got) - before == n


def make_topic(mem: int = 100, name: str = "t") -> Topic:
    log = TopicLog(None, max_bytes_per_file=1 << 20, mem_records=mem, max_record_bytes=4096)
    owner = Owner()
    return Topic(name, log, mem, lambda t, c: owner)


def publish(t: Topic, n: int, defer_ns: int = 0, ts: int = WALL, prefix: bytes = b"body") -> None:
    t.publish([prefix + b"%d" % i for i in range(n)], ts, defer_ns)
    t.write()


def make(mem: int = 100) -> tuple[Topic, Channel]:
    t = make_topic(mem)
    ch, _ = t.get_channel("c")
    return t, ch


def one_consumer(n: int, rdy: int, msg_timeout_ns: int = 10 * S, mem: int = 100
                 ) -> tuple[Topic, Channel, Client]:
    """A channel with one consumer at this RDY count, n messages published, one
    dispatch."""
    t, ch = make(mem)
    c = Client(rdy=rdy, msg_timeout_ns=msg_timeout_ns)
    ch.add_consumer(c, 0)
    publish(t, n)
    ch.dispatch(0, WALL)
    return t, ch, c


def two_consumers(n: int, rdy_a: int, rdy_b: int) -> tuple[Topic, Channel, Client, Client]:
    """A channel with two consumers at these RDY counts, n messages published, one
    dispatch."""
    t, ch = make()
    a, b = Client(rdy=rdy_a), Client(rdy=rdy_b)
    ch.add_consumer(a, 0)
    ch.add_consumer(b, 0)
    publish(t, n)
    ch.dispatch(0, WALL)
    return t, ch, a, b


def two_at_rdy1(n: int) -> tuple[Topic, Channel, Client, Client]:
    """A channel with two consumers at RDY 1, n messages published, one dispatch."""
    return two_consumers(n, 1, 1)


def test_rdy_caps_in_flight_and_fin_frees_a_slot() -> None:
    t, ch, c = one_consumer(10, 3)
    assert [m.attempts for m in c.got] == [1, 1, 1] and c.in_flight_count == 3
    ch.dispatch(0, WALL)
    assert len(c.got) == 3
    ch.finish(c, c.got[0].id)
    ch.dispatch(0, WALL)
    assert len(c.got) == 4 and ch.depth(WALL) == 6
    assert [int(m.id, 16) for m in c.got] == [0, 1, 2, 3]
    assert [m.body for m in c.got] == [b"body0", b"body1", b"body2", b"body3"]


def test_a_consumer_closed_while_its_pass_is_delivered() -> None:
    """The owner's deliver may close a consumer of the pass (its write failed): the
    pass is settled before (no error), and that consumer's message is requeued and goes
    to the others."""
    t, ch = make()
    cs = [Client(rdy=1) for _ in range(3)]
    for c in cs:
        ch.add_consumer(c, 0)
    publish(t, 6)
    owner = ch.owner
    assert isinstance(owner, Owner)
    owner.failing[cs[2]] = ch       # the last of the pass
    ch.dispatch(0, WALL)
    assert cs[2] not in ch.consumers and cs[2].got == []
    assert len(cs[0].got) == 1 and len(cs[1].got) == 1
    got = []
    for _ in range(10):
        for c in (cs[0], cs[1]):
            for m in c.got:
                ch.finish(c, m.id)
                got.append(m.body)
            c.got.clear()
        ch.dispatch(0, WALL)
    assert sorted(got) == sorted(b"body%d" % i for i in range(6))
    assert ch.depth(WALL) == 0 and len(ch.in_flight) == 0


def test_one_fin_each_in_order_when_two_name_the_same_message() -> None:
    """finish_singles (a turn's FINs at RDY 1) in the order read: another consumer's
    FIN of a message before its owner's fails NotOwner and leaves it; the owner's then
    finishes it; a second FIN of it after that fails NotInFlight."""
    t, ch, a, b = two_at_rdy1(2)
    off = int(b.got[0].id, 16)
    failed = ch.finish_singles([a, b, a], [off, off, off])
    assert [(i, type(e)) for i, e in failed] == [(0, NotOwner), (2, NotInFlight)]
    assert b.in_flight_count == 0 and a.in_flight_count == 1 and len(ch.in_flight) == 1


def test_round_robin_between_ready_consumers() -> None:
    t, ch, a, b = two_at_rdy1(4)
    assert len(a.got) == 1 and len(b.got) == 1


def test_fin_errors() -> None:
    t, ch, a, b = two_at_rdy1(1)
    owner, other = (a, b) if a.got else (b, a)
    mid = owner.got[0].id
    with pytest.raises(NotOwner):
        ch.finish(other, mid)
    ch.finish(owner, mid)
    with pytest.raises(NotInFlight):
        ch.finish(owner, mid)
    with pytest.raises(NotInFlight):
        ch.finish(owner, b"zzzzzzzzzzzzzzzz")
    with pytest.raises(NotInFlight):
        ch.finish(owner, b"000000000000000_")


def test_finish_offsets_reports_failures_in_order() -> None:
    t, ch = make()
    c, other = Client(rdy=5), Client(rdy=0)
    ch.add_consumer(c, 0)
    publish(t, 5)
    ch.dispatch(0, WALL)
    failed = ch.finish_offsets(c, [0, -1, 1, 0, 77])
    assert [(i, type(e).__name__) for i, e in failed] == \
        [(1, "NotInFlight"), (3, "NotInFlight"), (4, "NotInFlight")]
    assert ch.finish_offsets(other, [2]) and c.in_flight_count == 3 and len(ch.in_flight) == 3


def test_finish_offsets_whole_flights_and_mixed_batches() -> None:
    """FIN batches: a repeat fails its second FIN, a foreign offset fails and stays in
    flight, a whole flight finished out of order leaves the timeout wheel."""
    t, ch = make()
    c, other = Client(rdy=3), Client(rdy=3)
    ch.add_consumer(c, 0)
    publish(t, 3)
    ch.dispatch(0, WALL)            # one flight of 3 to one of them
    ch.add_consumer(other, 0)
    owner, rest = (c, other) if c.got else (other, c)
    publish(t, 3)
    ch.dispatch(0, WALL)            # the next 3 to the other
    assert len(ch.in_flight) == 6 and len(ch.in_flight_wheel) == 2
    mine = [offset_of(m.id) for m in owner.got]
    theirs = [offset_of(m.id) for m in rest.got]
    # a repeat: the second FIN of 1 fails, the others finish
    failed = ch.finish_offsets(owner, [mine[1], mine[0], mine[1]])
    assert [(i, type(e).__name__) for i, e in failed] == [(2, "NotInFlight")]
    assert owner.in_flight_count == 1 and len(ch.in_flight_wheel) == 2
    # a foreign offset in the batch: NotOwner for it, the rest finish, its flight stays
    failed = ch.finish_offsets(owner, [theirs[0], mine[2]])
    assert [(i, type(e).__name__) for i, e in failed] == [(0, "NotOwner")]
    assert owner.in_flight_count == 0 and len(ch.in_flight_wheel) == 1
    assert theirs[0] in ch.in_flight
    # a whole flight in one batch, out of order: its timeout leaves the wheel
    assert ch.finish_offsets(rest, theirs[::-1]) == []
    assert rest.in_flight_count == 0 and not ch.in_flight and not len(ch.in_flight_wheel)


def test_requeue_now_and_deferred_keep_timestamp_and_count_attempts() -> None:
    t, ch = make()
    c = Client(rdy=1)
    ch.add_consumer(c, 0)
    publish(t, 1, ts=WALL + 1000)
    ch.dispatch(0, WALL)
    m = c.got[-1]
    ch.requeue(c, m.id, 0, 0, WALL)
    ch.dispatch(0, WALL)
    assert c.got[-1].id == m.id and c.got[-1].attempts == 2
    ch.requeue(c, m.id, 5 * S, 1 * S, WALL)
    assert ch.deferred_count(WALL) == 1 and ch.depth(WALL) == 0
    timed_out, due = ch.expire(6 * S - 1)
    assert not timed_out and not due
    timed_out, due = ch.expire(6 * S)
    assert len(due) == 1 and timed_out == []
    ch.requeue_expired(timed_out, due)
    ch.dispatch(6 * S, WALL)
    got = c.got[-1]
    assert got.id == m.id and got.attempts == 3 and got.ts_ns == WALL + 1000
    assert ch.requeue_count == 2


def test_timeout_requeues_and_counts() -> None:
    t, ch, c = one_consumer(3, 3, msg_timeout_ns=2 * S)
    ch.finish(c, c.got[1].id)
    timed_out, due = ch.expire(2 * S)
    assert len(timed_out) == 1 and not due      # one flight of three
    ch.requeue_expired(timed_out, due)
    assert c.in_flight_count == 0 and ch.timeout_count == 2
    with pytest.raises(NotInFlight):
        ch.finish(c, c.got[0].id)
    ch.dispatch(3 * S, WALL)
    assert [(m.body, m.attempts) for m in c.got[3:]] == [(b"body0", 2), (b"body2", 2)]


def test_touch_extends_but_not_past_max_msg_timeout() -> None:
    t, ch, c = one_consumer(2, 2, msg_timeout_ns=2 * S)
    mid = c.got[0].id
    ch.touch(c, mid, 1 * S, max_msg_timeout_ns=4 * S)   # deadline 3 s (its own flight)
    timed_out, _ = ch.expire(2 * S)
    assert [f.first for f in timed_out] == [0]          # the other one of the flight
    ch.requeue_expired(timed_out, [])
    assert [off for off in ch.in_flight] == [0]
    ch.touch(c, mid, 3 * S, max_msg_timeout_ns=4 * S)   # capped at delivery + 4 s
    assert ch.expire(4 * S - 1) == ([], [])
    assert len(ch.expire(4 * S)[0]) == 1


def test_dpub_is_not_delivered_early_and_counts_as_deferred() -> None:
    t, ch = make()
    c = Client(rdy=5)
    ch.add_consumer(c, 0)
    publish(t, 2, defer_ns=3 * S)
    publish(t, 1, prefix=b"now")
    assert ch.deferred_count(WALL) == 2 and ch.depth(WALL) == 1
    ch.dispatch(0, WALL)
    assert [m.body for m in c.got] == [b"now0"] and len(ch.deferred) == 2
    ch.requeue_expired(*ch.expire(3 * S))
    ch.dispatch(3 * S, WALL + 3 * S)
    assert [m.body for m in c.got] == [b"now0", b"body0", b"body1"]


def test_disconnect_requeues_in_flight_at_once_in_offset_order() -> None:
    """Requeued at once (not at their timeout), in offset order, behind the messages
    queued when the consumer went away (nsqd's requeue order)."""
    _, ch, a, b = two_consumers(5, 3, 0)
    assert ch.remove_consumer(a) == 3
    b.rdy = 10
    ch.dispatch(1, WALL)
    assert [m.body for m in b.got] == [b"body%d" % i for i in (3, 4, 0, 1, 2)]
    assert [m.attempts for m in b.got] == [1, 1, 2, 2, 2]


def test_consumers_leaving_in_one_turn_requeued_a_step_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Consumers that leave in one turn (``EventLoop._requeue_leavers``): detached at
    once, their flights looked for in one pass for all of them (an idle one adds no
    work), then looked through and requeued a bounded step at a time; a flight that
    timed out in between is not requeued twice, and every message comes back once,
    with its attempt counted."""
    monkeypatch.setattr(lifecycle, "SCAN_STEP", 2)
    monkeypatch.setattr(lifecycle, "LEAVE_STEP", 2)
    t, ch = make()
    a, b, c, idle = Client(rdy=3), Client(rdy=3), Client(rdy=2), Client(rdy=5)
    for x in (a, b, c):
        ch.add_consumer(x, 0)
    publish(t, 8)
    ch.dispatch(0, WALL)
    ch.add_consumer(idle, 0)
    assert [x.in_flight_count for x in (a, b, c, idle)] == [3, 3, 2, 0]
    ch.touch(a, a.got[0].id, 1, 60 * S)        # a flight of one message of its own
    for x in (a, b, c, idle):
        assert ch.detach(x)
    assert not ch.detach(a) and ch.consumers == []
    assert not ch.leave([idle])                # nothing in flight: no work at all
    assert ch.leave([a, b, c, idle])
    assert len(ch.in_flight) == 8              # in flight until requeued
    # 4 flights, looked through 2 a step: the first step requeues nothing
    assert ch.requeue_step() == (0, True)
    # c's flight times out before its step comes
    timed_out, _ = ch.expire(WALL + 11 * S)
    (cf,) = [f for f in timed_out if f.client is c]
    ch.requeue_expired([cf], [])
    steps = []
    more = True
    while more:
        n, more = ch.requeue_step()
        steps.append(n)
    assert sum(steps) == 6 and max(steps) <= 3   # a's and b's; a step: 2 messages,
    #                                              or the one flight it begins with
    assert [x.in_flight_count for x in (a, b, c)] == [0, 0, 0] and len(ch.in_flight) == 0
    assert ch.requeue_step() == (0, False)
    d = Client(rdy=10)
    ch.add_consumer(d, 0)
    ch.dispatch(2, WALL)
    assert sorted(m.body for m in d.got) == sorted(b"body%d" % i for i in range(8))
    assert all(m.attempts == 2 for m in d.got)


def test_empty_drops_what_consumers_that_left_held() -> None:
    """/channel/empty while the requeues of consumers that left are under way: their
    messages are dropped with the rest, and the steps left do nothing."""
    t, ch, a, b = two_consumers(6, 3, 3)
    for x in (a, b):
        ch.detach(x)
    assert ch.leave([a, b])
    ch.empty()
    assert ch.requeue_step() == (0, False)
    d = Client(rdy=10)
    ch.add_consumer(d, 0)
    ch.dispatch(1, WALL)
    assert d.got == [] and ch.depth(WALL) == 0


def test_free_some_frees_a_budget_of_entries_nested_ones_too() -> None:
    """``free_some``: each call drops its budget of entries, the last container's
    first; a timer bucket of more than a few entries joins the litter, freed the same
    way (its entries on budgets of their own); nothing is left after enough calls."""
    from collections import deque

    litter: list[lifecycle.Litter] = [list(range(10)), deque(range(5)), set(range(7)),
                                      {i: object() for i in range(20)}]
    sizes = []
    while litter:
        before = sum(len(x) for x in litter)
        lifecycle.free_some(litter, 16)
        sizes.append(before - sum(len(x) for x in litter))
    assert sizes == [16, 16, 10]
    buckets = {b: {i: object() for i in range(100)} for b in range(3)}
    litter = [buckets]
    calls = 0
    while litter:
        lifecycle.free_some(litter, 16)
        calls += 1
        assert all(len(x) <= 100 for x in litter[1:])
    assert calls == -(-303 // 16)   # the 3 buckets and their 300 entries, 16 a call


def test_empty_frees_what_it_dropped_a_step_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """/channel/empty hands what it dropped (flights, their timers, requeued
    offsets) to steps (``lifecycle.freeing``, one a turn on the owner loop's
    ``run_steps``); the channel works at once, and the steps end."""
    monkeypatch.setattr(lifecycle, "FREE_STEP", 4)
    t, ch = make()
    c = Client(rdy=1)
    ch.add_consumer(c, 0)
    publish(t, 30)
    for _ in range(20):             # 20 flights of one message, each its own timer
        c.in_flight_count = 0
        ch.dispatch(0, WALL)
    ch.rewind(0)
    c.in_flight_count = 20
    litter = ch.empty()
    assert c.in_flight_count == 0 and len(ch.in_flight) == 0 and ch.depth(WALL) == 0
    assert litter
    steps = 0
    for _ in lifecycle.freeing(litter):
        steps += 1
        assert steps < 100
    assert steps >= 5 and litter == []     # 20 flights of one message, 4 a step
    publish(t, 2)
    c.in_flight_count = 0
    c.rdy = 5
    ch.dispatch(1, WALL)
    assert [m.body for m in c.got[-2:]] == [b"body0", b"body1"]


def test_max_consumers() -> None:
    _, ch = make()
    ch.add_consumer(Client(1), 1)
    with pytest.raises(TooManyConsumers):
        ch.add_consumer(Client(1), 1)


def test_first_channel_gets_the_backlog_later_ones_start_at_the_end() -> None:
    t = make_topic()
    publish(t, 5)
    first, _ = t.get_channel("first")
    later, _ = t.get_channel("later")
    assert first.depth(WALL) == 5 and later.depth(WALL) == 0
    publish(t, 2)
    assert first.depth(WALL) == 7 and later.depth(WALL) == 2
    assert first.message_count == 7 and later.message_count == 2


def test_ephemeral_channel_skips_what_overflows_its_memory() -> None:
    t = make_topic(mem=3)
    eph, _ = t.get_channel("c#ephemeral")
    c = Client(rdy=100)
    eph.add_consumer(c, 0)
    publish(t, 10)
    eph.dispatch(0, WALL)
    assert [m.body for m in c.got] == [b"body7", b"body8", b"body9"]


def test_topic_pause_holds_new_messages_back_and_empty_drops_them() -> None:
    t, ch = make()
    c = Client(rdy=100)
    ch.add_consumer(c, 0)
    publish(t, 2, prefix=b"before")
    assert t.set_paused(True) == []
    publish(t, 3, prefix=b"paused")
    ch.dispatch(0, WALL)
    assert [m.body for m in c.got] == [b"before0", b"before1"]
    assert t.depth() == 3 and ch.depth(WALL) == 0
    t.empty()
    assert t.depth() == 0
    publish(t, 1, prefix=b"after")
    assert t.set_paused(False) == [ch]
    ch.dispatch(0, WALL)
    assert [m.body for m in c.got[2:]] == [b"after0"]


def test_empty_and_rewind() -> None:
    t, ch = make()
    c = Client(rdy=2)
    ch.add_consumer(c, 0)
    publish(t, 4)
    publish(t, 1, defer_ns=S)
    ch.dispatch(0, WALL)
    ch.empty()
    assert ch.depth(WALL) == 0 and c.in_flight_count == 0 and not ch.in_flight
    assert ch.deferred_count(WALL) == 0
    ch.rewind(1)
    c.rdy = 10
    ch.dispatch(0, WALL)
    assert [m.body for m in c.got[2:]] == [b"body1", b"body2", b"body3"]


def test_snapshot_restores_pending_state() -> None:
    t, ch, c = one_consumer(6, 3)
    ch.finish(c, c.got[1].id)
    ch.requeue(c, c.got[2].id, 5 * S, 0, WALL)
    snap = ch.snapshot(WALL, 0)
    assert snap["cursor"] == 3
    assert sorted(list(p[:2]) for p in snap["pending"]) == [[0, 1], [2, 1]]
    t2 = Topic("t", t.log, 100, lambda a, b: Owner())
    again = t2.new_channel("c", cursor=0)
    again.restore(snap, 0, WALL + S)
    c2 = Client(rdy=10)
    again.add_consumer(c2, 0)
    again.dispatch(0, WALL + S)
    # offset 0 was in flight: ready again; 2 is deferred for 4 more seconds; 3.. follow
    assert [(m.body, m.attempts) for m in c2.got] == \
        [(b"body0", 2), (b"body3", 1), (b"body4", 1), (b"body5", 1)]
    assert again.deferred_count(WALL + S) == 1


def test_a_saved_cursor_past_the_log_end_restarts_at_the_end() -> None:
    """A state whose cursor is past its log's end (not this log's state) takes the
    cursor to the end: what is published next is delivered, not skipped; pending
    offsets past the end are dropped."""
    t, ch = make()
    publish(t, 3)
    again = t.new_channel("c2", cursor=0)
    again.restore({"cursor": 20, "pending": [[1, 2, 0], [15, 1, 0]]}, 0, WALL)
    assert again.cursor == 3
    publish(t, 2)
    c = Client(rdy=10)
    again.add_consumer(c, 0)
    again.dispatch(0, WALL)
    assert [(m.body, m.attempts) for m in c.got] == \
        [(b"body1", 3), (b"body0", 1), (b"body1", 1)]


def test_one_pass_redelivers_requeued_runs_each_with_its_attempts() -> None:
    """Requeued messages read together are framed together (one call a run of
    offsets), each with its own count: two runs (0-1, 3-4) in one pass."""
    t, ch = make()
    publish(t, 5)
    again = t.new_channel("c2", cursor=0)
    again.restore({"cursor": 5, "pending": [[0, 3, 0], [1, 1, 0], [3, 5, 0], [4, 2, 0]]},
                  0, WALL)
    c = Client(rdy=10)
    again.add_consumer(c, 0)
    again.dispatch(0, WALL)
    assert [(m.body, m.attempts) for m in c.got] == \
        [(b"body0", 4), (b"body1", 2), (b"body3", 6), (b"body4", 3)]
    assert c.in_flight_count == 4


# -- nsqd's requeue order ---------------------------------------------------------------
def test_timed_out_message_goes_behind_the_queued_ones() -> None:
    """nsqd: PUB A, PUB B; a RDY 1 consumer lets A time out -> B, then A (attempts 2)."""
    t, ch, c = one_consumer(2, 1, msg_timeout_ns=S)
    assert [(m.body, m.attempts) for m in c.got] == [(b"body0", 1)]
    ch.requeue_expired(*ch.expire(S))
    ch.dispatch(S, WALL + S)
    ch.finish(c, c.got[-1].id)
    ch.dispatch(S, WALL + S)
    assert [(m.body, m.attempts) for m in c.got] == \
        [(b"body0", 1), (b"body1", 1), (b"body0", 2)]


def test_req_waits_behind_at_most_mem_queue_size_messages(tmp_path: Path) -> None:
    """With more queued than mem_queue_size (what nsqd would hold on disk), a REQ'd
    message waits behind mem_queue_size of them, not the whole backlog."""
    log = TopicLog(str(tmp_path), max_bytes_per_file=1 << 20, mem_records=3,
                   max_record_bytes=4096)
    owner = Owner()
    t = Topic("t", log, 3, lambda _t, _c: owner)
    ch, _ = t.get_channel("c")
    c = Client(rdy=1)
    ch.add_consumer(c, 0)
    publish(t, 10)
    ch.dispatch(0, WALL)
    ch.requeue(c, c.got[0].id, 0, 0, WALL)
    for _ in range(5):
        ch.dispatch(0, WALL)
        ch.finish(c, c.got[-1].id)
    assert [m.body for m in c.got] == [b"body0", b"body1", b"body2", b"body3", b"body0",
                                       b"body4"]


def test_due_deferred_message_goes_behind_the_queued_ones() -> None:
    t, ch, c = one_consumer(1, 1)
    ch.requeue(c, c.got[0].id, S, 0, WALL)
    publish(t, 2, prefix=b"new")
    ch.requeue_expired(*ch.expire(S))       # due: behind new0 and new1
    for _ in range(3):
        ch.dispatch(S, WALL + S)
        ch.finish(c, c.got[-1].id)
    assert [m.body for m in c.got] == [b"body0", b"new0", b"new1", b"body0"]


# -- rewind while messages are held -----------------------------------------------------
def test_rewind_keeps_in_flight_in_flight_and_replays_it_after_fin() -> None:
    """The wedge of issue 22: the FIN works, in_flight_count drops to 0, and the RDY 1
    consumer gets the message again (anew), then the rest."""
    t, ch, c = one_consumer(3, 1)
    ch.rewind(0)
    ch.dispatch(0, WALL)
    assert len(c.got) == 1 and len(ch.in_flight) == 1     # not sent again meanwhile
    assert ch.depth(WALL) == 2 and ch.message_count == 3
    ch.finish(c, c.got[0].id)
    assert c.in_flight_count == 0 and not ch.in_flight
    assert ch.depth(WALL) == 3 and ch.message_count == 4  # the replay is a new put
    for _ in range(3):
        ch.dispatch(0, WALL)
        ch.finish(c, c.got[-1].id)
    assert [(m.body, m.attempts) for m in c.got] == \
        [(b"body0", 1), (b"body0", 1), (b"body1", 1), (b"body2", 1)]
    assert ch.depth(WALL) == 0 and not ch.in_flight and not ch.skip and not ch.replay


def test_a_rewind_owes_a_replay_to_what_was_in_flight_from_its_offset_on() -> None:
    """Owed: a message in flight at the rewind, at or after its offset, when that flight
    ends by FIN (TOUCHed meanwhile too: its flight of one keeps when it went out). Not
    owed: one before the offset, one REQ'd meanwhile (its redelivery is a new life), one
    that went out after the rewind. Once nothing is in flight, no rewind is kept."""
    t, ch, c = one_consumer(5, 3)  # 0, 1, 2 in flight: one flight
    ch.rewind(1)
    assert list(ch.skip) == [1, 2] and ch.rewinds == [(1, 1)]
    count = ch.message_count
    ch.touch(c, c.got[2].id, S, 60 * S)           # 2 now a flight of its own
    ch.requeue(c, c.got[1].id, 0, S, WALL)        # 1 back in the queue: not owed
    ch.finish(c, c.got[0].id)                     # before the offset: not owed
    assert ch.message_count == count and [e[:2] for e in ch.requeued] == [(1, 1)]
    ch.finish(c, c.got[2].id)                     # owed: once more, anew
    assert ch.message_count == count + 1 and [e[:2] for e in ch.requeued] == [(1, 1), (2, 0)]
    assert not ch.in_flight and ch.rewinds == []
    c.rdy = 1
    for _ in range(10):                           # what went out after it: not owed
        ch.dispatch(S, WALL)
        if c.in_flight_count:
            ch.finish(c, c.got[-1].id)
    assert sorted((m.body, m.attempts) for m in c.got[3:]) == \
        [(b"body1", 2), (b"body2", 1), (b"body3", 1), (b"body4", 1)]
    assert ch.message_count == count + 1 and ch.depth(WALL) == 0


def test_each_rewind_owes_what_was_in_flight_when_it_came() -> None:
    """Two rewinds, flights before and between them: each FIN'd message is owed its
    replay once if a rewind after its flight went out began at or before it."""
    t, ch, c = one_consumer(5, 3)  # 0, 1, 2 (before both rewinds)
    ch.rewind(2)
    c.rdy = 5
    ch.dispatch(0, WALL)                          # 3, 4 (between them)
    ch.rewind(4)
    assert [m.body for m in c.got] == [b"body%d" % i for i in range(5)]
    assert ch.rewinds == [(1, 2), (2, 4)] and list(ch.skip) == [4]
    count = ch.message_count
    owed = []
    for m in c.got[:5]:
        before = ch.message_count
        if m.body == b"body2":
            ch.finish(c, m.id)                    # (one FIN)
        else:
            ch.finish_offsets(c, [offset_of(m.id)])   # (a batch's path)
        owed.append(ch.message_count - before)
    assert owed == [0, 0, 1, 0, 1] and ch.message_count == count + 2
    assert [e[:2] for e in ch.requeued] == [(2, 0), (4, 0)] and ch.rewinds == []


def test_empty_leaves_every_consumer_holding_nothing() -> None:
    """Flights of several messages and flights of one (TOUCHed), to two consumers:
    after ``empty`` neither holds anything."""
    t, ch, a, b = two_consumers(10, 4, 3)
    ch.touch(a, a.got[1].id, S, 60 * S)
    ch.touch(b, b.got[0].id, S, 60 * S)
    assert a.in_flight_count + b.in_flight_count == len(ch.in_flight) == 7
    ch.empty()
    assert (a.in_flight_count, b.in_flight_count) == (0, 0)
    assert not ch.in_flight and ch.depth(WALL) == 0
    publish(t, 2)
    ch.dispatch(0, WALL)                      # each takes up to its RDY again
    assert a.in_flight_count + b.in_flight_count == 2


def test_rewind_over_requeued_and_deferred_keeps_their_attempts() -> None:
    t, ch, c = one_consumer(3, 3)
    ch.requeue(c, c.got[0].id, 0, 0, WALL)
    ch.requeue(c, c.got[1].id, 5 * S, 0, WALL)
    ch.rewind(0)
    assert ch.deferred_count(WALL) == 1 and ch.depth(WALL) == 1   # body0 requeued only
    c.rdy = 10
    ch.dispatch(0, WALL)
    # body0 (requeued, ready at once), then the re-read skips 0 and 1 and 2 is in flight
    assert [(m.body, m.attempts) for m in c.got[3:]] == [(b"body0", 2)]
    ch.finish(c, c.got[2].id)           # body2: in flight when rewound -> once more
    ch.dispatch(0, WALL)
    assert [(m.body, m.attempts) for m in c.got[3:]] == [(b"body0", 2), (b"body2", 1)]
    ch.requeue_expired(*ch.expire(5 * S))
    ch.dispatch(5 * S, WALL + 5 * S)
    assert (c.got[-1].body, c.got[-1].attempts) == (b"body1", 2)


def test_requeued_before_a_rewind_go_at_once_and_one_requeued_after_it_waits() -> None:
    """A rewind makes the requeued messages it finds ready at once, ahead of the range
    it replays (counted at the head of the FIFO, ``ready_head``, not made again); one
    requeued after it waits behind the messages queued ahead of it, as any REQ does."""
    t, ch, c = one_consumer(6, 3)                # 0-2 in flight, 3-5 queued
    ch.requeue(c, c.got[0].id, 0, 0, WALL)       # each behind 3-5 when requeued
    ch.requeue(c, c.got[1].id, 0, 0, WALL)
    ch.rewind(0)
    assert ch.ready_head == 2 and list(ch.skip) == [0, 1, 2]
    ch.requeue(c, c.got[2].id, 0, 0, WALL)       # after it: behind 3-5 again
    c.rdy = 10
    ch.dispatch(0, WALL)
    assert [(m.body, m.attempts) for m in c.got[3:]] == [
        (b"body0", 2), (b"body1", 2), (b"body3", 1), (b"body4", 1), (b"body5", 1),
        (b"body2", 2)]
    assert ch.ready_head == 0 and not ch.requeued
    ch.rewind(0)                                 # nothing requeued: nothing counted
    assert ch.ready_head == 0


def test_the_requeued_offsets_kept_as_int64s_follow_the_fifo() -> None:
    """``requeued_offsets`` (a rewind's listing) is the FIFO's offsets in its order
    while messages are requeued and taken, past the point where the int64s taken are
    cut off (4,096 and half of them), and a rewind then skips exactly those."""
    t, ch, c = one_consumer(10_000, 10_000, mem=20_000)
    for m in c.got[::-1]:                     # all requeued, last first
        ch.requeue(c, m.id, 0, 0, WALL)
    c.rdy = 0
    taken = 0
    for step in (1000, 3000, 2500, 1, 2000):
        c.rdy += step
        while ch.dispatch(0, WALL):
            pass
        taken += step
        assert len(ch.requeued) == 10_000 - taken
        assert list(ch.requeued_offsets()) == [e[0] for e in ch.requeued]
    for m in c.got[10_000:10_000 + 500]:      # some requeued again, at the tail
        ch.requeue(c, m.id, 0, 0, WALL)
    assert list(ch.requeued_offsets()) == [e[0] for e in ch.requeued]
    ch.rewind(0)
    assert list(ch.skip) == list(range(10_000))
    assert ch.ready_head == len(ch.requeued)


def test_dpubs_held_in_skip_are_counted_once_and_kept_up_with() -> None:
    """DPUBs not yet due ahead of the cursor count as deferred, except those a rewind
    put in ``skip`` (held elsewhere, counted there): found once per skip, then kept up
    with as the cursor passes skip's head, as time passes, and when the topic's DPUBs
    change (/topic/empty); always what a pass over skip counts."""
    t, ch = make()
    c = Client(rdy=50)
    ch.add_consumer(c, 0)
    publish(t, 3)                                  # 0-2
    publish(t, 4, defer_ns=3600 * S, ts=WALL)      # 3-6: read, deferred (held)
    publish(t, 2, defer_ns=10 * S, ts=WALL)        # 7-8: due sooner
    publish(t, 3)                                  # 9-11
    ch.dispatch(0, WALL)
    assert len(ch.deferred) == 6 and len(ch.in_flight) == 6
    ch.rewind(0)
    publish(t, 2, defer_ns=3600 * S, ts=WALL)      # 12-13: not read yet
    assert list(ch.skip) == list(range(12))

    def brute(wall: int) -> int:
        return t.deferred_ahead(ch.cursor, wall) - sum(
            1 for off in ch.skip if t.dpubs.get(off, 0) > wall)

    for wall in (WALL, WALL + 20 * S):
        assert ch._dpubs_ahead(wall) == brute(wall)
    assert ch._dpubs_ahead(WALL) == 2              # 12 and 13 only
    assert ch.deferred_count(WALL) == 6 + 2
    found = ch._skip_dpubs
    c.rdy = 100
    ch.dispatch(1, WALL)               # the cursor passes skip, then defers 12 and 13
    assert ch.cursor == 14 and not ch.skip
    assert ch._dpubs_ahead(WALL) == brute(WALL) == 0
    assert ch.deferred_count(WALL) == 8
    ch.rewind(0)                                   # a new skip: found again
    assert ch._dpubs_ahead(WALL) == brute(WALL)
    assert ch._skip_dpubs is not found
    t.empty()                                      # the topic's DPUBs cleared
    publish(t, 2, defer_ns=3600 * S, ts=WALL)
    assert ch._dpubs_ahead(WALL) == brute(WALL) == 2


@pytest.mark.parametrize("block", [1, 2, 3, 4096])
def test_dpubs_in_skip_counted_by_blocks_as_a_pass_over_skip_counts_them(
        monkeypatch: pytest.MonkeyPatch, block: int) -> None:
    """The deliver-at times of the DPUBs in skip, sorted in blocks (DUE_BLOCK): the
    block the cursor is in walked, the others bisected; at every cursor position and
    time, what a pass over skip counts."""
    monkeypatch.setattr(channel_mod, "DUE_BLOCK", block)
    t, ch = make()
    c = Client(rdy=100)
    ch.add_consumer(c, 0)
    for k in range(6):                   # plain messages and DPUBs due at 10-60 s
        publish(t, 2)
        publish(t, 3, defer_ns=(6 - k) * 10 * S, ts=WALL)
    ch.dispatch(0, WALL)
    assert len(ch.deferred) == 18 and len(ch.in_flight) == 12
    ch.rewind(0)
    end = t.released
    walls = [WALL + k * 5 * S for k in range(14)]
    for at in range(end + 1):
        ch._advance(at)
        for wall in walls:
            assert ch._skipped_dpubs(wall) == sum(
                1 for off in ch.skip if t.dpubs.get(off, 0) > wall), (at, wall)
    assert ch._skipped_dpubs(WALL) == 0


def test_dpubs_published_after_a_rewind_are_not_looked_for_in_its_skip() -> None:
    """A rewind's skip wholly below the DPUBs (published after what it holds): none
    of skip's offsets is looked up, and the count is what a pass over skip says."""
    t, ch, c = one_consumer(30, 50)
    ch.rewind(0)
    publish(t, 5, defer_ns=3600 * S, ts=WALL)      # 30-34, not read yet
    looked: list[int] = []

    class Counting(type(t.dpubs)):  # type: ignore[misc]
        __slots__ = ()

        def __contains__(self, off: object) -> bool:
            looked.append(off)  # type: ignore[arg-type]
            return super().__contains__(off)

        def among(self, offsets: memoryview) -> tuple[array.array[int], array.array[int]]:
            looked.extend(offsets)
            return super().among(offsets)  # type: ignore[no-any-return]

    t.dpubs.__class__ = Counting
    assert ch._dpubs_ahead(WALL) == 5 == t.deferred_ahead(ch.cursor, WALL) - sum(
        1 for off in ch.skip if t.dpubs.get(off, 0) > WALL)
    assert looked == [] and ch._skip_dpubs is not None and not ch._skip_dpubs[2]


def test_a_rewind_is_saved_and_restored_with_what_it_skips() -> None:
    t, ch, c = one_consumer(4, 2)  # 0, 1 in flight
    ch.rewind(0)
    snap = ch.snapshot(WALL, 0)
    assert snap["cursor"] == 0 and snap["skip"] == [0, 1]
    again = Topic("t", t.log, 100, lambda a, b: Owner()).new_channel("c", cursor=0)
    again.restore(snap, 0, WALL)
    c2 = Client(rdy=10)
    again.add_consumer(c2, 0)
    again.dispatch(0, WALL)
    # in flight -> requeued (attempts kept, first); the re-read skips them
    assert [(m.body, m.attempts) for m in c2.got] == \
        [(b"body0", 2), (b"body1", 2), (b"body2", 1), (b"body3", 1)]


def test_commit_forward_passes_what_a_rewind_skips() -> None:
    t, ch, c = one_consumer(5, 1)
    ch.rewind(0)
    assert list(ch.skip) == [0]
    assert ch.commit(3) == 3 and not ch.skip and ch.commit(1) == 3
    ch.finish(c, c.got[0].id)
    c.rdy = 10
    ch.dispatch(0, WALL)
    assert [m.body for m in c.got] == [b"body0", b"body0", b"body3", b"body4"]


def _offsets(chunks: tuple[tuple[tuple[int, int, int], ...], ...]) -> list[int]:
    return sorted(d[0] for part in chunks for d in part)


def test_a_snapshot_shares_the_deferred_messages_while_they_are_unchanged() -> None:
    """snapshot_parts builds again only what changed since the last snapshot; what it
    returned is never changed afterwards (the storage thread reads it while the loop
    goes on)."""
    t, ch, c = one_consumer(5, 5)
    for m in c.got[:3]:
        ch.requeue(c, m.id, 60 * S, 0, WALL)
    _, first = ch.snapshot_parts(WALL, 0)
    _, again = ch.snapshot_parts(WALL, 0)
    assert again is first and _offsets(first) == [0, 1, 2]
    ch.finish(c, c.got[3].id)              # not a deferred one: the snapshot stays shared
    assert ch.snapshot_parts(WALL, 0)[1] is first
    ch.requeue(c, c.got[4].id, 60 * S, 0, WALL)
    _, changed = ch.snapshot_parts(WALL, 0)
    assert changed is not first and _offsets(changed) == [0, 1, 2, 4]
    assert _offsets(first) == [0, 1, 2]
    ch.requeue_expired(*ch.expire(61 * S))   # all due: requeued, none deferred
    assert ch.snapshot_parts(WALL + 61 * S, 61 * S)[1] == ()
    assert _offsets(changed) == [0, 1, 2, 4]


def test_a_snapshot_lists_what_was_pending_when_it_was_taken() -> None:
    """snapshot_parts takes copies of the in-flight table, the requeued and the dying
    messages (MadeLater): its pending entries, made afterwards on another thread, are what
    was pending when it was taken, whatever the loop did since; two snapshots compare
    equal without making their entries, and differ once something changed."""
    t, ch = make(mem=1000)
    big, one = Client(rdy=6), Client(rdy=1)
    ch.add_consumer(big, 0)
    ch.add_consumer(one, 0)
    publish(t, 20)
    ch.dispatch(0, WALL)                  # a flight of several (the table) and one of one
    ch.requeue(big, big.got[0].id, 0, 0, WALL)
    ch.dispatch(0, WALL)
    flying = sorted([off, f.attempts, 0] for off, f in ch.in_flight.items())
    requeued = sorted([off, a, 0] for off, a, _ in ch.requeued)
    assert len(flying) >= 7 and requeued
    before = ch.snapshot(WALL, 0)          # made at once: the reference
    st, _ = ch.snapshot_parts(WALL, 0)
    st2, _ = ch.snapshot_parts(WALL, 0)
    assert st["pending"] == st2["pending"] and st == st2     # compared as copies
    assert sorted(map(list, st["pending"])) == sorted(flying + requeued) == \
        sorted(map(list, before["pending"]))
    st3, _ = ch.snapshot_parts(WALL, 0)
    for m in big.got[1:4]:
        ch.finish(big, m.id)
    ch.finish(one, one.got[0].id)
    ch.dispatch(0, WALL)
    after, _ = ch.snapshot_parts(WALL, 0)
    assert after != st3
    assert sorted(map(list, st3["pending"])) == sorted(flying + requeued)  # made now
    assert sorted(map(list, after["pending"])) == sorted(
        [[off, f.attempts, 0] for off, f in ch.in_flight.items()]
        + [[off, a, 0] for off, a, _ in ch.requeued])


def test_deferred_messages_leave_the_garbage_collectors_sight() -> None:
    """A deferred message is kept as a tuple of ints, which the collector stops
    tracking at its first pass: a full collection then does not walk them one by one
    with every loop held (as objects, 1,000,000 of them cost one 323 ms). All three
    ways in: a REQ with a delay, a DPUB read before it was due, a restored state."""
    t, ch = make(mem=1000)
    c = Client(rdy=200)
    ch.add_consumer(c, 0)
    publish(t, 100)
    publish(t, 50, defer_ns=3600 * S)            # DPUBs: deferred as the cursor passes
    ch.dispatch(0, WALL)
    for m in c.got:
        ch.requeue(c, m.id, 60 * S, 0, WALL)
    assert len(ch.deferred) == 150
    t2, restored = make(mem=1000)
    publish(t2, 150)
    restored.restore(ch.snapshot(WALL, 0), 0, WALL)
    assert len(restored.deferred) == 150
    gc.collect()
    for chan in (ch, restored):
        kept = [chan.deferred.get(off) for off in chan.deferred]
        assert not [d for d in kept if gc.is_tracked(d)]
        assert sorted(chan.deferred_wheel.pop_expired(3601 * S)) == sorted(kept)
