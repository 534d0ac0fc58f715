"""The channel's state machine against a small reference model (Hypothesis
``RuleBasedStateMachine``), in process: a real Channel over a real TopicLog on disk
(tiny segments and memory tail, so reads come from the files and retention deletes
segments), driven by random sequences of publish, deliver, FIN (one and batched), REQ
with and without delay, TOUCH, timeouts and due deferrals (an injected clock), rewind by
offset, empty, pause/unpause, consumer disconnect, restart (snapshot, the log reopened,
restore), retention and max-attempts dead-lettering (the owner's publish confirmed or
failed).

The model is the table of docs/storage.md ("A message's life on a channel") written as
sets: ``queued`` (still to be read at the cursor), ``flight``, ``requeued`` (FIFO with
each entry's mark: the released offset it waits behind, nsqd's order), ``deferred``,
``dying``, ``replay``. It predicts every delivery exactly (offset and attempts, in
order). After every step: nothing lost (the channel accounts for exactly the model's
messages, and retention never deleted one), no message delivered while another delivery
of it is in flight, every counter of /stats equal to the model's, attempts never going
backwards within a life.
"""
from __future__ import annotations

import shutil
import struct
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from pybroker.core.channel import Channel
from pybroker.core.flight import Consumer
from pybroker.core.topic import Topic
from pybroker.errors import NotInFlight, NotOwner
from pybroker.protocol.deadletter import parse_envelope
from pybroker.storage.topiclog import TopicLog
from tests.support.wire import parse_message
from tests.unit.test_channel import deliver_each

MS = 1_000_000
WALL0 = 1_700_000_000_000 * MS
MAX_MSG_TIMEOUT = 5000 * MS
MEM_QUEUE = 10_000          # larger than any run: a requeued message waits behind all


class Owner:
    def __init__(self) -> None:
        self.dirty = False
        self.batches: list[tuple[Channel, list[int], list[bytes]]] = []

    def mark_dirty(self, ch: Channel) -> None:
        self.dirty = True

    def deliver(self, sends: list[tuple[Consumer, int, int]], out: bytes | bytearray) -> None:
        deliver_each(sends, out)

    def dead_letter(self, ch: Channel, target: str, offsets: list[int],
                    bodies: list[bytes]) -> None:
        assert target == "t.dead"
        self.batches.append((ch, list(offsets), list(bodies)))


class Client:
    def __init__(self, name: int, timeout_ms: int) -> None:
        self.name = name
        self.rdy = 0
        self.msg_timeout_ns = timeout_ms * MS
        self.sample_rate = 0
        self.in_flight_count = 0
        self.got: list[tuple[int, int, bytes]] = []

    def ready_room(self) -> int:
        return self.rdy - self.in_flight_count

    def send_frames(self, frames: bytes, n: int) -> None:
        pos = 0
        before = len(self.got)
        while pos < len(frames):
            size, kind = struct.unpack_from(">ii", frames, pos)
            assert kind == 2
            m = parse_message(frames[pos + 8:pos + 4 + size])
            self.got.append((int(m.id, 16), m.attempts, m.body))
            pos += 4 + size
        assert len(self.got) - before == n


class InFlight:
    """The model's view of one delivery in flight."""

    __slots__ = ("client", "attempts", "deadline", "delivered", "seq")

    def __init__(self, client: int, attempts: int, deadline: int, delivered: int,
                 seq: int) -> None:
        self.client = client
        self.attempts = attempts
        self.deadline = deadline
        self.delivered = delivered
        self.seq = seq


def body_of(off: int) -> bytes:
    return b"m%d" % off


class ChannelModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="chmodel-")
        self.now = 0
        self.owner = Owner()
        self.log = self._open_log()
        self.topic = self._topic()
        self.ch, _ = self.topic.get_channel("c")
        self.max_attempts = 0
        self.clients: dict[int, Client] = {}
        self.next_client = 0
        # the model
        self.released = 0
        self.queued: set[int] = set()
        self.flight: dict[int, InFlight] = {}
        self.requeued: list[tuple[int, int, int]] = []    # (offset, attempts, mark)
        self.deferred: dict[int, tuple[int, int, int]] = {}  # off -> (attempts, due, seq)
        self.dying: dict[int, int] = {}
        self.replay: set[int] = set()
        self.paused = False
        self.seq = 0
        self.msg_base = 0       # message_count: published since start + re-reads
        self.requeues = 0
        self.timeouts = 0
        self.dead = 0
        self.last_attempts: dict[int, int] = {}

    def teardown(self) -> None:
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- plumbing ------------------------------------------------------------------------
    def _open_log(self) -> TopicLog:
        return TopicLog(self.dir, max_bytes_per_file=700, mem_records=3, max_record_bytes=64)

    def _topic(self) -> Topic:
        t = Topic("t", self.log, MEM_QUEUE, lambda _t, _c: self.owner)
        t.dl_defaults = (0, "")
        return t

    def wall(self) -> int:
        return WALL0 + self.now

    def _new_client(self, timeout_ms: int) -> Client:
        c = Client(self.next_client, timeout_ms)
        self.next_client += 1
        self.clients[c.name] = c
        self.ch.add_consumer(c, 0)
        return c

    def _requeue(self, off: int, attempts: int, mark: int) -> None:
        self.requeued.append((off, attempts, mark))

    def _head_ready(self) -> bool:
        mark = self.requeued[0][2]
        return not any(o < mark for o in self.queued)

    def _predict(self, room: int) -> tuple[list[tuple[int, int]], list[int]]:
        """Deliveries (offset, attempts) and dead letters of one dispatch with one
        consumer of this room (the model's queue changes as it goes)."""
        out: list[tuple[int, int]] = []
        dead: list[int] = []
        if self.paused:
            return out, dead
        while len(out) < room:
            if self.requeued and self._head_ready():
                off, attempts, _ = self.requeued.pop(0)
                if self.max_attempts and attempts + 1 > self.max_attempts:
                    self.dying[off] = attempts
                    dead.append(off)
                    continue
                out.append((off, attempts + 1))
            elif self.queued:
                off = min(self.queued)
                self.queued.discard(off)
                out.append((off, 1))
            else:
                break
        return out, dead

    # -- rules ---------------------------------------------------------------------------
    @initialize(max_attempts=st.sampled_from([0, 0, 2, 3]),
                timeouts=st.lists(st.sampled_from([1000, 2000]), min_size=1, max_size=2))
    def configure(self, max_attempts: int, timeouts: list[int]) -> None:
        self.max_attempts = max_attempts
        if max_attempts:
            self.ch.configure_dead_letters({"max_attempts": max_attempts})
        for ms in timeouts:
            self._new_client(ms)

    @rule(n=st.integers(1, 4))
    def publish(self, n: int) -> None:
        first = self.topic.publish([body_of(self.released + i) for i in range(n)], self.wall())
        assert first == self.released
        self.topic.write()
        self.queued.update(range(self.released, self.released + n))
        self.released += n
        self.msg_base += n

    @rule(data=st.data(), room=st.integers(1, 6))
    def deliver(self, data: st.DataObject, room: int) -> None:
        c = data.draw(st.sampled_from(sorted(self.clients.values(), key=lambda c: c.name)))
        expected, dead = self._predict(room)
        for other in self.clients.values():
            other.rdy = 0
        c.rdy = c.in_flight_count + room
        before = len(c.got)
        batches = len(self.owner.batches)
        self.ch.dispatch(self.now, self.wall())
        while self.owner.dirty:     # the loop comes back to a channel that asked
            self.owner.dirty = False
            self.ch.dispatch(self.now, self.wall())
        c.rdy = 0
        got = c.got[before:]
        assert [(o, a) for o, a, _ in got] == expected, (got, expected)
        self._took(c, got, dead, batches)

    @precondition(lambda self: not self.requeued)
    @rule(rooms=st.lists(st.integers(0, 3), min_size=2, max_size=2))
    def deliver_to_all(self, rooms: list[int]) -> None:
        """Every client ready at once, nothing requeued (the case a dispatch serves with
        one read for all, round-robin): together they get what one client with their summed
        room would, each at most its own room."""
        clients = sorted(self.clients.values(), key=lambda c: c.name)
        rooms = rooms[:len(clients)]
        expected, dead = self._predict(sum(rooms))
        before = {c.name: len(c.got) for c in clients}
        for c, room in zip(clients, rooms):
            c.rdy = c.in_flight_count + room
        batches = len(self.owner.batches)
        self.ch.dispatch(self.now, self.wall())
        while self.owner.dirty:
            self.owner.dirty = False
            self.ch.dispatch(self.now, self.wall())
        got_all = []
        for c, room in zip(clients, rooms):
            c.rdy = 0
            got = c.got[before[c.name]:]
            assert len(got) <= room
            got_all += [(o, a) for o, a, _ in got]
        assert sorted(got_all) == sorted(expected), (got_all, expected)
        # in the order they went out: by offset (one read, handed out in order)
        took = sorted(((item, c) for c in clients for item in c.got[before[c.name]:]),
                      key=lambda t: t[0][0])
        self._took(clients[0], [], dead, batches)
        for item, c in took:
            self._took(c, [item], [], len(self.owner.batches))

    def _took(self, c: Client, got: list[tuple[int, int, bytes]], dead: list[int],
              batches: int) -> None:
        for off, attempts, body in got:
            assert off not in self.flight, f"{off} delivered while in flight"
            assert body == body_of(off)
            assert attempts > self.last_attempts.get(off, 0), "attempts went backwards"
            self.last_attempts[off] = attempts
            self.seq += 1
            self.flight[off] = InFlight(c.name, attempts, self.now + c.msg_timeout_ns,
                                        self.now, self.seq)
        sent = [off for _, offs, _ in self.owner.batches[batches:] for off in offs]
        assert sorted(sent) == sorted(dead)
        for _, offs, bodies in self.owner.batches[batches:]:
            for off, raw in zip(offs, bodies):
                env = parse_envelope(raw)
                assert (env.topic, env.channel, env.body) == ("t", "c", body_of(off))
                assert env.attempts == self.dying[off] and env.from_topics == ("t",)

    def _held_by(self, c: Client) -> list[int]:
        return sorted(off for off, f in self.flight.items() if f.client == c.name)

    def _pick(self, data: st.DataObject, c: Client) -> int:
        """Mostly a message c holds; sometimes any offset (FIN of a stale id)."""
        mine = self._held_by(c)
        if mine and data.draw(st.integers(0, 4)):
            return data.draw(st.sampled_from(mine))
        return data.draw(st.integers(0, max(0, self.released)))

    def _expect_error(self, c: Client, off: int) -> type[Exception] | None:
        f = self.flight.get(off)
        if f is None:
            return NotInFlight
        return None if f.client == c.name else NotOwner

    def _finished(self, off: int) -> None:
        del self.flight[off]
        self.last_attempts.pop(off, None)
        if off in self.replay:          # rewound over while in flight: once more, anew
            self.replay.discard(off)
            self._requeue(off, 0, 0)
            self.msg_base += 1

    @rule(data=st.data())
    def fin(self, data: st.DataObject) -> None:
        c = data.draw(st.sampled_from(sorted(self.clients.values(), key=lambda c: c.name)))
        off = self._pick(data, c)
        want = self._expect_error(c, off)
        try:
            self.ch.finish(c, b"%016x" % off)
        except (NotInFlight, NotOwner) as e:
            assert type(e) is want, (e, want)
        else:
            assert want is None, f"FIN of {off} should have failed with {want}"
            self._finished(off)

    @rule(data=st.data())
    def fin_batch(self, data: st.DataObject) -> None:
        c = data.draw(st.sampled_from(sorted(self.clients.values(), key=lambda c: c.name)))
        offs = [self._pick(data, c) for _ in range(data.draw(st.integers(1, 4)))]
        self._check_fins([c] * len(offs), offs, self.ch.finish_offsets(c, offs))

    def _check_fins(self, who: list[Client], offs: list[int],
                    failed: list[tuple[int, Exception]]) -> None:
        """The model's outcome of FINs (who[i] FINs offs[i], in order) against the
        failures the channel reported for them."""
        wants = []
        for c, off in zip(who, offs):
            want = self._expect_error(c, off)
            wants.append(want)
            if want is None:
                self._finished(off)
        assert [(i, type(e)) for i, e in failed] == \
            [(i, w) for i, w in enumerate(wants) if w is not None]

    @rule(data=st.data())
    def fin_singles(self, data: st.DataObject) -> None:
        # a turn's FINs at RDY 1: several consumers (perhaps one twice), one FIN each
        clients = sorted(self.clients.values(), key=lambda c: c.name)
        who = data.draw(st.lists(st.sampled_from(clients), min_size=1, max_size=4))
        offs = [self._pick(data, c) for c in who]
        self._check_fins(who, offs, self.ch.finish_singles(who, offs))

    @rule(data=st.data(), delay_ms=st.sampled_from([0, 0, 500, 3000]))
    def req(self, data: st.DataObject, delay_ms: int) -> None:
        c = data.draw(st.sampled_from(sorted(self.clients.values(), key=lambda c: c.name)))
        off = self._pick(data, c)
        want = self._expect_error(c, off)
        try:
            self.ch.requeue(c, b"%016x" % off, delay_ms * MS, self.now, self.wall())
        except (NotInFlight, NotOwner) as e:
            assert type(e) is want
            return
        assert want is None
        f = self.flight.pop(off)
        self.replay.discard(off)
        self.requeues += 1
        if delay_ms:
            self.seq += 1
            self.deferred[off] = (f.attempts, self.now + delay_ms * MS, self.seq)
        else:
            self._requeue(off, f.attempts, self.released)

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        c = data.draw(st.sampled_from(sorted(self.clients.values(), key=lambda c: c.name)))
        off = self._pick(data, c)
        want = self._expect_error(c, off)
        try:
            self.ch.touch(c, b"%016x" % off, self.now, MAX_MSG_TIMEOUT)
        except (NotInFlight, NotOwner) as e:
            assert type(e) is want
            return
        assert want is None
        f = self.flight[off]
        f.deadline = min(self.now + c.msg_timeout_ns, f.delivered + MAX_MSG_TIMEOUT)
        self.seq += 1
        f.seq = self.seq

    @rule(dt_ms=st.sampled_from([1, 400, 999, 1000, 2500]))
    def advance(self, dt_ms: int) -> None:
        """Time passes; the scanner's expiry runs (timeouts, then due deferrals)."""
        self.now += dt_ms * MS
        self.ch.requeue_expired(*self.ch.expire(self.now))
        mark = self.released
        late = sorted((f.deadline, f.seq, off) for off, f in self.flight.items()
                      if f.deadline <= self.now)
        for _, _, off in late:
            f = self.flight.pop(off)
            self.replay.discard(off)
            self._requeue(off, f.attempts, mark)
            self.timeouts += 1
        due = sorted((d, s, off) for off, (_, d, s) in self.deferred.items() if d <= self.now)
        for _, _, off in due:
            attempts = self.deferred.pop(off)[0]
            self._requeue(off, attempts, mark)

    @rule(data=st.data())
    def disconnect(self, data: st.DataObject) -> None:
        c = data.draw(st.sampled_from(sorted(self.clients.values(), key=lambda c: c.name)))
        mine = self._held_by(c)
        assert self.ch.remove_consumer(c) == len(mine)
        del self.clients[c.name]
        self._new_client(c.msg_timeout_ns // MS)     # it connects again
        for off in mine:
            f = self.flight.pop(off)
            self.replay.discard(off)
            self._requeue(off, f.attempts, self.released)
        self.requeues += len(mine)

    @rule()
    def all_leave_together(self) -> None:
        """Every consumer leaves in one turn (``EventLoop._requeue_leavers``): each
        detached, what they held looked for in one pass and requeued by a step (the
        model's few fit one), in offset order; then they connect again."""
        gone = sorted(self.clients.values(), key=lambda c: c.name)
        mine = sorted(off for c in gone for off in self._held_by(c))
        for c in gone:
            assert self.ch.detach(c)
        assert self.ch.leave(gone) == bool(mine)
        assert self.ch.requeue_step() == (len(mine), False)
        for c in gone:
            del self.clients[c.name]
            self._new_client(c.msg_timeout_ns // MS)
        for off in mine:
            f = self.flight.pop(off)
            self.replay.discard(off)
            self._requeue(off, f.attempts, self.released)
        self.requeues += len(mine)

    @rule(data=st.data())
    def rewind(self, data: st.DataObject) -> None:
        offset = data.draw(st.integers(self.log.oldest, self.released))
        self.ch.rewind(offset)
        before = len(self.queued)
        held = set(self.flight) | {e[0] for e in self.requeued} | set(self.deferred) | \
            set(self.dying)
        self.replay |= {o for o in set(self.flight) | set(self.dying) if o >= offset}
        self.queued = {o for o in range(offset, self.released) if o not in held}
        self.requeued = [(o, a, 0) for o, a, _ in self.requeued]
        self.msg_base += max(0, len(self.queued) - before)

    @rule(go=st.integers(0, 3))
    def empty(self, go: int) -> None:
        if go:
            return      # a rare event: most runs should build up state
        self.ch.empty()
        self.queued.clear()
        self.flight.clear()
        self.requeued.clear()
        self.deferred.clear()
        self.dying.clear()
        self.replay.clear()
        self.last_attempts.clear()

    @rule(paused=st.sampled_from([True, False, False]))
    def pause(self, paused: bool) -> None:
        self.ch.paused = paused
        self.paused = paused

    @precondition(lambda self: self.owner.batches)
    @rule(ok=st.booleans())
    def confirm_dead_letters(self, ok: bool) -> None:
        ch, offsets, _ = self.owner.batches.pop(0)
        ch.dead_lettered(offsets, ok)
        if ch is not self.ch:
            return      # from before a restart: that channel object is gone
        for off in offsets:
            attempts = self.dying.pop(off, None)
            if attempts is None:
                continue
            if ok:
                self.dead += 1
                self.last_attempts.pop(off, None)
                if off in self.replay:
                    self.replay.discard(off)
                    self._requeue(off, 0, 0)
                    self.msg_base += 1
            else:
                self.replay.discard(off)
                self._requeue(off, attempts, 0)

    @rule()
    def retention(self) -> None:
        """The storage thread deletes whole segments below the channel's floor."""
        self.log.drop_before(self.topic.floor())

    @rule(go=st.integers(0, 2))
    def restart(self, go: int) -> None:
        """Save the state, reopen the log from its files (recovery), restore."""
        if go:
            return
        state = self.ch.snapshot(self.wall(), self.now)
        self.log.close()
        self.log = self._open_log()
        self.topic = self._topic()
        assert self.topic.released == self.released
        self.ch = self.topic.new_channel("c", cursor=self.log.oldest)
        self.ch.paused = self.paused
        if self.max_attempts:
            self.ch.configure_dead_letters({"max_attempts": self.max_attempts})
        self.ch.restore(state, self.now, self.wall())
        self.clients.clear()
        self._new_client(1000)
        pending = set(self.flight) | {e[0] for e in self.requeued} | set(self.dying)
        attempts = {off: f.attempts for off, f in self.flight.items()}
        attempts.update({off: a for off, a, _ in self.requeued})
        attempts.update(self.dying)
        self.requeued = [(off, attempts[off], 0) for off in sorted(pending)]
        self.flight.clear()
        self.dying.clear()
        self.replay.clear()
        # the wheel holds the deferred in offset order now
        for off in sorted(self.deferred):
            self.seq += 1
            a, due, _ = self.deferred[off]
            self.deferred[off] = (a, due, self.seq)
        self.requeues = self.timeouts = self.dead = 0
        # counters start again (as nsqd's): message_count = what is left to read
        self.msg_base = len(self.queued)

    # -- after every step ----------------------------------------------------------------
    @invariant()
    def nothing_lost(self) -> None:
        ch = self.ch
        held = {e[0] for e in ch.requeued}
        assert len(held) == len(ch.requeued), "an offset requeued twice"
        assert list(ch.requeued_offsets()) == [e[0] for e in ch.requeued]
        assert set(ch.in_flight) == set(self.flight)
        assert held == {e[0] for e in self.requeued}
        assert set(ch.deferred) == set(self.deferred)
        assert set(ch.dying) == set(self.dying)
        skip = set(getattr(ch, "skip", ()))
        assert {o for o in range(ch.cursor, self.released) if o not in skip} == self.queued
        everything = self.queued | set(self.flight) | held | set(self.deferred) | \
            set(self.dying)
        assert all(o >= self.log.oldest for o in everything), "retention deleted a message"

    @invariant()
    def counters_match(self) -> None:
        ch = self.ch
        wall = self.wall()
        assert len(ch.in_flight) == len(self.flight)
        for c in self.clients.values():
            assert c.in_flight_count == len(self._held_by(c)), c.name
        assert ch.depth(wall) == len(self.queued) + len(self.requeued)
        assert ch.deferred_count(wall) == len(self.deferred)
        assert ch.requeue_count == self.requeues
        assert ch.timeout_count == self.timeouts
        assert ch.dead_letter_count == self.dead
        assert len(ch.dying) == len(self.dying)
        assert ch.message_count == self.msg_base


ChannelModel.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestChannelModel = ChannelModel.TestCase
