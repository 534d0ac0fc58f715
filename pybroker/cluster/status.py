"""``pybroker cluster status``: the replicated topics of a cluster, their leaders,
leader epochs, in-sync sets and each follower's lag, read from etcd (what the cluster
agreed) and from each leader's /stats (the lag only the leader knows).

Budgets: one etcd range read (pybroker.cluster.etcd: a deadline for the whole call, the
answer capped at its MAX_RESPONSE); one GET /stats per node, each with ``timeout_s``
for the whole exchange and at most MAX_STATS bytes read; a node that does not answer
is shown as such, never waited for beyond that.
"""
from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from typing import TypedDict

import typer

from pybroker.cluster.coordinator import ROOT
from pybroker.cluster.etcd import Etcd, EtcdError
from pybroker.cluster.ports import (JsonObj, LeaderKey, TopicState, as_int, as_ints, as_list,
                                    as_obj, as_str, leader_key, registration, topic_state)

MAX_STATS = 8 * 1024 * 1024


class NodeRow(TypedDict):
    """A node as ``--json`` prints it: its registration, and whether /stats answered."""

    id: int
    tcp: str
    http: str
    repl: str
    answered: bool


class TopicRow(TypedDict):
    replicas: list[int]
    leader: int | None
    epoch: int
    isr: list[int]
    lag: dict[str, dict[str, int]]     # the leader's: follower -> messages, bytes
    log_end: dict[str, int]            # node -> its log's end


class ClusterDoc(TypedDict):
    nodes: dict[str, NodeRow]
    topics: dict[str, TopicRow]


def read_cluster(etcd_url: str, timeout_s: float = 3.0) -> ClusterDoc:
    """The nodes and the replicated topics, from etcd and the nodes' /stats.
    Raises EtcdError (or ValueError for a bad URL)."""
    _, kvs = Etcd(etcd_url, timeout_s=timeout_s).get_prefix(ROOT)
    nodes: dict[int, NodeRow] = {}
    replicas: dict[str, list[int]] = {}
    states: dict[str, TopicState] = {}
    leaders: dict[str, LeaderKey] = {}
    for kv in kvs:
        kind, _, name = kv.key[len(ROOT):].partition("/")
        doc = kv.json()
        if not isinstance(doc, dict):
            continue
        reg = registration(doc)
        if kind == "nodes" and name.isdigit() and reg is not None:
            nodes[int(name)] = NodeRow(id=reg["id"], tcp=reg["tcp"], http=reg["http"],
                                       repl=reg["repl"], answered=False)
        elif kind == "topics":
            replicas[name] = as_ints(doc.get("replicas"))
        elif kind == "state":
            states[name] = topic_state(doc)
        elif kind == "leader":
            leaders[name] = leader_key(doc)
    lags: dict[str, dict[str, dict[str, int]]] = {}
    ends: dict[str, dict[str, int]] = {}
    for nid, row in nodes.items():
        stats = _stats(row["http"], timeout_s)
        row["answered"] = stats is not None
        for t in as_list((stats or {}).get("topics")):
            t = as_obj(t)
            name = as_str(t.get("topic_name"))
            rep = as_obj(t.get("replication"))
            if rep.get("role") == "leader":
                lags[name] = {str(k): {u: as_int(n) for u, n in as_obj(v).items()}
                              for k, v in as_obj(rep.get("lag")).items()}
            if "log_end" in rep:
                ends.setdefault(name, {})[str(nid)] = as_int(rep["log_end"])
    out: dict[str, TopicRow] = {}
    for name in sorted(set(replicas) | set(states) | set(leaders) | set(ends)):
        state = states.get(name, topic_state(None))
        lead = leaders.get(name)
        out[name] = TopicRow(replicas=replicas.get(name, []),
                             leader=lead["node"] if lead else None,
                             epoch=state["epoch"], isr=state["isr"],
                             lag=lags.get(name, {}), log_end=ends.get(name, {}))
    return ClusterDoc(nodes={str(k): v for k, v in sorted(nodes.items())}, topics=out)


def _stats(http: str, timeout_s: float) -> JsonObj | None:
    if not http:
        return None
    url = f"http://{http}/stats?" + urllib.parse.urlencode({"format": "json"})
    deadline = time.monotonic() + timeout_s
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            body = bytearray()
            while len(body) <= MAX_STATS and time.monotonic() < deadline:
                chunk = r.read1(65536)
                if not chunk:
                    break
                body += chunk
            if len(body) > MAX_STATS or time.monotonic() >= deadline:
                return None
        doc: object = json.loads(body)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def render(doc: ClusterDoc) -> str:
    lines = ["NODE  TCP                    HTTP                   ANSWERED"]
    for nid, reg in doc["nodes"].items():
        lines.append(f"{nid:<5} {reg['tcp'] or '?':<22} {reg['http'] or '?':<22} "
                     f"{'yes' if reg['answered'] else 'no'}")
    lines.append("")
    lines.append("TOPIC                LEADER EPOCH IN-SYNC    REPLICAS   LAG (messages)")
    for name, t in doc["topics"].items():
        leader = "-" if t["leader"] is None else str(t["leader"])
        isr = ",".join(str(n) for n in t["isr"]) or "-"
        reps = ",".join(str(n) for n in t["replicas"]) or "-"
        lag = " ".join(f"{n}:{v.get('messages', '?')}" for n, v in sorted(t["lag"].items()))
        lines.append(f"{name:<20} {leader:<6} {t['epoch']:<5} {isr:<10} {reps:<10} "
                     f"{lag or '-'}")
    return "\n".join(lines)


cluster_app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                          help="Replicated topics (docs/replication.md).")


@cluster_app.command("status")
def status_command(
    cluster_etcd: str = typer.Option("http://127.0.0.1:2379", "--cluster-etcd",
                                     help="etcd endpoint the cluster's nodes use"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
    timeout: float = typer.Option(3.0, "--timeout", min=0.1, max=60,
                                  help="seconds for etcd and for each node's /stats"),
) -> None:
    """Print the nodes, and each replicated topic's leader, epoch, in-sync set and lag."""
    try:
        doc = read_cluster(cluster_etcd, timeout)
    except (EtcdError, ValueError) as e:
        typer.echo(f"FATAL: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps(doc, indent=2) if as_json else render(doc))


def register(app: typer.Typer) -> None:
    app.add_typer(cluster_app, name="cluster")


__all__ = ["read_cluster", "register", "render"]
