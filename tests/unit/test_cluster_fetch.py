"""The follower's fetcher (pybroker.cluster.fetcher) on a real selector loop against a
leader on a real socket: records answered are applied and the next fetch carries the
new offset at once; an answer that trickles is cut at its deadline, one over the
frame limit is refused from its header, a malformed one drops the connection, and in
every case the fetcher connects again. And the leader's server (pybroker.cluster.serve)
against a follower that sends too much or nonsense."""
from __future__ import annotations

import json
import socket
import struct
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator

import pytest

from pybroker.cluster import fetcher as fetcher_mod
from pybroker.cluster.fetcher import Fetcher
from pybroker.cluster.replica import FOLLOWER, ShippedParts, ShippedStates
from pybroker.cluster.rules import EpochHistory
from pybroker.cluster.reads import LastReads, record_bytes
from pybroker.cluster.serve import ReplicationServer
from pybroker.cluster.serveconn import request_limit
from pybroker.cluster.wire import MAX_TOPICS, FrameReader, encode, encode_compact_answer, \
    encode_compact_fetch, is_json, parse_compact_fetch, parse_head
from pybroker.evloop import SelectorLoop
from pybroker.storage.topiclog import TopicLog
from pybroker.testing import wait_until

LEADER = 7


class _Log:
    def __init__(self) -> None:
        self.written = 0


class _Topic:
    def __init__(self) -> None:
        self.log = _Log()


class _Replica:
    """The replica side the fetcher drives (it records what it is given)."""

    def __init__(self, name: str = "t") -> None:
        self.name = name
        self.role = FOLLOWER
        self.leader = LEADER
        self.epoch = 1
        self.truncated_for = 1
        self.unsynced_from: int | None = None     # (set: the fetcher skips it)
        self.retry_ns = 0                         # (later than now: skipped too)
        self.chan_from_leader = 0
        self.hw = 0
        self.history = EpochHistory([(1, 0)])
        self.isr: list[int] = [LEADER, 3]        # etcd's in-sync set, as last read
        self.topic = _Topic()
        self.applied: list[tuple[int, bytes, int]] = []
        self.chans: list[object] = []

    def apply(self, first: int, data: bytes, hw: int, history: object, chans: object,
              version: int, done: Callable[[], None], paused: object = None) -> None:
        self.applied.append((first, data, hw))
        self.chans.append(chans)
        self.topic.log.written = first + len(data) // 10     # ten bytes a "record" here
        self.hw = hw
        done()

    def truncate(self, offset: int, done: Callable[[], None]) -> None:
        self.truncated_for = self.epoch
        done()


class _Node:
    id = 3
    max_insync = 0          # --max-insync-replicas (0: every caught-up replica)


class _Leader:
    """A leader on a socket: each connection's requests go to ``answer`` (which writes
    what it likes); requests are kept."""

    def __init__(self, answer: Callable[[socket.socket, dict[str, object], int], None]
                 ) -> None:
        self.answer = answer
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.lsock.getsockname()[1]}"
        self.requests: list[dict[str, object]] = []
        self.connections = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.lsock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                conn, _ = self.lsock.accept()
            except OSError:
                continue
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = FrameReader()
        conn.settimeout(0.1)
        with conn:
            while not self.stop.is_set():
                try:
                    data = conn.recv(65536)
                except socket.timeout:
                    continue
                except OSError:
                    return
                if not data:
                    return
                reader.feed(data)
                while (frame := reader.next_raw()) is not None:
                    head: dict[str, object]
                    if is_json(frame[0]):
                        head = dict(parse_head(frame[0]))
                    else:       # a compact fetch: its fields by name
                        node, wait_ms, max_bytes, offsets = parse_compact_fetch(frame[0])
                        head = {"op": "compact", "node": node, "offsets": offsets}
                    self.requests.append(head)
                    try:
                        self.answer(conn, head, len(self.requests))
                    except OSError:
                        return

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.lsock.close()


@pytest.fixture
def loop() -> Iterator[SelectorLoop]:
    lp = SelectorLoop("test-fetch")
    lp.start()
    yield lp
    lp.stop()
    assert lp.thread is not None
    lp.thread.join(5)
    lp.close()


