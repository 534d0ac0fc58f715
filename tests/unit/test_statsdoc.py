"""core.statsdoc's TypedDicts are the shape core.stats and core.snapshot really build:
every document, topic, channel and client has exactly the declared keys (the optional
ones only where nsqd prints them), values of the declared types, in nsqd's key order."""
from __future__ import annotations

import types
import typing

from pybroker.core.snapshot import channel_snapshot, topic_stats
from pybroker.core.stats import client_stats, document, e2e_result
from pybroker.core.statsdoc import (ChannelCounts, ChannelExtras, ChannelStats, ClientStats,
                                    E2eResult, StatsDocument, TopicStats)
from tests.unit.test_channel import WALL, make, publish


def _check(value: object, hint: object, where: str) -> None:
    """value has the type hint (TypedDicts, lists, unions, None and the scalars)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arm in typing.get_args(hint):
            try:
                _check(value, arm, where)
                return
            except AssertionError as e:
                errors.append(str(e))
        raise AssertionError("; ".join(errors))
    if hint is type(None):
        assert value is None, f"{where}: {value!r} is not None"
    elif typing.is_typeddict(hint):
        assert isinstance(value, dict), where
        _check_typeddict(value, hint, where)
    elif origin is list:
        assert isinstance(value, list), f"{where}: {value!r} is not a list"
        (item,) = typing.get_args(hint)
        for i, v in enumerate(value):
            _check(v, item, f"{where}[{i}]")
    elif origin is dict:
        assert isinstance(value, dict), f"{where}: {value!r} is not a dict"
        _, item = typing.get_args(hint)
        for k, v in value.items():
            _check(v, item, f"{where}[{k!r}]")
    else:
        assert isinstance(hint, type), f"{where}: unexpected hint {hint!r}"
        assert isinstance(value, hint), f"{where}: {value!r} is not {hint.__name__}"
        assert hint is bool or not isinstance(value, bool), f"{where}: {value!r} is a bool"


def _check_typeddict(d: dict[str, object], td: object, where: str) -> None:
    hints = typing.get_type_hints(td)
    required = td.__required_keys__     # type: ignore[attr-defined]
    assert required <= d.keys(), f"{where}: missing {sorted(required - d.keys())}"
    assert d.keys() <= hints.keys(), f"{where}: undeclared {sorted(d.keys() - hints.keys())}"
    for k, v in d.items():
        _check(v, hints[k], f"{where}.{k}")


class StatsClient:
    def __init__(self, id: int, pubs: dict[str, int]) -> None:
        self.id = id
        self.client_id = self.hostname = f"c{id}"
        self.user_agent = "test/1.0"
        self.remote_address = "127.0.0.1:5000"
        self.rdy = 1
        self.in_flight_count = self.message_count = self.finish_count = 0
        self.requeue_count = self.sample_rate = 0
        self.connect_ts = 1_700_000_000
        self.pub_counts = pubs

    @property
    def state(self) -> int:
        return 3


def test_a_whole_document_has_the_declared_shape_and_order() -> None:
    t, ch = make()
    publish(t, 5)
    counts, extras, parts = channel_snapshot(ch, True, "", 0, WALL)
    assert list(counts) == list(typing.get_type_hints(ChannelCounts))
    assert list(extras) == list(typing.get_type_hints(ChannelExtras))
    chan: ChannelStats = {**counts, "e2e_processing_latency": e2e_result([0.5], parts),
                          **extras}
    topic = topic_stats(t, [chan], e2e_result([0.5], parts))
    assert list(topic) == list(typing.get_type_hints(TopicStats))
    producer = client_stats(StatsClient(1, {"t": 3, "b": 1}))
    consumer = client_stats(StatsClient(2, {}))
    assert "pub_counts" in producer and "pub_counts" not in consumer
    # nsqd's order: pub_counts (omitempty) between user_agent and tls
    keys = list(producer)
    assert keys.index("user_agent") < keys.index("pub_counts") < keys.index("tls")
    for memory in (None, {"heap_objects": 1, "gc_total_runs": 2}):
        doc = document("1.3.0", "OK", 1, [topic], memory, [producer], "c", {"tcp": 0})
        _check_typeddict(dict(doc), StatsDocument, "doc")
        if memory is not None:
            assert list(doc).index("memory") == list(doc).index("producers") - 1
    _check_typeddict(dict(consumer), ClientStats, "consumer")
    _check_typeddict(dict(e2e_result([], None)), E2eResult, "e2e")
