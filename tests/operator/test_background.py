"""The child-event requeue coalesces bursts into one reconcile per owner."""

from __future__ import annotations

import threading

from atom_operator.background import Requeue


def test_burst_of_events_collapses_to_one_key_per_owner() -> None:
    q = Requeue()
    for _ in range(50):
        q.add("ns", "a")
    q.add("ns", "b")
    q.add("other", "a")
    assert q.wait(0) is True
    assert q.drain() == {("ns", "a"), ("ns", "b"), ("other", "a")}
    assert q.drain() == set() and q.wait(0) is False


def test_add_from_another_thread_wakes_the_worker() -> None:
    q = Requeue()
    threading.Timer(0.05, q.add, args=("ns", "x")).start()
    assert q.wait(5) is True
    assert q.drain() == {("ns", "x")}


def test_later_keys_join_when_due_and_retry_backs_off() -> None:
    from atom_operator.reconciler import retry_delay

    now = [100.0]
    q = Requeue(clock=lambda: now[0])
    q.later("ns", "a", 2.0)
    assert q.drain() == set()
    now[0] = 102.5
    assert q.wait(0) is True and q.drain() == {("ns", "a")}
    assert [retry_delay(n) for n in range(7)] == [None, 1, 2, 4, 8, 16, 16]
