"""The verbs' table of a V2 connection and its dispatch: which handler steps run for a
command, in which order, and where AUTH gates them.

``dispatch`` asks the session's state table first (pybroker.protocol.session.COMMANDS:
verb x state -> run, ignore, or nsqd's E_INVALID text), then follows the verb's row of
``VERBS``: its ``line`` step (server.handlers: the checks of the command line, in nsqd's
order, returning what it parsed) and, for SUB, PUB, DPUB, MPUB, IDENTIFY and AUTH, its
``act`` (the rest, with the body for the verbs that carry one); ``grant`` says where AUTH
gates the verb (nsqd's CheckAuth): after the line (SUB; MPUB, before its body is read),
after the body (PUB, DPUB), or nowhere. A command whose line is complete before its body
(``pending=True``) has its line step run then, once; the rest of it, with what the line
parsed, waits on the connection (``held``) for the body. A grant that expired is asked for again while the
connection reads nothing (server.auth), and the command goes on from its gate when the
answer is in: no step runs twice.

Ownership: runs on the thread of the loop that owns the connection, like the handlers.
"""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Callable, NamedTuple

from pybroker.protocol.decoder import Command
from pybroker.server import auth as authd
from pybroker.server.handlers import (NO_LINE, Line, auth, auth_line, cls, dpub, dpub_line,
                                      fin, identify, mpub, mpub_line, nop, pub, pub_line,
                                      rdy, req, sub, sub_line, touch)

if TYPE_CHECKING:
    from pybroker.server.ports import Conn

__all__ = ["AFTER_BODY", "AFTER_LINE", "NO_GRANT", "VERBS", "Verb", "dispatch"]

NO_GRANT, AFTER_LINE, AFTER_BODY = 0, 1, 2


class Verb(NamedTuple):
    """One row: ``line`` checks the command line (for a verb without ``act``, it is the
    whole handler); ``act`` does the rest, given what ``line`` returned and the body
    (None for SUB); ``grant``: where AUTH gates it (NO_GRANT, AFTER_LINE, AFTER_BODY)."""

    line: Callable[[Conn, Command], "Line | None"]
    act: Callable[[Conn, Line, bytes], None] | None = None
    has_body: bool = False
    grant: int = NO_GRANT


def _no_line(c: Conn, cmd: Command) -> Line:
    return NO_LINE


VERBS: dict[bytes, Verb] = {
    b"IDENTIFY": Verb(_no_line, identify, True),
    b"AUTH": Verb(auth_line, auth, True),
    b"SUB": Verb(sub_line, sub, False, AFTER_LINE),
    b"PUB": Verb(pub_line, pub, True, AFTER_BODY),
    b"MPUB": Verb(mpub_line, mpub, True, AFTER_LINE),  # matches nsqd: before the body
    b"DPUB": Verb(dpub_line, dpub, True, AFTER_BODY),
    b"RDY": Verb(rdy), b"FIN": Verb(fin), b"REQ": Verb(req), b"TOUCH": Verb(touch),
    b"CLS": Verb(cls), b"NOP": Verb(nop),
}


def dispatch(c: Conn, cmd: Command) -> None:
    """Run cmd if the session's state table allows it (protocol.session.COMMANDS: the
    state checks and their nsqd texts live there, not in the handlers), through its row
    of ``VERBS``."""
    held = c.held
    if held is not None:  # this command's line ran when it was announced (pending)
        c.held = None
        held(cmd)
        return
    verb = cmd.params[0]
    if not c.session.check(verb):
        return
    row = VERBS[verb]
    line = row.line(c, cmd)
    if row.act is None:
        return
    assert line is not None
    if row.grant == AFTER_LINE and not _granted(c, verb, line, partial(_after_line, c, verb,
                                                                       row, line, cmd)):
        return
    _after_line(c, verb, row, line, cmd)


def _after_line(c: Conn, verb: bytes, row: Verb, line: Line, cmd: Command) -> None:
    assert row.act is not None
    if not row.has_body:
        row.act(c, line, b"")
    elif cmd.pending:
        c.held = partial(_with_body, c, verb, row, line)   # the body follows: the line
        # is not run again
    else:
        _with_body(c, verb, row, line, cmd)


def _with_body(c: Conn, verb: bytes, row: Verb, line: Line, cmd: Command) -> None:
    if cmd.body_error is not None:
        raise cmd.body_error   # nsqd's order: a size error at the body step
    body = cmd.body
    assert body is not None and row.act is not None
    if row.grant == AFTER_BODY and not _granted(c, verb, line, partial(row.act, c, line,
                                                                       body)):
        return
    row.act(c, line, body)


def _granted(c: Conn, verb: bytes, line: Line, then: Callable[[], None]) -> bool:
    """AUTH's gate (nsqd's CheckAuth): True to go on now; False while an expired grant
    is asked again (``then`` runs when the answer allows the command). Raises
    E_AUTH_FIRST or E_UNAUTHORIZED."""
    if c.loop.runtime.auth is None:
        return True
    return authd.check(c, then, verb.decode(), line[0], line[1])
