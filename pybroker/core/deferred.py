"""A channel's deferred messages, kept so that a snapshot costs what changed.

A deferred message is the tuple ``(offset, attempts, due_wall_ns)`` (core/flight.py's
``Deferred``). ``DeferredSet`` maps offsets to them in chunks of ``CHUNK`` offsets
(``offset >> CHUNK_BITS``), and keeps for each chunk the tuple of its messages as the
last snapshot listed them until something in that chunk changes. A snapshot is then
the tuple of those tuples (``Chunks``): its owner loop builds again only the chunks
that changed, and shares the rest with the snapshot before.

Why chunks, and why tuples (docs/storage.md, "Deferred messages and the garbage
collector"):
- A channel's saved state lists every deferred message, and a snapshot is taken every
  ``sync_timeout`` (every 200 ms on a replicated topic's leader). Copied whole at
  each change, 1,000,000 deferred messages cost the loop about 10 ms a snapshot.
- CPython's collector walks every element of a young container: a fresh list of
  825,000 deferred messages held every loop 42 ms in one collection of the youngest
  generation. A chunk's tuple is at most CHUNK elements (a few microseconds to walk).
- A tuple of integers is not tracked by the collector after its first pass; an object
  of a class always is (1,000,000 of them made a full collection 323 ms).

Ownership: the channel's owner loop; a ``Chunks`` value, once returned, is never
changed (other threads read it).
"""
from __future__ import annotations

import array
from collections.abc import Generator, Iterator

from pybroker._native.inflight import pack_offsets

from pybroker.core.flight import Deferred

CHUNK_BITS = 10
CHUNK = 1 << CHUNK_BITS     # offsets a chunk spans: at most this many messages a tuple

Chunks = tuple[tuple[Deferred, ...], ...]


class DeferredSet:
    """offset -> Deferred, in chunks; ``snapshot`` shares the unchanged chunks."""

    __slots__ = ("_chunks", "_frozen", "_len", "_snap", "_offs", "_stale")

    def __init__(self) -> None:
        self._chunks: dict[int, dict[int, Deferred]] = {}
        # chunk key -> its messages as the last snapshot listed them (while unchanged)
        self._frozen: dict[int, tuple[Deferred, ...]] = {}
        self._len = 0
        self._snap: Chunks | None = ()
        # chunk key -> its offsets as int64s (a rewind's listing: ``offsets_from``),
        # appended to as messages come; a removal makes the chunk's stale (made again
        # from the chunk when next asked for), so that messages deferred and waiting,
        # the common case, are listed by a copy of bytes
        self._offs: dict[int, array.array[int]] = {}
        self._stale: set[int] = set()

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[int]:
        """The offsets held (in no particular order)."""
        for chunk in self._chunks.values():
            yield from chunk

    def get(self, offset: int) -> Deferred | None:
        chunk = self._chunks.get(offset >> CHUNK_BITS)
        return None if chunk is None else chunk.get(offset)

    def add(self, d: Deferred) -> None:
        """Hold d (replacing what its offset held)."""
        key = d[0] >> CHUNK_BITS
        chunk = self._chunks.get(key)
        if chunk is None:
            chunk = self._chunks[key] = {}
            self._offs[key] = array.array("q")
        if d[0] not in chunk:
            self._len += 1
            if key not in self._stale:
                self._offs[key].append(d[0])
        chunk[d[0]] = d
        self._frozen.pop(key, None)
        self._snap = None

    def discard(self, d: Deferred) -> bool:
        """Drop d if its offset still holds this very message (not one deferred again
        since); True if it did."""
        key = d[0] >> CHUNK_BITS
        chunk = self._chunks.get(key)
        if chunk is None or chunk.get(d[0]) is not d:
            return False
        del chunk[d[0]]
        if chunk:
            self._stale.add(key)
        else:
            del self._chunks[key]
            del self._offs[key]
            self._stale.discard(key)
        self._len -= 1
        self._frozen.pop(key, None)
        self._snap = None
        return True

    def clear(self) -> None:
        self._chunks.clear()
        self._frozen.clear()
        self._offs.clear()
        self._stale.clear()
        self._len = 0
        self._snap = ()

    def lowest(self) -> int | None:
        """The lowest offset held, None when empty."""
        if not self._chunks:
            return None
        return min(self._chunks[min(self._chunks)])

    def offsets_from(self, offset: int, out: array.array[int]) -> None:
        """Add to ``out`` the offsets held in the chunks that reach ``offset`` or past
        it (a few below it too: the caller drops them): each chunk's int64s as kept, or
        made again from the chunk if a removal made them stale."""
        low = offset >> CHUNK_BITS
        stale, kept = self._stale, self._offs
        for key, chunk in self._chunks.items():
            if key >= low:
                if key in stale:
                    kept[key] = array.array("q", pack_offsets(chunk, len(chunk)))
                    stale.discard(key)
                out += kept[key]

    def freeze_steps(self, per_step: int) -> Generator[None, None, None]:
        """Make the chunk tuples the next snapshot needs, about per_step messages a
        step (a restored channel's first snapshot would make all of them in one
        turn)."""
        frozen = self._frozen
        done = 0
        for key, chunk in list(self._chunks.items()):
            if key not in frozen and self._chunks.get(key) is chunk:
                frozen[key] = tuple(chunk.values())
                done += len(chunk)
                if done >= per_step:
                    done = 0
                    yield

    def snapshot(self) -> Chunks:
        """Every message held, as a tuple of chunk tuples. Unchanged chunks are the
        tuples the last snapshot returned; unchanged altogether, the same value."""
        snap = self._snap
        if snap is None:
            frozen = self._frozen
            parts = []
            for key, chunk in self._chunks.items():
                part = frozen.get(key)
                if part is None:
                    part = frozen[key] = tuple(chunk.values())
                parts.append(part)
            snap = self._snap = tuple(parts)
        return snap
