"""Restarts on the same data_path: the backlog past mem_queue_size, and every message
held in memory, in flight or deferred at SIGTERM, comes back (both durability modes);
deferred messages keep their remaining delay (nsqd forgets it); after kill -9 in the
default mode at least what was already on disk survives.
"""
from __future__ import annotations

import json
import signal
from pathlib import Path
import time
from collections.abc import Callable

import pytest

from pybroker.storage import statejournal
from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.durability import (
    bodies,
    channel_stats,
    consume,
    create_channel,
    http,
    http_pub,
    topic_stats,
)
from tests.support.wire import WireClient

MakeBroker = Callable[..., BrokerProcess]
MODES = ["memory", "fsync"]


def restart(b: BrokerProcess, sig: int = signal.SIGTERM) -> None:
    if sig == signal.SIGKILL:
        b.kill9()
    else:
        code = b.stop(sig)
        assert code == 0, b.stderr_text()
        assert "Traceback" not in b.stderr_text(), b.stderr_text()
    b.start()


@pytest.mark.parametrize("mode", MODES)
def test_backlog_past_mem_queue_size_survives_a_restart(make_broker: MakeBroker,
                                                        tmp_path: object, mode: str) -> None:
    b = make_broker("--mem-queue-size=10", f"--durability={mode}",
                    "--max-bytes-per-file=4096")
    with_ch, no_ch = unique_name("spill"), unique_name("spill_noch")
    create_channel(b, with_ch, "ch")
    expected = [f"m{i:04d}".encode() * 8 for i in range(300)]
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        for i in range(0, 200, 25):
            c.mpub(with_ch, expected[i:i + 25])
            c.mpub(no_ch, expected[i:i + 25])
        for body in expected[200:]:
            c.pub(with_ch, body)
            c.pub(no_ch, body)
    ch = channel_stats(b, with_ch, "ch")
    t = topic_stats(b, no_ch)
    assert ch is not None and t is not None
    # most of the backlog is on disk, at most mem_queue_size in memory
    assert ch["depth"] == 300 and ch["backend_depth"] >= 290, ch
    assert t["depth"] == 300 and t["backend_depth"] >= 290, t

    restart(b)
    got = consume(b, with_ch, "ch", expect=300)
    assert sorted(bodies(got)) == sorted(expected)
    assert all(r.msg.attempts == 1 for r in got)
    got = consume(b, no_ch, "late", expect=300)  # the topic buffer goes to a new channel
    assert sorted(bodies(got)) == sorted(expected)
    # nothing more and nothing left
    assert consume(b, with_ch, "ch", idle_s=0.5) == []
    restart(b)
    assert consume(b, with_ch, "ch", idle_s=0.5) == []
    assert consume(b, no_ch, "late", idle_s=0.5) == []


DELAY_MS = 4000


