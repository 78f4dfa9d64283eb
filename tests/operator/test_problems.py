"""Degraded names what Kubernetes reports: unschedulable pods, quota refusals, missing claims,
image pulls, claims being deleted; and clears when Kubernetes stops reporting it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from atomd_fakes import deployment, pod, pvc
from atomd_helpers import IMAGE, OWNER, spec

from atom_operator import builders
from atom_operator.snapshot import Snapshot
from atom_operator.status import compute_status

NOW = datetime(2026, 1, 1, 0, 10, tzinfo=UTC)


def status_of(s, snap: Snapshot) -> dict[str, Any]:
    p = builders.plan(OWNER, s, IMAGE, snap)
    return compute_status(
        name=OWNER.name, spec=s, generation=2, snap=snap, plan=p, now=NOW, previous_conditions=None
    )


def cond(st: dict, ctype: str) -> dict:
    return next(c for c in st["conditions"] if c["type"] == ctype)


def rev_of(s) -> str:
    return builders.plan(OWNER, s, IMAGE, Snapshot()).revision


def pending_pod(rev: str, message: str) -> dict[str, Any]:
    p = pod("unified", rev, name="u-0", ready=False)
    p["status"]["phase"] = "Pending"
    p["status"]["conditions"] = [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
    ]
    return p


def test_unschedulable_pod_is_degraded_with_the_schedulers_message() -> None:
    s = spec("unified")
    msg = "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector."
    st = status_of(s, Snapshot(pods=[pending_pod(rev_of(s), msg)], pvc=pvc()))
    d = cond(st, "Degraded")
    assert st["phase"] == "Degraded" and d["status"] == "True" and d["reason"] == "Unschedulable"
    assert "u-0" in d["message"] and "node affinity/selector" in d["message"]
    # scheduled and running again: back to not degraded
    st2 = status_of(s, Snapshot(pods=[pod("unified", rev_of(s), name="u-0")], pvc=pvc()))
    assert cond(st2, "Degraded")["status"] == "False"


def test_missing_model_claim_is_named() -> None:
    s = spec("unified")
    msg = '0/3 nodes are available: persistentvolumeclaim "weights" not found. preemption: ...'
    d = cond(status_of(s, Snapshot(pods=[pending_pod(rev_of(s), msg)], pvc=pvc())), "Degraded")
    assert d["reason"] == "ClaimMissing" and "weights" in d["message"]


def test_missing_existing_claim_is_degraded() -> None:
    s = spec("unified", compileCache={"existingClaim": "shared"})
    st = status_of(s, Snapshot())
    assert cond(st, "Degraded")["reason"] == "ClaimMissing"
    assert "existingClaim" in cond(st, "Degraded")["message"]
    assert cond(st, "CompileCacheReady")["status"] == "False"


def test_quota_refusal_is_failed_create() -> None:
    s = spec("unified")
    built = next(
        o for o in builders.plan(OWNER, s, IMAGE, Snapshot()).apply if o["kind"] == "Deployment"
    )
    dep = deployment(built, ready=0)
    dep["status"]["conditions"] = [
        {
            "type": "ReplicaFailure",
            "status": "True",
            "reason": "FailedCreate",
            "message": 'pods "demo-unified-x" is forbidden: exceeded quota: gpus, requested: '
            "requests.nvidia.com/gpu=1, used: requests.nvidia.com/gpu=0, limited: requests.nvidia.com/gpu=0",
        }
    ]
    d = cond(status_of(s, Snapshot(deployments=[dep], pvc=pvc())), "Degraded")
    assert d["reason"] == "FailedCreate" and "exceeded quota" in d["message"]


def test_image_pull_failure_is_named() -> None:
    s = spec("unified")
    p = pod("unified", rev_of(s), name="u-0", ready=False, waiting="ImagePullBackOff")
    p["status"]["containerStatuses"][0]["image"] = "nope:1"
    d = cond(status_of(s, Snapshot(pods=[p], pvc=pvc())), "Degraded")
    assert d["reason"] == "ImagePullFailed" and "nope:1" in d["message"]


def test_claim_being_deleted_rolls_without_cache_and_says_so() -> None:
    s = spec("unified")
    terminating = pvc()
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:05:00Z"
    snap = Snapshot(pvc=terminating)
    st = status_of(s, snap)
    cache = cond(st, "CompileCacheReady")
    assert cache["status"] == "False" and cache["reason"] == "ClaimTerminating"
    assert cond(st, "Degraded")["reason"] == "ClaimTerminating"
    p = builders.plan(OWNER, s, IMAGE, snap)
    assert p.rolling_without_cache and p.revision != rev_of(s)
    assert not [o for o in p.apply if o["kind"] == "PersistentVolumeClaim"]
    (dep,) = [o for o in p.apply if o["kind"] == "Deployment"]
    pod_spec = dep["spec"]["template"]["spec"]
    assert "compile-cache" not in {v["name"] for v in pod_spec["volumes"]}
    assert "--compile-cache-dir" not in pod_spec["containers"][0]["args"]
    # once the claim is gone the plan creates it again and pods get the cache back
    again = builders.plan(OWNER, s, IMAGE, Snapshot())
    assert [o for o in again.apply if o["kind"] == "PersistentVolumeClaim"]
    assert again.revision == rev_of(s)


def test_hpa_on_a_child_deployment_is_reported() -> None:
    s = spec("unified")
    hpa = {
        "metadata": {"name": "fights"},
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": "demo-unified",
            }
        },
    }
    d = cond(status_of(s, Snapshot(pvc=pvc(), autoscalers=[hpa])), "Degraded")
    assert d["reason"] == "AutoscalerOnChild" and "kind AtomDeployment" in d["message"]
    on_parent = {
        "metadata": {"name": "ok"},
        "spec": {"scaleTargetRef": {"kind": "AtomDeployment", "name": "demo"}},
    }
    assert (
        cond(status_of(s, Snapshot(pvc=pvc(), autoscalers=[on_parent])), "Degraded")["status"]
        == "False"
    )
