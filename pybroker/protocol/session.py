"""Session: the V2 protocol state of one client connection, and the one table of which
command is allowed in which state (sans-IO: no sockets, threads or broker here).

States (nsqd's, as /stats reports them: ``ClientState``)::

    INIT --SUB accepted--> CONNECTED --joined the channel--> SUBSCRIBED --CLS--> CLOSING

IDENTIFY and AUTH keep INIT (``identified``, ``authorized`` record that they happened).
Beside the state, ``upgrading`` counts stream upgrades under way (TLS handshake, an
auth request in flight): no command is read meanwhile. ``tls`` says the stream is TLS,
for a server with tls_required.

``check(verb)`` answers, before a handler runs: run it (True), ignore the command (False:
RDY after CLS, as nsqd does) or refuse it (raises nsqd's E_INVALID with nsqd's text).
Handlers then ask the session to move (``begin_subscribe`` ...); a move that the table
does not allow is a bug (SessionError), never a client error.
"""
from __future__ import annotations

from pybroker.errors import Invalid, raw_text
from pybroker.protocol.wire import ClientState

INIT, CONNECTED, SUBSCRIBED, CLOSING = (ClientState.INIT, ClientState.CONNECTED,
                                        ClientState.SUBSCRIBED, ClientState.CLOSING)
_ANY = frozenset(ClientState)
_CONSUMING = frozenset({SUBSCRIBED, CLOSING})

# verb -> (states it runs in, states it is silently ignored in); any other state is
# refused with E_INVALID "cannot <VERB> in current state" (nsqd's texts)
COMMANDS: dict[bytes, tuple[frozenset[ClientState], frozenset[ClientState]]] = {
    b"IDENTIFY": (frozenset({INIT}), frozenset()),
    b"AUTH": (frozenset({INIT}), frozenset()),
    b"SUB": (frozenset({INIT}), frozenset()),
    b"RDY": (frozenset({SUBSCRIBED}), frozenset({CLOSING})),
    b"FIN": (_CONSUMING, frozenset()),
    b"REQ": (_CONSUMING, frozenset()),
    b"TOUCH": (_CONSUMING, frozenset()),
    b"CLS": (frozenset({SUBSCRIBED}), frozenset()),
    b"PUB": (_ANY, frozenset()),
    b"MPUB": (_ANY, frozenset()),
    b"DPUB": (_ANY, frozenset()),
    b"NOP": (_ANY, frozenset()),
}

# event -> (from state, to state)
MOVES: dict[str, tuple[ClientState, ClientState]] = {
    "subscribe": (INIT, CONNECTED),       # SUB accepted; the channel's loop takes over
    "subscribed": (CONNECTED, SUBSCRIBED),
    "close_wait": (SUBSCRIBED, CLOSING),  # CLS
}


class SessionError(AssertionError):
    """A move the state table does not allow: a bug in the caller."""


class Session:
    __slots__ = ("state", "identified", "authorized", "upgrading", "tls", "tls_required")

    def __init__(self, tls_required: bool = False) -> None:
        self.state = INIT
        self.identified = False
        self.authorized = False
        self.upgrading = 0
        self.tls = False
        self.tls_required = tls_required

    def __repr__(self) -> str:
        return f"Session({self.state.name}{' upgrading' if self.upgrading else ''})"

    def check(self, verb: bytes) -> bool:
        """May verb run now? True: run it; False: ignore it. Raises E_INVALID."""
        if self.tls_required and not self.tls and verb != b"IDENTIFY":
            # matches nsqd's enforceTLSPolicy: checked before the verb is even known
            raise Invalid(f"cannot {raw_text(verb)} in current state (TLS required)")
        rule = COMMANDS.get(verb)
        if rule is None:
            raise Invalid(f"invalid command {raw_text(verb)}")
        allowed, ignored = rule
        if self.state in allowed:
            return True
        if self.state in ignored:
            return False
        raise Invalid(f"cannot {verb.decode()} in current state")

    def move(self, event: str) -> None:
        src, dst = MOVES[event]
        if self.state != src:
            raise SessionError(f"{event} in state {self.state.name}")
        self.state = dst

    @property
    def consuming(self) -> bool:
        """Subscribed and not closing: messages may be sent."""
        return self.state == SUBSCRIBED

    # -- the flags beside the state --------------------------------------------------------
    def identify_done(self) -> None:
        if self.state != INIT:
            raise SessionError(f"IDENTIFY in state {self.state.name}")
        self.identified = True

    def hold(self) -> None:
        """A stream upgrade or an auth request began: read no command until release()."""
        self.upgrading += 1

    def release(self) -> None:
        if self.upgrading <= 0:
            raise SessionError("release without hold")
        self.upgrading -= 1
