"""The "10,000 messages, each exactly once" harness shared by the client-library tests
(test_pynsq, test_gnsq, test_ansq, test_tls_clients).

A ``Workload`` is what a test publishes: single PUBs, MPUB batches and DPUBs (deferred
10 to 100 ms), every body distinct. The client under test publishes it and consumes it;
``assert_each_once`` then checks that every body arrived and none twice. After the last
body arrived the test stays ``QUIET_S`` longer on the client's own loop (``async_wait``
for asyncio/tornado clients, ``green_wait`` for gevent ones), so that a duplicate
delivery has a chance to show: the one wait here that is for something NOT happening.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

#: after the last expected message: time for a duplicate delivery to show up
QUIET_S = 0.3
#: the longest a whole publish-and-consume run may take
DEADLINE_S = 60.0


@dataclass(frozen=True)
class Workload:
    pubs: list[bytes]
    batches: list[list[bytes]]
    dpubs: list[tuple[int, bytes]]          # (delay in ms, body)

    @property
    def n_commands(self) -> int:
        """Publish commands, each answered once (OK or an error)."""
        return len(self.pubs) + len(self.batches) + len(self.dpubs)

    @property
    def total(self) -> int:
        return len(self.pubs) + sum(map(len, self.batches)) + len(self.dpubs)

    def expected(self) -> set[bytes]:
        out = set(self.pubs) | {b for batch in self.batches for b in batch}
        out |= {b for _, b in self.dpubs}
        assert len(out) == self.total, "bodies must be distinct"
        return out


def workload(n_pub: int = 4000, n_batches: int = 50, batch: int = 100, n_dpub: int = 1000,
             pad: bool = False) -> Workload:
    """10,000 messages by default: 4,000 PUB, 50 MPUB of 100, 1,000 DPUB.

    ``pad`` gives PUB bodies lengths up to 300 bytes more (compression and TLS records of
    varied sizes)."""
    pubs = [b"pub-%d" % i + (b"-" + b"z" * (i % 300) if pad else b"") for i in range(n_pub)]
    batches = [[b"mpub-%d-%d" % (b, i) for i in range(batch)] for b in range(n_batches)]
    dpubs = [(10 + (i % 10) * 10, b"dpub-%d" % i) for i in range(n_dpub)]
    return Workload(pubs, batches, dpubs)


def assert_each_once(received: Counter[bytes], expected: set[bytes]) -> None:
    """Every expected body received, nothing else, and none more than once."""
    missing = expected - set(received)
    extra = set(received) - expected
    assert not missing and not extra, (f"{len(missing)} missing, e.g. {sorted(missing)[:5]}; "
                                       f"{len(extra)} unexpected, e.g. {sorted(extra)[:5]}")
    dups = {body: n for body, n in received.items() if n != 1}
    assert not dups, f"delivered more than once: {list(dups.items())[:5]}"


async def async_wait(pred: Callable[[], object], what: str, timeout_s: float = 10.0) -> None:
    """wait_until for a test running on an asyncio loop (the clients' callbacks run)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not pred():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.01)


def green_wait(pred: Callable[[], object], what: str, timeout_s: float = 10.0) -> None:
    """wait_until for gevent clients (gnsq, not monkey-patched): gevent.sleep lets their
    greenlets run."""
    import gevent

    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        gevent.sleep(0.01)
