"""The pure rules of replication: in-sync replicas, the high watermark, leader epochs,
truncation and the lease deadline (docs/replication.md). No I/O, no clock: time is an
argument. The coordinator, the replica state on the loops and the tests all use these.

Theory of operation
-------------------
- A topic's log has one leader per *leader epoch* (a number etcd hands out: every
  election takes the next one). ``EpochHistory`` lists ``(epoch, start offset)``: the
  records from ``start`` on (until the next entry) were appended by the leader of
  ``epoch`` (Kafka's leader-epoch cache, KIP-101).
- The leader tracks what each follower holds (``acked``: the offset a fetch asks for
  next is what the follower has, in fsync mode what it has synced). The **high
  watermark** is the lowest offset held by every member of the in-sync set (ISR, as
  stored in etcd, the leader included). A publish is acknowledged when the high
  watermark passes its last record and the ISR has at least ``min_insync`` members.
- A follower leaves the ISR when it has not been caught up for ``lag_ns``; it comes back
  when it holds everything up to the high watermark and the start of the current epoch.
  Both changes are written to etcd before the leader counts with them.
- A replica that follows a new leader asks it where its last epoch ends
  (``end_for_epoch``) and cuts its log there (``divergence``): the records past it
  were never acknowledged (an acknowledged record is on every ISR member, and leaders
  come from the ISR).
- ``LeaseClock``: a leader acknowledges only until ``sent + ttl - margin``, with ``sent``
  the monotonic time its last successful lease renewal was *sent* (etcd counts the TTL
  from when it handled it, later), so it stops before etcd can let the lease expire and
  another replica be elected.
"""
from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class EpochHistory:
    """``(epoch, start)`` entries, epochs and starts ascending."""

    __slots__ = ("entries",)

    def __init__(self, entries: list[tuple[int, int]] | None = None) -> None:
        self.entries: list[tuple[int, int]] = [(int(e), int(s)) for e, s in entries or []]

    def __repr__(self) -> str:
        return f"EpochHistory({self.entries})"

    def last_epoch(self) -> int:
        return self.entries[-1][0] if self.entries else 0

    def mark(self) -> list[int]:
        """What a fetch says of the history it holds: its length and last entry (a
        leader sends its own only when its mark differs)."""
        return [len(self.entries), *self.entries[-1]] if self.entries else [0]

    def begin(self, epoch: int, start: int) -> None:
        """The leader of ``epoch`` appends from ``start`` on (entries that start later
        are dropped: their records are gone)."""
        if self.entries and epoch <= self.entries[-1][0]:
            if epoch == self.entries[-1][0]:
                return
            raise ValueError(f"epoch {epoch} is older than {self.entries[-1][0]}")
        self.truncate(start)
        if self.entries and self.entries[-1][1] == start:
            self.entries.pop()      # the epoch before appended nothing
        self.entries.append((epoch, start))

    def truncate(self, end: int) -> None:
        """The log was cut at ``end``: epochs starting after it are gone."""
        while self.entries and self.entries[-1][1] > end:
            self.entries.pop()

    def end_for_epoch(self, epoch: int, log_end: int) -> tuple[int, int]:
        """(e, end): e the largest epoch here <= ``epoch``, end where e's records end
        in this log (the next epoch's start, or ``log_end``). (0, 0) when every epoch
        here is newer (the asker's records all diverge). Kafka's OffsetsForLeaderEpoch."""
        keys = [e for e, _ in self.entries]
        i = bisect.bisect_right(keys, epoch) - 1
        if i < 0:
            return 0, 0
        e = self.entries[i][0]
        end = self.entries[i + 1][1] if i + 1 < len(self.entries) else log_end
        return e, end

    def adopt(self, leader: "EpochHistory", log_end: int) -> None:
        """A follower whose log is a prefix of its leader's (after ``divergence``) takes
        the leader's entries that start within it."""
        self.entries = [(e, s) for e, s in leader.entries if s <= log_end]

    def to_list(self) -> list[list[int]]:
        return [[e, s] for e, s in self.entries]


