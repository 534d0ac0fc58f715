"""A new leader's channels built from its old leader's states (pybroker.cluster.takeover):
in steps, not added to the topic until done, each state cut to what the log holds; and
the leader ships a new version of its states only once every channel's is encoded."""
from __future__ import annotations

import json
import logging
from types import SimpleNamespace
from typing import Any, cast

import pytest

from pybroker.cluster import takeover
from pybroker.cluster.replica import Replica
from pybroker.cluster.rules import EpochHistory
from pybroker.cluster.states import Shipped, ship
from pybroker.core.lifecycle import RESTORE_STEP, ChannelState
from pybroker.core.topic import Topic
from pybroker.jsonvalue import PartTexts, dumps_keyed
from tests.unit.test_channel import WALL, S, make_topic, publish

NOW = 5 * S


def _topic(n: int) -> Topic:
    t = make_topic(mem=n + 100)
    publish(t, n)
    return t


def _steps(gen: takeover.Steps) -> tuple[list[Any], int]:
    n = 0
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value, n
        n += 1


def test_channels_are_cut_to_the_log_and_not_added_to_the_topic() -> None:
    """The old leader's state names offsets this log does not hold (its unacknowledged
    tail): the cursor comes back to the log's end, pending and skipped offsets past it
    go. The channels are the topic's only once the loop puts them in place."""
    t = _topic(10)
    states = cast("dict[str, ChannelState]", {
        "c": {"cursor": 14, "skip": [3, 12], "paused": True,
              "pending": [[1, 2, 0], [4, 1, WALL + 60 * S], [11, 1, 0]],
              "settings": {"max_attempts": 3, "dead_letter_topic": "dl"}},
        "d": {"cursor": 2, "pending": []}})
    chans, _ = _steps(takeover.build(t, states, t.log.written, NOW, WALL))
    assert t.channels == {}
    by = {ch.name: ch for ch in chans}
    c = by["c"]
    assert c.cursor == 10 and list(c.skip) == [] and c.paused
    assert c.max_attempts == 3 and c.dead_letter_topic == "dl"
    assert c.deferred_count(WALL) == 1 and [r[0] for r in c.requeued] == [1]
    assert by["d"].cursor == 2
    assert c.topic is t and c.owner is t.make_channel("c", 0).owner


def test_a_large_state_is_built_a_few_thousand_messages_a_step() -> None:
    """100,000 deferred messages, as shipped (JSON bytes): decoded a slice a step, their
    timers set RESTORE_STEP a step; the channel is the one a whole restore makes."""
    n = 100_000
    t = _topic(n + 10)
    state = {"cursor": n + 5, "skip": [],
             "pending": [[k, 1 + k % 3, WALL + (k % 7 + 1) * S] for k in range(n)]}
    raw = json.dumps({"c": state}).encode()
    chans, steps = _steps(takeover.build(t, takeover.Text([raw], len(raw)), t.log.written,
                                         NOW, WALL))
    assert steps >= n // RESTORE_STEP + len(raw) // (2 * 64 * 1024)
    whole = t.make_channel("c", 0)
    whole.restore(cast("ChannelState", state), NOW, WALL)
    assert chans[0].snapshot(WALL, NOW) == whole.snapshot(WALL, NOW)
    assert chans[0].deferred_count(WALL) == n


def test_states_that_are_not_json_take_over_no_channel(caplog: pytest.LogCaptureFixture) -> None:
    t = _topic(3)
    with caplog.at_level(logging.ERROR, logger="pybroker"):
        bad = b'{"c": {"cursor": 1, "pending": [[1, 2'
        chans, _ = _steps(takeover.build(t, takeover.Text([bad], len(bad)), 3, NOW, WALL))
    assert chans == []
    assert "cannot be read" in caplog.text


def test_a_version_is_shipped_only_once_every_channel_is_encoded() -> None:
    """A follower takes what it is shipped as the whole set of channels (one missing
    was deleted by the leader): after a takeover the states are encoded one channel at
    a time, and a version made between two would have dropped the others."""
    t = _topic(3)
    for name in ("a", "b", "tmp#ephemeral"):
        t.get_channel(name)
    woken: list[str] = []
    r = Replica(cast(Any, SimpleNamespace(wake_fetches=woken.append)), t, EpochHistory())
    before = r.chan_version
    r.shipped["a"] = _shipped({})
    r._new_version()
    assert r.chan_version == before          # b is not encoded yet
    r.shipped["b"] = _shipped({})
    r._new_version()
    assert r.chan_version > before           # the ephemeral channel is never shipped
    t.channels["b"].deleted = True
    del r.shipped["b"]
    version = r.chan_version
    r._new_version()
    assert r.chan_version > version          # a deleted one is not waited for
    # each version wakes the fetches parked on the topic, and is remembered by the
    # generations of its channels' encodings
    assert woken == ["t", "t"]
    assert r.version_gens[r.chan_version] == {"a": r.shipped["a"].keyed.gen}


