"""Observed objects as the API server would return them, for plan/status tests."""

from __future__ import annotations

from typing import Any

from atomd_helpers import OWNER

from atom_operator import naming


def deployment(
    obj: dict[str, Any], *, ready: int | None = None, generation: int = 1
) -> dict[str, Any]:
    """A built Deployment as observed: `ready` pods ready and updated (default: all)."""
    want = obj["spec"]["replicas"]
    n = want if ready is None else ready
    out = {**obj, "metadata": {**obj["metadata"], "generation": generation}}
    out["status"] = {
        "observedGeneration": generation,
        "replicas": want,
        "updatedReplicas": n,
        "readyReplicas": n,
    }
    return out


def pod(
    role: str,
    revision: str | None,
    *,
    name: str,
    ready: bool = True,
    component: str = "runtime",
    restarts: int = 0,
    waiting: str | None = None,
    last_exit: str | None = None,
) -> dict[str, Any]:
    labels = naming.labels(OWNER.name, component, role, revision)
    cs: dict[str, Any] = {"name": "runtime", "ready": ready, "restartCount": restarts, "state": {}}
    if waiting:
        cs["state"] = {"waiting": {"reason": waiting}}
    if last_exit:
        cs["lastState"] = {"terminated": {"reason": last_exit, "exitCode": 137}}
    return {
        "kind": "Pod",
        "metadata": {"name": name, "namespace": OWNER.namespace, "labels": labels},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [cs],
        },
    }


def pvc(phase: str = "Bound", created: str = "2026-01-01T00:00:00Z") -> dict[str, Any]:
    return {
        "metadata": {"name": naming.pvc_name(OWNER.name), "creationTimestamp": created},
        "status": {"phase": phase},
    }


def job(obj: dict[str, Any], state: str | None) -> dict[str, Any]:
    conds = [{"type": state, "status": "True"}] if state else []
    return {**obj, "status": {"conditions": conds}}