def divergence(mine: EpochHistory, my_end: int, leader: EpochHistory,
               leader_end: int) -> int:
    """Where a follower cuts its log, given the leader's whole epoch history and log
    end: the first offset at which the two logs' epochs differ (records at the same
    offset written in the same epoch are the same record: one leader per epoch, and it
    only appends), else the shorter log's end. Exact where Kafka's single
    OffsetsForLeaderEpoch answer (KIP-101) is not: a follower that lacks the epoch the
    leader names may differ before it (KIP-279 asks again; here both histories are
    small and sent whole)."""
    end = min(my_end, leader_end)
    bounds = sorted({s for _, s in mine.entries} | {s for _, s in leader.entries} | {0})
    for b in bounds:
        if b >= end:
            break
        if _epoch_at(mine, b) != _epoch_at(leader, b):
            return b
    return end


def _epoch_at(h: EpochHistory, offset: int) -> int:
    """The epoch whose leader wrote ``offset`` (0: before every entry)."""
    e = 0
    for epoch, start in h.entries:
        if start > offset:
            break
        e = epoch
    return e


class Follower:
    """What the leader knows of one follower."""

    __slots__ = ("acked", "caught_up_ns", "last_end", "fetched_ns", "connected")

    def __init__(self, now_ns: int) -> None:
        self.acked = 0            # offsets below are on the follower
        self.caught_up_ns = now_ns   # the last time it held all the leader had sent
        self.last_end = 0         # the leader's end when it last answered this follower
        self.fetched_ns = now_ns
        # what it holds was told on a connection still open: after a close (the node
        # may have restarted with less, an empty disk even) only a new fetch tells
        self.connected = True


class Waiter(Generic[T]):
    """Publishes waiting for the high watermark, by the offset they need it to reach."""

    __slots__ = ("_q",)

    def __init__(self) -> None:
        self._q: deque[tuple[int, T]] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def add(self, end: int, item: T) -> None:
        """``end``: one past the publish's last offset (ends arrive in order)."""
        self._q.append((end, item))

    def ready(self, hw: int) -> list[T]:
        """The items whose end the high watermark has reached, oldest first."""
        out: list[T] = []
        q = self._q
        while q and q[0][0] <= hw:
            out.append(q.popleft()[1])
        return out

    def all(self) -> list[T]:
        out = [item for _, item in self._q]
        self._q.clear()
        return out


