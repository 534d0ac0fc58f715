"""The leader's steady state (pybroker.cluster.serve: ``_steady_fetch``,
``_steady_answer``, ``_park``): a one-topic compact fetch from a follower that holds the
newest epoch history and channel states is served in few steps, and must answer
exactly what the general path answers. On a real selector loop and a real socket,
against a leader replica whose log is a real TopicLog: the acknowledgement is posted
when the fetch is read, records written later answer the parked fetch compact (the
same bytes the general encoder makes), a fetch with nothing to send is answered at its
deadline and not before (one timer per connection, moved on when it fires early), and
a follower whose history differs is answered by the general path, in JSON."""
from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pybroker.cluster.replica import LEADER
from pybroker.cluster.rules import EpochHistory
from pybroker.cluster import serve as serve_mod
from pybroker.cluster.serve import ReplicationServer
from pybroker.cluster.wire import (FrameReader, encode, encode_compact_answer,
                                   encode_compact_fetch, encode_compact_one, is_json,
                                   parse_compact_answer, parse_head)
from pybroker.evloop import SelectorLoop
from pybroker.storage.topiclog import TopicLog
from pybroker.testing import wait_until

FOLLOWER_NODE = 2


@settings(max_examples=200, deadline=None)
@given(first=st.integers(0, 2**64 - 1), hw=st.integers(0, 2**64 - 1),
       blobs=st.lists(st.binary(min_size=1, max_size=64), max_size=5))
def test_a_one_topic_answer_is_the_general_encoders_bytes(first: int, hw: int,
                                                          blobs: list[bytes]) -> None:
    size = sum(map(len, blobs))
    one = b"".join(bytes(b) for b in encode_compact_one(first, hw, size, blobs))
    assert one == b"".join(bytes(b) for b in encode_compact_answer([(first, hw, size)],
                                                                   blobs))


class _Replica:
    """What the server reads of a topic this node leads."""

    def __init__(self, loop: SelectorLoop) -> None:
        self.name = "t"
        self.inc = 1
        self.epoch = 3
        self.role = LEADER
        self.history = EpochHistory([(1, 0), (3, 0)])
        self.chan_version = 0
        self.hw = 0
        self.log = TopicLog(None, max_bytes_per_file=1 << 20, mem_records=1000,
                            max_record_bytes=4096)
        self.topic = type("T", (), {"log": self.log, "owner": loop})()
        self.posts: list[tuple[str, int]] = []      # what the server posted, in order
        self.isr = [1, FOLLOWER_NODE]               # the in-sync set

    def write(self, bodies: list[bytes]) -> None:
        self.log.append(bodies, time.time_ns())
        self.log.write_pending()
        self.hw = self.log.written - 1

    def acked(self, node: int, offset: int) -> None:
        self.posts.append(("acked", offset))

    def sent(self, node: int, end: int) -> None:
        self.posts.append(("sent", end))

    def fetched(self, node: int, offset: int, end: int) -> None:
        self.posts += [("acked", offset), ("sent", end)]

    def follower_gone(self, node: int) -> None:
        pass


class _Node:
    def __init__(self, loop: SelectorLoop, r: _Replica) -> None:
        self.runtime = type("R", (), {"loops": [loop]})()
        self.replicas = {"t": r}
        self.options = type("O", (), {"max_body_size": 5 << 20})()   # (the default)


class _Looking(SelectorLoop):
    """Notes each ``spin_for`` the server asks of it."""

    def __init__(self) -> None:
        super().__init__("test-steady", spin_ns=50_000)
        self.looks: list[int] = []

    def spin_for(self, ns: int) -> None:
        self.looks.append(ns)
        super().spin_for(ns)


@pytest.fixture
def setting() -> Iterator[tuple[_Looking, _Replica, ReplicationServer]]:
    loop = _Looking()
    loop.start()
    r = _Replica(loop)
    srv = ReplicationServer(_Node(loop, r), "127.0.0.1:0")  # type: ignore[arg-type]
    srv.start()
    yield loop, r, srv
    srv.stop(5)
    loop.stop()
    assert loop.thread is not None
    loop.thread.join(5)
    loop.close()


