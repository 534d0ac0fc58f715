"""The Publisher and its write epochs, in process (server/publish.py; docs/storage.md,
"When a write fails").

A real Runtime with two event loops and its storage manager, not started: the test
thread runs the loops' turns (``run_once``) and the storage thread's passes
(``run_pending``) by hand, in the order it wants, and fails writes and fsyncs through
the fault seam. Publishes come in through ``Publisher.submit`` (the way HTTP jobs and
dead letters come in) from the owner loop and from the other loop (handed over), each
recording its settlement and the loop it was settled on."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pybroker import evloop
from pybroker.errors import Exiting
from pybroker.server.loop import EventLoop
from pybroker.server.publish import SLICE, publish_now
from pybroker.storage import DiskFullError, StorageError
from pybroker.storage.fileops import Fault, FaultyFileOps
from tests.support.inproc import close_runtime, runtime, turn


class Harness:
    def __init__(self, tmp: Path, durability: str) -> None:
        self.rt = runtime(tmp, durability=durability, loop_threads="2",
                          mem_queue_size="100")
        self.ops = FaultyFileOps()
        self.rt.storage.fileops = self.ops
        self.a, self.b = self.rt.loops
        self.results: dict[str, tuple[str, str]] = {}   # publish -> (outcome, loop)
        self.current: EventLoop | None = None

    def name_owned_by(self, loop: EventLoop, prefix: str) -> str:
        for i in range(1000):
            name = f"{prefix}{i}"
            if self.rt.broker.topic_owner(name) is loop:
                return name
        raise AssertionError("no name hashes to that loop")

    def publish(self, frm: EventLoop, topic: str, key: str, n: int = 1) -> None:
        """Submit a publish of n messages from loop frm (as its thread would)."""
        def done(err: Exception | None) -> None:
            outcome = "ok" if err is None else type(err).__name__
            self.results[key] = (outcome, self.current.name if self.current else "?")
        payload = [f"{key}-{i}".encode() for i in range(n)]
        self.current = frm
        frm.publisher.submit(topic, payload, 0, done)

    def turn(self, *loops: EventLoop) -> None:
        for loop in loops or (self.a, self.b):
            self.current = loop
            turn(loop)
        self.current = None

    def settle(self, rounds: int = 4) -> None:
        """Turns of both loops and storage passes until the hand-offs are done."""
        for _ in range(rounds):
            self.turn()
            self.rt.storage.run_pending()

    def topic_bodies(self, name: str) -> list[bytes]:
        log = self.rt.broker.topics[name].log
        out = []
        off = log.oldest
        while off < log.written:
            batch = log.read(off, 100, 1 << 20)
            out += [batch.payload(i)[34:] for i in range(batch.n)]
            off = batch.first + batch.n
        return out

    def close(self) -> None:
        close_runtime(self.rt)


@pytest.fixture
def memory(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path, "memory")
    yield h
    h.close()


@pytest.fixture
def fsync(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path, "fsync")
    yield h
    h.close()


def test_a_failed_write_fails_exactly_the_publishes_it_carried(memory: Harness) -> None:
    h = memory
    t = h.name_owned_by(h.b, "t")
    u = h.name_owned_by(h.b, "u")
    h.rt.broker.get_topic(t)
    h.rt.broker.get_topic(u)
    h.ops.faults = [Fault("pwrite", "ENOSPC", path=f"/topics/{t}/")]
    # three publishers on t in one turn: from the owner, from the other loop (handed
    # over at the end of a's turn), and one on another topic of the same owner
    h.publish(h.a, t, "remote")
    h.turn(h.a)                       # hands "remote" to b
    h.publish(h.b, t, "local")
    h.publish(h.b, u, "other")
    assert h.results == {}
    h.turn(h.b)                       # takes "remote", writes t (fails) and u (works)
    assert h.results == {"local": ("DiskFullError", "loop-1"),
                         "other": ("ok", "loop-1")}
    h.turn(h.a)                       # the settlement reaches the loop it came from
    assert h.results["remote"] == ("DiskFullError", "loop-0")
    assert h.rt.health is not None and "ENOSPC" in h.rt.health
    # the next write of t carries the next publishes and works: nothing lost, nothing
    # of the failed ones written
    h.publish(h.a, t, "again")
    h.settle()
    assert h.results["again"] == ("ok", "loop-0")
    assert h.topic_bodies(t) == [b"again-0"]
    assert h.topic_bodies(u) == [b"other-0"]
    assert h.rt.health is None


def test_writes_work_again_only_after_a_write_of_real_records(
        memory: Harness, caplog: pytest.LogCaptureFixture) -> None:
    h = memory
    t = h.name_owned_by(h.a, "t")
    h.rt.broker.get_topic(t)
    h.ops.faults = [Fault("pwrite", "ENOSPC", count=0, path=f"/topics/{t}/")]
    caplog.set_level(logging.INFO, logger="pybroker")
    for i in range(5):
        h.publish(h.a, t, f"p{i}")
        h.settle(1)
    assert {r[0] for r in h.results.values()} == {"DiskFullError"}
    h.settle(3)                        # turns with nothing to write
    assert h.rt.health is not None
    assert "writes work again" not in caplog.text
    h.ops.faults = []
    h.publish(h.a, t, "ok")
    h.settle(1)
    assert h.results["ok"][0] == "ok" and h.rt.health is None
    assert caplog.text.count("writes work again") == 1


def test_a_write_that_did_not_carry_a_batch_never_answers_it_ok(memory: Harness) -> None:
    """The defect this design removes: a publish answered OK by a write that carried
    other records (or none). Here the topic is written outside its Publisher between
    the append and the end of the turn; the batch's epoch is not the one written."""
    h = memory
    t = h.name_owned_by(h.a, "t")
    topic = h.rt.broker.get_topic(t)
    h.publish(h.a, t, "mine")
    with topic.lock:
        topic.log.write_pending()        # someone else's write carries the records
    h.turn(h.a)
    assert h.results["mine"][0] == "StorageIOError"


