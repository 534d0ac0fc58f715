"""Replicated topics (docs/replication.md) with a real etcd and three real pybroker
nodes on loopback: acknowledgement by min-insync replicas, refusal below it, a leader
killed with -9 under load, a leader paused past its lease, a follower killed and
restarted. Every wait has a deadline; each test is bounded (pytest-timeout)."""
from __future__ import annotations

import base64
import json
import math
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pytest

from pybroker.cluster.serveconn import request_limit
from pybroker.cluster.syncs import RESUME_AFTER, SLOW_NS
from pybroker.cluster.states import joined, parts_of, take
from pybroker.cluster.wire import FrameReader, encode
from pybroker.testing import wait_until
from tests.support.http import channel_stats, http_json
from tests.support.nsqtools import start_nsqlookupd
from tests.support.cluster import Cluster, Consumers, Publishers, _Conn
from tests.support.wire import FRAME_ERROR, FRAME_RESPONSE, WireClient, dpub, identify, \
    mpub, pub, sub
from tests.support.wire import Message as WireMessage

pytestmark = pytest.mark.timeout(120)
TOPIC = "orders"


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(*extra: str) -> Cluster:
        made.append(Cluster(3, extra=list(extra)))
        return made[-1]

    yield make
    problems = [p for c in made for p in c.close()]
    assert not problems, "\n".join(problems)


@pytest.fixture
def cluster(make_cluster: Callable[..., Cluster]) -> Cluster:
    return make_cluster()


def _create(c: Cluster, topic: str = TOPIC, members: int = 3) -> int:
    """Publish the topic's first message on node 1; the leader once settled."""
    status, body = c.http_pub(1, topic, b"first")
    assert (status, body) == (200, b"OK"), (status, body)
    lead = wait_until(lambda: c.settled(topic, members), 15, 0.05,
                      what=f"{topic} to have a leader and {members} in sync")
    assert isinstance(lead, int)
    return lead


def _faulty_cluster(tmp_path: Path, *rules: str, extra: Sequence[str] = (),
                    min_insync: int = 2) -> tuple[Cluster, dict[int, Path]]:
    """Three nodes, each with a fault plan of ``rules`` (storage/fileops.py) that
    holds on node i while its flag file (the second value, by node id) exists."""
    flags = {i: tmp_path / f"fault{i}" for i in (1, 2, 3)}
    c = Cluster(3, min_insync=min_insync, extra=list(extra), node_env={
        i: {"PYBROKER_FAULTS": "; ".join(f"{r} count=0 while={flag}" for r in rules)}
        for i, flag in flags.items()})
    return c, flags


def _traffic(c: Cluster, what: str) -> tuple[Consumers, Publishers]:
    """4 consumers and 8 publishers running, once both are under way."""
    cons = Consumers(c, TOPIC, "ch", 4)
    pubs = Publishers(c, TOPIC, 8)
    try:
        wait_until(lambda: len(cons.received()) >= 50 and pubs.count() >= 100, 30,
                   what=f"traffic {what}")
    except BaseException:
        pubs.stop()
        cons.stop()
        raise
    return cons, pubs


def _every_acknowledged_delivered(cons: Consumers, acked: set[bytes]) -> None:
    """Wait until the consumers received every acknowledged body; stop them."""
    try:
        wait_until(lambda: acked <= cons.received(), 30, 0.1,
                   what="every acknowledged message delivered")
    finally:
        cons.stop()
    missing = acked - cons.received()
    assert not missing, f"{len(missing)} acknowledged messages lost: {sorted(missing)[:10]}"


def _pub_answer(c: Cluster, i: int, body: bytes, timeout_s: float = 20) -> tuple[int, bytes]:
    conn = _Conn(c.nodes[i].tcp_address)     # type: ignore[arg-type]
    try:
        conn.sock.sendall(pub(TOPIC, body))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = conn.frames(0.5)
            if got:
                return got[0]
        raise AssertionError(f"no answer to PUB within {timeout_s}s")
    finally:
        conn.close()


