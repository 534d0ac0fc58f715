"""The broker's log: nsqd's INFO lines for topic and channel creation and deletion and for
clients connecting and leaving, nsqd's DEBUG line per command, and nothing of DEBUG at INFO.

Where an nsqd binary is found, the same steps run against it and the lifecycle lines of
both logs must be the same (addresses aside)."""
from __future__ import annotations

import re
import threading
import urllib.request
from collections import Counter
from collections.abc import Callable

import pytest

from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.wire import WireClient

pytestmark = pytest.mark.timeout(60)

LINE_RE = re.compile(r"^\[(pybroker|nsqd)\] \d{4}/\d\d/\d\d \d\d:\d\d:\d\d\.\d{6} "
                     r"(DEBUG|INFO|WARN|ERROR|FATAL): (.*)$")
# the lifecycle lines both brokers must print alike
LIFECYCLE_RE = re.compile(
    r"^(TOPIC\(\S+\): (created|deleting|new channel\(\S+\)|deleting channel \S+)"
    r"|CHANNEL\(\S+\): deleting"
    r"|TCP: new client\(ADDR\)"
    r"|CLIENT\(ADDR\): desired protocol magic '  V2'"
    r"|PROTOCOL\(V2\): \[ADDR\] exiting ioloop)")
ADDR_RE = re.compile(r"127\.0\.0\.1:\d+")


def parsed(b: BrokerProcess) -> list[tuple[str, str]]:
    """(level, message) of every log line, client addresses replaced by ADDR."""
    out = []
    for line in b.stderr_lines:
        m = LINE_RE.match(line.rstrip("\n"))
        if m:
            out.append((m.group(2), ADDR_RE.sub("ADDR", m.group(3))))
    return out


def lifecycle(b: BrokerProcess) -> list[str]:
    # pybroker says why a connection ended ("exiting ioloop (peer closed)"); nsqd does not
    msgs = [re.sub(r" \(.*\)$", "", m) if "exiting ioloop" in m else m
            for level, m in parsed(b) if level == "INFO"]
    return [m for m in msgs if LIFECYCLE_RE.match(m)]


