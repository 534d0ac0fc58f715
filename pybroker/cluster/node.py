"""ClusterNode: what the rest of the server sees of clustering (docs/replication.md).

Built by the Runtime only when ``cluster_etcd`` is set (a single node imports nothing
of pybroker.cluster). It owns the coordinator thread (etcd: membership, elections,
in-sync sets), the replication server (followers fetch from here), the fetchers (this
node's follower side) and one Replica per replicated topic. The hooks elsewhere are
narrow: the Publisher asks ``diverts``/``divert``/``refusal`` before appending and
``await_replicas`` before answering; the SUB handler asks ``sub_refusal``; the HTTP
API asks ``leader_http`` before an action that changes a topic or its channels; the
nsqlookupd registrar asks ``registers``; /stats and /metrics ask ``stats``.

Threads: the ``diverts``, ``refusal``, ``sub_refusal``, ``leader_http``, ``registers``
and ``stats`` reads may run on any thread (they read the replicas' fields, each written by one owner);
everything else says where it runs.
"""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from pybroker.cluster.boot import same_boot, stopped_cleanly
from pybroker.cluster.forward import ForwardError, Forwarders
from pybroker.cluster.ports import Done, IsrAsker, Registration, ReplicaStats
from pybroker.cluster.replica import LEADER, NotLeader, Replica
from pybroker.cluster.rules import LeaseClock
from pybroker.cluster.syncs import FollowerSyncs
from pybroker.protocol.names import is_ephemeral
from pybroker.server.services import owner_loop

if TYPE_CHECKING:
    from collections.abc import Callable

    from pybroker.cluster.coordinator import Coordinator
    from pybroker.cluster.fetcher import Fetchers
    from pybroker.cluster.nodeport import NodeSummary
    from pybroker.cluster.serve import ReplicationServer
    from pybroker.core.topic import Topic
    from pybroker.server.loop import EventLoop
    from pybroker.server.ports import Loop, Payload
    from pybroker.server.services import ClusterHost

log = logging.getLogger("pybroker")
TICK_NS = 100_000_000          # leader checks (lease, lagging followers) per loop
DIVERT_WAIT_NS = 10_000_000_000   # a publish waits this long for a leader to be known
RETRY_NS = 50_000_000
FORWARD_RETRY_NS = 200_000_000   # a leader that went away: ask again after a poll


