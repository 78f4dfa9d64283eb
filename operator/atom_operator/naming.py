"""Names, labels and hashes shared by the builders and the status code."""

from __future__ import annotations

import hashlib
import json
from typing import Any

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_ROLE = "atom.dev/role"
LABEL_REVISION = "atom.dev/revision"
ANNOTATION_CACHE_KEY = "atom.dev/compile-cache-key"
ANNOTATION_RESTART_ID = "atom.dev/restart-id"
ANNOTATION_SERVING = "atom.dev/serving-revision"

APP_NAME = "atom"
MANAGED_BY = "atom-operator"

UNIFIED, PREFILL, DECODE, ROUTER = "unified", "prefill", "decode", "router"
HTTP_PORT = 8000
KV_PORT = 8001
CACHE_MOUNT = "/var/cache/atom"
MODEL_MOUNT = "/models"

_MAX_NAME = 63  # Service names are DNS-1035 labels


def digest(value: Any, length: int = 10) -> str:
    """Stable short hash of any JSON-able value (key order does not matter)."""
    blob = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:length]


def child_name(*parts: str) -> str:
    """Join parts with '-'; too-long names keep a hash of the full name so they stay unique."""
    name = "-".join(p for p in parts if p)
    if len(name) <= _MAX_NAME:
        return name
    suffix = digest(name, 8)
    return f"{name[: _MAX_NAME - 9].rstrip('-')}-{suffix}"


def selector_labels(
    instance: str, role: str | None = None, revision: str | None = None
) -> dict[str, str]:
    labels = {LABEL_NAME: APP_NAME, LABEL_INSTANCE: instance}
    if role:
        labels[LABEL_ROLE] = role
    if revision:
        labels[LABEL_REVISION] = revision
    return labels


def labels(
    instance: str, component: str, role: str | None = None, revision: str | None = None
) -> dict[str, str]:
    out = selector_labels(instance, role, revision)
    out[LABEL_COMPONENT] = component
    out[LABEL_MANAGED_BY] = MANAGED_BY
    return out


def selector_string(labels_: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels_.items()))


def instance_selector(instance: str) -> str:
    return selector_string({LABEL_INSTANCE: instance, LABEL_MANAGED_BY: MANAGED_BY})


def pvc_name(instance: str) -> str:
    return child_name(instance, "compile-cache")


def config_map_name(instance: str) -> str:
    return child_name(instance, "runtime")


def role_deployment_name(instance: str, role: str, revision: str | None) -> str:
    """Unified: one Deployment rolled in place. Disaggregated roles: one per revision, so both
    roles of a revision live and die together and the router can pin one revision."""
    if role == UNIFIED or role == ROUTER:
        return child_name(instance, role)
    return child_name(instance, role, revision or "")


def role_service_name(instance: str, role: str, revision: str | None) -> str:
    if role in (PREFILL, DECODE):
        return child_name(instance, role, revision or "")
    return instance  # the endpoint Service: unified pods, or the router when disaggregated


def service_url(instance: str, namespace: str, role: str, revision: str | None) -> str:
    return f"http://{service_address(instance, namespace, role, revision)}"


def service_address(instance: str, namespace: str, role: str, revision: str | None) -> str:
    """`name.namespace.svc:port`: for a headless Service, a DNS name whose A records are the
    ready pods (how atom-router finds each prefill and decode pod)."""
    return f"{role_service_name(instance, role, revision)}.{namespace}.svc:{HTTP_PORT}"
