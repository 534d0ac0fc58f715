"""The HTTP API beside nsqd's, request by request: Hypothesis draws requests (method,
endpoint, query, body, Accept header) and sends each to a real nsqd 1.3 and to pybroker, started with
the same limits and fed the same sequence; the status codes must be equal, and so must
the bodies of every answer but the documents that describe the broker itself (/stats,
/info). Names are drawn as kinds (the topic both brokers have, one new to both, an
invalid one) so a sequence changes both brokers' state the same way.
"""
from __future__ import annotations

import http.client
import os
import urllib.parse
from typing import Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.broker import BrokerProcess, unique_name
from tests.support.wire import mpub_body

EXAMPLES = max(60, int(os.environ.get("PYBROKER_FUZZ_EXAMPLES", "300")) // 2)
MAX_MSG, MAX_BODY = 64, 512
LIMITS = [f"--max-msg-size={MAX_MSG}", f"--max-body-size={MAX_BODY}"]
# answers that describe the broker (versions, start times, memory): the status only
DESCRIPTIVE = ("/stats", "/info")

ENDPOINTS = ["/pub", "/mpub", "/topic/create", "/topic/delete", "/topic/empty",
             "/topic/pause", "/topic/unpause", "/channel/create", "/channel/delete",
             "/channel/empty", "/channel/pause", "/channel/unpause", "/ping", "/info",
             "/stats", "/nope", "/pub/", "/topic/", "/channel", "/config/log_level",
             "/config/nsqlookupd_tcp_addresses", "/config/bogus", "/config/"]
KEYS = ["topic", "channel", "defer", "binary", "format", "include_clients"]
VALUES = ["", "1", "0", "-1", "3600000", "3600001", "x", "true", "false", "json", "text",
          "9" * 25]
BAD_NAMES = ["", "a" * 65, "bad!name", "sp ace", "#ephemeral", ".", "a..b", "ü"]


BODIES = st.one_of(
    st.sampled_from([b"", b"hello", b"a\nb\n", b"\n\n", b"x" * (MAX_MSG + 1),
                     b"y" * (MAX_BODY + 1), mpub_body([b"a", b"bc"]),
                     mpub_body([b""]), mpub_body([]), b"\x00\x00\x00\x02\x00",
                     b'"debug"', b'"warn"', b'"nope"', b"[]", b'["127.0.0.1:1"]', b'[1]',
                     b'"x"', b"null", b"{}"]),
    st.binary(max_size=20))


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, list[tuple[str, str]], bytes, str]:
    method = draw(st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE"]))
    path = draw(st.sampled_from(ENDPOINTS))
    query: list[tuple[str, str]] = []
    for key in draw(st.lists(st.sampled_from(KEYS), max_size=3)):
        if key in ("topic", "channel"):
            kind = draw(st.sampled_from(["known", "new", "bad", "ephemeral"]))
            value = (draw(st.sampled_from(BAD_NAMES)) if kind == "bad" else kind)
        else:
            value = draw(st.sampled_from(VALUES))
        query.append((key, value))
    accept = draw(st.sampled_from(["", "application/vnd.nsq; version=1.0", "text/plain"]))
    return method, path, query, draw(BODIES), accept


def concrete(query: list[tuple[str, str]], known: str, fresh: str) -> str:
    """The query string: name kinds replaced by the names of this example."""
    names = {"known": known, "new": fresh, "ephemeral": fresh + "#ephemeral"}
    return urllib.parse.urlencode([(k, names.get(v, v) if k in ("topic", "channel") else v)
                                   for k, v in query])


def answer(b: BrokerProcess, method: str, target: str, body: bytes,
           accept: str = "") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(*b.http_address, timeout=10)  # type: ignore[misc]
    try:
        conn.request(method, target, body=body if method in ("POST", "PUT") else None,
                     headers={"Accept": accept} if accept else {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_http_answers_match_nsqd(make_broker: Callable[..., BrokerProcess]) -> None:
    nsqd = make_broker(*LIMITS, kind="nsqd")       # first: no nsqd, no pybroker started
    ours = make_broker(*LIMITS)
    known = unique_name("fh")
    for b in (nsqd, ours):
        for path in (f"/topic/create?topic={known}",
                     f"/channel/create?topic={known}&channel={known}"):
            assert answer(b, "POST", path, b"") == (200, b""), (b.kind, path)
    mismatches: list[str] = []
    counter = iter(range(1_000_000))

    @settings(max_examples=EXAMPLES, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(req=requests())
    def run(req: tuple[str, str, list[tuple[str, str]], bytes, str]) -> None:
        method, path, query, body, accept = req
        fresh = f"{known}_{next(counter)}"
        q = concrete(query, known, fresh)
        target = path + ("?" + q if q else "")
        want = answer(nsqd, method, target, body, accept)
        got = answer(ours, method, target, body, accept)
        if path in DESCRIPTIVE:
            want, got = (want[0], b""), (got[0], b"")
        if got != want:
            mismatches.append(f"{method} {target} {body[:40]!r} Accept {accept!r}\n"
                              f"  nsqd:     {want}\n"
                              f"  pybroker: {got}")

    run()
    assert not mismatches, f"{len(mismatches)} requests answered differently:\n" + \
        "\n".join(mismatches[:15])
