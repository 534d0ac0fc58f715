"""Beyond nsqd: a topic's log read by offset, for consumers that keep their own offsets
(the partitioned Spark source, docs/spark.md). NSQ clients never see these routes.

``GET /topic/offsets?topic=T[&ts=UNIX_MS]``
    ``{"oldest_offset", "end_offset", "newest_offset"[, "offset"]}``: the lowest offset
    held, one past the newest readable (the topic's ``released``), and with ``ts`` the
    first offset published at or after that time (``end_offset`` if none).
``GET /topic/read?topic=T&offset=N[&max_messages=K][&max_bytes=B]``
    The log's records from N on, as stored (docs/storage.md: ``[u32 crc][u32 length]
    [u64 offset] payload``, back to back) in one ``application/octet-stream`` body of at
    most ``max_bytes`` (capped at 4 MiB; a single larger record is sent whole), at most
    ``max_messages`` records, never past ``end_offset``. Headers: ``X-Pybroker-First-
    Offset`` (the first record's offset: above N only where damaged records were
    skipped), ``X-Pybroker-Next-Offset`` (where to continue), ``X-Pybroker-Count``,
    ``X-Pybroker-Oldest-Offset``, ``X-Pybroker-End-Offset``. An offset outside
    ``[oldest, end]`` gets 400 ``OFFSET_OUT_OF_RANGE`` with the same two range headers.
``POST /channel/commit?topic=T&channel=C&offset=N``
    Move channel C's cursor forward to N (creating C at N if it does not exist): what
    is below is finished for it, so retention may delete it. Never moves a cursor back
    (that is ``/channel/rewind``). ``{"offset": cursor}``.

The arguments are checked on the HTTP thread; the reads (a log read: at most 4 MiB,
from the memory tail or read from the segment files by a cursor that reads ahead at
most the page's bytes, kept for the next page: http/reader.py; a lookup by
time: a bisect and one read of at most 64 KiB plus a record, storage/timeindex.py) run
on the log reader thread (http/reader.py), so no request holds the HTTP thread while
the disk answers. The cursor move is a job on the channel's owner loop.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pybroker.http.gather import Gather
from pybroker.http.reader import CursorCache
from pybroker.http.request import Request, first
from pybroker.http.response import Response, error, ok_json
from pybroker.protocol.names import is_valid_name
from pybroker.storage.topiclog import REC_HEADER, OffsetOutOfRange

if TYPE_CHECKING:
    from pybroker.core.channel import Channel
    from pybroker.core.seams import LogReader as LogCursor
    from pybroker.core.topic import Topic
    from pybroker.http.views import ApiView

MS = 1_000_000
MAX_READ_BYTES = 4 * 1024 * 1024
READ_AHEAD_MIN = 64 * 1024      # a /topic/read cursor's smallest read
DEFAULT_READ_MESSAGES = 100_000
OCTETS = b"application/octet-stream"


def _uint(q: dict[bytes, list[bytes]], name: bytes, default: int | None) -> int | None:
    """A non-negative integer argument; raises ValueError when malformed."""
    arg = first(q, name)
    if arg is None:
        return default
    if not arg.isdigit() or len(arg) > 19:
        raise ValueError(name.decode())
    return int(arg)


def _range_headers(oldest: int, end: int) -> tuple[bytes, ...]:
    return (b"X-Pybroker-Oldest-Offset: %d\r\n" % oldest,
            b"X-Pybroker-End-Offset: %d\r\n" % end)


def _topic(api: ApiView, req: Request) -> tuple[dict[bytes, list[bytes]], Topic] | Response:
    """The request's arguments and its existing topic, or the error that answers it."""
    q = api._params(req)
    name = first(q, b"topic")
    if name is None:
        return error(400, "MISSING_ARG_TOPIC")
    if not is_valid_name(name):
        return error(400, "INVALID_ARG_TOPIC")
    return q, api._existing_topic(name.decode())


def _busy(api: ApiView) -> Response | None:
    return error(503, "TOO_MANY_READS") if api.reader.busy() else None


def _answer(results: list[object]) -> Response:
    got = results[0] if results else None
    return got if isinstance(got, Response) else error(500, "INTERNAL_ERROR")


def topic_offsets(api: ApiView, req: Request) -> Response | Gather[Response]:
    found = _topic(api, req)
    if isinstance(found, Response):
        return found
    q, t = found
    try:
        ts = _uint(q, b"ts", None)
    except ValueError:
        return error(400, "INVALID_ARG_TS")
    if ts is None:
        return _offsets(t, None)
    return _busy(api) or Gather([(api.reader, _offsets, (t, ts))], _answer, timeout_s=10.0)


def _offsets(t: Topic, ts: int | None) -> Response:
    """The topic's range and, with ts, the lookup by time (on the reader thread)."""
    lg = t.log
    end = t.released
    doc = {"topic": t.name, "oldest_offset": lg.oldest, "end_offset": end,
           "newest_offset": end - 1}
    if ts is not None:
        doc["offset"] = min(lg.offset_for_time(ts * MS), end)
    return ok_json(doc)


def _records_end(buf: bytes | bytearray, pos: Sequence[int], k: int) -> int:
    """Position in buf just past record k - 1 (records are back to back)."""
    if k < len(pos):
        return int(pos[k])
    p = int(pos[k - 1])
    return p + REC_HEADER + int.from_bytes(buf[p + 4:p + 8], "big")