def _shipped(state: dict[str, int]) -> Shipped:
    return ship(dumps_keyed(state, PartTexts()), 0)


class _Owner:
    """A channel's owner loop, running what is posted to it at once."""

    def __init__(self) -> None:
        self.closed: list[Any] = []
        self.dirty: list[Any] = []

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
        fn(*args)

    def close_channel(self, ch: Any) -> None:
        self.closed.append(ch)

    def mark_dirty(self, ch: Any) -> None:
        self.dirty.append(ch)


class _Broker:
    def __init__(self) -> None:
        self.deleted: list[tuple[str, str]] = []

    def notify_changed(self) -> None:
        pass

    def delete_channel(self, topic: str, name: str) -> None:
        self.deleted.append((topic, name))


def test_the_built_channels_replace_the_followers_but_not_one_deleted_meanwhile() -> None:
    """The channels built are put in place of the follower's at once; one the leader
    did not ship is deleted (the leader deleted it before); one deleted here while the
    states were being built stays deleted."""
    owner = _Owner()
    log_ = make_topic(mem=100).log
    t = Topic("t", log_, 100, lambda a, b: owner)     # type: ignore[arg-type,return-value]
    publish(t, 5)
    for name in ("kept", "gone", "deleted-meanwhile"):
        t.get_channel(name)
    broker = _Broker()
    r = Replica(cast(Any, SimpleNamespace(runtime=SimpleNamespace(broker=broker))), t,
                EpochHistory())
    names = list(t.channels)
    shipped = cast("dict[str, ChannelState]", {"kept": {"cursor": 3, "pending": [[1, 1, 0]]},
                                                "deleted-meanwhile": {"cursor": 2}})
    chans, _ = _steps(takeover.build(t, shipped, t.log.written, NOW, WALL))
    old = dict(t.channels)
    t.remove_channel("deleted-meanwhile")
    r._install(chans, names, from_leader=7)
    assert broker.deleted == [("t", "gone")]
    assert "deleted-meanwhile" not in t.channels
    assert t.channels["kept"] is chans[0] and t.channels["kept"].cursor == 3
    assert old["kept"].deleted and owner.closed == [old["kept"]]
    assert owner.dirty == [chans[0]]


def test_a_sub_waits_for_the_takeover_and_hears_how_it_ended() -> None:
    """A SUB that comes while the channels are being built waits (after_takeover): it
    is told True once they are in place, False if the leadership went first; asked
    when nothing is being built, it is told at once."""
    t = _topic(3)
    node = SimpleNamespace(runtime=SimpleNamespace(broker=_Broker()),
                           roles_changed=lambda: None)
    r = Replica(cast(Any, node), t, EpochHistory())
    told: list[tuple[str, bool]] = []
    r.role, r.epoch = "leader", 4
    r.after_takeover(lambda led: told.append(("now", led)))
    assert told == [("now", True)]
    assert "taking_over" not in r.stats()
    r.taking_over = 4
    assert r.stats()["taking_over"] is True          # /stats says so while it builds
    r.after_takeover(lambda led: told.append(("a", led)))
    r.after_takeover(lambda led: told.append(("b", led)))
    assert told == [("now", True)]
    r._end_takeover(True)
    assert told[1:] == [("a", True), ("b", True)] and r.taking_over == 0
    r.taking_over = 4
    r.after_takeover(lambda led: told.append(("c", led)))
    r.dropped()                       # the topic deleted meanwhile
    assert told[3:] == [("c", False)] and r.sub_waiters == []


def test_a_leader_that_steps_down_keeps_nothing_of_what_it_shipped() -> None:
    """The encoded states a leadership shipped, and the encoder's memory of their
    chunks, go when it ends (they are a next leadership's to make afresh)."""
    from pybroker.cluster.replica import FOLLOWER, LEADER
    t = _topic(3)
    r = Replica(cast(Any, None), t, EpochHistory())
    r.role, r.epoch = LEADER, 1
    r.shipped["a"] = _shipped({"cursor": 1})
    r.chan_last["a"] = (cast(ChannelState, {"cursor": 1}), ())
    r.chan_at["a"] = 5
    r.texts["a"] = PartTexts()
    r.shipped_states()
    r._step_down(FOLLOWER, 2, 3)
    assert (r.role, r.epoch, r.leader) == (FOLLOWER, 2, 3)
    assert r.shipped == {} and r.chan_last == {} and r.chan_at == {} and r.texts == {}
    assert r._assembled is None and r.version_gens == {}
