"""One HTTP request from a test, its answer decoded: the suite's single HTTP-JSON helper.

``http_json`` returns (status, body) with the body decoded from JSON when it is JSON, else
as text; HTTP error statuses are returned, not raised. ``broker_json`` is the same against
a broker's HTTP API, with the query string built from keyword arguments.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from pybroker.testing import BrokerProcess


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
