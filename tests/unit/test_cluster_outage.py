"""Outage (pybroker.cluster.outage): an outside service that keeps failing is logged
in a bounded number of lines, driven here by a fake clock."""
from __future__ import annotations

import logging

from hypothesis import given, strategies as st

from pybroker.cluster.outage import SUMMARY_NS, Outage

S = 1_000_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 5 * S

    def __call__(self) -> int:
        return self.now


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _outage() -> tuple[Outage, Clock, Lines]:
    log = logging.getLogger(f"test-outage-{id(object())}")
    log.propagate = False
    lines = Lines()
    log.addHandler(lines)
    clock = Clock()
    return Outage("etcd", log, clock), clock, lines


def test_an_outage_costs_a_line_a_summary_per_30_s_and_a_line_at_its_end() -> None:
    o, clock, lines = _outage()
    o.ok()                                   # nothing failed: nothing to say
    assert not lines.records and not o.failing
    for _ in range(150):                     # 200 ms apart for 30 s, as the poll is
        o.failed("etcd 127.0.0.1:2379/kv/range: [Errno 111] Connection refused")
        clock.now += S // 5
    assert [r.levelno for r in lines.records] == [logging.ERROR]
    assert "Connection refused (retrying" in lines.records[0].getMessage()
    o.failed("etcd 127.0.0.1:2379/kv/range: timed out")     # 30 s after the first
    assert len(lines.records) == 2
    assert lines.records[1].getMessage() == (
        "CLUSTER: etcd: still failing: 151 failed calls in 30 s; the last: "
        "etcd 127.0.0.1:2379/kv/range: timed out")
    clock.now += 2 * S
    o.ok()
    assert lines.records[2].levelno == logging.WARNING
    assert lines.records[2].getMessage() == \
        "CLUSTER: etcd: working again after 32.0 s (151 failed calls)"
    assert not o.failing and o.total == 151
    o.ok()
    o.failed("again")                        # a new outage is reported whole again
    assert len(lines.records) == 4 and "again (retrying" in lines.records[3].getMessage()
    assert o.total == 152


@given(st.lists(st.tuples(st.integers(0, 20 * S), st.booleans()), max_size=300))
def test_lines_are_bounded_by_outages_and_their_length(
        events: list[tuple[int, bool]]) -> None:
    """Whatever the calls and their timing: at most one line at an outage's start, one
    at its end, and one per SUMMARY_NS of its length in between."""
    o, clock, lines = _outage()
    bound = 0
    began = None
    for dt, ok in events:
        clock.now += dt
        if ok:
            if began is not None:
                bound += 2 + (clock.now - began) // SUMMARY_NS
                began = None
            o.ok()
        else:
            if began is None:
                began = clock.now
            o.failed("x")
    if began is not None:
        bound += 1 + (clock.now - began) // SUMMARY_NS
    assert len(lines.records) <= bound
    assert o.total == sum(1 for _, ok in events if not ok)
