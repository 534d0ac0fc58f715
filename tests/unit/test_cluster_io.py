"""The replication connection's framing (pybroker.cluster.wire) and the etcd client's
budgets (pybroker.cluster.etcd) against hostile peers: an oversized frame, a head that
is not JSON, an etcd that trickles its answer, one that answers a bomb, one that is not
JSON, one that refuses. The happy path against a real etcd is in
tests/integration/test_replication.py (every node talks to it)."""
from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Callable, Iterator

import pytest

from pybroker.cluster import etcd as etcd_mod
from pybroker.cluster.etcd import Etcd, EtcdError, prefix_end
from pybroker.cluster.wire import MAX_FRAME, MAX_HEAD, MAX_TOPICS, FrameReader, WireError, \
    encode, encode_compact_answer, encode_compact_fetch, frame_need, is_json, \
    parse_compact_answer, parse_compact_fetch, parse_head


# -- wire -------------------------------------------------------------------------------
def _trickled(data: bytes) -> tuple[FrameReader, list[tuple[bytes, bytes]]]:
    """The frames (raw head, blob) a reader makes of data fed one byte at a time (a
    trickling peer)."""
    r = FrameReader()
    frames = []
    for i in range(len(data)):
        r.feed(data[i:i + 1])
        f = r.next_raw()
        if f is not None:
            frames.append((f[0], bytes(f[1])))
    return r, frames


def test_frames_round_trip_in_pieces() -> None:
    data = b"".join(encode({"op": "fetch", "n": 1}, b"records")) + \
        b"".join(encode({"op": "x"}))
    r, frames = _trickled(data)
    assert [(parse_head(h), b) for h, b in frames] == [({"op": "fetch", "n": 1}, b"records"),
                                                       ({"op": "x"}, b"")]
    assert r.pending() == 0


@pytest.mark.parametrize("size,hlen", [(MAX_FRAME + 1, 4), (100, MAX_HEAD + 1), (10, 20)])
def test_a_frame_over_the_limits_is_refused_before_it_is_read(size: int, hlen: int) -> None:
    r = FrameReader()
    r.feed(struct.pack(">II", size, hlen))     # only the header: nothing is buffered for it
    with pytest.raises(WireError):
        r.next()


@pytest.mark.parametrize("head", [b"not json", b"[1, 2]", b"\xff\xfe"])
def test_a_head_that_is_not_a_json_object_is_refused(head: bytes) -> None:
    r = FrameReader()
    r.feed(struct.pack(">II", 4 + len(head), len(head)) + head)
    with pytest.raises(WireError):
        r.next()


def test_frame_need_and_the_sender_refuse_oversized() -> None:
    assert frame_need(b"") == 8
    assert frame_need(struct.pack(">II", 10, 2)) == 6
    with pytest.raises(WireError):
        encode({"x": "y" * MAX_HEAD})


def test_compact_heads_round_trip_beside_json_ones() -> None:
    data = b"".join(encode_compact_fetch(3, 500, 1 << 21, [0, 7, 1 << 40])) + \
        b"".join(encode_compact_answer([(7, 9, 6), (1 << 40, 1 << 40, 0), (2, 3, 4)],
                                       [b"abcdef", b"ghij"])) + b"".join(encode({"op": "x"}))
    r, frames = _trickled(data)
    fetch, answer, js = frames
    assert not is_json(fetch[0]) and not is_json(answer[0]) and is_json(js[0])
    assert parse_compact_fetch(fetch[0]) == (3, 500, 1 << 21, [0, 7, 1 << 40])
    assert parse_compact_answer(answer[0], len(answer[1])) == [
        (7, 9, 6), (1 << 40, 1 << 40, 0), (2, 3, 4)]
    assert bytes(answer[1]) == b"abcdefghij"
    assert r.next_raw() is None and r.pending() == 0


_FETCH_HEAD = struct.pack(">BiIIH", 1, 3, 500, 100, 2) + struct.pack(">2Q", 1, 2)
_ANSWER_HEAD = struct.pack(">BH", 2, 1) + struct.pack(">QQI", 0, 5, 10)