@pytest.mark.parametrize("mode", MODES)
def test_sigterm_keeps_queued_in_flight_and_deferred(make_broker: MakeBroker,
                                                     mode: str) -> None:
    """In memory: queued; in flight: 2 (never FIN'd); deferred: 3 DPUB + 1 REQ with a
    delay; 1 REQ without delay. All come back after a restart with their attempts, and
    the deferred ones at their due time, not before."""
    b = make_broker("--mem-queue-size=100", f"--durability={mode}", "--msg-timeout=60s")
    topic = unique_name("sigterm")
    create_channel(b, topic, "ch")
    queued = [f"q{i}".encode() for i in range(8)]
    with WireClient.connect(b.tcp_address) as p:  # type: ignore[arg-type]
        p.mpub(topic, queued)
        t_dpub = time.time()
        for i in range(3):
            p.dpub(topic, DELAY_MS, f"d{i}".encode())
    http_pub(b, topic, b"d-http", defer_ms=DELAY_MS)
    deferred_due = {f"d{i}".encode(): t_dpub + DELAY_MS / 1000 for i in range(3)}
    deferred_due[b"d-http"] = t_dpub + DELAY_MS / 1000

    c = WireClient.connect(b.tcp_address)  # type: ignore[arg-type]
    c.sub(topic, "ch")
    c.rdy(4)
    first = c.read_messages(4)
    assert [m.body for m in first] == queued[:4]
    c.rdy(0)
    t_req = time.time()
    c.req(first[2].id, DELAY_MS)          # deferred by REQ
    c.req(first[3].id, 0)                 # straight back to the queue
    deferred_due[first[2].body] = t_req + DELAY_MS / 1000

    def settled() -> bool:
        s = channel_stats(b, topic, "ch")
        return s is not None and (s["in_flight_count"], s["deferred_count"], s["depth"]) \
            == (2, 5, 5)
    wait_until(settled, what="2 in flight, 5 deferred, 5 queued")

    restart(b)
    c.close()
    s = channel_stats(b, topic, "ch")
    # deferred ones count as deferred after the restart too (not as depth)
    assert s is not None and (s["depth"], s["deferred_count"]) == (7, 5), s
    got = consume(b, topic, "ch", expect=12, timeout_s=DELAY_MS / 1000 + 10)
    by_body = {r.msg.body: r for r in got}
    assert set(by_body) == set(queued) | set(deferred_due), bodies(got)
    assert len(got) == 12, f"duplicates: {bodies(got)}"
    # attempts: delivered once before the restart -> 2 now; never delivered -> 1
    for m in first[:4]:
        assert by_body[m.body].msg.attempts == 2, (m.body, by_body[m.body].msg)
    for body in queued[4:] + [b for b in deferred_due if b.startswith(b"d")]:
        assert by_body[body].msg.attempts == 1, (body, by_body[body].msg)
    # deferred ones: not before their time, and not much after it
    for body, due in deferred_due.items():
        at = by_body[body].at_wall
        assert at >= due - 0.05, f"{body!r} delivered {due - at:.2f}s early"
        assert at <= due + 2.5, f"{body!r} delivered {at - due:.2f}s late"
        print(f"{body!r}: delivered {at - due:+.3f}s from its due time")
    # the immediate ones came first (they were never deferred)
    immediate = set(queued) - {first[2].body}
    assert {r.msg.body for r in got[:7]} == immediate, bodies(got)


def test_nsqd_forgets_the_remaining_delay(make_broker: MakeBroker) -> None:
    """The nsqd behaviour pybroker improves on: after a restart a deferred message is
    delivered at once."""
    b = make_broker(kind="nsqd")
    topic = unique_name("nsqd_defer")
    create_channel(b, topic, "ch")
    with WireClient.connect(b.tcp_address) as p:  # type: ignore[arg-type]
        p.dpub(topic, 30_000, b"later")
    wait_until(lambda: (channel_stats(b, topic, "ch") or {}).get("deferred_count") == 1)
    restart(b)
    got = consume(b, topic, "ch", expect=1, timeout_s=5)
    assert bodies(got) == [b"later"]


def test_kill9_in_memory_mode_keeps_what_was_on_disk(make_broker: MakeBroker) -> None:
    """Default durability promises nsqd's guarantee: messages already written to the
    disk queue survive kill -9 (the OS has them); those only in memory may be lost."""
    b = make_broker("--mem-queue-size=10", "--durability=memory")
    with_ch, no_ch = unique_name("k9"), unique_name("k9_noch")
    create_channel(b, with_ch, "ch")
    expected = [f"k{i:04d}".encode() for i in range(200)]
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        for i in range(0, 200, 20):
            c.mpub(with_ch, expected[i:i + 20])
            c.mpub(no_ch, expected[i:i + 20])
    ch, t = channel_stats(b, with_ch, "ch"), topic_stats(b, no_ch)
    assert ch is not None and ch["backend_depth"] == 190, ch
    assert t is not None and t["backend_depth"] == 190, t
    restart(b, signal.SIGKILL)
    for topic, channel in ((with_ch, "ch"), (no_ch, "late")):
        got = bodies(consume(b, topic, channel, idle_s=1.0))
        missing = set(expected[10:]) - set(got)
        assert not missing, f"{topic}: {len(missing)} on-disk messages lost"
        assert set(got) <= set(expected)
        print(f"{topic}: {len(got)} of 200 delivered after kill -9 "
              f"({len(got) - len(set(got))} duplicates)")


