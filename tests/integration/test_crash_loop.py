"""kill -9 during concurrent publishing, in both durability modes, again and again.

Several publisher threads (raw sockets with PUB/MPUB/DPUB, and HTTP /pub and /mpub; one
command outstanding each)
record which bodies were answered OK; a consumer FINs every other delivery and leaves
the rest in flight. Each cycle ends with SIGKILL and a restart on the same data_path.
After the last restart everything is drained. The promise of both modes against a
crash of the process (fsync mode: also of the machine): every acknowledged message is
delivered, and every one that was never FIN'd is delivered again (at least once);
duplicates are allowed and counted.
"""
from __future__ import annotations

import json
import time

import pytest
from pathlib import Path
from collections.abc import Callable

from pybroker.storage.statejournal import load as load_state
from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.durability import (
    FinningConsumer,
    HttpPublisher,
    Publisher,
    bodies,
    channel_stats,
    consume,
    create_channel,
)
from tests.support.wire import WireClient

MakeBroker = Callable[..., BrokerProcess]
CYCLES = 5
RUN_S = 2.0


def _all_acked_some(pubs: list[Publisher | HttpPublisher]) -> Callable[[], bool]:
    return lambda: all(len(p.acked) >= 20 for p in pubs)


@pytest.mark.parametrize("mode", ["fsync", "memory"])
def test_kill9_loop_loses_no_acknowledged_message(make_broker: MakeBroker, mode: str) -> None:
    b = make_broker(f"--durability={mode}", "--mem-queue-size=50",
                    "--max-bytes-per-file=65536")
    with_ch, no_ch = unique_name("crash"), unique_name("crash_noch")
    create_channel(b, with_ch, "ch")
    acked: set[bytes] = set()
    seen: dict[bytes, int] = {}
    finished: set[bytes] = set()
    for cycle in range(CYCLES):
        assert b.tcp_address is not None
        consumer = FinningConsumer(b.tcp_address, with_ch, "ch", fin_every=2,
                                   rdy_count=1000).start()
        pubs: list[Publisher | HttpPublisher] = [Publisher(b.tcp_address, with_ch, f"c{cycle}p{i}", batch=5,
                          defer_ms=300 if i == 0 else 0) for i in range(3)]
        pubs.append(Publisher(b.tcp_address, no_ch, f"c{cycle}n", batch=5))
        assert b.http_address is not None
        pubs.append(HttpPublisher(b.http_address, with_ch, f"c{cycle}h"))
        for p in pubs:
            p.start()
        t0 = time.monotonic()
        wait_until(_all_acked_some(pubs), timeout_s=10, what="every publisher to get OKs")
        time.sleep(max(0.0, RUN_S - (time.monotonic() - t0)))
        text = b.stderr_text()
        b.kill9()
        for p in pubs:
            p.stop()
        consumer.stop()
        assert "Traceback" not in text, text
        for p in pubs:
            acked |= p.acked
        for body, n in consumer.seen.items():
            seen[body] = seen.get(body, 0) + n
        finished |= consumer.finished
        print(f"cycle {cycle}: {sum(len(p.acked) for p in pubs)} acked, "
              f"{sum(p.sent for p in pubs)} sent, {sum(consumer.seen.values())} delivered, "
              f"{len(consumer.finished)} FIN'd")
        b.start()
        for line in b.stderr_lines:
            if "DISKQUEUE" in line or "storage" in line or "metadata" in line:
                print("   ", line.rstrip())

    drained = consume(b, with_ch, "ch", idle_s=2.0, timeout_s=40)
    drained += consume(b, no_ch, "late", idle_s=2.0, timeout_s=40)
    for body in bodies(drained):
        seen[body] = seen.get(body, 0) + 1
    finished |= set(bodies(drained))

    never_delivered = acked - seen.keys()
    never_finished = acked - finished
    deliveries = sum(seen.values())
    dup = deliveries - len(seen)
    unacked_seen = len(seen.keys() - acked)
    print(f"acked {len(acked)}, delivered {len(seen)} distinct in {deliveries} "
          f"deliveries ({dup} duplicates), {unacked_seen} delivered without an OK "
          f"(publish cut by the kill), {len(drained)} in the final drain")
    assert not never_delivered, f"{len(never_delivered)} acknowledged messages never " \
                                f"delivered, e.g. {sorted(never_delivered)[:10]}"
    assert not never_finished, f"{len(never_finished)} acknowledged messages delivered " \
                               f"but never FIN'd and not redelivered, e.g. " \
                               f"{sorted(never_finished)[:10]}"
    # the broker is healthy and empty afterwards
    assert consume(b, with_ch, "ch", idle_s=0.5) == []


def _saved_due(b: BrokerProcess, topic: str, offset: int) -> int:
    """The due time the broker saved for a pending offset of topic's channel "ch"."""
    path = Path(b.data_path) / "state" / f"{topic}.json"
    try:
        # the file and the changes in its journal, as the broker reads them back
        state = json.loads(load_state(str(path)) or b"{}")
    except (OSError, ValueError):
        return 0
    for off, _, due in state.get("channels", {}).get("ch", {}).get("pending", []):
        if off == offset:
            return int(due)
    return 0


def test_kill9_keeps_deferred_time_in_fsync_mode(make_broker: MakeBroker) -> None:
    """A DPUB answered OK in fsync mode has its due time on disk: after kill -9 it is
    delivered, and not before that time. A message REQ'd with a delay keeps its due time
    once the channel's state is saved (at once in fsync mode)."""
    b = make_broker("--durability=fsync", "--msg-timeout=60s")
    topic = unique_name("k9defer")
    create_channel(b, topic, "ch")
    delay_ms = 3000
    with WireClient.connect(b.tcp_address) as p:  # type: ignore[arg-type]
        p.mpub(topic, [b"now-1", b"now-2"])
        t_dpub = time.time()
        for i in range(3):
            p.dpub(topic, delay_ms, f"later-{i}".encode())
    c = WireClient.connect(b.tcp_address)  # type: ignore[arg-type]
    c.sub(topic, "ch")
    c.rdy(2)
    got = c.read_messages(2)
    c.rdy(0)
    t_req = time.time()
    c.req(got[0].id, delay_ms)
    wait_until(lambda: (channel_stats(b, topic, "ch") or {}).get("deferred_count") == 4)
    # a REQ's due time is saved with the channel's state, at once in fsync mode
    wait_until(lambda: _saved_due(b, topic, int(got[0].id, 16)) > 0,
               what="the REQ's due time saved")
    b.kill9()
    c.close()
    b.start()
    received = consume(b, topic, "ch", idle_s=delay_ms / 1000 + 1.5, timeout_s=20)
    seen = bodies(received)
    assert set(seen) == {b"now-1", b"now-2", b"later-0", b"later-1", b"later-2"}, seen
    for r in received:
        if r.msg.body.startswith(b"later-"):
            assert r.at_wall >= t_dpub + delay_ms / 1000 - 0.05, \
                f"{r.msg.body!r} {t_dpub + delay_ms / 1000 - r.at_wall:.2f}s early"
    req_times = [r.at_wall - (t_req + delay_ms / 1000) for r in received
                 if r.msg.body == got[0].body]
    print(f"REQ'd message delivered at {[f'{t:+.2f}s' for t in req_times]} from its due time")
    assert req_times and max(req_times) >= -0.05
