"""Replica: one replicated topic's role on this node, owned by the topic's owner loop.

A leader: publishes written here wait (``await_replicas``) until the high watermark
passes them (pybroker.cluster.rules.LeaderState), then the Publisher answers them;
channels are given records only up to the high watermark (``Topic.release_cap``);
followers' fetches (``fetched``) move it. A follower: records fetched from the leader
are appended at the same offsets (``apply``), after the log was cut where it diverges
from the leader's (``truncate``); the leader's channel states are kept to take over
with (``_take_over``, pybroker.cluster.takeover). Every method runs on the topic's
owner loop unless it says otherwise; the coordinator and the fetcher post to it with
call_soon_threadsafe.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Callable, NamedTuple, cast

from pybroker.cluster.ports import (HANDED_OVER, LEADERSHIP_LOST, LEASE_EXPIRED, NOT_LEADER,
                                    Done, Json, JsonObj, ReplicaHost, ReplicaStats)
from pybroker.cluster.rules import EpochHistory, LeaderState, Waiter
from pybroker.cluster.takeover import INLINE_BYTES, Steps, Text, build, run, states_of
from pybroker.core.lifecycle import deferred_states, state_floor
from pybroker.cluster.states import (TAKE_STEP, VERSIONS_KEPT, Held, Part, Shipped, delta,
                                     joined, ops_of, ship, take_steps, whole)
from pybroker.jsonvalue import PartTexts, Piece, dumps_keyed
from pybroker.errors import ChannelNotFound, TopicNotFound
from pybroker.server.services import owner_loop
from pybroker.storage import StorageError
from pybroker.storage.topiclog import RecordBatch

if TYPE_CHECKING:
    from pybroker.core.channel import Channel
    from pybroker.core.deferred import Chunks
    from pybroker.core.lifecycle import ChannelState
    from pybroker.core.topic import Topic

log = logging.getLogger("pybroker")
RETRY_NS = 100_000_000         # a failed append or cut: the topic is asked again after
RETRY_MAX_NS = 5_000_000_000   # this, doubling while it fails, up to this
# a channel state unchanged since it was shipped is shipped again only this often (a
# leader snapshots every ship_ns, 200 ms; an idle channel then costs its followers one
# answer of JSON each 2 s, not five a second)
RESHIP_NS = 2_000_000_000
LEADER, FOLLOWER, NONE = "leader", "follower", "none"
# versions of a leader's channel states (a follower asks for newer than it holds)
_versions = itertools.count(1)


def bytes_between(topic: Topic, lo: int, hi: int) -> int:
    """About how many bytes of records [lo, hi) are (average record size)."""
    n = hi - lo
    if n <= 0 or not topic.message_count:
        return 0
    return n * (topic.message_bytes // max(1, topic.message_count) + 50)


_HANDING_OVER = f"its log cannot be written on this node: {HANDED_OVER}"


class NotLeader(Exception):
    """This node may not acknowledge publishes to the topic now."""


class ShippedStates(NamedTuple):
    """A leader's channel states as a follower receives them whole (``"states"``, a
    leader that does not ship parts): one JSON object, kept unparsed until it takes
    over (pybroker.cluster.takeover), and each channel's floor (the lowest offset it
    still needs) for its retention."""

    raw: bytes | memoryview       # a view of the frame it came in
    floors: list[int]


class ShippedParts(NamedTuple):
    """A leader's channel states in parts (``"parts"``, pybroker.cluster.states)."""

    parts: list[Part]


