"""Status truth while an object is created (issue 49): a pod waiting for its claim to bind, or
not yet placed within a grace period, is Progressing, not Degraded; one that still cannot be
placed after the grace period is Degraded with the scheduler's reason. Also: a name an earlier
CRD accepted is reported with what to do, and children are found by owner, not managed-by."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from atomd_fakes import OWNER, pod, pvc
from atomd_helpers import IMAGE, spec

from atom_operator import builders, events, naming, problems
from atom_operator.handlers import owner_of
from atom_operator.snapshot import Snapshot
from atom_operator.status import compute_status, recheck_at

NOW = datetime(2026, 1, 1, 0, 10, tzinfo=UTC)
UNBOUND = (
    "0/2 nodes are available: pod has unbound immediate PersistentVolumeClaims. preemption: "
    "0/2 nodes are available: 2 Preemption is not helpful for scheduling."
)
NO_FIT = "0/2 nodes are available: 2 Insufficient cpu. preemption: 0/2 nodes are available."


def _stamp(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def waiting_pod(rev: str, message: str, age: timedelta) -> dict[str, Any]:
    p = pod("unified", rev, name="u-0", ready=False)
    p["status"]["phase"] = "Pending"
    p["status"]["conditions"] = [
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": message,
            "lastTransitionTime": _stamp(NOW - age),
        }
    ]
    return p


def status_of(
    message: str, age: timedelta, claim: dict[str, Any] | None = None, name: str = OWNER.name
) -> dict[str, Any]:
    s = spec("unified")
    rev = builders.plan(OWNER, s, IMAGE, Snapshot()).revision
    snap = Snapshot(pods=[waiting_pod(rev, message, age)], pvc=claim or pvc())
    plan = builders.plan(OWNER, s, IMAGE, snap)
    return compute_status(
        name=name, spec=s, generation=1, snap=snap, plan=plan, now=NOW, previous_conditions=None
    )


def cond(st: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in st["conditions"] if c["type"] == ctype)


def test_a_pod_waiting_for_a_fresh_claim_is_progressing_not_degraded() -> None:
    fresh = pvc("Pending", created=_stamp(NOW - timedelta(seconds=3)))
    st = status_of(UNBOUND, timedelta(seconds=3), fresh)
    assert cond(st, "Degraded")["status"] == "False" and st["phase"] != "Degraded"
    progressing = cond(st, "Progressing")
    assert (
        progressing["status"] == "True" and "waits for its claim to bind" in progressing["message"]
    )
    assert not [e for e in events.transitions(None, st) if e.type == "Warning"]


def test_a_claim_wait_is_longer_than_the_scheduling_grace() -> None:
    age = problems.SCHEDULING_GRACE + timedelta(seconds=30)
    fresh = pvc("Pending", created=_stamp(NOW - age))
    assert cond(status_of(UNBOUND, age, fresh), "Degraded")["status"] == "False"


def test_a_pod_that_cannot_fit_is_progressing_within_the_grace_then_degraded() -> None:
    early = status_of(NO_FIT, problems.SCHEDULING_GRACE - timedelta(seconds=1))
    assert cond(early, "Degraded")["status"] == "False"
    assert "waits for a node" in cond(early, "Progressing")["message"]
    late = status_of(NO_FIT, problems.SCHEDULING_GRACE + timedelta(seconds=1))
    d = cond(late, "Degraded")
    assert (
        d["status"] == "True"
        and d["reason"] == "Unschedulable"
        and "Insufficient cpu" in d["message"]
    )
    assert late["phase"] == "Degraded"


def test_the_reconcile_asks_to_look_again_when_a_grace_period_ends() -> None:
    s = spec("unified")
    rev = builders.plan(OWNER, s, IMAGE, Snapshot()).revision
    age = timedelta(seconds=5)
    snap = Snapshot(pods=[waiting_pod(rev, NO_FIT, age)], pvc=pvc())
    at = recheck_at(snap, NOW)
    assert at is not None and NOW < at <= NOW - age + problems.SCHEDULING_GRACE + timedelta(
        seconds=2
    )
    pending = pvc("Pending", created=_stamp(NOW - timedelta(seconds=10)))
    at = recheck_at(Snapshot(pvc=pending), NOW)
    assert at is not None and at > NOW + problems.CLAIM_PENDING_GRACE - timedelta(seconds=11)
    assert recheck_at(Snapshot(pvc=pvc()), NOW) is None  # nothing pending: no recheck


def test_a_name_an_earlier_crd_accepted_says_what_to_do() -> None:
    st = status_of(NO_FIT, timedelta(0), name="7b-llama")
    ready = cond(st, "Ready")["message"]
    assert "'atom-7b-llama'" in ready and "delete this one" in ready
    assert cond(st, "Degraded")["status"] == "False"  # it may well serve: not a fault by itself
    s = spec("unified")
    plan = builders.plan(OWNER, s, IMAGE, Snapshot())
    refused = compute_status(
        name="7b-llama",
        spec=s,
        generation=1,
        snap=Snapshot(),
        plan=plan,
        now=NOW,
        apply_errors=["Service 7b-llama: a DNS-1035 label must start with a letter"],
    )
    d = cond(refused, "Degraded")
    assert d["reason"] == "InvalidName" and "Service 7b-llama" in d["message"]
    assert problems.legacy_name("llama-7b") == []
    assert problems.suggested_name("My.Model_7B") == "my-model-7b"
    assert problems.suggested_name("x" * 70) == "x" * 63


def test_children_are_found_by_owner_reference_or_instance_label() -> None:
    labels = naming.labels("demo", "runtime", "unified")
    assert owner_of({"labels": labels}) == "demo"
    edited = {**labels, naming.LABEL_MANAGED_BY: "someone"}
    assert owner_of({"labels": edited}) == "demo"  # the edited label no longer hides it
    ref = {"apiVersion": "atom.dev/v1alpha1", "kind": "AtomDeployment", "name": "demo"}
    assert owner_of({"labels": {}, "ownerReferences": [ref]}) == "demo"
    stranger = {"labels": {naming.LABEL_INSTANCE: "demo", naming.LABEL_NAME: "other-chart"}}
    assert owner_of(stranger) is None
