"""What reads every channel of a loop does it a step a turn: a checkpoint's snapshots
(``storage._snapshot_on_loop``, SNAPSHOT_STEP channels: 10,000 in one turn held the
loop 48 ms at every checkpoint) and /stats (``collect.loop_snapshot``, STATS_STEP:
62 ms). A real Runtime in this process, its loop turned by the test."""
from __future__ import annotations

import queue
import time
from collections.abc import Generator, Iterator

import pytest

import pybroker.server.storage as storage
from pybroker.http import collect
from pybroker.http.gather import Later
from pybroker.runtime import Runtime
from pybroker.testing import wait_until
from tests.support.inproc import attach, temp_runtime, turn


@pytest.fixture
def rt() -> Iterator[Runtime]:
    with temp_runtime("snapsteps-") as r:
        yield r


def test_a_checkpoint_snapshots_a_step_of_channels_a_turn(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage, "SNAPSHOT_STEP", 50)
    b, loop = rt.broker, rt.loops[0]
    for i in range(120):
        t = b.get_topic(f"t{i:03d}")
        for ch in ("a", "b") if i % 3 == 0 else ("a",):
            t.get_channel(ch)
    per_call: list[int] = []
    steps = storage._snapshot_steps

    def counted(lp: object, topics: list[object], out: list[storage.Snap]
                ) -> Generator[None, None, None]:
        """The steps, the channels each one snapshots counted."""
        gen = steps(lp, topics, out)  # type: ignore[arg-type]
        while True:
            before = len(out)
            try:
                next(gen)
            except StopIteration:
                per_call.append(len(out) - before)
                return
            per_call.append(len(out) - before)
            yield

    monkeypatch.setattr(storage, "_snapshot_steps", counted)
    answers: queue.Queue[list[storage.Snap]] = queue.Queue()
    storage._snapshot_on_loop(loop, b, answers)      # its first step, at once
    b.delete_topic("t119")                           # not reached yet: dropped later
    deadline = time.monotonic() + 10
    while answers.empty():
        assert time.monotonic() < deadline, "the snapshot did not finish"
        turn(loop)
    got = answers.get()
    assert len(per_call) >= 4                        # one step a turn
    assert all(n <= 50 + 1 for n in per_call), per_call     # a topic's channels together
    assert all(n >= 50 for n in per_call[:-1]), per_call    # none cut short
    names = [(t.name, name) for t, name, _, _ in got]
    assert len(names) == len(set(names))
    states = rt.storage._topic_states(got)
    assert {t.name for t in states} == {f"t{i:03d}" for i in range(119)}
    assert sum(len(st["channels"]) for st in states.values()) == 119 + 40


def test_stats_read_a_step_of_channels_a_turn(rt: Runtime,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """/stats' job on a loop (``collect.loop_snapshot``) reads STATS_STEP channels a
    turn and answers with the last (10,000 channels in one turn held the loop 62 ms):
    every channel once, none deleted meanwhile, the same figures as one read."""
    monkeypatch.setattr(collect, "STATS_STEP", 40)
    b, loop = rt.broker, rt.loops[0]
    chans = [b.get_topic(f"s{i:03d}").get_channel("c")[0] for i in range(130)]
    whole = collect.loop_snapshot(loop, chans[:40], False, "", False)
    assert isinstance(whole, collect.LoopSnapshot) and len(whole.channels) == 40
    read: list[int] = []
    step = collect._stats_step

    def counted(*args: object) -> int:
        before = len(args[3])  # type: ignore[arg-type]
        end = step(*args)  # type: ignore[arg-type]
        read.append(len(args[3]) - before)  # type: ignore[arg-type]
        return end

    monkeypatch.setattr(collect, "_stats_step", counted)
    got: list[object] = []
    later = collect.loop_snapshot(loop, chans, False, "", True)
    assert isinstance(later, Later)
    later.then(got.append)
    b.delete_topic("s129")                           # not read yet: left out
    deadline = time.monotonic() + 10
    while not got:
        assert time.monotonic() < deadline, "the stats did not come"
        turn(loop)
    snap = got[0]
    assert isinstance(snap, collect.LoopSnapshot)
    assert read == [40, 40, 40, 9]                   # a step a turn; the deleted one skipped
    assert set(snap.channels) == {id(ch) for ch in chans[:129]}
    assert all(snap.channels[id(ch)][0]["channel_name"] == "c" for ch in chans[:129])


def test_stats_list_a_step_of_clients_a_turn(rt: Runtime,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """With clients wanted, a step also stops at CLIENTS_STEP of them, and a channel
    with more is read whole once (its counts) and its clients listed a CLIENTS_STEP a
    turn (a channel's 10,000 clients in one turn held the loop 33-49 ms): every client
    listed once, the counts as the clients listed."""
    from pybroker.core import snapshot
    monkeypatch.setattr(collect, "CLIENTS_STEP", 5)
    b, loop = rt.broker, rt.loops[0]
    turn(loop)                                   # (the lane is on from a turn's end)
    subs = {"small": 2, "big": 12, "none": 0}
    clients = []
    for name, n in subs.items():
        b.get_topic(name).get_channel("c")
        clients += attach(loop, f"  V2SUB {name} c\n".encode(), n, name)
    try:
        def subscribed() -> bool:
            turn(loop)
            return sum(len(b.get_topic(n).get_channel("c")[0].consumers) for n in subs) == 14
        wait_until(subscribed, 10)
        chans = [b.get_topic(n).get_channel("c")[0] for n in subs]
        listed: list[int] = []                  # clients listed in each turn
        count = [0]
        for mod in (collect, snapshot):
            real = mod.client_stats

            def counting(*a: object, _real: object = real) -> object:
                count[0] += 1
                return _real(*a)  # type: ignore[operator]
            monkeypatch.setattr(mod, "client_stats", counting)
        got: list[object] = []
        later = collect.loop_snapshot(loop, chans, True, "", False)
        assert isinstance(later, Later)
        later.then(got.append)
        listed.append(count[0])
        deadline = time.monotonic() + 10
        while not got:
            assert time.monotonic() < deadline, "the stats did not come"
            count[0] = 0
            turn(loop)
            listed.append(count[0])
        snap = got[0]
        assert isinstance(snap, collect.LoopSnapshot)
        made = [k for k in listed if k]        # (turns before a step's timer is due: 0)
        assert made == [2, 5, 5, 2], listed    # the small one; the big one's, in 3
        for name, ch in zip(subs, chans):
            counts = snap.channels[id(ch)][0]
            assert counts["client_count"] == subs[name]
            ids = [c["remote_address"] for c in counts["clients"] or []]
            assert len(ids) == len(set(ids)) == subs[name]
    finally:
        for c in clients:
            c.close()
