"""The type of every option's resolved value (config.SPECS), for the type checker.

``OptionFields`` declares one attribute per option: config.Options takes them from it,
so ``options.msg_timeout`` is an ``int`` (nanoseconds) to mypy and a misspelt option
is an error. Kinds map to types as config resolves them: durations are integers in
nanoseconds, ``tls_required`` one of config's TLS_* integers, lists are lists of
strings (the percentiles: floats). tests/unit/test_option_types.py keeps this in step
with SPECS.
"""
from __future__ import annotations

from typing import Union

# a resolved option value, as Options.values holds it
OptionValue = Union[str, int, float, bool, list[str], list[float]]


class OptionFields:
    """Annotations only: one per option, in SPECS' order."""

    id: int  # resolved: from the hostname when not given
    log_level: str
    log_prefix: str
    tcp_address: str
    http_address: str
    https_address: str
    broadcast_address: str
    broadcast_tcp_port: int
    broadcast_http_port: int
    nsqlookupd_tcp_addresses: list[str]
    data_path: str
    mem_queue_size: int
    max_bytes_per_file: int
    sync_every: int
    sync_timeout: int  # ns
    queue_scan_interval: int  # ns
    queue_scan_refresh_interval: int  # ns
    queue_scan_selection_count: int
    queue_scan_worker_pool_max: int
    queue_scan_dirty_percent: float
    msg_timeout: int  # ns
    max_msg_timeout: int  # ns
    max_msg_size: int
    max_body_size: int
    max_req_timeout: int  # ns
    client_timeout: int  # ns
    max_heartbeat_interval: int  # ns
    max_rdy_count: int
    max_output_buffer_size: int
    max_output_buffer_timeout: int  # ns
    min_output_buffer_timeout: int  # ns
    output_buffer_timeout: int  # ns
    output_buffer_size: int
    max_channel_consumers: int
    statsd_address: str
    statsd_prefix: str
    statsd_interval: int  # ns
    statsd_mem_stats: bool
    statsd_udp_packet_size: int
    statsd_exclude_ephemeral: bool
    e2e_processing_latency_window_time: int  # ns
    e2e_processing_latency_percentiles: list[float]
    deflate: bool
    max_deflate_level: int
    snappy: bool
    tls_cert: str
    tls_key: str
    tls_client_auth_policy: str
    tls_root_ca_file: str
    tls_required: int  # TLS_NOT_REQUIRED, TLS_REQUIRED_EXCEPT_HTTP or TLS_REQUIRED
    tls_min_version: str
    auth_http_addresses: list[str]
    auth_http_request_method: str
    http_client_connect_timeout: int  # ns
    http_client_request_timeout: int  # ns
    durability: str
    retention_time: int  # ns
    retention_bytes: int
    max_attempts: int
    dead_letter_topic: str
    loop_threads: int
    loop_spin: int  # ns
    loop_sender: str  # auto, on, off
    max_connections: int
    cluster_etcd: str
    cluster_address: str
    replication_factor: int
    min_insync_replicas: int
    max_insync_replicas: int
    cluster_lease_ttl: int  # ns
