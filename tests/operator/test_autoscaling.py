"""Autoscaling and the InferencePool: the KEDA ScaledObjects and the pool the builders render,
the replicas a scaled role leaves to the HPA, and the conditions and printer columns the status
shows (CRDs missing, HPA not reading its metric, current and desired replicas)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from atomd_fakes import deployment, pod
from atomd_helpers import IMAGE, OWNER, spec
from pydantic import ValidationError

from atom_operator import builders, naming
from atom_operator.builders.autoscaling import hpa_name, scaled_object_name
from atom_operator.snapshot import Snapshot
from atom_operator.status import compute_status

NOW = datetime(2026, 1, 1, tzinfo=UTC)
POLICY = {"minReplicas": 1, "maxReplicas": 4, "target": 2}


def _kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def _status(s, snap: Snapshot, **kw) -> dict[str, Any]:
    p = builders.plan(OWNER, s, IMAGE, snap)
    st = compute_status(name=OWNER.name, spec=s, generation=1, snap=snap, plan=p, now=NOW, **kw)
    return st


def _conditions(st: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in st["conditions"]}


def test_unified_scaled_object_aims_at_the_scale_subresource() -> None:
    s = spec("unified", autoscaling={**POLICY, "scaleDownStabilizationSeconds": 60})
    (so,) = _kind(builders.plan(OWNER, s, IMAGE, Snapshot()).apply, "ScaledObject")
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    assert so["metadata"]["name"] == scaled_object_name("demo", naming.UNIFIED)
    assert so["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    body = so["spec"]
    assert body["scaleTargetRef"] == {
        "apiVersion": "atom.dev/v1alpha1", "kind": "AtomDeployment", "name": "demo"
    }
    assert (body["minReplicaCount"], body["maxReplicaCount"]) == (1, 4)
    behavior = body["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 60
    (trigger,) = body["triggers"]
    assert trigger["type"] == "metrics-api"
    assert trigger["metricType"] == "AverageValue"
    meta = trigger["metadata"]
    # KEDA reads every ready pod behind the endpoint Service and sums the queued requests.
    assert meta["url"] == f"http://demo.serving.svc:{naming.HTTP_PORT}/metrics"
    assert meta["format"] == "prometheus"
    assert meta["valueLocation"] == "vllm:num_requests_waiting"
    assert meta["aggregateFromKubeServiceEndpoints"] == "true"
    assert meta["aggregationType"] == "sum"
    assert meta["targetValue"] == "2"
    assert meta["timeout"] == "10s"
    # The unified Deployment keeps following spec.replicas (the HPA writes that).
    (dep,) = _kind(builders.plan(OWNER, s, IMAGE, Snapshot()).apply, "Deployment")
    assert dep["spec"]["replicas"] == 2


@pytest.mark.parametrize(
    ("metric", "series", "aggregation", "metric_type", "target"),
    [
        ("runningRequests", "vllm:num_requests_running", "sum", "AverageValue", "8"),
        ("kvCacheUsage", "vllm:kv_cache_usage_perc", "average", "Value", "0.75"),
    ],
)
def test_metric_choices(metric, series, aggregation, metric_type, target) -> None:
    s = spec("unified", autoscaling={**POLICY, "metric": metric, "target": float(target)})
    (so,) = _kind(builders.plan(OWNER, s, IMAGE, Snapshot()).apply, "ScaledObject")
    (trigger,) = so["spec"]["triggers"]
    assert trigger["metricType"] == metric_type
    assert trigger["metadata"]["valueLocation"] == series
    assert trigger["metadata"]["aggregationType"] == aggregation
    assert trigger["metadata"]["targetValue"] == target


def test_disaggregated_role_scales_its_deployment_and_leaves_replicas_to_the_hpa() -> None:
    body = spec("disaggregated").model_dump(by_alias=True, exclude_none=True)
    body["disaggregation"]["decode"]["autoscaling"] = POLICY
    s = spec(body)
    p = builders.plan(OWNER, s, IMAGE, Snapshot())
    (so,) = _kind(p.apply, "ScaledObject")  # prefill has no policy
    decode_dep = naming.role_deployment_name("demo", naming.DECODE, p.revision)
    assert so["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": decode_dep
    }
    svc = naming.role_service_name("demo", naming.DECODE, p.revision)
    assert so["spec"]["triggers"][0]["metadata"]["url"].startswith(f"http://{svc}.serving.svc:")
    deps = {d["metadata"]["name"]: d for d in _kind(p.apply, "Deployment")}
    assert "replicas" not in deps[decode_dep]["spec"]
    prefill_dep = naming.role_deployment_name("demo", naming.PREFILL, p.revision)
    assert deps[prefill_dep]["spec"]["replicas"] == 1
    assert p.autoscalers == {hpa_name("demo", naming.DECODE)}


def test_disaggregated_status_desires_what_the_hpa_set_and_knows_its_hpa() -> None:
    body = spec("disaggregated").model_dump(by_alias=True, exclude_none=True)
    body["disaggregation"]["decode"]["autoscaling"] = POLICY
    s = spec(body)
    rev = builders.plan(OWNER, s, IMAGE, Snapshot()).revision
    name = naming.role_deployment_name("demo", naming.DECODE, rev)
    dep = deployment({"kind": "Deployment", "metadata": {"name": name}, "spec": {"replicas": 3}})
    hpa = {
        "metadata": {"name": hpa_name("demo", naming.DECODE)},
        "spec": {"scaleTargetRef": {"kind": "Deployment", "name": name}},
        "status": {"currentReplicas": 2, "desiredReplicas": 3,
                   "conditions": [{"type": "ScalingActive", "status": "True"}]},
    }  # fmt: skip
    pods = [pod(naming.DECODE, rev, name=f"d{i}") for i in range(2)]
    st = _status(s, Snapshot(deployments=[dep], pods=pods, autoscalers=[hpa]))
    assert st["roles"]["decode"]["replicas"] == 3
    assert st["desiredReplicas"] == "prefill=1,decode=3"
    assert st["currentReplicas"] == "prefill=0,decode=2"
    cond = _conditions(st)
    assert cond["AutoscalingReady"]["status"] == "True"
    assert "decode 2->3 pods (1..4) on waitingRequestsPerReplica" in cond[
        "AutoscalingReady"]["message"]
    # KEDA's own HPA on our Deployment is not a foreign autoscaler.
    assert cond["Degraded"]["reason"] != "AutoscalerOnChild"


def test_keda_missing_is_a_condition_not_a_failure() -> None:
    s = spec("unified", autoscaling=POLICY)
    st = _status(s, Snapshot(), missing_kinds=frozenset({"ScaledObject"}))
    cond = _conditions(st)
    assert cond["AutoscalingReady"]["status"] == "False"
    assert cond["AutoscalingReady"]["reason"] == "KEDANotInstalled"
    assert cond["Degraded"]["status"] == "False"
    assert "AutoscalingReady" not in _conditions(_status(spec("unified"), Snapshot()))


def test_hpa_that_cannot_read_its_metric_is_reported() -> None:
    s = spec("unified", autoscaling=POLICY)
    hpa = {
        "metadata": {"name": hpa_name("demo", naming.UNIFIED)},
        "spec": {"scaleTargetRef": {"kind": "AtomDeployment", "name": "demo"}},
        "status": {"conditions": [{"type": "ScalingActive", "status": "False",
                                   "reason": "FailedGetExternalMetric",
                                   "message": "unable to get external metric"}]},
    }  # fmt: skip
    cond = _conditions(_status(s, Snapshot(autoscalers=[hpa])))["AutoscalingReady"]
    assert (cond["status"], cond["reason"]) == ("False", "FailedGetExternalMetric")
    waiting = _conditions(_status(s, Snapshot()))["AutoscalingReady"]
    assert waiting["reason"] == "WaitingForHPA"
    # No HPA because KEDA refused the ScaledObject: its reason and message.
    refused = {
        "metadata": {"name": scaled_object_name("demo", naming.UNIFIED)},
        "status": {"conditions": [{"type": "Ready", "status": "False",
                                   "reason": "ScaledObjectCheckFailed",
                                   "message": "the spec replicas field does not exist"}]},
    }  # fmt: skip
    cond = _conditions(_status(s, Snapshot(scaled_objects=[refused])))["AutoscalingReady"]
    assert (cond["status"], cond["reason"]) == ("False", "ScaledObjectCheckFailed")
    assert "spec replicas field" in cond["message"]


def test_inference_pool_selects_the_serving_pods() -> None:
    assert _kind(builders.plan(OWNER, spec("unified"), IMAGE, Snapshot()).apply,
                 "InferencePool") == []  # fmt: skip
    (pool,) = _kind(
        builders.plan(OWNER, spec("unified", inferencePool=True), IMAGE, Snapshot()).apply,
        "InferencePool",
    )
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["targetPorts"] == [{"number": naming.HTTP_PORT}]
    sel = pool["spec"]["selector"]["matchLabels"]
    assert sel == {**naming.selector_labels("demo", naming.UNIFIED),
                   naming.LABEL_COMPONENT: "runtime"}  # fmt: skip
    (pd,) = _kind(
        builders.plan(OWNER, spec("disaggregated", inferencePool=True), IMAGE, Snapshot()).apply,
        "InferencePool",
    )
    assert pd["spec"]["selector"]["matchLabels"][naming.LABEL_ROLE] == naming.ROUTER
    st = _status(spec("unified", inferencePool=True), Snapshot(),
                 missing_kinds=frozenset({"InferencePool"}))  # fmt: skip
    assert _conditions(st)["InferencePoolReady"]["reason"] == "InferencePoolCRDMissing"


def test_policy_validation() -> None:
    with pytest.raises(ValidationError):
        spec("unified", autoscaling={"maxReplicas": 2})  # no target
    with pytest.raises(ValidationError):
        spec("unified", autoscaling={**POLICY, "target": 0})
    with pytest.raises(ValidationError):
        spec("unified", autoscaling={**POLICY, "metric": "queueDepth"})
