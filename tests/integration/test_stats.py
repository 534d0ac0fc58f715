"""/stats on a running broker: the JSON document field by field (names, order, types)
for topics, channels, clients, producers and memory; the counts after a scripted
consumer session; filters; sorting; the text format; e2e latency percentiles.

Runs against pybroker and, when the binary is found, a real nsqd 1.3.0, which must give
the same document shape and the same counts.
"""
from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.wire import WireClient

DOC_KEYS = ["version", "health", "start_time", "topics", "memory", "producers"]
TOPIC_KEYS = {"topic_name": str, "channels": list, "depth": int, "backend_depth": int,
              "message_count": int, "message_bytes": int, "paused": bool,
              "e2e_processing_latency": dict}
CHANNEL_KEYS = {"channel_name": str, "depth": int, "backend_depth": int,
                "in_flight_count": int, "deferred_count": int, "message_count": int,
                "requeue_count": int, "timeout_count": int, "client_count": int,
                "clients": (list, type(None)), "paused": bool, "e2e_processing_latency": dict}
CLIENT_KEYS = {"client_id": str, "hostname": str, "version": str, "remote_address": str,
               "state": int, "ready_count": int, "in_flight_count": int, "message_count": int,
               "finish_count": int, "requeue_count": int, "connect_ts": int, "sample_rate": int,
               "deflate": bool, "snappy": bool, "user_agent": str, "tls": bool,
               "tls_cipher_suite": str, "tls_version": str, "tls_negotiated_protocol": str,
               "tls_negotiated_protocol_is_mutual": bool}
MEMORY_KEYS = ["heap_objects", "heap_idle_bytes", "heap_in_use_bytes", "heap_released_bytes",
               "gc_pause_usec_100", "gc_pause_usec_99", "gc_pause_usec_95", "next_gc_bytes",
               "gc_total_runs"]


def get(b: BrokerProcess, query: str) -> bytes:
    with urllib.request.urlopen(f"http://{b.http_hostport}/stats?{query}", timeout=10) as r:
        assert r.status == 200
        data: bytes = r.read()
        return data


def doc(b: BrokerProcess, query: str = "") -> dict[str, Any]:
    d: dict[str, Any] = json.loads(get(b, "format=json&" + query))
    return d


# -- shape checks (field names, order, JSON types) ----------------------------------------
# pybroker's extra keys (its topic log), after nsqd's own, which stay as nsqd has them
EXTRA_KEYS = {"oldest_offset": int, "newest_offset": int, "log_bytes_read": int, "cursor": int,
              "max_attempts": int, "dead_letter_topic": str, "dead_letter_count": int,
              "dead_letter_pending": int, "dead_letter_cycles": int}


def check_typed(obj: dict[str, Any], spec: dict[str, Any], what: str) -> None:
    keys = list(obj)
    assert keys[:len(spec)] == list(spec), f"{what}: keys {keys}"
    assert set(keys[len(spec):]) <= set(EXTRA_KEYS), f"{what}: keys {keys}"
    for key in keys[len(spec):]:
        assert isinstance(obj[key], EXTRA_KEYS[key]), f"{what}.{key} = {obj[key]!r}"
    for key, kind in spec.items():
        value = obj[key]
        assert isinstance(value, kind), f"{what}.{key} = {value!r} is not {kind}"
        if kind is int:
            assert not isinstance(value, bool), f"{what}.{key} is a bool"


def check_e2e(e2e: dict[str, Any], what: str) -> None:
    assert list(e2e) == ["count", "percentiles"], what
    assert isinstance(e2e["count"], int)
    if e2e["percentiles"] is not None:
        for p in e2e["percentiles"]:
            assert sorted(p) == ["quantile", "value"], what
            assert isinstance(p["quantile"], float) and isinstance(p["value"], (int, float))


def check_client(c: dict[str, Any], what: str) -> None:
    spec = dict(CLIENT_KEYS)
    if "pub_counts" in c:  # omitted when empty (nsqd's omitempty), after user_agent
        items = list(spec.items())
        i = list(spec).index("user_agent") + 1
        spec = dict(items[:i] + [("pub_counts", list)] + items[i:])
        for p in c["pub_counts"]:
            assert list(p) == ["topic", "count"] and isinstance(p["count"], int), what
    check_typed(c, spec, what)
    assert c["version"] == "V2"


