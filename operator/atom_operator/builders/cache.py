"""The compile-cache claim and the optional warm-up Job that fills it."""

from __future__ import annotations

from typing import Any

from atom_operator import naming, runtime_args
from atom_operator.builders.common import Owner, metadata
from atom_operator.builders.runtime import pod_spec
from atom_operator.spec import AtomDeploymentSpec


def build_pvc(owner: Owner, spec: AtomDeploymentSpec) -> dict[str, Any] | None:
    """The claim the operator creates (none with existingClaim or the cache off).
    Retained claims carry no ownerReference, so garbage collection leaves them."""
    cache = spec.compile_cache
    if not cache.enabled or cache.existing_claim:
        return None
    pvc_spec: dict[str, Any] = {
        "accessModes": list(cache.access_modes),
        "resources": {"requests": {"storage": cache.size}},
    }
    if cache.storage_class_name is not None:
        pvc_spec["storageClassName"] = cache.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": metadata(
            owner,
            naming.pvc_name(owner.name),
            naming.labels(owner.name, "compile-cache"),
            owned=not cache.retain_on_delete,
        ),
        "spec": pvc_spec,
    }


def warmup_job_name(owner: Owner, spec: AtomDeploymentSpec, role: str, image: str, key: str) -> str:
    # Job templates are immutable: the name hashes the whole pod spec, so a change makes a new Job.
    return naming.child_name(
        owner.name,
        "warmup",
        naming.digest(pod_spec(owner, spec, role, image, key, command="warmup")),
    )


def build_warmup_job(
    owner: Owner, spec: AtomDeploymentSpec, role: str, image: str, key: str
) -> dict[str, Any]:
    """`atom-runtime warmup` with the role's flags: compiles and captures into the cache once,
    so serving pods start warm (one writer, many readers)."""
    pod = pod_spec(owner, spec, role, image, key, command="warmup")
    pod["restartPolicy"] = "Never"
    labels = naming.labels(owner.name, "warmup", role)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata(
            owner,
            warmup_job_name(owner, spec, role, image, key),
            labels,
            annotations={naming.ANNOTATION_CACHE_KEY: key},
        ),
        "spec": {
            "backoffLimit": 1,
            "activeDeadlineSeconds": runtime_args.startup_budget_seconds(spec, role) * 2,
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
