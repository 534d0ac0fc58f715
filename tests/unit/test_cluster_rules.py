"""pybroker.cluster.rules as a Hypothesis state machine: three replicas, a controller
standing for etcd (leader epoch, leader key, in-sync set), leaders that append and
acknowledge by the high watermark, followers that cut their logs where they diverge
(epoch histories, KIP-101/279) and fetch, leases that expire (a leader paused or cut
off keeps its state but may no longer acknowledge), nodes killed and restarted, time
passing (lagging followers leave the in-sync set, caught-up ones rejoin; etcd holds a
change before its leader hears of it), a leader
whose log cannot be written handing its leadership over, and a node that comes back
with an empty disk while etcd still counts it in sync (Coordinator._leave_isr: it
never campaigns, and leaves the set unless it is its last member; a leader's in-sync
change holds only on the state it read, so it cannot write such a node back).

What must hold at every step: no offset is ever acknowledged with two different records
(no two leaders acknowledge the same offset), every acknowledged record is in the log
of the leader that holds the lease and of every live in-sync replica whose disk was not
lost since it was counted, and a follower's
log, once cut, is a prefix of its leader's."""
from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pybroker.cluster.rules import EpochHistory, LeaderState, LeaseClock, Waiter, \
    assign_replicas, divergence

NODES = (1, 2, 3)
MIN_INSYNC = 2
LAG_NS = 1000
Record = tuple[int, int]          # (epoch that appended it, unique id)


class Node:
    def __init__(self, nid: int) -> None:
        self.id = nid
        self.log: list[Record] = []
        self.history = EpochHistory()
        self.alive = True
        self.lead: LeaderState | None = None
        self.lease_valid = False
        self.following: tuple[int, int] | None = None     # (leader, epoch)
        self.truncated_for = 0
        self.hw = 0
        self.unvouched = False     # back with an empty disk, not yet out of the set
        self.restarted = False     # of those: back after a power cut (its tail lost)
        self.read_ver = 0          # the version of etcd's state it last read (a leader)


