"""Ledger: the streaming source's messages between their delivery and their FIN.

Theory of operation. One source run holds a Consumer whose handler never answers a
message itself: it hands it to the ledger. Spark asks for offsets; an offset is
``{"run": R, "seq": N}`` where R names this run and N counts the messages the ledger
has numbered. ``latest()`` numbers waiting messages (at most ``max_batch_size`` past
the batch start, so a batch never fills the in-flight window), ``planned()`` lists a
batch's messages, and ``commit()`` FINs every message up to an offset once Spark has
committed the batch holding it. Until then ``touch()`` keeps them alive. ``stop()``
FINs what the checkpoint proves done and REQueues the rest at once, so a stopped query
loses nothing and the next run gets them first. Offsets of another run (a restarted
query's checkpoint) name messages this process never held: nsqd redelivers those, so
their batches are planned empty.

Owned by the stream reader on the driver; the consumer's handler threads call
``add()``; everything else runs on the reader's (Spark's) thread or the touch thread.
No Spark and no socket here: messages only need ``finish/requeue/touch``.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Protocol


class Delivery(Protocol):
    """What the ledger needs of a message (pybroker.client.Message has it)."""

    id: bytes
    body: bytes
    timestamp: int
    attempts: int

    def finish(self) -> None: ...
    def requeue(self, delay_s: float | None = None, backoff: bool = True) -> None: ...
    def touch(self) -> None: ...


Offset = dict[str, object]


class Ledger:
    """Numbers delivered messages and answers them according to Spark's progress."""

    def __init__(self, run: str, max_batch_size: int) -> None:
        self.run = run
        self.max_batch_size = max_batch_size
        self._lock = threading.Lock()
        self._waiting: deque[Delivery] = deque()        # delivered, not yet numbered
        self._held: dict[int, Delivery] = {}            # numbered, not yet FIN'd
        self._last_seq = 0                              # highest number given out
        self._committed = 0                             # highest seq FIN'd through commit
        self._stopped = False
        self.received = 0
        self.finished = 0
        self.requeued = 0
        self.last_arrival = time.monotonic()

    # -- offsets -----------------------------------------------------------------------
    def offset(self, seq: int) -> Offset:
        return {"run": self.run, "seq": seq}

    def own_seq(self, offset: Offset | None) -> int | None:
        """The seq of an offset of this run; None for another run's (or no) offset."""
        if isinstance(offset, dict) and offset.get("run") == self.run:
            seq = offset.get("seq")
            if isinstance(seq, int):
                return seq
        return None

    def base_seq(self, start: Offset | None) -> int:
        """Where a batch starting at ``start`` begins in this run's numbering."""
        seq = self.own_seq(start)
        return seq if seq is not None else self._committed

    # -- delivery (consumer handler threads) ---------------------------------------------
    def add(self, msg: Delivery) -> None:
        """A new delivery; after ``stop()`` it goes straight back to the server."""
        with self._lock:
            if not self._stopped:
                self._waiting.append(msg)
                self.received += 1
                self.last_arrival = time.monotonic()
                return
        msg.requeue(0.0, backoff=False)

    # -- planning (Spark's thread) -------------------------------------------------------
    def latest(self, start: Offset | None, max_rows: int | None = None,
               newest_ts_ns: int | None = None) -> Offset | None:
        """The end offset of the next batch after ``start``; None if there is no data.

        Args:
            start: the previous batch's end (None before the first batch).
            max_rows: Spark's read limit, if smaller than ``max_batch_size``.
            newest_ts_ns: admit only messages published at or before this time
                (available-now: later messages stay waiting and are REQueued at stop).
        """
        cap = self.max_batch_size if max_rows is None else min(max_rows, self.max_batch_size)
        with self._lock:
            base = self.base_seq(start)
            numbered = self._last_seq - base
            if numbered < cap and self._waiting:
                if newest_ts_ns is None:
                    take = min(cap - numbered, len(self._waiting))
                    admitted = [self._waiting.popleft() for _ in range(take)]
                else:
                    admitted, kept = [], deque[Delivery]()
                    for msg in self._waiting:
                        if len(admitted) < cap - numbered and msg.timestamp <= newest_ts_ns:
                            admitted.append(msg)
                        else:
                            kept.append(msg)
                    self._waiting = kept
                for msg in admitted:
                    self._last_seq += 1
                    self._held[self._last_seq] = msg
            end = min(self._last_seq, base + cap)
        return self.offset(end) if end > base else None

    def planned(self, start: Offset | None, end: Offset) -> list[Delivery]:
        """The messages of the batch (start, end]: empty for another run's offsets."""
        end_seq = self.own_seq(end)
        if end_seq is None:
            return []
        base = self.base_seq(start)
        with self._lock:
            return [self._held[s] for s in range(base + 1, end_seq + 1) if s in self._held]

    # -- answering -----------------------------------------------------------------------
    def commit(self, end: Offset | int) -> int:
        """FIN every held message numbered up to ``end``; returns how many."""
        end_seq = end if isinstance(end, int) else self.own_seq(end)
        if end_seq is None:
            return 0
        with self._lock:
            done = [s for s in self._held if s <= end_seq]
            msgs = [self._held.pop(s) for s in done]
            self._committed = max(self._committed, end_seq)
        for msg in msgs:
            msg.finish()
        self.finished += len(msgs)
        return len(msgs)

    def touch(self) -> int:
        """TOUCH every message not yet FIN'd; returns how many."""
        with self._lock:
            msgs = list(self._held.values()) + list(self._waiting)
        for msg in msgs:
            msg.touch()
        return len(msgs)

    def uncommitted_end(self) -> int:
        """The highest seq handed to Spark and not yet committed (0 if none)."""
        with self._lock:
            return max(self._held) if self._held else 0

    def stop(self, done_seq: int | None = None) -> tuple[int, int]:
        """FIN up to ``done_seq`` (proved committed), REQueue the rest with no delay.

        Returns (finished, requeued). Later deliveries are REQueued on arrival.
        """
        finished = self.commit(done_seq) if done_seq is not None else 0
        with self._lock:
            self._stopped = True
            rest: Iterable[Delivery] = list(self._held.values()) + list(self._waiting)
            self._held.clear()
            self._waiting.clear()
        n = 0
        for msg in rest:
            msg.requeue(0.0, backoff=False)
            n += 1
        self.requeued += n
        return finished, n

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"received": self.received, "waiting": len(self._waiting),
                    "held": len(self._held), "finished": self.finished,
                    "requeued": self.requeued, "last_seq": self._last_seq}
