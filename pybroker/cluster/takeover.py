"""A new leader's channels, built from the states its old leader shipped.

A follower keeps its leader's channel states as they came, one JSON object
(``ShippedStates``), and only reads them when it takes the topic over. For a channel
holding many deferred messages that reading is long: 100,000 of them are 3.3 MB of JSON
(35 ms in one ``json.loads``) and 100,000 timers to set again (about 100 ms); done in
the turn that made the node leader, it held the loop 139 ms. So the channels are built
here as objects nobody sees yet, in steps (``build``): all in that turn when the states
are small (``INLINE_BYTES``), else a step a turn on the topic's owner loop (the JSON in
slices, ``loads_steps``; the timers ``RESTORE_STEP`` at a time, ``restore_steps``);
the loop then puts the finished channels in place at once (``Replica._install``).
Until then the topic is led but its channels are the follower's: a SUB waits, its
connection held (``Replica.after_takeover``), and they are neither shipped nor saved
as the leader's.
(A thread of its own was tried first: on the GIL, each system call of the loop then
waited for the builder's switch interval, and the loop's turns took up to 70 ms.)
"""
from __future__ import annotations

import logging
import mmap
from collections.abc import Generator
from typing import TYPE_CHECKING, NamedTuple, TypeVar, cast

from pybroker.jsonvalue import Json, Piece, loads_steps
from pybroker.protocol.deadletter import dead_letter_settings

if TYPE_CHECKING:
    from pybroker.core.channel import Channel
    from pybroker.core.lifecycle import ChannelState
    from pybroker.core.topic import Topic

log = logging.getLogger("pybroker")
# shipped states up to this size are taken over in the turn that makes the node leader
# (about 2,000 deferred messages, a few milliseconds); larger ones a step a turn
INLINE_BYTES = 64 * 1024
COPY_STEP = 4 << 20     # bytes of shipped states copied a step
COPY_PIECES = 4096      # pieces of shipped states copied a step at most
T = TypeVar("T")
Steps = Generator[None, None, list["Channel"]]


class Text(NamedTuple):
    """Shipped states as a follower keeps them: one JSON object in pieces
    (pybroker.cluster.states.joined, or the one view of a frame it came whole in), and
    its length as the leader said it."""

    pieces: list[Piece]
    size: int


def states_of(doc: Json) -> dict[str, ChannelState]:
    """The channel states of a leader's JSON object (ChannelState documents, checked
    where they are read: ``Lifecycle.restore``)."""
    if not isinstance(doc, dict):
        return {}
    return {n: cast("ChannelState", st) for n, st in doc.items() if isinstance(st, dict)}


def build(topic: Topic, shipped: Text | dict[str, ChannelState], end: int,
          now_ns: int, wall_ns: int) -> Steps:
    """The channels of the states ``shipped`` (as kept: their JSON, or decoded), each
    cut to the log's ``end`` (what it held when the node became leader: only messages
    not finished there are delivered again) and restored, not yet added to the topic:
    a step per ``next``, the channels when it stops."""
    if isinstance(shipped, dict):
        states = shipped
    else:
        try:
            text = yield from _copy(shipped)
            states = states_of((yield from loads_steps(text, tuples=True)))
        except ValueError as e:
            log.error("CLUSTER: %s: the channel states shipped cannot be read (%s): "
                      "channels start from the oldest record", topic.name, e)
            states = {}
    out: list[Channel] = []
    for name, state in states.items():
        st = cast("ChannelState", dict(state))
        st["cursor"] = min(int(st.get("cursor", 0)), end)
        # pending messages at or past the cursor (so past end) are dropped by
        # restore_steps, in its steps, unless skip names them: skip is cut here
        st["skip"] = [o for o in st.get("skip", []) if o < end]
        ch = topic.make_channel(name, st["cursor"])
        ch.paused = bool(st.get("paused", False))
        settings = st.get("settings")
        if isinstance(settings, dict):          # from the wire: checked as nsqd.dat's
            ch.configure_dead_letters(dead_letter_settings(settings))
        yield from ch.restore_steps(st, now_ns, wall_ns)
        out.append(ch)
        yield
    return out


def _copy(text: Text) -> Generator[None, None, bytes | mmap.mmap]:
    """The shipped states copied out of their pieces (which loads_steps cannot search)
    into one text: COPY_STEP bytes or COPY_PIECES pieces a step, into pages mapped as
    they are written (``bytes(view)`` of 35 MB, 1,000,000 deferred messages, held the
    loop 17 ms). ValueError when the pieces are not ``size`` bytes."""
    size = text.size
    if size <= COPY_STEP:
        out = b"".join(text.pieces)
        if len(out) != size:
            raise ValueError(f"{len(out)} bytes of states where {size} were said")
        return out
    m = mmap.mmap(-1, size)
    at = done = 0
    for i, piece in enumerate(text.pieces):
        view = memoryview(piece)
        while len(view):
            n = min(len(view), COPY_STEP - done)
            if at + n > size:
                raise ValueError(f"more bytes of states than the {size} said")
            m[at:at + n] = view[:n]
            view = view[n:]
            at += n
            done += n
            if done >= COPY_STEP:
                done = 0
                yield
        if i % COPY_PIECES == COPY_PIECES - 1:
            yield
    if at != size:
        raise ValueError(f"{at} bytes of states where {size} were said")
    return m


def run(steps: Generator[None, None, T]) -> T:
    """All the steps at once (small work; a loop takes larger one a turn:
    ``run_steps``)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            value: T = done.value
            return value


__all__ = ["INLINE_BYTES", "Steps", "Text", "build", "run", "states_of"]