@pytest.mark.parametrize("mode", MODES)
def test_mem_queue_size_zero_goes_through_disk(make_broker: MakeBroker, mode: str) -> None:
    """As in nsqd, --mem-queue-size=0 keeps every message on disk, and they are still
    delivered (before and after a restart)."""
    b = make_broker("--mem-queue-size=0", f"--durability={mode}")
    topic, no_ch = unique_name("mem0"), unique_name("mem0_noch")
    create_channel(b, topic, "ch")
    msgs = [f"z{i:03d}".encode() for i in range(30)]
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        c.mpub(topic, msgs[:15])
        c.mpub(no_ch, msgs[:15])
    s = channel_stats(b, topic, "ch")
    assert s is not None and s["backend_depth"] == 15, s
    assert bodies(consume(b, topic, "ch", expect=15, timeout_s=5)) == msgs[:15]
    assert bodies(consume(b, no_ch, "ch", expect=15, timeout_s=5)) == msgs[:15]
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        c.mpub(topic, msgs[15:])
    restart(b)
    assert bodies(consume(b, topic, "ch", expect=15, timeout_s=5)) == msgs[15:]


def test_deleted_and_emptied_queues_stay_so_after_restart(make_broker: MakeBroker) -> None:
    b = make_broker("--mem-queue-size=5")
    gone_topic, topic = unique_name("del_t"), unique_name("del_ch")
    create_channel(b, gone_topic, "ch")
    for ch in ("gone", "emptied", "kept"):
        create_channel(b, topic, ch)
    create_channel(b, topic, "eph#ephemeral")
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        c.mpub(gone_topic, [b"x"] * 20)
        c.mpub(topic, [f"m{i}".encode() for i in range(20)])
        c.mpub("eph_t#ephemeral", [b"e"] * 3)
    assert http(b, "POST", f"/topic/delete?topic={gone_topic}")[0] == 200
    assert http(b, "POST", f"/channel/delete?topic={topic}&channel=gone")[0] == 200
    assert http(b, "POST", f"/channel/empty?topic={topic}&channel=emptied")[0] == 200
    restart(b)
    t = topic_stats(b, topic)
    assert topic_stats(b, gone_topic) is None
    assert topic_stats(b, "eph_t#ephemeral") is None
    assert t is not None and sorted(c["channel_name"] for c in t["channels"]) == \
        ["emptied", "kept"], t
    assert consume(b, topic, "emptied", idle_s=0.5) == []
    assert len(consume(b, topic, "kept", expect=20)) == 20
    assert consume(b, gone_topic, "ch", idle_s=0.5) == []
    assert consume(b, topic, "gone", idle_s=0.5) == []