def test_publish_is_acknowledged_once_min_insync_replicas_hold_it(cluster: Cluster) -> None:
    c = cluster
    lead = _create(c)
    followers = [i for i in c.nodes if i != lead]
    # through the leader and through a follower (forwarded): OK only once replicated
    for n, i in enumerate([lead, *followers]):
        assert _pub_answer(c, i, f"ack-{n}".encode()) == (FRAME_RESPONSE, b"OK")
        # the leader answered after the high watermark passed the record: at least
        # min-insync (2) nodes hold it already, checked at once (no waiting)
        held = [j for j in c.nodes
                if (c.replication(j, TOPIC) or {}).get("log_end", 0) >= n + 2]
        assert len(held) >= 2 and lead in held, (n, held)
    # MPUB and DPUB through a follower: forwarded as they are, answered after the leader
    f = followers[0]
    for cmd in (mpub(TOPIC, [b"batch-1", b"batch-2", b"batch-3"]),
                dpub(TOPIC, 50, b"deferred")):
        conn = _Conn(c.nodes[f].tcp_address)     # type: ignore[arg-type]
        try:
            conn.sock.sendall(cmd)
            got = wait_until(lambda conn=conn: conn.frames(0.5), 20, what="an answer")
        finally:
            conn.close()
        assert got == [(FRAME_RESPONSE, b"OK")], got
    # a SUB on a follower is refused with the leader's name and address
    conn = _Conn(c.nodes[f].tcp_address)         # type: ignore[arg-type]
    try:
        conn.sock.sendall(sub(TOPIC, "ch"))
        got = wait_until(lambda: conn.frames(0.5), 10, what="the SUB's answer")
    finally:
        conn.close()
    leader_addr = c.nodes[lead].tcp_hostport
    assert got[0][0] == FRAME_ERROR and got[0][1].startswith(b"E_SUB_FAILED")  # type: ignore[index]
    assert f"node {lead} ({leader_addr})".encode() in got[0][1]   # type: ignore[index]
    r = c.replication(lead, TOPIC)
    assert r is not None and r["high_watermark"] == 8 and sorted(r["isr"]) == [1, 2, 3]
    assert set(r["lag"]) == {str(i) for i in followers}
    # /metrics and `pybroker cluster status` say the same
    with urllib.request.urlopen(c.nodes[lead].http_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert f'nsq_cluster_role{{topic="{TOPIC}"}} 2' in text
    assert f'nsq_cluster_insync_replicas{{topic="{TOPIC}"}} 3' in text
    for i in followers:
        assert f'nsq_cluster_replica_lag_messages{{topic="{TOPIC}",follower="{i}"}} 0' \
            in text
    out = subprocess.run([sys.executable, "-m", "pybroker", "cluster", "status",
                          f"--cluster-etcd={c.etcd.url}", "--json"], capture_output=True,
                         timeout=30, check=True).stdout
    st = json.loads(out)["topics"][TOPIC]
    assert st["leader"] == lead and sorted(st["isr"]) == [1, 2, 3] and st["epoch"] == 1
    assert {k: v["messages"] for k, v in st["lag"].items()} == {str(i): 0 for i in followers}
    text = subprocess.run([sys.executable, "-m", "pybroker", "cluster", "status",
                           f"--cluster-etcd={c.etcd.url}"], capture_output=True,
                          timeout=30, check=True).stdout.decode()
    assert TOPIC in text and "LEADER" in text


def test_min_insync_not_met_refuses_publishes(cluster: Cluster) -> None:
    c = cluster
    lead = _create(c)
    f1, f2 = [i for i in c.nodes if i != lead]
    c.nodes[f1].kill9()
    c.nodes[f2].kill9()
    # whatever is in flight when the followers die is never answered OK; once the
    # in-sync set shrank to the leader alone, publishes are refused at once
    answers = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        a = _pub_answer(c, lead, b"no-replicas")
        answers.append(a)
        if a[0] == FRAME_ERROR and b"in-sync" in a[1]:
            break
    assert all(a[0] == FRAME_ERROR and a[1].startswith(b"E_PUB_FAILED") for a in answers), \
        answers
    assert b"in-sync" in answers[-1][1], answers
    r = c.replication(lead, TOPIC)
    assert r is not None and r["isr"] == [lead], r
    # HTTP says it too (nsqd's 500 PUB_FAILED)
    status, _ = c.http_pub(lead, TOPIC, b"no-replicas-http")
    assert status == 500
    # one follower back: it catches up, rejoins the in-sync set, publishes work again
    c.nodes[f1].start()
    wait_until(lambda: c.settled(TOPIC, 2) == lead, 20, 0.05, what="follower back in sync")
    assert _pub_answer(c, lead, b"replicated-again") == (FRAME_RESPONSE, b"OK")


@pytest.mark.parametrize("durability", ["memory", "fsync"])
def test_leader_killed_under_load_loses_no_acknowledged_message(
        make_cluster: Callable[..., Cluster], durability: str) -> None:
    c = make_cluster(f"--durability={durability}")
    old = _create(c)
    cons, pubs = _traffic(c, "before the kill")
    try:
        killed_at = time.monotonic()
        c.nodes[old].kill9()
        acked_before = pubs.count()
        new = wait_until(lambda: c.leader(TOPIC, exclude=(old,)), 15, 0.05,
                         what="a new leader")
        wait_until(lambda: pubs.count() >= acked_before + 100, 30,
                   what="publishes acknowledged by the new leader")
        first = wait_until(lambda: cons.first_after(killed_at, old), 15, 0.05,
                           what="a message delivered by the new leader")
        assert isinstance(first, float)
        assert first - killed_at < 10, f"consumers waited {first - killed_at:.1f}s"
    finally:
        acked = pubs.stop()
    _every_acknowledged_delivered(cons, acked)
    assert new != old
    # at least once: what is delivered again is what was in flight or finished after
    # the last channel snapshot the new leader had (shipped every 200 ms)
    again = cons.deliveries - len(cons.received())
    print(f"{durability}: {len(acked)} acknowledged, {again} delivered again")
    r = c.replication(int(new), TOPIC)     # type: ignore[call-overload]
    assert r is not None and r["epoch"] >= 2 and old not in r["isr"]


def test_paused_leader_stops_acknowledging_and_rejoins_as_follower(cluster: Cluster) -> None:
    c = cluster
    forwarded: set[bytes] = set()
    old = _create(c)
    epoch = c.replication(old, TOPIC)["epoch"]   # type: ignore[index]
    pubs = Publishers(c, TOPIC, 4)
    direct = _Conn(c.nodes[old].tcp_address)     # type: ignore[arg-type]
    try:
        wait_until(lambda: pubs.count() >= 50, 20, what="traffic before the pause")
        c.nodes[old].proc.send_signal(signal.SIGSTOP)     # type: ignore[union-attr]
        try:
            # publishes sent to the paused leader wait in its socket
            for k in range(20):
                direct.sock.sendall(pub(TOPIC, f"during-pause-{k}".encode()))
            new = wait_until(lambda: c.leader(TOPIC, exclude=(old,)), 20, 0.05,
                             what="a new leader while the old one is paused")
            acked_mid = pubs.count()
            wait_until(lambda: pubs.count() >= acked_mid + 50, 20,
                       what="the new leader acknowledging")
        finally:
            c.nodes[old].proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        # the old leader answers what waited in its socket: E_PUB_FAILED while it still
        # thinks it leads (its lease is over by its own clock), or, once it knows it
        # follows, OK after forwarding to the new leader; each OK is checked below
        # (a message acknowledged by a leader without its lease would be cut from the
        # log with its tail, and missed by the consumer)
        answers = []
        try:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and len(answers) < 20:
                answers += direct.frames(0.5)
        except ConnectionError:
            pass                                   # E_PUB_FAILED is fatal: it closed
        assert answers, "the old leader answered nothing"
        oks = [a for a in answers if a == (FRAME_RESPONSE, b"OK")]
        assert answers[:len(oks)] == oks, answers          # OKs, then at most one error
        assert all(a[0] == FRAME_ERROR and a[1].startswith(b"E_PUB_FAILED")
                   for a in answers[len(oks):]), answers
        forwarded = {f"during-pause-{k}".encode() for k in range(len(oks))}
        # it rejoins as a follower of the new leader at the new epoch
        r = wait_until(lambda: (lambda x: x if x and x["role"] == "follower"
                                and x["leader"] == new else None)(c.replication(old, TOPIC)),
                       20, 0.05, what="the old leader to follow")
        assert r["epoch"] > epoch     # type: ignore[index]
    finally:
        direct.close()
        acked = pubs.stop()
    assert not any(b.startswith(b"during-pause") for b in acked)
    acked |= forwarded
    # nothing acknowledged is lost: a consumer of the new leader gets all of it
    cons = Consumers(c, TOPIC, "after", 2)
    try:
        wait_until(lambda: acked <= cons.received(), 30, 0.1,
                   what="every acknowledged message delivered")
    finally:
        cons.stop()
    # the old leader's unacknowledged tail was cut: all three logs end up the same,
    # record for record (raw bytes: offsets, timestamps, checksums)
    wait_until(lambda: len({(c.replication(i, TOPIC) or {}).get("log_end")
                            for i in c.nodes}) == 1, 20, 0.05, what="the logs to converge")
    logs = set()
    for i in c.nodes:
        with urllib.request.urlopen(f"{c.nodes[i].http_url}/topic/read?topic={TOPIC}"
                                    "&offset=0&max_messages=1000000", timeout=10) as resp:
            logs.add(resp.read())
    assert len(logs) == 1 and len(logs.pop()) > 0


def test_a_publish_forwarded_to_a_paused_leader_goes_to_the_next_one(cluster: Cluster) -> None:
    """A producer connected to a follower publishes while the leader is paused (SIGSTOP)
    past its lease: the follower forwards to the old leader, whose socket holds the
    publishes. Resumed, the old leader either refuses them (its lease expired: the
    follower sends them again to the next leader, ``ports.leadership_moved``; the unit
    test of that is tests/unit/test_cluster_forward.py) or, once it knows it follows,
    forwards them itself. Either way the producer sees a delay and OKs."""
    c = cluster
    old = _create(c)
    via = next(i for i in c.nodes if i != old)
    conn = _Conn(c.nodes[via].tcp_address)     # type: ignore[arg-type]
    bodies = [f"via-{k}".encode() for k in range(5)]
    try:
        c.nodes[old].proc.send_signal(signal.SIGSTOP)     # type: ignore[union-attr]
        try:
            for body in bodies:
                conn.sock.sendall(pub(TOPIC, body))
            wait_until(lambda: c.leader(TOPIC, exclude=(old,)), 20, 0.05,
                       what="a new leader while the old one is paused")
        finally:
            c.nodes[old].proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        answers: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and len(answers) < len(bodies):
            answers += conn.frames(0.5)
        assert answers == [(FRAME_RESPONSE, b"OK")] * len(bodies), answers
    finally:
        conn.close()
    _every_acknowledged_delivered(Consumers(c, TOPIC, "ch", 1), set(bodies))


def test_only_the_leader_is_registered_with_nsqlookupd(
        make_cluster: Callable[..., Cluster]) -> None:
    lookupd = start_nsqlookupd()
    try:
        c = make_cluster(f"--lookupd-tcp-address={lookupd.hostport('TCP')}",
                         "--broadcast-address=127.0.0.1")

        def listed() -> list[int] | None:
            status, doc = http_json("GET", f"http://{lookupd.hostport()}/lookup?topic={TOPIC}")
            if status != 200:
                return None
            return sorted(p["tcp_port"] for p in doc["producers"])  # type: ignore[index]

        def port(i: int) -> int:
            return c.nodes[i].tcp_address[1]    # type: ignore[index]

        old = _create(c)
        wait_until(lambda: listed() == [port(old)], 10, 0.05, what="lookupd to list the leader")
        c.nodes[old].kill9()
        new = wait_until(lambda: c.leader(TOPIC, exclude=(old,)), 15, 0.05,
                         what="a new leader")
        wait_until(lambda: listed() == [port(new)], 10, 0.05,   # type: ignore[arg-type]
                   what="lookupd to list the new leader alone")
    finally:
        assert lookupd.stop() == 0, lookupd.text()


def _publish_and_consume(c: Cluster, lead: int) -> None:
    """300 messages of about 200 bytes MPUBed to the leader in six, every one consumed
    there by one consumer on channel ``ch`` (its segments may then go)."""
    cons = Consumers(c, TOPIC, "ch", 1)
    try:
        wait_until(lambda: cons.subscribed, 10, what="a consumer on the leader")
        bodies = [f"r-{k}-".encode() + b"x" * 200 for k in range(300)]
        for k in range(0, 300, 50):
            conn = _Conn(c.nodes[lead].tcp_address)     # type: ignore[arg-type]
            try:
                conn.sock.sendall(mpub(TOPIC, bodies[k:k + 50]))
                got = wait_until(lambda conn=conn: conn.frames(0.5), 20, what="an answer")
            finally:
                conn.close()
            assert got == [(FRAME_RESPONSE, b"OK")], got
        wait_until(lambda: set(bodies) <= cons.received(), 20, what="everything consumed")
    finally:
        cons.stop()


def _oldest(c: Cluster, i: int) -> int:
    """Node i's oldest offset of TOPIC (/topic/offsets)."""
    status, doc = http_json("GET", f"{c.nodes[i].http_url}/topic/offsets?topic={TOPIC}")
    assert status == 200, doc
    return int(doc["oldest_offset"])


def test_follower_retention_follows_the_leaders_channels(
        make_cluster: Callable[..., Cluster]) -> None:
    """Followers have no channels of their own: their segments go once the leader's
    channels have consumed them (they would otherwise keep the whole log forever)."""
    c = make_cluster("--max-bytes-per-file=4096", "--sync-timeout=200ms")
    lead = _create(c)
    _publish_and_consume(c, lead)

    for i in c.nodes:
        wait_until(lambda i=i: _oldest(c, i) > 200, 20, 0.1,
                   what=f"node {i} to delete consumed segments")


def test_channel_states_survive_two_failovers(cluster: Cluster) -> None:
    """Consumer state is replicated from whichever node leads: after a second failover
    the third leader starts from the second one's channel states, so what was finished
    there is not delivered again."""
    c = cluster
    lead = _create(c)
    cons = Consumers(c, TOPIC, "ch", 1)
    try:
        killed: list[int] = []
        for round_ in range(2):
            wait_until(lambda: cons.subscribed, 15, what="a consumer on the leader")
            bodies = {f"round{round_}-{k}".encode() for k in range(300)}
            for k, body in enumerate(sorted(bodies)):
                assert _pub_answer(c, lead, body) == (FRAME_RESPONSE, b"OK"), (round_, k)
            wait_until(lambda b=bodies: b <= cons.received(), 20, what="all consumed")
            # the followers hold the leader's channel states from after the consumption
            version = c.replication(lead, TOPIC)["channel_states"]  # type: ignore[index]
            wait_until(lambda v=version, lead=lead: all(
                (c.replication(i, TOPIC) or {}).get("channel_states", 0) > v
                for i in c.nodes if i != lead and i not in killed), 10, 0.05,
                what="channel states shipped")
            before = cons.deliveries
            c.nodes[lead].kill9()
            killed.append(lead)
            new = wait_until(lambda: c.leader(TOPIC, exclude=tuple(killed)), 15, 0.05,
                             what="a new leader")
            lead = int(new)     # type: ignore[call-overload]
            wait_until(lambda lead=lead: cons.subscribed.get(0) == lead, 15, 0.05,
                       what="the consumer on the new leader")
            # whatever the new leader delivers again came after the states it holds
            assert _pub_answer(c, lead, f"marker{round_}".encode()) == (FRAME_RESPONSE, b"OK")
            wait_until(lambda r=round_: f"marker{r}".encode() in cons.received(), 15,
                       what="the marker")
            again = cons.deliveries - before - 1
            assert again <= 60, (f"round {round_}: {again} finished messages delivered "
                                 "again:\n" + "".join(
                                     ln for i in c.nodes for ln in c.nodes[i].stderr_lines
                                     if "CLUSTER" in ln and "fetching" not in ln))
            if round_ == 0:     # the first node back (min-insync 2 needs two nodes)
                back = killed.pop()
                c.nodes[back].start()
                wait_until(lambda: c.settled(TOPIC, 3), 20, 0.05, what="three in sync")
    finally:
        cons.stop()


def test_hostile_replication_peers_are_dropped(cluster: Cluster) -> None:
    """The replication port (never an NSQ client's) drops a peer that sends an
    oversized frame (over a fetch's limit and the default max_body_size, which a
    forwarded publish may carry), a head that is not JSON, an unknown request or a
    publish of no kind; the node goes on."""
    c = cluster
    lead = _create(c)
    addr = c.summary(lead)["replication_address"]
    host, _, port = addr.rpartition(":")
    over = request_limit(5 * 1024 * 1024) + 1
    for junk in (struct.pack(">II", 1 << 30, 4), struct.pack(">II", over, 4) + b"x" * 4096,
                 b"".join(encode({"op": "publish", "id": 1, "node": 9, "topic": TOPIC,
                                  "kind": "truncate"}, b"x")),
                 struct.pack(">II", 12, 8) + b"notjson!",
                 b"".join(encode({"op": "drop_tables"})), b"GET / HTTP/1.1\r\n\r\n"):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(junk)
            s.settimeout(5)
            try:
                assert s.recv(100) == b""        # closed without an answer
            except ConnectionResetError:
                pass
    assert _pub_answer(c, lead, b"still-fine") == (FRAME_RESPONSE, b"OK")


def test_channel_states_are_shipped_in_parts_to_a_peer_that_asks_and_whole_otherwise(
        cluster: Cluster) -> None:
    """A peer on the leader's replication port that fetches with ``"parts": 1`` gets
    the channel states in parts (pybroker.cluster.states), one that does not (a
    follower of an earlier version) gets them whole (``"states"``); both make the same
    JSON, with the channel's deferred message in it."""
    c = cluster
    lead = _create(c)
    L = c.nodes[lead]
    with WireClient.connect(L.tcp_address) as w:   # type: ignore[arg-type]
        w.pub(TOPIC, b"later")
        w.sub(TOPIC, "ch")
        w.rdy(1)
        w.req(w.read_message(10).id, 3_600_000)
        wait_until(lambda: (channel_stats(L, TOPIC, "ch") or {}).get("deferred_count") == 1,
                   10, 0.05, what="the message deferred")
        _states_shipped(c, lead, [i for i in c.nodes if i != lead])
    rep = c.replication(lead, TOPIC) or {}
    host, _, port = c.summary(lead)["replication_address"].rpartition(":")

    def fetch(parts: bool) -> tuple[dict[str, Any], memoryview]:
        req: dict[str, Any] = {"op": "fetch", "node": 99, "wait_ms": 0, "max_bytes": 1024,
                               "topics": [{"name": TOPIC, "epoch": rep["epoch"],
                                           "offset": rep["log_end"], "version": 0,
                                           "hist": [0]}]}
        if parts:
            req["parts"] = 1
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"".join(encode(req)))
            reader = FrameReader()
            frame = None
            while frame is None:
                data = s.recv(1 << 16)
                assert data, "the leader closed the connection"
                reader.feed(data)
                frame = reader.next()
        head, blob = frame
        (entry,) = head["topics"]           # type: ignore[misc]
        assert isinstance(entry, dict)
        return entry, blob

    whole_entry, blob = fetch(parts=False)
    assert "parts" not in whole_entry
    at, n = whole_entry["states"]
    whole_text = json.loads(bytes(blob[at:at + n]))
    parts_entry, blob = fetch(parts=True)
    assert "states" not in parts_entry
    held = take({}, parts_of(parts_entry["parts"], blob))
    pieces, size = joined(held)
    assert json.loads(b"".join(pieces)) == whole_text
    # the deferred message: due in about an hour ([offset, attempts, due wall ns])
    due = [d[2] for d in whole_text["ch"]["pending"] if d[2]]
    assert len(due) == 1 and 3_500 < (due[0] - time.time_ns()) / 1e9 < 3_700, due


