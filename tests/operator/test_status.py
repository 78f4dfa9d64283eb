"""Status is truthful: counts per revision, Ready/Progressing/Degraded with named causes."""

from __future__ import annotations

from datetime import UTC, datetime

from atomd_fakes import deployment, job, pod, pvc
from atomd_helpers import IMAGE, OWNER, spec

from atom_operator import builders, naming
from atom_operator.snapshot import Snapshot
from atom_operator.status import compute_status

NOW = datetime(2026, 1, 1, 0, 10, tzinfo=UTC)


def status_of(s, snap: Snapshot, previous=None) -> dict:
    p = builders.plan(OWNER, s, IMAGE, snap)
    return compute_status(
        name=OWNER.name,
        spec=s,
        generation=3,
        snap=snap,
        plan=p,
        now=NOW,
        previous_conditions=previous,
    )


def cond(st: dict, ctype: str) -> dict:
    return next(c for c in st["conditions"] if c["type"] == ctype)


def current_rev(s) -> str:
    return builders.plan(OWNER, s, IMAGE, Snapshot()).revision


def test_unified_ready_with_counts() -> None:
    s = spec("unified")
    rev = current_rev(s)
    snap = Snapshot(pods=[pod("unified", rev, name="a"), pod("unified", rev, name="b")], pvc=pvc())
    st = status_of(s, snap)
    assert st["phase"] == "Ready" and st["observedGeneration"] == 3
    assert st["roles"]["unified"] == {
        "replicas": 2,
        "readyReplicas": 2,
        "updatedReplicas": 2,
        "revision": rev,
        "tensorParallel": 1,
    }
    assert cond(st, "Ready")["status"] == "True" and cond(st, "Progressing")["status"] == "False"
    assert cond(st, "CompileCacheReady")["status"] == "True"
    assert st["ready"] == "1/1" and st["replicas"] == 2 and st["graphMode"] == "TR_HYBRID"
    assert st["endpoint"] == "http://demo.serving.svc:8000"


def test_rollout_in_progress_counts_only_new_revision() -> None:
    s = spec("unified")
    rev = current_rev(s)
    snap = Snapshot(
        pods=[
            pod("unified", "oldrev", name="a"),
            pod("unified", "oldrev", name="b"),
            pod("unified", rev, name="c", ready=False),
        ],
        pvc=pvc(),
    )
    st = status_of(s, snap)
    assert st["phase"] == "Progressing"
    assert (
        st["roles"]["unified"]["readyReplicas"] == 0
        and st["roles"]["unified"]["updatedReplicas"] == 1
    )
    assert cond(st, "Ready")["status"] == "False" and cond(st, "Progressing")["status"] == "True"
    # new pods all ready but an old one lingers: still not Ready
    snap2 = Snapshot(
        pods=[
            pod("unified", rev, name="c"),
            pod("unified", rev, name="d"),
            pod("unified", "oldrev", name="a"),
        ],
        pvc=pvc(),
    )
    assert status_of(s, snap2)["phase"] == "Progressing"


def test_nothing_yet_is_pending() -> None:
    st = status_of(spec("unified"), Snapshot(pvc=pvc()))
    assert st["phase"] == "Pending" and cond(st, "Ready")["status"] == "False"


def test_crash_loop_during_capture_is_degraded_and_named() -> None:
    s = spec("unified")
    rev = current_rev(s)
    snap = Snapshot(
        pods=[
            pod(
                "unified",
                rev,
                name="gpu-oom",
                ready=False,
                restarts=3,
                waiting="CrashLoopBackOff",
                last_exit="OOMKilled",
            )
        ],
        pvc=pvc(),
    )
    st = status_of(s, snap)
    d = cond(st, "Degraded")
    assert st["phase"] == "Degraded" and d["status"] == "True" and d["reason"] == "CaptureCrashLoop"
    assert "gpu-oom" in d["message"] and "OOMKilled" in d["message"]


def test_unbound_claim_degrades_only_after_grace() -> None:
    s = spec("unified")
    fresh = status_of(s, Snapshot(pvc=pvc("Pending", created="2026-01-01T00:09:30Z")))
    assert cond(fresh, "CompileCacheReady")["reason"] == "ClaimPending"
    assert cond(fresh, "Degraded")["status"] == "False"
    stale = status_of(s, Snapshot(pvc=pvc("Pending", created="2026-01-01T00:00:00Z")))
    assert (
        cond(stale, "Degraded")["reason"] == "ClaimUnbound"
        and "demo-compile-cache" in cond(stale, "Degraded")["message"]
    )


def test_failed_warmup_job_is_named() -> None:
    s = spec("unified", compileCache={"warmup": True})
    p = builders.plan(OWNER, s, IMAGE, Snapshot())
    (name,) = p.warmup_jobs.values()
    built = next(o for o in p.apply if o["metadata"]["name"] == name)
    st = status_of(s, Snapshot(jobs=[job(built, "Failed")], pvc=pvc()))
    assert (
        cond(st, "Degraded")["reason"] == "WarmupFailed" and name in cond(st, "Degraded")["message"]
    )
    assert cond(st, "CompileCacheReady")["status"] == "False"
    running = status_of(s, Snapshot(jobs=[job(built, None)], pvc=pvc()))
    assert cond(running, "Progressing")["reason"] == "WaitingForWarmup"


