"""The shape of nsqd's /stats JSON document as pybroker builds it: one TypedDict per
level (document, topic, channel, client, latency result), with nsqd's field names and
Go's types, and pybroker's extra keys marked as such.

core.stats and core.snapshot build these; http/ renders them (JSON, the text format,
/metrics, statsd). Fields nsqd leaves out when empty (``omitempty``) are NotRequired.

Annotations are evaluated here (no ``from __future__ import annotations``), so that
NotRequired is seen at run time too (``__required_keys__``).
"""
from typing import Literal, NotRequired, TypedDict


class E2eQuantile(TypedDict):
    quantile: float
    value: int


class E2eResult(TypedDict):
    """nsqd's quantile.Result; ``percentiles`` is null where nsqd has no stream."""

    count: int
    percentiles: list[E2eQuantile] | None


class PubCount(TypedDict):
    topic: str
    count: int


class ClientBase(TypedDict):
    """nsqd's ClientV2Stats up to ``user_agent``."""

    client_id: str
    hostname: str
    version: str
    remote_address: str
    state: int
    ready_count: int
    in_flight_count: int
    message_count: int
    finish_count: int
    requeue_count: int
    connect_ts: int
    sample_rate: int
    deflate: bool
    snappy: bool
    user_agent: str


class ClientAuthPubs(TypedDict, total=False):
    """ClientV2Stats' omitempty fields between ``user_agent`` and ``tls``."""

    authed: bool
    auth_identity: str
    auth_identity_url: str
    pub_counts: list[PubCount]


class ClientTls(TypedDict):
    """ClientV2Stats' TLS fields (tlsio's description of the session)."""

    tls: bool
    tls_cipher_suite: str
    tls_version: str
    tls_negotiated_protocol: str
    tls_negotiated_protocol_is_mutual: bool
    # pybroker's: the client certificate's common name
    tls_client_cert_common_name: NotRequired[str]


class ClientStats(ClientBase, ClientAuthPubs, ClientTls):
    """nsqd's ClientV2Stats, in nsqd's key order."""


class ChannelCounts(TypedDict):
    """nsqd's ChannelStats without its latency result (read on the owner loop)."""

    channel_name: str
    depth: int
    backend_depth: int
    in_flight_count: int
    deferred_count: int
    message_count: int
    requeue_count: int
    timeout_count: int
    client_count: int
    clients: list[ClientStats] | None
    paused: bool


class ChannelExtras(TypedDict):
    """pybroker's keys of a channel, after nsqd's."""

    cursor: int
    max_attempts: int
    dead_letter_topic: str
    dead_letter_count: int
    dead_letter_pending: int
    dead_letter_cycles: int


class ChannelStats(ChannelCounts, ChannelExtras):
    """A channel of /stats: nsqd's keys, its latency result, then pybroker's keys."""

    e2e_processing_latency: E2eResult


class TopicStats(TypedDict):
    """nsqd's TopicStats, plus pybroker's log figures."""

    topic_name: str
    channels: list[ChannelStats]
    depth: int
    backend_depth: int
    message_count: int
    message_bytes: int
    paused: bool
    e2e_processing_latency: E2eResult
    oldest_offset: int
    newest_offset: int
    log_bytes_read: int


class StatsDocument(TypedDict):
    """The /stats?format=json body; ``codec`` and ``refused_connections`` are pybroker's."""

    version: str
    health: str
    start_time: int
    topics: list[TopicStats] | None
    memory: NotRequired[dict[str, int]]   # nsqd's memStats (include_mem)
    producers: list[ClientStats] | None
    codec: NotRequired[str]
    refused_connections: NotRequired[dict[str, int]]


# the numeric and boolean keys of a topic and of a channel (for /metrics and statsd)
TopicFigure = Literal["depth", "backend_depth", "message_count", "message_bytes", "paused",
                      "log_bytes_read"]
ChannelFigure = Literal["depth", "backend_depth", "in_flight_count", "deferred_count",
                        "message_count", "requeue_count", "timeout_count", "client_count",
                        "paused", "dead_letter_count", "dead_letter_cycles"]