def _on_loop(loop: SelectorLoop, fn: Callable[[], None]) -> None:
    done: list[bool] = []

    def run() -> None:
        fn()
        done.append(True)
    loop.call_soon_threadsafe(run)
    wait_until(lambda: bool(done), 5)


def _posted(r: _Replica, end: int) -> None:
    """The posts of a fetch answered with everything below ``end`` are in (they follow
    its answer on the loop's thread)."""
    wait_until(lambda: ("sent", end) in r.posts, 5)


class _Follower:
    def __init__(self, srv: ReplicationServer) -> None:
        host, _, port = srv.address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=5)
        self.reader = FrameReader()

    def answer(self, timeout: float = 5.0) -> tuple[bytes, memoryview]:
        self.sock.settimeout(timeout)
        while (frame := self.reader.next_raw()) is None:
            chunk = self.sock.recv(65536)
            assert chunk, "the leader closed the connection"
            self.reader.feed(chunk)
        return frame

    def fetch(self, offset: int, wait_ms: int, hist: list[int]) -> dict[str, Any]:
        """The JSON fetch the steady state repeats compact."""
        self.sock.sendall(b"".join(encode({
            "op": "fetch", "node": FOLLOWER_NODE, "wait_ms": wait_ms, "max_bytes": 1 << 20,
            "parts": 1, "topics": [{"name": "t", "epoch": 3, "offset": offset,
                                    "version": 0, "hist": list[Any](hist)}]})))
        head, _ = self.answer()
        assert is_json(head)
        return dict(parse_head(head))

    def compact(self, offset: int, wait_ms: int) -> None:
        self.sock.sendall(b"".join(encode_compact_fetch(FOLLOWER_NODE, wait_ms, 1 << 20,
                                                        [offset])))


def test_a_parked_compact_fetch_is_answered_compact_by_the_next_write(
        setting: tuple[SelectorLoop, _Replica, ReplicationServer]) -> None:
    loop, r, srv = setting
    _on_loop(loop, lambda: r.write([b"a" * 20, b"b" * 20]))
    f = _Follower(srv)
    head = f.fetch(0, 0, r.history.mark())
    assert head["compact"] == 1
    _posted(r, 2)
    for round_ in range(3):
        end = r.log.written
        r.posts.clear()
        f.compact(end, 5000)                  # holds everything: parked
        wait_until(lambda end=end: ("acked", end) in r.posts, 5)  # type: ignore[misc]
        bodies = [b"r%d-%d" % (round_, i) * 8 for i in range(round_ + 1)]

        def write_and_tell(bodies: list[bytes] = bodies) -> None:
            r.write(bodies)
            srv.notify("t")
        _on_loop(loop, write_and_tell)
        raw, blob = f.answer()
        assert not is_json(raw)
        [(first, hw, size)] = parse_compact_answer(raw, len(blob))
        assert (first, hw, size) == (end, r.hw, len(blob))
        check = TopicLog(None, max_bytes_per_file=1 << 20, mem_records=1000,
                         max_record_bytes=4096)
        check.head = check.written = end
        assert len(check.append_raw(bytes(blob), end)[0]) == len(bodies)
        # (posted just after the answer went out)
        want = [("acked", end), ("sent", end + len(bodies))]
        wait_until(lambda want=want: r.posts == want, 5)  # type: ignore[misc]


def test_records_already_there_answer_a_compact_fetch_in_its_turn(
        setting: tuple[SelectorLoop, _Replica, ReplicationServer]) -> None:
    loop, r, srv = setting
    _on_loop(loop, lambda: r.write([b"x" * 30] * 3))
    f = _Follower(srv)
    f.fetch(0, 0, r.history.mark())
    _posted(r, 3)
    _on_loop(loop, lambda: r.write([b"y" * 30] * 2))
    r.posts.clear()
    f.compact(3, 5000)               # records from 3 are there: answered at once
    raw, blob = f.answer(timeout=2)
    [(first, _, size)] = parse_compact_answer(raw, len(blob))
    assert (first, size) == (3, len(blob)) and size > 0
    wait_until(lambda: r.posts == [("acked", 3), ("sent", 5)], 5)