class ReplicationRules(RuleBasedStateMachine):
    MAX_INSYNC = 0        # the in-sync set's cap (max_insync_replicas; 0: none)

    def __init__(self) -> None:
        super().__init__()
        self.nodes = {n: Node(n) for n in NODES}
        self.now = 0
        self.uid = 0
        self.epoch = 0
        self.leader: int | None = None          # the leader key (on its lease)
        self.isr: set[int] = set(NODES)
        self.acked: dict[int, Record] = {}
        # an in-sync change written to etcd, not yet heard by its leader: (leader, epoch,
        # the new set)
        self.asked: tuple[int, int, set[int]] | None = None
        self.state_ver = 0         # etcd's state key's mod revision, as a count
        self.elect_on(1)

    # -- the controller (etcd) -----------------------------------------------------------
    def elect_on(self, c: int) -> None:
        n = self.nodes[c]
        self.epoch += 1
        live = {i for i in NODES if self.nodes[i].alive}
        self.isr = (self.isr & live) | {c}
        self.leader = c
        self.state_ver += 1
        n.read_ver = self.state_ver
        n.history.begin(self.epoch, len(n.log))
        n.lead = LeaderState(c, self.epoch, set(self.isr), MIN_INSYNC, LAG_NS, n.hw,
                             len(n.log), self.now, self.MAX_INSYNC)
        n.lease_valid = True
        n.following = None

    def valid_leader(self) -> Node | None:
        if self.leader is None:
            return None
        n = self.nodes[self.leader]
        return n if n.alive and n.lease_valid and n.lead is not None else None

    # -- rules ---------------------------------------------------------------------------
    @rule(k=st.integers(1, 4))
    def publish(self, k: int) -> None:
        n = self.valid_leader()
        if n is None or n.lead is None or not n.lead.enough():
            return                       # refused (Replica.refusal)
        for _ in range(k):
            self.uid += 1
            n.log.append((n.lead.epoch, self.uid))

    @rule(f=st.sampled_from(NODES), most=st.integers(0, 5))
    def fetch(self, f: int, most: int) -> None:
        fo = self.nodes[f]
        if not fo.alive or fo.following is None:
            return
        lid, epoch = fo.following
        ld = self.nodes[lid]
        if not ld.alive or ld.lead is None or ld.lead.epoch != epoch:
            return                       # the leader is gone or moved on: error, retry
        if fo.truncated_for != epoch:
            cut = divergence(fo.history, len(fo.log), ld.history, len(ld.log))
            del fo.log[cut:]
            fo.history.truncate(cut)
            fo.hw = min(fo.hw, cut)
            fo.truncated_for = epoch
        assert fo.log == ld.log[:len(fo.log)], "a cut follower diverges from its leader"
        held = len(fo.log)
        ld.lead.fetched(f, held, len(ld.log), self.now)
        sent = ld.log[held:held + most]
        ld.lead.answered(f, held + len(sent) if held + len(sent) < len(ld.log)
                         else len(ld.log))
        fo.log += sent
        fo.history.adopt(EpochHistory(ld.history.entries), len(fo.log))
        fo.hw = max(fo.hw, min(ld.hw, len(fo.log)))

    @rule()
    def advance(self) -> None:
        """The leader's high watermark moves; what it passes is acknowledged."""
        n = self.valid_leader()
        if n is None or n.lead is None or not n.lead.enough():
            return
        hw = n.lead.high_watermark(len(n.log))
        n.hw = hw
        for off in range(hw):
            rec = n.log[off]
            if rec[0] != n.lead.epoch:
                continue                 # appended by an earlier leader, not a publish here
            before = self.acked.setdefault(off, rec)
            assert before == rec, f"offset {off} acknowledged as {before} and as {rec}"

    @rule(dt=st.integers(0, 1500))
    def tick(self, dt: int) -> None:
        """Time passes; the leader asks for in-sync changes (Replica.check_isr): etcd
        is written first, and the leader hears of it later (``isr_written``)."""
        self.now += dt
        n = self.valid_leader()
        if n is None or n.lead is None or self.asked is not None:
            return
        live = {i for i in NODES if self.nodes[i].alive}
        new = n.lead.isr_change(list(NODES), self.now, live)
        if new is not None:
            n.lead.asking(new)
            if n.read_ver != self.state_ver:
                # the state moved on since it read it: refused (Coordinator._state_read)
                self.asked = (n.id, n.lead.epoch, set())
                return
            self.isr = new
            self.state_ver += 1
            n.read_ver = self.state_ver
            self.asked = (n.id, n.lead.epoch, new)

    @rule()
    def isr_written(self) -> None:
        """The coordinator's answer reaches the leader (Replica.isr_changed)."""
        if self.asked is None:
            return
        nid, epoch, new = self.asked
        self.asked = None
        n = self.nodes[nid]
        if n.alive and n.lead is not None and n.lead.epoch == epoch:
            n.lead.isr_written(new or None)

    @rule()
    def leader_polls(self) -> None:
        """The leader reads etcd's state: its in-sync set is etcd's (set_role)."""
        n = self.valid_leader()
        if n is None or n.lead is None or self.asked is not None:
            return
        n.lead.isr = frozenset(self.isr) | {n.id}
        n.read_ver = self.state_ver

    @rule(f=st.sampled_from(NODES))
    def poll(self, f: int) -> None:
        """A node reads etcd: it follows the leader that holds the key."""
        fo = self.nodes[f]
        if not fo.alive or self.leader is None or self.leader == f and fo.lease_valid:
            return
        if fo.following != (self.leader, self.epoch):
            fo.lead = None
            fo.lease_valid = False
            fo.following = (self.leader, self.epoch)
            fo.truncated_for = 0

    @rule()
    def lease_expires(self) -> None:
        """The leader is paused, cut off or dead past its lease: its key goes; it keeps
        its state but its LeaseClock no longer lets it acknowledge."""
        if self.leader is None:
            return
        self.nodes[self.leader].lease_valid = False
        self.leader = None

    @rule()
    def resign(self) -> None:
        """The leader's log cannot be written (Replica.storage_failed): it stops
        acknowledging, then gives its key up and writes the in-sync set without itself
        (Coordinator._resign), when a member both etcd and it count in sync is left."""
        n = self.valid_leader()
        if n is None or n.lead is None:
            return
        heirs = (self.isr & set(n.lead.isr)) - {n.id}
        if not heirs or n.read_ver != self.state_ver:
            return                       # refused: it leads on
        n.lease_valid = False            # (its ``resigning`` flag: no OK from here on)
        n.lead = None
        self.leader = None
        self.isr = heirs
        self.state_ver += 1

    @precondition(lambda self: self.leader is None)
    @rule(c=st.sampled_from(NODES))
    def campaign(self, c: int) -> None:
        n = self.nodes[c]
        if n.alive and c in self.isr and not n.unvouched:
            self.elect_on(c)

    @rule(x=st.sampled_from(NODES))
    def kill(self, x: int) -> None:
        n = self.nodes[x]
        n.alive = False
        for m in self.nodes.values():     # its connections close
            if m.lead is not None:
                m.lead.disconnected(x)
        n.lease_valid = False
        n.lead = None
        if self.leader == x:
            self.leader = None          # its lease is revoked or expires

    @rule(x=st.sampled_from(NODES))
    def restart(self, x: int) -> None:
        n = self.nodes[x]
        if not n.alive:
            n.alive = True                # the log and epoch history are on disk
            n.following = None
            n.truncated_for = 0

    @rule(x=st.sampled_from(NODES))
    def restart_with_an_empty_disk(self, x: int) -> None:
        """A dead node comes back with its data path lost (Coordinator: no copy of an
        incarnation that had a leader: unvouched)."""
        n = self.nodes[x]
        if not n.alive:
            n.alive = True
            n.log = []
            n.history = EpochHistory()
            n.hw = 0
            n.following = None
            n.truncated_for = 0
            n.unvouched = True
            n.restarted = False

    @rule(x=st.sampled_from(NODES), kept=st.floats(0, 1))
    def restart_after_a_power_cut(self, x: int, kept: float) -> None:
        """A dead node's machine lost power (memory mode): the records its page cache
        held are gone, the end of its log with them, while its files still name the
        topic; it comes back under another boot id (pybroker.cluster.boot: unvouched,
        restarted). Power cuts of every in-sync copy at once are outside the
        guarantees: another in-sync member is alive with its disk whole."""
        n = self.nodes[x]
        if n.alive or not any(self.nodes[i].alive and not self.nodes[i].unvouched
                              for i in self.isr - {x}):
            return
        end = int(len(n.log) * kept)
        n.log = n.log[:end]
        n.history.truncate(end)
        n.hw = min(n.hw, end)
        n.alive = True
        n.following = None
        n.truncated_for = 0
        n.unvouched = n.restarted = True

    @rule(x=st.sampled_from(NODES))
    def leave_isr(self, x: int) -> None:
        """An unvouched node's poll (Coordinator._leave_isr): out of the set unless it
        is its last member; vouched for once it is out. A restarted one as the last
        member is vouched for where it is (what is left)."""
        n = self.nodes[x]
        if not n.alive or not n.unvouched:
            return
        if x not in self.isr:
            n.unvouched = n.restarted = False
        elif len(self.isr) > 1:
            self.isr = self.isr - {x}
            self.state_ver += 1
            n.unvouched = n.restarted = False
        elif n.restarted:
            n.unvouched = n.restarted = False

    # -- what must hold ------------------------------------------------------------------
    @invariant()
    def acknowledged_records_are_kept(self) -> None:
        n = self.valid_leader()
        holders = [n] if n is not None else []
        holders += [self.nodes[i] for i in self.isr
                    if self.nodes[i].alive and not self.nodes[i].unvouched
                    and self.leader is not None]
        for h in holders:
            for off, rec in self.acked.items():
                assert off < len(h.log) and h.log[off] == rec, \
                    f"acknowledged {rec} at {off} missing on node {h.id} ({h.log})"

    @invariant()
    def someone_can_lead(self) -> None:
        # the in-sync set never loses its last member: a leader of the set stays in it
        assert self.isr


