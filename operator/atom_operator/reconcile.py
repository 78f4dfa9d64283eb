"""One level-triggered reconcile: observe children, apply the plan, prune, write status.

Called by every Kopf trigger (create, update, resume, timer); it never reads a diff, so any
trigger converges the same way, and a restart mid-way just runs it again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from atom_operator import builders, naming, status
from atom_operator.applied import AppliedCache
from atom_operator.builders import Owner, Plan
from atom_operator.kube import ApiError, Kube
from atom_operator.models import AtomDeploymentSpec
from atom_operator.snapshot import Snapshot

APPLIED = AppliedCache()


@dataclass
class Result:
    plan: Plan
    status: dict[str, Any]
    applied: int = 0
    deleted: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0


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
        pvc=kube.get("PersistentVolumeClaim", ns, claim) if claim else None,
    )


def reconcile(
    kube: Kube,
    *,
    name: str,
    namespace: str,
    uid: str,
    generation: int,
    spec_body: dict[str, Any],
    previous_status: dict[str, Any] | None,
    default_image: str,
    logger: logging.Logger,
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
    image = spec.image or default_image
    claim = builders.runtime.claim_name(owner, spec)
    snap = observe(kube, owner, claim)
    plan = builders.plan(owner, spec, image, snap)

    result = Result(plan=plan, status={})
    observed = snap.by_key()
    for obj in plan.apply:
        if APPLIED.unchanged(obj, observed.get((obj["kind"], obj["metadata"]["name"]))):
            continue
        try:
            APPLIED.record(obj, kube.apply(obj))
            result.applied += 1
        except ApiError as exc:
            # One refused child (say, a PVC that cannot shrink) must not block the others.
            msg = f"{obj['kind']} {obj['metadata']['name']}: {exc.message}"
            logger.warning("apply failed: %s", msg)
            result.errors.append(msg)

    # Prune what the plan no longer wants; never PVCs: the compile cache outlives revisions.
    for kind, items in (
        ("Deployment", snap.deployments),
        ("Service", snap.services),
        ("ConfigMap", snap.config_maps),
        ("Job", snap.jobs),
    ):
        for item in items:
            item_name = item["metadata"]["name"]
            if (kind, item_name) not in plan.keep and not item["metadata"].get("deletionTimestamp"):
                kube.delete(kind, namespace, item_name)
                APPLIED.forget(kind, namespace, item_name)
                result.deleted.append(f"{kind}/{item_name}")
    if result.deleted:
        logger.info("pruned %s", ", ".join(result.deleted))

    result.status = status.compute_status(
        name=name,
        spec=spec,
        generation=generation,
        snap=snap,
        plan=plan,
        now=datetime.now(UTC),
        previous_conditions=(previous_status or {}).get("conditions"),
        apply_errors=result.errors,
    )
    result.seconds = time.monotonic() - started
    return result
