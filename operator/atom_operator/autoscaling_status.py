"""Status readings of autoscaling and the InferencePool (pure): desired replicas of a scaled
role, and the AutoscalingReady / InferencePoolReady conditions.

KEDA creates one HPA per ScaledObject (builders/autoscaling.hpa_name); the HPA's own
ScalingActive condition says whether it reads the metric, so AutoscalingReady repeats it.
"""

from __future__ import annotations

from typing import Any

from atom_operator import naming, runtime_args
from atom_operator.builders.autoscaling import (
    SCALED_OBJECT_API,
    hpa_name,
    scaled_object_name,
    scaled_roles,
)
from atom_operator.snapshot import Snapshot
from atom_operator.spec import AtomDeploymentSpec

ConditionParts = tuple[str, str, str]  # status, reason, message


def find_hpa(snap: Snapshot, name: str) -> dict[str, Any] | None:
    return next((h for h in snap.autoscalers if h["metadata"]["name"] == name), None)


def desired_replicas(
    spec: AtomDeploymentSpec, snap: Snapshot, instance: str, role: str, revision: str
) -> int:
    """What the role should run. A scaled disaggregated role: its Deployment's replicas (the
    HPA writes them there); everything else: the spec (the HPA of the unified role writes
    spec.replicas through the scale subresource)."""
    if spec.disaggregation is not None and role in scaled_roles(spec):
        dep = snap.deployment(naming.role_deployment_name(instance, role, revision))
        if dep is not None and "replicas" in (dep.get("spec") or {}):
            return int(dep["spec"]["replicas"])
    return runtime_args.role_replicas(spec, role)


def _keda_refusal(snap: Snapshot, name: str) -> tuple[str, str] | None:
    """(reason, message) of the ScaledObject's Ready=False, as KEDA wrote it."""
    so = next((o for o in snap.scaled_objects if o["metadata"]["name"] == name), None)
    conds = ((so or {}).get("status") or {}).get("conditions") or []
    ready = next((c for c in conds if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "False":
        return None
    return ready.get("reason") or "ScaledObjectNotReady", ready.get("message", "")


def _hpa_condition(hpa: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    conds = (hpa.get("status") or {}).get("conditions") or []
    return next((c for c in conds if c.get("type") == ctype), None)


def autoscaling_condition(
    instance: str, spec: AtomDeploymentSpec, snap: Snapshot, missing_kinds: frozenset[str]
) -> ConditionParts | None:
    """None when no role is scaled."""
    roles = scaled_roles(spec)
    if not roles:
        return None
    if "ScaledObject" in missing_kinds:
        return (
            "False",
            "KEDANotInstalled",
            f"{SCALED_OBJECT_API} ScaledObject is not served by this cluster: install KEDA "
            "(its CRDs, operator and metrics API server); until then replicas stay as the "
            "spec says",
        )
    parts = []
    for role, policy in roles.items():
        name = hpa_name(instance, role)
        hpa = find_hpa(snap, name)
        if hpa is None:
            refused = _keda_refusal(snap, scaled_object_name(instance, role))
            if refused is not None:
                return "False", refused[0], f"{role}: ScaledObject: {refused[1]}"[:500]
            return ("False", "WaitingForHPA", f"{role}: KEDA has not created the "
                    f"HorizontalPodAutoscaler {name} yet (is KEDA's operator running?)")
        active = _hpa_condition(hpa, "ScalingActive")
        if active is not None and active.get("status") == "False":
            return (
                "False",
                active.get("reason") or "ScalingInactive",
                f"{role}: HorizontalPodAutoscaler {name}: {active.get('message', '')}"[:500],
            )
        st = hpa.get("status") or {}
        parts.append(
            f"{role} {st.get('currentReplicas', 0)}->{st.get('desiredReplicas', 0)} pods "
            f"({policy.min_replicas}..{policy.max_replicas}) on {policy.metric} "
            f"target {policy.target:g}"
        )
    return "True", "Scaling", "; ".join(parts)


def inference_pool_condition(
    spec: AtomDeploymentSpec, missing_kinds: frozenset[str]
) -> ConditionParts | None:
    if not spec.inference_pool:
        return None
    if "InferencePool" in missing_kinds:
        return (
            "False",
            "InferencePoolCRDMissing",
            "inference.networking.k8s.io/v1 InferencePool is not served by this cluster: "
            "install the Gateway API Inference Extension's CRDs",
        )
    role = "router" if spec.disaggregation else "unified"
    return "True", "InferencePoolApplied", f"an InferencePool selects the {role} pods"
