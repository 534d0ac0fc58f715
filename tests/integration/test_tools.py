"""``pybroker pub``, ``tail`` and ``stat`` end to end, as subprocesses, on pybroker and nsqd.

Where NSQ's own tool is installed (to_nsq, nsq_tail, nsq_stat) the same scenario runs
through it too and the outputs must be byte-for-byte equal.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Callable

import pytest

from pybroker.client import Consumer, Message, Producer
from tests.support.broker import BrokerProcess, project_root, unique_name, wait_until
from tests.support.durability import topic_stats
from tests.support.lookupd import FakeLookupd
from tests.support.programs import require_program
from tests.support.tools import TOOL, reap_tools, run_tool, spawn, start_tool  # noqa: F401

pytestmark = pytest.mark.timeout(60)




def consume(b: BrokerProcess, topic: str, channel: str, n: int, timeout_s: float = 10.0
            ) -> list[bytes]:
    got: list[bytes] = []
    c = Consumer(topic, channel, lambda m: got.append(m.body), max_in_flight=100)
    c.connect_to_nsqd(b.tcp_hostport)
    try:
        wait_until(lambda: len(got) >= n, timeout_s, what=f"{n} messages")
    finally:
        c.close()
    return got


def create_channel(b: BrokerProcess, topic: str, channel: str) -> None:
    """SUB creates the channel; RDY stays 0 so nothing is taken from it."""
    c = Consumer(topic, channel, lambda m: None, max_in_flight=0)
    c.connect_to_nsqd(b.tcp_hostport)
    c.close()


# -- pub -----------------------------------------------------------------------------
def test_pub_lines_from_stdin(any_broker: BrokerProcess) -> None:
    topic = unique_name("tool_pub")
    r = run_tool("pub", f"--topic={topic}", f"--nsqd-tcp-address={any_broker.tcp_hostport}",
                 input=b"alpha\nbeta\n\ngamma\r\nlast-no-newline")
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"" and b"Traceback" not in r.stderr
    assert consume(any_broker, topic, "ch", 4) == [b"alpha", b"beta", b"gamma\r",
                                                   b"last-no-newline"]


def test_pub_delimiter_go_style_flags(any_broker: BrokerProcess) -> None:
    topic = unique_name("tool_pub_delim")
    r = run_tool("pub", "-delimiter=,", f"-topic={topic}",
                 f"-nsqd-tcp-address={any_broker.tcp_hostport}", input=b"one,two,,three\n")
    assert r.returncode == 0, r.stderr
    assert consume(any_broker, topic, "ch", 3) == [b"one", b"two", b"three"]


def test_pub_rate_and_many_servers(make_broker: Callable[..., BrokerProcess],
                                   broker_kind: str) -> None:
    a, b = make_broker(kind=broker_kind), make_broker(kind=broker_kind)
    topic = unique_name("tool_pub_rate")
    lines = b"".join(b"r%02d\n" % i for i in range(20))
    t0 = time.monotonic()
    r = run_tool("pub", f"--topic={topic}", f"--nsqd-tcp-address={a.tcp_hostport}",
                 f"--nsqd-tcp-address={b.tcp_hostport}", "--rate=20", input=lines)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert took >= 0.9, f"20 messages at --rate=20 took only {took:.2f}s"
    want = [b"r%02d" % i for i in range(20)]
    assert consume(a, topic, "ch", 20) == want
    assert consume(b, topic, "ch", 20) == want


def test_pub_many_messages_in_order(any_broker: BrokerProcess) -> None:
    topic = unique_name("tool_pub_many")
    r = run_tool("pub", f"--topic={topic}", f"--nsqd-tcp-address={any_broker.tcp_hostport}",
                 input=b"".join(b"%05d\n" % i for i in range(5000)))
    assert r.returncode == 0, r.stderr
    assert consume(any_broker, topic, "ch", 5000) == [b"%05d" % i for i in range(5000)]


@pytest.mark.parametrize("delimiter, data", [
    ("\n", b"alpha\nbeta\n\ngamma\r\nlast-no-newline"),
    ("\n", b"ends\nwith\nnewline\n"),
    (",", b"one,two,,three\n"),
    (",", b"no,trailing,newline"),
], ids=["newline", "newline-ended", "comma", "comma-unended"])
def test_pub_publishes_what_to_nsq_publishes(any_broker: BrokerProcess, delimiter: str,
                                             data: bytes) -> None:
    """The same input through NSQ's to_nsq and pybroker pub gives the same messages."""
    to_nsq = require_program("to_nsq")
    go_topic, py_topic = unique_name("tool_pub_go"), unique_name("tool_pub_py")
    addr = f"-nsqd-tcp-address={any_broker.tcp_hostport}"
    go = subprocess.run([to_nsq, f"-topic={go_topic}", f"-delimiter={delimiter}", addr],
                        input=data, capture_output=True, timeout=20)
    assert go.returncode == 0, go.stderr
    mine = run_tool("pub", f"-topic={py_topic}", f"-delimiter={delimiter}", addr, input=data)
    assert mine.returncode == 0, mine.stderr
    # both exit after every publish was answered: the topics hold all there will be
    counts = [(topic_stats(any_broker, t) or {}).get("message_count") for t in (go_topic,
                                                                              py_topic)]
    assert counts[0] == counts[1] and counts[0], (counts, go.stderr, mine.stderr)
    n = counts[0]
    mine_got, go_got = consume(any_broker, py_topic, "ch", n), consume(any_broker, go_topic,
                                                                        "ch", n)
    if data.endswith((b"\n", delimiter.encode())):
        assert mine_got == go_got
    else:
        # the one difference, on purpose: to_nsq 1.3.0 cuts the last byte off a last piece
        # that has no delimiter after it (it drops one byte from every piece it reads);
        # pybroker pub publishes that piece whole
        assert mine_got[:-1] == go_got[:-1] and go_got[-1] == mine_got[-1][:-1]


