"""HTTP responses as nsqd's Go server writes them: status lines, headers, JSON errors.

``Response`` is what a route returns; ``encode`` turns it into bytes for one request
(HTTP version, keep-alive, HEAD). Pure: no sockets; the Date header comes from the
caller's once-a-second ``DateCache``.
"""
from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import cast

from pybroker.jsonvalue import Json

NSQ_HEADER = b"X-Nsq-Content-Type: nsq; version=1.0\r\n"
TEXT = b"text/plain; charset=utf-8"
JSON = b"application/json; charset=utf-8"
HTML = b"text/html; charset=utf-8"

REASONS = {
    100: "Continue", 200: "OK", 301: "Moved Permanently", 307: "Temporary Redirect",
    400: "Bad Request", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Request Entity Too Large", 431: "Request Header Fields Too Large",
    500: "Internal Server Error", 503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


class Response:
    """One answer: status, body, content type and extra header lines.

    ``nsq`` adds nsqd's ``X-Nsq-Content-Type`` header (every V1 route; not /ping or
    OPTIONS). ``close`` forces ``Connection: close`` and a close after the write.
    """

    __slots__ = ("body", "close", "content_type", "headers", "nsq", "raw", "status")

    def __init__(self, status: int, body: bytes | bytearray = b"",
                 content_type: bytes | None = None,
                 nsq: bool = True, headers: tuple[bytes, ...] = (), close: bool = False,
                 raw: bytes | None = None) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        self.nsq = nsq
        self.headers = headers
        self.close = close
        self.raw = raw  # complete pre-encoded bytes (protocol-level errors)


def closing(r: Response) -> Response:
    """r with ``Connection: close``: an answer sent without reading the request's body
    must close the connection (the unread body cannot be told from the next request)."""
    if r.close:
        return r
    return Response(r.status, r.body, r.content_type, r.nsq, r.headers, True, r.raw)


# a JSON body: a decoded-JSON value, a document with a TypedDict shape, or a list (an
# option's value)
JsonBody = Json | Mapping[str, object] | Sequence[object]


def _dumps(data: JsonBody) -> bytes:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()


def ok_text(text: bytes = b"OK") -> Response:
    """200 with a text body (nsqd's V1 string results: Go sniffs them as text/plain)."""
    return Response(200, text, TEXT if text else None)


def empty() -> Response:
    """200 with an empty body and no Content-Type (nsqd's V1 nil results)."""
    return Response(200)


def ok_json(data: JsonBody) -> Response:
    return Response(200, _dumps(data), JSON)


SLICE_ITEMS = 256   # list items encoded per hold of the GIL in ``_dump_sliced``


def ok_json_yielding(data: JsonBody) -> Response:
    """``ok_json`` for a large document, made off the HTTP thread (a /stats of many
    topics: ``Gather.off_thread``). Encoded with orjson (a /stats of 2,000 topics,
    1.2 MB: 1.6 ms against json's 20 ms on this machine), SLICE_ITEMS items of a long
    list at a time, the GIL offered between (json held it 60 ms for the 6 MB of 10,000
    topics). orjson's bytes are json's compact ones, but for floats under 1e-4 (written
    without an exponent, as Go writes them) and NaN (``null``); a part orjson refuses (an
    integer past 64 bits, a key that is not a string) is encoded by json."""
    out: list[bytes] = []
    _dump_sliced(data, out, 2)
    return Response(200, b"".join(out), JSON)


def _enc(v: object) -> bytes:
    import orjson   # (imported when first asked for: it brings datetime and platform)
    try:
        return orjson.dumps(v)
    except TypeError:       # (orjson.JSONEncodeError is one)
        return _dumps(cast("JsonBody", v))


def _dump_sliced(v: object, out: list[bytes], depth: int) -> None:
    if depth and isinstance(v, dict) and all(isinstance(k, str) for k in v):
        out.append(b"{")
        sep = b""
        for k, item in v.items():
            out.append(sep)
            out.append(_enc(k))
            out.append(b":")
            _dump_sliced(item, out, depth - 1)
            sep = b","
        out.append(b"}")
    elif isinstance(v, list) and len(v) > SLICE_ITEMS:
        out.append(b"[")
        for i in range(0, len(v), SLICE_ITEMS):
            if i:
                out.append(b",")
                time.sleep(0)          # the GIL offered to the loops and the HTTP thread
            out.append(_enc(v[i:i + SLICE_ITEMS])[1:-1])
        out.append(b"]")
    else:
        out.append(_enc(v))


def error(status: int, message: str, close: bool = False) -> Response:
    """nsqd's V1 error: ``{"message":"CODE"}`` with the status."""
    return Response(status, _dumps({"message": message}), JSON, close=close)


def tls_required(https_port: int) -> Response:
    """nsqd's answer on plain HTTP when tls_required is true (its exact body)."""
    body = b'{"message": "TLS_REQUIRED", "https_port": %d}' % https_port
    return Response(403, body, JSON)


def plain_error(status: int, detail: str = "") -> Response:
    """Go's net/http protocol-level error (bad request line, header too large, ...):
    ``<code> <reason>[: detail]`` in the status line and body, then a close."""
    reason = (REASONS.get(status, "Error") + (f": {detail}" if detail else "")).encode()
    raw = (b"HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\n"
           b"Connection: close\r\n\r\n%d %s" % (status, reason, status, reason))
    return Response(status, close=True, raw=raw)


_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def http_date(now: float) -> str:
    """RFC 1123 in GMT ("Mon, 20 Nov 1995 19:12:08 GMT"), as email.utils.formatdate(now,
    usegmt=True) writes it, without importing the email package at start-up."""
    t = time.gmtime(now)
    return (f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} {t.tm_year:04d} "
            f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT")


class DateCache:
    """The RFC 1123 Date header value, recomputed at most once a second."""

    def __init__(self) -> None:
        self._second = -1
        self.value = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self.value = http_date(now).encode()
        return self.value


def encode(r: Response, date: bytes, version: str, keep_alive: bool,
           head: bool = False) -> bytes:
    """Bytes for r in answer to a request of ``version`` ("1.0"/"1.1").

    Matches Go's net/http: an HTTP/1.0 request gets an HTTP/1.0 status line and
    ``Connection: keep-alive`` if it asked for keep-alive; an HTTP/1.1 request that
    will not be kept alive gets ``Connection: close``; HEAD gets headers only.
    """
    if r.raw is not None:
        return r.raw
    v10 = version == "1.0"
    status = r.status
    # Go's order: the handler's headers sorted by name, then Date and Content-Length,
    # then a Content-Type sniffed from the body (text), then Connection
    sniffed = r.content_type is TEXT
    named = list(r.headers)
    if r.content_type is not None and not sniffed:
        named.append(b"Content-Type: " + r.content_type + b"\r\n")
    if r.nsq:
        named.append(NSQ_HEADER)
    named.sort()
    parts: list[bytes | bytearray] = [
        b"HTTP/1.0 " if v10 else b"HTTP/1.1 ", str(status).encode(), b" ",
        REASONS.get(status, "Unknown").encode(), b"\r\n", *named,
        b"Date: ", date, b"\r\nContent-Length: ", str(len(r.body)).encode(), b"\r\n"]
    if sniffed:
        parts.append(b"Content-Type: text/plain; charset=utf-8\r\n")
    if r.close or not keep_alive:
        if not v10:
            parts.append(b"Connection: close\r\n")
    elif v10:
        parts.append(b"Connection: keep-alive\r\n")
    parts.append(b"\r\n")
    if not head:
        parts.append(r.body)
    return b"".join(parts)


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


