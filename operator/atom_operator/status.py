"""Pure status computation: phase, conditions and per-role counts from observed children.

Truthful means: counts come from pods at the current revision, Ready needs every role ready
at that revision (and the router on it), and Degraded names the cause. The status is built as
the CRD's own `AtomDeploymentStatus` and dumped by alias, so it cannot drift from the schema.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from atom_operator import autoscaling_status, naming, problems, runtime_args
from atom_operator.builders import Plan
from atom_operator.problems import CLAIM_PENDING_GRACE, Problem, parse_time
from atom_operator.snapshot import (
    Snapshot,
    deployment_complete,
    job_state,
    label,
    live_pods,
    pod_ready,
)
from atom_operator.spec import AtomDeploymentSpec
from atom_operator.status_models import (
    AtomDeploymentStatus,
    CompileCacheStatus,
    Condition,
    Phase,
    RoleStatus,
)

RECHECK_MARGIN = timedelta(seconds=1)  # look again just after a grace period ends


def _timestamp(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def role_counts(
    spec: AtomDeploymentSpec, snap: Snapshot, role: str, revision: str, instance: str = ""
) -> RoleStatus:
    pods = live_pods(snap, role)
    current = [p for p in pods if label(p, naming.LABEL_REVISION) == revision]
    return RoleStatus(
        replicas=autoscaling_status.desired_replicas(spec, snap, instance, role, revision),
        ready_replicas=sum(pod_ready(p) for p in current),
        updated_replicas=len(current),
        revision=revision,
        tensor_parallel=runtime_args.tensor_size(spec, role),
    )


def _role_ready(counts: RoleStatus, snap: Snapshot, role: str, revision: str) -> bool:
    stale = [p for p in live_pods(snap, role) if label(p, naming.LABEL_REVISION) != revision]
    return (
        counts.ready_replicas >= counts.replicas
        and counts.updated_replicas == counts.replicas
        and not stale
    )


def cache_condition(
    spec: AtomDeploymentSpec, snap: Snapshot, plan: Plan, now: datetime
) -> tuple[str, str, str, list[Problem]]:
    """(status, reason, message, problems) of CompileCacheReady."""
    if not spec.compile_cache.enabled:
        return "True", "Disabled", "compile cache disabled: every pod compiles from scratch", []
    found: list[Problem] = []
    pvc = snap.pvc
    claim = plan.claim_name
    if pvc is None:
        msg = f"PersistentVolumeClaim {claim} not found"
        if spec.compile_cache.existing_claim:  # the operator creates its own claim, not this one
            found.append(Problem("ClaimMissing", f"compileCache.existingClaim: {msg}"))
        return "False", "ClaimMissing", msg, found
    if pvc["metadata"].get("deletionTimestamp"):
        msg = (
            f"PersistentVolumeClaim {claim} is being deleted (kept until no pod uses it): pods "
            "roll without the compile cache"
        )
        msg += (
            "; the operator recreates the claim once it is gone"
            if not spec.compile_cache.existing_claim
            else "; recreate compileCache.existingClaim to use it again"
        )
        return "False", "ClaimTerminating", msg, [Problem("ClaimTerminating", msg)]
    phase = pvc.get("status", {}).get("phase", "Pending")
    if phase != "Bound":
        created = parse_time(pvc["metadata"].get("creationTimestamp"))
        msg = f"PersistentVolumeClaim {claim} is {phase}"
        if phase == "Lost" or (created is not None and now - created > CLAIM_PENDING_GRACE):
            found.append(Problem("ClaimUnbound", msg + " (no volume bound to it)"))
        return "False", "ClaimPending", msg, found
    for key, job_name in plan.warmup_jobs.items():
        state = job_state(snap.job(job_name))
        if state == "Failed":
            found.append(
                Problem("WarmupFailed", f"warm-up Job {job_name} failed (cache key {key})")
            )
            return "False", "WarmupFailed", f"warm-up Job {job_name} failed", found
        if state != "Complete":
            return (
                "False",
                "WarmingUp",
                f"warm-up Job {job_name} is compiling into the cache",
                found,
            )
    keys = ", ".join(f"{r}={k}" for r, k in plan.cache_keys.items())
    reason = "Warm" if plan.warmup_jobs else "Bound"
    return "True", reason, f"claim {claim} bound; keys {keys}", found


def _condition(
    ctype: str,
    status: str,
    reason: str,
    message: str,
    generation: int,
    now: datetime,
    previous: dict[str, dict[str, Any]],
) -> Condition:
    prev = previous.get(ctype)
    since = _timestamp(now)
    if prev is not None and prev.get("status") == status:  # unchanged: keep when it changed
        since = prev.get("lastTransitionTime", since)
    return Condition.model_validate(
        {
            "type": ctype,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": since,
            "observedGeneration": generation,
        }
    )


def _dumped(status: AtomDeploymentStatus) -> dict[str, Any]:
    """The status stanza (camelCase) for the status subresource. Every field that was set is
    written, None included (a merge patch then clears it); fields never set are left out."""
    return status.model_dump(by_alias=True, exclude_unset=True)


def monitoring_condition(spec: AtomDeploymentSpec, unavailable: bool) -> tuple[str, str, str]:
    if unavailable:
        return (
            "False",
            "PodMonitorCRDMissing",
            "monitoring.coreos.com/v1 PodMonitor is not served by this cluster: install the "
            "Prometheus Operator's CRDs (pods still serve /metrics on port 8000)",
        )
    msg = "a PodMonitor selects the runtime and router pods"
    np = spec.network_policy
    if spec.disaggregated and np.enabled and not np.metrics_from:
        msg += (
            "; prefill and decode pods admit HTTP only from the router: set "
            "networkPolicy.metricsFrom to let Prometheus scrape them"
        )
    return "True", "PodMonitorApplied", msg


def compute_status(
    *,
    name: str,
    spec: AtomDeploymentSpec,
    generation: int,
    snap: Snapshot,
    plan: Plan,
    now: datetime,
    previous_conditions: list[dict[str, Any]] | None = None,
    apply_errors: list[str] | None = None,
    monitoring_unavailable: bool = False,
    missing_kinds: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """The whole status stanza (camelCase), ready for the status subresource."""
    rev = plan.revision
    roles: dict[str, RoleStatus] = {}
    ready_roles = 0
    for role in runtime_args.roles(spec):
        counts = role_counts(spec, snap, role, rev, name)
        roles[role] = counts
        ready_roles += _role_ready(counts, snap, role, rev)
    total_roles = len(roles)
    router_ok = True
    if spec.disaggregation is not None:
        dep = snap.deployment(naming.role_deployment_name(name, naming.ROUTER, None))
        router_serving = (
            (dep or {}).get("metadata", {}).get("annotations", {}).get(naming.ANNOTATION_SERVING)
        )
        router_ok = router_serving == rev and deployment_complete(dep)
        pods = live_pods(snap, naming.ROUTER)
        roles[naming.ROUTER] = RoleStatus(  # no tensorParallel: the router holds no model
            replicas=runtime_args.role_replicas(spec, naming.ROUTER),
            ready_replicas=sum(
                pod_ready(p) for p in pods if label(p, naming.LABEL_REVISION) == rev
            ),
            updated_replicas=sum(label(p, naming.LABEL_REVISION) == rev for p in pods),
            revision=router_serving,
        )
        total_roles += 1
        ready_roles += router_ok

    cache_status, cache_reason, cache_msg, found = cache_condition(spec, snap, plan, now)
    legacy = problems.legacy_name(name)  # the likely cause when a child was refused
    found = problems.unique(
        (legacy if apply_errors else [])
        + [Problem("ApplyFailed", e) for e in apply_errors or []]
        + found
        + problems.deployments(snap)
        + problems.scheduling(snap, now)
        + problems.containers(snap)
        + problems.crash_loops(snap)
        + problems.foreign_scalers(snap, plan.owned_deployments(), plan.autoscalers)
    )
    all_ready = ready_roles == total_roles

    if all_ready:
        ready = (
            "True",
            "AllRolesReady",
            f"{ready_roles}/{total_roles} roles ready at revision {rev}",
        )
        progressing = ("False", "RolloutComplete", f"revision {rev} is serving")
    else:
        waiting = [
            r for r, c in roles.items() if c.ready_replicas < c.replicas or c.revision != rev
        ]
        if plan.waiting_for_warmup:
            reason, msg = (
                "WaitingForWarmup",
                f"roles {', '.join(plan.waiting_for_warmup)} wait for the warm-up Job",
            )
        elif spec.disaggregation is not None and not router_ok and plan.serving_revision != rev:
            reason, msg = (
                "RollingOut",
                f"router stays on {plan.serving_revision} until revision {rev} is ready",
            )
        else:
            reason, msg = (
                "RollingOut",
                f"waiting for {', '.join(waiting) or 'old pods to go'} at revision {rev}",
            )
        ready = (
            "False",
            "RolesNotReady",
            f"{ready_roles}/{total_roles} roles ready at revision {rev}",
        )
        waits = problems.scheduling_waits(snap, now)
        if waits:  # normal while creating: said here, not as Degraded
            msg = problems.joined(
                [Problem(reason, msg)] + [Problem(reason, w.message) for w in waits]
            )
        progressing = ("True", reason, msg)
    if legacy:  # said even while it serves: what to do before the name is needed again
        ready = (ready[0], ready[1], f"{ready[2]}; {legacy[0].message}")
    degraded = (
        ("True", found[0].reason, problems.joined(found))
        if found
        else ("False", "AsExpected", "no failures observed")
    )
    previous = {c["type"]: c for c in previous_conditions or [] if "type" in c}
    conditions = [
        _condition("Ready", *ready, generation, now, previous),
        _condition("Progressing", *progressing, generation, now, previous),
        _condition("Degraded", *degraded, generation, now, previous),
        _condition(
            "CompileCacheReady", cache_status, cache_reason, cache_msg, generation, now, previous
        ),
    ]
    if spec.monitoring.enabled:
        conditions.append(
            _condition(
                "MonitoringReady",
                *monitoring_condition(spec, monitoring_unavailable),
                generation,
                now,
                previous,
            )
        )
    for ctype, parts in (
        ("AutoscalingReady", autoscaling_status.autoscaling_condition(name, spec, snap, missing_kinds)),
        ("InferencePoolReady", autoscaling_status.inference_pool_condition(spec, missing_kinds)),
    ):
        if parts is not None:
            conditions.append(_condition(ctype, *parts, generation, now, previous))
    phase: Phase
    if found:
        phase = "Degraded"
    elif all_ready:
        phase = "Ready"
    elif not any(live_pods(snap, r) for r in roles):
        phase = "Pending"
    else:
        phase = "Progressing"

    graph_mode = per_role(
        spec,
        lambda role: runtime_args.graph_mode(spec, runtime_args.effective_compilation(spec, role)),
    )
    keys = plan.cache_keys
    unified = roles.get(naming.UNIFIED)
    status = AtomDeploymentStatus(
        observed_generation=generation,
        phase=phase,
        conditions=conditions,
        roles=roles,
        compile_cache=CompileCacheStatus(
            key=next(iter(keys.values()))
            if len(set(keys.values())) == 1
            else ",".join(f"{r}:{k}" for r, k in keys.items()),
            keys=keys,
            claim_name=plan.claim_name,
        ),
        revision=rev,
        serving_revision=plan.serving_revision,
        endpoint=plan.endpoint,
        graph_mode=graph_mode,
        tensor_parallel=per_role(spec, lambda role: str(runtime_args.tensor_size(spec, role))),
        kv_transport=runtime_args.kv_transport(spec),
        ready=f"{ready_roles}/{total_roles}",
        replicas=unified.updated_replicas if unified else 0,
        current_replicas=per_role(spec, lambda role: str(roles[role].updated_replicas)),
        desired_replicas=per_role(spec, lambda role: str(roles[role].replicas)),
        selector=naming.selector_string(naming.selector_labels(name, naming.UNIFIED)),
    )
    return _dumped(status)


def recheck_at(snap: Snapshot, now: datetime) -> datetime | None:
    """When this status may change with nothing else happening: just after the first grace
    period still running ends (a pod not yet placed, a claim not yet bound). No event comes
    then, so the reconcile asks to be run again."""
    ends = [w.until for w in problems.scheduling_waits(snap, now)]
    pvc = snap.pvc
    if pvc is not None and pvc.get("status", {}).get("phase", "Pending") == "Pending":
        created = parse_time(pvc["metadata"].get("creationTimestamp"))
        if created is not None and now <= created + CLAIM_PENDING_GRACE:
            ends.append(created + CLAIM_PENDING_GRACE)
    return min(ends) + RECHECK_MARGIN if ends else None


def per_role(spec: AtomDeploymentSpec, value: Callable[[str], str]) -> str:
    """One value when every runtime role has it, else `role=value` pairs (printer columns)."""
    values = {role: value(role) for role in runtime_args.roles(spec)}
    if len(set(values.values())) == 1:
        return next(iter(values.values()))
    return ",".join(f"{r}={v}" for r, v in values.items())


def invalid_spec_status(
    generation: int,
    message: str,
    now: datetime,
    previous_conditions: list[dict[str, Any]] | None,
    *,
    reason: str = "InvalidSpec",
) -> dict[str, Any]:
    """Status for a spec the operator will not act on: one it cannot read (a CRD older than
    the operator, reason InvalidSpec) or one its settings refuse (the message says why)."""
    previous = {c["type"]: c for c in previous_conditions or [] if "type" in c}
    if reason == "InvalidSpec":
        message = f"spec does not match the operator's schema (is the CRD up to date?): {message}"
    msg = message[:1000]
    status = AtomDeploymentStatus(
        observed_generation=generation,
        phase="Degraded",
        conditions=[
            _condition("Ready", "False", reason, msg, generation, now, previous),
            _condition("Progressing", "False", reason, msg, generation, now, previous),
            _condition("Degraded", "True", reason, msg, generation, now, previous),
        ],
    )
    return _dumped(status)


def status_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The merge patch from `old` to `new` status: changed top-level fields only, and map
    entries that disappeared (roles after unified <-> disaggregated, cache keys) set to null."""
    new = dict(new)
    if "roles" in new:
        new["roles"] = {**{r: None for r in (old.get("roles") or {})}, **new["roles"]}
    cache = new.get("compileCache")
    if cache is not None:
        old_keys = (old.get("compileCache") or {}).get("keys") or {}
        new["compileCache"] = {
            **cache,
            "keys": {**{k: None for k in old_keys}, **(cache.get("keys") or {})},
        }
    return {k: v for k, v in new.items() if _stripped(old.get(k)) != _stripped(v)}


def _stripped(value: Any) -> Any:
    """Compare as the API server stores it: null map entries are removed by a merge patch."""
    if isinstance(value, dict):
        return {k: _stripped(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_stripped(v) for v in value]
    return value
