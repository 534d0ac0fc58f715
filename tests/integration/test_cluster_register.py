"""A node's registration in etcd (pybroker.cluster.coordinator.register_node), against a
real etcd, with the race that once let a leader back with an empty disk be elected:
its previous run's registration expiring between the failed transaction and the read
that names its holder. Such a join used to count itself joined at revision 0, so every
copy looked made after it joined and was vouched for."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from pybroker.cluster.etcd import Compare, Etcd, EtcdError
from pybroker.cluster.coordinator import ROOT, register_node
from pybroker.cluster.ports import JsonObj
from tests.support.etcd import EtcdProcess

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def etcd_url() -> Iterator[str]:
    e = EtcdProcess().start()
    try:
        yield e.url
    finally:
        e.stop()
        e.cleanup()


class ExpiresDuringJoin(Etcd):
    """The holder's lease ends right after the joiner's first transaction failed (as
    its expiry would, at that moment)."""

    def __init__(self, url: str, holder: int) -> None:
        super().__init__(url)
        self.holder = holder
        self.txns = 0

    def txn(self, compare: list[Compare], success: list[JsonObj],
            failure: list[JsonObj] | None = None) -> bool:
        ok = super().txn(compare, success, failure)
        self.txns += 1
        if self.txns == 1 and not ok:
            self.revoke(self.holder)
        return ok


def _held(url: str, node: int) -> int:
    e = Etcd(url)
    holder = e.grant(30)
    e.put(f"{ROOT}nodes/{node}", '{"run": "previous"}', holder)
    return holder


def test_a_registration_that_expires_during_the_join_is_taken_over(etcd_url: str) -> None:
    holder = _held(etcd_url, 41)
    etcd = ExpiresDuringJoin(etcd_url, holder)
    lease = etcd.grant(30)
    created = register_node(etcd, 41, '{"run": "this"}', lease)
    kv = etcd.get(f"{ROOT}nodes/41")
    assert kv is not None and kv.lease == lease and kv.value == '{"run": "this"}'
    assert created == kv.create_revision > 0
    assert etcd.txns == 2                       # tried again, not taken as joined


def test_a_registration_held_by_another_run_is_waited_for(etcd_url: str) -> None:
    holder = _held(etcd_url, 42)
    etcd = Etcd(etcd_url)
    lease = etcd.grant(30)
    with pytest.raises(EtcdError, match="registered by another process"):
        register_node(etcd, 42, '{"run": "this"}', lease)
    kv = etcd.get(f"{ROOT}nodes/42")
    assert kv is not None and kv.lease == holder
    assert etcd.keepalive(lease) == 0           # the joiner's new lease was revoked


def test_a_first_registration(etcd_url: str) -> None:
    etcd = Etcd(etcd_url)
    lease = etcd.grant(30)
    created = register_node(etcd, 43, "{}", lease)
    kv = etcd.get(f"{ROOT}nodes/43")
    assert kv is not None and kv.lease == lease and created == kv.create_revision
    # its own registration found again (a second join on the same lease) holds
    assert register_node(etcd, 43, "{}", lease) == created
