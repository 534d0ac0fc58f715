"""TimeoutWheel: ordering, removal, expiry by a given clock (no sleeping)."""
from pybroker.core.timeouts import TimeoutWheel


def test_pop_expired_in_deadline_order_and_ties_in_insertion_order() -> None:
    w: TimeoutWheel[str] = TimeoutWheel()
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
    w: TimeoutWheel[object] = TimeoutWheel()
    item = object()
    h1 = w.add(5, item)
    h2 = w.add(5, item)  # the same item twice: handles stay distinct
    assert w.remove(h1)
    assert not w.remove(h1)
    assert w.pop_expired(5) == [item]
    assert not w.remove(h2)


def test_items_and_clear() -> None:
    w: TimeoutWheel[int] = TimeoutWheel()
    for d in (3, 1, 2):
        w.add(d, d)
    assert w.items() == [1, 2, 3]
    w.clear()
    assert len(w) == 0
