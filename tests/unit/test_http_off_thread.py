"""A long Gather finish runs off the HTTP thread (``Gather.off_thread``: /stats and
/metrics), never on it, and its large JSON is made a slice at a time
(``ok_json_yielding``): /ping waited up to 155 ms behind a /stats of 10,000 topics
(6 MB) on the HTTP thread. An answer is shared by the requests of its form that came
before it was begun (``collect.SharedAnswers``), and by no later one."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pybroker.http import response
from pybroker.http.collect import SharedAnswers
from pybroker.http.gather import Gather
from pybroker.http.response import Response, ok_json_yielding
from pybroker.http.server import HttpServer
from pybroker.runtime import Runtime
from pybroker.testing import wait_until
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
    if _fits(doc):      # the same bytes as the whole document encoded at once
        assert got == orjson.dumps(doc)
    assert json.loads(got) == json.loads(json.dumps(doc))   # (past 64 bits: json's parts)


def _fits(v: object) -> bool:
    """No integer past orjson's 64 bits anywhere in v."""
    if isinstance(v, bool) or not isinstance(v, (int, list, dict)):
        return True
    if isinstance(v, int):
        return -2**63 <= v < 2**64
    items = v.values() if isinstance(v, dict) else v
    return all(_fits(x) for x in items)


def test_a_stats_sized_document_is_the_same_bytes() -> None:
    doc = {"version": "1.3.0", "health": "OK", "topics": [
        {"topic_name": f"t{i}", "channels": [{"channel_name": "c", "depth": i,
                                              "clients": [{"name": "ü"}]}],
         "e2e_processing_latency": {"count": 0, "percentiles": None}}
        for i in range(2_000)], "producers": []}
    assert ok_json_yielding(doc).body == json.dumps(doc, separators=(",", ":"),
                                                    ensure_ascii=False).encode()


def test_a_full_reader_queue_refuses_a_long_finish_and_never_runs_it_here(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """An off-thread finish (it may wait for the loops) never runs on the HTTP thread:
    with MAX_FINISHES jobs waiting on the log reader it is refused as a read is (503);
    once they are done, it runs there."""
    from pybroker.http import server as server_module
    monkeypatch.setattr(server_module, "MAX_FINISHES", 3)
    server = HttpServer(rt)
    server.thread = threading.current_thread()
    reader = server.api.reader
    ran: list[str] = []
    hold = threading.Event()

    def finish(results: list[object]) -> Response:
        ran.append(threading.current_thread().name)
        return Response(200, b"done")

    def answered(conn: _Conn) -> Response:
        deadline = time.monotonic() + 10
        while not conn.answers:
            assert time.monotonic() < deadline, "no answer"
            turn(server)
        return conn.answers[0][1]

    try:
        reader.call_soon_threadsafe(hold.wait, 10)     # the reader busy with one job
        wait_until(lambda: reader._jobs.qsize() == 0, 10)
        for _ in range(3):
            reader.call_soon_threadsafe(lambda: None)
        refused = _Conn()
        server.submit(refused, object(), Gather([], finish, off_thread=True))  # type: ignore[arg-type]
        resp = answered(refused)
        assert resp.status == 503 and json.loads(resp.body) == {"message": "TOO_MANY_READS"}
        assert ran == []
        hold.set()
        wait_until(lambda: reader._jobs.qsize() == 0, 10)
        queued = _Conn()
        server.submit(queued, object(), Gather([], finish, off_thread=True))  # type: ignore[arg-type]
        assert answered(queued).body == b"done" and ran == ["logread"]
    finally:
        hold.set()
        reader.stop()
        server.close()


def test_shared_answers_serve_only_requests_that_came_before_they_were_begun() -> None:
    answers = SharedAnswers()
    made: list[int] = []

    def make() -> Response:
        made.append(len(made))
        return Response(200, b"%d" % len(made))

    a, b = answers.ticket(), answers.ticket()
    first = answers.answer("f", a, make)
    assert answers.answer("f", b, make) is first        # came before it was begun
    c = answers.ticket()
    assert answers.answer("f", c, make).body == b"2"    # came after: a new one
    assert answers.answer("g", c, make).body == b"3"    # another form: its own
    assert len(made) == 3


def test_a_ticket_taken_while_an_answer_is_made_gets_a_newer_one() -> None:
    answers = SharedAnswers()
    inside = threading.Event()
    go_on = threading.Event()
    bodies = iter([b"old", b"new"])

    def make() -> Response:
        inside.set()
        go_on.wait(10)
        return Response(200, next(bodies))

    got: list[bytes | bytearray] = []
    early = answers.ticket()
    t = threading.Thread(target=lambda: got.append(answers.answer("f", early, make).body))
    t.start()
    assert inside.wait(10)
    late = answers.ticket()            # the request comes while "old" is being made
    go_on.set()
    t.join(10)
    assert got == [b"old"]
    assert answers.answer("f", late, lambda: Response(200, b"new")).body == b"new"


def test_failed_answers_are_not_shared_and_forms_are_bounded() -> None:
    answers = SharedAnswers()
    t = answers.ticket()
    assert answers.answer("f", t, lambda: Response(500, b"x")).status == 500
    assert answers.answer("f", t, lambda: Response(200, b"y")).body == b"y"
    for i in range(SharedAnswers.FORMS + 5):
        answers.answer(("form", i), answers.ticket(), lambda: Response(200, b"z"))
    assert len(answers._made) == SharedAnswers.FORMS
    assert ("form", 0) not in answers._made
