"""Rollout rules of the pure plan: revisions, router switching, pruning, warm-up gating."""

from __future__ import annotations

from atomd_fakes import deployment, job
from atomd_helpers import IMAGE, OWNER, spec

from atom_operator import builders, naming
from atom_operator.snapshot import Snapshot


def by_name(p: builders.Plan) -> dict[str, dict]:
    """Deployments and Jobs by name (per-revision Services share their Deployment's name)."""
    return {o["metadata"]["name"]: o for o in p.apply if o["kind"] in ("Deployment", "Job")}


def router_target(p: builders.Plan) -> str:
    return by_name(p)["demo-router"]["metadata"]["annotations"][naming.ANNOTATION_SERVING]


def observed_after(p: builders.Plan, *, ready_roles: bool = True) -> Snapshot:
    """Everything of plan `p` exists; role Deployments ready or not; router complete."""
    deps = []
    for o in p.apply:
        if o["kind"] != "Deployment":
            continue
        is_role = o["metadata"]["labels"]["app.kubernetes.io/component"] == "runtime"
        deps.append(deployment(o, ready=None if ready_roles or not is_role else 0))
    return Snapshot(deployments=deps)


def test_router_waits_for_both_new_roles_then_switches_then_old_goes() -> None:
    old_spec = spec("disaggregated")
    new_spec = spec("disaggregated", compilation={"level": 3, "cudagraphMode": "FULL"})
    p1 = builders.plan(OWNER, old_spec, IMAGE, Snapshot())
    old = p1.revision
    assert router_target(p1) == old
    serving_old = observed_after(p1)

    # new revision applied, not ready yet: router stays on old; old kept
    p2 = builders.plan(OWNER, new_spec, IMAGE, serving_old)
    new = p2.revision
    assert new != old and router_target(p2) == old and p2.serving_revision == old
    assert ("Deployment", f"demo-prefill-{new}") in p2.keep and (
        "Deployment",
        f"demo-decode-{old}",
    ) in p2.keep

    # only prefill of the new revision ready: still old
    half = Snapshot(
        deployments=serving_old.deployments
        + [
            deployment(by_name(p2)[f"demo-prefill-{new}"]),
            deployment(by_name(p2)[f"demo-decode-{new}"], ready=1),
        ]
    )
    assert router_target(builders.plan(OWNER, new_spec, IMAGE, half)) == old

    # both ready: router points at new; old kept until the router has rolled
    both = Snapshot(
        deployments=serving_old.deployments
        + [
            deployment(by_name(p2)[f"demo-prefill-{new}"]),
            deployment(by_name(p2)[f"demo-decode-{new}"]),
        ]
    )
    p3 = builders.plan(OWNER, new_spec, IMAGE, both)
    assert router_target(p3) == new
    assert ("Deployment", f"demo-decode-{old}") in p3.keep

    # router rolled to new and complete: old revision no longer kept (pruned)
    rolled = Snapshot(
        deployments=[d for d in both.deployments if d["metadata"]["name"] != "demo-router"]
        + [deployment(by_name(p3)["demo-router"])]
    )
    p4 = builders.plan(OWNER, new_spec, IMAGE, rolled)
    assert router_target(p4) == new
    assert ("Deployment", f"demo-decode-{old}") not in p4.keep
    assert ("Service", f"demo-prefill-{old}") not in p4.keep
    assert ("Deployment", f"demo-decode-{new}") in p4.keep


def test_replicas_only_change_keeps_revision_and_router() -> None:
    p1 = builders.plan(OWNER, spec("disaggregated"), IMAGE, Snapshot())
    scaled = spec(
        "disaggregated", disaggregation={"prefill": {"replicas": 3}, "decode": {"replicas": 4}}
    )
    p2 = builders.plan(OWNER, scaled, IMAGE, observed_after(p1))
    assert p2.revision == p1.revision and router_target(p2) == p1.revision
    assert by_name(p2)[f"demo-decode-{p1.revision}"]["spec"]["replicas"] == 4


def test_unified_rolls_in_place() -> None:
    p1 = builders.plan(OWNER, spec("unified"), IMAGE, Snapshot())
    p2 = builders.plan(
        OWNER, spec("unified", compilation={"cudagraphMode": "FULL"}), IMAGE, observed_after(p1)
    )
    assert "demo-unified" in by_name(p1) and "demo-unified" in by_name(p2)
    labels = by_name(p2)["demo-unified"]["spec"]["template"]["metadata"]["labels"]
    assert labels[naming.LABEL_REVISION] == p2.revision != p1.revision


def test_warmup_holds_serving_pods_until_the_job_completes() -> None:
    s = spec("unified", compileCache={"warmup": True})
    p1 = builders.plan(OWNER, s, IMAGE, Snapshot())
    assert "demo-unified" not in by_name(p1) and p1.waiting_for_warmup == ["unified"]
    assert ("Deployment", "demo-unified") in p1.keep  # an existing one is not pruned meanwhile
    (job_name,) = p1.warmup_jobs.values()
    running = builders.plan(OWNER, s, IMAGE, Snapshot(jobs=[job(by_name(p1)[job_name], None)]))
    assert "demo-unified" not in by_name(running)
    done = builders.plan(OWNER, s, IMAGE, Snapshot(jobs=[job(by_name(p1)[job_name], "Complete")]))
    assert "demo-unified" in by_name(done) and not done.waiting_for_warmup


def test_one_warmup_job_per_distinct_cache_key() -> None:
    body = {
        "model": {"name": "llama-3.2-1b"},
        "compilation": {"cudagraphMode": "FULL_DECODE_ONLY"},
        "compileCache": {"warmup": True},
        "disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
    }
    p = builders.plan(OWNER, spec(body), IMAGE, Snapshot())
    # same effective compilation for both roles -> one key -> one Job
    assert len(set(p.cache_keys.values())) == 1 and len(p.warmup_jobs) == 1
