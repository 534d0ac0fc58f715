"""The bench's records, typed: what a load process reports, a scenario's flat figures,
the summary of a run and the whole JSON-ready result, plus the start signals a load
process waits on.

A load process (bench.workers) puts one ``WorkerResult``; a scenario (bench.scenarios)
turns its processes' results into ``Figures`` (flat ``name -> number``, plus the
latency samples); the runner (bench.runner) adds the broker, scenario and run to each
record and summarizes the records into medians and ratios; the report reads all of it.
"""
from __future__ import annotations

from typing import Protocol, TypedDict, Union

# a figure: a count, a rate, a flag, a name, a percentile that may be missing (None), or
# the latency samples (seconds since the start, milliseconds)
Figure = Union[None, bool, int, float, str, list[tuple[float, float]]]
Figures = dict[str, Figure]
# per scenario, per broker (and "ratio": pybroker/nsqd), the median of each figure
Summary = dict[str, dict[str, dict[str, float | None]]]


class WorkerResult(TypedDict, total=False):
    """One load process's report (keys by kind: every one has ``idx`` and ``count``,
    or ``error``)."""

    idx: int
    error: str
    count: int
    elapsed_s: float
    # publisher: MPUB round trips and their percentiles
    requests: int
    req_ms: dict[str, float]
    # consumer: the common start, the first and last receipt (monotonic seconds)
    start: float
    first: float
    last: float
    # latency consumer: publish-to-receipt percentiles, how many, and samples
    latency_ms: dict[str, float]
    measured: int
    samples: list[tuple[float, float]]
    # paced publisher: messages answered OK
    acked: int


class MachineInfo(TypedDict):
    cpu: str
    cores: int | None
    memory_bytes: int
    kernel: str
    python: str
    platform: str
    pybroker_commit: str
    loadavg_at_start: tuple[float, float, float]


class BenchResult(TypedDict):
    """What run_bench returns and the report and JSON file show."""

    machine: MachineInfo
    config: dict[str, int | float | bool]      # BenchConfig's fields
    runs: int
    scenarios: list[str]
    brokers: dict[str, dict[str, str]]         # name -> description (and nsqd's path)
    records: list[Figures]
    summary: Summary


# the start signals a load process gets (multiprocessing's Queue, Event and Value)
class Ready(Protocol):
    def put(self, obj: int) -> None: ...


class Go(Protocol):
    def wait(self, timeout: float | None = None) -> bool: ...


class StartAt(Protocol):
    value: float


class Results(Protocol):
    def put(self, obj: WorkerResult) -> None: ...


def number(v: Figure) -> float | None:
    """A numeric figure as a number; None for a missing one (and for any other kind)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v
    return None
