"""A checkpoint's snapshots are taken SNAPSHOT_STEP channels a loop turn
(``storage._snapshot_on_loop``): 10,000 channels in one turn held the loop 48 ms at
every checkpoint. A real Runtime in this process, its loop turned by the test."""
from __future__ import annotations

import queue
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import pybroker.server.storage as storage
from pybroker.server.runtime import Runtime
from tests.support.inproc import close_runtime, runtime, turn


@pytest.fixture
def rt() -> Iterator[Runtime]:
    tmp = tempfile.mkdtemp(prefix="snapsteps-")
    r = runtime(Path(tmp))
    try:
        yield r
    finally:
        close_runtime(r)
        shutil.rmtree(tmp, ignore_errors=True)


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

    def counted(*args: object) -> None:
        before = len(args[3])  # type: ignore[arg-type]
        steps(*args)  # type: ignore[arg-type]
        per_call.append(len(args[3]) - before)  # type: ignore[arg-type]

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
