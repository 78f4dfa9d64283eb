"""KEDA ScaledObjects for the scaled roles, and the Gateway API Inference Extension's
InferencePool (pure builders).

The metric: KEDA's metrics-api scaler reads the Prometheus text of every ready pod behind the
role's Service (aggregateFromKubeServiceEndpoints) and sums or averages one vLLM-named series;
KEDA serves that through external.metrics.k8s.io and the HPA it creates scales the target. No
Prometheus and no metrics API of our own.

The target: the unified role scales through the AtomDeployment's scale subresource (the HPA
writes spec.replicas). A CRD has one scale subresource, so a disaggregated role's ScaledObject
aims at the role's Deployment of the current revision, whose replicas the operator then leaves
to the HPA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from atom_operator import naming
from atom_operator.autoscaling_spec import ScalingPolicy
from atom_operator.builders.common import Owner, metadata
from atom_operator.spec import GROUP, KIND, VERSION, AtomDeploymentSpec

SCALED_OBJECT_API = "keda.sh/v1alpha1"
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
# KEDA names the HPA it creates for a ScaledObject this way (unless told otherwise).
HPA_PREFIX = "keda-hpa-"
METRICS_TIMEOUT = "10s"  # per scrape of one pod's /metrics


@dataclass(frozen=True)
class MetricSource:
    series: str  # the vLLM-compatible series each runtime pod's /metrics exports
    aggregation: Literal["sum", "average"]  # over the role's ready pods
    # AverageValue: the HPA asks for ceil(sum / target) pods; Value: ceil(pods x mean / target).
    metric_type: Literal["AverageValue", "Value"]


METRICS: dict[str, MetricSource] = {
    "waitingRequestsPerReplica": MetricSource("vllm:num_requests_waiting", "sum", "AverageValue"),
    "runningRequests": MetricSource("vllm:num_requests_running", "sum", "AverageValue"),
    "kvCacheUsage": MetricSource("vllm:kv_cache_usage_perc", "average", "Value"),
}


def scaled_object_name(owner_name: str, role: str) -> str:
    return naming.child_name(owner_name, role, "autoscaler")


def scaled_roles(spec: AtomDeploymentSpec) -> dict[str, ScalingPolicy]:
    """The roles with an autoscaling policy, and their policies."""
    if spec.disaggregation is None:
        return {naming.UNIFIED: spec.autoscaling} if spec.autoscaling else {}
    roles = {naming.PREFILL: spec.disaggregation.prefill, naming.DECODE: spec.disaggregation.decode}
    return {role: r.autoscaling for role, r in roles.items() if r.autoscaling is not None}


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def build_scaled_object(
    owner: Owner, spec: AtomDeploymentSpec, role: str, policy: ScalingPolicy, revision: str
) -> dict[str, Any]:
    if role == naming.UNIFIED:
        target = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": owner.name}
        service = owner.name  # the endpoint Service: the unified pods
    else:
        target = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": naming.role_deployment_name(owner.name, role, revision),
        }
        service = naming.role_service_name(owner.name, role, revision)
    source = METRICS[policy.metric]
    # Only the host, namespace and port of the URL matter to KEDA: it reads each ready
    # endpoint of that Service at the pod's port.
    url = f"http://{service}.{owner.namespace}.svc:{naming.HTTP_PORT}/metrics"
    return {
        "apiVersion": SCALED_OBJECT_API,
        "kind": "ScaledObject",
        "metadata": metadata(
            owner,
            scaled_object_name(owner.name, role),
            naming.labels(owner.name, "autoscaler", role),
        ),
        "spec": {
            "scaleTargetRef": target,
            "minReplicaCount": policy.min_replicas,
            "maxReplicaCount": policy.max_replicas,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleUp": {
                            "stabilizationWindowSeconds": policy.scale_up_stabilization_seconds
                        },
                        "scaleDown": {
                            "stabilizationWindowSeconds": policy.scale_down_stabilization_seconds
                        },
                    }
                }
            },
            "triggers": [
                {
                    "type": "metrics-api",
                    "name": policy.metric.lower(),
                    "metricType": source.metric_type,
                    "metadata": {
                        "url": url,
                        "format": "prometheus",
                        "valueLocation": source.series,
                        "targetValue": _number(policy.target),
                        "aggregateFromKubeServiceEndpoints": "true",
                        "aggregationType": source.aggregation,
                        # KEDA's default is 3 s; a CPU pod busy with the spike took 1-2 s to
                        # answer /metrics on a loaded machine.
                        "timeout": METRICS_TIMEOUT,
                    },
                }
            ],
        },
    }


def build_scaled_objects(
    owner: Owner, spec: AtomDeploymentSpec, revision: str
) -> list[dict[str, Any]]:
    return [
        build_scaled_object(owner, spec, role, policy, revision)
        for role, policy in scaled_roles(spec).items()
    ]


def hpa_name(owner_name: str, role: str) -> str:
    return HPA_PREFIX + scaled_object_name(owner_name, role)


def inference_pool_name(owner_name: str) -> str:
    return naming.child_name(owner_name, "pool")


def build_inference_pool(owner: Owner, spec: AtomDeploymentSpec) -> dict[str, Any] | None:
    """The pool a GIE gateway routes to: the unified pods, or the router when disaggregated
    (prefill/decode pairs are the router's to make)."""
    if not spec.inference_pool:
        return None
    role = naming.ROUTER if spec.disaggregation else naming.UNIFIED
    component = "router" if spec.disaggregation else "runtime"
    selector = {**naming.selector_labels(owner.name, role), naming.LABEL_COMPONENT: component}
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": metadata(
            owner, inference_pool_name(owner.name), naming.labels(owner.name, "pool", role)
        ),
        "spec": {
            "selector": {"matchLabels": selector},
            "targetPorts": [{"number": naming.HTTP_PORT}],
        },
    }
