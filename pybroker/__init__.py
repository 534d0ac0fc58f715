"""pybroker: a message broker that speaks NSQ's protocols (TCP V2, HTTP API, nsqlookupd)."""

__version__ = "0.1.0"
# The version reported to clients (IDENTIFY, /info, /stats). nsqadmin and nsq_stat parse it
# as semver and compare it with nsqd's feature versions, so it must not run ahead of 1.3.0.
NSQ_COMPAT_VERSION = "1.3.0"
# What ``pybroker-nsqd --version`` prints and logs first: nsqd's own format ("nsqd v1.3.0
# (built w/go1.19.8)"), so tools and test harnesses that parse nsqd's version parse it.
DROPIN_VERSION = f"nsqd v{NSQ_COMPAT_VERSION}-compat (built w/pybroker-{__version__})"
