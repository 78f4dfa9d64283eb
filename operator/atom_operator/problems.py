"""Pure readings of what keeps an AtomDeployment from serving, each with a named reason.

Every reader takes the observed children and returns `Problem`s; `status` turns the first one
into Degraded's reason and all of them into its message. They read what Kubernetes itself
reports (the scheduler's PodScheduled condition, the kubelet's waiting reasons, the Deployment
controller's ReplicaFailure and Progressing conditions), so a problem clears on the next
reconcile after Kubernetes stops reporting it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from atom_operator import naming
from atom_operator.snapshot import Snapshot, label

CRASH_RESTARTS = 2
MAX_MESSAGE = 1000  # one condition message stays readable in `kubectl describe`
IMAGE_PULL_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
# The scheduler names a missing claim in its Unschedulable message.
_MISSING_CLAIM = re.compile(r'persistentvolumeclaim "([^"]+)" not found')


@dataclass(frozen=True)
class Problem:
    reason: str
    message: str


def _short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


def _serving_pods(snap: Snapshot) -> list[dict[str, Any]]:
    """Pods of this AtomDeployment that should run (warm-up pods included), not going away."""
    return [
        p
        for p in snap.pods
        if not p["metadata"].get("deletionTimestamp")
        and p.get("status", {}).get("phase") not in ("Succeeded", "Failed")
    ]


def _who(pod: dict[str, Any]) -> str:
    return f"pod {pod['metadata']['name']} ({label(pod, naming.LABEL_ROLE)})"


def scheduling(snap: Snapshot) -> list[Problem]:
    """Pods the scheduler cannot place: no node matches, no GPU left, a claim is missing."""
    out = []
    for pod in _serving_pods(snap):
        for cond in pod.get("status", {}).get("conditions") or []:
            if cond.get("type") != "PodScheduled" or cond.get("status") != "False":
                continue
            if cond.get("reason") != "Unschedulable":
                continue
            message = cond.get("message", "")
            missing = _MISSING_CLAIM.search(message)
            if missing:
                out.append(
                    Problem(
                        "ClaimMissing",
                        _short(
                            f"{_who(pod)} waits for PersistentVolumeClaim {missing.group(1)}, "
                            "which does not exist"
                        ),
                    )
                )
            else:
                out.append(Problem("Unschedulable", _short(f"{_who(pod)}: {message}")))
    return out


def containers(snap: Snapshot) -> list[Problem]:
    """Containers that cannot start: the image cannot be pulled, or env/volume sources are
    missing (a Secret named by apiKeySecretRef, say)."""
    out = []
    for pod in _serving_pods(snap):
        statuses = (pod.get("status", {}).get("initContainerStatuses") or []) + (
            pod.get("status", {}).get("containerStatuses") or []
        )
        for cs in statuses:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason")
            detail = waiting.get("message", "")
            if reason in IMAGE_PULL_REASONS:
                image = cs.get("image", "")
                out.append(
                    Problem(
                        "ImagePullFailed",
                        _short(f"{_who(pod)} cannot pull image {image}: {reason}: {detail}"),
                    )
                )
            elif reason == "CreateContainerConfigError":
                out.append(Problem("CreateContainerConfigError", _short(f"{_who(pod)}: {detail}")))
    return out


def crash_loops(snap: Snapshot) -> list[Problem]:
    """Runtime pods that keep dying before their first Ready: compile or capture failing."""
    problems = []
    for pod in snap.pods:
        if (
            pod["metadata"].get("deletionTimestamp")
            or label(pod, naming.LABEL_COMPONENT) != "runtime"
        ):
            continue
        for cs in pod.get("status", {}).get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            last = (cs.get("lastState") or {}).get("terminated") or {}
            looping = (
                waiting.get("reason") == "CrashLoopBackOff"
                or cs.get("restartCount", 0) >= CRASH_RESTARTS
            )
            if looping and not cs.get("ready"):
                detail = f"{cs.get('restartCount', 0)} restarts"
                if last:
                    detail += f", last exit {last.get('reason', 'Error')} (code {last.get('exitCode', '?')})"
                problems.append(
                    Problem(
                        "CaptureCrashLoop",
                        f"{_who(pod)} is crash-looping during compile/capture: {detail}",
                    )
                )
    return problems


def deployments(snap: Snapshot) -> list[Problem]:
    """Deployments whose pods cannot be created (a ResourceQuota, a LimitRange, admission: the
    ReplicaSet's FailedCreate, copied into the Deployment's ReplicaFailure condition) or that
    ran past their progress deadline."""
    out = []
    for dep in snap.deployments:
        name = dep["metadata"]["name"]
        for cond in dep.get("status", {}).get("conditions") or []:
            kind, status = cond.get("type"), cond.get("status")
            if kind == "ReplicaFailure" and status == "True":
                reason = cond.get("reason") or "FailedCreate"
                out.append(Problem(reason, _short(f"Deployment {name}: {cond.get('message', '')}")))
            elif (
                kind == "Progressing"
                and status == "False"
                and cond.get("reason") == "ProgressDeadlineExceeded"
            ):
                out.append(
                    Problem(
                        "ProgressDeadlineExceeded",
                        _short(f"Deployment {name}: {cond.get('message', '')}"),
                    )
                )
    return out


def foreign_scalers(snap: Snapshot, owned_deployments: set[str]) -> list[Problem]:
    """HorizontalPodAutoscalers aimed at a child Deployment: the operator sets its replicas
    from the spec on every reconcile, so the two would fight."""
    out = []
    for hpa in snap.autoscalers:
        target = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
        if target.get("kind") == "Deployment" and target.get("name") in owned_deployments:
            out.append(
                Problem(
                    "AutoscalerOnChild",
                    f"HorizontalPodAutoscaler {hpa['metadata']['name']} scales Deployment "
                    f"{target['name']}, which the operator owns and sets back to the spec's "
                    "replicas: aim it at the AtomDeployment instead (scaleTargetRef "
                    "apiVersion atom.dev/v1alpha1, kind AtomDeployment: its scale subresource)",
                )
            )
    return out


def unique(problems: list[Problem]) -> list[Problem]:
    seen: set[Problem] = set()
    out: list[Problem] = []
    for p in problems:
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def joined(problems: list[Problem], limit: int = 4 * MAX_MESSAGE) -> str:
    """Degraded's message: every problem, the first ones first, within a readable size."""
    text = "; ".join(p.message for p in problems)
    return text if len(text) <= limit else text[: limit - 3] + "..."
