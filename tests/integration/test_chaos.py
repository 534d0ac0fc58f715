"""A bounded chaos run against the real server in fsync mode: publishers over TCP (PUB,
MPUB, DPUB) and HTTP, consumers joining and leaving (FINing some, leaving others to time
out), topics and channels created, emptied, paused and deleted at random beside them,
and kill -9 with restarts. Afterwards: every acknowledged message on the topics that
were never deleted or emptied was delivered, the log has no traceback, /ping is OK, RSS
stayed bounded, and clients that did nothing wrong were not disconnected (other than by
the kills). ``PYBROKER_CHAOS_S`` lengthens each phase (default 6 s, two kills)."""
from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable

from tests.support.broker import BrokerProcess, rss_kb, unique_name, wait_until
from tests.support.durability import (
    FinningConsumer,
    HttpPublisher,
    Publisher,
    bodies,
    consume,
    create_channel,
    http,
    ping,
)

MakeBroker = Callable[..., BrokerProcess]
PHASE_S = float(os.environ.get("PYBROKER_CHAOS_S", "6"))
KILLS = 2


class Chaos(threading.Thread):
    """Random lifecycle operations on the side topics (never on the kept ones, whose
    messages are counted), plus pause/unpause and channel churn on the kept ones."""

    def __init__(self, b: BrokerProcess, kept: list[str], seed: int) -> None:
        super().__init__(name="chaos", daemon=True)
        self.b = b
        self.kept = kept
        self.side = [unique_name("side") for _ in range(3)]
        self.rng = random.Random(seed)
        self.stop_event = threading.Event()
        self.bad: list[str] = []
        self.ops = 0

    def run(self) -> None:
        from tests.support.wire import WireClient

        while not self.stop_event.is_set():
            r = self.rng
            side = r.choice(self.side)
            op = r.choice(["pub", "create", "delete", "empty", "pause", "chan", "chan_del",
                           "kept_pause", "kept_chan"])
            try:
                if op == "pub":
                    with WireClient.connect(self.b.tcp_address) as c:  # type: ignore[arg-type]
                        c.mpub(side, [b"side"] * r.randint(1, 50))
                    paths = []
                elif op == "create":
                    paths = [f"/topic/create?topic={side}"]
                elif op == "delete":
                    paths = [f"/topic/delete?topic={side}"]
                elif op == "empty":
                    paths = [f"/topic/empty?topic={side}", f"/channel/empty?topic={side}&channel=c"]
                elif op == "pause":
                    verb = r.choice(["pause", "unpause"])
                    paths = [f"/topic/{verb}?topic={side}", f"/channel/{verb}?topic={side}&channel=c"]
                elif op == "chan":
                    paths = [f"/channel/create?topic={side}&channel=c"]
                elif op == "chan_del":
                    paths = [f"/channel/delete?topic={side}&channel=c"]
                elif op == "kept_pause":
                    t = r.choice(self.kept)
                    paths = [f"/topic/pause?topic={t}", f"/topic/unpause?topic={t}"]
                else:
                    t = r.choice(self.kept)
                    extra = f"x{r.randint(0, 3)}"
                    paths = [f"/channel/create?topic={t}&channel={extra}",
                             f"/channel/delete?topic={t}&channel={extra}"]
                for path in paths:
                    status, text = http(self.b, "POST", path)
                    if status not in (200, 404):
                        self.bad.append(f"{path}: {status} {text[:80]!r}")
                self.ops += 1
            except OSError:
                pass       # the broker is being killed and restarted
            self.stop_event.wait(r.uniform(0.0, 0.03))

    def stop(self) -> None:
        self.stop_event.set()
        self.join(10)


def test_chaos(make_broker: MakeBroker) -> None:
    seed = random.randrange(1 << 30)
    print(f"chaos seed {seed}")
    b = make_broker("--durability=fsync", "--mem-queue-size=100", "--max-bytes-per-file=65536",
                    "--msg-timeout=2s", "--loop-threads=2", "--sync-timeout=200ms")
    kept = [unique_name("kept") for _ in range(2)]
    for t in kept:
        create_channel(b, t, "ch")
    acked: set[bytes] = set()
    seen: set[bytes] = set()
    peak_rss = 0
    for phase in range(KILLS + 1):
        assert b.tcp_address is not None and b.http_address is not None
        pubs: list[Publisher | HttpPublisher] = [
            Publisher(b.tcp_address, kept[i % 2], f"p{phase}-{i}", batch=7,
                      defer_ms=150 if i == 0 else 0) for i in range(3)]
        pubs.append(HttpPublisher(b.http_address, kept[1], f"h{phase}"))
        consumers = [FinningConsumer(b.tcp_address, t, "ch", fin_every=1 + i, rdy_count=30)
                     for i, t in enumerate(kept)]
        chaos = Chaos(b, kept, seed + phase)
        for w in [*pubs, *consumers]:
            w.start()
        chaos.start()
        deadline = time.monotonic() + PHASE_S
        while time.monotonic() < deadline:
            # a consumer that comes and goes: its messages return at once
            c = FinningConsumer(b.tcp_address, random.choice(kept), "ch", rdy_count=5).start()
            time.sleep(0.3)
            c.stop()
            seen |= c.finished
            assert b.proc is not None
            peak_rss = max(peak_rss, rss_kb(b.proc.pid))
        chaos.stop()
        killed = phase < KILLS
        text = b.stderr_text()
        if killed:
            b.kill9()
        for w in [*pubs, *consumers]:
            w.stop()
        assert "Traceback" not in text, text
        assert not chaos.bad, chaos.bad[:5]
        for p in pubs:
            acked |= p.acked
            if not killed:
                assert not p.errors, p.errors
        for c in consumers:
            seen |= set(c.seen)
            if not killed:
                assert not c.errors, c.errors
        print(f"phase {phase}: {sum(len(p.acked) for p in pubs)} acked, {chaos.ops} chaos "
              f"operations, peak RSS {peak_rss // 1024} MiB")
        if killed:
            b.start()
    for t in kept:
        http(b, "POST", f"/topic/unpause?topic={t}")
        seen |= set(bodies(consume(b, t, "ch", idle_s=2.5, timeout_s=120)))
    lost = acked - seen
    assert not lost, f"{len(lost)} acknowledged messages lost, e.g. {sorted(lost)[:5]}"
    wait_until(lambda: ping(b) == (200, "OK"), what="/ping OK at the end")
    assert "Traceback" not in b.stderr_text()
    assert peak_rss < 400 * 1024, f"peak RSS {peak_rss // 1024} MiB"
