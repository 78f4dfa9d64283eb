"""The Reconciler: one status writer, per-object memory that is forgotten, serialized runs."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from typing import Any

import kopf
import pytest

from atom_operator.kube import ApiError
from atom_operator.leader import AlwaysLeader
from atom_operator.reconciler import Reconciler
from atom_operator.settings import Settings

LOG = logging.getLogger("test")
SPEC = {"model": {"name": "tiny-llama", "loadFormat": "dummy"}}


class FakeKube:
    """Objects in memory, as the API server would keep them; `gate`, when set, holds every
    list call until it is opened (to catch two runs of one object at once)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.status_writes: list[tuple[str, str, dict[str, Any]]] = []
        self.status_error: ApiError | None = None
        self.version = 0
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.inside = 0
        self.most_inside = 0
        self._lock = threading.Lock()

    def list(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        if kind == "Deployment":  # the first list of a reconcile
            with self._lock:
                self.inside += 1
                self.most_inside = max(self.most_inside, self.inside)
            self.entered.set()
            if self.gate is not None:
                self.gate.wait(10)
            with self._lock:
                self.inside -= 1
        return [o for (k, ns, _), o in self.objects.items() if k == kind and ns == namespace]

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind, namespace, name))

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        meta = {**obj["metadata"], "resourceVersion": str(self.version), "generation": 1}
        stored = {**obj, "metadata": meta}
        self.objects[(obj["kind"], meta["namespace"], meta["name"])] = stored
        return stored

    def create(self, obj: dict[str, Any]) -> bool:
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        created = key not in self.objects
        self.objects.setdefault(key, obj)
        return created

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self.objects.pop((kind, namespace, name), None)

    def post_event(self, involved: dict[str, Any], event_type: str, reason: str, msg: str) -> None:
        return None

    def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        if self.status_error is not None:
            raise self.status_error
        self.status_writes.append((namespace, name, status))


def atomd(uid: str = "u1", status: dict[str, Any] | None = None) -> dict[str, Any]:
    meta = {"name": "demo", "namespace": "serving", "uid": uid, "generation": 2}
    return {"metadata": meta, "spec": SPEC, "status": status or {}}


def reconciler(kube: FakeKube) -> Reconciler:
    return Reconciler(kube, Settings(default_image="img"))  # type: ignore[arg-type]


def test_run_writes_the_status_once_through_the_status_subresource() -> None:
    kube = FakeKube()
    r = reconciler(kube)
    outcome = r.run(atomd(), LOG)
    assert kube.status_writes == [("serving", "demo", outcome.patch)]
    written = outcome.patch
    assert written["observedGeneration"] == 2 and written["phase"] == "Pending"
    # The claim it created is observed now (Pending): only the conditions change.
    second = r.run(atomd(status=written), LOG)
    assert set(second.patch) == {"conditions"} and len(kube.status_writes) == 2
    # Run again with the status as stored: nothing changed, nothing written.
    again = r.run(atomd(status={**written, **second.patch}), LOG)
    assert again.patch == {} and len(kube.status_writes) == 2
    assert r.stats.reconciles == 3 and r.stats.failed_reconciles == 0


def test_status_write_failures_do_not_fail_the_reconcile(caplog) -> None:
    kube = FakeKube()
    kube.status_error = ApiError(404, '{"message": "not found"}')
    assert reconciler(kube).run(atomd(), LOG).patch  # deleted meanwhile: silent
    kube.status_error = ApiError(422, '{"message": "invalid status"}')
    with caplog.at_level(logging.WARNING):
        reconciler(kube).run(atomd(), LOG)
    assert "invalid status" in caplog.text


def test_forget_drops_everything_remembered_of_the_object() -> None:
    kube = FakeKube()
    r = reconciler(kube)
    r.run(atomd("u1"), LOG)
    r.run(atomd("u2"), LOG)
    assert r.tracked() == {"u1", "u2"}
    assert r.seconds_since_reconcile("u1") < 60
    r.forget("u1")
    assert r.tracked() == {"u2"}
    assert r.seconds_since_reconcile("u1") == float("inf")
    r.forget("never-seen")  # no error


