"""NodePort: what the node's parts (the coordinator, the fetchers, the replication
server, the forwarders, the report) ask of the ClusterNode (pybroker.cluster.node).

They depend on this Protocol, never on node.py: node.py builds them and passes itself.
Each field says who writes it; the others only read it (a racy but safe read of a
reference that is replaced whole).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypedDict

from pybroker.cluster.ports import Registration, ReplicaHost, ReplicaStats
from pybroker.cluster.syncs import SyncCounts

if TYPE_CHECKING:
    from pybroker.cluster.replica import Replica
    from pybroker.config import Options
    from pybroker.core.topic import Topic


class NodeSummary(TypedDict):
    """This node's part of /stats (``cluster``)."""

    node_id: int
    lease_valid: bool
    live_nodes: list[int]
    replication_address: str
    follower_syncs: SyncCounts        # where its follower fsyncs ran (fsync mode)
    leaderships_handed_over: int      # topics it gave up leading: its log failed here
    etcd_errors: int                  # failed etcd calls since start-up
    etcd_failing_s: float             # how long etcd has been failing (0: it works)


class NodePort(ReplicaHost, Protocol):
    options: Options
    factor: int                           # the replication factor
    nodes: dict[int, Registration]        # live nodes (the coordinator's thread)
    leaders: dict[str, int]               # topic -> leader id (etcd's view; coordinator)
    replicas: dict[str, Replica]          # this node's replicas (the coordinator adds)
    handovers: int                        # leaderships given up (the coordinator counts)
    restored: dict[str, Topic]            # the topics read from the data path at start-up
    same_boot: bool                       # memory mode: False after a machine restart

    def assign_fetchers(self, by_leader: dict[int, list[Replica]],
                        addresses: dict[int, str]) -> None:
        """The coordinator's thread: which replicas follow which leader now."""

    def diverts(self, name: str) -> bool:
        """A publish to ``name`` must not be appended here (any thread)."""

    def stats(self, name: str) -> ReplicaStats | None:
        """A replicated topic's /stats keys (any thread)."""

    def summary(self) -> NodeSummary:
        """This node's part of /stats (any thread)."""


__all__ = ["NodePort", "NodeSummary"]