def check_document(d: dict[str, Any]) -> None:
    keys = [k for k in DOC_KEYS if k != "memory" or "memory" in d]
    if "codec" in d:     # pybroker's extra key, after nsqd's: which frame codec runs
        assert d["codec"] in ("c", "pure")
        keys.append("codec")
    if "refused_connections" in d:   # pybroker's extra key: connections refused per listener
        assert sorted(d["refused_connections"]) == ["http", "tcp"]
        assert all(isinstance(v, int) for v in d["refused_connections"].values())
        keys.append("refused_connections")
    assert list(d) == keys
    assert d["health"] == "OK"
    assert tuple(int(x) for x in d["version"].split(".")) <= (1, 3, 0)  # semver for nsqadmin
    assert isinstance(d["start_time"], int)
    if "memory" in d:
        assert list(d["memory"]) == MEMORY_KEYS
        assert all(isinstance(v, int) for v in d["memory"].values())
    for t in d["topics"] or ():
        check_typed(t, TOPIC_KEYS, f"topic {t['topic_name']}")
        check_e2e(t["e2e_processing_latency"], t["topic_name"])
        for c in t["channels"]:
            check_typed(c, CHANNEL_KEYS, f"channel {c['channel_name']}")
            check_e2e(c["e2e_processing_latency"], c["channel_name"])
            for client in c["clients"] or ():
                check_client(client, f"client of {c['channel_name']}")
    assert d["producers"] is None or isinstance(d["producers"], list)
    for p in d["producers"] or ():
        check_client(p, "producer")
        assert p["pub_counts"]


# -- the scripted session -------------------------------------------------------------------
class Session:
    """Producer and consumer in known states: see ``start``."""

    def __init__(self, b: BrokerProcess) -> None:
        self.b = b
        self.topic = unique_name("st")
        self.other = unique_name("st_other")
        self.producer_id = unique_name("prod")
        self.consumer_id = unique_name("cons")
        self.clients: list[WireClient] = []

    def start(self) -> None:
        """5 messages; channels "b" and "a" (created in that order); the consumer on "a"
        holds 2 in flight, 1 deferred by REQ, finished 1; "a" has 1 queued."""
        b, t = self.b, self.topic
        assert b.tcp_address
        for ch in ("b", "a"):
            _create(b, t, ch)
        prod = WireClient.connect(b.tcp_address)
        self.clients.append(prod)
        prod.identify(client_id=self.producer_id, hostname="prod-host", user_agent="stats/1")
        for i in range(5):
            prod.pub(t, b"msg-%d" % i)
        prod.pub(self.other, b"elsewhere")
        cons = WireClient.connect(b.tcp_address)
        self.clients.append(cons)
        cons.identify(client_id=self.consumer_id, hostname="cons-host", user_agent="stats/2",
                      msg_timeout=3000)
        cons.sub(t, "a")
        cons.rdy(2)
        m1, m2 = cons.read_messages(2)
        cons.fin(m1.id)
        cons.read_message()  # m3 takes m1's place
        cons.req(m2.id, 60_000)  # deferred
        cons.read_message()  # m4 takes m2's place
        cons.rdy(0)
        self.consumer = cons

        def settled() -> bool:
            # the REQ and the RDY 0 after it (the REQ alone may be seen before the RDY)
            c = self.channel("a")
            return c["deferred_count"] == 1 and [cl["ready_count"] for cl in c["clients"]] == [0]

        wait_until(settled, what="the REQ and the RDY 0")

    def topic_doc(self, query: str = "") -> dict[str, Any]:
        d = doc(self.b, f"topic={self.topic}&" + query)
        assert len(d["topics"]) == 1
        t: dict[str, Any] = d["topics"][0]
        return t

    def channel(self, name: str) -> dict[str, Any]:
        chans = {c["channel_name"]: c for c in self.topic_doc()["channels"]}
        c: dict[str, Any] = chans[name]
        return c

    def close(self) -> None:
        for c in self.clients:
            c.close()


def _create(b: BrokerProcess, t: str, ch: str) -> None:
    for path in (f"/topic/create?topic={t}", f"/channel/create?topic={t}&channel={ch}"):
        urllib.request.urlopen(urllib.request.Request(f"http://{b.http_hostport}{path}", b""),
                               timeout=5)


@pytest.fixture
def session(any_broker: BrokerProcess) -> Any:
    s = Session(any_broker)
    s.start()
    yield s
    s.close()


def test_document_shape(session: Session) -> None:
    check_document(doc(session.b))
    check_document(doc(session.b, "include_mem=false"))
    check_document(doc(session.b, f"topic={session.topic}"))