def test_pub_errors_exit_1(any_broker: BrokerProcess) -> None:
    r = run_tool("pub", "--topic=bad$topic", f"--nsqd-tcp-address={any_broker.tcp_hostport}",
                 input=b"x\n")
    assert r.returncode == 1 and b"E_BAD_TOPIC" in r.stderr
    r = run_tool("pub", "--topic=t", input=b"x\n")
    assert r.returncode == 1 and b"--nsqd-tcp-address required" in r.stderr
    r = run_tool("pub", "--topic=t", "--delimiter=ab", "--nsqd-tcp-address=127.0.0.1:1")
    assert r.returncode == 1 and b"--delimiter must be a single byte" in r.stderr


@pytest.fixture(params=["pybroker", "nsqd"])
def broker_kind(request: pytest.FixtureRequest) -> str:
    """Which server ``make_broker`` starts; nsqd tests skip when no binary is found."""
    return str(request.param)


# -- tail ----------------------------------------------------------------------------
def test_tail_n_prints_and_leaves_the_rest(
        make_any_broker: Callable[..., BrokerProcess]) -> None:
    # nsqd may still write a message after CLOSE_WAIT (its pump had taken it before the
    # CLS), which the closing tail never answers: nsqd keeps it in flight until
    # msg-timeout, so that is short here
    any_broker = make_any_broker("--msg-timeout=2s")
    topic = unique_name("tool_tail")
    with Producer(any_broker.tcp_hostport) as p:
        p.multi_publish(topic, [b"line %d" % i for i in range(10)])
    r = run_tool("tail", f"--topic={topic}", "--channel=durable", "-n", "4",
                 f"--nsqd-tcp-address={any_broker.tcp_hostport}")
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"".join(b"line %d\n" % i for i in range(4))
    assert b"Traceback" not in r.stderr
    # the messages tail did not print are still in the channel (requeued ones go last),
    # each delivered to tail at most once: it sends CLS before the Nth message's FIN, so
    # the server hands it no more (a requeue loop until CLS once took one to 6 attempts)
    got: list[tuple[bytes, int]] = []
    c = Consumer(topic, "durable", lambda m: got.append((m.body, m.attempts)),
                 max_in_flight=100, max_attempts=0)
    c.connect_to_nsqd(any_broker.tcp_hostport)
    try:
        wait_until(lambda: len(got) >= 6, 10, what="6 messages")
    finally:
        c.close()
    assert sorted(body for body, _ in got) == [b"line %d" % i for i in range(4, 10)]
    assert max(attempts for _, attempts in got) <= 2, got


def test_tail_print_topic_many_topics(any_broker: BrokerProcess) -> None:
    t1, t2 = unique_name("tool_tail_a"), unique_name("tool_tail_b")
    with Producer(any_broker.tcp_hostport) as p:
        p.publish(t1, b"from one")
        p.publish(t2, b"from two")
    r = run_tool("tail", f"-topic={t1}", f"-topic={t2}", "-print-topic=true", "-n=2",
                 f"-nsqd-tcp-address={any_broker.tcp_hostport}")
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.splitlines())
    assert lines == sorted([t1.encode() + b" | from one", t2.encode() + b" | from two"])


