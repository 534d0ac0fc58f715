"""Two loop threads: the cross-loop paths, in the one module that runs them (the rest of
the suite runs the default single loop, as users do).

Publishers on one loop feed channels the other loop owns: each publish is written by the publisher's loop, which then tells the channel's owner
(once per turn) that its channel has new records. Publishers must not come to wait on
the other loop turn after turn: their round trips stay bounded over the whole run (no
drift from the first seconds to the last), and every message reaches its consumer.

Connections are given to the loops in turn as they are accepted (the first to loop 0),
and a channel belongs to loop ``crc32("topic:channel") % loops`` (Broker.pick_owner):
the test opens its connections one at a time and picks names to place them.

The protocol cases below run on one shared two-loop broker with the channel on each loop
in turn, so one of the two always moves the consumer's connection at SUB: FIN, REQ,
TOUCH, a timeout, a deferred publish, HTTP publishes, pause/empty/delete over HTTP and
a dead letter published by the channel's loop to a topic another loop may own.
"""
from __future__ import annotations

import statistics
import threading
import time
import urllib.parse
import zlib
from collections.abc import Callable

import pytest

from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.durability import channel_stats, http, http_pub, topic_stats
from tests.support.wire import FRAME_MESSAGE, WireClient, fin, parse_message, rdy

MakeBroker = Callable[..., BrokerProcess]
TOPICS = 4
PUBLISHERS_PER_TOPIC = 3
SECONDS = 8.0


def _owned_by(loop: int, loops: int, prefix: str, channel: str) -> str:
    for i in range(10_000):
        name = f"{prefix}{i}"
        if zlib.crc32(f"{name}:{channel}".encode()) % loops == loop:
            return name
    raise AssertionError("no name found")


