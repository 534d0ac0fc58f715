"""AUTH against ``auth_http_addresses``, as nsqd's internal/auth and protocol_v2 do it.

The HTTP request never runs on an event loop: ``AuthClient`` owns a small pool of
``auth-N`` threads; each answer is posted back to the client's loop with
``call_soon_threadsafe``. While a query is out, that client reads no further commands
(``Session.upgrading``); other clients go on. A command that found its grant expired waits
for the re-query and then runs again. Texts and codes are nsqd's.
"""
from __future__ import annotations

import http.client
import json
import logging
import random
import re
import ssl
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from pybroker.errors import ClientError
from pybroker.protocol.encoder import encode_error, encode_response

if TYPE_CHECKING:
    from pybroker.config import Options
    from pybroker.server.loop import EventLoop
    from pybroker.protocol.decoder import Command
    from pybroker.server.connection import ClientConn

log = logging.getLogger("pybroker")
WORKERS = 32  # queries in flight at once; each waits at most connect + request timeout


class AuthFailed(ClientError):
    code = b"E_AUTH_FAILED"


class AuthFirst(ClientError):
    code = b"E_AUTH_FIRST"


class Unauthorized(ClientError):
    code = b"E_UNAUTHORIZED"


@dataclass
class Authorization:
    topic: re.Pattern[str]
    channels: list[re.Pattern[str]]
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

    def is_allowed(self, topic: str, channel: str) -> bool:
        return any(a.allows(topic, channel) for a in self.authorizations)

    def is_expired(self) -> bool:
        return self.expires < time.monotonic()


def parse_state(body: bytes) -> AuthState:
    """The auth server's JSON answer, checked as nsqd checks it. Raises ValueError."""
    data = json.loads(body)
    if not isinstance(data, dict):
        raise ValueError("json: cannot unmarshal into auth.State")
    ttl = data.get("ttl") or 0
    if not isinstance(ttl, int) or isinstance(ttl, bool):
        raise ValueError("json: cannot unmarshal ttl into an int")
    auths = []
    for a in data.get("authorizations") or []:
        perms = list(a.get("permissions") or [])
        for p in perms:
            if p not in ("subscribe", "publish"):
                raise ValueError(f"unknown permission {p}")
        topic = str(a.get("topic") or "")
        try:
            topic_re = re.compile(topic)
        except re.error as e:
            raise ValueError(f"unable to compile topic {json.dumps(topic)} {e}") from None
        channels = []
        for ch in a.get("channels") or []:
            try:
                channels.append(re.compile(str(ch)))
            except re.error as e:
                raise ValueError(f"unable to compile channel {json.dumps(ch)} {e}") from None
        auths.append(Authorization(topic_re, channels, perms))
    if ttl <= 0:
        raise ValueError(f"invalid TTL {ttl} (must be >0)")
    return AuthState(ttl, str(data.get("identity") or ""), str(data.get("identity_url") or ""),
                     auths, time.monotonic() + ttl)


class AuthClient:
    """Queries the auth servers from its own threads; results go back to the asking loop."""

    def __init__(self, options: Options) -> None:
        self.addresses: list[str] = list(options.auth_http_addresses)
        self.method = str(options.auth_http_request_method)
        self.connect_timeout_s = options.http_client_connect_timeout / 1e9
        self.request_timeout_s = options.http_client_request_timeout / 1e9
        ctx = ssl.create_default_context()
        if options.tls_root_ca_file:
            ctx.load_verify_locations(cafile=options.tls_root_ca_file)
        self.ssl_context = ctx
        self.pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="auth")

    def stop(self, timeout_s: float) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def query(self, loop: EventLoop, remote_ip: str, tls: bool, common_name: str, secret: str,
              done: Callable[[AuthState | None, str], None]) -> None:
        """Ask in the pool; ``done(state, error)`` then runs on ``loop``."""
        def work() -> None:
            try:
                state, err = self.query_any(remote_ip, tls, common_name, secret), ""
            except Exception as e:  # every failure is "AUTH failed" to the client
                state, err = None, str(e)
            loop.call_soon_threadsafe(done, state, err)

        self.pool.submit(work)

    def query_any(self, remote_ip: str, tls: bool, common_name: str, secret: str) -> AuthState:
        """nsqd's QueryAnyAuthd: each server once, from a random start. Raises ValueError."""
        errors: list[str] = []
        n = len(self.addresses)
        start = random.randrange(n)
        for i in range(n):
            addr = self.addresses[(start + i) % n]
            try:
                return self._query(addr, remote_ip, tls, common_name, secret)
            except (OSError, ValueError, http.client.HTTPException) as e:
                errors.append(f"failed to auth against {addr} - {e}")
        raise ValueError("; ".join(errors))

    def _query(self, addr: str, remote_ip: str, tls: bool, common_name: str,
               secret: str) -> AuthState:
        params = urllib.parse.urlencode(sorted({
            "remote_ip": remote_ip, "tls": "true" if tls else "false", "secret": secret,
            "common_name": common_name}.items()))
        url = addr if "://" in addr else f"http://{addr}/auth"
        parts = urllib.parse.urlsplit(url)
        path = parts.path or "/"
        body = None
        headers = {"Accept": "application/vnd.nsq; version=1.0"}
        if self.method == "post":
            body = params.encode()
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        else:
            path += "?" + (parts.query + "&" if parts.query else "") + params
        conn: http.client.HTTPConnection
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(parts.netloc, timeout=self.connect_timeout_s,
                                               context=self.ssl_context)
        else:
            conn = http.client.HTTPConnection(parts.netloc, timeout=self.connect_timeout_s)
        try:
            conn.connect()
            assert conn.sock is not None
            conn.sock.settimeout(self.request_timeout_s)
            conn.request(self.method.upper(), path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            raise ValueError(f"got response {resp.status} {resp.reason} {data!r}")
        return parse_state(data)


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
