"""Pure builders: spec (+ a few observed facts) -> the child manifests to apply.

`plan()` is the whole desired state of one AtomDeployment. It is pure so the rollout rules are
unit-tested: which revision the router points at, which old revisions are kept, which Deployments
wait for a warm-up Job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from atom_operator import naming, runtime_args
from atom_operator.builders.autoscaling import (
    build_inference_pool,
    build_scaled_objects,
    hpa_name,
    scaled_roles,
)
from atom_operator.builders.cache import build_pvc, build_warmup_job
from atom_operator.builders.common import Owner
from atom_operator.builders.monitoring import build_pod_monitor
from atom_operator.builders.policy import build_disruption_budgets, build_network_policies
from atom_operator.builders.router import build_router_deployment, router_args
from atom_operator.builders.runtime import (
    build_config_map,
    build_endpoint_service,
    build_role_deployment,
    build_role_service,
    claim_name,
    pod_template,
)
from atom_operator.builders.secret import token_secret_name
from atom_operator.snapshot import Snapshot, deployment_complete, job_state, router_revision
from atom_operator.spec import AtomDeploymentSpec

__all__ = ["Owner", "Plan", "plan", "revision_of", "cache_keys"]


@dataclass
class Plan:
    apply: list[dict[str, Any]] = field(default_factory=list)
    keep: set[tuple[str, str]] = field(default_factory=set)  # (kind, name) not to garbage-collect
    revision: str = ""
    serving_revision: str | None = None
    cache_keys: dict[str, str] = field(default_factory=dict)
    claim_name: str | None = None
    warmup_jobs: dict[str, str] = field(default_factory=dict)  # cache key -> Job name
    waiting_for_warmup: list[str] = field(default_factory=list)  # roles held back
    endpoint: str = ""
    rolling_without_cache: bool = False  # the claim is being deleted (see plan())
    token_secret: str | None = None  # internal-token Secret to create once (disaggregated)
    autoscalers: frozenset[str] = frozenset()  # HPAs KEDA makes for our ScaledObjects

    def owned_deployments(self) -> set[str]:
        return {name for kind, name in self.keep if kind == "Deployment"}

    def add(self, obj: dict[str, Any] | None) -> None:
        if obj is not None:
            self.apply.append(obj)
            self.keep.add((obj["kind"], obj["metadata"]["name"]))


def cache_keys(spec: AtomDeploymentSpec, image: str) -> dict[str, str]:
    return {role: runtime_args.cache_key(spec, role, image) for role in runtime_args.roles(spec)}


def _templates(
    owner: Owner, spec: AtomDeploymentSpec, image: str, keys: dict[str, str]
) -> dict[str, dict[str, Any]]:
    return {
        role: pod_template(owner, spec, role, image, keys[role])
        for role in runtime_args.roles(spec)
    }


def revision_of(templates: dict[str, dict[str, Any]]) -> str:
    """Hash of the runtime pod templates (replicas are not in them); prefill and decode share
    one revision, so they roll together."""
    return naming.digest(templates, 10)


def without_cache(spec: AtomDeploymentSpec) -> AtomDeploymentSpec:
    cache = spec.compile_cache.model_copy(update={"enabled": False})
    return spec.model_copy(update={"compile_cache": cache})


def plan(owner: Owner, spec: AtomDeploymentSpec, image: str, observed: Snapshot) -> Plan:
    keys = cache_keys(spec, image)
    out = Plan(cache_keys=keys, claim_name=claim_name(owner, spec))
    out.endpoint = naming.service_url(owner.name, owner.namespace, naming.UNIFIED, None)
    if observed.pvc is not None and observed.pvc["metadata"].get("deletionTimestamp"):
        # A claim being deleted stays (pvc-protection) while a pod mounts it, and a new pod
        # waits on it forever: with maxUnavailable 0 neither would go. Pods roll without the
        # cache instead; once the old pods are gone the claim goes, and the next reconcile
        # recreates it (the spec's cache is back, one more roll).
        spec = without_cache(spec)
        out.rolling_without_cache = True
    templates = _templates(owner, spec, image, keys)
    rev = out.revision = revision_of(templates)

    out.add(build_pvc(owner, spec))
    warm = _plan_warmup(out, owner, spec, image, keys, observed)

    if spec.disaggregation is None:
        name = naming.role_deployment_name(owner.name, naming.UNIFIED, None)
        out.keep.add(("Deployment", name))
        if warm[naming.UNIFIED]:
            out.add(
                build_role_deployment(owner, spec, naming.UNIFIED, templates[naming.UNIFIED], rev)
            )
        else:
            out.waiting_for_warmup.append(naming.UNIFIED)
        out.serving_revision = rev
        router = None
    else:
        router = _plan_disaggregated(out, owner, spec, image, templates, warm, observed)
    out.add(build_endpoint_service(owner, spec))
    out.add(build_config_map(owner, spec, image, keys, rev, router))
    for obj in build_network_policies(owner, spec) + build_disruption_budgets(owner, spec):
        out.add(obj)
    out.add(build_pod_monitor(owner, spec))
    for scaled in build_scaled_objects(owner, spec, rev):
        out.add(scaled)
    out.autoscalers = frozenset(hpa_name(owner.name, role) for role in scaled_roles(spec))
    out.add(build_inference_pool(owner, spec))
    if spec.disaggregated:
        out.token_secret = token_secret_name(owner.name)
    return out


def _plan_warmup(
    out: Plan,
    owner: Owner,
    spec: AtomDeploymentSpec,
    image: str,
    keys: dict[str, str],
    observed: Snapshot,
) -> dict[str, bool]:
    """One warm-up Job per distinct cache key; a role is 'warm' once its Job completed."""
    warm = {role: True for role in keys}
    if not (spec.compile_cache.enabled and spec.compile_cache.warmup):
        return warm
    for role, key in keys.items():
        if key not in out.warmup_jobs:
            job = build_warmup_job(owner, spec, role, image, key)
            out.warmup_jobs[key] = job["metadata"]["name"]
            out.add(job)
        warm[role] = job_state(observed.job(out.warmup_jobs[key])) == "Complete"
    return warm


def _plan_disaggregated(
    out: Plan,
    owner: Owner,
    spec: AtomDeploymentSpec,
    image: str,
    templates: dict[str, dict[str, Any]],
    warm: dict[str, bool],
    observed: Snapshot,
) -> list[str]:
    """New revision's roles come up beside the serving ones; the router moves only when both
    new roles are fully ready; the old revision goes once the router has moved."""
    rev = out.revision
    roles = (naming.PREFILL, naming.DECODE)
    if all(warm[r] for r in roles):
        scaled = scaled_roles(spec)
        for role in roles:
            dep = build_role_deployment(owner, spec, role, templates[role], rev)
            if role in scaled:  # the HPA sets its replicas; the spec's only until it acts
                del dep["spec"]["replicas"]
            out.add(dep)
            out.add(build_role_service(owner, role, rev))
    else:
        out.waiting_for_warmup.extend(r for r in roles if not warm[r])
    serving = router_revision(observed, owner.name)
    new_ready = all(
        deployment_complete(observed.deployment(naming.role_deployment_name(owner.name, r, rev)))
        for r in roles
    )
    target = rev if serving in (None, rev) or new_ready else serving
    router_dep = observed.deployment(naming.role_deployment_name(owner.name, naming.ROUTER, None))
    router_settled = serving == target and deployment_complete(router_dep)
    keep_revisions = {rev, target}
    if serving and not router_settled:
        keep_revisions.add(serving)  # the router may still have pods pointing there
    for keep_rev in keep_revisions:
        for role in roles:
            out.keep.add(("Deployment", naming.role_deployment_name(owner.name, role, keep_rev)))
            out.keep.add(("Service", naming.role_service_name(owner.name, role, keep_rev)))
    out.add(build_router_deployment(owner, spec, image, target))
    out.serving_revision = target
    assert spec.disaggregation is not None
    return router_args(owner, target, spec.disaggregation.router.routing_policy)