def test_killed_follower_restarts_and_catches_up(cluster: Cluster) -> None:
    c = cluster
    lead = _create(c)
    f = next(i for i in c.nodes if i != lead)
    c.nodes[f].kill9()
    for k in range(200):       # min-insync 2 is still met by the leader and one follower
        assert _pub_answer(c, lead, f"while-down-{k}".encode()) == (FRAME_RESPONSE, b"OK")
    end = c.replication(lead, TOPIC)["log_end"]    # type: ignore[index]
    assert end == 201
    c.nodes[f].start()
    wait_until(lambda: (c.replication(f, TOPIC) or {}).get("log_end", 0) == end
               and c.settled(TOPIC, 3) == lead, 20, 0.05,
               what="the restarted follower to catch up and rejoin the in-sync set")
    r = c.replication(lead, TOPIC)
    assert r is not None and r["lag"][str(f)]["messages"] == 0


def test_a_capped_in_sync_set_takes_the_third_replica_in_when_a_member_goes(
        make_cluster: Callable[..., Cluster]) -> None:
    """--max-insync-replicas=2 (docs/replication.md, "At most N in sync"): the in-sync
    set keeps the leader and one follower, and the third replica, outside it, holds the
    records all the same. Under 8 publishers and 4 consumers: the member follower killed
    with -9, the third takes its place and publishes go on; the killed one back, it
    catches up outside the full set; then the leader killed, the member left leads with
    the other in sync. No acknowledged message lost, consumers served within 10 s."""
    c = make_cluster("--max-insync-replicas=2")
    lead = _create(c, members=2)
    r = c.replication(lead, TOPIC)
    assert r is not None
    member = next(i for i in r["isr"] if i != lead)
    outside = next(i for i in c.nodes if i not in r["isr"])

    def isr() -> set[int]:
        return set((c.replication(lead, TOPIC) or {}).get("isr", []))

    def holds(i: int, end: int) -> bool:
        return int((c.replication(i, TOPIC) or {}).get("log_end", 0)) >= end

    cons, pubs = _traffic(c, "with two in sync")
    try:
        end = int(c.replication(lead, TOPIC)["log_end"])     # type: ignore[index]
        wait_until(lambda: holds(outside, end), 10, 0.05,
                   what="the replica outside the set to hold the records")
        c.nodes[member].kill9()
        acked_before = pubs.count()
        wait_until(lambda: isr() == {lead, outside}, 20, 0.05,
                   what="the third replica to take the killed member's place")
        wait_until(lambda: pubs.count() >= acked_before + 100, 30,
                   what="publishes acknowledged with the new member")
        c.nodes[member].start()
        end = int(c.replication(lead, TOPIC)["log_end"])     # type: ignore[index]
        wait_until(lambda: holds(member, end), 20, 0.05,
                   what="the restarted replica to catch up outside the set")
        assert isr() == {lead, outside}
        killed_at = time.monotonic()
        c.nodes[lead].kill9()
        acked_before = pubs.count()
        new = wait_until(lambda: c.leader(TOPIC, exclude=(lead,)), 15, 0.05,
                         what="a new leader")
        assert new == outside            # the only live member of the set
        wait_until(lambda: pubs.count() >= acked_before + 100, 30,
                   what="publishes acknowledged by the new leader")
        first = wait_until(lambda: cons.first_after(killed_at, lead), 15, 0.05,
                           what="a message delivered by the new leader")
        assert isinstance(first, float) and first - killed_at < 10, first - killed_at
    finally:
        acked = pubs.stop()
    _every_acknowledged_delivered(cons, acked)
    r = c.replication(outside, TOPIC)
    assert r is not None and set(r["isr"]) == {outside, member}, r


def test_topics_owned_by_two_loops_replicate(
        make_cluster: Callable[..., Cluster]) -> None:
    """With two event loops a node's topics are spread over both: each loop fetches
    its own from the leader, and the leader serves a follower's connection on one loop
    while the topic it asks for may be another's."""
    c = make_cluster("--loop-threads=2")
    topics = [f"two_loops_{k}" for k in range(4)]
    leads = {t: _create(c, t) for t in topics}
    for t, lead in leads.items():
        for k in range(30):
            status, body = c.http_pub(lead, t, f"{t}-{k}".encode())
            assert (status, body) == (200, b"OK"), (t, status, body)

    def replicated() -> bool:
        return all((c.replication(i, t) or {}).get("log_end") == 31
                   for t in topics for i in c.nodes)

    wait_until(replicated, 20, 0.05, what="every replica to hold all 31 records")
    for t, lead in leads.items():
        r = c.replication(lead, t)
        assert r is not None and r["high_watermark"] == 31 and len(r["isr"]) == 3


def test_gnsq_clients_work_unchanged_across_a_failover(
        make_cluster: Callable[..., Cluster]) -> None:
    """A real NSQ client library (gnsq): its producer talks to a follower (forwarded),
    its consumer discovers the leader through a real nsqlookupd; the leader is killed;
    every publish answered OK is delivered, the new leader's within 10 s."""
    import gevent
    import gnsq

    from tests.support.each_once import green_wait

    lookupd = start_nsqlookupd()
    consumer = producer = None
    try:
        c = make_cluster(f"--lookupd-tcp-address={lookupd.hostport('TCP')}",
                         "--broadcast-address=127.0.0.1")
        old = _create(c)
        f = next(i for i in c.nodes if i != old)
        received: dict[bytes, float] = {}
        consumer = gnsq.Consumer(TOPIC, "ch", lookupd_http_addresses=[lookupd.hostport()],
                                 lookupd_poll_interval=1, lookupd_poll_jitter=0.1,
                                 max_in_flight=50)

        def handler(_consumer: object, message: gnsq.Message) -> None:
            received.setdefault(message.body, time.monotonic())    # FIN'd on return

        consumer.on_message.connect(handler, weak=False)
        producer = gnsq.Producer(nsqd_tcp_addresses=[c.nodes[f].tcp_hostport])
        consumer.start(block=False)
        producer.start()

        def publish(prefix: str, n: int) -> set[bytes]:
            bodies = [f"{prefix}-{k}".encode() for k in range(n)]
            results = [producer.publish(TOPIC, b, raise_error=False)  # type: ignore[union-attr]
                       for b in bodies]
            return {b for b, r in zip(bodies, results) if r.get(timeout=30) == b"OK"}

        before = publish("before", 100)
        assert len(before) == 100
        green_wait(lambda: before <= set(received), "delivery before the kill", 20)
        killed = time.monotonic()
        c.nodes[old].kill9()
        after = publish("after", 100)       # forwarded to the new leader once elected
        assert after, "no publish acknowledged after the failover"
        green_wait(lambda: (before | after) <= set(received),
                   "every acknowledged publish delivered", 30)
        first = min(t for b, t in received.items() if b in after)
        assert first - killed < 10, f"{first - killed:.1f}s"
    finally:
        for client in (producer, consumer):
            if client is not None:
                client.close()
                client.join(5)
        gevent.sleep(0)
        assert lookupd.stop() == 0, lookupd.text()


def test_nsq_go_tools_work_unchanged_across_a_failover(
        make_cluster: Callable[..., Cluster], tmp_path: Path) -> None:
    """NSQ's own programs (go-nsq inside): to_nsq publishes to a follower (forwarded to
    the leader), nsq_tail finds the leader through a real nsqlookupd (polled every
    second, ``-consumer-opt``); the leader is killed; to_nsq, run again on a follower
    once a new leader leads, is answered OK for every line; nsq_tail prints every line
    of both runs, the new leader's within 10 s of the kill."""
    from tests.support.programs import require_program
    to_nsq = require_program("to_nsq")
    nsq_tail = require_program("nsq_tail")
    lookupd = start_nsqlookupd()
    tail: subprocess.Popen[bytes] | None = None
    out = tmp_path / "tail.out"
    try:
        c = make_cluster(f"--lookupd-tcp-address={lookupd.hostport('TCP')}",
                         "--broadcast-address=127.0.0.1")
        old = _create(c)
        f = next(i for i in c.nodes if i != old)

        def to_nsq_on(node: int, lines: list[bytes]) -> subprocess.Popen[bytes]:
            proc = subprocess.Popen([to_nsq, f"-topic={TOPIC}",
                                     f"-nsqd-tcp-address={c.nodes[node].tcp_hostport}"],
                                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE)
            assert proc.stdin is not None
            proc.stdin.write(b"\n".join(lines) + b"\n")
            proc.stdin.close()
            return proc

        def answered_ok(proc: subprocess.Popen[bytes]) -> None:
            assert proc.wait(60) == 0, proc.stderr.read().decode(errors="replace")[-2000:] \
                if proc.stderr else proc.returncode

        def printed() -> set[bytes]:
            return set(out.read_bytes().splitlines()) if out.exists() else set()

        with open(out, "wb") as sink:
            tail = subprocess.Popen([nsq_tail, f"-topic={TOPIC}", "-channel=tail",
                                     f"-lookupd-http-address={lookupd.hostport()}",
                                     "-consumer-opt=lookupd_poll_interval,1s",
                                     "-consumer-opt=lookupd_poll_jitter,0.1"],
                                    stdout=sink, stderr=subprocess.DEVNULL)
        # nsq_tail's channel is made when it subscribes: lines published before that
        # would not be its own
        wait_until(lambda: channel_stats(c.nodes[old], TOPIC, "tail") is not None, 20,
                   0.05, what="nsq_tail to subscribe on the leader")
        before = [f"before-{k}".encode() for k in range(200)]
        answered_ok(to_nsq_on(f, before))
        wait_until(lambda: set(before) <= printed(), 20, 0.05,
                   what="nsq_tail to print every line published before the kill")
        killed = time.monotonic()
        c.nodes[old].kill9()
        new = wait_until(lambda: c.leader(TOPIC, exclude=(old,)), 15, 0.05,
                         what="a new leader")
        other = next(i for i in c.nodes if i not in (old, new))
        after = [f"after-{k}".encode() for k in range(200)]
        pub = to_nsq_on(other, after)
        wait_until(lambda: bool(set(after) & printed()), 15, 0.02,
                   what="nsq_tail to print a line published after the kill")
        first = time.monotonic() - killed
        answered_ok(pub)
        wait_until(lambda: set(after) <= printed(), 20, 0.05,
                   what="nsq_tail to print every line published after the kill")
        assert first < 10, f"{first:.1f}s"
    finally:
        if tail is not None:
            tail.terminate()
            tail.wait(10)
        assert lookupd.stop() == 0, lookupd.text()
    assert tail.returncode == 0, tail.returncode