def test_resync_listing_forgets_what_it_no_longer_names() -> None:
    kube = FakeKube()
    r = reconciler(kube)
    r.run(atomd("gone"), LOG)
    r.run(atomd("kept"), LOG)
    listed_since = time.monotonic()
    r.run(atomd("newer"), LOG)  # began after the listing: it may be missing from it
    r.retain({"kept"}, listed_since)
    assert r.tracked() == {"kept", "newer"}


def test_forget_during_a_run_keeps_runs_of_the_object_serialized() -> None:
    kube = FakeKube()
    kube.gate = threading.Event()
    r = reconciler(kube)
    first = threading.Thread(target=r.run, args=(atomd("u1"), LOG))
    first.start()
    assert kube.entered.wait(10)
    r.forget("u1")  # deleted while reconciling
    assert r.tracked() == set()
    kube.entered.clear()
    second = threading.Thread(target=r.run, args=(atomd("u1"), LOG))
    second.start()
    assert not kube.entered.wait(0.3), "a second run of one object started beside the first"
    kube.gate.set()
    first.join(10)
    second.join(10)
    assert kube.most_inside == 1
    # the second run began after the forget: the object is remembered again, once
    assert r.tracked() == {"u1"}


def test_failed_applies_back_off_and_count_as_failed() -> None:
    class Refusing(FakeKube):
        def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
            raise ApiError(403, '{"message": "quota"}')

    r = reconciler(Refusing())
    delays = [r.run(atomd(), LOG).retry_in for _ in range(3)]
    assert delays == [1.0, 2.0, 4.0]
    assert r.stats.failed_reconciles == 3


def test_importing_the_handlers_reads_no_settings() -> None:
    env = {"ATOM_OPERATOR_RECONCILE_INTERVAL": "-1", "PATH": ""}
    code = "import atom_operator.handlers"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_no_handler_puts_a_finalizer_on_atomdeployments() -> None:
    from atom_operator import handlers

    registry = kopf.get_default_registry()
    changing = registry._changing.get_all_handlers()
    assert {h.id for h in changing} >= {"on_change"}
    assert not any(h.requires_finalizer for h in changing)
    assert not any(h.requires_finalizer for h in registry._spawning.get_all_handlers())
    assert "forget-deleted" in {h.id for h in registry._watching.get_all_handlers()}
    assert handlers.RESOURCE == ("atom.dev", "v1alpha1", "atomdeployments")


def test_deleted_event_forgets_the_object() -> None:
    from atom_operator import handlers
    from atom_operator.background import Background

    kube = FakeKube()
    r = reconciler(kube)
    r.run(atomd("u1"), LOG)
    op = handlers.Operator(
        reconciler=r, background=Background(r, logger=LOG), leader=AlwaysLeader()
    )
    memo = kopf.Memo({handlers.MEMO_KEY: op})
    modified = {"type": "MODIFIED", "object": atomd("u1")}
    handlers.on_deleted(event=modified, memo=memo)  # type: ignore[arg-type]
    assert r.tracked() == {"u1"}
    deleted = {"type": "DELETED", "object": atomd("u1")}
    handlers.on_deleted(event=deleted, memo=memo)  # type: ignore[arg-type]
    assert r.tracked() == set()


@pytest.mark.parametrize("leading", [True, False])
def test_handler_reconciles_only_while_leading(leading: bool) -> None:
    from atom_operator import handlers
    from atom_operator.background import Background

    leader = AlwaysLeader()
    leader.leading = leading  # a standby replica when False
    kube = FakeKube()
    r = reconciler(kube)
    op = handlers.Operator(reconciler=r, background=Background(r, logger=LOG), leader=leader)
    memo = kopf.Memo({handlers.MEMO_KEY: op})
    handlers.on_change(body=atomd(), memo=memo, logger=LOG)  # type: ignore[arg-type]
    assert len(kube.status_writes) == int(leading)
