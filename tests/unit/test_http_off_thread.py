"""A long Gather finish runs off the HTTP thread (``Gather.off_thread``: /stats and
/metrics), and its large JSON is made a slice at a time (``ok_json_yielding``): /ping
waited up to 155 ms behind a /stats of 10,000 topics (6 MB) on the HTTP thread."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pybroker.http import response
from pybroker.http.gather import Gather
from pybroker.http.response import Response, ok_json_yielding
from pybroker.http.server import HttpServer
from pybroker.runtime import Runtime
from tests.support.inproc import temp_runtime, turn


class _Conn:
    """What the server's completion needs of a connection."""

    def __init__(self) -> None:
        self.answers: list[tuple[object, Response, str]] = []

    def complete(self, req: object, resp: Response) -> None:
        self.answers.append((req, resp, threading.current_thread().name))


@pytest.fixture
def rt() -> Iterator[Runtime]:
    with temp_runtime("httpoff-") as r:
        yield r


@pytest.mark.parametrize("off", [True, False])
def test_a_long_finish_runs_on_the_reader_thread(rt: Runtime, off: bool) -> None:
    server = HttpServer(rt)
    server.thread = threading.current_thread()       # this thread runs its turns
    finished_on: list[str] = []

    def finish(results: list[object]) -> Response:
        finished_on.append(threading.current_thread().name)
        return Response(200, b"done")

    conn = _Conn()
    req = object()
    try:
        server.submit(conn, req, Gather([], finish, off_thread=off))  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while not conn.answers:
            assert time.monotonic() < deadline, "no answer"
            turn(server)
        assert finished_on == (["logread"] if off else [threading.current_thread().name])
        (got_req, resp, answered_on), = conn.answers
        # the answer is written by the HTTP thread (here: the one running its turns)
        assert got_req is req and resp.body == b"done"
        assert answered_on == threading.current_thread().name
    finally:
        server.api.reader.stop()
        server.close()


JSONS = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=12)
    | st.dictionaries(st.text(max_size=6), inner, max_size=6),
    max_leaves=60)


@settings(max_examples=300, deadline=None)
@given(doc=JSONS)
def test_the_sliced_encoding_is_the_same_bytes(doc: object) -> None:
    original = response.SLICE_ITEMS
    response.SLICE_ITEMS = 3            # slices of 3: long lists everywhere
    try:
        got = ok_json_yielding(doc).body  # type: ignore[arg-type]
    finally:
        response.SLICE_ITEMS = original
    assert got == json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def test_a_stats_sized_document_is_the_same_bytes() -> None:
    doc = {"version": "1.3.0", "health": "OK", "topics": [
        {"topic_name": f"t{i}", "channels": [{"channel_name": "c", "depth": i,
                                              "clients": [{"name": "ü"}]}],
         "e2e_processing_latency": {"count": 0, "percentiles": None}}
        for i in range(2_000)], "producers": []}
    assert ok_json_yielding(doc).body == json.dumps(doc, separators=(",", ":"),
                                                    ensure_ascii=False).encode()