def _fetching(loop: SelectorLoop, leader: _Leader, node: _Node | None = None,
              rep: _Replica | None = None) -> tuple[Fetcher, _Replica]:
    rep = rep or _Replica()
    f = Fetcher(node or _Node(), loop, LEADER)  # type: ignore[arg-type]
    loop.call_soon_threadsafe(f.assign, [rep], leader.address)  # type: ignore[arg-type]
    return f, rep


def _stop(loop: SelectorLoop, f: Fetcher) -> None:
    loop.call_soon_threadsafe(f.stop)


def _records(head: dict[str, object], n: int, compact: bool = False) -> list[bytes]:
    t = head["topics"][0]  # type: ignore[index]
    blob = b"r" * (10 * n)
    extra = {"compact": 1} if compact else {}
    return encode({"topics": [{"name": "t", "hw": t["offset"] + n, "first": t["offset"],
                               "blob": [0, len(blob)]}], **extra}, blob)


def test_records_are_applied_and_the_next_fetch_acknowledges_them(
        loop: SelectorLoop) -> None:
    def answer(conn: socket.socket, head: dict[str, object], i: int) -> None:
        if i <= 3:
            conn.sendall(b"".join(_records(head, 5)))
        # later fetches stay unanswered (a parked long poll)

    leader = _Leader(answer)
    f, rep = _fetching(loop, leader)
    try:
        wait_until(lambda: len(leader.requests) >= 4, 5, what="four fetches")
        offsets = [r["topics"][0]["offset"] for r in leader.requests[:4]]  # type: ignore[index]
        assert offsets == [0, 5, 10, 15]          # each names what the last one applied
        assert [a[0] for a in rep.applied] == [0, 5, 10] and rep.hw == 15
        assert all(r["op"] == "fetch" and r["node"] == 3 for r in leader.requests)
    finally:
        _stop(loop, f)
        leader.close()


@pytest.mark.parametrize("cap, isr, lazy", [
    (0, [LEADER, 5], False),          # no cap: every follower fetches at once
    (2, [LEADER, 3], False),          # a member of the capped set: at once
    (2, [LEADER], False),             # the set has room: at once (it must catch up)
    (2, [LEADER, 5], True),           # outside a full capped set: rests LAZY_NS
])
def test_a_follower_outside_a_full_capped_set_rests_between_fetches(
        loop: SelectorLoop, monkeypatch: pytest.MonkeyPatch, cap: int, isr: list[int],
        lazy: bool) -> None:
    """--max-insync-replicas: a follower no OK waits for (outside a full in-sync set)
    sends its next fetch LAZY_NS after an answer that found it near the leader's end;
    any other fetches again at once. The leader answers every fetch at once here; the
    rest is made 50 ms so that ten rounds tell the two apart on a busy machine too."""
    monkeypatch.setattr(fetcher_mod, "LAZY_NS", 50_000_000)
    rounds = 10

    def answer(conn: socket.socket, head: dict[str, object], i: int) -> None:
        if i <= rounds:
            conn.sendall(b"".join(_records(head, 1)))

    node = _Node()
    node.max_insync = cap
    rep = _Replica()
    rep.isr = isr
    leader = _Leader(answer)
    t0 = time.monotonic()
    f, _ = _fetching(loop, leader, node, rep)
    try:
        wait_until(lambda: len(leader.requests) > rounds, 10, what="the fetches")
        took = time.monotonic() - t0
        offsets = [r["topics"][0]["offset"] for r in leader.requests]  # type: ignore[index]
        assert offsets == list(range(rounds + 1))    # each acknowledges the last answer
        rests = rounds * 0.05
        assert (took >= rests) if lazy else (took < rests), took
    finally:
        _stop(loop, f)
        leader.close()


