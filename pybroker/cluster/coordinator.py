"""Coordinator: this node's dealings with etcd, on its own thread (``cluster``).

Keys under ``/pybroker/``:
- ``nodes/<id>``: this node's addresses, on this node's lease (membership);
- ``topics/<name>``: ``{"replicas": [ids], "inc": n}``, written once by the node that
  first had the topic (assign_replicas: it and the next live nodes by id); ``inc``
  names this incarnation of the name (random; 0 in records of earlier versions);
- ``deleted/<name>``: ``{"inc": n}``: incarnation n was deleted (``/topic/delete`` on any
  node): every node deletes its copy of n, and a topic of that name made later is a new
  incarnation (registering it removes this tombstone);
- ``state/<name>``: ``{"epoch", "leader", "isr"}``: the leader epoch and the in-sync set;
- ``leader/<name>``: ``{"node", "epoch"}`` on the leader's lease (the lease is the
  leadership: when it expires the key goes and an in-sync replica may take the next
  epoch, in one transaction that also checks the state it read).

The lease is renewed every ttl/3 on a thread of its own (pybroker.cluster.lease:
``LeaseClock`` counts from when the renewal was sent; nothing this thread does can delay
it). This thread reads the whole prefix every ``POLL_NS`` (and at once when a topic appears
here), and then: deletes local copies of deleted or replaced incarnations, registers
topics new here, creates the local topics etcd lists with this node as a replica,
campaigns where there is no leader and this node is in sync, and posts each replica's
role to its topic's owner loop. Each replica's incarnation is kept in
``<data_path>/cluster/<name>.inc`` (beside its epoch history), so a node that was down
when a topic was deleted, or deleted and made again, drops its old copy on return. An in-sync change asked by a
leader is a transaction that holds only while this node's leader key (and lease) does.
Every etcd call has a deadline (pybroker.cluster.etcd); nothing here blocks a loop.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import time
from typing import TYPE_CHECKING

from pybroker.cluster.etcd import Compare, Etcd, EtcdError, delete_op, put_op
from pybroker.cluster.lease import LeaseKeeper
from pybroker.cluster.outage import Outage
from pybroker.cluster.ports import (IsrAsker, LeaderKey, Registration, TopicState,
                                    as_int, as_ints, as_obj, leader_key, registration,
                                    topic_state)
from pybroker.cluster.replica import FOLLOWER, LEADER, NONE, Replica
from pybroker.cluster.rules import EpochHistory, assign_replicas
from pybroker.errors import TopicNotFound
from pybroker.evloop import SelectorLoop
from pybroker.protocol.names import is_ephemeral
from pybroker.server.services import owner_loop

if TYPE_CHECKING:
    from pybroker.cluster.nodeport import NodePort
    from pybroker.core.topic import Topic

log = logging.getLogger("pybroker")
ROOT = "/pybroker/"
POLL_NS = 200_000_000
ASSIGN_NS = 300_000_000     # in a longer pass, fetchers are assigned this often



REGISTER_TRIES = 3     # registrations tried in one join while another's keeps vanishing


def register_node(etcd: Etcd, node_id: int, value: str, lease: int) -> int:
    """Register ``node_id`` under ``lease``; returns the registration's create revision
    (which tells the topics made before this process joined from those made after).

    The key may be held by this node's previous run until that lease expires. It can
    expire between the failed transaction and the read that names its holder: then the
    transaction is tried again, never taken for a registration (a node that counted
    itself joined at revision 0 would vouch for copies it never held: a leader back
    with an empty disk would be elected). Raises EtcdError while another holds it (the
    new ``lease`` revoked), and on etcd's errors.
    """
    key = f"{ROOT}nodes/{node_id}"
    for _ in range(REGISTER_TRIES):
        if etcd.txn([Compare(key, "CREATE", 0)], [put_op(key, value, lease)]):
            break
        found = etcd.get(key)
        if found is None:
            continue                        # it expired just now: register again
        if found.lease != lease:
            etcd.revoke(lease)
            raise EtcdError(f"node id {node_id} is registered by another process "
                            f"({found.value}); waiting for it to go")
        break
    mine = etcd.get(key)
    if mine is None or mine.lease != lease:
        etcd.revoke(lease)
        raise EtcdError(f"node id {node_id}: its registration did not hold; joining again")
    return mine.create_revision

class Coordinator(SelectorLoop):
    def __init__(self, node: NodePort, tcp: str, http: str, repl: str) -> None:
        super().__init__("cluster")
        self.node = node
        o = node.options
        self.etcd = Etcd(o.cluster_etcd, timeout_s=max(0.5, o.cluster_lease_ttl / 3e9))
        # etcd's failures, logged without a flood while it is away (pybroker.cluster.outage)
        self.outage = Outage("etcd", log)
        self.ttl_s = max(1, int(o.cluster_lease_ttl // 1_000_000_000))
        # the lease, renewed on a thread of its own (pybroker.cluster.lease)
        self.keeper = LeaseKeeper(Etcd(o.cluster_etcd, timeout_s=self.etcd.timeout_s),
                                  self.ttl_s * 1_000_000_000 // 3, node.lease,
                                  self.call_soon_threadsafe, self.outage.failed,
                                  self.outage.ok, self._lease_lost)
        self.me = {"id": node.id, "tcp": tcp, "http": http, "repl": repl}
        self.dir = os.path.join(os.path.abspath(o.data_path or "."), "cluster")
        self.lease_id = 0
        self._polling = False
        self._poll_timer: object = None
        self._posted: dict[str, tuple[str, int, int, tuple[int, ...]]] = {}
        self._leader_values: dict[str, str] = {}
        self._state: dict[str, tuple[TopicState, int]] = {}     # name -> (state, mod)
        self._leader_kv: dict[str, tuple[LeaderKey, int]] = {}  # name -> (value, lease)
        self._records: dict[str, tuple[int, str]] = {}   # name -> (inc, raw value)
        self._tombs: dict[str, int] = {}      # name -> the incarnation deleted
        self._dropping: set[str] = set()      # local copies this thread deletes now
        self._deleting: set[str] = set()      # deleted here, not yet in etcd (any thread)
        # the incarnation each local topic belongs to, by topic object: a topic made
        # after a delete is a new object, so it never inherits its name's old incarnation
        self._incs: dict[Topic, int] = {}
        # replicas created here without a copy of their records it can vouch for: never
        # elected, and out of the in-sync set until caught up (``_leave_isr``)
        # name -> True when its copy was on disk but the machine restarted since
        # (memory mode: its unsynced tail may be gone, pybroker.cluster.boot): as the
        # in-sync set's last member such a copy is what is left, and may be elected
        self._unvouched: dict[str, bool] = {}
        self._joined_rev = 0        # etcd's revision when this process first joined
        self._created: dict[str, int] = {}    # name -> its topic record's revision
        self._warned: set[tuple[str, int]] = set()

    # -- any thread ---------------------------------------------------------------------
    def start(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        super().start()
        self.keeper.start()
        self.call_soon_threadsafe(self._begin)
        self.node.runtime.broker.on_change.append(self.poll_soon)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.keeper.stop(timeout_s)      # no renewal after the revoke below
        self.call_soon_threadsafe(self._end)
        SelectorLoop.stop(self)
        if self.thread is not None:
            self.thread.join(timeout_s)
        self.close()

    def poll_soon(self) -> None:
        if not self._polling:
            self._polling = True
            self.call_soon_threadsafe(self._poll)

    def change_isr(self, r: IsrAsker, epoch: int, isr: list[int]) -> None:
        self.call_soon_threadsafe(self._change_isr, r, epoch, isr)

    def resign(self, r: IsrAsker, epoch: int, others: list[int]) -> None:
        self.call_soon_threadsafe(self._resign, r, epoch, others)

    def save_history(self, name: str, inc: int, entries: list[list[int]]) -> None:
        self.call_soon_threadsafe(self._save_history, name, inc, entries)

    def assign_fetchers(self) -> None:
        self.call_soon_threadsafe(self._assign_fetchers)

    def topic_deleted(self, name: str) -> None:
        """A replicated topic was deleted here (``/topic/delete``, any thread): delete
        its incarnation in the cluster, unless this thread is the one dropping it."""
        if name not in self._dropping:
            self._deleting.add(name)      # before the next poll can adopt a new copy
            self.call_soon_threadsafe(self._delete_cluster_topic, name)

    # -- the session ------------------------------------------------------------------
    def _begin(self) -> None:
        try:
            self._new_session()
        except EtcdError as e:
            self.outage.failed(e)
            self.call_later(500_000_000, self._begin)
            return
        self.outage.ok()
        self._poll()

    def _new_session(self) -> None:
        path = os.path.join(self.dir, "lease")
        try:
            with open(path) as f:
                old = int(f.read().strip() or 0)
        except (OSError, ValueError):
            old = 0
        if old:
            # this node's previous run: its leadership and membership end now, not at
            # the lease's expiry (a restarted node rejoins at once)
            self.etcd.revoke(old)
        sent = time.monotonic_ns()
        self.lease_id = self.etcd.grant(self.ttl_s)
        # leaderships held on an earlier lease end here, whatever the clock says: a
        # replica acknowledges only under the lease its leadership was taken with
        self.node.lease_id = self.lease_id
        created = register_node(self.etcd, self.node.id, json.dumps(self.me), self.lease_id)
        if not self._joined_rev:
            self._joined_rev = created
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(self.lease_id))
        os.replace(tmp, path)
        self.keeper.begin(self.lease_id, sent)    # renewed from now on, on its thread
        log.info("CLUSTER: node %d joined (lease %x, ttl %ds)", self.node.id,
                 self.lease_id, self.ttl_s)

    def _lease_lost(self, lease: int) -> None:
        """The keeper found ``lease`` expired (posted from its thread): every leadership
        on it is gone; join again on a new one. The keeper holds the last session's
        lease until a new one has begun (``begin``, at the end of ``_new_session``), so
        while joining fails, even after a grant, it reports the old one again and this
        tries again."""
        with self.keeper.lock:
            current = self.keeper.lease_id
        if lease != current:
            return                    # a session begun since
        log.error("CLUSTER: the lease expired: leaderships lost; joining again")
        self.node.lease.lost()
        self._posted.clear()
        try:
            self._new_session()
        except EtcdError as e:
            self.outage.failed(e)
        self._poll()

    def _end(self) -> None:
        if self.lease_id:
            # leaderships end now rather than at expiry: failover without waiting
            self.node.lease.lost()
            self.etcd.revoke(self.lease_id)
            try:
                os.unlink(os.path.join(self.dir, "lease"))
            except OSError:
                pass

    # -- polling ----------------------------------------------------------------------
    def _poll(self) -> None:
        self._polling = False
        self.cancel(self._poll_timer)
        self._poll_timer = self.call_later(POLL_NS, self._poll)
        if not self.lease_id:
            return
        try:
            _, kvs = self.etcd.get_prefix(ROOT)
        except EtcdError as e:
            self.outage.failed(e)
            return
        self.outage.ok()
        nodes: dict[int, Registration] = {}
        topics: dict[str, list[int]] = {}
        self._state = {}
        self._leader_kv = {}
        self._records = {}
        self._created = {}
        self._tombs = {}
        for kv in kvs:
            kind, _, name = kv.key[len(ROOT):].partition("/")
            doc = kv.json()
            if not isinstance(doc, dict):
                continue
            if kind == "nodes":
                reg = registration(doc)
                if reg is not None and name.isdigit():
                    nodes[int(name)] = reg
            elif kind == "topics":
                topics[name] = as_ints(doc.get("replicas"))
                self._created[name] = kv.create_revision
                self._records[name] = (as_int(doc.get("inc")), kv.value)
            elif kind == "deleted":
                self._tombs[name] = as_int(doc.get("inc"))
            elif kind == "state":
                self._state[name] = (topic_state(doc), kv.mod_revision)
            elif kind == "leader":
                self._leader_kv[name] = (leader_key(doc), kv.lease)
        node = self.node
        node.nodes = nodes
        node.live = set(nodes)
        node.assigned = topics
        node.leaders = {name: doc["node"] for name, (doc, _) in self._leader_kv.items()}
        try:
            self._reconcile(topics)
        except EtcdError as e:
            self.outage.failed(e)

    def _reconcile(self, topics: dict[str, list[int]]) -> None:
        node = self.node
        broker = node.runtime.broker
        me = node.id
        changed = False
        assigned_ns = time.monotonic_ns()
        for t in [t for t in self._incs if t.deleted]:
            del self._incs[t]
        # replicas of incarnations etcd no longer lists: deleted (their tombstone), or
        # deleted here and not registered again
        for name in [n for n in node.replicas if n not in topics]:
            gone = node.replicas[name]
            if gone.topic.deleted or self._tombs.get(name) == gone.inc:
                self._drop_local(name)
                changed = True
        for t in broker.all_topics():
            if t.name not in topics and not is_ephemeral(t.name) and not t.deleted \
                    and t.name not in self._deleting:
                tomb = self._tombs.get(t.name)
                if tomb is not None and tomb == self._local_inc(t.name):
                    self._drop_local(t.name)     # a copy of the deleted incarnation
                    changed = True
                    continue
                topics[t.name] = self._register(t.name)
        for name, replicas in topics.items():
            if name in self._deleting:
                continue       # its delete is on its way to etcd
            inc = self._records.get(name, (0, ""))[0]
            local = self._local_inc(name)
            if local is not None and local != inc:
                # this node's copy is of an earlier incarnation, deleted since (and the
                # name made again): its records, epochs and channels are not this one's
                log.info("CLUSTER: %s: dropping the copy of deleted incarnation %x",
                         name, local)
                self._drop_local(name)
                changed = True
                local = None
            here = broker.topics.get(name)
            if local is None and here is not None and not here.deleted:
                self._adopt(here, inc)     # a copy here (replica or not) of this one
            if me not in replicas:
                continue
            r = node.replicas.get(name)
            state, mod = self._state.get(name, (topic_state(None), 0))
            if r is None or r.topic.deleted:
                try:
                    topic = broker.get_topic(name)
                except Exception:        # the broker is exiting
                    return
                r = Replica(node, topic, self._load_history(name), inc)
                node.replicas[name] = r
                self._adopt(topic, inc)
                # its copy is vouched for when it was on this node's disk (and, in
                # memory mode, the machine did not restart since), when no leader was
                # ever elected (nothing acknowledged yet), or when the topic was made
                # after this process joined (every acknowledgement it counted for was
                # this copy's)
                on_disk = local is not None and local == inc \
                    and node.restored.get(name) is topic
                if state["epoch"] == 0 or (on_disk and node.same_boot) \
                        or self._created.get(name, self._joined_rev + 1) > self._joined_rev:
                    self._unvouched.pop(name, None)
                else:
                    self._unvouched[name] = on_disk
            isr = state["isr"]
            if name in self._unvouched:
                state, mod = self._leave_isr(name, state, mod)
                isr = state["isr"]
            lead = self._leader_kv.get(name)
            # a topic that never had a leader is campaigned for by its first replica
            # (the node that made it) while that node is live: one transaction a new
            # topic, not one from each replica, two of them bound to fail
            first = replicas[0] if replicas else me
            if lead is None and mod and me in isr and name not in self._unvouched \
                    and (state["epoch"] > 0 or first == me or first not in node.live):
                lead = self._campaign(name, state, mod, isr)
                state, _ = self._state.get(name, (state, mod))
                isr = state["isr"]
            if lead is None:
                role, epoch, leader = NONE, state["epoch"], -1
            else:
                doc, lease = lead
                leader, epoch = doc["node"], doc["epoch"]
                role = LEADER if leader == me and lease == self.lease_id else FOLLOWER
                if leader == me and role != LEADER:
                    role, leader = NONE, -1      # an earlier run's key, about to expire
            key = (role, epoch, leader, tuple(isr))
            if self._posted.get(name) != key:
                self._posted[name] = key
                owner_loop(r.topic.owner).call_soon_threadsafe(r.set_role, role, epoch, leader, isr,
                                                   self.lease_id)
                changed = True
                if time.monotonic_ns() - assigned_ns > ASSIGN_NS:
                    # a long pass (many topics made at once: about 5 ms of etcd each):
                    # the followers posted so far begin fetching now, not at its end,
                    # before their leaders count them as lagging
                    self._assign_fetchers()
                    assigned_ns = time.monotonic_ns()
        if changed:
            self._assign_fetchers()

    def _leave_isr(self, name: str, state: TopicState, mod: int) -> tuple[TopicState, int]:
        """This node has no copy of ``name``'s records it can vouch for (its data
        path was lost or replaced: no copy of this incarnation was on its disk, and a
        leader was elected before, so publishes may have been acknowledged), yet etcd may
        still count it in sync: a node killed and back with an empty disk before its
        leader dropped it, or a leader back before an in-sync follower was elected.
        Elected, it would lead with an empty log and its followers would cut theirs to
        match: every acknowledged record gone. So it never campaigns while unvouched,
        and takes itself out of the in-sync set (a transaction that holds only on the
        state read) unless it is its last member; once out (or not in it), it is
        vouched for as any follower is: a leader adds it back only once it has caught
        up. As the last member it stays, and the topic waits (the guarantees: a replica
        that may lack acknowledged records is never elected). A copy that was on disk
        but whose machine restarted since (memory mode, True in ``_unvouched``) leaves
        the same way; as the last member (every other left before) it is what is left,
        and may be elected, as it was before the node could tell."""
        me = self.node.id
        isr = state["isr"]
        restarted = self._unvouched.get(name, False)
        if me not in isr:
            self._unvouched.pop(name, None)
            return state, mod
        if len(isr) == 1 and restarted:
            # every other member left the set before: this copy is the newest there is
            self._unvouched.pop(name, None)
            log.warning("CLUSTER: %s: this node's machine restarted (the records it had "
                        "not synced may be lost) and it is the only in-sync replica: it "
                        "may be elected with what its disk holds", name)
            return state, mod
        if len(isr) == 1 or not mod:
            if (name, mod) not in self._warned:
                self._warned.add((name, mod))
                log.error("CLUSTER: %s: this node is its only in-sync replica but has no "
                          "copy of its records on disk: not electing it (the topic waits "
                          "for a replica that holds them)", name)
            return state, mod
        skey = f"{ROOT}state/{name}"
        new_state = TopicState(epoch=state["epoch"], leader=state["leader"],
                               isr=sorted(set(isr) - {me}))
        rev = self.etcd.txn_at([Compare(skey, "MOD", mod)],
                               [put_op(skey, json.dumps(new_state))])
        if not rev:
            return state, mod           # the state moved on: read again at the next poll
        mod = rev
        self._state[name] = (new_state, mod)
        self._unvouched.pop(name, None)
        log.warning("CLUSTER: %s: %s: left the in-sync set %s to catch up first", name,
                    "this node's machine restarted since its last run (memory mode: the "
                    "records it had not synced may be lost)" if restarted else
                    "no copy of its records on this node's disk (a new or lost data path)",
                    isr)
        return new_state, mod

    def _register(self, name: str) -> list[int]:
        """A topic new here becomes a topic of the cluster: a new incarnation (its
        tombstone, if the name was deleted before, goes in the same transaction)."""
        node = self.node
        replicas = assign_replicas(node.id, sorted(node.live | {node.id}), node.factor)
        key = f"{ROOT}topics/{name}"
        state = TopicState(epoch=0, leader=-1, isr=replicas)
        inc = secrets.randbits(62) | 1          # never 0: records of earlier versions
        value = json.dumps({"replicas": replicas, "inc": inc})
        rev = self.etcd.txn_at([Compare(key, "CREATE", 0)],
                               [put_op(key, value),
                                put_op(f"{ROOT}state/{name}", json.dumps(state)),
                                delete_op(f"{ROOT}deleted/{name}")])
        if rev:
            log.info("CLUSTER: topic %s replicated on nodes %s (incarnation %x)", name,
                     replicas, inc)
            self._tombs.pop(name, None)
            self._records[name] = (inc, value)
            # the copy here is this incarnation's first (a record lost from etcd, not
            # deleted through it: registered again with what this node holds)
            r = node.replicas.get(name)
            if r is not None and not r.topic.deleted:
                r.inc = inc
            t = node.runtime.broker.topics.get(name)
            if t is not None:
                self._adopt(t, inc)
            self._state[name] = (state, rev)
            self._created[name] = rev
            return replicas
        kv = self.etcd.get(key)
        doc = kv.json() if kv is not None else None
        if kv is not None and isinstance(doc, dict):
            st = self.etcd.get(f"{ROOT}state/{name}")
            if st is not None and isinstance(st.json(), dict):
                self._state[name] = (topic_state(st.json()), st.mod_revision)
            got = as_ints(as_obj(doc).get("replicas"))
            self._records[name] = (as_int(as_obj(doc).get("inc")), kv.value)
            return got
        return replicas

    # -- deletion ---------------------------------------------------------------------
    def _delete_cluster_topic(self, name: str) -> None:
        """The incarnation this node knew of ``name`` goes from etcd, a tombstone in its
        place, in one transaction that holds only while the record is the one read
        (a name made again meanwhile is not touched). Every node then drops its copy
        at its next poll."""
        rec = self._records.get(name)
        r = self.node.replicas.get(name)
        if rec is None or (r is not None and r.inc != rec[0]):
            # not a topic of the cluster (or not the incarnation here)
            self._deleting.discard(name)
            return
        inc, raw = rec
        key = f"{ROOT}topics/{name}"
        try:
            ok = self.etcd.txn([Compare(key, "VALUE", raw)],
                               [delete_op(key), delete_op(f"{ROOT}state/{name}"),
                                delete_op(f"{ROOT}leader/{name}"),
                                put_op(f"{ROOT}deleted/{name}", json.dumps({"inc": inc}))])
        except EtcdError as e:
            self.outage.failed(f"{name}: deleting it in the cluster failed: {e}")
            self.call_later(500_000_000, self._delete_cluster_topic, name)
            return
        if ok:
            log.info("CLUSTER: topic %s (incarnation %x) deleted in the cluster", name, inc)
            self._records.pop(name, None)
            self._tombs[name] = inc
        self._deleting.discard(name)
        self._poll()

    def _drop_local(self, name: str) -> None:
        """This node's copy of a deleted incarnation goes: the local topic (its files,
        channels and lookupd registration, as /topic/delete), its replica, its epoch
        history and incarnation files."""
        node = self.node
        r = node.replicas.pop(name, None)
        self._posted.pop(name, None)
        self._leader_values.pop(name, None)
        broker = node.runtime.broker
        topic = broker.topics.get(name)
        if topic is not None and (r is None or r.topic is topic):
            self._incs.pop(topic, None)
            self._dropping.add(name)
            try:
                broker.delete_topic(name)
            except TopicNotFound:
                pass
            finally:
                self._dropping.discard(name)
        for path in (self._history_path(name), self._inc_path(name)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.error("CLUSTER: %s: %s not removed: %s", name, path, e)
        if r is not None:
            owner_loop(r.topic.owner).call_soon_threadsafe(r.dropped)
        log.info("CLUSTER: %s: local copy dropped (deleted in the cluster)", name)

    def _campaign(self, name: str, state: TopicState, mod: int, isr: list[int]
                  ) -> tuple[LeaderKey, int] | None:
        """Take the leadership of ``name`` at the next epoch (this node is in sync)."""
        node = self.node
        epoch = state["epoch"] + 1
        new_isr = sorted((set(isr) & node.live) | {node.id})
        value = json.dumps({"node": node.id, "epoch": epoch})
        new_state = TopicState(epoch=epoch, leader=node.id, isr=new_isr)
        lkey, skey = f"{ROOT}leader/{name}", f"{ROOT}state/{name}"
        rev = self.etcd.txn_at([Compare(lkey, "CREATE", 0), Compare(skey, "MOD", mod)],
                               [put_op(lkey, value, self.lease_id),
                                put_op(skey, json.dumps(new_state))])
        if not rev:
            return None
        self._state[name] = (new_state, rev)
        self._leader_values[name] = value
        node.leaders[name] = node.id
        log.info("CLUSTER: %s: elected leader at epoch %d (in sync %s)", name, epoch,
                 new_isr)
        doc = LeaderKey(node=node.id, epoch=epoch)
        self._leader_kv[name] = (doc, self.lease_id)
        return doc, self.lease_id

    # -- requests from the loops -----------------------------------------------------
    def _still_leading(self, name: str, epoch: int) -> list[Compare]:
        """The comparisons that hold a transaction to this node's leadership of
        ``name`` at ``epoch``: its key, on this session's lease."""
        value = self._leader_values.get(name) or json.dumps(
            {"node": self.node.id, "epoch": epoch})
        lkey = f"{ROOT}leader/{name}"
        return [Compare(lkey, "VALUE", value), Compare(lkey, "LEASE", self.lease_id)]

    def _state_read(self, name: str) -> list[Compare]:
        """The comparison that holds a transaction to the state this node last read of
        ``name`` (none before it read one)."""
        mod = self._state.get(name, (None, 0))[1]
        return [Compare(f"{ROOT}state/{name}", "MOD", mod)] if mod else []

    def _change_isr(self, r: IsrAsker, epoch: int, isr: list[int]) -> None:
        node = self.node
        name = r.name
        isr = sorted(set(isr) | {node.id})
        ok = False
        skey = f"{ROOT}state/{name}"
        try:
            # and on the state this node read: a member that left meanwhile (it lost
            # its copy: ``_leave_isr``) is not written back by a leader that had not
            # heard yet
            rev = self.etcd.txn_at(
                [*self._still_leading(name, epoch), *self._state_read(name)],
                [put_op(skey, json.dumps({"epoch": epoch, "leader": node.id, "isr": isr}))])
            ok = rev > 0
            if ok:
                self._state[name] = (TopicState(epoch=epoch, leader=node.id, isr=isr), rev)
        except EtcdError as e:
            self.outage.failed(f"{name}: in-sync change not written: {e}")
        if ok:
            posted = self._posted.get(name)
            if posted is not None:
                self._posted[name] = (posted[0], posted[1], posted[2], tuple(isr))
        owner_loop(r.topic.owner).call_soon_threadsafe(r.isr_changed, epoch, isr if ok else None)

    def _resign(self, r: IsrAsker, epoch: int, others: list[int]) -> None:
        """Give up the leadership of ``r``'s topic at ``epoch`` (its log cannot be
        written here; it acknowledges nothing meanwhile): in one transaction, while the
        key is still this session's, delete the leadership key and write the in-sync set
        without this node: the members both etcd and the leader count in sync
        (``others``: they hold every acknowledged record), so one of them is elected at
        the next epoch and this node cannot campaign until it has caught up again.
        Refused when none is left, or when etcd fails (it then leads on)."""
        node = self.node
        name = r.name
        state, _ = self._state.get(name, (topic_state(None), 0))
        heirs = sorted((set(state["isr"]) & set(others)) - {node.id})
        ok = False
        if heirs and state["epoch"] == epoch:
            new_state = TopicState(epoch=epoch, leader=-1, isr=heirs)
            try:
                ok = self.etcd.txn(
                    [*self._still_leading(name, epoch), *self._state_read(name)],
                    [delete_op(f"{ROOT}leader/{name}"),
                     put_op(f"{ROOT}state/{name}", json.dumps(new_state))])
            except EtcdError as e:
                self.outage.failed(f"{name}: handing the leadership over failed: {e}")
            if ok:
                # what etcd holds now is read by the poll below; until then this
                # leadership is neither compared against nor posted again
                self._leader_values.pop(name, None)
                self._posted[name] = (NONE, epoch, -1, tuple(heirs))
                node.handovers += 1
                log.info("CLUSTER: %s: gave up the leadership at epoch %d; in sync: %s",
                         name, epoch, heirs)
        owner_loop(r.topic.owner).call_soon_threadsafe(r.resigned, epoch, ok)
        if ok:
            self.poll_soon()

    def _assign_fetchers(self) -> None:
        node = self.node
        by_leader: dict[int, list[Replica]] = {}
        for name, (role, _, leader, _) in self._posted.items():
            r = node.replicas.get(name)
            if role == FOLLOWER and r is not None and leader in node.nodes:
                by_leader.setdefault(leader, []).append(r)
        node.assign_fetchers(by_leader, {n: reg["repl"] for n, reg in node.nodes.items()})

    # -- files -------------------------------------------------------------------------
    def _history_path(self, name: str) -> str:
        return os.path.join(self.dir, f"{name}.epochs")

    def _inc_path(self, name: str) -> str:
        return os.path.join(self.dir, f"{name}.inc")

    def _local_inc(self, name: str) -> int | None:
        """The incarnation this node's copy of ``name`` belongs to (None: no copy, or
        one not known to belong to any: a topic made here since, or kept by an earlier
        version). A topic read from the data path at start-up takes its incarnation
        from its ``.inc`` file."""
        t = self.node.runtime.broker.topics.get(name)
        if t is None or t.deleted:
            return None
        inc = self._incs.get(t)
        if inc is None and self.node.restored.get(name) is t:
            try:
                with open(self._inc_path(name)) as f:
                    inc = self._incs[t] = int(f.read().strip())
            except (OSError, ValueError):
                return None
        return inc

    def _adopt(self, topic: Topic, inc: int) -> None:
        """The local ``topic`` is a copy of incarnation ``inc`` (kept on disk too)."""
        if self._incs.get(topic) != inc:
            self._incs[topic] = inc
            self._save_inc(topic.name, inc)

    def _save_inc(self, name: str, inc: int) -> None:
        # not fsynced: a crash that loses it (or leaves it empty) leaves a copy this node
        # cannot vouch for, which leaves the in-sync set and catches up (``_leave_isr``);
        # never a wrong one. With 1,000 topics made at once, a follower's fsyncs of these
        # files took long enough for its leaders to drop it from the in-sync set.
        _save(self._inc_path(name), str(inc), f"{name}: incarnation", sync=False)

    def _load_history(self, name: str) -> EpochHistory:
        try:
            with open(self._history_path(name)) as f:
                return EpochHistory([(int(e), int(s)) for e, s in json.load(f)])
        except (OSError, ValueError, TypeError):
            return EpochHistory()

    def _save_history(self, name: str, inc: int, entries: list[list[int]]) -> None:
        r = self.node.replicas.get(name)
        if r is None or r.inc != inc or r.topic.deleted:
            return      # a replica dropped since (deleted): its file went with it
        _save(self._history_path(name), json.dumps(entries), f"{name}: epoch history")


def _save(path: str, text: str, what: str, sync: bool = True) -> None:
    """Replace the file at path with text, synced (unless not ``sync``), atomically (a
    tmp file renamed); an error is logged (the coordinator's files are kept beside the
    data path)."""
    try:
        with open(path + ".tmp", "w") as f:
            f.write(text)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
    except OSError as e:
        log.error("CLUSTER: %s not saved: %s", what, e)


__all__ = ["Coordinator", "POLL_NS", "ROOT"]