def test_a_parked_fetch_with_nothing_to_send_is_answered_at_its_deadline(
        setting: tuple[SelectorLoop, _Replica, ReplicationServer]) -> None:
    loop, r, srv = setting
    _on_loop(loop, lambda: r.write([b"z" * 10]))
    f = _Follower(srv)
    f.fetch(0, 0, r.history.mark())
    # a first park, answered by a write 50 ms in: its timer stays (due at 400 ms)
    f.compact(1, 400)
    wait_until(lambda: ("acked", 1) in r.posts, 5)
    time.sleep(0.05)       # (the time the first fetch stays parked: part of the test)

    def write_and_tell() -> None:
        r.write([b"w" * 10])
        srv.notify("t")
    _on_loop(loop, write_and_tell)
    raw, blob = f.answer()
    assert parse_compact_answer(raw, len(blob))[0][2] > 0
    # the next park, with nothing written: answered empty at its own deadline, not at
    # the first one's
    parked = time.monotonic()
    f.compact(2, 400)
    raw, blob = f.answer(timeout=5)
    waited = time.monotonic() - parked
    assert parse_compact_answer(raw, len(blob)) == [(2, r.hw, 0)]
    assert 0.39 <= waited < 3, waited


def test_a_follower_whose_history_differs_is_answered_by_the_general_path(
        setting: tuple[SelectorLoop, _Replica, ReplicationServer]) -> None:
    loop, r, srv = setting
    _on_loop(loop, lambda: r.write([b"h" * 10] * 2))
    f = _Follower(srv)
    f.fetch(0, 0, [1, 1, 0])              # it says it holds one entry of the two
    _on_loop(loop, lambda: r.write([b"i" * 10]))
    f.compact(2, 5000)                    # the same fetch, compact: answered in JSON
    raw, blob = f.answer(timeout=2)
    assert is_json(raw)
    head: Any = parse_head(raw)
    [t] = head["topics"]
    assert t["history"] == [[1, 0], [3, 0]] and t["first"] == 2
    assert t["blob"] == [0, len(blob)] and len(blob) > 0


@pytest.mark.parametrize("member, pause_s, looks", [
    (True, 0.0, 2),        # a member that fetches again at once: looked for
    (False, 0.0, 0),       # a follower outside the in-sync set: no OK waits for it
    (True, 0.8, 0),        # a member slower than the look: not looked for
])
def test_the_leader_looks_for_a_prompt_members_next_fetch(
        setting: tuple[_Looking, _Replica, ReplicationServer],
        monkeypatch: pytest.MonkeyPatch, member: bool, pause_s: float,
        looks: int) -> None:
    """After answering an in-sync member whose last fetch followed the records before
    within REPLY_SPIN_NS (made 250 ms here, for a busy machine), the leader's loop looks
    for its next fetch (its acknowledgement) before sleeping: from the second steady
    answer on, since the first follows a JSON one."""
    monkeypatch.setattr(serve_mod, "REPLY_SPIN_NS", 250_000_000)
    loop, r, srv = setting
    if not member:
        r.isr = [1]
    _on_loop(loop, lambda: r.write([b"a" * 20]))
    f = _Follower(srv)
    f.fetch(0, 0, r.history.mark())
    _posted(r, 1)
    for round_ in range(3):
        end = r.log.written
        f.compact(end, 5000)
        wait_until(lambda end=end: ("acked", end) in r.posts, 5)  # type: ignore[misc]

        def write_and_tell(round_: int = round_) -> None:
            r.write([b"r%d" % round_ * 8])
            srv.notify("t")
        _on_loop(loop, write_and_tell)
        f.answer()
        time.sleep(pause_s)
    _posted(r, 4)
    _on_loop(loop, lambda: None)    # (the look follows the post, in the same turn)
    assert loop.looks == [250_000_000] * looks
