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
from typing import Any

import typer

from pybroker.cluster.coordinator import ROOT
from pybroker.cluster.etcd import Etcd, EtcdError

MAX_STATS = 8 * 1024 * 1024


def read_cluster(etcd_url: str, timeout_s: float = 3.0) -> dict[str, Any]:
    """{"nodes": {id: registration}, "topics": {name: {...}}} from etcd and the leaders.
    Raises EtcdError (or ValueError for a bad URL)."""
    _, kvs = Etcd(etcd_url, timeout_s=timeout_s).get_prefix(ROOT)
    nodes: dict[int, dict[str, Any]] = {}
    topics: dict[str, dict[str, Any]] = {}
    for kv in kvs:
        kind, _, name = kv.key[len(ROOT):].partition("/")
        doc = kv.json()
        if not isinstance(doc, dict):
            continue
        if kind == "nodes" and name.isdigit():
            nodes[int(name)] = doc
        elif kind in ("topics", "state", "leader"):
            topics.setdefault(name, {})[kind] = doc
    lags: dict[str, dict[str, Any]] = {}
    for nid, reg in nodes.items():
        doc = _stats(str(reg.get("http", "")), timeout_s)
        reg["answered"] = doc is not None
        for t in (doc or {}).get("topics") or []:
            rep = t.get("replication") or {}
            if rep.get("role") == "leader":
                lags[t["topic_name"]] = rep.get("lag", {})
            if "log_end" in rep:
                topics.setdefault(t["topic_name"], {}).setdefault("log_end", {})[
                    str(nid)] = rep["log_end"]
    out: dict[str, dict[str, Any]] = {}
    for name, parts in sorted(topics.items()):
        state = parts.get("state", {})
        lead = parts.get("leader")
        out[name] = {"replicas": parts.get("topics", {}).get("replicas", []),
                     "leader": lead.get("node") if lead else None,
                     "epoch": state.get("epoch", 0), "isr": state.get("isr", []),
                     "lag": lags.get(name, {}), "log_end": parts.get("log_end", {})}
    return {"nodes": {str(k): v for k, v in sorted(nodes.items())}, "topics": out}


def _stats(http: str, timeout_s: float) -> dict[str, Any] | None:
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
        doc = json.loads(body)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def render(doc: dict[str, Any]) -> str:
    lines = ["NODE  TCP                    HTTP                   ANSWERED"]
    for nid, reg in doc["nodes"].items():
        lines.append(f"{nid:<5} {reg.get('tcp', '?'):<22} {reg.get('http', '?'):<22} "
                     f"{'yes' if reg.get('answered') else 'no'}")
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
