"""One level-triggered reconcile: observe children, apply the plan, prune, compute status.

Called by every trigger (create, update, resume, child event, resync) through `Reconciler.run`;
it never reads a diff, so any trigger converges the same way, and a restart mid-way just runs
it again. What it remembers of one object between passes is that object's `ObjectMemory`.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from atom_operator import builders, events, naming, status
from atom_operator.applied import AppliedCache
from atom_operator.builders import Owner, Plan
from atom_operator.builders.secret import build_internal_token_secret
from atom_operator.kube import ApiError, Kube
from atom_operator.logs import Logger
from atom_operator.snapshot import Snapshot
from atom_operator.spec import GROUP, KIND, VERSION, AtomDeploymentSpec

SECRET_RECHECK_S = 300.0  # a token Secret deleted by hand comes back within this long
# Kinds of optional CRDs: an apply answered 404 means the CRD is not installed, which a
# condition reports (MonitoringReady, AutoscalingReady, InferencePoolReady); not a failure.
OPTIONAL_KINDS = ("PodMonitor", "ScaledObject", "InferencePool")


@dataclass
class ObjectMemory:
    """What this process remembers of one AtomDeployment between reconciles. Only the pass
    holding the object's lock touches it (`Reconciler`), so it needs no lock of its own."""

    applied: AppliedCache = field(default_factory=AppliedCache)  # no-op applies to skip
    secrets_seen: dict[str, float] = field(default_factory=dict)  # Secret name -> monotonic
    last_status: dict[str, Any] | None = None  # the status last computed here


@dataclass
class Result:
    plan: Plan
    status: dict[str, Any]
    applied: int = 0
    deleted: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    monitoring_unavailable: bool = False
    missing_kinds: set[str] = field(default_factory=set)  # optional CRDs not installed
    recheck_in: float | None = None  # seconds until the status may change with no event


