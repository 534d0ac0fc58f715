"""The cluster package's low seams: the JSON shapes it reads (from etcd, from a peer on
the replication connection) with the helpers that narrow them, and ``ReplicaHost``,
what a Replica asks of its node.

The direction of the package: rules, wire, etcd and this module at the bottom; the
Replica (``replica.py``) on them; the node's parts (coordinator, fetchers, replication
server, forwarders, report) on the Replica and ``nodeport.NodePort``; ``node.py``,
which builds the parts, on top. Nothing imports node.py but the Runtime.

JSON read from outside is never trusted: ``need_*`` raise ValueError (a peer's request
or answer that is malformed drops its connection), ``as_*`` fall back to a default
(etcd's documents, written by pybroker, read leniently as before).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NotRequired, Protocol, TypedDict, Union

if TYPE_CHECKING:
    from pybroker.cluster.rules import LeaseClock
    from pybroker.core.topic import Topic
    from pybroker.server.services import ClusterHost

Json = Union[dict[str, "Json"], list["Json"], str, int, float, bool, None]
JsonObj = dict[str, Json]
Done = Callable[[Union[Exception, None]], None]   # a publish's answer: None is OK


def as_obj(v: Json) -> JsonObj:
    return v if isinstance(v, dict) else {}


def as_list(v: Json) -> list[Json]:
    return v if isinstance(v, list) else []


def as_int(v: Json, default: int = 0) -> int:
    if isinstance(v, int):
        return int(v)
    if isinstance(v, (str, float)):
        try:
            return int(v)
        except (ValueError, OverflowError):
            return default
    return default


def as_ints(v: Json) -> list[int]:
    return [as_int(x) for x in as_list(v)]


def as_str(v: Json, default: str = "") -> str:
    return v if isinstance(v, str) else default


def need_int(v: Json) -> int:
    """An integer a peer must send (ValueError otherwise)."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"expected an integer, not {v!r:.40}")
    return v


def need_str(v: Json) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string, not {v!r:.40}")
    return v


def need_obj(v: Json) -> JsonObj:
    if not isinstance(v, dict):
        raise ValueError(f"expected an object, not {v!r:.40}")
    return v


def need_objs(v: Json) -> list[JsonObj]:
    if not isinstance(v, list):
        raise ValueError(f"expected a list, not {v!r:.40}")
    return [need_obj(x) for x in v]


class Registration(TypedDict):
    """A node's key in etcd (``nodes/<id>``): its addresses."""

    id: int
    tcp: str
    http: str
    repl: str


def registration(doc: Json) -> Registration | None:
    """A node's registration read from etcd (None: not one)."""
    if not isinstance(doc, dict):
        return None
    return Registration(id=as_int(doc.get("id"), -1), tcp=as_str(doc.get("tcp")),
                        http=as_str(doc.get("http")), repl=as_str(doc.get("repl")))


class TopicState(TypedDict):
    """A topic's ``state/<name>`` in etcd: its leader epoch, leader and in-sync set."""

    epoch: int
    leader: int
    isr: list[int]


def topic_state(doc: Json) -> TopicState:
    d = as_obj(doc)
    return TopicState(epoch=as_int(d.get("epoch")), leader=as_int(d.get("leader"), -1),
                      isr=as_ints(d.get("isr")))


class LeaderKey(TypedDict):
    """A topic's ``leader/<name>`` in etcd (held on the leader's lease)."""

    node: int
    epoch: int


def leader_key(doc: Json) -> LeaderKey:
    d = as_obj(doc)
    return LeaderKey(node=as_int(d.get("node"), -1), epoch=as_int(d.get("epoch")))


class ReplicaStats(TypedDict):
    """A replicated topic's extra /stats keys (``replication``)."""

    role: str
    leader: int
    epoch: int
    isr: list[int]
    high_watermark: int
    log_end: int
    channel_states: int            # the version of the channel states held
    states_shipped_bytes: int      # bytes of channel states this node shipped as leader
    lag: NotRequired[dict[str, dict[str, int]]]   # the leader's: per follower
    taking_over: NotRequired[bool]  # a new leader building its channels (takeover.py)



class IsrAsker(Protocol):
    """A leader's replica asking for an in-sync change, or handing its leadership over
    (answered on its topic's loop)."""

    name: str
    topic: Topic

    def isr_changed(self, epoch: int, isr: list[int] | None) -> None: ...
    def resigned(self, epoch: int, ok: bool) -> None: ...


class ReplicaHost(Protocol):
    """What a Replica asks of its node (pybroker.cluster.node.ClusterNode)."""

    id: int
    min_insync: int
    max_insync: int                 # the most in-sync replicas a topic keeps (0: all)
    lag_ns: int                     # not caught up this long: out of the in-sync set
    ship_ns: int                    # channel states are snapshot this often
    durable: bool                   # fsync mode: a follower acknowledges synced records
    live: set[int]                  # nodes registered in etcd
    assigned: dict[str, list[int]]  # topic -> its replicas (etcd's view)
    lease: LeaseClock
    lease_id: int                   # the etcd lease of the node's current session
    runtime: ClusterHost

    def save_history(self, name: str, inc: int, entries: list[list[int]]) -> None: ...
    def roles_changed(self) -> None: ...
    def wake_fetches(self, name: str) -> None: ...
    def sync_follower(self, topic: Topic, done: Callable[[], None]) -> bool: ...
    def change_isr(self, asker: IsrAsker, epoch: int, isr: list[int]) -> None: ...
    def resign(self, asker: IsrAsker, epoch: int, others: list[int]) -> None: ...


# How a leader's refusals and failures say that it does not lead the topic (any more):
# not the leader, its lease expired, its leadership lost or handed over. A node that
# forwarded the publish (pybroker.cluster.forward) sends it again to the next leader,
# as it does when the leader goes away, instead of failing its producer.
NOT_LEADER = "not the leader of"
LEASE_EXPIRED = "cluster lease expired"
LEADERSHIP_LOST = "leadership lost"
HANDED_OVER = "leadership handed over"


def leadership_moved(text: str) -> bool:
    """Does a leader's error text say it does not lead the topic (any more)?"""
    return any(m in text for m in (NOT_LEADER, LEASE_EXPIRED, LEADERSHIP_LOST,
                                   HANDED_OVER))


__all__ = ["Done", "HANDED_OVER", "IsrAsker", "LEADERSHIP_LOST", "LEASE_EXPIRED",
           "NOT_LEADER", "leadership_moved", "Json", "JsonObj", "LeaderKey", "Registration",
           "ReplicaHost", "ReplicaStats", "TopicState", "as_int", "as_ints", "as_list", "as_obj", "as_str",
           "leader_key", "need_int", "need_obj", "need_objs", "need_str", "registration",
           "topic_state"]
