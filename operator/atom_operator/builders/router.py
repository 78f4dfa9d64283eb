"""The router Deployment that pairs prefill and decode pods of one revision."""

from __future__ import annotations

from typing import Any

from atom_operator import naming
from atom_operator.builders.common import Owner, metadata
from atom_operator.builders.runtime import (
    api_key_env,
    container_security_context,
    pod_security_context,
    spread,
    with_default_requests,
)
from atom_operator.builders.secret import token_env
from atom_operator.spec import AtomDeploymentSpec

# An asyncio proxy: one core and a little memory carry thousands of streams.
ROUTER_CPU = "500m"
ROUTER_MEMORY = "1Gi"


def router_args(owner: Owner, revision: str, routing_policy: str = "prefix") -> list[str]:
    """DNS names of the revision's headless role Services: the router balances over their pods
    (each request needs one prefill pod and one decode pod, not a Service's random pick).
    --routing-policy is rendered only when it is not the router's default (prefix)."""
    policy = [] if routing_policy == "prefix" else ["--routing-policy", routing_policy]
    return [
        "--prefill",
        naming.service_address(owner.name, owner.namespace, naming.PREFILL, revision),
        "--decode",
        naming.service_address(owner.name, owner.namespace, naming.DECODE, revision),
        "--port",
        str(naming.HTTP_PORT),
        *policy,
    ]


def build_router_deployment(
    owner: Owner, spec: AtomDeploymentSpec, image: str, serving_revision: str
) -> dict[str, Any]:
    """Router pinned to `serving_revision`; switching revision rolls the router (maxUnavailable 0)."""
    assert spec.disaggregation is not None
    router = spec.disaggregation.router
    container: dict[str, Any] = {
        "name": "router",
        "image": image,
        "command": ["atom-router"],
        "args": router_args(owner, serving_revision, router.routing_policy),
        "ports": [{"name": "http", "containerPort": naming.HTTP_PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 5},
        # A TCP check, not /health: that one is 503 while no backend is healthy, and
        # restarting the router would not bring a backend back.
        "livenessProbe": {
            "tcpSocket": {"port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 3,
            "timeoutSeconds": 5,
        },
        "securityContext": {**container_security_context(), "readOnlyRootFilesystem": True},
        "env": [{"name": "HOME", "value": "/tmp"}, token_env(owner.name), *api_key_env(spec)],
        "resources": with_default_requests(router.resources or {}, ROUTER_CPU, ROUTER_MEMORY),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    pod: dict[str, Any] = {
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}],
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "topologySpreadConstraints": spread(spec, owner.name, naming.ROUTER),
    }
    if spec.priority_class_name:
        pod["priorityClassName"] = spec.priority_class_name
    labels = naming.labels(owner.name, "router", naming.ROUTER, serving_revision)
    # The router goes where its runtime pods may go (a tainted or dedicated pool included).
    for key, value in (
        ("nodeSelector", spec.node_selector),
        ("tolerations", spec.tolerations),
        ("affinity", spec.affinity),
    ):
        if value:
            pod[key] = value
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(
            owner,
            naming.role_deployment_name(owner.name, naming.ROUTER, None),
            labels,
            annotations={naming.ANNOTATION_SERVING: serving_revision},
        ),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": naming.selector_labels(owner.name, naming.ROUTER)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "revisionHistoryLimit": 3,
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