def test_channel_states_come_in_the_blob_and_are_kept_unparsed(
        loop: SelectorLoop) -> None:
    """A leader ships its channel states as one JSON object in the blob, after the
    records, with their floors in the head: the fetcher hands them on as they came."""
    states = b'{"ch": {"cursor": 3, "pending": [[1, 2, 0]]}}'

    def answer(conn: socket.socket, head: dict[str, object], i: int) -> None:
        if i == 1:
            recs = b"r" * 20
            conn.sendall(b"".join(encode({"topics": [{
                "name": "t", "hw": 2, "first": 0, "blob": [0, 20], "version": 7,
                "floors": [1], "states": [20, len(states)]}]}, recs, states)))

    leader = _Leader(answer)
    f, rep = _fetching(loop, leader)
    try:
        wait_until(lambda: rep.applied, 5, what="the answer applied")
        assert rep.applied == [(0, b"r" * 20, 2)]
        assert rep.chans == [ShippedStates(states, [1])]
    finally:
        _stop(loop, f)
        leader.close()


def test_channel_states_in_parts_reach_the_replica_checked(loop: SelectorLoop) -> None:
    """The fetcher asks for parts (``"parts": 1``), and a leader's parts
    (pybroker.cluster.states) reach the replica read from the frame."""
    ops = struct.pack(">2q", -1, 2)

    def answer(conn: socket.socket, head: dict[str, object], i: int) -> None:
        if i == 1:
            conn.sendall(b"".join(encode({"topics": [{
                "name": "t", "hw": 0, "version": 7,
                "parts": [["ch", 5, 0, 3, 2, 0, 16, 16, 2]]}]}, ops, b"{}")))

    leader = _Leader(answer)
    f, rep = _fetching(loop, leader)
    try:
        wait_until(lambda: rep.chans, 5, what="the parts applied")
        assert leader.requests[0]["parts"] == 1
        (got,) = rep.chans
        assert isinstance(got, ShippedParts)
        (part,) = got.parts
        assert (part.name, part.gen, part.base, part.floor, part.size) == ("ch", 5, 0, 3, 2)
        assert bytes(part.ops) == ops and bytes(part.data) == b"{}"
    finally:
        _stop(loop, f)
        leader.close()


def test_once_the_leader_takes_compact_fetches_the_steady_state_is_compact(
        loop: SelectorLoop) -> None:
    rep: _Replica

    def answer(conn: socket.socket, head: dict[str, object], i: int) -> None:
        if i == 1:       # the JSON fetch, answered JSON: the leader takes compact ones
            conn.sendall(b"".join(_records(head, 5, compact=True)))
        elif i <= 3:     # compact fetches, answered compact
            at = head["offsets"][0]  # type: ignore[index]
            if i == 3:
                rep.chan_from_leader = 4     # (as a channel document would) the plan changes
            conn.sendall(b"".join(encode_compact_answer([(at, at + 5, 50)], [b"r" * 50])))
        elif i == 4:
            conn.sendall(b"".join(_records(head, 5)))

    leader = _Leader(answer)
    f, rep = _fetching(loop, leader)
    try:
        wait_until(lambda: len(leader.requests) >= 5, 5, what="five fetches")
        got = leader.requests[:5]
        assert [r["op"] for r in got] == ["fetch", "compact", "compact", "fetch", "compact"]
        assert [r["offsets"] for r in got[1:3]] == [[5], [10]]
        assert all(r["node"] == 3 for r in got)
        # what changed goes out in JSON, then the steady state is compact again
        assert got[3]["topics"] == [{"name": "t", "epoch": 1, "offset": 15, "version": 4,
                                     "hist": [1, 1, 0]}]
        assert got[4]["offsets"] == [20]
        assert [a[0] for a in rep.applied] == [0, 5, 10, 15] and rep.hw == 20
    finally:
        _stop(loop, f)
        leader.close()


class _Looking(SelectorLoop):
    """A loop that notes each ``spin_for`` (with the offset the fetch just sent named)."""

    def __init__(self, rep: _Replica) -> None:
        super().__init__("test-fetch-looks", spin_ns=50_000)
        self.rep = rep
        self.looks: list[tuple[int, int]] = []

    def spin_for(self, ns: int) -> None:
        self.looks.append((self.rep.topic.log.written, ns))
        super().spin_for(ns)


