"""Leader election over a Lease, against an in-memory Lease store with the API server's
optimistic concurrency (resourceVersion conflicts answer 409)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from atom_operator.kube import ApiError, NotLeading
from atom_operator.leader import LeaderElector


class LeaseApi:
    """The three calls the elector makes, as the API server answers them."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.down = False

    def path(self, kind: str, namespace: str, name: str | None = None) -> str:
        return f"/{kind}/{namespace}/{name or ''}"

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        if self.down:
            raise ConnectionError("api down")
        return copy.deepcopy(self.lease)

    def request(self, method: str, path: str, *, body: dict[str, Any]) -> dict[str, Any]:
        if self.down:
            raise ConnectionError("api down")
        if method == "POST" and self.lease is not None:
            raise ApiError(409, '{"message": "exists"}')
        if method == "PUT" and body["metadata"].get("resourceVersion") != str(self.version):
            raise ApiError(409, '{"message": "conflict"}')
        self.version += 1
        self.lease = copy.deepcopy(body)
        self.lease["metadata"]["resourceVersion"] = str(self.version)
        return self.lease


def electors(api: LeaseApi, now: list[float], *names: str) -> list[LeaderElector]:
    return [
        LeaderElector(
            api,  # type: ignore[arg-type]
            namespace="ns",
            name="atom-operator",
            identity=n,
            lease_s=15,
            renew_deadline_s=10,
            clock=lambda: now[0],
        )
        for n in names
    ]


def test_one_of_two_leads_and_the_other_takes_over_after_the_lease() -> None:
    api, now = LeaseApi(), [0.0]
    a, b = electors(api, now, "a", "b")
    elected: list[str] = []
    a.on_elected, b.on_elected = (lambda: elected.append("a")), (lambda: elected.append("b"))
    for _ in range(5):
        a.step(), b.step()
        now[0] += 2
    assert a.leading and not b.leading and elected == ["a"]
    # a dies (stops renewing): b waits one lease duration by its own clock, then leads
    t_dead = now[0]
    while not b.leading:
        b.step()
        now[0] += 2
        assert now[0] - t_dead <= 15 + 2 * 2
    assert elected == ["a", "b"] and api.lease["spec"]["holderIdentity"] == "b"
    assert api.lease["spec"]["leaseTransitions"] == 1


def test_restart_with_the_same_identity_takes_its_lease_back_at_once() -> None:
    api, now = LeaseApi(), [0.0]
    (first,) = electors(api, now, "pod-0")
    first.step()
    (again,) = electors(api, now, "pod-0")  # the container restarted, same pod name
    again.step()
    assert again.leading


def test_release_hands_over_at_once() -> None:
    api, now = LeaseApi(), [0.0]
    a, b = electors(api, now, "a", "b")
    a.step(), b.step()
    a.release()
    assert not a.leading
    b.step()
    assert b.leading


def test_a_leader_that_cannot_renew_stands_down_before_the_lease_ends() -> None:
    api, now = LeaseApi(), [0.0]
    (a,) = electors(api, now, "a")
    a.step()
    api.down = True
    now[0] += 9
    a.step()
    assert a.leading  # within the renew deadline
    now[0] += 2
    a.step()
    assert not a.leading  # 11 s > 10 s deadline, and < 15 s lease: nobody else leads yet


# --- fencing (issue 49) -----------------------------------------------------------------------


def test_leading_lapses_with_time_alone_as_in_a_frozen_process() -> None:
    """A SIGSTOP freezes the election thread too: nothing clears a flag, yet the leader stops
    leading once its last renewal began a renew deadline ago."""
    api, now = LeaseApi(), [0.0]
    (a,) = electors(api, now, "a")
    a.step()
    fence = a.fence()
    fence.check()
    now[0] += 10  # no step ran: the process was frozen
    assert not a.leading
    with pytest.raises(NotLeading):
        fence.check()


def test_a_fence_stays_closed_after_the_replica_is_elected_again() -> None:
    api, now = LeaseApi(), [0.0]
    a, b = electors(api, now, "a", "b")
    a.step(), b.step()
    in_flight = a.fence()  # a reconcile began in a's first term
    now[0] += 60  # a froze; b took over meanwhile
    b.step()
    assert b.leading
    a.step()  # a wakes and sees b's record
    assert not a.leading
    now[0] += 16  # b goes away for good
    a.step()  # b's record stood still for a lease duration: a leads again, a new term
    assert a.leading
    with pytest.raises(NotLeading):
        in_flight.check()
    a.fence().check()


def test_the_leader_stands_down_at_once_when_the_lease_names_another_holder() -> None:
    api, now = LeaseApi(), [0.0]
    a, b = electors(api, now, "a", "b")
    a.step()
    assert api.lease is not None
    api.lease["spec"]["holderIdentity"] = "b"  # another replica (or a person) took it
    api.version += 1
    api.lease["metadata"]["resourceVersion"] = str(api.version)
    now[0] += 2
    a.step()
    assert not a.leading  # at once, not at the renew deadline


def test_a_renewal_refused_by_a_conflict_stands_down_at_once() -> None:
    api, now = LeaseApi(), [0.0]
    (a,) = electors(api, now, "a")
    a.step()
    real = api.request

    def conflicting(method: str, path: str, *, body: dict[str, Any]) -> dict[str, Any]:
        raise ApiError(409, '{"message": "conflict"}')

    api.request = conflicting  # type: ignore[method-assign]
    now[0] += 2
    a.step()
    assert not a.leading
    api.request = real  # type: ignore[method-assign]


def test_a_deleted_lease_never_makes_two_leaders() -> None:
    api, now = LeaseApi(), [0.0]
    a, b = electors(api, now, "a", "b")
    a.step(), b.step()
    assert a.leading and not b.leading
    api.lease = None  # kubectl delete lease
    took_over = None
    for tick in range(40):  # 0.5 s steps, in either order
        order = (a, b) if tick % 2 else (b, a)
        for e in order:
            e.step()
            assert not (a.leading and b.leading), f"two leaders at {now[0]}"
        if took_over is None and (a.leading or b.leading):
            took_over = now[0]
        now[0] += 0.5
    assert not a.leading or not b.leading
    assert took_over is not None and took_over <= 15 + 1  # one lease duration, no more
    assert api.lease is not None and api.lease["spec"]["holderIdentity"] in ("a", "b")


def test_the_renew_deadline_must_end_before_the_lease() -> None:
    with pytest.raises(ValueError):
        LeaderElector(
            LeaseApi(), namespace="n", name="l", identity="a", lease_s=5, renew_deadline_s=5
        )  # type: ignore[arg-type]