def test_fsync_mode_answers_after_the_fsync_covering_the_epoch(fsync: Harness) -> None:
    h = fsync
    t = h.name_owned_by(h.b, "t")
    h.rt.broker.get_topic(t)
    h.publish(h.b, t, "first")
    h.publish(h.a, t, "handed")
    h.turn(h.a, h.b)                     # b writes "first" and asks for an fsync
    assert h.results == {}
    h.rt.storage.run_pending()           # the fsync: posted back to b
    h.turn(h.b)
    assert h.results == {"first": ("ok", "loop-1")}
    h.turn(h.b)                          # "handed" arrived late in b's turn: written
    h.rt.storage.run_pending()
    h.turn(h.b, h.a)
    assert h.results["handed"] == ("ok", "loop-0")


def test_a_failed_fsync_fails_every_batch_it_covered_then_a_new_segment(
        fsync: Harness) -> None:
    h = fsync
    t = h.name_owned_by(h.b, "t")
    topic = h.rt.broker.get_topic(t)
    h.publish(h.b, t, "ok1")
    h.settle()
    assert h.results["ok1"][0] == "ok"
    h.ops.faults = [Fault("fsync", "EIO", path=f"/topics/{t}/")]
    h.publish(h.b, t, "w1")
    h.turn(h.b)                          # written (epoch 2), waiting for the fsync
    h.publish(h.b, t, "w2")
    h.turn(h.b)                          # written (epoch 3), waiting too
    h.rt.storage.run_pending()           # one pass, one fsync: it fails
    h.turn(h.b)
    assert h.results["w1"][0] == h.results["w2"][0] == "StorageIOError"
    assert h.rt.health is not None and "EIO" in h.rt.health
    segments = sorted(p.name for p in Path(topic.log.directory or "").glob("*.log"))
    assert len(segments) == 1
    h.publish(h.b, t, "after")
    h.settle()
    assert h.results["after"][0] == "ok" and h.rt.health is None
    segments = sorted(p.name for p in Path(topic.log.directory or "").glob("*.log"))
    assert len(segments) == 2            # the failed segment took no more writes


