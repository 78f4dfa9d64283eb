"""What the operator observed of one AtomDeployment's children, and pure readings of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from atom_operator import naming


@dataclass
class Snapshot:
    deployments: list[dict[str, Any]] = field(default_factory=list)
    pods: list[dict[str, Any]] = field(default_factory=list)
    jobs: list[dict[str, Any]] = field(default_factory=list)
    services: list[dict[str, Any]] = field(default_factory=list)
    config_maps: list[dict[str, Any]] = field(default_factory=list)
    disruption_budgets: list[dict[str, Any]] = field(default_factory=list)
    network_policies: list[dict[str, Any]] = field(default_factory=list)
    pod_monitors: list[dict[str, Any]] = field(default_factory=list)
    scaled_objects: list[dict[str, Any]] = field(default_factory=list)  # KEDA's, if served
    inference_pools: list[dict[str, Any]] = field(default_factory=list)
    pvc: dict[str, Any] | None = None
    autoscalers: list[dict[str, Any]] = field(default_factory=list)  # HPAs of the namespace

    def deployment(self, name: str) -> dict[str, Any] | None:
        return next((d for d in self.deployments if d["metadata"]["name"] == name), None)

    def prunable(self) -> list[tuple[str, list[dict[str, Any]]]]:
        """Children the operator deletes once the plan no longer wants them (never the claim:
        the compile cache outlives revisions)."""
        return [
            ("Deployment", self.deployments),
            ("Service", self.services),
            ("ConfigMap", self.config_maps),
            ("Job", self.jobs),
            ("PodDisruptionBudget", self.disruption_budgets),
            ("NetworkPolicy", self.network_policies),
            ("PodMonitor", self.pod_monitors),
            ("ScaledObject", self.scaled_objects),
            ("InferencePool", self.inference_pools),
        ]

    def by_key(self) -> dict[tuple[str, str], dict[str, Any]]:
        """Every observed child by (kind, name)."""
        out: dict[tuple[str, str], dict[str, Any]] = {}
        for kind, items in (
            *self.prunable(),
            ("PersistentVolumeClaim", [self.pvc] if self.pvc else []),
        ):
            for item in items:
                out[(kind, item["metadata"]["name"])] = item
        return out

    def job(self, name: str) -> dict[str, Any] | None:
        return next((j for j in self.jobs if j["metadata"]["name"] == name), None)


def label(obj: dict[str, Any], key: str) -> str | None:
    return (obj.get("metadata", {}).get("labels") or {}).get(key)


def deployment_complete(dep: dict[str, Any] | None) -> bool:
    """Every desired pod is updated and ready, and the controller saw the latest spec."""
    if dep is None:
        return False
    want = dep.get("spec", {}).get("replicas", 1)
    st = dep.get("status", {})
    return (
        st.get("observedGeneration", 0) >= dep["metadata"].get("generation", 1)
        and st.get("updatedReplicas", 0) >= want
        and st.get("readyReplicas", 0) >= want
        and st.get("replicas", 0) == want
    )


def router_revision(snap: Snapshot, instance: str) -> str | None:
    """The revision the router is configured for (its Deployment's annotation)."""
    dep = snap.deployment(naming.role_deployment_name(instance, naming.ROUTER, None))
    if dep is None:
        return None
    return (dep["metadata"].get("annotations") or {}).get(naming.ANNOTATION_SERVING)


def job_state(job: dict[str, Any] | None) -> str:
    """Missing, Running, Complete or Failed."""
    if job is None:
        return "Missing"
    for cond in job.get("status", {}).get("conditions") or []:
        if cond.get("status") == "True" and cond.get("type") in ("Complete", "Failed"):
            return cond["type"]
    return "Running"


def pod_ready(pod: dict[str, Any]) -> bool:
    if pod["metadata"].get("deletionTimestamp"):
        return False
    conds = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def live_pods(snap: Snapshot, role: str) -> list[dict[str, Any]]:
    """Serving pods of a role (not warm-up pods) that are not being deleted."""
    return [
        p
        for p in snap.pods
        if label(p, naming.LABEL_ROLE) == role
        and label(p, naming.LABEL_COMPONENT) in ("runtime", "router")
        and not p["metadata"].get("deletionTimestamp")
        and p.get("status", {}).get("phase") not in ("Succeeded", "Failed")
    ]