def observe(kube: Kube, owner: Owner, claim: str | None) -> Snapshot:
    selector = naming.instance_selector(owner.name)
    ns = owner.namespace

    def owned(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # Same labels could be set by hand on a stranger; only our children count.
        return [
            i
            for i in items
            if any(r.get("uid") == owner.uid for r in i["metadata"].get("ownerReferences") or [])
        ]

    return Snapshot(
        deployments=owned(kube.list("Deployment", ns, selector)),
        pods=kube.list("Pod", ns, naming.selector_string(naming.selector_labels(owner.name))),
        jobs=owned(kube.list("Job", ns, selector)),
        services=owned(kube.list("Service", ns, selector)),
        config_maps=owned(kube.list("ConfigMap", ns, selector)),
        disruption_budgets=owned(kube.list("PodDisruptionBudget", ns, selector)),
        network_policies=owned(kube.list("NetworkPolicy", ns, selector)),
        pvc=kube.get("PersistentVolumeClaim", ns, claim) if claim else None,
        pod_monitors=owned(_optional_list(kube, "PodMonitor", ns, selector)),
        scaled_objects=owned(_optional_list(kube, "ScaledObject", ns, selector)),
        inference_pools=owned(_optional_list(kube, "InferencePool", ns, selector)),
        autoscalers=_optional_list(kube, "HorizontalPodAutoscaler", ns, ""),
    )


def _optional_list(kube: Kube, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
    """Kinds the cluster may not serve (no Prometheus Operator) or RBAC may not grant (an
    older chart): none of them, rather than a failed reconcile."""
    try:
        return kube.list(kind, namespace, selector)
    except ApiError as exc:
        if exc.status in (403, 404):
            return []
        raise


def ensure_token_secret(kube: Kube, memory: ObjectMemory, owner: Owner, name: str) -> None:
    """Create the internal-token Secret once with a fresh random token; an existing one is
    never read nor rewritten (no rotation on reconcile, and no RBAC to read Secrets)."""
    seen = memory.secrets_seen.get(name)
    if seen is not None and time.monotonic() - seen < SECRET_RECHECK_S:
        return
    kube.create(build_internal_token_secret(owner, name, secrets.token_hex(32)))
    memory.secrets_seen[name] = time.monotonic()


def post_events(
    kube: Kube,
    memory: ObjectMemory,
    owner: Owner,
    previous: dict[str, Any] | None,
    current: dict[str, Any],
    logger: Logger,
) -> None:
    involved = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": owner.name,
        "namespace": owner.namespace,
        "uid": owner.uid,
    }
    # What this process computed last wins over the object's (possibly stale) status, so two
    # triggers racing on one change post its events once.
    before = previous if memory.last_status is None else memory.last_status
    memory.last_status = current
    for ev in events.transitions(before, current):
        try:
            kube.post_event(involved, ev.type, ev.reason, ev.message)
        except ApiError as exc:  # an event is a courtesy: never fail a reconcile for it
            logger.warning("posting event %s failed: %s", ev.reason, exc.message)


def reconcile(
    kube: Kube,
    memory: ObjectMemory,
    *,
    name: str,
    namespace: str,
    uid: str,
    generation: int,
    spec_body: dict[str, Any],
    previous_status: dict[str, Any] | None,
    default_image: str,
    logger: Logger,
    allow_host_volumes: bool = False,
) -> Result:
    started = time.monotonic()
    owner = Owner(name=name, namespace=namespace, uid=uid)
    try:
        spec = AtomDeploymentSpec.model_validate(spec_body)
    except ValidationError as exc:
        # Only possible when the installed CRD is older than the operator: say so, touch nothing.
        logger.error("spec does not match the operator's models: %s", exc)
        st = status.invalid_spec_status(
            generation, str(exc), datetime.now(UTC), (previous_status or {}).get("conditions")
        )
        return Result(plan=Plan(), status=st, errors=[str(exc)], seconds=time.monotonic() - started)
    if spec.host_volume_types() and not allow_host_volumes:
        # The chart's ValidatingAdmissionPolicy refuses these at the API server; this holds
        # where it is not installed. Nothing is applied for such a spec.
        kinds = ", ".join(f"spec.model.volume.{t}" for t in spec.host_volume_types())
        msg = (
            f"{kinds}: host volumes are not allowed (they reach the node's files); set the "
            "operator's ATOM_OPERATOR_ALLOW_HOST_VOLUMES=true (chart: admission.allowHostVolumes) "
            "to allow them"
        )
        logger.warning(msg)
        st = status.invalid_spec_status(
            generation,
            msg,
            datetime.now(UTC),
            (previous_status or {}).get("conditions"),
            reason="HostVolumeForbidden",
        )
        return Result(plan=Plan(), status=st, errors=[], seconds=time.monotonic() - started)
    image = spec.image or default_image
    claim = builders.runtime.claim_name(owner, spec)
    snap = observe(kube, owner, claim)
    plan = builders.plan(owner, spec, image, snap)

    result = Result(plan=plan, status={})
    if plan.token_secret:
        try:  # before the pods that read it (the kubelet would wait for it anyway)
            ensure_token_secret(kube, memory, owner, plan.token_secret)
        except ApiError as exc:
            msg = f"Secret {plan.token_secret}: {exc.message}"
            logger.warning("creating the internal token failed: %s", msg)
            result.errors.append(msg)
    observed = snap.by_key()
    for obj in plan.apply:
        if memory.applied.unchanged(obj, observed.get((obj["kind"], obj["metadata"]["name"]))):
            continue
        try:
            memory.applied.record(obj, kube.apply(obj))
            result.applied += 1
        except ApiError as exc:
            if obj["kind"] in OPTIONAL_KINDS and exc.status == 404:
                # Its CRD is not installed: a condition says so; not a failure.
                result.missing_kinds.add(obj["kind"])
                result.monitoring_unavailable |= obj["kind"] == "PodMonitor"
                continue
            # One refused child (say, a PVC that cannot shrink) must not block the others.
            msg = f"{obj['kind']} {obj['metadata']['name']}: {exc.message}"
            logger.warning("apply failed: %s", msg)
            result.errors.append(msg)

    # Prune what the plan no longer wants; never PVCs: the compile cache outlives revisions.
    for kind, items in snap.prunable():
        for item in items:
            item_name = item["metadata"]["name"]
            if (kind, item_name) not in plan.keep and not item["metadata"].get("deletionTimestamp"):
                kube.delete(kind, namespace, item_name)
                memory.applied.forget(kind, namespace, item_name)
                result.deleted.append(f"{kind}/{item_name}")
    if result.deleted:
        logger.info("pruned %s", ", ".join(result.deleted))

    now = datetime.now(UTC)
    result.status = status.compute_status(
        name=name,
        spec=spec,
        generation=generation,
        snap=snap,
        plan=plan,
        now=now,
        previous_conditions=(previous_status or {}).get("conditions"),
        apply_errors=result.errors,
        monitoring_unavailable=result.monitoring_unavailable,
        missing_kinds=frozenset(result.missing_kinds),
    )
    recheck = status.recheck_at(snap, now)
    if recheck is not None:
        result.recheck_in = max(0.0, (recheck - now).total_seconds())
    post_events(kube, memory, owner, previous_status, result.status, logger)
    result.seconds = time.monotonic() - started
    return result