TestReplicationRules = ReplicationRules.TestCase
TestReplicationRules.settings = settings(max_examples=300, stateful_step_count=60,
                                         deadline=None)


class CappedReplicationRules(ReplicationRules):
    """The same rules with the in-sync set capped at two (max_insync_replicas=2): the
    third replica follows outside it and joins when a member leaves."""

    MAX_INSYNC = 2

    @invariant()
    def the_cap_holds_once_the_leader_has_asked(self) -> None:
        """Over the cap only while a member has not fetched from this leader yet."""
        n = self.valid_leader()
        if n is not None and n.lead is not None and self.asked is None \
                and n.lead.isr_change(list(NODES), self.now, None) is None \
                and all(m in n.lead.followers for m in n.lead.isr - {n.id}):
            assert len(n.lead.isr) <= self.MAX_INSYNC, n.lead.isr


TestCappedReplicationRules = CappedReplicationRules.TestCase
TestCappedReplicationRules.settings = settings(max_examples=150, stateful_step_count=60,
                                               deadline=None)


def test_lease_clock_stops_before_the_ttl() -> None:
    clock = LeaseClock(ttl_ns=5_000, margin_ns=1_000)
    assert not clock.valid(0)
    clock.renewed(sent_ns=100)
    assert clock.valid(100) and clock.valid(4_099) and not clock.valid(4_100)
    clock.renewed(sent_ns=50)            # an older renewal answered late: no going back
    assert clock.valid(4_099)
    clock.lost()
    assert not clock.valid(0)


