"""StorageManager's health bookkeeping when several loops report writes at once: a loop
whose write worked may not clear the "failed to write" health that another loop has
just set for another topic (both change under StorageManager._lock)."""
from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pybroker.config import resolve
from pybroker.server.storage import StorageManager


class _Host:
    """The runtime's side of the bookkeeping: health, read and written by the storage
    manager. Reading it while a write is being reported lets another loop's failure
    race in (the interleaving that lost the failure), then waits to see whether that
    failure could complete meanwhile."""

    def __init__(self, tmp: Path) -> None:
        self.options = resolve({}, {"data_path": str(tmp)})
        self.broker: Any = None
        self.loops: list[Any] = []
        self._health: str | None = None
        self.on_read: Any = None

    @property
    def health(self) -> str | None:
        hook, self.on_read = self.on_read, None
        if hook is not None:
            hook()
        return self._health

    @health.setter
    def health(self, value: str | None) -> None:
        self._health = value


def test_a_working_write_does_not_clear_another_topics_failure(tmp_path: Path) -> None:
    host = _Host(tmp_path)
    sm = StorageManager(host)  # type: ignore[arg-type]
    a, b = SimpleNamespace(name="a"), SimpleNamespace(name="b")
    sm.failed(OSError("disk full"), a)          # topic a failed earlier ...
    other = threading.Thread(target=sm.failed, args=(OSError("disk full"), b))

    def race() -> None:                          # ... b fails while a's write_ok runs
        other.start()
        other.join(0.3)

    host.on_read = race
    sm.write_ok(a)                               # type: ignore[arg-type]
    other.join(5)
    assert host.health is not None and host.health.startswith("failed to write"), \
        "topic b's failure was cleared by topic a's working write"
    sm.write_ok(b)                               # type: ignore[arg-type]
    assert host.health is None