def test_a_failed_checkpoint_fsync_fails_the_waiting_batch(fsync: Harness) -> None:
    """The storage thread's checkpoint fsync fails while a batch waits for its own
    fsync; the fsync it asked for then succeeds (on nothing new). The batch must fail:
    its records were in the files whose fsync failed."""
    h = fsync
    t = h.name_owned_by(h.a, "t")
    topic = h.rt.broker.get_topic(t)
    h.publish(h.a, t, "waiting")
    h.turn(h.a)                          # written; its fsync request is queued
    h.ops.faults = [Fault("fsync", "EIO", path=f"/topics/{t}/")]
    h.rt.storage.checkpoint({topic: {"floor": 0, "min_cursor": 0}})
    h.ops.faults = []
    h.rt.storage.run_pending()           # the batch's own fsync request: "works"
    h.turn(h.a)
    assert h.results["waiting"][0] == "StorageIOError"


def test_big_mpub_in_slices_fails_whole_when_one_slice_fails(memory: Harness) -> None:
    h = memory
    t = h.name_owned_by(h.a, "t")
    h.rt.broker.get_topic(t)
    n = SLICE + 10
    body = b"".join(b"x" for _ in range(n))
    parts = (body, list(range(n)), [1] * n)
    got: list[Any] = []
    h.ops.faults = [Fault("pwrite", "ENOSPC", nth=3, path=f"/topics/{t}/")]  # 2nd slice
    h.current = h.b
    h.b.publisher.submit(t, parts, 0, got.append)        # handed over to a
    for _ in range(4):
        h.settle(1)
    assert len(got) == 1 and isinstance(got[0], DiskFullError)
    h.ops.faults = []
    h.b.publisher.submit(t, parts, 0, got.append)
    for _ in range(4):
        h.settle(1)
    assert got[1] is None
    assert h.rt.broker.topics[t].log.written == SLICE + n   # the 1st slice of the first


def test_exiting_broker_settles_with_exiting(memory: Harness) -> None:
    h = memory
    t = h.name_owned_by(h.b, "t")
    h.rt.broker.exiting = True
    h.publish(h.b, t, "late")
    h.publish(h.a, t, "late-remote")
    h.settle()
    assert h.results == {"late": ("Exiting", "loop-1"), "late-remote": ("Exiting", "loop-0")}


def test_publish_now_at_start_up(memory: Harness) -> None:
    h = memory
    topic = h.rt.broker.get_topic("imported")
    first = publish_now(topic, [(1, 3, b"a", 0), (2, 0, b"b", 5)])
    assert first == 0 and h.topic_bodies("imported") == [b"a", b"b"]
    assert dict(topic.dpubs) == {1: 5} and topic.message_count == 2
    h.ops.faults = [Fault("pwrite", "EIO")]
    with pytest.raises(StorageError):
        publish_now(topic, [(3, 0, b"c", 0)])
    assert h.topic_bodies("imported") == [b"a", b"b"] and topic.log.head == 2


def test_deleted_topic_takes_no_publish(memory: Harness) -> None:
    h = memory
    t = h.name_owned_by(h.a, "t")
    old = h.rt.broker.get_topic(t)
    h.publish(h.a, t, "before")
    h.rt.broker.delete_topic(t)          # between the append and the write
    h.publish(h.a, t, "after")           # goes to the new topic of that name
    h.settle()
    assert h.results["before"][0] == "ok" and h.results["after"][0] == "ok"
    assert old.log.written == 0
    assert h.topic_bodies(t) == [b"after-0"]
    with pytest.raises(Exiting):
        old.publish([b"x"], 1)


def test_http_job_result_comes_when_the_loop_resolves_it() -> None:
    """A Gather job may answer later (an HTTP publish: when its write is settled)."""
    from pybroker.http.gather import MISSING, Later, run_job

    got: list[Any] = []
    later = Later()
    run_job(lambda: later, (), got.append)
    assert got == []
    later.resolve(None)
    later.resolve(ValueError("twice"))     # settled once only
    assert got == [None]
    early = Later()
    early.resolve("done")
    run_job(lambda: early, (), got.append)  # resolved before anyone waited
    assert got == [None, "done"]

    def broken() -> Any:
        raise RuntimeError("a bug")

    run_job(broken, (), got.append)
    assert got[-1] is MISSING