class LeaderState:
    """The ISR and high watermark of one topic this node leads (its owner loop)."""

    def __init__(self, me: int, epoch: int, isr: set[int], min_insync: int, lag_ns: int,
                 hw: int, epoch_start: int, now_ns: int, max_insync: int = 0) -> None:
        self.me = me
        self.epoch = epoch
        self.isr = frozenset(isr | {me})
        self.min_insync = min_insync
        self.max_insync = max_insync      # the most members the set keeps (0: no cap)
        self.lag_ns = lag_ns
        self.hw = hw
        self.epoch_start = epoch_start
        self.followers: dict[int, Follower] = {}
        self.now_ns = now_ns
        # members an in-sync change asked for adds (written to etcd first): counted by
        # the high watermark until the answer comes (``asking``)
        self.adding: frozenset[int] = frozenset()

    def fetched(self, node: int, acked: int, leader_end: int, now_ns: int) -> bool:
        """A fetch from ``node`` holding ``acked``; the leader's log ends at leader_end
        (offsets past it are not believed: a follower never holds more). True when
        what it holds changed (the high watermark may move)."""
        f = self.followers.get(node)
        if f is None:
            f = self.followers[node] = Follower(now_ns)
            was = -1                  # first heard of: whatever it holds is news
        else:
            was = f.acked
        f.acked = min(acked, leader_end)
        f.fetched_ns = now_ns
        f.connected = True
        if f.acked >= f.last_end:
            f.caught_up_ns = now_ns
        return f.acked != was

    def answered(self, node: int, leader_end: int) -> None:
        """The leader answered ``node``'s fetch with everything up to leader_end."""
        f = self.followers.get(node)
        if f is not None:
            f.last_end = leader_end

    def disconnected(self, node: int) -> None:
        """``node``'s replication connection closed: what it said it holds is not
        believed for an in-sync add (``caught_up``) until it fetches again (a node back
        with an empty disk would otherwise be added on its old word)."""
        f = self.followers.get(node)
        if f is not None:
            f.connected = False

    def enough(self) -> bool:
        return len(self.isr) >= self.min_insync

    def asking(self, new: Iterable[int]) -> None:
        """A change of the in-sync set to ``new`` was asked for. etcd is written
        first, so a member it adds may be elected before this leader hears the answer:
        from now on the high watermark waits for it too, so that what it passes that
        member holds (Kafka's "maximal ISR", KIP-497). A member it drops keeps counting
        until the answer: the set only shrinks once etcd says so."""
        self.adding = frozenset(new) - self.isr

    def isr_written(self, isr: Iterable[int] | None) -> None:
        """The answer: the set etcd now holds, or None (refused)."""
        if isr is not None:
            self.isr = frozenset(isr) | {self.me}
        self.adding = frozenset()

    def high_watermark(self, own: int) -> int:
        """The lowest offset every ISR member holds (``own``: the leader's, synced in
        fsync mode), and every member an in-sync change is adding (``asking``); it
        never goes back."""
        low = own
        for node in self.isr | self.adding if self.adding else self.isr:
            if node == self.me:
                continue
            f = self.followers.get(node)
            low = min(low, f.acked if f is not None else 0)
        if low > self.hw:
            self.hw = low
        return self.hw

    def lagging(self, now_ns: int, live: set[int] | None = None) -> set[int]:
        """ISR members to drop: not caught up for lag_ns, or gone from the cluster."""
        out = set()
        for node in self.isr:
            if node == self.me:
                continue
            f = self.followers.get(node)
            last = f.caught_up_ns if f is not None else self.now_ns
            if now_ns - last > self.lag_ns or live is not None and node not in live:
                out.add(node)
        return out

    def caught_up(self, replicas: list[int], now_ns: int,
                  live: set[int] | None = None) -> set[int]:
        """Followers outside the ISR that may join it: live, caught up within lag_ns
        (so that one just dropped for lagging does not come straight back), and holding
        everything up to the high watermark and the start of this epoch."""
        need = max(self.hw, self.epoch_start)
        return {n for n, f in self.followers.items()
                if n not in self.isr and n in replicas and f.connected and f.acked >= need
                and now_ns - f.caught_up_ns <= self.lag_ns
                and (live is None or n in live)}

    def isr_change(self, replicas: list[int], now_ns: int,
                   live: set[int] | None = None) -> set[int] | None:
        """The in-sync set to ask for, or None when it stays as it is: lagging members
        out, caught-up followers in while the set has room (``max_insync``; 0: every
        one). A set over the cap (an older one from etcd, or the cap just set) gives up
        the members holding least, once each has fetched from this leader (else a
        member not heard from yet, alive, could go before a dead one, which only
        leaves as lagging). Who is a member never decides what an OK promises:
        every member holds what was acknowledged, and only members are elected, so
        the cap changes how many copies an OK waits for, never the rules."""
        keep = set(self.isr) - self.lagging(now_ns, live)
        add = self.caught_up(replicas, now_ns, live)
        if self.max_insync:
            def held(n: int) -> tuple[int, int]:      # (every n ranked has fetched)
                return (self.followers[n].acked, -n)
            room = self.max_insync - len(keep)
            if room < 0:
                others = [n for n in keep if n != self.me]
                if all(n in self.followers for n in others):
                    keep.difference_update(sorted(others, key=held)[:-room])
                add = set()
            else:
                add = set(sorted(add, key=held, reverse=True)[:room])
        new = keep | add
        return new if new != self.isr else None

    def lag(self, own_end: int) -> dict[int, int]:
        """Messages each follower is behind the leader's log end."""
        return {n: max(0, own_end - f.acked) for n, f in self.followers.items()}


class LeaseClock:
    """When a leader must stop acknowledging (monotonic ns of its own clock)."""

    __slots__ = ("ttl_ns", "margin_ns", "valid_until")

    def __init__(self, ttl_ns: int, margin_ns: int | None = None) -> None:
        self.ttl_ns = ttl_ns
        self.margin_ns = margin_ns if margin_ns is not None else max(ttl_ns // 5, 100_000_000)
        self.valid_until = 0

    def renewed(self, sent_ns: int) -> None:
        """A renewal sent at ``sent_ns`` succeeded."""
        self.valid_until = max(self.valid_until, sent_ns + self.ttl_ns - self.margin_ns)

    def lost(self) -> None:
        self.valid_until = 0

    def valid(self, now_ns: int) -> bool:
        return now_ns < self.valid_until


def assign_replicas(creator: int, live: list[int], factor: int) -> list[int]:
    """The replicas of a new topic: its creator, then the next live nodes by id."""
    others = sorted(n for n in set(live) if n != creator)
    after = [n for n in others if n > creator] + [n for n in others if n < creator]
    return [creator] + after[:max(0, factor - 1)]


__all__ = ["EpochHistory", "Follower", "LeaderState", "LeaseClock", "Waiter",
           "assign_replicas", "divergence"]
