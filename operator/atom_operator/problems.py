"""Pure readings of what keeps an AtomDeployment from serving, each with a named reason.

Every reader takes the observed children and returns `Problem`s; `status` turns the first one
into Degraded's reason and all of them into its message. They read what Kubernetes itself
reports (the scheduler's PodScheduled condition, the kubelet's waiting reasons, the Deployment
controller's ReplicaFailure and Progressing conditions), so a problem clears on the next
reconcile after Kubernetes stops reporting it.

What is normal while an object is created is not a problem: a pod the scheduler has not placed
yet is a `Wait` (Progressing) for a grace period, longer while it waits for its claim to bind,
and becomes a Problem (Degraded, with the scheduler's reason) only once the grace has passed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from atom_operator import naming
from atom_operator.crd_rules import MAX_NAME_LENGTH, NAME_PATTERN
from atom_operator.snapshot import Snapshot, label

CRASH_RESTARTS = 2
MAX_MESSAGE = 1000  # one condition message stays readable in `kubectl describe`
IMAGE_PULL_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
# The scheduler names a missing claim in its Unschedulable message.
_MISSING_CLAIM = re.compile(r'persistentvolumeclaim "([^"]+)" not found')
# ... and a claim that exists but has no volume yet (binding takes a moment; a provisioner more).
_UNBOUND_CLAIM = "unbound immediate PersistentVolumeClaims"
SCHEDULING_GRACE = timedelta(seconds=15)  # the scheduler places a pod that fits within this
CLAIM_PENDING_GRACE = timedelta(minutes=2)  # binding (or WaitForFirstConsumer) takes a moment


@dataclass(frozen=True)
class Problem:
    reason: str
    message: str


@dataclass(frozen=True)
class Wait:
    """Something normal while an object is created, until `until` (then it is a Problem)."""

    message: str
    until: datetime


def parse_time(text: str | None) -> datetime | None:
    """An API server timestamp (RFC 3339, seconds, UTC)."""
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


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


def _unschedulable(snap: Snapshot) -> list[tuple[dict[str, Any], str, datetime | None]]:
    """(pod, the scheduler's message, when it began) of each pod the scheduler could not place."""
    out = []
    for pod in _serving_pods(snap):
        for cond in pod.get("status", {}).get("conditions") or []:
            if (cond.get("type"), cond.get("status"), cond.get("reason")) != (
                "PodScheduled",
                "False",
                "Unschedulable",
            ):
                continue
            since = parse_time(cond.get("lastTransitionTime")) or parse_time(
                pod["metadata"].get("creationTimestamp")
            )
            out.append((pod, cond.get("message", ""), since))
    return out


def _grace_ends(message: str, since: datetime | None) -> datetime | None:
    """When an unschedulable pod stops being a wait (None: when is unknown, so it is one now)."""
    if since is None:
        return None
    return since + (CLAIM_PENDING_GRACE if _UNBOUND_CLAIM in message else SCHEDULING_GRACE)


def scheduling_waits(snap: Snapshot, now: datetime) -> list[Wait]:
    """Pods the scheduler has not placed yet, within their grace period: Progressing."""
    out = []
    for pod, message, since in _unschedulable(snap):
        until = _grace_ends(message, since)
        if until is not None and now < until:
            what = "its claim to bind" if _UNBOUND_CLAIM in message else "a node"
            out.append(Wait(_short(f"{_who(pod)} waits for {what}: {message}"), until))
    return out


def scheduling(snap: Snapshot, now: datetime | None = None) -> list[Problem]:
    """Pods the scheduler cannot place: no node matches, no GPU left, a claim is missing. With
    `now`, a pod still within its grace period (`scheduling_waits`) is no problem yet."""
    out = []
    for pod, message, since in _unschedulable(snap):
        until = _grace_ends(message, since)
        if now is not None and until is not None and now < until:
            continue
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


def _pulled_image(pod: dict[str, Any], container_image: str, detail: str) -> str:
    """What a pull failure is about: an image volume (spec.model.image) when the kubelet's
    message quotes its reference (it fails the container that mounts it), else the container's."""
    for volume in pod.get("spec", {}).get("volumes") or []:
        ref = (volume.get("image") or {}).get("reference")
        if ref and f'"{ref}' in detail:
            return f"{ref} (image volume {volume['name']})"
    return container_image


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
                image = _pulled_image(pod, cs.get("image", ""), detail)
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


def foreign_scalers(
    snap: Snapshot, owned_deployments: set[str], ours: frozenset[str] = frozenset()
) -> list[Problem]:
    """HorizontalPodAutoscalers aimed at a child Deployment: the operator sets its replicas
    from the spec on every reconcile, so the two would fight. `ours`: the HPAs KEDA made for
    this object's ScaledObjects (the operator leaves those Deployments' replicas alone)."""
    out = []
    for hpa in snap.autoscalers:
        if hpa["metadata"]["name"] in ours:
            continue
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


def suggested_name(name: str) -> str:
    """A DNS-1035 label close to `name`: lowercase, '-' for anything else, a letter first."""
    text = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-") or "atom"
    if not text[0].isalpha():
        text = f"atom-{text}"
    return text[:MAX_NAME_LENGTH].rstrip("-")


def legacy_name(name: str) -> list[Problem]:
    """A name the CRD refuses for new objects, on an object created under an earlier CRD that
    accepted it (the rule passes an unchanged name, so the object can still be patched): say
    what to do. `status` puts it in Ready's message, and makes it Degraded's reason when a
    child failed to apply (API servers that hold Service names to DNS-1035 refuse the endpoint
    Service named after it)."""
    if len(name) <= MAX_NAME_LENGTH and re.match(NAME_PATTERN, name):
        return []
    return [
        Problem(
            "InvalidName",
            f"metadata.name {name!r} is not a DNS-1035 label (at most {MAX_NAME_LENGTH} "
            "characters: lowercase letters, digits and '-', starting with a letter): an "
            "earlier CRD accepted it, the current one refuses it for new objects, and API "
            "servers that hold Service names to DNS-1035 refuse the endpoint Service named "
            "after it. This object can still be patched and deleted; to keep serving under a "
            f"valid name, create a copy named {suggested_name(name)!r} (any valid name) and "
            "delete this one",
        )
    ]


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
