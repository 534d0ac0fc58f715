"""nsqd's stats document: topic, channel and client dicts with nsqd's field names, types
and units (stats.go, client_v2.go), and the end-to-end latency window behind
``e2e_processing_latency``.

Domain only: no I/O, no clock (``now_ns`` is an argument), no threads. The caller decides
where each function runs: ``client_stats`` reads state owned by a connection's event loop
and must run on that loop (so do core.snapshot's channel and topic snapshots);
``e2e_result`` and ``document`` only assemble what those returned.
"""
from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Protocol

from pybroker.core.statsdoc import (ClientAuthPubs, ClientBase, ClientStats, ClientTls, E2eResult,
                                    PubCount, StatsDocument, TopicStats)

# one half of a latency window as (exact count, sampled values)
LatencyPart = tuple[int, list[int]]


class LatencyWindow:
    """End-to-end processing latency (publish to FIN) over a sliding window.

    Like nsqd's quantile.Quantile: two halves of ``window_ns / 2`` each; inserts go to
    the current half, queries see both, and the older half is dropped as time moves on.
    nsqd keeps a targeted CKMS stream per half; here each half keeps an exact count and
    a uniform reservoir of at most ``RESERVOIR`` samples, weighted by count at query time.

    Owner: the event loop that owns the channel (it inserts on FIN and snapshots for
    stats); not locked.
    """

    RESERVOIR = 2048

    def __init__(self, window_ns: int, now_ns: int) -> None:
        self.half_ns = max(1, window_ns // 2)
        self.moved_ns = now_ns
        self.counts = [0, 0]
        self.samples: list[list[int]] = [[], []]
        self.current = 0

    def _advance(self, now_ns: int) -> None:
        if now_ns - self.moved_ns > 2 * self.half_ns:
            # idle for longer than the window: both halves are stale
            self.counts = [0, 0]
            self.samples = [[], []]
            self.moved_ns = now_ns
            return
        while now_ns > self.moved_ns + self.half_ns:
            self.current ^= 1
            self.counts[self.current] = 0
            self.samples[self.current] = []
            self.moved_ns += self.half_ns

    def insert(self, latency_ns: int, now_ns: int) -> None:
        self._advance(now_ns)
        i = self.current
        self.counts[i] += 1
        bucket = self.samples[i]
        if len(bucket) < self.RESERVOIR:
            bucket.append(latency_ns)
        else:
            j = random.randrange(self.counts[i])
            if j < self.RESERVOIR:
                bucket[j] = latency_ns

    def snapshot(self, now_ns: int) -> list[LatencyPart]:
        """Copies of both halves, for ``e2e_result`` (safe to hand to another thread)."""
        self._advance(now_ns)
        return [(self.counts[i], list(self.samples[i])) for i in (0, 1) if self.counts[i]]


def quantiles(parts: Iterable[LatencyPart], percentiles: Sequence[float]) -> list[int]:
    """Weighted quantiles over sampled halves (each sample stands for count/len values)."""
    weighted: list[tuple[int, float]] = []
    for count, values in parts:
        if values:
            w = count / len(values)
            weighted.extend((v, w) for v in values)
    if not weighted:
        return [0 for _ in percentiles]
    weighted.sort()
    total = sum(w for _, w in weighted)
    out = []
    for p in percentiles:
        target = p * total
        acc = 0.0
        pick = weighted[-1][0]
        for v, w in weighted:
            acc += w
            if acc >= target:
                pick = v
                break
        out.append(pick)
    return out


def e2e_result(percentiles: Sequence[float], parts: list[LatencyPart] | None) -> E2eResult:
    """nsqd's quantile.Result: ``{"count": N, "percentiles": [{"quantile", "value"}]}``.

    ``parts`` is None where nsqd has no stream (e2e not configured, or a topic without
    channels): then ``percentiles`` is null and the count 0, exactly as nsqd prints it.
    """
    if not percentiles or parts is None:
        return {"count": 0, "percentiles": None}
    values = quantiles(parts, percentiles)
    return {"count": sum(c for c, _ in parts),
            "percentiles": [{"quantile": p, "value": v} for p, v in zip(percentiles, values)]}


# -- clients ----------------------------------------------------------------------------
class StatsClient(Protocol):
    """What a client connection exposes for stats (implemented by server.ClientConn)."""

    id: int
    client_id: str
    hostname: str
    user_agent: str
    remote_address: str
    rdy: int
    in_flight_count: int
    message_count: int
    finish_count: int
    requeue_count: int
    connect_ts: int
    sample_rate: int
    pub_counts: dict[str, int]

    @property
    def state(self) -> int: ...


def client_stats(c: StatsClient, topic_filter: str = "") -> ClientStats:
    """nsqd's ClientV2Stats (run on the connection's loop).

    ``pub_counts`` is left out when empty (nsqd's omitempty), and holds only
    ``topic_filter`` when one is given. nsqd 1.3.0 lists just one topic otherwise (a
    ``break`` in clientV2.Stats); every topic is listed here, sorted by name.
    """
    t = getattr(c, "transport", None)
    base: ClientBase = {
        "client_id": c.client_id,
        "hostname": c.hostname,
        "version": "V2",
        "remote_address": c.remote_address,
        "state": int(c.state),
        "ready_count": c.rdy,
        "in_flight_count": c.in_flight_count,
        "message_count": c.message_count,
        "finish_count": c.finish_count,
        "requeue_count": c.requeue_count,
        "connect_ts": c.connect_ts,
        "sample_rate": c.sample_rate,
        "deflate": bool(getattr(t, "deflate", False)),
        "snappy": bool(getattr(t, "snappy", False)),
        "user_agent": c.user_agent,
    }
    d: ClientAuthPubs = {}
    auth = getattr(c, "auth_state", None)
    if auth is not None and auth.authorizations:
        # matches nsqd: authed, auth_identity and auth_identity_url are omitempty
        d["authed"] = True
        if auth.identity:
            d["auth_identity"] = auth.identity
        if auth.identity_url:
            d["auth_identity_url"] = auth.identity_url
    pubs = c.pub_counts
    if pubs:
        names = [topic_filter] if topic_filter else sorted(pubs)
        counts: list[PubCount] = [{"topic": n, "count": pubs[n]} for n in names if n in pubs]
        if counts:
            d["pub_counts"] = counts
    tls: ClientTls = {"tls": False, "tls_cipher_suite": "", "tls_version": "",
                      "tls_negotiated_protocol": "", "tls_negotiated_protocol_is_mutual": False}
    tls_stats = getattr(t, "tls_stats", None)
    if tls_stats:
        tls.update(tls_stats)
        if getattr(t, "common_name", ""):  # not in nsqd 1.3.0's /stats: the client certificate's name
            tls["tls_client_cert_common_name"] = t.common_name  # type: ignore[union-attr]
    return {**base, **d, **tls}


def producer_stats(conns: Iterable[StatsClient], topic_filter: str = "") -> list[ClientStats]:
    """Clients that have published (nsqd's typeProducer), in connection order."""
    return [client_stats(c, topic_filter)
            for c in sorted((c for c in conns if c.pub_counts), key=lambda c: c.id)]


def document(version: str, health: str, start_time: int, topics: list[TopicStats] | None,
             memory: dict[str, int] | None,
             producers: list[ClientStats] | None, codec: str = "",
             refused: dict[str, int] | None = None) -> StatsDocument:
    """The /stats?format=json body; ``memory`` is left out when None (omitempty).
    ``codec`` and ``refused`` (connections refused by the descriptor reserve or
    max_connections, per listener) are pybroker additions."""
    doc: StatsDocument
    if memory is None:
        doc = {"version": version, "health": health, "start_time": start_time,
               "topics": topics, "producers": producers}
    else:   # nsqd's order: memory before producers
        doc = {"version": version, "health": health, "start_time": start_time,
               "topics": topics, "memory": memory, "producers": producers}
    if codec:
        doc["codec"] = codec
    if refused is not None:
        doc["refused_connections"] = refused
    return doc
