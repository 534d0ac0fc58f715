"""One parsed HTTP request, and query strings parsed the way Go's url.ParseQuery does.

Pure data and parsing: the connection (conn.py) fills a Request from httptools'
callbacks; routes and handlers read it.
"""
from __future__ import annotations

import re
from urllib.parse import unquote_to_bytes

import httptools

from pybroker.http.response import Response

_BAD_ESCAPE = re.compile(rb"%(?![0-9a-fA-F]{2})")


class Request:
    """A request as the parser delivered it. Owned by one HttpConn (the http thread)."""

    __slots__ = (
        "begin_ns",
        "body",
        "body_len",
        "content_length",
        "expect_continue",
        "has_host",
        "header_bytes",
        "headers_done",
        "keep_alive",
        "limit",
        "method",
        "over_limit",
        "param",
        "path",
        "query",
        "reject",
        "url",
        "version",
    )

    def __init__(self, begin_ns: int) -> None:
        self.method = b""
        self.url = b""
        self.version = "1.1"
        self.keep_alive = True
        self.content_length = -1  # -1: none given (chunked, or no body)
        self.body: list[bytes] = []
        self.body_len = 0
        self.expect_continue = False
        self.has_host = False
        self.header_bytes = 0
        self.path = ""
        self.query = b""
        self.param = ""  # the value of a route parameter (/config/:opt)
        self.reject: Response | None = None  # an early answer, sent without the body
        self.begin_ns = begin_ns
        self.headers_done = False
        self.limit = 0  # largest body the route accepts
        self.over_limit: Response | None = None  # the answer when the body is larger

    def body_bytes(self) -> bytes:
        parts = self.body
        if not parts:
            return b""
        if len(parts) == 1:
            return parts[0]
        data = b"".join(parts)
        self.body = [data]
        return data


def split_url(url: bytes) -> tuple[str, bytes]:
    """(path, raw query) of a request target; the path is percent-decoded like Go's
    URL.Path. Absolute-form targets ("http://host/path?q") are reduced to their path."""
    if url.startswith(b"/"):
        raw_path, _, query = url.partition(b"?")
    else:
        try:
            u = httptools.parse_url(url)
        except httptools.HttpParserInvalidURLError:
            return "", b""
        raw_path, query = u.path or b"/", u.query or b""
    if b"%" in raw_path:
        raw_path = unquote_to_bytes(raw_path)
    return raw_path.decode("utf-8", "replace"), query


def _unescape(s: bytes) -> bytes | None:
    if b"%" not in s and b"+" not in s:
        return s
    if _BAD_ESCAPE.search(s):
        return None
    return unquote_to_bytes(s.replace(b"+", b" "))


def parse_query(raw: bytes) -> tuple[dict[bytes, list[bytes]], bool]:
    """Go's url.ParseQuery: ``(values, ok)``. Like Go it keeps every pair it can parse
    and reports a failure (a ';' separator, or a bad %-escape) through ``ok``."""
    values: dict[bytes, list[bytes]] = {}
    ok = True
    if not raw:
        return values, ok
    for part in raw.split(b"&"):
        if not part:
            continue
        if b";" in part:
            ok = False
            continue
        key, _, value = part.partition(b"=")
        k = _unescape(key)
        v = _unescape(value)
        if k is None or v is None:
            ok = False
            continue
        values.setdefault(k, []).append(v)
    return values, ok


def first(values: dict[bytes, list[bytes]], key: bytes) -> bytes | None:
    """The first value for key, or None when the key is absent (Go's ReqParams.Get)."""
    v = values.get(key)
    return v[0] if v else None