def test_waiter_releases_in_order_by_end() -> None:
    w: Waiter[str] = Waiter()
    w.add(3, "a")
    w.add(5, "b")
    assert w.ready(2) == [] and w.ready(4) == ["a"] and len(w) == 1
    assert w.all() == ["b"] and len(w) == 0


def test_assign_replicas_takes_the_next_nodes_by_id() -> None:
    assert assign_replicas(2, [1, 2, 3, 4], 3) == [2, 3, 4]
    assert assign_replicas(4, [1, 2, 3, 4], 3) == [4, 1, 2]
    assert assign_replicas(1, [1], 3) == [1]


def test_divergence_cuts_an_unacknowledged_tail() -> None:
    leader = EpochHistory([(1, 0), (3, 5)])
    mine = EpochHistory([(1, 0), (2, 5)])     # a deposed leader appended at epoch 2
    assert leader.end_for_epoch(mine.last_epoch(), 9) == (1, 5)
    assert divergence(mine, 8, leader, 9) == 5


def test_divergence_before_the_epoch_the_leader_names() -> None:
    """The follower lacks the epoch the leader's OffsetsForLeaderEpoch answer names
    (2): its record at offset 0 (epoch 1) differs from the leader's (epoch 2), though
    a single such answer would keep it (the case the state machine found)."""
    leader = EpochHistory([(2, 0), (4, 1)])
    mine = EpochHistory([(1, 0), (3, 1)])
    assert leader.end_for_epoch(mine.last_epoch(), 1) == (2, 1)
    assert divergence(mine, 1, leader, 1) == 0
    assert divergence(EpochHistory([(2, 0)]), 1, leader, 1) == 1   # the same record


def _tick(m: ReplicationRules, dt: int) -> None:
    """Time passes, and the leader hears at once of the in-sync change it asked for."""
    m.tick(dt)
    m.isr_written()


def _acknowledged(m: ReplicationRules, k: int) -> None:
    """Both followers follow; k records published, fetched by both and acknowledged."""
    m.poll(2)
    m.poll(3)
    m.publish(k)
    for f in (2, 3):
        m.fetch(f, 5)
        m.fetch(f, 0)
    m.advance()


def test_a_follower_rejoins_only_once_it_holds_the_epoch_start() -> None:
    """A new leader's high watermark can lag what the old one acknowledged; a follower
    that holds up to it but not up to the new epoch's start must stay out of the
    in-sync set (else a later failover to it loses acknowledged records)."""
    m = ReplicationRules()
    _acknowledged(m, 3)
    assert sorted(m.acked) == [0, 1, 2]
    _tick(m, 600)
    m.fetch(2, 0)
    _tick(m, 600)                      # node 3 has not caught up for LAG_NS: it leaves
    assert m.isr == {1, 2}
    m.publish(2)
    m.fetch(2, 5)
    m.fetch(2, 0)
    m.advance()                      # offsets 3 and 4 acknowledged by nodes 1 and 2
    assert sorted(m.acked) == [0, 1, 2, 3, 4]
    m.lease_expires()
    m.campaign(2)
    assert m.nodes[2].lead is not None and m.nodes[2].lead.hw == 3
    m.poll(3)
    m.fetch(3, 0)                    # holds 3: the new leader's high watermark
    _tick(m, 0)
    assert 3 not in m.isr
    m.acknowledged_records_are_kept()
    m.fetch(3, 5)
    m.fetch(3, 0)
    _tick(m, 0)
    assert 3 in m.isr
    m.acknowledged_records_are_kept()


def test_dead_followers_leave_the_in_sync_set_and_stay_out() -> None:
    """Both followers gone: the in-sync set shrinks to the leader and stays so (a
    follower dropped for lagging must not be taken back for holding the high
    watermark, or two dead followers take turns and a publish waits forever)."""
    m = ReplicationRules()
    _acknowledged(m, 1)
    m.kill(2)
    m.kill(3)
    for _ in range(3):
        _tick(m, 700)
        if m.isr == {1}:
            break
    assert m.isr == {1}
    for _ in range(4):
        _tick(m, 700)
        assert m.isr == {1}
    lead = m.nodes[1].lead
    assert lead is not None and not lead.enough()


