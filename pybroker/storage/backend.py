"""The Backend seam between the broker core and a queue store (stdlib only).

``Backend`` is what the core programs against: DiskQueue implements it, and
NullBackend is nsqd's dummy backend for ``#ephemeral`` topics and channels
(overflow is discarded, nothing is ever read back).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable


@runtime_checkable
class Backend(Protocol):
    """A FIFO of byte records with seqs, acks and group-commit sync (see diskqueue)."""

    name: str

    def put(self, record: bytes, *, claim: bool = False) -> int: ...
    def put_many(self, records: Iterable[bytes], *, claim: bool = False) -> int: ...
    def read_many(self, max_n: int, *, auto_ack: bool = False
                  ) -> list[tuple[int, bytes]]: ...
    def ack(self, seq: int) -> bool: ...
    def ack_many(self, seqs: Iterable[int]) -> int: ...
    def sync(self, seq: int | None = None) -> int: ...
    @property
    def synced_seq(self) -> int: ...
    def maybe_sync(self, now_ns: int) -> bool: ...
    def checkpoint(self, now_ns: int | None = None) -> None: ...
    def depth(self) -> int: ...
    def is_empty(self) -> bool: ...
    def unacked_count(self) -> int: ...
    def stats(self) -> dict[str, int]: ...
    def empty(self) -> None: ...
    def close(self) -> None: ...
    def delete(self) -> None: ...


class NullBackend:
    """Discards everything put into it (nsqd's dummyBackendQueue for #ephemeral).

    Seqs still count up and are reported as synced at once, so a caller in durable
    mode never waits on it. Owned by whoever created it; not locked (no shared state
    but a counter).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._next_seq = 0

    def put(self, record: bytes, *, claim: bool = False) -> int:
        return self.put_many((record,), claim=claim)

    def put_many(self, records: Iterable[bytes], *, claim: bool = False) -> int:
        first = self._next_seq
        self._next_seq += sum(1 for _ in records)
        return first

    def read_many(self, max_n: int, *, auto_ack: bool = False) -> list[tuple[int, bytes]]:
        return []

    def ack(self, seq: int) -> bool:
        return False

    def ack_many(self, seqs: Iterable[int]) -> int:
        return 0

    def sync(self, seq: int | None = None) -> int:
        return self._next_seq - 1

    @property
    def synced_seq(self) -> int:
        return self._next_seq - 1

    def maybe_sync(self, now_ns: int) -> bool:
        return False

    def checkpoint(self, now_ns: int | None = None) -> None:
        return None

    def depth(self) -> int:
        return 0

    def is_empty(self) -> bool:
        return True

    def unacked_count(self) -> int:
        return 0

    def stats(self) -> dict[str, int]:
        return {"depth": 0, "unacked": 0, "next_seq": self._next_seq,
                "synced_seq": self._next_seq - 1, "segments": 0, "fsyncs": 0,
                "writes": 0}

    def empty(self) -> None:
        return None

    def close(self) -> None:
        return None

    def delete(self) -> None:
        return None
