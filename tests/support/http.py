"""One HTTP request from a test, its answer decoded: the suite's single HTTP-JSON helper.

``http_json`` returns (status, body) with the body decoded from JSON when it is JSON, else
as text; HTTP error statuses are returned, not raised. ``broker_json`` is the same against
a broker's HTTP API, with the query string built from keyword arguments;
``channel_stats`` and ``wait_all_finished`` read a channel from /stats (pybroker or nsqd).
"""
from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from pybroker.testing import BrokerProcess, wait_until


def http_json(method: str, url: str, body: Any = None,
              timeout_s: float = 10.0) -> tuple[int, Any]:
    """(status, decoded JSON body or text) of one request; HTTP errors are returned.

    ``body`` is sent as is when it is bytes, else encoded as JSON; a POST without a body
    sends an empty one (as nsqd's POST endpoints expect)."""
    if isinstance(body, bytes):
        data: bytes | None = body
    elif body is not None:
        data = json.dumps(body).encode()
    else:
        data = b"" if method in ("POST", "PUT") else None
    req = urllib.request.Request(url, data=data, method=method)
    if body is not None and not isinstance(body, bytes):
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    if not raw:
        return status, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


def broker_json(b: BrokerProcess, method: str, path: str, body: Any = None,
                timeout_s: float = 10.0, **query: Any) -> tuple[int, Any]:
    """http_json against broker ``b``'s HTTP API: broker_json(b, "GET", "/stats",
    format="json", topic=t)."""
    url = f"http://{b.http_hostport}{path}"
    if query:
        url += ("&" if "?" in path else "?") + urllib.parse.urlencode(query)
    return http_json(method, url, body, timeout_s)


def get_json(url: str, timeout_s: float = 10.0) -> Any:
    """The JSON body of a GET that must answer 200."""
    status, doc = http_json("GET", url, timeout_s=timeout_s)
    assert status == 200, (url, status, doc)
    return doc


def channel_stats(b: BrokerProcess, topic: str, channel: str) -> dict[str, Any] | None:
    """One channel's entry in the broker's /stats (pybroker or nsqd); None when absent."""
    status, doc = broker_json(b, "GET", "/stats", format="json", topic=topic)
    assert status == 200, doc
    for t in doc.get("topics") or []:
        if t["topic_name"] == topic:
            for c in t.get("channels") or []:
                if c["channel_name"] == channel:
                    return c  # type: ignore[no-any-return]
    return None


def the_channel(b: BrokerProcess, topic: str, channel: str) -> dict[str, Any]:
    """channel_stats for a channel that must exist."""
    c = channel_stats(b, topic, channel)
    assert c is not None, f"no channel {topic}/{channel} in /stats"
    return c


def wait_all_finished(b: BrokerProcess, topic: str, channel: str,
                      timeout_s: float = 10.0) -> None:
    """Wait until the channel holds nothing: no message queued, deferred or in flight,
    i.e. every FIN reached the server (an un-FIN'd message stays in flight, then queued
    again after its timeout, and never satisfies this)."""
    def settled() -> bool:
        c = channel_stats(b, topic, channel)
        assert c is not None, f"no channel {topic}/{channel}"
        return bool(c["depth"] == 0 and c["in_flight_count"] == 0 and c["deferred_count"] == 0)

    wait_until(settled, timeout_s, what=f"every message of {topic}/{channel} finished")