def test_tail_output_matches_nsq_tail(any_broker: BrokerProcess) -> None:
    nsq_tail = require_program("nsq_tail")
    topic = unique_name("tool_tail_cmp")
    for ch in ("go", "py"):       # both channels exist before the messages arrive
        create_channel(any_broker, topic, ch)
    bodies = [b"plain", b"with | bar", b"  spaces  ", "utf-8 \u00e9".encode()]
    with Producer(any_broker.tcp_hostport) as p:
        p.multi_publish(topic, bodies)
    common = [f"-topic={topic}", "-print-topic", "-n=4",
              f"-nsqd-tcp-address={any_broker.tcp_hostport}"]
    go = subprocess.run([nsq_tail, *common, "-channel=go"], capture_output=True, timeout=20)
    mine = run_tool("tail", *common, "-channel=py")
    assert go.returncode == 0, go.stderr
    assert mine.returncode == 0, mine.stderr
    assert mine.stdout == go.stdout
    assert mine.stdout == b"".join(topic.encode() + b" | " + b + b"\n" for b in bodies)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_tail_exits_cleanly_on_signal(any_broker: BrokerProcess, sig: int) -> None:
    topic = unique_name("tool_tail_sig")
    proc = start_tool("tail", f"--topic={topic}", f"--nsqd-tcp-address={any_broker.tcp_hostport}")
    try:
        with Producer(any_broker.tcp_hostport) as p:
            deadline = time.monotonic() + 10
            assert proc.stdout is not None
            os.set_blocking(proc.stdout.fileno(), False)
            out = b""
            while b"hello\n" not in out and time.monotonic() < deadline:
                p.publish(topic, b"hello")
                time.sleep(0.2)
                out += proc.stdout.read() or b""
        assert b"hello\n" in out
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err
        assert b"Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=5)


def test_tail_argument_errors() -> None:
    r = run_tool("tail", "--topic=t")
    assert r.returncode == 1
    assert b"--nsqd-tcp-address or --lookupd-http-address required" in r.stderr
    r = run_tool("tail", "--nsqd-tcp-address=127.0.0.1:1")
    assert r.returncode == 1 and b"--topic required" in r.stderr
    r = run_tool("tail", "--topic=t", "--nsqd-tcp-address=127.0.0.1:1",
                 "--lookupd-http-address=127.0.0.1:2")
    assert r.returncode == 1 and b"not both" in r.stderr


def test_tail_through_lookupd(any_broker: BrokerProcess) -> None:
    topic = unique_name("tool_tail_lookupd")
    with Producer(any_broker.tcp_hostport) as p:
        p.publish(topic, b"found")
    with FakeLookupd() as lookupd:
        lookupd.add_producer(topic, any_broker)
        r = run_tool("tail", f"--topic={topic}", "-n", "1",
                     f"--lookupd-http-address={lookupd.http_hostport}")
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"found\n"


# -- stat ----------------------------------------------------------------------------
class Holder:
    """Keeps every message in flight until ``release()``; after that, finishes at once."""

    def __init__(self) -> None:
        self.held: list[Message] = []
        self.lock = threading.Lock()
        self.released = False

    def __call__(self, m: Message) -> None:
        with self.lock:
            if not self.released:
                m.disable_auto_response()
                self.held.append(m)

    def release(self) -> None:
        with self.lock:
            self.released = True
            held, self.held = self.held, []
        for m in held:
            m.finish()


HEADER = (b"------rate------+----------------depth----------------+"
          b"--------------metadata---------------\n"
          b"ingress  egress |   total     mem    disk inflt   def |     req     t-o"
          b"         msgs clients\n")


def test_stat_table(any_broker: BrokerProcess) -> None:
    topic = unique_name("tool_stat")
    holder = Holder()
    c = Consumer(topic, "ch", holder, max_in_flight=3)
    c.connect_to_nsqd(any_broker.tcp_hostport)
    try:
        with Producer(any_broker.tcp_hostport) as p:
            p.multi_publish(topic, [b"s%d" % i for i in range(10)])
        wait_until(lambda: len(holder.held) == 3, 5, what="3 messages in flight")
        args = [f"--topic={topic}", "--channel=ch", "--count=2", "--interval=300ms",
                f"--nsqd-http-address={any_broker.http_hostport}"]
        r = run_tool("stat", *args)
        assert r.returncode == 0, r.stderr
        row = (b"      0       0 |       7       7       0     3     0 |"
               b"       0       0           10       1\n")
        assert r.stdout == HEADER + row + row
        with FakeLookupd() as lookupd:
            lookupd.add_producer(topic, any_broker)
            r2 = run_tool("stat", f"--topic={topic}", "--channel=ch", "--count=1",
                          "--interval=100ms", f"--lookupd-http-address={lookupd.http_hostport}")
        assert r2.returncode == 0, r2.stderr
        assert r2.stdout == HEADER + row
        # the same table from NSQ's own nsq_stat (last: pybroker's own checks ran first)
        go = subprocess.run([require_program("nsq_stat"), *args], capture_output=True,
                            timeout=20)
        assert go.returncode == 0, go.stderr
        assert r.stdout == go.stdout
    finally:
        holder.release()
        c.close()