def test_deferrals_saved_as_changes_survive_a_kill9(make_broker: MakeBroker) -> None:
    """A channel holding 20,000 deferred messages, then 30 more deferred one at a time
    across checkpoints (every 50 ms): each checkpoint appends what changed (a chunk of
    up to 1,024 offsets) to the state's journal (pybroker.storage.statejournal) instead
    of writing the whole file again; after a kill -9 the broker reads the file and its
    journal and holds every deferred message."""
    b = make_broker("--durability=fsync", "--sync-timeout=50ms", "--max-req-timeout=2h")
    topic = unique_name("journal")
    create_channel(b, topic, "ch")
    n, more = 20_000, 30
    state = Path(b.data_path) / "state" / f"{topic}.json"
    with WireClient.connect(b.tcp_address) as w:  # type: ignore[arg-type]
        w.mpub(topic, [f"m{k}".encode() for k in range(n + more)])
        w.sub(topic, "ch")
        w.rdy(2500)
        for _ in range(n):
            w.req(w.read_message(10).id, 3_600_000)
        w.rdy(0)
        wait_until(lambda: _saved_deferred(state) == n, 10, what="the deferrals saved")
        written = _write_bytes(b)
        w.rdy(1)
        for k in range(1, more + 1):
            w.req(w.read_message(10).id, 3_600_000)
            # saved before the next: a checkpoint between two
            wait_until(lambda want=n + k: _saved_deferred(state) == want, 10,
                       what=f"deferral {k} saved")
    # 30 changed states written whole would be 30 files; as changes, at most one file
    # (the journal full: MAX_RECORDS) and the journal's records
    written = _write_bytes(b) - written
    whole = state.stat().st_size
    print(f"{more} changes wrote {written:,} bytes; the file is {whole:,}")
    assert written < 5 * whole, (written, whole)
    restart(b, signal.SIGKILL)
    s = channel_stats(b, topic, "ch")
    assert s is not None and (s["deferred_count"], s["depth"]) == (n + more, 0), s


def _saved_deferred(path: Path) -> int:
    """The deferred messages a topic's saved state holds (its file and journal, as
    start-up reads them; 0 before the first save): pending ones with a due time."""
    text = statejournal.load(str(path))
    if text is None:
        return 0
    return sum(1 for ch in json.loads(text)["channels"].values()
               for p in ch.get("pending", []) if p[2] > 0)


def _write_bytes(b: BrokerProcess) -> int:
    """What the broker process has written to storage (``/proc/PID/io``)."""
    with open(f"/proc/{b.pid}/io") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("write_bytes"))


def test_a_state_saved_as_its_topic_is_deleted_is_not_left_for_a_new_one(
        make_broker: MakeBroker, tmp_path: Path) -> None:
    """A topic deleted while the storage thread writes its state file whole (its first
    save, held in the fsync of the temporary file by the fault plan) leaves no state
    file behind: a topic created again under its name, killed before its own first
    save, starts clean after the restart instead of from the old topic's cursor (20,
    past the new log's 10 messages: all 10 were skipped)."""
    slow = tmp_path / "slow"
    slow.touch()
    plan = f"op=fsync kind=slow ms=3000 nth=1 count=1 while={slow} path=/state/"
    b = make_broker("--durability=fsync", "--sync-timeout=1h",
                    env={"PYBROKER_FAULTS": plan})
    topic = unique_name("racy")
    state_dir = Path(b.data_path) / "state"
    create_channel(b, topic, "ch")
    with WireClient.connect(b.tcp_address) as w:  # type: ignore[arg-type]
        w.mpub(topic, [f"old{k}".encode() for k in range(20)])
        w.sub(topic, "ch")
        w.rdy(20)
        msgs = w.read_messages(20, 10)
        for m in msgs[:-1]:
            w.fin(m.id)
        w.req(msgs[-1].id, 60_000)           # a deferral in fsync mode: saved at once
        wait_until(lambda: any(state_dir.glob(f"{topic}.json.*.tmp")),
                   what="the state's first save under way")
    assert http(b, "POST", f"/topic/delete?topic={topic}")[0] == 200
    # the storage thread removes a deleted topic's moved-aside log after the save
    wait_until(lambda: not any((Path(b.data_path) / "topics").glob(".deleted-*")),
               timeout_s=15, what="the save and the deletion done")
    assert sorted(p.name for p in state_dir.glob(f"{topic}.json*")) == []
    slow.unlink()
    create_channel(b, topic, "ch")
    with WireClient.connect(b.tcp_address) as w:  # type: ignore[arg-type]
        w.mpub(topic, [f"new{k}".encode() for k in range(10)])
    restart(b, signal.SIGKILL)               # before the new topic's first save
    got = consume(b, topic, "ch", expect=10, timeout_s=10)
    assert sorted(bodies(got)) == sorted(f"new{k}".encode() for k in range(10))