def test_a_follower_looks_for_an_answer_only_while_records_come_soon(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After an answer that carried records within REPLY_SPIN_NS of its fetch (made
    200 ms here, for a busy machine), the next fetch says a reply is coming (the loop
    looks for it before sleeping); after one that came later, or carried nothing, it
    does not."""
    REPLY_SPIN_NS = 200_000_000
    monkeypatch.setattr(fetcher_mod, "REPLY_SPIN_NS", REPLY_SPIN_NS)

    def answer(conn: socket.socket, head: dict[str, object], i: int) -> None:
        if i == 1:       # JSON, prompt, 5 records: the leader takes compact fetches
            conn.sendall(b"".join(_records(head, 5, compact=True)))
            return
        at = head["offsets"][0]  # type: ignore[index]
        if i in (2, 3, 5):       # prompt, 5 records
            conn.sendall(b"".join(encode_compact_answer([(at, at + 5, 50)], [b"r" * 50])))
        elif i == 4:             # empty, prompt
            conn.sendall(b"".join(encode_compact_answer([(at, at, 0)], [])))
        elif i == 6:             # 5 records, but late
            time.sleep(3 * REPLY_SPIN_NS / 1e9)
            conn.sendall(b"".join(encode_compact_answer([(at, at + 5, 50)], [b"r" * 50])))

    rep = _Replica()
    lp = _Looking(rep)
    lp.start()
    leader = _Leader(answer)
    f, _ = _fetching(lp, leader, rep=rep)
    try:
        wait_until(lambda: len(leader.requests) >= 7, 10, what="seven fetches")
        assert [r["op"] for r in leader.requests[:7]] == ["fetch"] + ["compact"] * 6
        # fetches 2, 3 (answers 1, 2 prompt), 4 (answer 3), not 5 (answer 4 empty),
        # 6 (answer 5), not 7 (answer 6 late)
        assert lp.looks == [(5, REPLY_SPIN_NS), (10, REPLY_SPIN_NS),
                            (15, REPLY_SPIN_NS), (20, REPLY_SPIN_NS)]
    finally:
        _stop(lp, f)
        leader.close()
        lp.stop()
        assert lp.stopped.wait(5)
        lp.close()


def test_a_trickled_answer_is_cut_at_its_deadline(loop: SelectorLoop,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetcher_mod, "WAIT_MS", 100)
    monkeypatch.setattr(fetcher_mod, "IO_SLACK_NS", 300_000_000)
    monkeypatch.setattr(fetcher_mod, "RETRY_NS", 50_000_000)
    started: list[float] = []

    def answer(conn: socket.socket, head: dict[str, object], i: int) -> None:
        frame = b"".join(_records(head, 1))
        started.append(time.monotonic())
        for b in frame:                    # a byte every 50 ms: never done in time
            conn.sendall(bytes([b]))
            time.sleep(0.05)

    leader = _Leader(answer)
    f, rep = _fetching(loop, leader)
    try:
        wait_until(lambda: leader.connections >= 2, 5, what="a second connection")
        assert not rep.applied
        assert time.monotonic() - started[0] < 2.0    # cut at ~0.4 s, not at the trickle's end
    finally:
        _stop(loop, f)
        leader.close()


@pytest.mark.parametrize("reply", [
    struct.pack(">II", 1 << 31, 10),                        # over the frame limit
    struct.pack(">II", 12, 40),                             # head longer than the frame
    b"".join(encode({"topics": [{"name": "t", "hw": 1, "first": 0,
                                 "blob": [0, 999]}]}, b"x" * 10)),   # blob outside
    b"".join(encode({"topics": [{"name": "t", "hw": "many"}]})),     # not an integer
    b"".join(encode({"topics": "t"})),                               # not a list
    struct.pack(">II", 9, 5) + b"[1,2]",                             # head not an object
    b"".join(encode_compact_answer([(0, 1, 0), (0, 1, 0)], [])),      # 2 topics, 1 asked
    b"".join(encode_compact_answer([(0, 1, 10)], [b"x" * 11])),      # sizes that differ
    b"".join(encode_compact_fetch(2, 0, 10, [0])),                   # a request's kind
    b"".join(encode({"topics": [{"name": "t", "hw": 0, "version": 2, "floors": [0],
                                 "states": [0, 99]}]}, b"{}")),     # states outside
    b"".join(encode({"topics": [{"name": "t", "hw": 0, "version": 2, "floors": ["x"],
                                 "states": [0, 2]}]}, b"{}")),      # a floor not an int
    b"".join(encode({"topics": [{"name": "t", "hw": 0, "version": 2, "parts": [
        ["ch", 1, 0, 0, 2, 0, 16, 16, 99]]}]}, b"{}")),             # parts outside
    b"".join(encode({"topics": [{"name": "t", "hw": 0, "version": 2,
                                 "parts": {"ch": 1}}]})),          # parts not a list
])
def test_a_bad_answer_drops_the_connection_and_it_connects_again(
        loop: SelectorLoop, monkeypatch: pytest.MonkeyPatch, reply: bytes) -> None:
    monkeypatch.setattr(fetcher_mod, "RETRY_NS", 50_000_000)

    def answer(conn: socket.socket, head: dict[str, object], i: int) -> None:
        conn.sendall(reply)

    leader = _Leader(answer)
    f, rep = _fetching(loop, leader)
    try:
        wait_until(lambda: leader.connections >= 2, 5, what="a second connection")
        assert not rep.applied
    finally:
        _stop(loop, f)
        leader.close()


def test_a_round_names_at_most_max_topics_and_every_topic_in_turn(
        loop: SelectorLoop, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetcher_mod, "MAX_TOPICS", 2)

    def answer(conn: socket.socket, head: dict[str, object], i: int) -> None:
        names = [t["name"] for t in head["topics"]]  # type: ignore[attr-defined]
        conn.sendall(b"".join(encode({"topics": [{"name": n, "hw": 0} for n in names]})))

    leader = _Leader(answer)
    reps = [_Replica(n) for n in ("a", "b", "c")]
    f = Fetcher(_Node(), loop, LEADER)  # type: ignore[arg-type]
    loop.call_soon_threadsafe(f.assign, reps, leader.address)  # type: ignore[arg-type]
    try:
        wait_until(lambda: len(leader.requests) >= 6, 5, what="six fetches")
        asked = [[t["name"] for t in r["topics"]]  # type: ignore[attr-defined]
                 for r in leader.requests[:6]]
        assert all(len(a) == 2 for a in asked)
        assert {n for a in asked for n in a} == {"a", "b", "c"}
    finally:
        _stop(loop, f)
        leader.close()


def test_a_topic_whose_unsynced_records_could_not_be_cut_is_not_fetched(
        loop: SelectorLoop) -> None:
    """A follower whose fsync failed and whose cut after it failed too holds records it
    may not acknowledge (``Replica.unsynced_from``): no fetch names that topic (so no
    fetch acknowledges them) until they are cut; the others go on."""
    def answer(conn: socket.socket, head: dict[str, object], i: int) -> None:
        names = [t["name"] for t in head["topics"]]  # type: ignore[attr-defined]
        conn.sendall(b"".join(encode({"topics": [{"name": n, "hw": 0} for n in names]})))

    leader = _Leader(answer)
    a, b = _Replica("a"), _Replica("b")
    b.unsynced_from = 0
    f = Fetcher(_Node(), loop, LEADER)  # type: ignore[arg-type]
    loop.call_soon_threadsafe(f.assign, [a, b], leader.address)  # type: ignore[arg-type]
    try:
        wait_until(lambda: len(leader.requests) >= 3, 5, what="three fetches")
        assert all([t["name"] for t in r["topics"]] == ["a"]  # type: ignore[attr-defined]
                   for r in leader.requests[:3])
        n = len(leader.requests)
        b.unsynced_from = None            # (as a tick's cut does)
        wait_until(lambda: any(len(r["topics"]) == 2  # type: ignore[arg-type]
                               for r in leader.requests[n:]), 5,
                   what="a fetch naming both topics")
    finally:
        _stop(loop, f)
        leader.close()


# -- the leader's server against a hostile follower -----------------------------------
class _Runtime:
    def __init__(self, loop: SelectorLoop) -> None:
        self.loops = [loop]


_BODY = 1 << 20          # the fake node's max_body_size


class _ServerNode:
    """A node that leads nothing: a forwarded publish is answered "not the leader"."""

    def __init__(self, loop: SelectorLoop) -> None:
        self.id = 1
        self.runtime = _Runtime(loop)
        self.replicas: dict[str, object] = {}
        self.options = SimpleNamespace(max_body_size=_BODY, max_msg_size=1 << 16,
                                       max_req_timeout=3600 * 10**9)
        loop.options = self.options          # type: ignore[attr-defined]

        self.leads = False      # (a test may make it lead: its publishes then wait)

    def diverts(self, name: str) -> bool:
        return not self.leads


@pytest.fixture
def server(loop: SelectorLoop) -> Iterator[ReplicationServer]:
    srv = ReplicationServer(_ServerNode(loop), "127.0.0.1:0")  # type: ignore[arg-type]
    srv.start()
    yield srv
    srv.stop(5)


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def _connect(server: ReplicationServer) -> socket.socket:
    host, _, port = server.address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=5)


_FETCH_T = b"".join(encode({"op": "fetch", "node": 2, "wait_ms": 0, "max_bytes": 10,
                             "topics": [{"name": "t", "epoch": 1, "offset": 0}]}))


def _exchange(s: socket.socket, reader: FrameReader, request: bytes) -> dict[str, object]:
    """Send a request, return the head of the answer (JSON)."""
    s.sendall(request)
    while (frame := reader.next()) is None:
        chunk = s.recv(65536)
        assert chunk, "the server closed the connection"
        reader.feed(chunk)
    return dict(frame[0])


def test_the_server_answers_a_fetch_of_a_topic_it_does_not_lead(
        server: ReplicationServer) -> None:
    with _connect(server) as s:
        head = _exchange(s, FrameReader(), _FETCH_T)
        assert json.loads(json.dumps(head))["topics"] == [
            {"name": "t", "error": "not_leader"}]


@pytest.mark.parametrize("request_", [
    struct.pack(">II", request_limit(_BODY) + 1, 4),            # over the request limit
    # requests to publish without a kind, an id or a topic that can be read
    b"".join(encode({"op": "publish", "id": 1, "node": 2, "topic": "t", "kind": "sub"},
                    b"x")),
    b"".join(encode({"op": "publish", "id": "one", "node": 2, "topic": "t",
                     "kind": "pub"}, b"x")),
    b"".join(encode({"op": "publish", "id": 1, "node": 2, "topic": 7, "kind": "pub"},
                    b"x")),
    b"".join(encode({"op": "fetch", "node": "two", "topics": []})),   # not an integer
    b"".join(encode({"op": "fetch", "node": 2, "topics": {"t": 1}})),  # not a list
    b"".join(encode({"op": "nonsense", "node": 2})),
    b"".join(encode_compact_fetch(2, 0, 10, [0])),      # compact, with no fetch before it
    b"".join(encode_compact_answer([(0, 1, 0)], [])),   # an answer's kind
    b"".join(encode({"op": "fetch", "node": 2, "wait_ms": 0, "max_bytes": 10,     # too many
                     "topics": [{"name": f"t{k}", "epoch": 1, "offset": 0}
                                for k in range(MAX_TOPICS + 1)]})),
])
def test_the_server_drops_a_follower_that_sends_nonsense(server: ReplicationServer,
                                                          request_: bytes) -> None:
    with _connect(server) as s:
        s.sendall(request_)
        assert _closed(s)


def test_a_publish_forwarded_to_a_node_that_leads_nothing_is_refused_by_id(
        server: ReplicationServer) -> None:
    """Its answer names the request and says "not the leader" (so the forwarding node
    asks the next leader: ports.leadership_moved); the connection stays open."""
    with _connect(server) as s:
        reader = FrameReader()
        for rid in (7, 8):
            head = _exchange(s, reader, b"".join(encode(
                {"op": "publish", "id": rid, "node": 2, "topic": "t", "kind": "pub"},
                b"hello")))
            assert head == {"id": rid, "error": "E_PUB_FAILED PUB failed not the leader "
                                                "of t (node 1)"}, head
        head = _exchange(s, reader, b"".join(encode(
            {"op": "publish", "id": 9, "node": 2, "topic": "t", "kind": "mpub"},
            struct.pack(">iI", 1, 2) + b"hi")))
        assert head == {"id": 9, "error": "E_MPUB_FAILED MPUB failed not the leader of "
                                          "t (node 1)"}, head


@pytest.mark.parametrize("head,blob,error", [
    ({"topic": "t!", "kind": "pub"}, b"x",
     'E_BAD_TOPIC PUB topic name "t!" is not valid'),
    ({"topic": "t", "kind": "pub"}, b"", "E_BAD_MESSAGE PUB invalid message body size 0"),
    ({"topic": "t", "kind": "pub"}, b"x" * ((1 << 16) + 1),
     "E_BAD_MESSAGE PUB message too big 65537 > 65536"),
    ({"topic": "t", "kind": "pub", "defer_ns": 10**9}, b"x",
     "E_INVALID PUB timeout 1000 out of range 0-3600000"),
    ({"topic": "t", "kind": "dpub", "defer_ns": 3601 * 10**9}, b"x",
     "E_INVALID DPUB timeout 3601000 out of range 0-3600000"),
    ({"topic": "t", "kind": "mpub"}, struct.pack(">iI", 2, 1) + b"x",
     "E_BAD_BODY MPUB body size does not match its messages (its 9 bytes end inside "
     "message(1)'s size)"),
])
def test_a_forwarded_publish_nsq_would_refuse_gets_nsqs_error_by_id(
        server: ReplicationServer, head: dict[str, object], blob: bytes,
        error: str) -> None:
    """As the NSQ command would be refused (the sending node's limits may differ from
    this one's): the error answered by id, the connection open for the next request."""
    with _connect(server) as s:
        reader = FrameReader()
        got = _exchange(s, reader, b"".join(encode(
            {"op": "publish", "id": 4, "node": 2, **head}, blob)))    # type: ignore[dict-item]
        assert got == {"id": 4, "error": error}, got
        got = _exchange(s, reader, b"".join(encode(
            {"op": "publish", "id": 5, "node": 2, "topic": "t", "kind": "pub"}, b"ok")))
        assert got["id"] == 5, got


def test_forwarded_publishes_waiting_on_a_leader_are_bounded_in_bytes(
        server: ReplicationServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Publishes the leader took and has not answered yet (its publisher holds them:
    here one that never settles) count against FORWARDED_BYTES; one more than fits is
    answered at once with an error, by id, and the connection stays open."""
    from pybroker.cluster import serve as serve_mod

    monkeypatch.setattr(serve_mod, "FORWARDED_BYTES", 10)
    node = server.node
    node.leads = True                                        # type: ignore[attr-defined]
    taken: list[str] = []
    loop = node.runtime.loops[0]                             # type: ignore[attr-defined]
    loop.publisher = SimpleNamespace(submit=lambda name, payload, defer, done:
                                     taken.append(name))
    with _connect(server) as s:
        reader = FrameReader()
        for rid in (1, 2):
            s.sendall(b"".join(encode({"op": "publish", "id": rid, "node": 2, "topic": "t",
                                       "kind": "pub"}, b"four")))
        head = _exchange(s, reader, b"".join(encode(
            {"op": "publish", "id": 3, "node": 2, "topic": "t", "kind": "pub"}, b"four")))
        assert head == {"id": 3, "error": "E_PUB_FAILED PUB failed over 10 bytes of "
                        "forwarded publishes wait for their acknowledgement on this "
                        "leader"}, head
    assert taken == ["t", "t"]


def test_a_compact_fetch_must_match_the_last_fetch(server: ReplicationServer) -> None:
    with _connect(server) as s:
        reader = FrameReader()
        # this leader takes compact fetches
        assert _exchange(s, reader, _FETCH_T)["compact"] == 1
        # the same fetch again, compact: answered (in JSON: its topic has an error)
        head = _exchange(s, reader, b"".join(encode_compact_fetch(2, 0, 10, [0])))
        assert head["topics"] == [{"name": "t", "error": "not_leader"}]
        # offsets for two topics after a fetch of one: dropped
        s.sendall(b"".join(encode_compact_fetch(2, 0, 10, [0, 0])))
        assert _closed(s)


# -- the leader's read: every write since the follower's offset, within its budget ----
class _LeaderReplica:
    def __init__(self, log: object) -> None:
        self.name = "t"
        self.inc = 7
        self.epoch = 1
        self.topic = type("T", (), {"log": log})()


def _three_writes(tmp: str | None) -> TopicLog:
    """Three writes of four records: three blocks of the memory tail, or (a directory)
    segment files only."""
    log = TopicLog(tmp, max_bytes_per_file=1 << 20, mem_records=0 if tmp else 1000,
                   max_record_bytes=4096)
    for w in range(3):       # three writes (three blocks of the memory tail) of 4 records
        log.append([b"w%d-%d" % (w, i) * 10 for i in range(4)], time.time_ns())
        log.write_pending()
    return log


@pytest.mark.parametrize("on_disk", [False, True])
def test_a_read_carries_every_write_since_the_offset_asked(
        tmp_path: Path, on_disk: bool) -> None:
    log = _three_writes(str(tmp_path) if on_disk else None)
    r = _LeaderReplica(log)
    got = LastReads().read(r, 2, log.written, 1 << 20)      # type: ignore[arg-type]
    assert got is not None
    n, parts, size = got
    assert n == 10 and size == sum(len(p) for p in parts)
    raw = b"".join(bytes(p) for p in parts)
    check = TopicLog(None, max_bytes_per_file=1 << 20, mem_records=1000,
                     max_record_bytes=4096)
    check.head = check.written = 2
    assert len(check.append_raw(raw, 2)[0]) == 10    # whole, in sequence, checksums intact
    one_by_one, at = b"", 2
    while at < log.written:                     # the log's own reads, a write at a time
        b = log.read(at, 100, 1 << 20)
        one_by_one += bytes(record_bytes(b, b.n))
        at += b.n
    assert raw == one_by_one


def test_a_read_stops_at_its_budget_on_a_record_boundary() -> None:
    log = _three_writes(None)
    r = _LeaderReplica(log)
    reads = LastReads()
    whole = reads.read(r, 0, log.written, 1 << 20)             # type: ignore[arg-type]
    assert whole is not None and whole[0] == 12
    rec = whole[2] // 12                                    # records are the same size
    cut = reads.read(r, 0, log.written, 5 * rec + rec // 2)  # type: ignore[arg-type]
    assert cut is not None and (cut[0], cut[2]) == (5, 5 * rec)
    # a budget under one record still sends one (a follower is never stuck)
    one = reads.read(r, 7, log.written, 1)                  # type: ignore[arg-type]
    assert one is not None and (one[0], one[2]) == (1, rec)


# -- with several loops, a follower's connection is served by the loop owning its topics
class _OwnedReplica:
    def __init__(self, owner: SelectorLoop) -> None:
        self.role = "follower"          # this node does not lead it: answered not_leader
        self.topic = type("T", (), {"owner": owner})()


def _ask(s: socket.socket, name: str) -> dict[str, object]:
    return _exchange(s, FrameReader(), b"".join(encode(
        {"op": "fetch", "node": 2, "wait_ms": 0, "max_bytes": 10,
         "topics": [{"name": name, "epoch": 1, "offset": 0}]})))


def test_a_follower_connection_moves_to_the_loop_that_owns_its_topics(
        loop: SelectorLoop) -> None:
    other = SelectorLoop("test-fetch-2")
    other.start()
    node = _ServerNode(loop)
    node.runtime.loops = [loop, other]
    node.replicas["t"] = _OwnedReplica(other)
    srv = ReplicationServer(node, "127.0.0.1:0")  # type: ignore[arg-type]
    srv.start()
    try:
        with _connect(srv) as s:
            wait_until(lambda: len(srv.conns) == 1, 5)
            conn = next(iter(srv.conns))
            assert conn.loop is loop                   # the first loop took it
            for _ in range(3):                         # answered there, from the start
                assert _ask(s, "t")["topics"] == [{"name": "t", "error": "not_leader"}]
                assert conn.loop is other and not conn.closed
            assert srv.loops[id(other)] is other       # writes there answer its fetches
            assert conn.moves == 1
            # a topic this node does not have: no loop to go to, it stays
            assert _ask(s, "unknown")["topics"] == [{"name": "unknown",
                                                     "error": "not_leader"}]
            assert conn.loop is other
    finally:
        srv.stop(5)
        other.stop()
        assert other.thread is not None
        other.thread.join(5)
        other.close()
