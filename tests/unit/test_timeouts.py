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


def test_add_all_is_add_for_each_with_one_deadline() -> None:
    w: TimeoutWheel[str] = TimeoutWheel(resolution_ns=10)
    w.add(15, "before")
    handles = w.add_all(15, ["x", "y", "z"])
    w.add(15, "after")
    w.add(5, "early")
    assert len(w) == 6 and len(set(handles)) == 3
    assert all(w.deadline_of(h) == 20 for h in handles)
    assert w.remove(handles[1])
    assert not w.remove(handles[1])
    assert w.add_all(40, []) == [] and len(w) == 5 and w.next_deadline() == 10
    assert w.pop_expired(20) == ["early", "before", "x", "z", "after"]
    assert len(w) == 0


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


def test_pop_expired_with_a_limit_leaves_the_rest_due_in_order() -> None:
    w: TimeoutWheel[int] = TimeoutWheel(resolution_ns=10)
    handles = [w.add(5 if i < 6 else 25, i) for i in range(10)]   # two buckets
    assert w.pop_expired(100, limit=4) == [0, 1, 2, 3]
    assert len(w) == 6
    assert w.remove(handles[5])            # a handle into a half-taken bucket still works
    assert not w.remove(handles[2])        # one already taken does not
    assert w.pop_expired(100, limit=2) == [4, 6]
    assert w.pop_expired(100) == [7, 8, 9]
    assert len(w) == 0 and w.pop_expired(100) == []


def test_heap_timers_pop_with_a_limit() -> None:
    from pybroker.evloop import HeapTimers

    h = HeapTimers()
    for i in range(5):
        h.add(i, (print, (i,)))
    assert [a for _, a in h.pop_expired(10, limit=3)] == [(0,), (1,), (2,)]
    assert h.next_deadline() == 3
    assert [a for _, a in h.pop_expired(10)] == [(3,), (4,)]
