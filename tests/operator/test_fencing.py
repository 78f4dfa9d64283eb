"""Fenced writes (issue 49): the Kube write path checks the leader term's fence before every
write, status never moves observedGeneration backwards, and a reconcile that finds itself no
longer leading is abandoned with a log line and writes nothing more."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import pytest
from test_reconciler import SPEC, FakeKube

from atom_operator.kube import Kube, NotLeading, StaleStatus
from atom_operator.reconciler import Reconciler
from atom_operator.settings import Settings

LOG = logging.getLogger("test")


@dataclass
class _Response:
    status: int
    text: str

    def read(self) -> bytes:
        return self.text.encode()


@dataclass
class FakeApi:
    """The two calls `Kube.request` makes of a kubernetes ApiClient, answered from `answers`
    (method -> list of (status, body)); every call is recorded."""

    answers: dict[str, list[tuple[int, dict[str, Any]]]] = field(default_factory=dict)
    calls: list[tuple[str, str, Any]] = field(default_factory=list)

    def param_serialize(self, method: str, path: str, **kw: Any) -> tuple[Any, ...]:
        return method, path, kw["header_params"], kw["body"], None

    def call_api(self, method: str, url: str, **kw: Any) -> _Response:
        self.calls.append((method, url, json.loads(json.dumps(kw["body"]))))  # as sent
        status, body = self.answers[method].pop(0)
        return _Response(status, json.dumps(body))


class Closed:
    def check(self) -> None:
        raise NotLeading("no longer leads")


def stored(generation: int, rv: str = "7") -> dict[str, Any]:
    return {"metadata": {"resourceVersion": rv}, "status": {"observedGeneration": generation}}


def test_every_write_checks_the_fence_and_reads_do_not() -> None:
    api = FakeApi({"GET": [(200, {"items": []})]})
    kube = Kube(api).fenced(Closed())  # type: ignore[arg-type]
    assert kube.list("Deployment", "ns", "") == []
    obj = {"kind": "Service", "metadata": {"name": "s", "namespace": "ns"}}
    for write in (
        lambda: kube.apply(obj),
        lambda: kube.delete("Deployment", "ns", "d"),
        lambda: kube.create(obj),
        lambda: kube.post_event({"name": "x", "namespace": "ns"}, "Normal", "R", "m"),
        lambda: kube.patch_status("AtomDeployment", "ns", "x", {"phase": "Ready"}),
    ):
        with pytest.raises(NotLeading):
            write()
    assert [c[0] for c in api.calls] == ["GET"]  # not one write left the process


def test_status_is_never_written_over_a_newer_generation() -> None:
    api = FakeApi({"GET": [(200, stored(60))]})
    kube = Kube(api)  # type: ignore[arg-type]
    with pytest.raises(StaleStatus):
        kube.patch_status("AtomDeployment", "ns", "x", {"observedGeneration": 59})
    assert [c[0] for c in api.calls] == ["GET"]


def test_status_write_carries_the_read_resource_version_and_retries_a_conflict() -> None:
    api = FakeApi(
        {
            "GET": [(200, stored(59, "7")), (200, stored(59, "8"))],
            "PATCH": [(409, {"message": "the object has been modified"}), (200, {})],
        }
    )
    kube = Kube(api)  # type: ignore[arg-type]
    kube.patch_status("AtomDeployment", "ns", "x", {"observedGeneration": 60, "phase": "Ready"})
    patches = [c[2] for c in api.calls if c[0] == "PATCH"]
    assert [p["metadata"]["resourceVersion"] for p in patches] == ["7", "8"]
    assert patches[-1]["status"] == {"observedGeneration": 60, "phase": "Ready"}


class FencedFakeKube(FakeKube):
    """The reconciler's fake cluster, with a fence that closes after `allowed` writes."""

    def __init__(self, allowed: int) -> None:
        super().__init__()
        self.allowed = allowed
        self.writes: list[str] = []
        self.refused = 0

    def fenced(self, fence: Any) -> FencedFakeKube:
        return self

    def _write(self, what: str) -> None:
        if len(self.writes) >= self.allowed:
            self.refused += 1
            raise NotLeading("lease lost")
        self.writes.append(what)

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._write(f"apply {obj['kind']}")
        return super().apply(obj)

    def create(self, obj: dict[str, Any]) -> bool:
        self._write(f"create {obj['kind']}")
        return super().create(obj)

    def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        self._write("status")
        super().patch_status(kind, namespace, name, status)


@dataclass
class Leads:
    leading: bool = True

    def fence(self) -> Closed:
        return Closed()


def test_a_reconcile_that_loses_the_lease_midway_is_abandoned(caplog) -> None:
    kube = FencedFakeKube(allowed=1)
    r = Reconciler(kube, Settings(default_image="img"), leadership=Leads())  # type: ignore[arg-type]
    obj = {
        "metadata": {"name": "demo", "namespace": "serving", "uid": "u1", "generation": 2},
        "spec": SPEC,
        "status": {},
    }
    with caplog.at_level(logging.WARNING):
        outcome = r.run(obj, LOG)
    assert len(kube.writes) == 1 and kube.refused == 1  # the first refusal ends the run
    assert kube.status_writes == [] and outcome.patch == {} and outcome.retry_in is None
    assert "abandoned" in caplog.text and "demo" in caplog.text


def test_every_status_write_names_its_generation() -> None:
    kube = FakeKube()
    r = Reconciler(kube, Settings(default_image="img"))  # type: ignore[arg-type]
    obj = {
        "metadata": {"name": "demo", "namespace": "serving", "uid": "u1", "generation": 3},
        "spec": SPEC,
        "status": {},
    }
    first = r.run(obj, LOG)
    r.run({**obj, "status": first.patch}, LOG)  # only the conditions differ now
    assert [w[2]["observedGeneration"] for w in kube.status_writes] == [3, 3]
