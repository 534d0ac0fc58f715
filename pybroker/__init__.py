"""pybroker: a message broker that speaks NSQ's protocols (TCP V2, HTTP API, nsqlookupd)."""

__version__ = "0.1.0"
# The version reported to clients (IDENTIFY, /info, /stats). nsqadmin and nsq_stat parse it
# as semver and compare it with nsqd's feature versions, so it must not run ahead of 1.3.0.
NSQ_COMPAT_VERSION = "1.3.0"
