"""Leader election over a Lease, against an in-memory Lease store with the API server's
optimistic concurrency (resourceVersion conflicts answer 409)."""

from __future__ import annotations

import copy
from typing import Any

from atom_operator.kube import ApiError
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