class Replica:
    def __init__(self, node: ReplicaHost, topic: Topic, history: EpochHistory,
                 inc: int = 0) -> None:
        self.node = node
        self.topic = topic
        self.name = topic.name
        self.inc = inc                 # the incarnation of the name (etcd's topics/<name>)
        self.role = NONE
        self.epoch = 0
        self.leader = -1               # the leader's node id (-1: none known)
        self.history = history
        self.lead: LeaderState | None = None
        self.waiters: Waiter[Done] = Waiter()
        self.local_end = 0             # leader: offsets below are written (and synced)
        self.hw = 0                    # the high watermark (a follower: as last heard)
        self.truncated_for = 0         # follower: the epoch whose divergence was cut
        # follower: its records from here on were appended but their fsync failed and
        # the cut after it too: not fetched (nor acknowledged) until cut (``_synced``)
        self.unsynced_from: int | None = None
        # follower: appends or cuts that failed in a row, and when the fetcher may ask
        # for this topic again (``_back_off``)
        self.failures = 0
        self.retry_ns = 0
        self.isr: list[int] = []
        self.isr_asked = False         # an ISR change is with the coordinator
        # a follower's copy of its leader's channel states (parsed from ``channels_raw``
        # when it takes over: ``states``)
        self.channels: dict[str, ChannelState] = {}
        self.channels_raw: bytes | memoryview | None = None
        # a follower's copy of its leader's channel states in parts (else in
        # ``channels_raw``, from a leader that ships them whole)
        self.held: dict[str, Held] = {}
        # a leader's channel states as shipped: each channel's encoding (its JSON in
        # pieces, how they are made from the encoding before) and its floor, encoded off
        # the loops (``_snapshot``), and what each snapshot was (to ship only changes)
        self.shipped: dict[str, Shipped] = {}
        # the encodings of the current version (``shipped`` as it was when made: a
        # channel encoded since waits for the next, ``_new_version``)
        self.versioned: dict[str, Shipped] = {}
        # the generation of each channel's encoding in the last VERSIONS_KEPT versions
        # (what a follower that holds one of them holds), and the parts answered to
        # each version held since the current one was made (pybroker.cluster.states)
        self.version_gens: dict[int, dict[str, int]] = {}
        self._deltas: dict[int, tuple[list[Json], list[Piece], int]] = {}
        self.states_sent = 0           # bytes of channel states shipped (for /stats)
        # each channel's state as last shipped: the state without its deferred messages,
        # and their chunks (the same value while they are unchanged: core/deferred.py)
        self.chan_last: dict[str, tuple[ChannelState, Chunks]] = {}
        self.chan_at: dict[str, int] = {}      # when each channel's state last shipped
        self.encoding: set[str] = set()        # channels whose encoding is under way
        # each channel's chunks of deferred messages as last encoded (their JSON, so that
        # only the chunks that changed are encoded again): the storage thread's; the
        # loop only replaces the dict, when a leadership begins or ends
        self.texts: dict[str, PartTexts] = {}
        self._assembled: tuple[int, list[Piece], int, list[int]] | None = None
        self.chan_version = 0
        self.chan_from_leader = 0      # follower: the version it holds
        # the topic's paused flag and, when paused, how far its channels may read
        # (``released``), shipped with the channel states: the leader's as in its newest
        # version; a follower's as last heard (None: not heard)
        self.paused_shipped: bool | None = None
        self.released_shipped = 0
        self.last_snap_ns = 0
        self.lead_lease = 0            # leader: the etcd lease its leadership is held on
        # leader: the epoch whose leadership it is handing over (its log's write or
        # fsync failed: ``storage_failed``); 0: none. Meanwhile it acknowledges nothing
        self.resigning = 0
        # leader: the epoch whose channels are being built, a step a turn
        # (pybroker.cluster.takeover); 0: none. Meanwhile a SUB waits (``after_takeover``:
        # what to call then), and its follower's channels are neither shipped nor saved
        # as the leader's
        self.taking_over = 0
        self.sub_waiters: list[Callable[[bool], None]] = []

    def __repr__(self) -> str:
        return f"Replica({self.name} {self.role} e{self.epoch})"

    # -- roles (posted by the coordinator) ---------------------------------------------
    def set_role(self, role: str, epoch: int, leader: int, isr: list[int],
                 lease: int = 0) -> None:
        """``lease``: the etcd lease the leadership is held on (a leader)."""
        topic = self.topic
        was = self.role
        self.isr = sorted(isr)
        if self.resigning and (role != LEADER or epoch != self.resigning):
            self.resigning = 0        # the leadership went elsewhere meanwhile
        if role == LEADER:
            self.lead_lease = lease
        if role == LEADER and (was != LEADER or epoch != self.epoch):
            self.role, self.epoch, self.leader = LEADER, epoch, leader
            end = topic.log.written
            self.history.begin(epoch, end)
            self.node.save_history(self.name, self.inc, self.history.to_list())
            self.local_end = end
            now = time.monotonic_ns()
            self.lead = LeaderState(self.node.id, epoch, set(isr), self.node.min_insync,
                                    self.node.lag_ns, self.hw, end, now,
                                    self.node.max_insync)
            # what an earlier leadership of this node shipped is not this one's
            self._forget_shipped()     # what an earlier leadership shipped
            self._take_over()
            log.info("CLUSTER: %s: leader at epoch %d (log end %d, high watermark %d, "
                     "in sync %s)", self.name, epoch, end, self.hw, self.isr)
            self.advance()
        elif role == LEADER:
            assert self.lead is not None
            self.lead.isr = frozenset(isr) | {self.node.id}
            self.advance()
        elif role != was or epoch != self.epoch or leader != self.leader:
            self._step_down(role, epoch, leader)
        if role != was:
            self.node.roles_changed()

    def _step_down(self, role: str, epoch: int, leader: int) -> None:
        self._end_takeover(False)
        if self.role == LEADER:
            self._fail_all(NotLeader(f"{self.name}: {LEADERSHIP_LOST}"))
            self.kick_consumers(f"topic {self.name} is now led by node {leader}"
                                if leader >= 0 else
                                f"topic {self.name} is being handed to another node")
            with self.topic.lock:
                self.topic.release_cap = None   # a follower's log is all replicated
            # what this leadership shipped is nobody's now (a next one starts afresh):
            # with 1,000,000 deferred messages, 35 MB of encoded states kept for nothing
            self._forget_shipped()
        self.role, self.epoch, self.leader = role, epoch, leader
        self.lead = None
        self.truncated_for = 0     # a new leader: find where the logs diverge first
        self.chan_from_leader = 0  # and take its channel states whatever their version
        if role == FOLLOWER:
            log.info("CLUSTER: %s: following node %d at epoch %d", self.name, leader, epoch)
            self.kick_consumers(f"topic {self.name} is led by node {leader}")

    def _forget_shipped(self) -> None:
        """A leadership begins or ends: the channel states encoded and shipped, and
        the encoder's memory of their chunks, are not the next one's (the storage
        thread's ``_encode`` holds on to the ``texts`` it began with: replaced, not
        cleared)."""
        self.shipped.clear()
        self.versioned = {}
        self.chan_last.clear()
        self.chan_at.clear()
        self.texts = {}
        self._assembled = None
        self.version_gens.clear()
        self._deltas.clear()

    def dropped(self) -> None:
        """This incarnation was deleted in the cluster and its local topic with it (the
        coordinator): publishes waiting for its replicas fail, and it leads no more."""
        was = self.role
        self._fail_all(NotLeader(f"topic {self.name} was deleted"))
        self.role, self.leader, self.lead = NONE, -1, None
        self._end_takeover(False)
        if was != NONE:
            self.node.roles_changed()

    def kick_consumers(self, why: str) -> None:
        for ch in list(self.topic.channels.values()):
            ch.owner.call_soon_threadsafe(_kick, ch, why)

    # -- leader ----------------------------------------------------------------------
    def await_replicas(self, end: int, done: Done) -> None:
        """Records below ``end`` are written here (synced, in fsync mode): done(None)
        once the in-sync replicas hold them, done(error) if that cannot be."""
        if self.role != LEADER:
            done(NotLeader(f"{NOT_LEADER} {self.name}"))
            return
        if self.resigning:
            done(NotLeader(_HANDING_OVER))
            return
        if end > self.local_end:
            self.local_end = end
        self.waiters.add(end, done)
        self.node.wake_fetches(self.name)
        self.advance()

    def refusal(self) -> str | None:
        """Why a publish here would fail now (None: it may be appended)."""
        if self.role != LEADER or self.lead is None:
            return f"{NOT_LEADER} {self.name}"
        if self.resigning:
            return _HANDING_OVER
        if not self.lease_ok():
            return f"{LEASE_EXPIRED} (not acknowledging)"
        if not self.lead.enough():
            return (f"not enough in-sync replicas ({len(self.lead.isr)} of "
                    f"{self.lead.min_insync} required)")
        return None

    def lease_ok(self) -> bool:
        """The leadership's lease is valid by this node's clock, and is the lease of
        the node's current etcd session (not one that expired and was replaced)."""
        node = self.node
        return node.lease.valid(time.monotonic_ns()) and self.lead_lease == node.lease_id \
            and self.lead_lease != 0

    def fetched(self, node: int, acked: int, sent_end: int) -> None:
        """A follower's fetch, answered with everything below ``sent_end`` (posted by
        the replication server)."""
        self.acked(node, acked)
        self.sent(node, sent_end)

    def sent(self, node: int, sent_end: int) -> None:
        """A follower's fetch whose acknowledgement was posted when it was read
        (``acked``) is answered with everything below ``sent_end``."""
        lead = self.lead
        if lead is not None:
            lead.answered(node, sent_end)
            if node not in lead.isr:
                # it may have caught up: into the ISR at once (members that lag are
                # dropped by the tick)
                self.check_isr(time.monotonic_ns())

    def follower_gone(self, node: int) -> None:
        """``node``'s replication connection closed (posted by the replication server)."""
        if self.lead is not None:
            self.lead.disconnected(node)

    def acked(self, node: int, acked: int) -> None:
        """A follower's acknowledgement: it holds everything below ``acked`` (the
        high watermark moves only when that changed)."""
        lead = self.lead
        if lead is not None and lead.fetched(node, acked, self.topic.log.written,
                                             time.monotonic_ns()):
            self.advance()

    def advance(self) -> None:
        """Move the high watermark; answer the publishes it passed; release to channels."""
        lead = self.lead
        if lead is None or self.resigning:
            return
        if not self.lease_ok():
            if len(self.waiters):
                self._fail_all(NotLeader(f"{LEASE_EXPIRED} before the replicas "
                                         "acknowledged"))
            return
        if not lead.enough():
            if len(self.waiters):
                self._fail_all(NotLeader(f"not enough in-sync replicas ({len(lead.isr)} "
                                         f"of {lead.min_insync} required)"))
            return
        hw = lead.high_watermark(self.local_end)
        self.hw = hw
        for done in self.waiters.ready(hw):
            done(None)
        self._release(hw)

    # -- a leader that cannot store the topic --------------------------------------------
    def storage_failed(self, kind: str) -> None:
        """A write or fsync (``kind``) of this topic's log failed here. A leader hands its
        leadership to the other in-sync replicas, which hold every acknowledged record:
        it stops acknowledging now (the publishes waiting fail), then the coordinator
        deletes its leadership key and writes the in-sync set without it (``resign``), so
        that another member is elected and this node follows it, and rejoins the set
        only once its log takes appends again and it has caught up. With no other
        in-sync replica it keeps leading (its publishes fail until its disk works)."""
        lead = self.lead
        if self.role != LEADER or lead is None or self.resigning:
            return
        others = sorted(lead.isr - {self.node.id})
        if not others:
            log.error("CLUSTER: %s: the %s of its log failed here, and no other replica "
                      "is in sync to take over: still leading", self.name, kind)
            return
        log.error("CLUSTER: %s: the %s of its log failed here; handing the leadership "
                  "(epoch %d) to the in-sync replicas %s", self.name, kind, self.epoch,
                  others)
        self.resigning = self.epoch
        self._fail_all(NotLeader(_HANDING_OVER))
        self.node.resign(self, self.epoch, others)

    def resigned(self, epoch: int, ok: bool) -> None:
        """The coordinator's answer to ``resign``: the leadership key is gone (``ok``:
        this node leads no more), or it was refused (no other member in sync in etcd's
        view either, or etcd failed): it leads on, and tries again at the next failure."""
        if epoch != self.resigning:
            return
        self.resigning = 0
        if ok and self.role == LEADER and self.epoch == epoch:
            self._step_down(NONE, epoch, -1)
            self.node.roles_changed()
        elif not ok:
            log.warning("CLUSTER: %s: the leadership was not handed over; leading on",
                        self.name)
            self.advance()

    def _release(self, hw: int) -> None:
        topic = self.topic
        with topic.lock:
            topic.release_cap = hw
            if topic.paused:
                return
            to = min(topic.log.written, hw)
            if to <= topic.released:
                return
            topic.released = to
            chans = list(topic.channels.values())
        if chans:
            owner_loop(topic.owner).wake(chans)

    def _fail_all(self, err: Exception) -> None:
        for done in self.waiters.all():
            done(err)

    def check_isr(self, now: int) -> None:
        """Ask the coordinator to drop lagging followers or add caught-up ones."""
        lead = self.lead
        if lead is None or self.isr_asked:
            return
        change = lead.isr_change(self.node.assigned.get(self.name, []), now, self.node.live)
        if change is not None:
            new = sorted(change)
            self.isr_asked = True
            log.info("CLUSTER: %s: in-sync replicas %s -> %s", self.name,
                     sorted(lead.isr), new)
            lead.asking(new)     # from now on what it adds counts (maximal ISR)
            self.node.change_isr(self, self.epoch, new)

    def isr_changed(self, epoch: int, isr: list[int] | None) -> None:
        """The coordinator's answer (None: refused; the state in etcd moved on)."""
        self.isr_asked = False
        if self.lead is not None and epoch == self.epoch:
            self.lead.isr_written(isr)
            if isr is not None:
                self.isr = sorted(isr)
            self.advance()

    def tick(self) -> None:
        """Every tick (the node's timer on this loop): lease expiry, lagging followers,
        channel snapshots to ship."""
        if self.unsynced_from is not None and self.role == FOLLOWER:
            try:
                self._cut(self.unsynced_from)     # (a cut that failed at its fsync)
            except (StorageError, ValueError) as e:
                log.error("CLUSTER: %s: cutting the unsynced records from %d failed "
                          "again: %s", self.name, self.unsynced_from, e)
        if self.role != LEADER:
            return
        now = time.monotonic_ns()
        self.advance()
        self.check_isr(now)
        if self.taking_over:
            return        # its channels are still the follower's
        if now - self.last_snap_ns >= self.node.ship_ns:
            self.last_snap_ns = now
            topic = self.topic
            released = topic.released if topic.paused else 0
            if topic.paused != self.paused_shipped or released != self.released_shipped:
                self.paused_shipped, self.released_shipped = topic.paused, released
                self._new_version()
            live = self.topic.channels
            for name in [n for n in self.shipped if n not in live]:
                self.shipped.pop(name, None)        # deleted here: not on takeover either
                self.chan_last.pop(name, None)
                self._new_version()
            for ch in list(live.values()):
                ch.owner.call_soon_threadsafe(self._snapshot, ch)

    def _snapshot(self, ch: Channel) -> None:
        """On the channel's owner loop: take its state, and when it changed (or
        RESHIP_NS passed) have the storage thread finish and encode it (``_encode``).
        The loop rebuilds only the chunks of deferred messages that changed
        (core/deferred.py) and compares the rest: a
        channel holding 100,000 deferred messages cost the loop a full state and its
        JSON for each follower every 200 ms (a publisher on the leader waited up to
        197 ms)."""
        name = ch.name
        if ch.deleted or ch.ephemeral or name in self.encoding:
            return
        st, deferred = ch.snapshot_parts(time.time_ns(), time.monotonic_ns())
        if ch.dl_settings:
            st["settings"] = dict(ch.dl_settings)    # max_attempts, dead_letter_topic
        now = time.monotonic_ns()
        last = self.chan_last.get(name)
        if last is not None and last[1] is deferred and last[0] == st \
                and now - self.chan_at.get(name, 0) < RESHIP_NS:
            return        # unchanged: shipped again only every RESHIP_NS
        self.chan_at[name] = now
        self.chan_last[name] = (st, deferred)
        self.encoding.add(name)
        self.node.runtime.storage.call_soon_threadsafe(self._encode, name, st, deferred,
                                                       self.epoch)

    def _encode(self, name: str, st: ChannelState, deferred: Chunks,
                epoch: int) -> None:
        """On the storage thread: the state completed with its deferred messages, its
        floor, and its JSON, made in slices that offer the GIL to the loops."""
        owner = owner_loop(self.topic.owner)
        texts = self.texts       # (the loop may replace it meanwhile, never change it)
        try:
            for gone in [n for n in texts if n not in self.topic.channels]:
                del texts[gone]
            memo = texts.setdefault(name, PartTexts())
            full = cast("ChannelState", dict(st))     # (st stays as the loop made it)
            deferred_states(full, deferred, memo)
            floor = state_floor(full)
            # in pieces, never joined: 35 MB of states (1,000,000 deferred messages)
            # joined and encoded held the GIL about 10 ms each; the chunks that did not
            # change since the last version are not encoded again (jsonvalue.PartTexts),
            # nor shipped again to a follower that holds them (pybroker.cluster.states)
            shipped = ship(dumps_keyed(full, memo), floor)
        except Exception:       # a bug: the next snapshot tries again
            texts.pop(name, None)
            log.exception("CLUSTER: %s: encoding the state of channel %s failed",
                          self.name, name)
            owner.call_soon_threadsafe(self._encode_failed, name)
            return
        owner.call_soon_threadsafe(self._encoded, name, shipped, epoch)

    def _encode_failed(self, name: str) -> None:
        self.encoding.discard(name)
        self.chan_last.pop(name, None)

    def _encoded(self, name: str, shipped: Shipped, epoch: int) -> None:
        # on the topic's owner loop (where fetches are answered)
        self.encoding.discard(name)
        if name not in self.topic.channels or name not in self.chan_last \
                or self.role != LEADER or epoch != self.epoch:
            return                      # deleted, or not this leadership's, meanwhile
        self.shipped[name] = shipped
        self._new_version()

    def _new_version(self) -> None:
        """A new version of the channel states to ship, once every channel's is here.
        Until then the followers keep what they hold: a follower takes what it is
        shipped as the whole, and a channel it was not shipped is one the leader
        deleted (after a takeover the states are encoded one channel at a time; a
        version shipped between two would have lost the others had this leader died
        then)."""
        shipped = self.shipped
        for name, ch in self.topic.channels.items():
            if name not in shipped and not ch.ephemeral and not ch.deleted:
                return    # its ``_encoded`` makes the version
        self.chan_version = next(_versions)
        self.versioned = dict(shipped)
        gens = self.version_gens
        gens[self.chan_version] = {n: s.keyed.gen for n, s in shipped.items()}
        while len(gens) > VERSIONS_KEPT:
            del gens[next(iter(gens))]
        self._deltas.clear()
        # the parked fetches take it now, not at their next write or deadline: a
        # follower that missed a version gets a channel encoded twice since whole, its
        # changes being from the encoding it missed (pybroker.cluster.states)
        self.node.wake_fetches(self.name)

    def shipped_states(self) -> tuple[list[Piece], int, list[int]]:
        """The channel states to ship as one JSON object, in pieces (each channel's as
        encoded, sent without a copy: joining 35 MB of states, 1,000,000 deferred
        messages, held the leader's loop 34-61 ms), its length, and the channels'
        floors (on the topic's owner loop; made once per version), for a follower that
        takes them whole."""
        got = self._assembled
        if got is None or got[0] != self.chan_version:
            got = self._assembled = (self.chan_version, *whole(self.versioned))
        return got[1], got[2], got[3]

    def states_for(self, held: int) -> tuple[list[Json], list[Piece], int]:
        """The channel states of the current version for a follower that holds version
        ``held``, in parts (pybroker.cluster.states.delta): its items, the blob's pieces
        and their length (on the topic's owner loop; made once per version held)."""
        if held not in self.version_gens:
            held = 0        # (at most VERSIONS_KEPT + 1 kept, whatever a follower says)
        got = self._deltas.get(held)
        if got is None:
            got = self._deltas[held] = delta(self.versioned,
                                             self.version_gens.get(held))
        return got

    # -- follower ----------------------------------------------------------------------
    def truncate(self, offset: int, done: Callable[[], None]) -> None:
        """Cut the log where it diverges from the leader's (posted by the fetcher)."""
        topic = self.topic
        if self._pending():
            # a publish appended this turn (refused at its answer: this node does not
            # lead) is written at the turn's end: cut after that
            owner_loop(topic.owner).call_later(1_000_000, self.truncate, offset, done)
            return
        try:
            before = topic.log.written
            end = self._cut(offset)
            if end < before:
                log.warning("CLUSTER: %s: log cut from %d back to %d (records the new "
                            "leader does not have)", self.name, before, end)
            self.truncated_for = self.epoch      # (``failures`` ends with an append)
        except Exception as e:
            self._back_off(f"cutting the log to {offset} failed", e)
        finally:
            done()

    def restart_at(self, offset: int, done: Callable[[], None]) -> None:
        """The leader no longer has the records after this log's end (its retention
        dropped them while this node was away): drop this log and begin again at the
        leader's oldest record, ``offset`` (posted by the fetcher). None of the records
        dropped here can be acknowledged by this node again, and the leader holds every
        acknowledged one from ``offset`` on."""
        topic = self.topic
        try:
            if self._pending():
                raise ValueError("records are pending")
            with topic.lock:
                before = topic.log.written
                if topic.deleted or offset <= before or self.role != FOLLOWER:
                    return
                topic.log.restart_at(offset)
                topic.released = offset
                topic.orphan_start = max(topic.orphan_start, offset)
                topic.dpubs.clear()
            log.warning("CLUSTER: %s: the log here ends at %d, below the leader's oldest "
                        "record %d: dropped, following from %d", self.name, before, offset,
                        offset)
        except Exception as e:
            self._back_off(f"beginning the log again at {offset} failed", e)
        finally:
            done()

    def _pending(self) -> bool:
        """Records appended here are not yet written (a publish this node refused at
        its answer, written at the turn's end): no cut or restart until they are."""
        log_ = self.topic.log
        return getattr(log_, "head", log_.written) != log_.written

    def _cut(self, offset: int) -> int:
        """Cut the log back so that ``offset`` is the next offset written (this
        replica's loop); the new end. Raises StorageError on a file error, ValueError
        while records are pending (a refused publish's, written at the turn's end)."""
        topic = self.topic
        if self._pending():
            raise ValueError("records are pending")
        with topic.lock:
            if topic.deleted:
                # this incarnation was deleted meanwhile (its files are going): nothing
                # to cut; the fetcher is told at its next assignment
                return topic.log.written
            end = topic.log.truncate(offset)
            topic.released = min(topic.released, end)
            for off in list(topic.dpubs.irange(end, None)):
                del topic.dpubs[off]
        self.history.truncate(end)
        self.hw = min(self.hw, end)
        if self.unsynced_from is not None and end <= self.unsynced_from:
            self.unsynced_from = None
        return end

    def apply(self, first: int, blob: bytes, hw: int, history: list[list[int]] | None,
              chans: JsonObj | ShippedStates | ShippedParts | None, version: int,
              done: Callable[[], None], paused: tuple[bool, int] | None = None) -> None:
        """Append a leader's records (posted by the fetcher); done() once written (and
        synced, in fsync mode). ``chans`` (with ``version``, and ``paused``: the topic's
        paused flag and its released offset when paused): the leader's newest channel
        states, when newer than the ones held."""
        topic = self.topic
        epoch = 0
        try:
            if isinstance(chans, ShippedParts):
                done = self._take_parts(chans.parts, version, paused, done)
            elif isinstance(chans, ShippedStates):
                # kept as they came, parsed only to take over (``states``)
                self.channels_raw = chans.raw
                self.held = {}
                self.channels = {}
                self.chan_from_leader = version
                if paused is not None:
                    self.paused_shipped, self.released_shipped = paused
                self._follow_floors(chans.floors)
            elif chans is not None:
                # the leader's snapshots (ChannelState documents), checked where read
                self.channels_raw = None
                self.held = {}
                self.channels = states_of(chans)
                self.chan_from_leader = version
                if paused is not None:
                    self.paused_shipped, self.released_shipped = paused
                self._follow_floor(self.channels)
            if blob:
                with topic.lock:
                    if topic.log.written != first or self.role != FOLLOWER:
                        raise ValueError(f"records from {first}, log at {topic.log.written}")
                    starts, deferred = topic.log.append_raw(blob, first)
                    if deferred:
                        self._note_dpubs(first, blob, starts, deferred)
                    topic.message_count += len(starts)
                    topic.message_bytes += len(blob)
                epoch = topic.write()[0]
                if not self.node.durable:
                    self.failures = 0     # (fsync mode: once synced, ``_synced``)
            end = topic.log.written
            if history is not None:     # sent when it changed (or this node's differs)
                before = list(self.history.entries)
                self.history.adopt(EpochHistory([(e, s) for e, s in history]), end)
                if self.history.entries != before:
                    self.node.save_history(self.name, self.inc, self.history.to_list())
            self.hw = max(self.hw, min(hw, end))
            if blob and self.node.durable:
                owner = owner_loop(topic.owner)

                def handed() -> None:           # (the storage thread) back to the loop
                    owner.call_soon_threadsafe(self._synced, first, epoch, done)

                if self.node.sync_follower(topic, handed):
                    self._synced(first, epoch, done)      # synced here, now
                return
        except Exception as e:
            self._back_off("records from the leader not appended", e)
        done()

    def _back_off(self, what: str, e: Exception) -> None:
        """An append or a cut failed (a full disk, a write error, an answer that does
        not fit the log): the fetcher asks for this topic again after a back-off that
        doubles while it fails (RETRY_NS up to RETRY_MAX_NS), so a follower that cannot
        write neither spins nor floods its log; its leader drops it from the in-sync
        set meanwhile. It begins again with where its log diverges."""
        self.failures += 1
        wait_ns = min(RETRY_NS << min(self.failures - 1, 16), RETRY_MAX_NS)
        self.retry_ns = time.monotonic_ns() + wait_ns
        self.truncated_for = 0
        log.error("CLUSTER: %s: %s (failure %d, asked again in %d ms): %s", self.name,
                  what, self.failures, wait_ns // 1_000_000, e)

    def _synced(self, first: int, epoch: int, done: Callable[[], None]) -> None:
        """The fsync of the records appended from ``first`` on (the write of ``epoch``)
        is over (this replica's loop). If it failed they are not held here: a follower
        acknowledges only what it synced (its next fetch names its log's end), so they
        are cut, to be fetched again after a back-off (``_back_off``; an fsync that
        works ends the failures). Should the cut fail too, nothing of this topic is
        fetched (so nothing more acknowledged: its leader drops it from the in-sync set)
        until a tick cuts them (``unsynced_from``)."""
        try:
            err = self.topic.log.lost_by(epoch)
            if err is None:
                self.failures = 0
            elif self.role != FOLLOWER:
                # elected meanwhile: its history starts its epoch at its log's end, so
                # nothing is cut (no publish waits for these records, and no fetch of
                # this node acknowledged them)
                log.error("CLUSTER: %s: records from %d not synced (%s), kept: this "
                          "node leads now", self.name, first, err)
            else:
                self.unsynced_from = first
                self._cut(first)
                # fetched again after a back-off, as a failed append is: a disk whose
                # fsyncs keep failing would otherwise have them fetched, appended, cut
                # and logged about a thousand times a second
                self._back_off(f"records from {first} not synced: cut, to be fetched "
                               "again", err)
        except (StorageError, ValueError) as e:
            log.error("CLUSTER: %s: records from %d not synced; cutting them failed "
                      "(not fetched until a tick cuts them): %s", self.name, first, e)
        except Exception:
            log.exception("CLUSTER: %s: records from %d not synced; cutting them failed "
                          "(not fetched until a tick cuts them)", self.name, first)
        finally:
            done()

    def _follow_floor(self, chans: dict[str, ChannelState]) -> None:
        """Retention on a follower (which has no channels of its own) follows the
        leader's channels: segments below the lowest offset they still need may go.
        The states are up to ship_ns old, and a floor only rises, so this keeps at least
        what the leader keeps. No channel there: everything is kept."""
        floors = []
        for st in chans.values():
            try:
                floors.append(min([int(st.get("cursor", 0))]
                                  + [int(p[0]) for p in st.get("pending", [])]))
            except (TypeError, ValueError, IndexError):
                return
        self._follow_floors(floors)

    def _take_parts(self, parts: list[Part], version: int,
                    paused: tuple[bool, int] | None,
                    done: Callable[[], None]) -> Callable[[], None]:
        """A version of the leader's channel states in parts (pybroker.cluster.states):
        what this follower holds made into it, at once, or, past TAKE_STEP ops (many
        channels), a step a turn; the done to call once the records are appended then
        waits for the last step too (the fetcher asks again only after both). Parts
        that do not fit what it holds leave it holding the version before, and it asks
        for every state again."""
        steps = take_steps(self.held, parts)
        epoch = self.epoch
        if ops_of(parts) <= TAKE_STEP:
            try:
                held = run(steps)
            except Exception as e:
                self._parts_failed(e)
            else:
                self._took_parts(held, version, paused, parts, epoch)
            return done
        left = [2]

        def both() -> None:
            left[0] -= 1
            if not left[0]:
                done()

        def took(held: dict[str, Held]) -> None:
            self._took_parts(held, version, paused, parts, epoch)
            both()

        def failed(e: BaseException) -> None:
            self._parts_failed(e)
            both()
        owner_loop(self.topic.owner).run_steps(steps, took, failed)
        return both

    def _took_parts(self, held: dict[str, Held], version: int,
                    paused: tuple[bool, int] | None, parts: list[Part], epoch: int) -> None:
        if self.role == FOLLOWER and self.epoch == epoch:   # (else not its now)
            self.held = held
            self.channels_raw = None
            self.channels = {}
            self.chan_from_leader = version
            if paused is not None:
                self.paused_shipped, self.released_shipped = paused
            self._follow_floors([p.floor for p in parts])

    def _parts_failed(self, e: BaseException) -> None:
        if isinstance(e, ValueError):
            log.warning("CLUSTER: %s: the channel states shipped do not fit the ones "
                        "held (%s): asking for all of them", self.name, e)
        else:       # a bug: the fetcher is never left waiting
            log.error("CLUSTER: %s: taking the channel states shipped failed", self.name,
                      exc_info=e)
        self.chan_from_leader = 0

    def _follow_floors(self, floors: list[int]) -> None:
        """``_follow_floor`` with the floors the leader worked out (one per channel)."""
        topic = self.topic
        if floors and not topic.channels:
            with topic.lock:
                topic.orphan_start = max(topic.orphan_start, min(floors))

    def _note_dpubs(self, first: int, blob: bytes, starts: Sequence[int],
                    deferred: int) -> None:
        # caller holds the topic's lock: DPUB records count as deferred until due
        batch = RecordBatch(first, blob, starts, deferred)
        for i in batch.deferred_indices(len(starts)):
            self.topic.dpubs[first + i] = batch.deliver_at(i)

    def _take_over(self) -> None:
        """A new leader takes its old leader's channel states (cursors, pending, skip),
        cut to what its log holds now: only messages not finished there are delivered
        again. Small states in this turn; larger ones a step a turn, put in place when
        all are built (pybroker.cluster.takeover)."""
        topic = self.topic
        raw = self.channels_raw
        text = Text(*joined(self.held)) if self.held else \
            Text([raw], len(raw)) if raw is not None else None
        steps = build(topic, self.channels if text is None else text, topic.log.written,
                      time.monotonic_ns(), time.time_ns())
        names = [n for n, ch in topic.channels.items() if not ch.ephemeral]
        if text is None or text.size <= INLINE_BYTES:
            self._install(run(steps), names, self.chan_from_leader)
            return
        self.taking_over = epoch = self.epoch
        log.info("CLUSTER: %s: taking its channels over in steps (%d bytes of states)",
                 self.name, text.size)
        began, from_leader = time.monotonic_ns(), self.chan_from_leader

        def built(chans: list[Channel] | None) -> None:
            if chans is None:
                return      # the leadership went meanwhile: not its channels
            log.info("CLUSTER: %s: channels built in %.0f ms", self.name,
                     (time.monotonic_ns() - began) / 1e6)
            self._install(chans, names, from_leader)
            self._end_takeover(True)

        def failed(e: BaseException) -> None:   # a bug: the follower's channels stay
            log.error("CLUSTER: %s: building the channels taken over failed", self.name,
                      exc_info=e)
            self._end_takeover(True)        # (no SUB waits forever)
        owner_loop(self.topic.owner).run_steps(self._while_leading(steps, epoch), built,
                                               failed)

    def _while_leading(self, steps: Steps, epoch: int
                       ) -> Generator[None, None, list[Channel] | None]:
        """steps while this replica still takes over as the leader of epoch; None when
        the leadership went meanwhile."""
        while True:
            if self.taking_over != epoch or self.role != LEADER or self.epoch != epoch:
                steps.close()
                return None
            try:
                next(steps)
            except StopIteration as done:
                chans: list[Channel] = done.value
                return chans
            yield

    def after_takeover(self, then: Callable[[bool], None]) -> None:
        """``then(led)`` once the channels being built are in place (True), or the
        leadership went first (False); at once if that is done already."""
        if self.taking_over:
            self.sub_waiters.append(then)
        else:
            then(self.role == LEADER)

    def _end_takeover(self, led: bool) -> None:
        self.taking_over = 0
        waiters, self.sub_waiters = self.sub_waiters, []
        for then in waiters:
            try:
                then(led)
            except Exception:       # a bug: the others are told all the same
                log.exception("CLUSTER: %s: a SUB waiting for the takeover failed",
                              self.name)

    def _install(self, chans: list[Channel], names: list[str], from_leader: int) -> None:
        """Put the channels taken over in place of the follower's (``names``: the
        follower's channels when it took over; ``from_leader``: the version of the
        states it held, 0 if none came from a leader); the states kept to build them
        go."""
        self.channels_raw = None
        self.held = {}
        self.channels = {}
        topic = self.topic
        log.info("CLUSTER: %s: channels taken over: %s", self.name,
                 ", ".join(f"{ch.name} at {ch.cursor}" for ch in chans) or "none")
        if from_leader:
            # the states came from a leader: its channels are the topic's. One this node
            # still has from an earlier leadership of its own, deleted since, goes
            broker = self.node.runtime.broker
            have = {ch.name for ch in chans}
            for name in names:
                ch = topic.channels.get(name)
                if ch is None or name in have or ch.ephemeral:
                    continue
                log.info("CLUSTER: %s: channel %s was deleted by the leader before",
                         self.name, name)
                try:
                    broker.delete_channel(topic.name, name)
                except (TopicNotFound, ChannelNotFound):
                    pass
        if self.paused_shipped is not None and self.paused_shipped != topic.paused:
            # a topic paused (or unpaused) by the old leader stays so: when paused, its
            # channels read no further than they could there (a follower's log was
            # all released as it came)
            log.info("CLUSTER: %s: topic %s as the leader had it", self.name,
                     "paused" if self.paused_shipped else "unpaused")
            woken = topic.set_paused(self.paused_shipped)
            if self.paused_shipped:
                with topic.lock:
                    topic.released = min(topic.released, self.released_shipped)
            if woken:
                self.node.runtime.broker.wake(woken)
            self.node.runtime.broker.notify_changed()
        if not chans:
            return
        had = set(names)
        for ch in chans:
            with topic.lock:
                if ch.name in had and ch.name not in topic.channels:
                    continue        # deleted here while it was being built
                old = topic.channels.pop(ch.name, None)
                topic.channels[ch.name] = ch
            if old is not None:
                old.deleted = True
                old.owner.call_soon_threadsafe(old.owner.close_channel, old)
            ch.owner.call_soon_threadsafe(_dirty, ch)
        self.node.runtime.broker.notify_changed()

    # -- stats ---------------------------------------------------------------------------
    def stats(self) -> ReplicaStats:
        """The extra /stats keys of this topic (any thread: a racy but safe read)."""
        end = self.topic.log.written
        out: ReplicaStats = {"role": self.role, "leader": self.leader,
                               "epoch": self.epoch, "isr": list(self.isr),
                               "high_watermark": self.hw, "log_end": end,
                               "channel_states": (self.chan_version if self.role == LEADER
                                                  else self.chan_from_leader),
                               "states_shipped_bytes": self.states_sent}
        if self.taking_over:
            out["taking_over"] = True
        lead = self.lead
        if lead is not None:
            lag: dict[str, dict[str, int]] = {}
            for n, f in list(lead.followers.items()):
                msgs = max(0, end - f.acked)
                lag[str(n)] = {"messages": msgs,
                               "bytes": bytes_between(self.topic, f.acked, end)}
            out["lag"] = lag
        return out


def _kick(ch: Channel, why: str) -> None:
    for c in list(ch.consumers):
        close = getattr(c, "close", None)
        if close is not None:
            close(why)


def _dirty(ch: Channel) -> None:
    ch.owner.mark_dirty(ch)


__all__ = ["FOLLOWER", "LEADER", "NONE", "NotLeader", "Replica", "bytes_between"]
