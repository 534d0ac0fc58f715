"""A fetch request as the leader's replication server keeps it (pybroker.cluster.serve):
its JSON checked once, when read, into typed fields; a compact fetch
(pybroker.cluster.wire.COMPACT_FETCH) renews its offsets and it is served again, so the
steady state reads no JSON and checks nothing twice.

Budgets: ``wait_ms`` is capped at MAX_WAIT_MS, ``max_bytes`` at MAX_FETCH_BYTES; the
number of topics is checked by the reader (wire.MAX_TOPICS) before one is made.
"""
from __future__ import annotations

from pybroker.cluster.ports import Json, JsonObj, need_int, need_str

MAX_FETCH_BYTES = 8 * 1024 * 1024
MAX_WAIT_MS = 5000


class Want:
    """One topic of a fetch (checked when its JSON was read)."""

    __slots__ = ("name", "epoch", "offset", "version", "hist")

    def __init__(self, t: JsonObj) -> None:
        self.name = need_str(t.get("name"))
        self.epoch = need_int(t.get("epoch"))
        self.offset = need_int(t.get("offset"))
        if self.offset < 0:
            raise ValueError(f"offset {self.offset} asked")
        self.version = need_int(t.get("version", 0))
        self.hist: Json = t.get("hist")   # its history's mark (EpochHistory.mark)


class Fetch:
    """A fetch request, checked once, when its JSON was read; a compact fetch renews
    its offsets (``renew``) and it is served again."""

    __slots__ = ("wait_ms", "max_bytes", "wants", "names", "compact", "parts")

    def __init__(self, req: JsonObj, topics: list[JsonObj]) -> None:
        self.wait_ms = min(need_int(req.get("wait_ms", 0)), MAX_WAIT_MS)
        self.max_bytes = min(need_int(req.get("max_bytes", MAX_FETCH_BYTES)),
                             MAX_FETCH_BYTES)
        self.wants = [Want(t) for t in topics]
        self.names = frozenset(w.name for w in self.wants)
        # the follower takes channel states in parts (pybroker.cluster.states)
        self.parts = req.get("parts") == 1
        self.compact = False     # this time it came compact (then so may its answer)

    def renew(self, wait_ms: int, max_bytes: int, offsets: list[int]) -> None:
        """The same fetch again, compact (wire.COMPACT_FETCH), with these values."""
        self.compact = True
        self.wait_ms = min(wait_ms, MAX_WAIT_MS)
        self.max_bytes = min(max_bytes, MAX_FETCH_BYTES)
        for w, offset in zip(self.wants, offsets):
            w.offset = offset


__all__ = ["MAX_FETCH_BYTES", "MAX_WAIT_MS", "Fetch", "Want"]