class ClusterNode:
    def __init__(self, runtime: ClusterHost) -> None:
        o = runtime.options
        self.runtime = runtime
        self.options = o
        self.id = int(o.id)
        self.min_insync = int(o.min_insync_replicas)
        self.max_insync = int(o.max_insync_replicas)    # 0: every caught-up replica
        self.factor = int(o.replication_factor)
        ttl_ns = int(o.cluster_lease_ttl)
        self.lease = LeaseClock(ttl_ns)
        self.lease_id = 0         # the etcd lease of this node's current session
        self.lag_ns = ttl_ns
        self.ship_ns = 200_000_000
        self.durable = o.durability == "fsync"
        self.syncs = FollowerSyncs()     # where a follower's fsyncs run (fsync mode)
        self.handovers = 0     # leaderships given up because the log failed here
        self.replicas: dict[str, Replica] = {}
        # the topics read from the data path (built after they are, before clients come)
        self.restored: dict[str, Topic] = {t.name: t for t in runtime.broker.all_topics()}
        # memory mode: False when the machine restarted since the last run (the page
        # cache, and the records it held, may be gone: pybroker.cluster.boot)
        self.same_boot = self.durable or self._same_boot(o.data_path)
        self.live: set[int] = set()
        self.nodes: dict[int, Registration] = {}        # id -> registration
        self.assigned: dict[str, list[int]] = {}        # topic -> replica ids
        self.leaders: dict[str, int] = {}               # topic -> leader id (etcd's view)
        self.forwarders = Forwarders(self)
        self.coordinator: Coordinator | None = None
        self.server: ReplicationServer | None = None
        self.fetchers: Fetchers | None = None

    # -- start and stop (main thread) --------------------------------------------------
    @staticmethod
    def _same_boot(data_path: str) -> bool:
        try:
            return same_boot(_boot_dir(data_path))
        except OSError as e:
            log.error("CLUSTER: saving this boot's id failed (%s): the copies on this "
                      "node's disk catch up before they count as in sync", e)
            return False

    def stopped(self, healthy: bool) -> None:
        """After the logs were written, synced and closed at a clean stop (main
        thread): in memory mode, say so for the next run (pybroker.cluster.boot),
        unless a write or an fsync failed (``healthy`` False)."""
        if self.durable or not healthy:
            return
        try:
            stopped_cleanly(_boot_dir(self.options.data_path))
        except OSError as e:
            log.error("CLUSTER: marking this clean stop failed (%s): the next run's "
                      "copies catch up first if the machine restarts meanwhile", e)

    def start(self, tcp_address: str, http_address: str) -> None:
        from pybroker.cluster.coordinator import Coordinator
        from pybroker.cluster.fetcher import Fetchers
        from pybroker.cluster.serve import ReplicationServer

        self.server = ReplicationServer(self, self.options.cluster_address)
        self.server.start()
        self.fetchers = Fetchers(self)
        self.coordinator = Coordinator(self, tcp_address, http_address,
                                       self.server.address)
        self.coordinator.start()
        self.runtime.broker.on_delete_topic.append(self._topic_deleted)
        self.runtime.storage.on_topic_failure.append(self._storage_failed)
        for loop in self.runtime.loops:
            loop.call_soon_threadsafe(self._tick, loop)

    def stop(self, timeout_s: float) -> None:
        if self.coordinator is not None:
            self.coordinator.stop(timeout_s)
        if self.fetchers is not None:
            self.fetchers.stop(timeout_s)
        if self.server is not None:
            self.server.stop(timeout_s)

    def _topic_deleted(self, topic: Topic) -> None:
        """A topic was deleted here (any thread, under the registry's lock): a
        replicated one is deleted in the whole cluster (docs/replication.md)."""
        if self.coordinator is not None and self.replicated(topic.name):
            self.coordinator.topic_deleted(topic.name)

    def _storage_failed(self, topic: Topic, kind: str) -> None:
        """A write or fsync of ``topic``'s log failed here (any thread): a replicated
        topic this node leads is handed over (``Replica.storage_failed``, on its loop)."""
        r = self.replicas.get(topic.name)
        if r is not None and r.topic is topic and r.role == LEADER and not topic.deleted:
            owner_loop(topic.owner).call_soon_threadsafe(r.storage_failed, kind)

    def _tick(self, loop: EventLoop) -> None:
        for r in list(self.replicas.values()):
            if r.topic.owner is loop:
                try:
                    r.tick()
                except Exception:
                    log.exception("CLUSTER: %s: tick failed", r.name)
        if not self.runtime.broker.exiting:
            loop.call_later(TICK_NS, self._tick, loop)

    # -- the Publisher's hooks ---------------------------------------------------------
    def replicated(self, name: str) -> bool:
        return not is_ephemeral(name)

    def diverts(self, name: str) -> bool:
        """A publish to ``name`` must not be appended here (another node leads it, or
        no leader is known yet)."""
        if is_ephemeral(name):
            return False
        r = self._live_replica(name)
        return r is None or r.role != LEADER

    def _live_replica(self, name: str) -> Replica | None:
        """This node's replica of ``name``, unless its topic was deleted here: that one
        leads nothing any more, and the name's next incarnation gets a leader first."""
        r = self.replicas.get(name)
        return None if r is None or r.topic.deleted else r

    def refusal(self, name: str) -> str | None:
        """Why a publish to a topic led here must fail now, or None."""
        r = self.replicas.get(name)
        if r is None or is_ephemeral(name):
            return None
        return r.refusal()

    def divert(self, loop: Loop, name: str, payload: Payload, defer_ns: int, done: Done,
               deadline_ns: int = 0) -> None:
        """On ``loop``: forward the publish to the topic's leader (answered with its
        answer), or publish it here once this node leads, or wait for a leader; a
        leader that went away before answering is replaced by the next one. All within
        DIVERT_WAIT_NS of the publish's arrival, then it fails."""
        now = time.monotonic_ns()
        deadline_ns = deadline_ns or now + DIVERT_WAIT_NS
        r = self._live_replica(name)
        leader = self.leaders.get(name, -1) if r is None else r.leader
        if r is not None and r.role == LEADER:
            loop.publisher.submit(name, payload, defer_ns, done)
            return
        if leader >= 0 and leader != self.id and leader in self.nodes:
            def forwarded(err: Exception | None) -> None:
                if isinstance(err, ForwardError) and err.lost \
                        and time.monotonic_ns() + FORWARD_RETRY_NS < deadline_ns:
                    # the leader is gone (or not reachable): the next one takes it
                    loop.call_later(FORWARD_RETRY_NS, self.divert, loop, name, payload,
                                    defer_ns, done, deadline_ns)
                else:
                    done(err)

            self.forwarders.forward(owner_loop(loop), leader, name, payload, defer_ns,
                                    forwarded)
            return
        if now >= deadline_ns:
            done(NotLeader(f"no leader of {name} is known"))
            return
        if r is None and self.coordinator is not None:
            self.coordinator.poll_soon()
        loop.call_later(RETRY_NS, self.divert, loop, name, payload, defer_ns, done,
                        deadline_ns)

    def await_replicas(self, topic: Topic, end: int, done: Done) -> bool:
        """On the topic's owner loop, after its write: False when the topic is not
        replicated (answer at once); else done(None or error) runs later."""
        r = self.replicas.get(topic.name)
        if r is None or r.topic is not topic:
            if not self.replicated(topic.name):
                return False
            # none yet, or the replica of an incarnation deleted since (this topic is
            # the name made again): nothing may be acknowledged for it yet
            done(NotLeader(f"{topic.name} has no replica state yet"))
            return True
        r.await_replicas(end, done)
        return True

    # -- the handlers' and registrar's hooks --------------------------------------------
    def sub_refusal(self, name: str) -> str | None:
        """Why a SUB to ``name`` is refused here (this node does not lead it), or None.
        A topic the cluster does not know yet may be subscribed to anywhere: that node
        creates it and is its first replica (if another wins its election, the
        consumer is closed and looks again)."""
        if is_ephemeral(name):
            return None
        r = self.replicas.get(name)
        if r is not None and r.role == LEADER:
            return None
        if r is None and name not in self.assigned and name not in self.leaders:
            return None
        leader = self.leaders.get(name, -1) if r is None else r.leader
        if leader < 0 or leader == self.id:
            return (f"topic {name} has no leader now (an election is under way); "
                    "subscribe again shortly")
        reg = self.nodes.get(leader)
        return (f"topic {name} is led by node {leader} ({reg['tcp'] if reg else '?'}); "
                "subscribe there (nsqlookupd lists the leader)")

    def leader_http(self, name: str) -> str | None:
        """Where an HTTP action that changes ``name``'s topic or channels (pause, empty,
        a channel made or deleted, its config, a rewind, a commit) must go: None, here
        (this node leads it, or the topic is not replicated, or not known yet); the
        leader's HTTP address; or "" while it has no leader (an election)."""
        if is_ephemeral(name):
            return None
        r = self._live_replica(name)
        if r is not None and r.role == LEADER:
            return None
        if r is None and name not in self.assigned and name not in self.leaders:
            return None
        leader = self.leaders.get(name, -1) if r is None else r.leader
        reg = self.nodes.get(leader) if leader >= 0 and leader != self.id else None
        return reg["http"] if reg is not None and reg["http"] else ""

    def sub_after_takeover(self, name: str, then: Callable[[bool], None]) -> bool:
        """(any loop) True if this node leads ``name`` but its channels are still being
        built (pybroker.cluster.takeover): ``then(led)`` is called on the topic's owner
        loop once they are in place (True), or once the leadership went first (False)."""
        r = self.replicas.get(name)
        if r is None or r.role != LEADER or not r.taking_over:
            return False
        owner_loop(r.topic.owner).call_soon_threadsafe(r.after_takeover, then)
        return True

    def registers(self, name: str) -> bool:
        """Whether this node registers ``name`` with nsqlookupd (the leader only)."""
        if is_ephemeral(name):
            return True
        r = self.replicas.get(name)
        return r is not None and r.role == LEADER

    def roles_changed(self) -> None:
        lk = self.runtime.lookupd
        if lk is not None:
            lk.notify()
        if self.coordinator is not None:
            self.coordinator.assign_fetchers()

    # -- its report (/stats, /metrics) -------------------------------------------------
    def add_stats(self, doc: dict[str, object]) -> None:
        from pybroker.cluster.report import add_stats
        add_stats(self, doc)

    def metrics_text(self) -> bytes:
        from pybroker.cluster.report import metrics_text
        return metrics_text(self)

    # -- for the replicas (ports.ReplicaHost) and the parts (nodeport.NodePort) --------
    def change_isr(self, asker: IsrAsker, epoch: int, isr: list[int]) -> None:
        assert self.coordinator is not None
        self.coordinator.change_isr(asker, epoch, isr)

    def resign(self, asker: IsrAsker, epoch: int, others: list[int]) -> None:
        assert self.coordinator is not None
        self.coordinator.resign(asker, epoch, others)

    def save_history(self, name: str, inc: int, entries: list[list[int]]) -> None:
        if self.coordinator is not None:
            self.coordinator.save_history(name, inc, entries)

    def wake_fetches(self, name: str) -> None:
        if self.server is not None:
            self.server.notify(name)

    def sync_follower(self, topic: Topic, done: Callable[[], None]) -> bool:
        """On topic's owner loop, in fsync mode: a follower appended records to topic.
        fsync them here and say True when this loop serves nobody but replication and
        the node's fsyncs are fast (pybroker.cluster.syncs); else hand the fsync to the
        storage thread, which calls done() (False)."""
        storage = self.runtime.storage
        syncs = self.syncs
        clock = syncs.clock
        loop = owner_loop(topic.owner)
        if syncs.inline_on() and not loop.connections \
                and not (self.server is not None and self.server.serves(loop)):
            t0 = clock()
            storage.sync_now(topic)
            syncs.took_inline(clock() - t0)
            return True
        t0 = clock()

        def synced(_topics: list[Topic]) -> None:       # (the storage thread)
            syncs.took_handed(clock() - t0)
            done()

        storage.sync_topics([topic], synced)
        return False

    def assign_fetchers(self, by_leader: dict[int, list[Replica]],
                        addresses: dict[int, str]) -> None:
        if self.fetchers is not None:
            self.fetchers.assign(by_leader, addresses)

    # -- stats --------------------------------------------------------------------------
    def stats(self, name: str) -> ReplicaStats | None:
        r = self.replicas.get(name)
        return r.stats() if r is not None else None

    def summary(self) -> NodeSummary:
        # the coordinator's count of etcd failures, read from another thread (a racy
        # but safe read of two numbers)
        o = self.coordinator.outage if self.coordinator is not None else None
        since = o.since_ns if o is not None else 0
        return {"node_id": self.id, "lease_valid": self.lease.valid(time.monotonic_ns()),
                "live_nodes": sorted(self.live),
                "replication_address": self.server.address if self.server else "",
                "follower_syncs": self.syncs.counts(),
                "leaderships_handed_over": self.handovers,
                "etcd_errors": o.total if o is not None else 0,
                "etcd_failing_s": round((time.monotonic_ns() - since) / 1e9, 1)
                if since else 0.0}



def _boot_dir(data_path: str) -> str:
    return os.path.join(os.path.abspath(data_path or "."), "cluster")

__all__ = ["ClusterNode"]