@pytest.mark.parametrize("publish_opts,tail_opts", [
    (["deflate,true", "deflate_level,3"], ["snappy,true"]),
    (["snappy,true"], ["deflate,true", "deflate_level,6"]),
], ids=["deflate-in-snappy-out", "snappy-in-deflate-out"])
def test_nsq_go_tools_over_tls_and_compression_through_a_follower(
        make_cluster: Callable[..., Cluster], tmp_path: Path, publish_opts: list[str],
        tail_opts: list[str]) -> None:
    """Every node requires TLS of its TCP clients: to_nsq (TLS and one compression) publishes 300 lines to
    a follower, which forwards them to the leader; nsq_tail (TLS and the other) reads
    them from the leader, every line once and in order."""
    from tests.support.certs import make_certs
    from tests.support.programs import require_program
    to_nsq = require_program("to_nsq")
    nsq_tail = require_program("nsq_tail")
    certs = make_certs(tmp_path / "certs")
    c = make_cluster(f"--tls-cert={certs.server_cert}", f"--tls-key={certs.server_key}",
                     "--tls-required=tcp-https")
    lead = _create(c, "tls_orders")
    f = next(i for i in c.nodes if i != lead)
    tls = ["tls_v1,true", f"tls_root_ca_file,{certs.ca}"]
    tail = subprocess.Popen(
        [nsq_tail, "-topic=tls_orders", "-channel=tail", "-n", "301",
         f"-nsqd-tcp-address={c.nodes[lead].tcp_hostport}",
         *[f"-consumer-opt={o}" for o in tls + tail_opts]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: channel_stats(c.nodes[lead], "tls_orders", "tail") is not None,
                   20, 0.05, what="nsq_tail to subscribe")
        lines = [f"line-{k}".encode() for k in range(300)]
        pub = subprocess.run(
            [to_nsq, "-topic=tls_orders", f"-nsqd-tcp-address={c.nodes[f].tcp_hostport}",
             *[f"-producer-opt={o}" for o in tls + publish_opts]],
            input=b"\n".join(lines) + b"\n", capture_output=True, timeout=60,
            check=False)
        assert pub.returncode == 0, pub.stderr.decode(errors="replace")[-2000:]
        out, err = tail.communicate(timeout=30)
    finally:
        if tail.poll() is None:
            tail.kill()
            tail.wait(10)
    assert tail.returncode == 0, err.decode(errors="replace")[-2000:]
    # the topic had no channel before nsq_tail's: as nsqd, its first channel takes
    # what was published before it (the "first" message of _create)
    assert out.splitlines() == [b"first", *lines], out[-500:]


def test_publishes_through_a_follower_of_a_cluster_that_asks_auth(
        make_cluster: Callable[..., Cluster]) -> None:
    """Every node asks an auth server (``--auth-http-address``): a producer on a follower
    AUTHs there and publishes; the follower forwards over the replication port (the
    leader's NSQ port would ask the forwarding node to AUTH too), so its publishes are
    acknowledged and on every replica; a secret with no authorization is refused by the
    follower itself."""
    from pybroker.client import Producer
    from pybroker.client.errors import AuthError
    from tests.integration.test_auth import AuthServer

    server = AuthServer()
    try:
        c = make_cluster(f"--auth-http-address={server.address}")
        lead = _create(c, "pub_orders")
        f = next(i for i in c.nodes if i != lead)
        with Producer(c.nodes[f].tcp_hostport, auth_secret="good") as p:
            for k in range(20):
                p.publish("pub_orders", f"m{k}".encode())
            p.multi_publish("pub_orders", [b"a", b"b", b"c"])
        asked = [q.get("secret") for q in server.queries]
        assert asked and set(asked) == {"good"}, asked

        def replicated() -> bool:
            return all((c.replication(i, "pub_orders") or {}).get("log_end") == 24
                       for i in c.nodes)

        wait_until(replicated, 20, 0.05, what="every replica to hold the 24 records")
        with pytest.raises(AuthError, match="E_UNAUTHORIZED"):
            with Producer(c.nodes[f].tcp_hostport, auth_secret="none") as p:
                p.publish("pub_orders", b"refused")
    finally:
        server.stop()


def test_actions_on_a_followers_http_port_are_sent_to_the_leader(
        make_cluster: Callable[..., Cluster]) -> None:
    """A channel's pause (and the other actions that change a replicated topic or its
    channels) on a follower answers 307 to the same path on the leader, which curl -L
    and nsqadmin (given every node's HTTP address, so it asks the followers too)
    follow: the leader's channel is paused and unpaused (whose state the followers
    hold for a failover: test_a_paused_topic_and_channel_settings_survive_failover).
    A follower never answers 200 for a change it did not make where consumers read.
    Making and deleting a topic stay cluster-wide on any node."""
    from tests.support.nsqtools import start_nsqadmin
    from tests.support.programs import require_program
    curl = require_program("curl")
    c = make_cluster("--broadcast-address=127.0.0.1")   # (the Location's host)
    lead = _create(c, "adm")
    f = next(i for i in c.nodes if i != lead)
    status, _ = http_json("POST", f"{c.nodes[lead].http_url}/channel/create?topic=adm"
                          "&channel=c1")
    assert status == 200
    path = "/channel/pause?topic=adm&channel=c1"
    req = urllib.request.Request(c.nodes[f].http_url + path, data=b"", method="POST")
    with pytest.raises(urllib.error.HTTPError) as caught:      # (urllib does not follow it)
        urllib.request.urlopen(req, timeout=10)
    assert caught.value.code == 307, caught.value
    assert caught.value.headers["Location"] == c.nodes[lead].http_url + path
    assert json.loads(caught.value.read()) == {"message": "NOT_LEADER"}
    out = subprocess.run([curl, "-sS", "-L", "-X", "POST", "-o", "/dev/null", "-w",
                          "%{http_code} %{url_effective}", c.nodes[f].http_url + path],
                         capture_output=True, text=True, timeout=30, check=False)
    assert out.stdout == f"200 {c.nodes[lead].http_url}{path}", (out.stdout, out.stderr)

    def paused(i: int) -> bool | None:
        ch = channel_stats(c.nodes[i], "adm", "c1")
        return None if ch is None else bool(ch["paused"])

    assert paused(lead) is True
    admin = start_nsqadmin(*[f"--nsqd-http-address={b.http_hostport}"
                             for b in c.nodes.values()])
    try:
        status, body = http_json("POST", f"http://{admin.hostport()}/api/topics/adm/c1",
                                 {"action": "unpause"})
        assert status == 200, (status, body, admin.text()[-2000:])
        assert paused(lead) is False
    finally:
        assert admin.stop() == 0, admin.text()
    # made and deleted through a follower: cluster-wide, answered there
    status, _ = http_json("POST", f"{c.nodes[f].http_url}/topic/create?topic=adm2")
    assert status == 200
    wait_until(lambda: c.leader("adm2") is not None, 15, 0.05, what="a leader of adm2")
    status, _ = http_json("POST", f"{c.nodes[f].http_url}/topic/delete?topic=adm2")
    assert status == 200


def test_pybroker_client_finds_the_new_leader_at_once(
        make_cluster: Callable[..., Cluster]) -> None:
    """pybroker.client with its default lookupd poll interval (60 s): its consumer,
    left without a connection when the leader dies, asks nsqlookupd again until the new
    leader is listed, and receives from it within 10 s; its producer (on a follower)
    has its publishes forwarded."""
    import threading

    from pybroker.client import Consumer, Message, Producer

    lookupd = start_nsqlookupd()
    consumer = producer = None
    try:
        c = make_cluster(f"--lookupd-tcp-address={lookupd.hostport('TCP')}",
                         "--broadcast-address=127.0.0.1")
        old = _create(c)
        f = next(i for i in c.nodes if i != old)
        received: dict[bytes, float] = {}
        lock = threading.Lock()

        def handler(message: Message) -> None:
            with lock:
                received.setdefault(message.body, time.monotonic())

        consumer = Consumer(TOPIC, "ch", handler, max_in_flight=50)
        assert consumer.config.lookupd_poll_interval >= 60
        consumer.connect_to_nsqlookupd(lookupd.hostport())
        producer = Producer(c.nodes[f].tcp_hostport)

        def publish(prefix: str, n: int) -> set[bytes]:
            acked = set()
            for k in range(n):
                body = f"{prefix}-{k}".encode()
                try:
                    producer.publish(TOPIC, body, 30)     # type: ignore[union-attr]
                except Exception:
                    continue                              # refused: not acknowledged
                acked.add(body)
            return acked

        def seen() -> set[bytes]:
            with lock:
                return set(received)

        before = publish("before", 50)
        assert len(before) == 50
        wait_until(lambda: before <= seen(), 20, what="delivery before the kill")
        killed = time.monotonic()
        c.nodes[old].kill9()
        after = publish("after", 50)
        assert after, "no publish acknowledged after the failover"
        wait_until(lambda: (before | after) <= seen(), 30,
                   what="every acknowledged publish delivered")
        with lock:
            first = min(t for b, t in received.items() if b in after)
        assert first - killed < 10, f"{first - killed:.1f}s"
    finally:
        if producer is not None:
            producer.stop()
        if consumer is not None:
            consumer.close()
        assert lookupd.stop() == 0, lookupd.text()


def _gone_everywhere(c: Cluster, topic: str) -> bool:
    return all(c.topic_stats(i, topic) is None for i in c.nodes if c.nodes[i].proc)


def _stays_gone(c: Cluster, topic: str, seconds: float) -> None:
    """No node takes the topic up again for ``seconds`` (several coordinator polls:
    one every 200 ms), checked all along."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        back = [i for i in c.nodes if c.nodes[i].proc and c.topic_stats(i, topic)]
        assert not back, f"{topic} came back on nodes {back}"
        time.sleep(0.05)


def _delete(c: Cluster, i: int, topic: str = TOPIC) -> None:
    req = urllib.request.Request(f"{c.nodes[i].http_url}/topic/delete?topic={topic}",
                                 b"", method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


def _consumes_only(c: Cluster, body: bytes, channel: str = "ch") -> None:
    """A consumer of the topic (at its leader) gets ``body`` and nothing else."""
    cons = Consumers(c, TOPIC, channel, 1)
    try:
        wait_until(lambda: body in cons.received(), 15, 0.05, what=f"{body!r}")
    finally:
        cons.stop()
    assert cons.received() == {body}, cons.received()


def _made_again_holds_only_new(c: Cluster, members: int) -> None:
    """A publish after the delete makes a new, empty topic: every replica's log holds
    the new message alone, and a consumer gets it and nothing of the old one."""
    status, body = c.http_pub(1, TOPIC, b"again")
    assert (status, body) == (200, b"OK"), (status, body)
    lead = wait_until(lambda: c.settled(TOPIC, members), 20, 0.05,
                      what=f"the new {TOPIC} to settle on {members} nodes")
    r = c.replication(int(lead), TOPIC)     # type: ignore[call-overload]
    assert r is not None and r["log_end"] == 1 and r["epoch"] == 1, r
    wait_until(lambda: all((c.replication(i, TOPIC) or {}).get("log_end") == 1
                           for i in r["isr"]), 10, 0.05, what="the replicas to hold it")
    _consumes_only(c, b"again")


def _six_on_every_node(c: Cluster) -> tuple[int, int]:
    """The topic with six records on all three nodes; (its leader, a follower)."""
    lead = _create(c)
    for k in range(5):
        assert _pub_answer(c, lead, f"old-{k}".encode()) == (FRAME_RESPONSE, b"OK")
    wait_until(lambda: all((c.replication(i, TOPIC) or {}).get("log_end") == 6
                           for i in c.nodes), 10, 0.05, what="every node to hold 6")
    return lead, next(i for i in c.nodes if i != lead)


def test_deleting_a_topic_deletes_it_on_every_node(cluster: Cluster) -> None:
    """/topic/delete on one node (a follower here; nsqadmin asks the leader) deletes the
    topic on all three, for good: no node registers its copy again. A publish then
    makes a new topic of that name, which holds none of the old records."""
    c = cluster
    lead, f = _six_on_every_node(c)
    _delete(c, f)
    wait_until(lambda: _gone_everywhere(c, TOPIC), 10, 0.05,
               what=f"{TOPIC} deleted on every node")
    _stays_gone(c, TOPIC, 1.5)
    _made_again_holds_only_new(c, 3)


def test_a_node_down_during_a_delete_drops_its_copy_on_return(cluster: Cluster) -> None:
    """A follower killed before the delete comes back with its copy of the deleted
    topic: it drops it rather than registering it again; and a follower that was down
    while the topic was deleted and made again drops the old copy and follows the new."""
    c = cluster
    lead, f = _six_on_every_node(c)
    c.nodes[f].kill9()
    _delete(c, lead)
    wait_until(lambda: _gone_everywhere(c, TOPIC), 10, 0.05,
               what=f"{TOPIC} deleted on the live nodes")
    c.nodes[f].start()
    c.wait_joined(f, 3)
    wait_until(lambda: _gone_everywhere(c, TOPIC), 10, 0.05,
               what=f"the returning node {f} to drop its copy")
    _stays_gone(c, TOPIC, 1.5)
    # down again while the topic is deleted... and made again (without it)
    _made_again_holds_only_new(c, 3)
    lead = int(c.settled(TOPIC, 3))     # type: ignore[arg-type]
    g = next(i for i in c.nodes if i != lead)
    c.nodes[g].kill9()
    _delete(c, lead)
    wait_until(lambda: _gone_everywhere(c, TOPIC), 10, 0.05, what="the second delete")
    status, body = c.http_pub(lead, TOPIC, b"third")
    assert (status, body) == (200, b"OK"), (status, body)
    two = wait_until(lambda: c.settled(TOPIC, 2), 20, 0.05, what="the third incarnation")
    c.nodes[g].start()
    c.wait_joined(g, 3)
    # g held the second incarnation's "again": never the third's record at offset 0
    wait_until(lambda: (c.topic_stats(g, TOPIC) is None
                        or (c.replication(g, TOPIC) or {}).get("log_end") == 1), 15, 0.05,
               what=f"node {g} to drop the old copy")
    r = c.replication(int(two), TOPIC)       # type: ignore[call-overload]
    assert r is not None and r["log_end"] == 1
    _consumes_only(c, b"third", "ch2")


def _states_shipped(c: Cluster, frm: int, to: list[int]) -> None:
    """Until nodes ``to`` hold channel states node ``frm`` (the leader) took after now:
    it snapshots every 200 ms (a new version when a state changed, and at least every
    2 s: RESHIP_NS). The first version seen after now may come from a snapshot taken
    before now and still being encoded then (on the storage thread, which finishes a
    channel's encoding before that channel is snapshotted again); the one seen after
    it was taken after now, so it includes every change made before. (Versions are
    numbered across topics: a step is a change seen, not one more.)"""
    v = (c.replication(frm, TOPIC) or {}).get("channel_states", 0)
    for _ in range(2):
        v = wait_until(lambda v=v: ((c.replication(frm, TOPIC) or {}).get("channel_states", 0)
                                    > v and c.replication(frm, TOPIC)["channel_states"]),  # type: ignore[index]
                       10, 0.05, what=f"node {frm}'s next channel snapshot")
    newer = v
    wait_until(lambda: all((c.replication(i, TOPIC) or {}).get("channel_states", 0) >= newer
                           for i in to), 10, 0.05,
               what=f"nodes {to} to hold node {frm}'s channel states")


def test_a_channel_deleted_by_the_leader_stays_deleted_after_failover(
        cluster: Cluster) -> None:
    """A node that led the topic (and so holds its channels locally) follows again; the
    new leader deletes a channel; when the old one leads again it takes the new
    leader's channels, and the deleted one is not among them (it was, before)."""
    c = cluster
    a = _create(c)
    for ch in ("keep", "drop"):
        req = urllib.request.Request(
            f"{c.nodes[a].http_url}/channel/create?topic={TOPIC}&channel={ch}", b"",
            method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200

    _states_shipped(c, a, [i for i in c.nodes if i != a])
    c.nodes[a].kill9()                            # a's local channels stay on its disk
    b = wait_until(lambda: c.settled(TOPIC, 2), 20, 0.05, what="a new leader")
    assert isinstance(b, int)
    c.nodes[a].start()
    wait_until(lambda: c.settled(TOPIC, 3) == b, 20, 0.05, what=f"node {a} back in sync")
    req = urllib.request.Request(
        f"{c.nodes[b].http_url}/channel/delete?topic={TOPIC}&channel=drop", b"",
        method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
    _states_shipped(c, b, [a])
    third = next(i for i in c.nodes if i not in (a, b))
    c.nodes[third].kill9()                       # only a can take over from b now
    c.nodes[b].kill9()
    wait_until(lambda: c.leader(TOPIC) == a, 20, 0.05, what=f"node {a} to lead again")
    t = c.topic_stats(a, TOPIC)
    assert t is not None
    assert sorted(ch["channel_name"] for ch in t["channels"]) == ["keep"], t["channels"]


def test_a_paused_topic_and_channel_settings_survive_failover(cluster: Cluster) -> None:
    """nsqadmin's topic pause, on the leader, ships with the channel states: the next
    leader keeps the topic paused (what was published after the pause is not
    delivered), and unpausing it there delivers it. So do a channel's dead-letter
    settings (POST /channel/config)."""
    c = cluster
    a = _create(c)

    def post(i: int, path: str) -> None:
        req = urllib.request.Request(f"{c.nodes[i].http_url}{path}", b"", method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200

    post(a, f"/channel/create?topic={TOPIC}&channel=ch")
    post(a, f"/channel/config?topic={TOPIC}&channel=ch&max_attempts=3"
            f"&dead_letter_topic={TOPIC}.parked")
    post(a, f"/topic/pause?topic={TOPIC}")
    for k in range(3):
        assert _pub_answer(c, a, f"held-{k}".encode()) == (FRAME_RESPONSE, b"OK")

    _states_shipped(c, a, [i for i in c.nodes if i != a])     # the pause with them
    c.nodes[a].kill9()
    b = wait_until(lambda: c.settled(TOPIC, 2), 20, 0.05, what="a new leader")
    assert isinstance(b, int)
    # it takes the states over as it becomes leader (its /stats may say leader first)
    wait_until(lambda: (c.topic_stats(b, TOPIC) or {}).get("paused") is True
               and [ch["channel_name"] for ch in c.topic_stats(b, TOPIC)["channels"]]  # type: ignore[index]
               == ["ch"], 10, 0.05, what="the new leader's topic paused, with its channel")
    status, cfg = http_json("GET", f"{c.nodes[b].http_url}/channel/config?topic={TOPIC}"
                                   "&channel=ch")
    assert status == 200 and (cfg["max_attempts"], cfg["dead_letter_topic"]) == \
        (3, f"{TOPIC}.parked"), cfg
    cons = Consumers(c, TOPIC, "ch", 1)
    try:
        wait_until(lambda: cons.subscribed, 15, 0.05, what="the consumer on the new leader")
        # "first" reached the channel before the pause (as in nsqd, a paused topic
        # holds back only what comes after); the rest waits for the unpause
        wait_until(lambda: cons.received() == {b"first"}, 15, 0.05, what="first")
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            assert cons.received() == {b"first"}, cons.received()
            time.sleep(0.05)
        post(b, f"/topic/unpause?topic={TOPIC}")
        wait_until(lambda: len(cons.received()) == 4, 15, 0.05, what="the held messages")
    finally:
        cons.stop()
    assert cons.received() == {b"first", b"held-0", b"held-1", b"held-2"}


def test_a_publish_right_after_a_delete_goes_to_the_new_topic(cluster: Cluster) -> None:
    """Deleted on the leader and published to there at once: the publish waits for the
    name's new incarnation (its registration and election), is answered OK once that
    one's in-sync replicas hold it, and is its only record (nothing of the old one)."""
    c = cluster
    lead, _ = _six_on_every_node(c)
    _delete(c, lead)
    assert _pub_answer(c, lead, b"fresh") == (FRAME_RESPONSE, b"OK")
    new = wait_until(lambda: c.settled(TOPIC, 3), 20, 0.05, what="the new incarnation")
    r = c.replication(int(new), TOPIC)     # type: ignore[call-overload]
    assert r is not None and r["log_end"] == 1 and r["high_watermark"] == 1, r
    wait_until(lambda: all((c.replication(i, TOPIC) or {}).get("log_end") == 1
                           for i in c.nodes), 10, 0.05, what="every node to hold it")
    _consumes_only(c, b"fresh")


def test_followers_sync_on_their_loops_only_while_that_holds_nobody(tmp_path: Path) -> None:
    """fsync mode (pybroker.cluster.syncs): a follower whose loop serves only
    replication fsyncs there; a client on that loop sends its fsyncs to the storage
    thread; a disk that turns slow (the fault plan's ``slow`` fsyncs, over SLOW_NS)
    holds a loop once, then the storage thread syncs until RESUME_AFTER fsyncs in a row
    were fast. Every acknowledged message is on every node throughout. (A real fsync
    over SLOW_NS on a busy machine turns inline syncing off too: the phases that need
    it on publish until it is.)"""
    flag = tmp_path / "slow"
    ms = 3 * SLOW_NS // 1_000_000
    c = Cluster(3, extra=["--durability=fsync"], env={
        "PYBROKER_FAULTS": f"op=fsync kind=slow ms={ms} count=0 while={flag}"})
    try:
        lead = _create(c)
        followers = [i for i in c.nodes if i != lead]
        sent = 1

        def publish(n: int) -> None:
            nonlocal sent
            for _ in range(n):
                assert c.http_pub(lead, TOPIC, f"m{sent}".encode()) == (200, b"OK")
                sent += 1

        def syncs(i: int) -> dict[str, Any]:
            return dict(c.summary(i)["follower_syncs"])

        def all_have_them() -> bool:
            return all((c.replication(i, TOPIC) or {}).get("log_end") == sent
                       for i in c.nodes)

        def publish_until_inline(most: int) -> None:
            for _ in range(most):
                if all(syncs(i)["inline_on"] for i in followers):
                    return
                publish(1)
            raise AssertionError(f"inline syncing still off after {most} publishes: "
                                 f"{[syncs(i) for i in followers]}")

        publish(20)
        wait_until(all_have_them, 15, 0.05, what="every node to hold every message")
        for i in followers:
            s = syncs(i)
            assert s["inline"] >= 1 and s["inline"] + s["handed"] >= 21, s

        # a client on a follower's loop: that follower hands its fsyncs over
        f = followers[0]
        client = _Conn(c.nodes[f].tcp_address)     # type: ignore[arg-type]
        try:
            client.sock.sendall(identify())       # answered: the loop holds it now
            assert client.frames(5) == [(FRAME_RESPONSE, b"OK")]
            before = syncs(f)
            publish(10)
            wait_until(all_have_them, 15, 0.05, what="every node to hold every message")
            after = syncs(f)
            assert after["inline"] == before["inline"], (before, after)
            assert after["handed"] >= before["handed"] + 10, (before, after)
        finally:
            client.close()

        # the disk turns slow: one inline fsync is slow, then the storage thread syncs
        publish_until_inline(4 * RESUME_AFTER)
        wait_until(all_have_them, 15, 0.05, what="every node to hold every message")
        held = {i: syncs(i) for i in followers}
        flag.touch()
        publish(8)
        wait_until(all_have_them, 30, 0.05, what="every node to hold every message")
        for i in followers:
            s = syncs(i)
            assert s["slow"] == held[i]["slow"] + 1 and not s["inline_on"], (held[i], s)
            assert s["inline"] == held[i]["inline"] + 1, (held[i], s)
            assert s["handed"] >= held[i]["handed"] + 7, (held[i], s)

        # fast again: RESUME_AFTER fast handed fsyncs in a row turn inline syncing on
        flag.unlink()
        publish(RESUME_AFTER)
        publish_until_inline(4 * RESUME_AFTER)
        publish(5)
        wait_until(all_have_them, 30, 0.05, what="every node to hold every message")
        for i in followers:
            s = syncs(i)
            assert s["inline"] > held[i]["inline"] + 1, (held[i], s)
            with urllib.request.urlopen(f"{c.nodes[i].http_url}/metrics", timeout=5) as r:
                text = r.read().decode()
            # at least the one the fault plan made (a loaded machine's disk can add
            # a slow one of its own meanwhile: CI saw 2)
            slow = int(text.split("\nnsq_cluster_follower_slow_syncs_total ", 1)[1].split()[0])
            assert slow >= s["slow"] >= held[i]["slow"] + 1, text
            for where in ("inline", "handed"):
                line = f'nsq_cluster_follower_syncs_total{{where="{where}"}} '
                assert int(text.split(line, 1)[1].split()[0]) >= s[where], text
    finally:
        problems = c.close()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("cut_fails", [False, True])
def test_a_follower_whose_fsync_fails_does_not_acknowledge(tmp_path: Path,
                                                           cut_fails: bool) -> None:
    """fsync mode: a follower's fsync fails (EIO from the fault plan, while its flag
    exists). It must not count as holding what it could not sync: it cuts those records
    and asks for them again (``cut_fails``: the cut fails too, and it fetches nothing of
    the topic until a tick's cut works), so the leader sees it behind, drops it from
    the in-sync set, and acknowledges with the others; once its disk works it catches
    up and rejoins. Every acknowledged message is on every node at the end."""
    c, flags = _faulty_cluster(tmp_path, "op=fsync kind=EIO",
                               *(["op=ftruncate kind=EIO"] if cut_fails else []),
                               extra=["--durability=fsync"])
    try:
        lead = _create(c)
        f, other = [i for i in c.nodes if i != lead]
        flags[f].touch()
        failing_from = time.monotonic()
        acked = 1
        for k in range(5):
            assert c.http_pub(lead, TOPIC, f"m{k}".encode()) == (200, b"OK")
            acked += 1
        # f holds none of them synced: never counted as holding them, so it left the
        # in-sync set (the publishes waited for that), while the other follower has all
        r = c.replication(lead, TOPIC)
        assert r is not None and f not in r["isr"] and other in r["isr"], r
        assert r["lag"][str(f)]["messages"] >= 5, r
        assert (c.replication(other, TOPIC) or {}).get("log_end") == acked
        with pytest.raises(urllib.error.HTTPError) as ping:
            urllib.request.urlopen(f"{c.nodes[f].http_url}/ping", timeout=5)
        assert ping.value.code == 500 and ping.value.read().startswith(b"NOK")
        wait_until(lambda: "not synced" in c.nodes[f].stderr_text(), 10,
                   what="the follower's line about the records not synced")
        said = c.nodes[f].stderr_text()
        assert "not synced" in said and (
            "cutting the unsynced records" in said) == cut_fails, said[-3000:]
        if not cut_fails:
            # each cut is followed by a back-off that doubles from 100 ms (before:
            # fetched, appended, cut and logged again at once, hundreds of times a
            # second): about log2(seconds / 0.1) + 2 tries
            tries = said.count("cut, to be fetched again")
            seconds = time.monotonic() - failing_from
            assert 1 <= tries <= 3 + math.log2(max(seconds, 0.1) / 0.1), (tries, seconds)
        flags[f].unlink()
        wait_until(lambda: c.settled(TOPIC, 3) == lead, 20, 0.05,
                   what="the follower to catch up and rejoin once its fsyncs work")
        wait_until(lambda: all((c.replication(i, TOPIC) or {}).get("log_end") == acked
                               for i in c.nodes), 10, 0.05,
                   what="every node to hold every acknowledged message")
    finally:
        problems = c.close()
    assert not problems, "\n".join(problems)


def test_a_follower_with_a_full_disk_backs_off_and_rejoins(tmp_path: Path) -> None:
    """A follower whose appends fail (ENOSPC from the fault plan, while its flag exists)
    asks for that topic again only after a back-off that doubles (replica.RETRY_NS up to
    RETRY_MAX_NS): it neither spins nor floods its log (before: about 6,000 error
    lines a second). Its leader drops it from the in-sync set and acknowledges with the
    other follower; once the disk has room it catches up and rejoins."""
    c, flags = _faulty_cluster(tmp_path, "op=pwrite kind=ENOSPC")
    try:
        lead = _create(c)
        f, other = [i for i in c.nodes if i != lead]
        flags[f].touch()
        before = c.nodes[f].stderr_text().count("not appended")
        t0 = time.monotonic()
        for k in range(5):
            assert c.http_pub(lead, TOPIC, f"m{k}".encode()) == (200, b"OK")
        wait_until(lambda: time.monotonic() - t0 >= 4, 6, 0.1, what="four seconds")
        failures = c.nodes[f].stderr_text().count("not appended") - before
        # 100 ms doubling: at most about 7 tries in 4-6 s
        assert 1 <= failures <= 8, failures
        r = c.replication(lead, TOPIC)
        assert r is not None and f not in r["isr"] and other in r["isr"], r
        flags[f].unlink()
        wait_until(lambda: c.settled(TOPIC, 3) == lead, 20, 0.05,
                   what="the follower to catch up and rejoin once its disk has room")
        wait_until(lambda: all((c.replication(i, TOPIC) or {}).get("log_end") == 6
                               for i in c.nodes), 10, 0.05,
                   what="every node to hold every acknowledged message")
    finally:
        problems = c.close()
    assert not problems, "\n".join(problems)


def test_a_follower_behind_the_leaders_oldest_record_begins_again_there(
        make_cluster: Callable[..., Cluster]) -> None:
    """A follower killed while the leader's channels consumed (and its retention
    dropped) records the follower never had: on its return the leader answers
    ``out_of_range`` with its oldest offset, and the follower drops its log and
    follows from there (before, it asked again at once, forever, at half a core, and
    never rejoined the in-sync set)."""
    c = make_cluster("--max-bytes-per-file=4096", "--sync-timeout=200ms")
    lead = _create(c)
    f = next(i for i in c.nodes if i != lead)
    c.nodes[f].kill9()
    _publish_and_consume(c, lead)

    wait_until(lambda: _oldest(c, lead) > 200, 20, 0.1, what="the leader to drop segments")
    c.nodes[f].start()
    wait_until(lambda: c.settled(TOPIC, 3) == lead, 20, 0.05,
               what="the returning follower to rejoin the in-sync set")
    assert (c.replication(f, TOPIC) or {}).get("log_end") == 301
    assert _oldest(c, f) >= _oldest(c, lead) - 50      # it holds from about the leader's oldest on
    # (its log lines are written by a thread of their own: soon, not at once)
    wait_until(lambda: "below the leader's oldest record" in c.nodes[f].stderr_text(), 10,
               what="the follower's line about beginning at the leader's oldest record")
    # its copy ends where the leader's does
    status, doc = http_json("GET", f"{c.nodes[f].http_url}/topic/offsets?topic={TOPIC}")
    assert status == 200 and int(doc["end_offset"]) == 301, doc


@pytest.mark.parametrize("fault, cap", [("write_enospc", 0), ("fsync_eio", 0),
                                        ("write_enospc", 2)])
def test_a_leader_whose_disk_fails_hands_its_leadership_over(tmp_path: Path,
                                                             fault: str, cap: int) -> None:
    """The leader's log stops taking writes (ENOSPC on pwrite, memory mode) or fsyncs
    (EIO, fsync mode) from the fault plan, under 8 publishers and 4 consumers. Before,
    it kept leading and failed every publish while two in-sync followers stood by. Now
    it stops acknowledging, gives its leadership key up and leaves the in-sync set in
    one etcd transaction (``Replica.storage_failed``, ``Coordinator._resign``); an
    in-sync follower is elected, publishes (also those sent to the old leader, which
    forwards them) are acknowledged again, and no acknowledged message is lost. Once
    its disk works the old leader catches up and rejoins the in-sync set. With the set
    capped at two (``cap``) the heir is its one other member, and the replica outside
    the set joins it; the old leader, back, catches up outside the full set."""
    extra = [f"--max-insync-replicas={cap}"]
    if fault == "write_enospc":
        c, flags = _faulty_cluster(tmp_path, "op=pwrite kind=ENOSPC", extra=extra)
    else:
        c, flags = _faulty_cluster(tmp_path, "op=fsync kind=EIO",
                                   extra=["--durability=fsync", *extra])
    members = cap or 3
    try:
        old = _create(c, members=members)
        cons, pubs = _traffic(c, "before the disk fails")
        try:
            failed_at = time.monotonic()
            flags[old].touch()
            new = wait_until(lambda: c.leader(TOPIC, exclude=(old,)), 15, 0.05,
                             what="a new leader")
            assert isinstance(new, int)
            handed_in = time.monotonic() - failed_at
            acked_then = pubs.count()
            wait_until(lambda: pubs.count() >= acked_then + 100, 30,
                       what="publishes acknowledged after the handover")
            # the old leader follows (its appends fail: it is out of the in-sync set)
            r = c.replication(new, TOPIC)
            assert r is not None and old not in r["isr"] and len(r["isr"]) == 2, r
            assert (c.replication(old, TOPIC) or {}).get("role") in ("follower", "none")
            wait_until(lambda: "handing the leadership" in c.nodes[old].stderr_text(), 10,
                       what="the old leader's line about handing the leadership over")
            assert c.summary(old)["leaderships_handed_over"] == 1
            assert c.summary(new)["leaderships_handed_over"] == 0
            with urllib.request.urlopen(f"{c.nodes[old].http_url}/metrics", timeout=5) as m:
                assert b"\nnsq_cluster_leaderships_handed_over_total 1\n" in m.read()
            # a publish sent to the old leader is forwarded and acknowledged
            assert c.http_pub(old, TOPIC, b"via-the-old-leader") == (200, b"OK")
        finally:
            acked = pubs.stop() | {b"via-the-old-leader"}
        _every_acknowledged_delivered(cons, acked)
        assert pubs.failed >= 1     # the write that failed failed its publishes
        print(f"{fault}: handed over in {handed_in:.2f}s, {len(acked)} acknowledged, "
              f"{pubs.failed} refused")
        flags[old].unlink()
        wait_until(lambda: c.settled(TOPIC, members) == new, 30, 0.05,
                   what="the old leader to catch up and rejoin once its disk works")
        wait_until(lambda: len({(c.replication(i, TOPIC) or {}).get("log_end")
                                for i in c.nodes}) == 1, 15, 0.05,
                   what="every node to hold the same log")
    finally:
        problems = c.close()
    assert not problems, "\n".join(problems)


def test_a_leader_alone_in_sync_keeps_the_topic_when_its_disk_fails(tmp_path: Path) -> None:
    """With ``min-insync-replicas`` 1 and both followers gone (the in-sync set is the
    leader alone), nobody holds every acknowledged record but the leader: its disk
    failing must not hand the topic to a follower that lacks them. It refuses the
    publishes its disk cannot take, keeps leading, and acknowledges again once the
    disk works."""
    c, flags = _faulty_cluster(tmp_path, "op=pwrite kind=ENOSPC", min_insync=1)
    try:
        lead = _create(c)
        epoch = c.replication(lead, TOPIC)["epoch"]   # type: ignore[index]
        for i in c.nodes:
            if i != lead:
                c.nodes[i].kill9()
        wait_until(lambda: (c.replication(lead, TOPIC) or {}).get("isr") == [lead], 20,
                   0.05, what="the leader alone in sync")
        flags[lead].touch()
        status, _ = c.http_pub(lead, TOPIC, b"not-stored")
        assert status == 500
        wait_until(lambda: "no other replica is in sync" in c.nodes[lead].stderr_text(),
                   10, 0.05, what="the leader to say why it keeps the topic")
        r = c.replication(lead, TOPIC)
        assert r is not None and r["role"] == "leader" and r["epoch"] == epoch, r
        assert c.summary(lead)["leaderships_handed_over"] == 0
        flags[lead].unlink()
        assert c.http_pub(lead, TOPIC, b"stored") == (200, b"OK")
    finally:
        problems = c.close()
    assert not problems, "\n".join(problems)


def test_an_etcd_outage_is_logged_in_a_few_lines_and_the_cluster_resumes(
        cluster: Cluster) -> None:
    """etcd crashes (SIGKILL) under traffic and comes back on its data: while it is
    away each node logs the outage once (not each failed call: the coordinator
    retries about seven times a second), /stats and /metrics count it, the leader
    stops acknowledging at its lease deadline, and once etcd is back every node says
    so, publishes are acknowledged again and no acknowledged message is lost."""
    c = cluster
    _create(c)
    cons, pubs = _traffic(c, "before etcd went away")
    try:
        before = {i: len(b.stderr_text().splitlines()) for i, b in c.nodes.items()}
        c.etcd.kill()
        # past the lease (3 s): the leader has stopped acknowledging by then
        wait_until(lambda: all(c.summary(i)["etcd_failing_s"] >= 4 for i in c.nodes),
                   20, 0.1, what="every node to count 4 s of etcd failing")
        stalled = pubs.count()
        for i, b in c.nodes.items():
            s = c.summary(i)
            assert s["etcd_errors"] >= 10 and not s["lease_valid"], (i, s)
            new = b.stderr_text().splitlines()[before[i]:]
            etcd_lines = [ln for ln in new if "CLUSTER: etcd" in ln]
            assert len(etcd_lines) == 1, (i, etcd_lines)
            assert "retrying; further failures are summarised every 30 s" in etcd_lines[0]
            with urllib.request.urlopen(f"{b.http_url}/metrics", timeout=5) as m:
                metrics = dict(ln.split(" ", 1) for ln in m.read().decode().splitlines()
                               if ln.startswith("nsq_cluster_etcd_"))
            assert int(metrics["nsq_cluster_etcd_errors_total"]) >= s["etcd_errors"]
            assert float(metrics["nsq_cluster_etcd_failing_seconds"]) >= 4
        c.etcd.restart()
        wait_until(lambda: pubs.count() >= stalled + 100, 30,
                   what="publishes acknowledged again once etcd is back")
        for i, b in c.nodes.items():
            wait_until(lambda i=i: c.summary(i)["etcd_failing_s"] == 0, 15, 0.1,
                       what=f"node {i} to see etcd working")
            assert any("CLUSTER: etcd: working again after" in ln
                       for ln in b.stderr_text().splitlines()[before[i]:]), i
    finally:
        acked = pubs.stop()
    _every_acknowledged_delivered(cons, acked)


def _etcd_isr(c: Cluster, topic: str) -> list[int]:
    """The in-sync set etcd holds for topic."""
    key = base64.b64encode(f"/pybroker/state/{topic}".encode()).decode()
    kvs = c.etcd.call("/kv/range", {"key": key}).get("kvs") or []
    return list(json.loads(base64.b64decode(kvs[0]["value"]))["isr"]) if kvs else []


def _leader_back_alone(c: Cluster, damage: Callable[[Any], None], says: str) -> None:
    """100 messages acknowledged; the followers paused; the leader killed, its disk
    damaged (``damage(node)``) and started again, the only candidate: it must leave the
    in-sync set (its log says ``says``), not be elected, and once the followers resume
    one of them leads with every message and the returned node catches up."""
    old = _create(c)
    for k in range(100):
        assert _pub_answer(c, old, f"kept-{k}".encode()) == (FRAME_RESPONSE, b"OK")
    others = [i for i in c.nodes if i != old]
    for i in others:
        c.nodes[i].proc.send_signal(signal.SIGSTOP)     # type: ignore[union-attr]
    try:
        b = c.nodes[old]
        b.kill9()
        damage(b)
        b.start()
        # it joins once its old lease has expired, reads etcd, and leaves the set
        wait_until(lambda: old not in _etcd_isr(c, TOPIC)
                   or (c.replication(old, TOPIC) or {}).get("role") == "leader", 30, 0.1,
                   what="the returned node to leave the in-sync set (or be elected)")
        r = c.replication(old, TOPIC)
        assert r is None or r["role"] != "leader", r
        assert sorted(_etcd_isr(c, TOPIC)) == others
        wait_until(lambda: says in b.stderr_text(), 10, what=f"the line {says!r}")
    finally:
        for i in others:
            c.nodes[i].proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
    first = wait_until(lambda: c.leader(TOPIC), 30, 0.02,
                       what="a leader once the followers resume")
    assert first in others, first       # not the returned node, behind them
    # once back in sync (every message) the returned node may lead later: a leader
    # whose lease lapses under load is replaced by any member (seen once in CI)
    wait_until(lambda: c.settled(TOPIC, 3), 30, 0.1,
               what="the returned node back in sync")
    for i in c.nodes:
        r = c.replication(i, TOPIC)
        assert r is not None and r["log_end"] == 101, (i, r)


def test_a_leader_back_at_once_with_an_empty_disk_is_not_elected(cluster: Cluster) -> None:
    """The leader's machine dies and comes back at once with an empty data path (a
    replaced disk, a container's fresh volume) while etcd still counts it in sync.
    Elected, it would lead with an empty log and its followers would cut theirs to
    match: every acknowledged message gone (1 run in 6 before the fix, when it won the
    race against the followers). Here the followers are paused so that it is the only
    candidate: it must leave the in-sync set instead of campaigning, and once the
    followers resume one of them leads, with every acknowledged message, and the
    returned node catches up."""
    def empty(b: Any) -> None:
        data = Path(b.data_path)
        shutil.rmtree(data)
        data.mkdir()
    _leader_back_alone(cluster, empty, "left the in-sync set")


def test_a_leader_whose_machine_restarted_is_not_elected_with_what_it_lost(
        cluster: Cluster) -> None:
    """Memory mode: the leader's machine loses power and is back at once. A killed
    process loses nothing the kernel took, but a power cut loses what the page cache
    held: its log's tail is gone while its files still name the topic, and etcd still
    counts it in sync. Elected, its followers would cut their logs to match its shorter
    one (acknowledged messages gone). Here its log is cut to half its bytes after the
    kill and it comes back under another boot id (pybroker.cluster.boot); the followers
    are paused so that it is the only candidate. It must leave the in-sync set, and
    once the followers resume one of them leads with every acknowledged message.
    Before the node kept its boot id, it was elected with the cut log."""
    def power_cut(b: Any) -> None:
        segs = sorted((Path(b.data_path) / "topics").rglob("*.log"))
        assert segs, list(Path(b.data_path).rglob("*"))
        with open(segs[-1], "r+b") as f:     # what the page cache held: gone
            f.truncate(os.path.getsize(segs[-1]) // 2)
        b.env = {**(b.env or {}), "PYBROKER_BOOT_ID": "after-a-power-cut"}
    _leader_back_alone(cluster, power_cut, "machine restarted since its last run")


def test_a_clean_stop_marks_the_boot_file_and_is_trusted_after_a_reboot(
        cluster: Cluster) -> None:
    """A node stopped cleanly (SIGTERM) syncs its logs and marks its boot file clean:
    back on another boot (a planned reboot) it trusts its copies and says nothing of a
    restarted machine; its own run's file is not clean until it stops so again."""
    c = cluster
    lead = _create(c)
    for k in range(20):
        assert _pub_answer(c, lead, f"m-{k}".encode()) == (FRAME_RESPONSE, b"OK")
    f = next(i for i in c.nodes if i != lead)
    b = c.nodes[f]
    boot_file = Path(b.data_path) / "cluster" / "boot"
    assert not boot_file.read_text().strip().endswith(" clean")
    assert b.stop() == 0
    assert boot_file.read_text().strip().endswith(" clean")
    b.env = {**(b.env or {}), "PYBROKER_BOOT_ID": "after-a-planned-reboot"}
    b.start()
    wait_until(lambda: c.settled(TOPIC, 3), 30, 0.1, what="the node back in sync")
    assert "machine restarted" not in b.stderr_text()
    assert boot_file.read_text() == "after-a-planned-reboot\n"
    assert (c.replication(f, TOPIC) or {}).get("log_end") == 21


def test_three_hundred_topics_made_at_once_keep_every_lease(cluster: Cluster) -> None:
    """300 topics made at once on three nodes: each node's coordinator registers,
    creates, campaigns for and writes files of about 300 replicas in one pass over
    etcd. Before the lease had a thread of its own (pybroker.cluster.lease) its
    renewal waited behind that pass, the leases expired, every leadership was lost at
    once and the leaders' in-sync changes then failed over and over (thousands of log
    lines). Here no node loses its lease, every topic gets one leader, and nothing
    churns."""
    c = cluster
    n = 300
    for k in range(n):
        req = urllib.request.Request(f"{c.nodes[1 + k % 3].http_url}/topic/create"
                                     f"?topic=many{k}", b"")
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200

    def settled() -> bool:
        for k in range(n):
            r = c.replication(1, f"many{k}")
            if r is None or r["leader"] < 0 or len(r["isr"]) != 3:
                return False
        return True

    wait_until(settled, 60, 0.5, what="every topic led, with three in sync")
    for i, b in c.nodes.items():
        text = b.stderr_text()
        assert "the lease expired" not in text, (i, text[-3000:])
        assert c.summary(i)["lease_valid"]
        assert text.count("elected leader at epoch") <= n
        # a follower still making its copies when its leader checks may be dropped and
        # added back once: never the churn of failing changes
        assert text.count("in-sync replicas [") <= n, i


def test_an_idle_channels_state_is_shipped_again_only_every_two_seconds(
        cluster: Cluster) -> None:
    """A leader snapshots its channels every 200 ms; an unchanged state used to be
    shipped each time (a JSON answer to every follower five times a second, however
    large: a channel holding 100,000 deferred messages makes it megabytes). Now it is
    shipped when it changed, and again every 2 s (RESHIP_NS)."""
    c = cluster
    lead = _create(c)
    cons = Consumers(c, TOPIC, "ch", 1)
    try:
        wait_until(lambda: b"first" in cons.received(), 15, what="the first message")
        _states_shipped(c, lead, [i for i in c.nodes if i != lead])
        seen = set()
        end = time.monotonic() + 1.5
        while time.monotonic() < end:         # seven snapshots of an idle channel
            seen.add(c.replication(lead, TOPIC)["channel_states"])  # type: ignore[index]
            time.sleep(0.05)
        assert len(seen) <= 2, seen           # at most one reship fell in the window
        v = max(seen)
        wait_until(lambda: c.replication(lead, TOPIC)["channel_states"] > v,  # type: ignore[index]
                   5, 0.05, what="the reship after 2 s")
        assert _pub_answer(c, lead, b"second") == (FRAME_RESPONSE, b"OK")
        wait_until(lambda: b"second" in cons.received(), 15, what="the second message")
        _states_shipped(c, lead, [i for i in c.nodes if i != lead])   # a change: at once
    finally:
        cons.stop()


def test_a_channel_holding_150000_deferred_messages_is_replicated_off_the_loops(
        make_cluster: Callable[..., Cluster]) -> None:
    """A channel's state ships to the followers (for a failover) with every deferred
    message in it. It used to be built whole and encoded as JSON in the head of an
    answer on the leader's loop, for each follower, and parsed on theirs: with 100,000
    deferred messages a publisher on the leader waited up to 109 ms each time it
    shipped, and with 150,000 the head passed MAX_HEAD (4 MB): every answer failed
    ("frame too large"), the followers fell out of the in-sync set and publishes were
    refused. Now the leader's loop copies references, the storage thread encodes, the
    states travel in the blob, and followers keep them unparsed until they take over.
    The bound is wide of the 15-19 ms measured alone (under a loaded CI run, beside
    other tests, 38 ms was seen with 60,000). The takeover then restores every deferred
    message, in steps (it held the new leader's loop 139 ms with 100,000 in one turn:
    pybroker.cluster.takeover); a SUB meanwhile waits until the channel is in place."""
    c = make_cluster("--max-req-timeout=2h")
    lead = _create(c)
    n = 150_000
    L = c.nodes[lead]
    with WireClient.connect(L.tcp_address) as w:   # type: ignore[arg-type]
        for _ in range(0, n, 1000):
            w.mpub(TOPIC, [b"x" * 20] * 1000)
        w.sub(TOPIC, "ch")
        w.rdy(2500)
        for _ in range(n + 1):
            w.req(w.read_message(10).id, 3_600_000)
        wait_until(lambda: (channel_stats(L, TOPIC, "ch") or {}).get("deferred_count")
                   == n + 1, 30, 0.2, what="every message deferred")
        assert c.http_pub(lead, "other", b"warm") == (200, b"OK")
        rtts: list[float] = []
        with WireClient.connect(L.tcp_address) as p:   # type: ignore[arg-type]
            end = time.monotonic() + 5.0      # two reships (every 2 s) fall in it
            while time.monotonic() < end:
                t0 = time.perf_counter()
                p.pub("other", b"probe")
                rtts.append(time.perf_counter() - t0)
    worst = sorted(rtts)[-2:]
    print(f"probe round trips on the leader: n={len(rtts)}, the two longest "
          f"{worst[0] * 1e3:.1f} and {worst[1] * 1e3:.1f} ms")
    # the second longest: a loop held at each reship holds it twice here, while one
    # stall of the whole process on a loaded CI machine (283 ms once, beside five
    # other test workers on 2 cores) does not repeat
    assert worst[0] < 0.25, f"two probe round trips took {worst[0] * 1e3:.0f} ms or more"
    followers = [i for i in c.nodes if i != lead]
    _states_shipped(c, lead, followers)
    # a few more deferred, one every 100 ms: each version ships a follower the chunks
    # that changed (pybroker.cluster.states), not the 5 MB state
    def shipping() -> tuple[int, int]:
        rep = c.replication(lead, TOPIC) or {}
        return int(rep.get("channel_states", 0)), int(rep.get("states_shipped_bytes", 0))
    v0, b0 = shipping()
    more = 20
    with WireClient.connect(L.tcp_address) as w:   # type: ignore[arg-type]
        w.mpub(TOPIC, [b"y" * 20] * more)
        w.sub(TOPIC, "ch")
        w.rdy(1)
        for _ in range(more):
            w.req(w.read_message(10).id, 3_600_000)
            time.sleep(0.1)
        wait_until(lambda: (channel_stats(L, TOPIC, "ch") or {}).get("deferred_count")
                   == n + 1 + more, 30, 0.2, what="the new ones deferred")
    _states_shipped(c, lead, followers)
    v1, b1 = shipping()
    print(f"{v1 - v0} versions shipped in {b1 - b0:,} bytes")
    assert v1 - v0 >= 5 and b1 - b0 < 2_000_000, (v1 - v0, b1 - b0)   # whole: 50 MB
    c.nodes[lead].kill9()
    new = wait_until(lambda: c.leader(TOPIC, exclude=(lead,)), 15, 0.02, what="a new leader")
    N = c.nodes[int(new)]    # type: ignore[call-overload]
    refused: list[bytes] = []

    def held_at_sub() -> tuple[int] | None:
        """What the channel holds when the new leader accepts a SUB (None: refused)."""
        with WireClient.connect(N.tcp_address) as s:   # type: ignore[arg-type]
            s.send(sub(TOPIC, "ch"))
            ftype, data = s.read_frame(10)
            if ftype == FRAME_ERROR:
                refused.append(data)
                return None
            assert (ftype, data) == (FRAME_RESPONSE, b"OK")
            return ((channel_stats(N, TOPIC, "ch") or {}).get("deferred_count", -1),)
    held = wait_until(held_at_sub, 20, 0.02, what="a SUB taken by the new leader")
    print(f"SUBs refused before the election: {len(refused)}")
    assert held == (n + 1 + more,)
    assert all(b"election" in r or b"led by node" in r for r in refused), refused
    wait_until(lambda: any("taking its channels over in steps" in ln for ln in N.stderr_lines),
               10, what="the new leader's line about taking channels over in steps")


def test_messages_requeued_and_deferred_before_a_failover_are_delivered_after_it(
        cluster: Cluster) -> None:
    """States over 64 KB are taken over in steps (pybroker.cluster.takeover): 5,000 of
    6,000 messages delivered once and requeued (a tenth at once, the rest with a 2 s
    delay), ten finished, the rest never delivered. After the leader is killed, a
    consumer on the new leader gets every one not finished, the requeued ones as later
    attempts, and none that was finished."""
    c = cluster
    lead = _create(c)
    L = c.nodes[lead]
    bodies = {f"m{k:05d}".encode() for k in range(6000)}
    with WireClient.connect(L.tcp_address) as w:   # type: ignore[arg-type]
        w.mpub(TOPIC, sorted(bodies))
        w.sub(TOPIC, "ch")
        w.rdy(100)
        finished = {b"first"}
        requeued: set[bytes] = set()

        def requeue(m: WireMessage) -> None:
            again = m.body in requeued
            requeued.add(m.body)
            w.req(m.id, 0 if len(requeued) % 10 == 0 and not again else 2000)
        while len(requeued) < 5000:
            m = w.read_message(10)
            if len(finished) < 11 and m.body not in requeued:
                finished.add(m.body)
                w.fin(m.id)
            else:
                requeue(m)
        w.rdy(0)

        def drained() -> bool:
            """What was sent before RDY 0 is requeued too."""
            try:
                requeue(w.read_message(0.2))
            except TimeoutError:
                return (channel_stats(L, TOPIC, "ch") or {}).get("in_flight_count") == 0
            return False
        wait_until(drained, 20, 0, what="nothing in flight on the leader")
        _states_shipped(c, lead, [i for i in c.nodes if i != lead])
    c.nodes[lead].kill9()
    new = wait_until(lambda: c.leader(TOPIC, exclude=(lead,)), 15, 0.02, what="a new leader")
    N = c.nodes[int(new)]    # type: ignore[call-overload]
    lines = wait_until(lambda: [ln for ln in N.stderr_lines if "channels taken over" in ln]
                       and N.stderr_lines, 20, 0.05, what="the channels taken over")
    assert any("taking its channels over in steps" in ln for ln in lines), \
        "".join(ln for ln in lines if "CLUSTER" in ln and "fetching" not in ln)[-1500:]

    def subscribed() -> WireClient | None:
        w2 = WireClient.connect(N.tcp_address)   # type: ignore[arg-type]
        w2.send(sub(TOPIC, "ch"))
        if w2.read_frame(10) == (FRAME_RESPONSE, b"OK"):
            return w2
        w2.close()
        return None
    w2 = wait_until(subscribed, 20, 0.05, what="a SUB taken by the new leader")
    assert isinstance(w2, WireClient)
    with w2:
        w2.rdy(500)
        got: dict[bytes, int] = {}
        want = bodies - finished
        while len(got) < len(want):
            m = w2.read_message(15)
            got[m.body] = m.attempts
            w2.fin(m.id)
    assert set(got) == want
    assert all(got[b] >= 2 for b in requeued), sorted(b for b in requeued if got[b] < 2)[:5]


def test_a_transaction_says_the_revision_its_keys_were_written_at() -> None:
    """Etcd.txn_at (a real etcd): the revision a transaction returns is the
    mod_revision of every key it put, which the coordinator keeps instead of reading
    each key back; a compare that fails returns 0 and writes nothing."""
    from pybroker.cluster.etcd import Compare, Etcd, put_op
    from tests.support.etcd import EtcdProcess

    e = EtcdProcess().start()
    try:
        etcd = Etcd(e.url, timeout_s=5)
        rev = etcd.txn_at([Compare("/t/a", "CREATE", 0)],
                          [put_op("/t/a", "1"), put_op("/t/b", "2")])
        a, b = etcd.get("/t/a"), etcd.get("/t/b")
        assert a is not None and b is not None and rev > 0
        assert a.mod_revision == b.mod_revision == rev
        assert etcd.txn_at([Compare("/t/a", "CREATE", 0)], [put_op("/t/a", "3")]) == 0
        again = etcd.get("/t/a")
        assert again is not None and again.value == "1" and again.mod_revision == rev
        rev2 = etcd.txn_at([Compare("/t/a", "MOD", rev)], [put_op("/t/a", "4")])
        assert rev2 > rev and etcd.get("/t/a").mod_revision == rev2  # type: ignore[union-attr]
    finally:
        e.cleanup()