def test_counts_after_a_consumer_session(session: Session) -> None:
    t = session.topic_doc()
    assert (t["topic_name"], t["depth"], t["backend_depth"]) == (session.topic, 0, 0)
    assert (t["message_count"], t["message_bytes"], t["paused"]) == (5, 25, False)
    assert [c["channel_name"] for c in t["channels"]] == ["a", "b"]  # sorted by name
    a, b = t["channels"]
    assert {k: a[k] for k in ("depth", "in_flight_count", "deferred_count", "message_count",
                              "requeue_count", "timeout_count", "client_count", "paused")} == {
        "depth": 1, "in_flight_count": 2, "deferred_count": 1, "message_count": 5,
        "requeue_count": 1, "timeout_count": 0, "client_count": 1, "paused": False}
    assert (b["depth"], b["in_flight_count"], b["client_count"], b["clients"]) == (5, 0, 0, [])
    (client,) = a["clients"]
    assert client["client_id"] == session.consumer_id
    assert (client["hostname"], client["user_agent"]) == ("cons-host", "stats/2")
    host, port = session.consumer.sock.getsockname()[:2]
    assert client["remote_address"] == f"{host}:{port}"
    assert {k: client[k] for k in ("state", "ready_count", "in_flight_count", "message_count",
                                   "finish_count", "requeue_count", "sample_rate")} == {
        "state": 3, "ready_count": 0, "in_flight_count": 2, "message_count": 4,
        "finish_count": 1, "requeue_count": 1, "sample_rate": 0}
    assert abs(client["connect_ts"] - time.time()) < 60
    assert "pub_counts" not in client


def test_timeouts_are_counted(session: Session) -> None:
    # the two in-flight messages time out (msg_timeout 3 s) and go back to the queue
    wait_until(lambda: session.channel("a")["timeout_count"] == 2, timeout_s=10,
               what="2 timeouts")
    a = session.channel("a")
    assert (a["depth"], a["in_flight_count"], a["deferred_count"]) == (3, 0, 1)
    assert a["clients"][0]["in_flight_count"] == 0


def test_producers(session: Session) -> None:
    d = doc(session.b, f"topic={session.topic}&include_mem=false")
    (prod,) = [p for p in d["producers"] if p["client_id"] == session.producer_id]
    assert prod["pub_counts"] == [{"topic": session.topic, "count": 5}]
    assert (prod["state"], prod["ready_count"], prod["hostname"]) == (0, 0, "prod-host")
    d = doc(session.b, f"topic={session.other}&include_mem=false")
    (prod,) = [p for p in d["producers"] if p["client_id"] == session.producer_id]
    assert prod["pub_counts"] == [{"topic": session.other, "count": 1}]
    assert not [p for p in d["producers"] if p["client_id"] == session.consumer_id]


def test_filters(session: Session) -> None:
    b, t = session.b, session.topic
    d = doc(b, f"topic={t}&channel=b")
    assert [c["channel_name"] for c in d["topics"][0]["channels"]] == ["b"]
    d = doc(b, f"topic={t}&channel=nope")
    assert d["topics"] == [] and "memory" in d
    d = doc(b, "topic=nope_at_all&include_mem=false")
    assert (d["topics"], d["producers"]) == (None, None)
    d = doc(b, f"topic={t}&include_clients=false&include_mem=0")
    assert "memory" not in d and d["producers"] is None
    assert [c["clients"] for c in d["topics"][0]["channels"]] == [None, None]
    assert d["topics"][0]["channels"][0]["client_count"] == 1
    d = doc(b, f"topic={t}&include_clients=maybe&include_mem=true")  # not false: true
    assert "memory" in d and d["topics"][0]["channels"][0]["clients"]


def test_topics_are_sorted(any_broker: BrokerProcess) -> None:
    names = [unique_name(p) for p in ("zz", "mm", "aa")]
    for n in names:
        _create(any_broker, n, "c")
    listed = [t["topic_name"] for t in doc(any_broker, "include_mem=false")["topics"]]
    assert listed == sorted(listed)
    assert set(names) <= set(listed)


def test_paused_flags(any_broker: BrokerProcess) -> None:
    t = unique_name("stp")
    _create(any_broker, t, "c")
    for path in (f"/topic/pause?topic={t}", f"/channel/pause?topic={t}&channel=c"):
        urllib.request.urlopen(urllib.request.Request(f"http://{any_broker.http_hostport}{path}",
                                                      b""), timeout=5)
    d = doc(any_broker, f"topic={t}")["topics"][0]
    assert (d["paused"], d["channels"][0]["paused"]) == (True, True)
    text = get(any_broker, f"topic={t}").decode()
    assert f"*P [{t:<15}]" in text and f"   *P [{'c':<25}]" in text


def test_no_e2e_percentiles_unless_configured(any_broker: BrokerProcess) -> None:
    t = unique_name("ste")
    _create(any_broker, t, "c")
    d = doc(any_broker, f"topic={t}")["topics"][0]
    assert d["e2e_processing_latency"] == {"count": 0, "percentiles": None}
    assert d["channels"][0]["e2e_processing_latency"] == {"count": 0, "percentiles": None}


