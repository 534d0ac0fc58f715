"""The partitioned source's broker client: pybroker's log extensions over HTTP.

``offsets`` asks ``GET /topic/offsets``, ``read`` pages through ``GET /topic/read`` for a
range of offsets (raw records, at most ``fetch_bytes`` per request) and ``commit`` posts
``POST /channel/commit`` (pybroker/http/logread.py documents the three). One keep-alive
connection per client; stdlib only (no pyspark, no pyarrow), so it runs and is tested
anywhere.
"""
from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

from pybroker.config import split_hostport


class LogError(RuntimeError):
    """The broker refused a request or could not be reached; the message says which."""


class OffsetsLost(LogError):
    """The wanted offsets are no longer in the log (retention deleted them)."""

    def __init__(self, message: str, oldest: int, end: int) -> None:
        super().__init__(message)
        self.oldest = oldest
        self.end = end


@dataclass(frozen=True)
class Offsets:
    oldest: int         # the lowest offset the log holds
    end: int            # one past the newest readable record
    at: int | None      # the first offset at or after the asked time


@dataclass(frozen=True)
class Chunk:
    """Records [first, next) as stored in the log, back to back in ``data``."""

    first: int
    next: int
    data: bytes


class LogClient:
    def __init__(self, address: str, timeout_s: float = 30.0) -> None:
        host, port = split_hostport(address)
        self.address = address
        self.host, self.port = host, port
        self.timeout_s = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> LogClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, query: dict[str, object]
                 ) -> tuple[int, dict[str, str], bytes]:
        url = path + "?" + urllib.parse.urlencode(query)
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port,
                                                        timeout=self.timeout_s)
            try:
                self._conn.request(method, url)
                resp = self._conn.getresponse()
                body = resp.read()
            except (OSError, http.client.HTTPException) as e:
                self.close()
                if attempt:     # a kept-alive connection the server closed: once more
                    raise LogError(f"{method} http://{self.address}{path}: {e}") from e
                continue
            headers = {k.lower(): v for k, v in resp.getheaders()}
            return resp.status, headers, body
        raise AssertionError("unreachable")

    @staticmethod
    def _message(body: bytes) -> str:
        try:
            return str(json.loads(body)["message"])
        except (ValueError, KeyError, TypeError):
            return body[:200].decode("utf-8", "replace")

    def offsets(self, topic: str, ts_ms: int | None = None) -> Offsets:
        query: dict[str, object] = {"topic": topic}
        if ts_ms is not None:
            query["ts"] = ts_ms
        status, _, body = self._request("GET", "/topic/offsets", query)
        if status == 404:
            return Offsets(0, 0, 0 if ts_ms is not None else None)  # no topic yet
        if status != 200:
            raise LogError(f"/topic/offsets on {self.address}: {status} "
                           f"{self._message(body)}")
        doc = json.loads(body)
        at = doc.get("offset")
        return Offsets(int(doc["oldest_offset"]), int(doc["end_offset"]),
                       None if at is None else int(at))

    def read(self, topic: str, start: int, end: int, fetch_bytes: int) -> Iterator[Chunk]:
        """Chunks covering [start, end) in order. Raises OffsetsLost when start (or a
        later page) is below what the log holds."""
        off = start
        while off < end:
            status, h, body = self._request("GET", "/topic/read", {
                "topic": topic, "offset": off, "max_messages": end - off,
                "max_bytes": fetch_bytes})
            if status == 400 and self._message(body) == "OFFSET_OUT_OF_RANGE":
                oldest = int(h.get("x-pybroker-oldest-offset", "0"))
                top = int(h.get("x-pybroker-end-offset", "0"))
                raise OffsetsLost(f"topic {topic} on {self.address}: offsets [{off}, "
                                  f"{min(oldest, end)}) are no longer in the log (it holds "
                                  f"[{oldest}, {top}))", oldest, top)
            if status == 404:
                raise OffsetsLost(f"topic {topic} is gone from {self.address}", 0, 0)
            if status != 200:
                raise LogError(f"/topic/read on {self.address}: {status} "
                               f"{self._message(body)}")
            first = int(h["x-pybroker-first-offset"])
            nxt = int(h["x-pybroker-next-offset"])
            if nxt <= off:
                raise LogError(f"/topic/read on {self.address} made no progress at {off}")
            yield Chunk(first, nxt, body)
            off = nxt

    def commit(self, topic: str, channel: str, offset: int) -> int:
        """Move channel's cursor forward to offset; returns the cursor."""
        status, _, body = self._request("POST", "/channel/commit", {
            "topic": topic, "channel": channel, "offset": offset})
        if status != 200:
            raise LogError(f"/channel/commit on {self.address}: {status} "
                           f"{self._message(body)}")
        return int(json.loads(body)["offset"])

    def rewind(self, topic: str, channel: str, offset: int) -> None:
        """Move channel's cursor back to offset (``POST /channel/rewind``)."""
        status, _, body = self._request("POST", "/channel/rewind", {
            "topic": topic, "channel": channel, "offset": offset})
        if status != 200:
            raise LogError(f"/channel/rewind on {self.address}: {status} "
                           f"{self._message(body)}")