def test_a_leader_that_resigns_hands_over_only_to_replicas_in_sync() -> None:
    """The state machine's ``resign`` along one path a random search rarely takes:
    node 3 lags out of the in-sync set, records are acknowledged by nodes 1 and 2, and
    node 1's log fails. Only node 2 may inherit; node 3 may not campaign (with node 3
    among the heirs, its election loses the acknowledged records, and the invariant
    says so)."""
    m = ReplicationRules()
    m.poll(2)
    m.poll(3)
    _tick(m, 600)
    m.fetch(2, 0)
    _tick(m, 600)              # node 3 never fetched: out of the in-sync set
    assert m.isr == {1, 2}
    m.publish(2)
    m.fetch(2, 5)
    m.fetch(2, 5)
    m.advance()
    assert len(m.acked) == 2
    m.resign()
    assert m.leader is None and m.isr == {2}
    m.campaign(3)
    assert m.leader is None        # not in sync: it may not campaign
    m.campaign(2)
    m.poll(3)
    m.fetch(3, 5)
    assert m.leader == 2
    m.acknowledged_records_are_kept()


def test_a_member_being_added_counts_for_the_high_watermark() -> None:
    """An in-sync change is written to etcd before its leader hears of it. Node 3,
    back in sync, is added; before the answer comes, node 2 acknowledges new records
    and the leader dies. Node 3 is in etcd's set and may be elected: the records the
    leader acknowledged meanwhile must be on it, so the high watermark waited for it
    (``LeaderState.asking``) instead of counting only the set it knew."""
    m = ReplicationRules()
    m.poll(2)
    m.poll(3)
    m.tick(600)
    m.fetch(2, 0)
    m.tick(600)              # node 3 never fetched: out of the in-sync set
    m.isr_written()
    assert m.isr == {1, 2} and m.nodes[1].lead is not None
    assert m.nodes[1].lead.isr == {1, 2}
    m.fetch(3, 0)            # node 3 holds everything (nothing yet): caught up
    m.publish(2)
    m.fetch(2, 5)
    m.fetch(2, 5)            # node 2 holds the two records
    m.tick(0)                # node 3 is added: etcd first
    assert m.isr == {1, 2, 3} and m.asked is not None
    m.advance()              # before the answer: node 3 holds neither record
    m.kill(1)
    m.campaign(3)
    assert m.leader == 3
    m.acknowledged_records_are_kept()


def test_a_leader_back_with_an_empty_disk_is_not_elected() -> None:
    """The leader dies and is back with an empty disk before a follower campaigned;
    etcd still counts it in sync. It must not campaign: elected, it would lead an empty
    log. It leaves the set instead, and a follower leads with every record."""
    m = ReplicationRules()
    _acknowledged(m, 3)
    assert sorted(m.acked) == [0, 1, 2]
    m.kill(1)
    m.restart_with_an_empty_disk(1)
    m.campaign(1)
    assert m.leader is None              # not a candidate while unvouched
    m.leave_isr(1)
    assert m.isr == {2, 3} and not m.nodes[1].unvouched
    m.campaign(1)
    assert m.leader is None              # out of the set: not a candidate either
    m.campaign(2)
    assert m.leader == 2
    m.acknowledged_records_are_kept()


def test_a_leader_back_after_a_power_cut_is_not_elected_with_its_cut_log() -> None:
    """Memory mode: the leader's machine loses power and is back before a follower
    campaigned, its log cut to one record (the page cache lost), etcd still counting it
    in sync. It must not campaign; it leaves the set, and a follower leads with every
    record. (Trusted as after a process crash, it was elected with the one record.)"""
    m = ReplicationRules()
    _acknowledged(m, 3)
    m.kill(1)
    m.restart_after_a_power_cut(1, 0.34)
    assert len(m.nodes[1].log) == 1 and m.nodes[1].unvouched
    m.campaign(1)
    assert m.leader is None              # not a candidate while unvouched
    m.leave_isr(1)
    assert m.isr == {2, 3} and not m.nodes[1].unvouched
    m.campaign(2)
    assert m.leader == 2
    m.acknowledged_records_are_kept()


