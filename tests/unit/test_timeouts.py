"""TimeoutWheel: ordering, removal, expiry by a given clock (no sleeping)."""
from pybroker.core.timeouts import TimeoutWheel


def test_pop_expired_in_deadline_order_and_ties_in_insertion_order() -> None:
    w: TimeoutWheel[str] = TimeoutWheel(resolution_ns=1)
    w.add(30, "c")
    w.add(10, "a")
    w.add(10, "a2")
    w.add(20, "b")
    assert w.next_deadline() == 10
    assert w.pop_expired(9) == []
    assert w.pop_expired(20) == ["a", "a2", "b"]
    assert len(w) == 1 and w.next_deadline() == 30
    assert w.pop_expired(10**18) == ["c"]
    assert w.next_deadline() is None


def test_remove_by_handle() -> None:
    w: TimeoutWheel[object] = TimeoutWheel(resolution_ns=1)
    item = object()
    h1 = w.add(5, item)
    h2 = w.add(5, item)  # the same item twice: handles stay distinct
    assert w.remove(h1)
    assert not w.remove(h1)
    assert w.pop_expired(5) == [item]
    assert not w.remove(h2)


def test_items_and_clear() -> None:
    w: TimeoutWheel[int] = TimeoutWheel(resolution_ns=1)
    for d in (3, 1, 2):
        w.add(d, d)
    assert w.items() == [1, 2, 3]
    w.clear()
    assert len(w) == 0


def test_deadlines_round_up_to_the_resolution_never_early() -> None:
    w: TimeoutWheel[str] = TimeoutWheel(resolution_ns=1000)
    w.add(1001, "x")
    w.add(2000, "y")
    assert w.pop_expired(1999) == []
    assert w.pop_expired(2000) == ["x", "y"]
    assert len(w) == 0


def test_removed_items_do_not_fire_and_len_tracks() -> None:
    w: TimeoutWheel[int] = TimeoutWheel()
    handles = [w.add(5_000_000, i) for i in range(100)]
    for h in handles[::2]:
        assert w.remove(h)
    assert len(w) == 50
    assert w.pop_expired(5_000_000) == list(range(1, 100, 2))
    assert len(w) == 0 and w.pop_expired(10**12) == []
