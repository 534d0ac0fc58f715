"""AUTH against ``auth_http_addresses``, as nsqd's internal/auth and protocol_v2 do it.

The HTTP request never runs on an event loop: ``AuthClient`` (server.authhttp) runs
every request on its own ``auth`` selector loop, each with one deadline, and posts the
answer back to the client's loop with ``call_soon_threadsafe``. While a query is out,
that client reads no further commands (``Session.upgrading``); other clients go on, and
so do other clients' queries, however slow one server is. A command that found its
grant expired waits for the re-query and then runs again. Patterns are RE2 (Go's
regexp syntax, linear time: server.grants); each topic/channel pair is matched once
per grant. Texts and codes are nsqd's. The HTTP client (server.authhttp: ssl, a thread
pool) and the RE2 patterns are imported when AUTH is configured and used: a broker
without ``auth_http_addresses`` never loads them.
"""
from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Callable

from pybroker.errors import ClientError, go_quote
from pybroker.protocol.encoder import encode_error, encode_response
from pybroker.server.authstate import AuthState, Authorization, parse_state

if TYPE_CHECKING:
    from pybroker.server.ports import Conn

__all__ = ["AuthState", "Authorization", "check", "parse_state", "start_auth"]


log = logging.getLogger("pybroker")


class AuthFailed(ClientError):
    code = b"E_AUTH_FAILED"


class AuthFirst(ClientError):
    code = b"E_AUTH_FIRST"


class Unauthorized(ClientError):
    code = b"E_UNAUTHORIZED"


# -- the protocol side (runs on the client's loop) --------------------------------------
def _remote_ip(c: Conn) -> str:
    host = c.remote_address.rpartition(":")[0]
    return host.strip("[]")


def _ask(c: Conn, then: Callable[[AuthState | None, str], None]) -> None:
    auth = c.loop.runtime.auth
    assert auth is not None, "AUTH is refused (E_AUTH_DISABLED) without auth servers"
    t = c.transport
    c.session.hold()

    def done(state: AuthState | None, err: str) -> None:
        c.session.release()
        if c.closed:
            return
        then(state, err)
        c.loop.to_flush[c] = None
        c.process()

    auth.query(c.loop, _remote_ip(c), t.tls, t.common_name, c.auth_secret, done)


def _fatal(c: Conn, err: ClientError) -> None:
    log.error("[%s] - %s", c, err.payload().decode("utf-8", "replace"))
    c.send_frame(encode_error(err.payload()))
    c.close_after_flush()


def start_auth(c: Conn, secret: str) -> None:
    """AUTH with a secret: query, then answer nsqd's JSON or its error (fatal)."""
    c.auth_secret = secret

    def then(state: AuthState | None, err: str) -> None:
        if state is None:
            # matches nsqd: the reason is logged, never sent to an untrusted client
            log.warning("PROTOCOL(V2): [%s] AUTH failed %s", c, err)
            _fatal(c, AuthFailed("AUTH failed"))
            return
        c.auth_state = state
        c.session.authorized = bool(state.authorizations)
        if not state.authorizations:
            _fatal(c, Unauthorized("AUTH no authorizations found"))
            return
        body = json.dumps({"identity": state.identity, "identity_url": state.identity_url,
                           "permission_count": len(state.authorizations)},
                          separators=(",", ":")).encode()
        c.send_frame(encode_response(body))

    _ask(c, then)


def check(c: Conn, then: Callable[[], None], verb: str, topic: str,
          channel: str) -> bool:
    """nsqd's CheckAuth for SUB/PUB/MPUB/DPUB, the gate of their rows in the handlers'
    table. True: go on. False: the grant expired and is being asked again; ``then`` (the
    rest of the command, from its gate on) runs when the new grant allows it. Raises
    ClientError."""
    if c.loop.runtime.auth is None:
        return True
    state: AuthState | None = c.auth_state
    if state is None or not state.authorizations:
        raise AuthFirst(f"AUTH required before {verb}")
    if state.is_expired():
        def answered(new: AuthState | None, err: str) -> None:
            if new is None:
                log.warning("PROTOCOL(V2): [%s] AUTH failed %s", c, err)
                _fatal(c, AuthFailed("AUTH failed"))
                return
            c.auth_state = new
            _resume(c, then, verb, topic, channel)

        _ask(c, answered)
        return False
    if not state.is_allowed(topic, channel):
        raise Unauthorized(f"AUTH failed for {verb} on {go_quote(topic)} {go_quote(channel)}")
    return True


def _resume(c: Conn, then: Callable[[], None], verb: str, topic: str,
            channel: str) -> None:
    """The new grant is in: the command goes on from its gate (checked against it)."""
    try:
        if check(c, then, verb, topic, channel):
            then()
    except ClientError as err:
        if err.fatal:
            _fatal(c, err)
        else:
            c.send_frame(encode_error(err.payload()))
