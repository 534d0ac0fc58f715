"""Replicated topics (docs/replication.md): membership, leadership and in-sync sets in
etcd, followers fetching the leader's log by offset, publishes answered once the
in-sync replicas hold them. Imported only when ``cluster_etcd`` is set."""