@pytest.mark.parametrize("head", [
    b"", b"\x01\x00",                                   # too short
    b"\x02" + _FETCH_HEAD[1:],                          # an answer's kind
    _FETCH_HEAD[:-1],                                   # an offset cut short
    _FETCH_HEAD + b"\x00" * 8,                          # more offsets than it says
    struct.pack(">BiIIH", 1, 3, 500, 100, MAX_TOPICS + 1)
    + b"\x00" * 8 * (MAX_TOPICS + 1),                   # over the topics a request names
])
def test_a_malformed_compact_fetch_is_refused(head: bytes) -> None:
    with pytest.raises(WireError):
        parse_compact_fetch(head)


@pytest.mark.parametrize("head,blob_len", [
    (_ANSWER_HEAD, 9), (_ANSWER_HEAD, 11),             # records that do not fill the blob
    (b"\x01" + _ANSWER_HEAD[1:], 10),                   # a request's kind
    (_ANSWER_HEAD[:-2], 10),                            # an entry cut short
    (struct.pack(">BH", 2, 2) + _ANSWER_HEAD[3:], 10),  # more entries than it holds
    (b"\x02", 0),
])
def test_a_malformed_compact_answer_is_refused(head: bytes, blob_len: int) -> None:
    with pytest.raises(WireError):
        parse_compact_answer(head, blob_len)


def test_a_compact_head_is_not_json_to_a_json_reader() -> None:
    r = FrameReader()
    r.feed(b"".join(encode_compact_fetch(3, 0, 0, [1])))
    with pytest.raises(WireError):
        r.next()


# -- etcd client ------------------------------------------------------------------------
def _server(handler: Callable[[socket.socket], None]) -> Iterator[str]:
    lsock = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def run() -> None:
        lsock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = lsock.accept()
            except OSError:
                continue
            with conn:
                try:
                    conn.recv(65536)
                    handler(conn)
                except OSError:
                    pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{lsock.getsockname()[1]}"
    finally:
        stop.set()
        t.join(5)
        lsock.close()


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[socket.socket], None]], str]]:
    gens: list[Iterator[str]] = []

    def start(handler: Callable[[socket.socket], None]) -> str:
        g = _server(handler)
        gens.append(g)
        return next(g)

    yield start
    for g in gens:
        for _ in g:
            pass


def _answer(body: bytes, status: str = "200 OK") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def test_happy_answer(serve: Callable[..., str]) -> None:
    url = serve(lambda c: c.sendall(_answer(b'{"header": {"revision": "7"}, "kvs": []}')))
    assert Etcd(url, timeout_s=2).get_prefix("/pybroker/") == (7, [])


def test_a_trickled_answer_is_cut_at_the_deadline(serve: Callable[..., str]) -> None:
    def trickle(c: socket.socket) -> None:
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        for _ in range(100):
            c.sendall(b" ")
            time.sleep(0.05)
    url = serve(trickle)
    t0 = time.monotonic()
    with pytest.raises(EtcdError):
        Etcd(url, timeout_s=0.5).get("/k")
    assert time.monotonic() - t0 < 1.5      # the whole call, not each read


def test_an_answer_over_the_limit_is_refused(serve: Callable[..., str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(etcd_mod, "MAX_RESPONSE", 100_000)
    big = b'{"kvs": "' + b"A" * 1_000_000 + b'"}'
    url = serve(lambda c: c.sendall(_answer(big)))
    with pytest.raises(EtcdError, match="over"):
        Etcd(url, timeout_s=5).get("/k")


@pytest.mark.parametrize("reply", [_answer(b"<html>nope"),
                                   _answer(b'{"error": "etcdserver: no lease"}',
                                           "404 Not Found"),
                                   b"garbage\r\n\r\n"])
def test_bad_answers_are_errors(serve: Callable[..., str], reply: bytes) -> None:
    url = serve(lambda c: c.sendall(reply))
    with pytest.raises(EtcdError):
        Etcd(url, timeout_s=2).keepalive(1)


def test_no_etcd_is_an_error_in_time() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()                                # nothing listens there
    with pytest.raises(EtcdError):
        Etcd(f"http://127.0.0.1:{port}", timeout_s=1).grant(5)


def test_urls_and_ranges() -> None:
    with pytest.raises(ValueError):
        Etcd("https://127.0.0.1:2379")
    assert Etcd("127.0.0.1:2400").port == 2400
    assert prefix_end("/pybroker/") == "/pybroker0"