def test_text_format(session: Session) -> None:
    text = get(session.b, f"topic={session.topic}").decode()
    lines = text.splitlines()
    assert re.fullmatch(r"nsqd v1\.3\.0 \(.*\)", lines[0])
    assert re.fullmatch(r"start_time \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(Z|[+-]\d\d:\d\d)", lines[1])
    assert re.fullmatch(r"uptime (\d+h)?(\d+m)?[\d.]+(s|ms|µs)", lines[2])
    assert lines[3:5] == ["", "Health: OK"]
    assert "Memory:" in lines and any(ln.startswith("   heap_objects ") for ln in lines)
    t = session.topic
    assert (f"   [{t:<15}] depth: 0     be-depth: 0     msgs: 5        e2e%: ") in lines
    assert (f"      [{'a':<25}] depth: 1     be-depth: 0     inflt: 2    def: 1    "
            f"re-q: 1     timeout: 0     msgs: 5        e2e%: ") in lines
    client = [ln for ln in lines if ln.startswith("        [V2 cons-host:")]
    assert len(client) == 1
    assert re.fullmatch(r"        \[V2 cons-host:\d+ stats/2\s*\] state: 3 inflt: 2    rdy: 0    "
                        r"fin: 1        re-q: 1        msgs: 4        connected: \d+s",
                        client[0]), client[0]
    assert "Producers:" in lines
    prod = [ln for ln in lines if "prod-host:" in ln]
    assert re.fullmatch(rf"   \[V2 prod-host:\d+ stats/1\s*\] msgs: 5 +topics: {t}=5 "
                        r"connected: \d+s", prod[0]), prod[0]


def test_text_format_empty(any_broker: BrokerProcess) -> None:
    text = get(any_broker, "topic=nope_nothing&include_mem=false").decode()
    assert text.endswith("\nHealth: OK\n\nTopics: None\n\nProducers: None\n")
    assert "Memory:" not in text


# -- e2e processing latency -----------------------------------------------------------------
@pytest.fixture
def e2e_broker(make_module_broker: Callable[..., BrokerProcess],
               broker_kind: str) -> BrokerProcess:
    return make_module_broker("--e2e-processing-latency-percentile=0.99,0.5", kind=broker_kind)


def test_e2e_percentiles(e2e_broker: BrokerProcess) -> None:
    b, t = e2e_broker, unique_name("e2e")
    assert b.tcp_address
    _create(b, t, "c")
    d = doc(b, f"topic={t}")["topics"][0]
    zero = {"count": 0, "percentiles": [{"quantile": 0.99, "value": 0},
                                         {"quantile": 0.5, "value": 0}]}
    assert d["channels"][0]["e2e_processing_latency"] == zero
    with WireClient.connect(b.tcp_address) as c:
        c.sub(t, "c")
        c.rdy(20)
        urllib.request.urlopen(urllib.request.Request(
            f"http://{b.http_hostport}/mpub?topic={t}", b"\n".join(b"%d" % i for i in range(20))),
            timeout=5)
        for m in c.read_messages(20):
            time.sleep(0.005)
            c.fin(m.id)
        c.pub(t + "_probe", b"x")  # a round trip: every FIN has been handled
        d = doc(b, f"topic={t}")["topics"][0]
    for e2e in (d["e2e_processing_latency"], d["channels"][0]["e2e_processing_latency"]):
        assert e2e["count"] == 20
        p99, p50 = e2e["percentiles"]
        assert (p99["quantile"], p50["quantile"]) == (0.99, 0.5)
        assert 0 < p50["value"] <= p99["value"] < 30e9
    text = get(b, f"topic={t}").decode()
    assert re.search(r"e2e%: [\d.]+(ns|us|ms|s), [\d.]+(ns|us|ms|s)\n", text)


def test_every_answer_is_as_new_as_its_request(any_broker: BrokerProcess) -> None:
    """8 clients each publish to a topic of their own, then ask for the whole /stats
    (the same form for all of them, so that pybroker may share one answer among them:
    collect.SharedAnswers) and must see their own last publish counted, every time."""
    import http.client
    import threading

    host, port = any_broker.http_hostport.rsplit(":", 1)
    topics = [unique_name("fresh") for _ in range(8)]
    errors: list[str] = []

    def client(topic: str) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            for n in range(1, 16):
                conn.request("POST", f"/pub?topic={topic}", body=b"m")
                r = conn.getresponse()
                r.read()
                if r.status != 200:
                    errors.append(f"{topic}: pub {r.status}")
                    return
                conn.request("GET", "/stats?format=json")
                r = conn.getresponse()
                body = r.read()
                counts = {t["topic_name"]: t["message_count"] for t in json.loads(body)["topics"]}
                if counts.get(topic) != n:
                    errors.append(f"{topic}: {counts.get(topic)} after {n} publishes")
                    return
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(t,)) for t in topics]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
