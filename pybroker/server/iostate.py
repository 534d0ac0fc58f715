"""The I/O life of one client connection: one state and the one table of its moves.

This is the socket's side only: whether bytes are read and commands run at all, and
whether the connection is on its way out. Which command may run is the protocol's
side, kept apart in its own table (pybroker.protocol.session: ``Session.state`` and
``COMMANDS``, with nsqd's texts); so is back-pressure (``ClientConn.reading``: unread
replies over the cap) and waiting for a publish's answer (``awaiting_commit``)::

    AWAIT_MAGIC --magic--> OPEN --SUB on another loop's channel--> MOVING --adopted--> OPEN
         |                  | --no TLS handshake slot--> HELD --a slot--> OPEN
         |                  | --SUB while its topic is taken over--> HELD --in place--> OPEN
         |                  |
         +--bad magic--+----+-- a fatal error --> DRAINING --queued frames written--> CLOSED
                                      (and from every state but CLOSED: closed at once)

``ClientConn`` moves it only through ``move`` (an illegal move raises ``IoStateError``:
a bug, never a client's doing). The hot paths read it as an attribute compared by
identity (``c.io is OPEN``), never through a call. Sans-IO: no sockets here, so
tests/unit/test_iostate.py drives the table and a real connection against it.
"""
from __future__ import annotations

import enum


class Io(enum.Enum):
    AWAIT_MAGIC = "await_magic"  # accepted; the 4-byte protocol magic not yet read
    OPEN = "open"                # commands are read and run (unless back-pressured)
    HELD = "held"                # waiting (a TLS handshake slot, a topic's takeover):
    #                              its socket is not read, no command runs
    MOVING = "moving"            # SUB on another loop's channel: handed over, runs nothing
    DRAINING = "draining"        # a fatal error: nothing more read; closed once written
    CLOSED = "closed"


AWAIT_MAGIC, OPEN, HELD, MOVING, DRAINING, CLOSED = (
    Io.AWAIT_MAGIC, Io.OPEN, Io.HELD, Io.MOVING, Io.DRAINING, Io.CLOSED)

# state -> the states it may move to
MOVES: dict[Io, frozenset[Io]] = {
    AWAIT_MAGIC: frozenset({OPEN, DRAINING, CLOSED}),
    OPEN: frozenset({HELD, MOVING, DRAINING, CLOSED}),
    HELD: frozenset({OPEN, DRAINING, CLOSED}),
    # a publish answered with an error before the hand-over: drained where it is
    MOVING: frozenset({OPEN, DRAINING, CLOSED}),
    DRAINING: frozenset({CLOSED}),
    CLOSED: frozenset(),
}


class IoStateError(AssertionError):
    """A move the table does not allow: a bug in the caller."""


def move(src: Io, dst: Io) -> Io:
    """dst, if the table allows src -> dst; else raise IoStateError."""
    if dst not in MOVES[src]:
        raise IoStateError(f"connection I/O state {src.name} -> {dst.name}")
    return dst