def topic_read(api: ApiView, req: Request) -> Response | Gather[Response]:
    found = _topic(api, req)
    if isinstance(found, Response):
        return found
    q, t = found
    try:
        offset = _uint(q, b"offset", None)
    except ValueError:
        return error(400, "INVALID_ARG_OFFSET")
    if offset is None:
        return error(400, "MISSING_ARG_OFFSET")
    try:
        max_messages = _uint(q, b"max_messages", DEFAULT_READ_MESSAGES)
        max_bytes = _uint(q, b"max_bytes", MAX_READ_BYTES)
    except ValueError as bad:
        return error(400, f"INVALID_ARG_{str(bad).upper()}")
    assert max_messages is not None and max_bytes is not None
    if max_messages < 1:
        return error(400, "INVALID_ARG_MAX_MESSAGES")
    if max_bytes < 1:
        return error(400, "INVALID_ARG_MAX_BYTES")
    max_bytes = min(max_bytes, MAX_READ_BYTES)
    lg = t.log
    end = t.released
    if not lg.oldest <= offset <= end:
        r = error(400, "OFFSET_OUT_OF_RANGE")
        r.headers = _range_headers(lg.oldest, end)
        return r
    return _busy(api) or Gather([(api.reader, _read, (t, offset, max_messages, max_bytes,
                                                      api.reader.cursors))],
                                _answer, timeout_s=10.0)


def _read(t: Topic, offset: int, max_messages: int, max_bytes: int,
          cursors: CursorCache | None = None) -> Response:
    """On the reader thread: the records from offset on, as /topic/read answers them,
    read through a cursor (the one the previous page left at offset, if kept)."""
    lg = t.log
    cur = cursors.take(lg, offset) if cursors is not None else None
    if cur is None:
        cur = lg.cursor(READ_AHEAD_MIN, MAX_READ_BYTES)
    nxt = -1
    try:
        r, nxt = _page(t, cur, offset, max_messages, max_bytes)
        return r
    finally:
        if cursors is not None and nxt >= 0:
            cursors.put(lg, cur, nxt)
        else:
            cur.release()


def _page(t: Topic, cur: LogCursor, offset: int, max_messages: int,
          max_bytes: int) -> tuple[Response, int]:
    """The answer, and the offset the next page starts at (-1: an error)."""
    lg = t.log
    end = t.released
    limit = min(end, offset + max_messages)
    body = bytearray()      # each part copied at once: the cursor's next read reuses its buffer
    start = off = offset
    while off < limit and len(body) < max_bytes:
        size = len(body)
        try:
            b = cur.read(off, limit - off, max_bytes - size, limit - off)
        except OffsetOutOfRange:
            if not body:   # retention deleted it since the check above
                r = error(400, "OFFSET_OUT_OF_RANGE")
                r.headers = _range_headers(lg.oldest, t.released)
                return r, -1
            break
        if b.n == 0:
            if b.first > off and not body:   # damaged records at the end: skipped
                start = off = min(b.first, limit)
            break
        if b.first != off:
            if body:       # a gap (damaged records): the next request starts there
                break
            start = off = b.first
            if off >= limit:
                break
        n = min(b.n, limit - off)
        pos, buf = b.pos, b.buf
        p0 = int(pos[0])
        # whole records within the byte budget (at least one per response)
        budget = max_bytes - size
        k = bisect.bisect_right(pos, p0 + budget, 1, n) - 1
        if k == n - 1 and _records_end(buf, pos, n) - p0 <= budget:
            k = n
        if k == 0:
            if body:
                break
            k = 1
        e = _records_end(buf, pos, k)
        body += memoryview(buf)[p0:e]
        off += k
        if k < n:
            break
    headers = (b"X-Pybroker-First-Offset: %d\r\n" % start,
               b"X-Pybroker-Next-Offset: %d\r\n" % off,
               b"X-Pybroker-Count: %d\r\n" % (off - start),
               *_range_headers(lg.oldest, t.released))
    return Response(200, body, OCTETS, nsq=False, headers=headers), off


def _channel_commit(ch: Channel, offset: int, created: bool) -> int:
    """On ch's owner loop: move the cursor forward to offset (a new channel: to it)."""
    if ch.deleted:
        return -1
    if created:
        ch.cursor = offset
        ch.start_offset = offset
        return offset
    return ch.commit(offset)


def channel_commit(api: ApiView, req: Request) -> Response | Gather[Response]:
    found = _topic(api, req)
    if isinstance(found, Response):
        return found
    q, t = found
    name = first(q, b"channel")
    if name is None:
        return error(400, "MISSING_ARG_CHANNEL")
    if not is_valid_name(name):
        return error(400, "INVALID_ARG_CHANNEL")
    try:
        offset = _uint(q, b"offset", None)
    except ValueError:
        return error(400, "INVALID_ARG_OFFSET")
    if offset is None:
        return error(400, "MISSING_ARG_OFFSET")
    if not t.log.oldest <= offset <= t.released:
        r = error(400, "OFFSET_OUT_OF_RANGE")
        r.headers = _range_headers(t.log.oldest, t.released)
        return r
    created = t.find_channel(name.decode()) is None
    ch = api.broker.get_channel(t, name.decode())

    def done(results: list[object]) -> Response:
        if not results or not isinstance(results[0], int) or results[0] < 0:
            return error(404, "CHANNEL_NOT_FOUND")
        return ok_json({"offset": results[0]})

    return Gather([(ch.owner, _channel_commit, (ch, offset, created))], done)
