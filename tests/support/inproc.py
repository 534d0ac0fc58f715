"""A real Runtime in the test's own process, its loops not started: the test thread runs
their turns (``loop.run_once``). For tests that watch a loop's state between turns."""
from __future__ import annotations

from pathlib import Path

from pybroker.config import resolve
from pybroker.server.runtime import Runtime


def runtime(tmp: Path, **options: str) -> Runtime:
    """A Runtime on data path ``tmp`` with these options (nsqd's key names), its
    storage prepared."""
    rt = Runtime(resolve({}, {"data_path": str(tmp), **options}))
    rt.storage.prepare()
    return rt


def close_runtime(rt: Runtime) -> None:
    """Close what ``runtime`` opened: the topics' logs, the data path's lock, the loops
    (and their sender threads)."""
    for t in rt.broker.all_topics():
        t.log.close()
    rt.storage.lock.release()
    for loop in rt.loops:
        loop.close()
