"""Dead letters: max_attempts per channel and the dead-letter topic (docs/dead-letters.md).

A real gnsq consumer that always REQs (or never answers, so that timeouts count) on a
real broker; the dead letters are read back with gnsq from the dead-letter topic and
their envelopes checked. max_attempts 0 is compared with a real nsqd running the same
flow. Also: a kill -9 in fsync mode while messages are being dead-lettered, the HTTP
settings and their errors, the TOML defaults, persistence across a restart, /stats and
/metrics, and ``pybroker dead-letters`` republishing to the original topic.

gnsq runs on gevent in the test's thread without monkey-patching (as in test_gnsq.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gevent
import gnsq
import pytest

from pybroker.protocol.deadletter import DeadLetter, parse_envelope
from tests.support.broker import BrokerProcess, project_root, unique_name, wait_until
from tests.support.http import broker_json

pytestmark = pytest.mark.timeout(180)


def green_wait(pred: Callable[[], object], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        gevent.sleep(0.01)


class Seen:
    """A gnsq consumer recording every delivery (id, attempts, body). ``answer``:
    "req" (REQ without delay), "none" (never answers: the message times out) or
    "fin"."""

    def __init__(self, addr: str, topic: str, channel: str, answer: str,
                 max_in_flight: int = 10) -> None:
        self.deliveries: list[tuple[bytes, int, bytes]] = []
        self.consumer = gnsq.Consumer(topic, channel, nsqd_tcp_addresses=[addr],
                                      max_in_flight=max_in_flight, max_tries=0,
                                      backoff_on_requeue=False)

        def handler(_c: Any, message: Any) -> None:
            self.deliveries.append((message.id, message.attempts, message.body))
            if answer == "req":
                message.enable_async()
                message.requeue(0, backoff=False)
            elif answer == "none":
                message.enable_async()

        self.consumer.on_message.connect(handler, weak=False)
        self.consumer.start(block=False)

    def attempts_of(self, body: bytes) -> list[int]:
        return [a for _, a, b in self.deliveries if b == body]

    def close(self) -> None:
        self.consumer.close()
        self.consumer.join(5)


def publish(addr: str, topic: str, bodies: list[bytes]) -> None:
    p = gnsq.Producer(nsqd_tcp_addresses=[addr])
    p.start()
    try:
        for body in bodies:
            assert p.publish(topic, body) == b"OK"
    finally:
        p.close()
        p.join(5)


def http(b: BrokerProcess, method: str, path: str, **query: Any) -> tuple[int, Any]:
    return broker_json(b, method, path, **query)


def channel_stats(b: BrokerProcess, topic: str, channel: str) -> dict[str, Any]:
    _, d = http(b, "GET", "/stats", format="json", topic=topic)
    for t in d["topics"]:
        if t["topic_name"] == topic:
            for c in t["channels"]:
                if c["channel_name"] == channel:
                    return dict(c)
    raise AssertionError(f"no channel {topic}/{channel} in /stats")


def topic_names(b: BrokerProcess) -> list[str]:
    _, d = http(b, "GET", "/stats", format="json")
    return [t["topic_name"] for t in d["topics"]]


def read_dead_letters(addr: str, topic: str, n: int, timeout_s: float = 20.0,
                      channel: str = "dead-letters") -> list[DeadLetter]:
    """FIN and parse the messages of a dead-letter topic until n distinct original bodies
    are among them (a crash may dead-letter a message twice: counting deliveries would
    stop early and miss one still on its way)."""
    seen = Seen(addr, topic, channel, "fin", max_in_flight=100)

    def distinct() -> int:
        return len({parse_envelope(body).body for _, _, body in seen.deliveries})

    try:
        green_wait(lambda: distinct() >= n, f"{n} distinct dead letters on {topic}",
                   timeout_s)
        gevent.sleep(0.2)   # room for any extra one to show up
    finally:
        seen.close()
    return [parse_envelope(body) for _, _, body in seen.deliveries]


def write_toml(tmp_path: Path, text: str) -> str:
    p = tmp_path / "pybroker.toml"
    p.write_text(text)
    return str(p)


# -- the flow -------------------------------------------------------------------------------
def test_always_req_ends_on_dead_letter_topic_with_its_envelope(
        make_broker: Callable[..., BrokerProcess], tmp_path: Path) -> None:
    b = make_broker("-c", write_toml(tmp_path, "max_attempts = 3\n"))
    topic = unique_name("dl")
    bodies = [b"first", b"\x00binary\nwith newline\xff", b"x" * 3000]
    t0 = int(time.time() * 1000)
    c = Seen(b.tcp_hostport, topic, "work", "req")
    try:
        publish(b.tcp_hostport, topic, bodies)
        green_wait(lambda: len(c.deliveries) >= 9, "3 deliveries of each message")
        letters = read_dead_letters(b.tcp_hostport, topic + ".dead", 3)
        gevent.sleep(0.3)
        for body in bodies:    # exactly max_attempts deliveries, never a 4th
            assert c.attempts_of(body) == [1, 2, 3]
    finally:
        c.close()
    t1 = int(time.time() * 1000)
    assert sorted(d.body for d in letters) == sorted(bodies)
    ids = {body: mid.decode() for mid, _, body in c.deliveries}
    for d in letters:
        assert (d.topic, d.channel, d.attempts) == (topic, "work", 3)
        assert d.id == ids[d.body]
        assert d.header["body_len"] == len(d.body)
        assert t0 <= d.published_ms <= d.first_delivery_ms <= d.last_delivery_ms \
            <= d.dead_at_ms <= t1
    st = channel_stats(b, topic, "work")
    assert (st["max_attempts"], st["dead_letter_topic"]) == (3, topic + ".dead")
    assert st["dead_letter_count"] == 3
    assert (st["depth"], st["in_flight_count"], st["dead_letter_pending"]) == (0, 0, 0)
    # the dead-letter topic's own channels get no default max_attempts (no cascade)
    assert channel_stats(b, topic + ".dead", "dead-letters")["max_attempts"] == 0
    with urllib.request.urlopen(f"http://{b.http_hostport}/metrics", timeout=10) as r:
        text = r.read().decode()
    line = (f'pybroker_channel_dead_lettered_total{{topic="{topic}",channel="work"}} 3')
    assert line in text
    # pybroker stat: one more column, the dead-lettered count
    r = subprocess.run([sys.executable, "-m", "pybroker", "stat", "--topic", topic,
                        "--channel", "work", "--nsqd-http-address", b.http_hostport,
                        "--interval", "100ms", "--count", "1"],
                       capture_output=True, text=True, timeout=60, cwd=project_root())
    assert r.returncode == 0, r.stderr
    head, row = r.stdout.splitlines()[1:3]
    assert head.split()[-2:] == ["clients", "dead"] and row.split()[-1] == "3"
    assert "Traceback" not in b.stderr_text()


def test_timeouts_count_as_attempts(make_broker: Callable[..., BrokerProcess]) -> None:
    # nsqd: each timed-out delivery counts, the next delivery carries attempts + 1
    nsqd = make_broker("--msg-timeout=300ms", kind="nsqd")
    topic = unique_name("dlt")
    c = Seen(nsqd.tcp_hostport, topic, "slow", "none")
    try:
        publish(nsqd.tcp_hostport, topic, [b"never answered"])
        green_wait(lambda: len(c.deliveries) >= 3, "3 deliveries on nsqd")
    finally:
        c.close()
    assert c.attempts_of(b"never answered")[:3] == [1, 2, 3]
    # pybroker with max_attempts 2: the same two deliveries, then the dead-letter topic
    b = make_broker("--msg-timeout=300ms")
    topic = unique_name("dlt")
    http(b, "POST", "/topic/create", topic=topic)
    http(b, "POST", "/channel/create", topic=topic, channel="slow")
    status, got = http(b, "POST", "/channel/config", topic=topic, channel="slow",
                       max_attempts=2, dead_letter_topic=topic + "-parked")
    assert status == 200 and got["max_attempts"] == 2
    c = Seen(b.tcp_hostport, topic, "slow", "none")
    try:
        publish(b.tcp_hostport, topic, [b"never answered"])
        letters = read_dead_letters(b.tcp_hostport, topic + "-parked", 1)
    finally:
        c.close()
    assert c.attempts_of(b"never answered") == [1, 2]
    assert letters[0].attempts == 2 and letters[0].body == b"never answered"
    st = channel_stats(b, topic, "slow")
    assert st["timeout_count"] == 2 and st["dead_letter_count"] == 1


def _attempts_run(b: BrokerProcess, deliveries: int) -> list[int]:
    topic = unique_name("cmp")
    c = Seen(b.tcp_hostport, topic, "ch", "req")
    try:
        publish(b.tcp_hostport, topic, [b"poison"])
        green_wait(lambda: len(c.deliveries) >= deliveries, f"{deliveries} deliveries")
        return c.attempts_of(b"poison")[:deliveries]
    finally:
        c.close()


def test_max_attempts_zero_behaves_as_nsqd(make_broker: Callable[..., BrokerProcess]) -> None:
    nsqd = make_broker(kind="nsqd")
    ours = make_broker()
    theirs = _attempts_run(nsqd, 12)
    mine = _attempts_run(ours, 12)
    assert mine == theirs == list(range(1, 13))
    assert not [t for t in topic_names(ours) if t.endswith(".dead")]


# -- settings -------------------------------------------------------------------------------
def test_channel_config_errors_and_persistence(make_broker: Callable[..., BrokerProcess],
                                               tmp_path: Path) -> None:
    b = make_broker("-c", write_toml(tmp_path, 'max_attempts = 4\n'
                                     'dead_letter_topic = "parking"\n'))
    topic = unique_name("cfg")
    http(b, "POST", "/topic/create", topic=topic)
    http(b, "POST", "/channel/create", topic=topic, channel="a")
    http(b, "POST", "/channel/create", topic=topic, channel="b")
    errors = [
        ({"channel": "a"}, 400, "MISSING_ARG_TOPIC"),
        ({"topic": topic, "channel": "nope", "max_attempts": 1}, 404, "CHANNEL_NOT_FOUND"),
        ({"topic": topic, "channel": "a"}, 400, "MISSING_ARG_MAX_ATTEMPTS_OR_DEAD_LETTER_TOPIC"),
        ({"topic": topic, "channel": "a", "max_attempts": -1}, 400, "INVALID_ARG_MAX_ATTEMPTS"),
        ({"topic": topic, "channel": "a", "max_attempts": "x"}, 400, "INVALID_ARG_MAX_ATTEMPTS"),
        ({"topic": topic, "channel": "a", "max_attempts": 65536}, 400,
         "INVALID_ARG_MAX_ATTEMPTS"),
        ({"topic": topic, "channel": "a", "dead_letter_topic": "bad name"}, 400,
         "INVALID_ARG_DEAD_LETTER_TOPIC"),
        ({"topic": topic, "channel": "a", "dead_letter_topic": "x#ephemeral"}, 400,
         "INVALID_ARG_DEAD_LETTER_TOPIC"),
        ({"topic": topic, "channel": "a", "dead_letter_topic": topic}, 400,
         "INVALID_ARG_DEAD_LETTER_TOPIC"),
    ]
    for query, status, code in errors:
        got = http(b, "POST", "/channel/config", **query)
        assert got == (status, {"message": code}), query
    # the TOML defaults apply to channels without settings of their own
    assert http(b, "GET", "/channel/config", topic=topic, channel="b")[1]["max_attempts"] == 4
    status, got = http(b, "POST", "/channel/config", topic=topic, channel="a",
                       max_attempts=7, dead_letter_topic="")
    assert status == 200
    assert (got["max_attempts"], got["dead_letter_topic"]) == (7, topic + ".dead")
    _, b_cfg = http(b, "GET", "/channel/config", topic=topic, channel="b")
    assert (b_cfg["max_attempts"], b_cfg["dead_letter_topic"]) == (4, "parking")
    def saved() -> dict[str, Any]:
        meta = json.loads((Path(b.data_path) / "nsqd.dat").read_text())
        return {c["name"]: c for t in meta["topics"] if t["name"] == topic
                for c in t["channels"]}

    wait_until(lambda: saved().get("a", {}).get("max_attempts") == 7, 10.0,
               what="the settings saved in nsqd.dat")
    assert saved()["a"]["dead_letter_topic"] == "" and "max_attempts" not in saved()["b"]
    # kept across a restart (the settings are in nsqd.dat; the defaults in the config)
    assert b.stop() == 0
    b.start()
    _, a_cfg = http(b, "GET", "/channel/config", topic=topic, channel="a")
    assert (a_cfg["max_attempts"], a_cfg["dead_letter_topic"]) == (7, topic + ".dead")
    st = channel_stats(b, topic, "b")
    assert (st["max_attempts"], st["dead_letter_topic"]) == (4, "parking")


def test_bad_toml_values_stop_start_up(tmp_path: Path) -> None:
    for text, key in (("max_attempts = -2\n", "max_attempts"),
                      ('dead_letter_topic = "a b"\n', "dead_letter_topic")):
        path = write_toml(tmp_path, text)
        r = subprocess.run([sys.executable, "-m", "pybroker", "serve", "-c", path,
                            "--tcp-address=127.0.0.1:0", "--http-address=127.0.0.1:0",
                            f"--data-path={tmp_path}"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and key in r.stderr and "Traceback" not in r.stderr


# -- crash ----------------------------------------------------------------------------------
def _drained(ch: dict[str, Any]) -> bool:
    return bool(ch["depth"] == 0 and ch["in_flight_count"] == 0 and
                ch["dead_letter_pending"] == 0)


def test_kill9_in_fsync_mode_loses_no_dead_letter(
        make_broker: Callable[..., BrokerProcess]) -> None:
    b = make_broker("--durability=fsync", "--max-attempts=1")
    topic = unique_name("crash")
    n = 300
    bodies = [b"m-%d" % i for i in range(n)]
    c = Seen(b.tcp_hostport, topic, "ch", "req", max_in_flight=50)
    publish(b.tcp_hostport, topic, bodies)
    # kill -9 while dead letters are being published: some made it, some not yet
    green_wait(lambda: len(c.deliveries) >= n // 3, "a third delivered")
    b.kill9()
    c.close()
    b.start()
    c = Seen(b.tcp_hostport, topic, "ch", "req", max_in_flight=50)
    try:
        letters = read_dead_letters(b.tcp_hostport, topic + ".dead", n, timeout_s=60)
        green_wait(lambda: _drained(channel_stats(b, topic, "ch")), "drained")
    finally:
        c.close()
    got = [d.body for d in letters]
    assert set(got) == set(bodies)          # none lost
    # at least once: a message may be dead-lettered again, never a third time
    assert max(got.count(x) for x in set(got)) <= 2
    assert all(d.topic == topic and d.channel == "ch" for d in letters)


# -- the tool -------------------------------------------------------------------------------
def _tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pybroker", "dead-letters", *args],
                          capture_output=True, text=True, timeout=60, cwd=project_root(),
                          env=dict(os.environ))


def test_dead_letters_tool_lists_shows_and_republishes(
        make_broker: Callable[..., BrokerProcess]) -> None:
    b = make_broker("--max-attempts=1")
    topic = unique_name("tool")
    dead = topic + ".dead"
    c = Seen(b.tcp_hostport, topic, "work", "req")
    try:
        publish(b.tcp_hostport, topic, [b"alpha", b"beta", b"gamma"])
        green_wait(lambda: channel_stats(b, topic, "work")["dead_letter_count"] == 3,
                   "3 dead letters")
    finally:
        c.close()
    addr = ["--topic", dead, "--nsqd-tcp-address", b.tcp_hostport, "--wait", "500ms"]
    r = _tool("list", *addr)
    assert r.returncode == 0, r.stderr
    assert "3 dead letters" in r.stdout
    for body in ("alpha", "beta", "gamma"):
        assert f"{topic}/work/" in r.stdout and body in r.stdout
    beta_line = next(line for line in r.stdout.splitlines() if "beta" in line)
    beta_id = beta_line.split()[0]
    r = _tool("show", beta_id, *addr)
    assert r.returncode == 0, r.stderr
    assert '  attempts: 1' in r.stdout and r.stdout.rstrip().endswith("beta")
    # nothing was taken away by list/show
    green_wait(lambda: channel_stats(b, dead, "dead-letters")["depth"] == 3, "3 kept")
    r = _tool("republish", *addr)
    assert r.returncode == 1 and "choose what to republish" in r.stderr
    # one by id, then the rest (older than 0s)
    back = Seen(b.tcp_hostport, topic, "work", "fin")
    try:
        r = _tool("republish", "--id", beta_id, *addr)
        assert r.returncode == 0, r.stderr
        assert "1 republished" in r.stdout and "2 left" in r.stdout
        green_wait(lambda: back.attempts_of(b"beta") == [1], "beta back on its topic")
        assert channel_stats(b, dead, "dead-letters")["depth"] == 2
        r = _tool("republish", "--older-than", "0s", *addr)
        assert r.returncode == 0, r.stderr
        assert "2 republished" in r.stdout and "0 left" in r.stdout
        green_wait(lambda: sorted(body for _, _, body in back.deliveries)
                   == [b"alpha", b"beta", b"gamma"], "all three back")
    finally:
        back.close()
    assert channel_stats(b, dead, "dead-letters")["depth"] == 0
    assert channel_stats(b, dead, "dead-letters")["in_flight_count"] == 0


def test_dead_letters_tool_refuses_a_misspelt_topic_and_warns_nothing(
        broker: BrokerProcess) -> None:
    """Against a broker with nsqd's defaults: a topic it does not have is refused (the SUB
    would create it), and a real one is read without the RDY warning of a window larger
    than the broker's max_rdy_count."""
    def topics() -> list[str]:
        status, stats = broker_json(broker, "GET", "/stats", format="json")
        assert status == 200
        return [t["topic_name"] for t in stats["topics"]]

    addr = ["--nsqd-tcp-address", broker.tcp_hostport,
            "--nsqd-http-address", broker.http_hostport, "--wait", "200ms"]
    typo = unique_name("typo") + ".daed"
    r = _tool("list", "--topic", typo, *addr)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"no topic {typo} on {broker.http_hostport}" in r.stderr
    assert typo not in topics()
    real = unique_name("empty") + ".dead"
    urllib.request.urlopen(urllib.request.Request(
        f"http://{broker.http_hostport}/topic/create?topic={real}", method="POST"),
        timeout=5).close()
    r = _tool("list", "--topic", real, *addr)
    assert r.returncode == 0, r.stderr
    assert "0 dead letters" in r.stdout
    assert "max RDY count" not in r.stderr and "WARN" not in r.stderr.upper(), r.stderr