def test_fsync_of_a_topic_deleted_meanwhile(fsync: Harness) -> None:
    """A publish written just before its topic is deleted is answered OK (nsqd: it won
    the race, then went with its topic) though the fsync of the moved files fails, and
    that failure is not the broker's health."""
    h = fsync
    h.rt.broker.on_delete_topic.append(h.rt.storage.delete_topic)
    t = h.name_owned_by(h.a, "t")
    h.rt.broker.get_topic(t)
    h.publish(h.a, t, "raced")
    h.turn(h.a)                          # written; waiting for its fsync
    h.rt.broker.delete_topic(t)          # the directory is moved aside at once
    h.settle()
    assert h.results["raced"] == ("ok", "loop-0")
    assert h.rt.health is None


def _plain_client(h: Harness, loop: EventLoop) -> tuple[Any, Any]:
    """A client connection on ``loop`` over a socketpair, its magic read."""
    import socket

    client, server = socket.socketpair()
    client.settimeout(5)
    loop.add_connection(server, "test:1")
    conn = next(c for c in loop.connections if c.sock is server)
    client.sendall(b"  V2")
    h.turn(loop)
    return client, conn


def _read(client: Any, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = client.recv(n - len(got))
        assert chunk
        got += chunk
    return got


def test_the_lanes_answers_go_out_with_the_turn_and_before_what_follows(
        memory: Harness) -> None:
    """A plain publisher's PUBs go through the publish lane and its OKs straight to the
    turn's batched writes (Publisher: batch.direct, EventLoop.answer_direct); an OK
    whose connection has something queued after the publish goes in front of it."""
    from pybroker.protocol.encoder import OK_FRAME

    loop = memory.a
    topic = memory.name_owned_by(loop, "direct")
    client, conn = _plain_client(memory, loop)
    answered: list[list[tuple[Any, int, int]]] = []
    real = loop.answer_direct
    loop.answer_direct = lambda items: (answered.append(list(items)),   # type: ignore
                                        real(items))[1]
    client.sendall(b"".join(b"PUB %s\n" % topic.encode() + len(b).to_bytes(4, "big") + b
                            for b in (b"one", b"two")))
    memory.turn(loop)
    assert _read(client, 20) == OK_FRAME * 2
    assert answered == [[(conn, 2, 2)]]     # by the lane, straight to the turn's writes
    loop.answer_direct = real               # type: ignore[method-assign]
    assert memory.topic_bodies(topic) == [b"one", b"two"]
    # the defensive order: an answer for conn, with a frame queued for it since
    conn.send_frame(b"\x00\x00\x00\x05\x00\x00\x00\x00X")
    loop.answer_direct([(conn, 3, 3)])
    turn(loop)
    assert _read(client, 39) == OK_FRAME * 3 + b"\x00\x00\x00\x05\x00\x00\x00\x00X"
    client.close()


def test_idle_calls_run_after_the_writes_of_the_turns_before(
        memory: Harness, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SelectorLoop.when_idle on the event loop: what a replication leader answers a
    follower's fetch at. A turn with work (one that does not sleep) leaves the calls
    deferred; the next turn that finds nothing to read runs them, and they see the
    records the publishes before appended already written; one that raises is logged,
    the rest still run; a call deferred while they run waits for the next idle turn."""
    monkeypatch.setattr(evloop, "IDLE_MAX_NS", 10**12)   # (only idleness runs them)
    h = memory
    t = h.name_owned_by(h.a, "t")
    topic = h.rt.broker.get_topic(t)
    seen: list[tuple[str, int]] = []

    def broken() -> None:
        raise RuntimeError("a bug")

    def first() -> None:
        seen.append(("first", topic.log.written))
        h.a.when_idle("added", lambda: seen.append(("added", topic.log.written)))

    h.publish(h.a, t, "p", 3)
    h.a.when_idle("broken", broken)
    h.a.when_idle("first", first)
    h.turn(h.a)                       # (a call queued: the turn does not sleep)
    assert seen == []
    assert h.results["p"][0] == "ok"
    with caplog.at_level(logging.ERROR):
        h.a.run_once()               # nothing to read: a look, then the calls
    assert seen == [("first", 3)]
    assert "error in an idle call" in caplog.text
    h.a.run_once()
    assert seen == [("first", 3), ("added", 3)]