def _http(b: BrokerProcess, path: str) -> None:
    req = urllib.request.Request(f"http://{b.http_hostport}{path}", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200


def scenario(b: BrokerProcess, topic: str) -> None:
    """Create, use and delete a topic and two channels, as a user would."""
    with WireClient.connect(b.tcp_address) as producer:     # type: ignore[arg-type]
        producer.pub(topic, b"hello")
    with WireClient.connect(b.tcp_address) as consumer:     # type: ignore[arg-type]
        consumer.identify()
        consumer.sub(topic, "ch1")
        consumer.rdy(1)
        assert consumer.read_frame()[0] == 2                # the message
    _http(b, f"/channel/create?topic={topic}&channel=ch2")
    _http(b, f"/channel/delete?topic={topic}&channel=ch2")
    _http(b, f"/topic/delete?topic={topic}")


def expected_lifecycle(topic: str) -> list[str]:
    return [
        "TCP: new client(ADDR)", "CLIENT(ADDR): desired protocol magic '  V2'",
        f"TOPIC({topic}): created",
        "PROTOCOL(V2): [ADDR] exiting ioloop",
        "TCP: new client(ADDR)", "CLIENT(ADDR): desired protocol magic '  V2'",
        f"TOPIC({topic}): new channel(ch1)",
        "PROTOCOL(V2): [ADDR] exiting ioloop",
        f"TOPIC({topic}): new channel(ch2)",
        f"TOPIC({topic}): deleting channel ch2", "CHANNEL(ch2): deleting",
        f"TOPIC({topic}): deleting", "CHANNEL(ch1): deleting",
    ]


def assert_lifecycle(b: BrokerProcess, topic: str) -> None:
    """The expected lines, in order, except that a connection's end may be logged after
    later HTTP actions (another thread)."""
    got, want = lifecycle(b), expected_lifecycle(topic)
    assert Counter(got) == Counter(want), got

    def ordered(lines: list[str]) -> list[str]:
        return [m for m in lines if "exiting ioloop" not in m]

    assert ordered(got) == ordered(want)


def _run(make: Callable[..., BrokerProcess], kind: str, level: str) -> tuple[BrokerProcess, str]:
    b = make(f"--log-level={level}", kind=kind)
    topic = unique_name("log")
    scenario(b, topic)
    want = len(expected_lifecycle(topic))
    wait_until(lambda: len(lifecycle(b)) >= want, 10, what="every lifecycle line")
    return b, topic


def test_lifecycle_lines_at_info(make_broker: Callable[..., BrokerProcess]) -> None:
    b, topic = _run(make_broker, "pybroker", "info")
    assert_lifecycle(b, topic)
    lines = parsed(b)
    assert not [m for level, m in lines if level == "DEBUG"]
    identify = [m for level, m in lines if level == "INFO" and "IDENTIFY:" in m]
    assert len(identify) == 1 and identify[0].startswith("[ADDR] IDENTIFY: client_id:")


def test_lifecycle_lines_match_nsqd(make_broker: Callable[..., BrokerProcess]) -> None:
    nsqd, ntopic = _run(make_broker, "nsqd", "info")
    b, topic = _run(make_broker, "pybroker", "info")
    theirs = [m.replace(ntopic, "TOPIC") for m in lifecycle(nsqd)]
    ours = [m.replace(topic, "TOPIC") for m in lifecycle(b)]
    # the same lines; order may differ only where nsqd's goroutines race
    assert Counter(ours) == Counter(theirs), (ours, theirs)


def test_debug_logs_every_command(make_broker: Callable[..., BrokerProcess]) -> None:
    b, topic = _run(make_broker, "pybroker", "debug")
    debug = [m for level, m in parsed(b) if level == "DEBUG"]
    for cmd in (f"[PUB {topic}]", "[IDENTIFY]", f"[SUB {topic} ch1]", "[RDY 1]"):
        assert f"PROTOCOL(V2): [ADDR] {cmd}" in debug, (cmd, debug)
    assert_lifecycle(b, topic)            # the INFO lines are still there


def test_debug_command_lines_match_nsqd(make_broker: Callable[..., BrokerProcess]) -> None:
    nsqd, ntopic = _run(make_broker, "nsqd", "debug")
    b, topic = _run(make_broker, "pybroker", "debug")

    def commands(x: BrokerProcess, name: str) -> list[str]:
        return [m.replace(name, "TOPIC") for level, m in parsed(x)
                if level == "DEBUG" and m.startswith("PROTOCOL(V2): [ADDR] [")]

    assert commands(b, topic) == commands(nsqd, ntopic)


def test_log_level_can_change_at_run_time(make_broker: Callable[..., BrokerProcess]) -> None:
    b = make_broker("--log-level=info")
    req = urllib.request.Request(f"http://{b.http_hostport}/config/log_level",
                                 data=b"debug", method="PUT")
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200
    topic = unique_name("log")
    with WireClient.connect(b.tcp_address) as producer:     # type: ignore[arg-type]
        producer.pub(topic, b"x")
    wait_until(lambda: ("DEBUG", f"PROTOCOL(V2): [ADDR] [PUB {topic}]") in parsed(b), 5,
               what="the PUB's DEBUG line")


class StalledLog(BrokerProcess):
    """A broker whose stderr is read until it listens, then not at all until ``resume``:
    a log collector that stopped reading (the pipe's 64 KiB then fill)."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.reading = threading.Event()
        self.reading.set()

    def _took_line(self, line: str) -> None:
        super()._took_line(line)
        self.reading.wait()

    def resume(self) -> None:
        self.reading.set()


def test_a_log_nobody_reads_holds_no_client() -> None:
    """Every command logs a DEBUG line; with the log's pipe full, 3,000 PUBs on new and
    old connections are still answered, and the lines come once the pipe is read."""
    b = StalledLog("pybroker", ["--log-level=debug"]).start()
    try:
        b.reading.clear()
        topic = unique_name("stall")
        sent = 0
        with WireClient.connect(b.tcp_address) as producer:     # type: ignore[arg-type]
            for i in range(30):
                with WireClient.connect(b.tcp_address) as other:  # type: ignore[arg-type]
                    other.pub(topic, b"x" * 10)                 # (waits for its OK)
                for _ in range(99):
                    producer.pub(topic, b"%05d" % i)
                sent += 100
        assert b.ping(), "the HTTP server did not answer"
        assert sent == 3000
        b.resume()
        wait_until(lambda: sum(f"[PUB {topic}]" in line for line in b.stderr_lines) >= 3000
                   or "log lines dropped" in b.stderr_text(), 20,
                   what="the PUB lines after the pipe was read again")
    finally:
        b.resume()
        b.stop()
        b.cleanup()
