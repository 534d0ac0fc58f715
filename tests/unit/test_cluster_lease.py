"""LeaseKeeper (pybroker.cluster.lease): one renewal at a time, driven by hand
(``renew_once``) against a scripted etcd; the real etcd is in test_replication.py."""
from __future__ import annotations

from collections.abc import Callable

from pybroker.cluster.etcd import Etcd, EtcdError
from pybroker.cluster.lease import LeaseKeeper
from pybroker.cluster.rules import LeaseClock
from pybroker.testing import wait_until

EVERY = 1_000_000_000


class ScriptedEtcd(Etcd):
    """Answers keepalive from a script: a TTL, or an exception to raise; ``during``
    runs inside the call (as if the coordinator acted meanwhile)."""

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:1")
        self.script: list[int | Exception] = []
        self.asked: list[int] = []
        self.during: Callable[[], None] | None = None

    def keepalive(self, lease: int) -> int:
        self.asked.append(lease)
        if self.during is not None:
            self.during()
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step


def _keeper() -> tuple[LeaseKeeper, ScriptedEtcd, LeaseClock, list[tuple[str, object]]]:
    etcd = ScriptedEtcd()
    clock = LeaseClock(3 * EVERY, margin_ns=0)
    told: list[tuple[str, object]] = []

    def post(fn: Callable[..., None], *args: object) -> None:
        fn(*args)

    k = LeaseKeeper(etcd, EVERY, clock, post,
                    lambda why: told.append(("failed", why)),
                    lambda: told.append(("ok", None)),
                    lambda lease: told.append(("expired", lease)))
    return k, etcd, clock, told


def test_renewals_move_the_clock_and_failures_are_told() -> None:
    k, etcd, clock, told = _keeper()
    assert k.renew_once() == EVERY // 2 and not etcd.asked     # no session yet
    k.begin(7, 100)
    assert clock.valid_until == 100 + 3 * EVERY
    etcd.script = [3, EtcdError("etcd 127.0.0.1:1/lease/keepalive: timed out"), 0]
    assert k.renew_once() == EVERY
    assert clock.valid_until > 100 + 3 * EVERY and k.renewals == 1
    until = clock.valid_until
    assert k.renew_once() == EVERY // 2            # failed: sooner, clock unmoved
    assert clock.valid_until == until
    assert k.renew_once() == EVERY // 2            # expired: told, clock unmoved
    assert clock.valid_until == until
    assert told == [("ok", None), ("failed", "lease renewal failed: etcd "
                                   "127.0.0.1:1/lease/keepalive: timed out"),
                    ("ok", None), ("expired", 7)]
    assert etcd.asked == [7, 7, 7]


def test_a_late_answer_for_a_replaced_lease_does_not_extend_the_new_one() -> None:
    """The coordinator begins a new session while a renewal of the old lease is on
    its way: that answer must not move the clock the new lease is counted on."""
    k, etcd, clock, told = _keeper()
    k.begin(7, 100)
    etcd.script = [3]
    etcd.during = lambda: k.begin(8, 200)
    k.renew_once()
    assert clock.valid_until == 200 + 3 * EVERY and k.renewals == 0
    etcd.during = None
    etcd.script = [3]
    k.renew_once()
    assert etcd.asked == [7, 8] and k.renewals == 1


def test_the_thread_renews_until_stopped() -> None:
    k, etcd, clock, told = _keeper()
    k.every_ns = 10_000_000
    etcd.script = [3] * 1000
    k.begin(5, 0)
    k.start()
    try:
        wait_until(lambda: k.renewals >= 3, 5, 0.01, what="three renewals")
    finally:
        k.stop()
    assert k.thread is not None and not k.thread.is_alive()