def test_stat_rates_and_errors(any_broker: BrokerProcess) -> None:
    topic = unique_name("tool_stat_rate")
    with Producer(any_broker.tcp_hostport) as p:
        p.publish(topic, b"first")
        c = Consumer(topic, "ch", lambda m: None, max_in_flight=50)
        c.connect_to_nsqd(any_broker.tcp_hostport)
        try:
            wait_until(lambda: c.stats().messages_finished == 1, 5, what="a delivery")
            proc = start_tool("stat", f"--topic={topic}", "--channel=ch", "--interval=1s",
                              "--count=1", f"--nsqd-http-address={any_broker.http_hostport}")
            assert proc.stdout is not None
            header = proc.stdout.readline() + proc.stdout.readline()   # after the first poll
            p.multi_publish(topic, [b"x"] * 30)
            out, err = proc.communicate(timeout=15)
        finally:
            c.close()
    assert proc.returncode == 0, err
    assert header == HEADER
    row = out.split()
    # 30 messages in one second: ingress 30; all delivered: egress 30; msgs 31
    assert row[0] == b"30" and row[1] == b"30" and row[-2] == b"31", out
    r = run_tool("stat", f"--topic={topic}", "--channel=nope", "--count=1",
                 f"--nsqd-http-address={any_broker.http_hostport}")
    assert r.returncode == 1
    assert f"failed to find channel(nope) in stats metadata for topic({topic})".encode() \
        in r.stderr
    r = run_tool("stat", "--topic=t", "--channel=c",
                 f"--nsqd-http-address=http://{any_broker.http_hostport}")
    assert r.returncode == 1 and b"address should not contain scheme" in r.stderr


def test_progress_only_on_a_tty(any_broker: BrokerProcess) -> None:
    import pty
    topic = unique_name("tool_progress")
    data = b"".join(b"p%d\n" % i for i in range(3000))
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([*TOOL, "pub", f"--topic={topic}",
                                 f"--nsqd-tcp-address={any_broker.tcp_hostport}", "--rate=2000"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=slave,
                                cwd=project_root())
        os.close(slave)
        slave = -1
        out, _ = proc.communicate(data, timeout=20)
        tty_text = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            tty_text += chunk
    finally:
        os.close(master)
        if slave != -1:
            os.close(slave)
    assert proc.returncode == 0
    assert out == b""
    assert b"pub: " in tty_text and b"3000 messages" in tty_text, tty_text[-300:]
    piped = run_tool("pub", f"--topic={topic}", f"--nsqd-tcp-address={any_broker.tcp_hostport}",
                     input=data)
    assert piped.returncode == 0 and piped.stderr == b"" and piped.stdout == b""



def test_pub_and_stat_exit_cleanly_on_signals(any_broker: BrokerProcess) -> None:
    topic = unique_name("tool_sig")
    create_channel(any_broker, topic, "ch")
    pub = spawn([*TOOL, "pub", f"--topic={topic}",
                 f"--nsqd-tcp-address={any_broker.tcp_hostport}"], stdin=subprocess.PIPE)
    assert pub.stdin is not None
    pub.stdin.write(b"before-signal\n")
    pub.stdin.flush()                       # stdin stays open: pub waits for more
    got = consume(any_broker, topic, "ch", 1)
    assert got == [b"before-signal"]
    pub.send_signal(signal.SIGTERM)
    _, err = pub.communicate(timeout=10)
    assert pub.returncode == 0 and b"Traceback" not in err, err
    stat = start_tool("stat", f"--topic={topic}", "--channel=ch", "--interval=200ms",
                      f"--nsqd-http-address={any_broker.http_hostport}")
    assert stat.stdout is not None
    assert stat.stdout.readline().startswith(b"------rate------")   # polling has begun
    stat.send_signal(signal.SIGINT)
    out, err = stat.communicate(timeout=10)
    assert stat.returncode == 0 and b"Traceback" not in err, err