def test_disaggregated_needs_router_on_current_revision() -> None:
    s = spec("disaggregated")
    p = builders.plan(OWNER, s, IMAGE, Snapshot())
    rev = p.revision
    pods = [
        pod("prefill", rev, name="p0"),
        pod("decode", rev, name="d0"),
        pod("decode", rev, name="d1"),
        pod("router", rev, name="r0", component="router"),
    ]
    router = next(o for o in p.apply if o["metadata"]["name"] == "demo-router")
    st = status_of(s, Snapshot(pods=pods, deployments=[deployment(router)], pvc=pvc()))
    assert st["phase"] == "Ready" and st["ready"] == "3/3"
    assert st["graphMode"] == "prefill=TR_HYBRID,decode=FULL_DECODE_ONLY"
    assert set(st["roles"]) == {"prefill", "decode", "router"}
    # router still rolling: not Ready
    st2 = status_of(s, Snapshot(pods=pods, deployments=[deployment(router, ready=0)], pvc=pvc()))
    assert st2["phase"] == "Progressing" and st2["ready"] == "2/3"


def test_last_transition_time_kept_while_status_unchanged() -> None:
    s = spec("unified")
    first = status_of(
        s,
        Snapshot(pvc=pvc()),
        previous=[
            {"type": "Ready", "status": "False", "lastTransitionTime": "2025-12-31T00:00:00Z"}
        ],
    )
    assert cond(first, "Ready")["lastTransitionTime"] == "2025-12-31T00:00:00Z"
    assert cond(first, "Progressing")["lastTransitionTime"] == "2026-01-01T00:10:00Z"


def test_scale_selector_matches_unified_pods() -> None:
    st = status_of(spec("unified"), Snapshot(pvc=pvc()))
    labels = naming.labels(OWNER.name, "runtime", "unified", "r")
    assert all(labels[k] == v for k, v in (kv.split("=") for kv in st["selector"].split(",")))


def test_status_patch_nulls_vanished_roles_and_skips_unchanged() -> None:
    from atom_operator.status import status_patch

    old = {
        "phase": "Ready",
        "roles": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
        "compileCache": {"key": "a", "keys": {"prefill": "a", "decode": "b"}},
    }
    new = {
        "phase": "Ready",
        "roles": {"unified": {"replicas": 1}},
        "compileCache": {"key": "c", "keys": {"unified": "c"}},
    }
    patch = status_patch(old, new)
    assert "phase" not in patch
    assert patch["roles"] == {"prefill": None, "decode": None, "unified": {"replicas": 1}}
    assert patch["compileCache"]["keys"] == {"prefill": None, "decode": None, "unified": "c"}
    assert status_patch(new, new) == {}


def test_digest_diffbase_is_small_for_huge_specs() -> None:
    import json

    import kopf

    from atom_operator.handlers import DigestDiffBaseStorage

    store = DigestDiffBaseStorage(prefix="atom.dev", key="last-handled-digest")
    big = {
        "metadata": {"name": "x"},
        "spec": {"env": [{"name": f"V{i}", "value": "x" * 100} for i in range(5000)]},
    }
    essence = store.build(body=kopf.Body(big))
    assert len(json.dumps(essence)) < 100
    changed = json.loads(json.dumps(big))
    changed["spec"]["env"][0]["value"] = "y"
    assert store.build(body=kopf.Body(changed)) != essence


def _reconcile_without_api(spec_body: dict, generation: int):
    """reconcile() with a client that fails any call: for specs it must not act on."""
    import logging

    from atom_operator.reconcile import ObjectMemory, reconcile

    class NoApi:
        def __getattr__(self, name: str):
            raise AssertionError(f"API call {name} on a spec that must touch nothing")

    return reconcile(
        NoApi(),  # type: ignore[arg-type]
        ObjectMemory(),
        name="demo",
        namespace="serving",
        uid="u",
        generation=generation,
        spec_body=spec_body,
        previous_status=None,
        default_image="img",
        logger=logging.getLogger("t"),
    )


def test_unreadable_spec_reports_invalid_spec_and_touches_nothing() -> None:
    result = _reconcile_without_api({"model": {"name": "x"}, "compilation": {"level": 9}}, 4)
    st = result.status
    assert st["phase"] == "Degraded" and st["observedGeneration"] == 4
    assert (
        cond(st, "Degraded")["reason"] == "InvalidSpec"
        and "level" in cond(st, "Degraded")["message"]
    )


def test_host_volume_refused_by_the_operator_unless_allowed() -> None:
    body = {"model": {"name": "x", "volume": {"hostPath": {"path": "/"}}}}
    result = _reconcile_without_api(body, 2)
    d = cond(result.status, "Degraded")
    assert d["reason"] == "HostVolumeForbidden" and "spec.model.volume.hostPath" in d["message"]
    assert result.plan.apply == [] and not result.errors
