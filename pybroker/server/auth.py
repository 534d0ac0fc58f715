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
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from pybroker.errors import ClientError
from pybroker.protocol.encoder import encode_error, encode_response
if TYPE_CHECKING:
    from pybroker.server.authhttp import AuthClient
    from pybroker.server.grants import Pattern
    from pybroker.protocol.decoder import Command
    from pybroker.server.connection import ClientConn

__all__ = ["AuthClient", "AuthState", "Authorization", "check", "parse_state", "start_auth"]


def __getattr__(name: str) -> type[AuthClient]:
    """``AuthClient`` is server.authhttp's, imported when first asked for."""
    if name == "AuthClient":
        from pybroker.server.authhttp import AuthClient

        return AuthClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
log = logging.getLogger("pybroker")
CHECK_CACHE = 4096  # topic/channel pairs whose answer a grant keeps


class AuthFailed(ClientError):
    code = b"E_AUTH_FAILED"


class AuthFirst(ClientError):
    code = b"E_AUTH_FIRST"


class Unauthorized(ClientError):
    code = b"E_UNAUTHORIZED"


@dataclass
class Authorization:
    topic: Pattern
    channels: list[Pattern]
    permissions: list[str]

    def allows(self, topic: str, channel: str) -> bool:
        # matches nsqd: a channel asks for "subscribe", none for "publish"; both
        # patterns are unanchored (Go's MatchString)
        if ("subscribe" if channel else "publish") not in self.permissions:
            return False
        if not self.topic.search(topic):
            return False
        return any(c.search(channel) for c in self.channels)


@dataclass
class AuthState:
    ttl: int
    identity: str = ""
    identity_url: str = ""
    authorizations: list[Authorization] = field(default_factory=list)
    expires: float = 0.0  # time.monotonic()
    checked: dict[tuple[str, str], bool] = field(default_factory=dict)

    def is_allowed(self, topic: str, channel: str) -> bool:
        key = (topic, channel)
        ok = self.checked.get(key)
        if ok is None:
            ok = any(a.allows(topic, channel) for a in self.authorizations)
            if len(self.checked) >= CHECK_CACHE:
                self.checked.clear()
            self.checked[key] = ok
        return ok

    def is_expired(self) -> bool:
        return self.expires < time.monotonic()


def parse_state(body: bytes) -> AuthState:
    """The auth server's JSON answer, checked as nsqd checks it. Raises ValueError."""
    from pybroker.server.grants import check_budget, compile_grant

    data = json.loads(body)
    if not isinstance(data, dict):
        raise ValueError("json: cannot unmarshal into auth.State")
    ttl = data.get("ttl") or 0
    if not isinstance(ttl, int) or isinstance(ttl, bool):
        raise ValueError("json: cannot unmarshal ttl into an int")
    auths = []
    patterns: list[Pattern] = []
    for a in data.get("authorizations") or []:
        if not isinstance(a, dict):
            raise ValueError("json: cannot unmarshal into auth.Authorization")
        perms = list(a.get("permissions") or [])
        for p in perms:
            if p not in ("subscribe", "publish"):
                raise ValueError(f"unknown permission {p}")
        topic_re = compile_grant("topic", str(a.get("topic") or ""))
        channels = [compile_grant("channel", str(ch)) for ch in a.get("channels") or []]
        patterns.append(topic_re)
        patterns.extend(channels)
        check_budget(patterns)
        auths.append(Authorization(topic_re, channels, perms))
    if ttl <= 0:
        raise ValueError(f"invalid TTL {ttl} (must be >0)")
    return AuthState(ttl, str(data.get("identity") or ""), str(data.get("identity_url") or ""),
                     auths, time.monotonic() + ttl)


# -- the protocol side (runs on the client's loop) --------------------------------------
def _remote_ip(c: "ClientConn") -> str:
    host = c.remote_address.rpartition(":")[0]
    return host.strip("[]")


def _ask(c: "ClientConn", then: Callable[[AuthState | None, str], None]) -> None:
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


def _fatal(c: "ClientConn", err: ClientError) -> None:
    log.error("[%s] - %s", c, err.payload().decode("utf-8", "replace"))
    c.send_frame(encode_error(err.payload()))
    c.close_after_flush()


def start_auth(c: "ClientConn", secret: str) -> None:
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


def check(c: "ClientConn", cmd: "Command", verb: str, topic: str, channel: str) -> bool:
    """nsqd's CheckAuth for SUB/PUB/MPUB/DPUB. True: go on. False: the grant expired and
    is being asked again; ``cmd`` runs again when the answer is in. Raises ClientError."""
    if c.loop.runtime.auth is None:
        return True
    state: AuthState | None = c.auth_state
    if state is None or not state.authorizations:
        raise AuthFirst(f"AUTH required before {verb}")
    if state.is_expired():
        def then(new: AuthState | None, err: str) -> None:
            if new is None:
                log.warning("PROTOCOL(V2): [%s] AUTH failed %s", c, err)
                _fatal(c, AuthFailed("AUTH failed"))
                return
            c.auth_state = new
            _rerun(c, cmd)

        _ask(c, then)
        return False
    if not state.is_allowed(topic, channel):
        raise Unauthorized(f"AUTH failed for {verb} on {_q(topic)} {_q(channel)}")
    return True


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _rerun(c: "ClientConn", cmd: "Command") -> None:
    from pybroker.server import handlers

    try:
        handlers.dispatch(c, cmd)
    except ClientError as err:
        if err.fatal:
            _fatal(c, err)
        else:
            c.send_frame(encode_error(err.payload()))