def test_publishers_on_one_loop_feed_channels_of_the_other(make_broker: MakeBroker) -> None:
    b = make_broker("--loop-threads=2")
    assert b.tcp_address is not None
    prefix = unique_name("xl")
    topics = [_owned_by(1, 2, f"{prefix}-{t}-", "ch") for t in range(TOPICS)]
    # accepted in turn: even connections live on loop 0, odd ones on loop 1. Publishers
    # take the even ones; consumers the odd ones (their channels are loop 1's: no move)
    publishers: list[tuple[str, WireClient]] = []
    consumers: list[tuple[str, WireClient]] = []
    for k in range(2 * TOPICS * PUBLISHERS_PER_TOPIC):
        c = WireClient.connect(b.tcp_address, timeout=10.0)
        c.pub(f"{prefix}-accepted", b"x")   # a round trip: accepted before the next
        if k % 2 == 0:
            publishers.append((topics[(k // 2) % TOPICS], c))
        elif len(consumers) < TOPICS:
            consumers.append((topics[len(consumers)], c))
        else:
            c.close()
    for topic, c in consumers:
        c.sub(topic, "ch")
        c.send(rdy(1000))

    received: dict[str, set[bytes]] = {t: set() for t in topics}
    problems: list[str] = []
    stop_consuming = threading.Event()

    def consume(topic: str, c: WireClient) -> None:
        got = received[topic]
        while not stop_consuming.is_set():
            try:
                ftype, data = c.read_frame(0.5)
            except TimeoutError:
                continue
            except Exception as e:
                problems.append(f"consumer {topic}: {type(e).__name__}: {e}")
                return
            if ftype == FRAME_MESSAGE:
                m = parse_message(data)
                got.add(m.body)
                c.send(fin(m.id))
            else:
                problems.append(f"consumer {topic}: unexpected frame {ftype} {data!r}")

    rtts: list[list[tuple[float, float]]] = [[] for _ in publishers]
    sent: dict[str, set[bytes]] = {t: set() for t in topics}
    lock = threading.Lock()

    def publish(i: int, topic: str, c: WireClient) -> None:
        start = time.monotonic()
        n = 0
        try:
            while (now := time.monotonic()) - start < SECONDS:
                body = b"%d-%d" % (i, n)
                c.pub(topic, body)
                rtts[i].append((now - start, time.monotonic() - now))
                with lock:
                    sent[topic].add(body)
                n += 1
        except Exception as e:
            problems.append(f"publisher {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=consume, args=(t, c)) for t, c in consumers]
    threads += [threading.Thread(target=publish, args=(i, t, c))
                for i, (t, c) in enumerate(publishers)]
    for t in threads:
        t.start()
    for t in threads[len(consumers):]:
        t.join(SECONDS + 30)
    try:
        wait_until(lambda: all(received[t] == sent[t] for t in topics), 20, 0.05,
                   what="every message at its consumer")
    except AssertionError:
        pass            # the assertions below say which were missing
    stop_consuming.set()
    for t in threads[:len(consumers)]:
        t.join(5)
    for _, c in publishers + consumers:
        c.close()
    assert not problems, "\n".join(problems[:10])

    total = sum(len(s) for s in sent.values())
    assert total > 500, f"only {total} publishes in {SECONDS}s"
    for t in topics:
        missing = sent[t] - received[t]
        assert not missing, f"{len(missing)} of {len(sent[t])} messages of {t} not delivered"
        assert received[t] <= sent[t]
    # bounded round trips, with no drift: the last quarter of the run is not slower than
    # the first (beyond noise on a shared machine), and no round trip waits for long
    samples = [s for per in rtts for s in per]
    first = [rtt for at, rtt in samples if at < SECONDS / 4]
    last = [rtt for at, rtt in samples if at >= SECONDS * 3 / 4]
    assert first and last
    med_first, med_last = statistics.median(first), statistics.median(last)
    assert med_last <= max(3 * med_first, med_first + 0.005), (med_first, med_last)
    print(f"{len(samples)} round trips; median first {med_first * 1e3:.2f} ms, "
          f"last {med_last * 1e3:.2f} ms")
    p99 = statistics.quantiles([rtt for _, rtt in samples], n=100)[98]
    assert p99 < 0.25, f"p99 round trip {p99 * 1000:.1f} ms"
    assert "Traceback" not in b.stderr_text()


# -- the protocol across loops -------------------------------------------------------------
TWO_LOOPS = ("--loop-threads=2", "--msg-timeout=1s", "--max-attempts=3")


@pytest.fixture
def two_loops(make_module_broker: Callable[..., BrokerProcess]) -> BrokerProcess:
    return make_module_broker(*TWO_LOOPS)


def _placed(owner: int, what: str) -> str:
    return _owned_by(owner, 2, unique_name(what) + "-", "ch")


def _q(**kw: str) -> str:
    return urllib.parse.urlencode(kw)


@pytest.mark.parametrize("owner", [0, 1])
def test_fin_req_touch_and_dpub_on_either_loop(two_loops: BrokerProcess, owner: int) -> None:
    b = two_loops
    assert b.tcp_address is not None
    topic = _placed(owner, "xl_fin")
    with WireClient.connect(b.tcp_address) as c:
        c.sub(topic, "ch")
        c.rdy(5)
        c.pub(topic, b"tcp")
        http_pub(b, topic, b"http")
        got = {m.body: m for m in c.read_messages(2, timeout=10)}
        assert set(got) == {b"tcp", b"http"}
        c.send(fin(got[b"tcp"].id))
        c.req(got[b"http"].id, 0)
        again = c.read_message(timeout=10)
        assert (again.body, again.attempts) == (b"http", 2)
        for _ in range(3):                         # held past the 1 s msg_timeout
            time.sleep(0.4)
            c.touch(again.id)
        c.fin(again.id)
        c.dpub(topic, 300, b"later")
        t0 = time.monotonic()
        later = c.read_message(timeout=10)
        assert later.body == b"later" and time.monotonic() - t0 >= 0.25
        c.fin(later.id)
        wait_until(lambda: (channel_stats(b, topic, "ch") or {}).get("in_flight_count") == 0,
                   10, what="every FIN to land")
        st = channel_stats(b, topic, "ch")
        assert st is not None
        assert (st["depth"], st["timeout_count"], st["requeue_count"]) == (0, 0, 1), st


@pytest.mark.parametrize("owner", [0, 1])
def test_timeouts_then_a_dead_letter_across_loops(two_loops: BrokerProcess,
                                                  owner: int) -> None:
    b = two_loops
    assert b.tcp_address is not None
    topic = _placed(owner, "xl_dead")
    with WireClient.connect(b.tcp_address) as c:
        c.sub(topic, "ch")
        c.rdy(1)
        c.pub(topic, b"never finished")
        attempts = [c.read_message(timeout=10).attempts for _ in range(3)]
        assert attempts == [1, 2, 3]               # each one timed out (1 s), unanswered
        wait_until(lambda: (channel_stats(b, topic, "ch") or {}).get(
            "dead_letter_count") == 1, 10, what="the dead letter")
        c.expect_nothing(0.3)
    dead = topic_stats(b, topic + ".dead")
    assert dead is not None and dead["message_count"] == 1, dead


@pytest.mark.parametrize("owner", [0, 1])
def test_pause_empty_and_delete_over_http_reach_the_owner_loop(two_loops: BrokerProcess,
                                                                owner: int) -> None:
    b = two_loops
    assert b.tcp_address is not None
    topic = _placed(owner, "xl_admin")
    with WireClient.connect(b.tcp_address) as c:
        c.sub(topic, "ch")
        assert http(b, "POST", "/channel/pause?" + _q(topic=topic, channel="ch"))[0] == 200
        c.rdy(10)
        http_pub(b, topic, b"held back")
        c.expect_nothing(0.3)
        assert http(b, "POST", "/channel/empty?" + _q(topic=topic, channel="ch"))[0] == 200
        assert (channel_stats(b, topic, "ch") or {}).get("depth") == 0
        assert http(b, "POST", "/channel/unpause?" + _q(topic=topic, channel="ch"))[0] == 200
        c.pub(topic, b"after")
        m = c.read_message(timeout=10)
        assert m.body == b"after"
        c.fin(m.id)
        assert http(b, "POST", "/channel/delete?" + _q(topic=topic, channel="ch"))[0] == 200
        c.assert_closed()
    assert channel_stats(b, topic, "ch") is None
