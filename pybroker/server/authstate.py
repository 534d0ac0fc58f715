"""What an auth server granted a client: its answer parsed and checked as nsqd checks it,
and the per-client grant that SUB/PUB/MPUB/DPUB are tested against.

What it owns: ``AuthState`` and ``Authorization`` (data, no I/O) and ``parse_state``.
Both sides use it: the HTTP client (server.authhttp) parses answers with it, the protocol
side (server.auth) keeps one grant per client. The RE2 patterns (server.grants) are
imported when an answer is first parsed.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pybroker.server.grants import Pattern

__all__ = ["CHECK_CACHE", "AuthState", "Authorization", "parse_state"]
CHECK_CACHE = 4096  # topic/channel pairs whose answer a grant keeps


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