def test_a_power_cut_of_the_last_member_elects_what_is_left() -> None:
    """Its followers left the set before (dropped as lagging): the node back after a
    power cut is the only in-sync replica, and its copy is what is left: it may be
    elected (the topic would otherwise wait for good)."""
    m = ReplicationRules()
    m.poll(2)
    m.poll(3)
    _tick(m, 600)
    _tick(m, 600)                # neither follower fetched: both out
    assert m.isr == {1}
    m.publish(2)
    m.advance()
    m.kill(1)
    m.nodes[1].alive = True      # the rule needs another in-sync member: set by hand
    m.nodes[1].unvouched = m.nodes[1].restarted = True
    m.lease_expires()
    m.leave_isr(1)
    assert m.isr == {1} and not m.nodes[1].unvouched
    m.campaign(1)
    assert m.leader == 1


def test_a_leader_that_had_not_heard_does_not_write_a_lost_member_back() -> None:
    """A follower back with an empty disk leaves the set while the leader still counts
    it in (it has not read etcd since). The leader's next in-sync change (dropping the
    other follower, dead) would write the set it knows, with the empty one back in, and
    a failover could then elect it: it is refused, as it held on a state that moved on;
    the leader reads etcd and asks again."""
    m = ReplicationRules()
    _acknowledged(m, 3)
    assert sorted(m.acked) == [0, 1, 2]
    m.kill(3)
    m.restart_with_an_empty_disk(3)
    m.leave_isr(3)
    assert m.isr == {1, 2}
    m.kill(2)
    _tick(m, 0)                 # drop 2 from the set the leader knows, {1, 2, 3}
    m.leader_polls()
    _tick(m, 0)                 # drop 2 from the set etcd holds
    assert m.isr == {1}
    m.lease_expires()
    m.campaign(3)
    m.acknowledged_records_are_kept()
    assert m.leader is None


def _leader(isr: set[int], cap: int, held: dict[int, int], now: int = 0) -> LeaderState:
    """Node 1 leading with ``isr``, capped at ``cap``; each follower in ``held`` has
    fetched, holding that much, at time 0 (the leader's log ends at 10)."""
    lead = LeaderState(1, 1, isr, MIN_INSYNC, LAG_NS, 0, 0, now, cap)
    for node, acked in held.items():
        lead.fetched(node, acked, 10, 0)
        lead.answered(node, acked)
    return lead


def test_a_capped_set_gives_up_the_members_holding_least() -> None:
    """Three in sync under a cap of two (the set etcd had, or the cap just set): the
    member holding least leaves (the leader never); at a tie, the higher id."""
    assert _leader({1, 2, 3}, 2, {2: 10, 3: 7}).isr_change([1, 2, 3], 0) == {1, 2}
    assert _leader({1, 2, 3}, 2, {2: 10, 3: 10}).isr_change([1, 2, 3], 0) == {1, 2}
    assert _leader({1, 2}, 2, {2: 10, 3: 10}).isr_change([1, 2, 3], 0) is None
    # a member not heard from yet is not dropped for it (it may be the live one);
    # once it lags for LAG_NS it leaves as lagging, and the set is within the cap
    lead = _leader({1, 2, 3}, 2, {3: 10})
    assert lead.isr_change([1, 2, 3], 0) is None
    lead.fetched(3, 10, 10, LAG_NS + 1)
    assert lead.isr_change([1, 2, 3], LAG_NS + 1) == {1, 3}
    # no cap: the caught-up follower joins
    assert _leader({1, 2}, 0, {2: 10, 3: 10}).isr_change([1, 2, 3], 0) == {1, 2, 3}


def test_a_capped_set_takes_a_follower_in_when_a_member_leaves() -> None:
    """A member that stopped fetching leaves and the follower outside takes its place
    in the same change (publishes are never refused for the swap); with room for one,
    the one holding most joins."""
    lead = _leader({1, 2}, 2, {2: 10, 3: 10})
    lead.fetched(3, 10, 10, LAG_NS + 1)          # 3 fetches on; 2 fell silent
    assert lead.isr_change([1, 2, 3], LAG_NS + 1) == {1, 3}
    lead = _leader({1}, 2, {2: 10, 3: 10})
    lead.hw = 10
    assert lead.isr_change([1, 2, 3], 0) == {1, 2}
    lead = _leader({1}, 2, {2: 9, 3: 10})
    assert lead.isr_change([1, 2, 3], 0) == {1, 3}
