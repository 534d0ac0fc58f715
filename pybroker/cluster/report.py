"""The cluster's figures for /stats (extra keys) and /metrics (Prometheus text).

/stats: each replicated topic gets a ``replication`` object (role, leader, epoch,
in-sync set ``isr``, ``high_watermark``, and on the leader ``lag`` per follower in
messages and bytes); the document gets ``cluster`` (this node's id, whether its lease
is valid, the live nodes, where its follower fsyncs ran, how many leaderships it
handed over because its log failed). /metrics: ``nsq_cluster_*``
families. Read on the HTTP thread from the replicas' fields (each written by one
owner; a racy but safe read).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pybroker.cluster.nodeport import NodePort

_ROLE = {"leader": 2, "follower": 1, "none": 0}


def add_stats(node: NodePort, doc: dict[str, object]) -> None:
    """Add the cluster's keys to a /stats JSON document (in place)."""
    topics = doc.get("topics")
    for t in topics if isinstance(topics, list) else []:
        if not isinstance(t, dict):
            continue
        extra = node.stats(str(t.get("topic_name", "")))
        if extra is not None:
            t["replication"] = extra
    doc["cluster"] = node.summary()


def metrics_text(node: NodePort) -> bytes:
    """The ``nsq_cluster_*`` families."""
    lines = [
        "# HELP nsq_cluster_role Role of this node per replicated topic "
        "(2 leader, 1 follower, 0 none).",
        "# TYPE nsq_cluster_role gauge",
    ]
    stats = {name: r.stats() for name, r in list(node.replicas.items())}
    for name, s in sorted(stats.items()):
        lines.append(f'nsq_cluster_role{{topic="{name}"}} {_ROLE.get(s["role"], 0)}')
    lines += ["# HELP nsq_cluster_leader_epoch Leader epoch of each replicated topic.",
              "# TYPE nsq_cluster_leader_epoch gauge"]
    for name, s in sorted(stats.items()):
        lines.append(f'nsq_cluster_leader_epoch{{topic="{name}"}} {s["epoch"]}')
    lines += ["# HELP nsq_cluster_insync_replicas Members of the in-sync set.",
              "# TYPE nsq_cluster_insync_replicas gauge"]
    for name, s in sorted(stats.items()):
        lines.append(f'nsq_cluster_insync_replicas{{topic="{name}"}} {len(s["isr"])}')
    lines += ["# HELP nsq_cluster_high_watermark Offset below which every in-sync "
              "replica holds the log.", "# TYPE nsq_cluster_high_watermark gauge"]
    for name, s in sorted(stats.items()):
        lines.append(f'nsq_cluster_high_watermark{{topic="{name}"}} {s["high_watermark"]}')
    for unit in ("messages", "bytes"):
        lines += [f"# HELP nsq_cluster_replica_lag_{unit} How far each follower is behind "
                  f"the leader ({unit}; on the leader).",
                  f"# TYPE nsq_cluster_replica_lag_{unit} gauge"]
        for name, s in sorted(stats.items()):
            for follower, lag in sorted(s.get("lag", {}).items()):
                lines.append(f'nsq_cluster_replica_lag_{unit}{{topic="{name}",'
                             f'follower="{follower}"}} {lag[unit]}')
    summary = node.summary()
    lines += ["# HELP nsq_cluster_lease_valid 1 while this node's etcd lease is valid "
              "by its own clock.", "# TYPE nsq_cluster_lease_valid gauge",
              f"nsq_cluster_lease_valid {int(summary['lease_valid'])}"]
    syncs = summary["follower_syncs"]
    lines += ["# HELP nsq_cluster_follower_syncs_total A follower's fsyncs (fsync mode), "
              "by where they ran: its loop (inline) or the storage thread (handed).",
              "# TYPE nsq_cluster_follower_syncs_total counter",
              f'nsq_cluster_follower_syncs_total{{where="inline"}} {syncs["inline"]}',
              f'nsq_cluster_follower_syncs_total{{where="handed"}} {syncs["handed"]}',
              "# HELP nsq_cluster_follower_slow_syncs_total Inline fsyncs over 20 ms (each "
              "sent the next ones to the storage thread).",
              "# TYPE nsq_cluster_follower_slow_syncs_total counter",
              f"nsq_cluster_follower_slow_syncs_total {syncs['slow']}",
              "# HELP nsq_cluster_follower_inline_syncs 1 while a follower's next fsync may "
              "run on its loop.", "# TYPE nsq_cluster_follower_inline_syncs gauge",
              f"nsq_cluster_follower_inline_syncs {int(syncs['inline_on'])}",
              "# HELP nsq_cluster_leaderships_handed_over_total Topics this node stopped "
              "leading because a write or fsync of their log failed here.",
              "# TYPE nsq_cluster_leaderships_handed_over_total counter",
              "nsq_cluster_leaderships_handed_over_total "
              f"{summary['leaderships_handed_over']}",
              "# HELP nsq_cluster_etcd_errors_total etcd calls that failed (unreachable, "
              "an error or no answer in time).",
              "# TYPE nsq_cluster_etcd_errors_total counter",
              f"nsq_cluster_etcd_errors_total {summary['etcd_errors']}",
              "# HELP nsq_cluster_etcd_failing_seconds How long etcd has been failing "
              "(0 while it works).", "# TYPE nsq_cluster_etcd_failing_seconds gauge",
              f"nsq_cluster_etcd_failing_seconds {summary['etcd_failing_s']}"]
    return ("\n".join(lines) + "\n").encode()


__all__ = ["add_stats", "metrics_text"]
