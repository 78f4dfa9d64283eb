"""The autoscaling part of the spec: a KEDA ScaledObject per scaled role, and the Gateway API
Inference Extension's InferencePool (builders/autoscaling.py renders both)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from atom_operator.spec_base import CamelModel

ScalingMetric = Literal["waitingRequestsPerReplica", "kvCacheUsage", "runningRequests"]
SCALING_METRICS: tuple[str, ...] = ScalingMetric.__args__  # type: ignore[attr-defined]
MAX_SCALE = 1000  # bounds replicas an autoscaler may ask for (and the CEL cost estimate)


class ScalingPolicy(CamelModel):
    """How KEDA (through the HPA it creates) scales one role on a metric its pods export."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.minReplicas) || self.minReplicas <= self.maxReplicas",
                    "message": "autoscaling.minReplicas must be at most autoscaling.maxReplicas",
                    "fieldPath": ".minReplicas",
                    "reason": "FieldValueInvalid",
                },
                {
                    "rule": "!has(self.metric) || self.metric != 'kvCacheUsage' "
                    "|| self.target <= 1.0",
                    "message": "autoscaling.target of kvCacheUsage is a fraction of the KV "
                    "blocks (0 < target <= 1)",
                    "fieldPath": ".target",
                    "reason": "FieldValueInvalid",
                },
            ]
        }
    )

    min_replicas: int = Field(
        default=1,
        ge=1,
        le=MAX_SCALE,
        description="Fewest pods (at least 1: the metric comes from the role's own pods).",
    )
    max_replicas: int = Field(ge=1, le=MAX_SCALE, description="Most pods.")
    metric: ScalingMetric = Field(
        default="waitingRequestsPerReplica",
        description="waitingRequestsPerReplica: requests queued in the engines (sum of "
        "vllm:num_requests_waiting over the role's ready pods) per pod; runningRequests: "
        "requests being served (vllm:num_requests_running) per pod; kvCacheUsage: mean "
        "fraction of KV blocks in use (vllm:kv_cache_usage_perc) over the role's pods.",
    )
    target: float = Field(
        gt=0,
        le=100000,
        description="Target value of the metric: requests per pod, or a fraction (0-1] for "
        "kvCacheUsage. The HPA asks for ceil(total / target) pods (ceil(pods x mean / target) "
        "for kvCacheUsage).",
    )
    scale_up_stabilization_seconds: int = Field(
        default=0,
        ge=0,
        le=3600,
        description="The HPA scales up to the lowest recommendation of this window (0: at once).",
    )
    scale_down_stabilization_seconds: int = Field(
        default=300,
        ge=0,
        le=3600,
        description="The HPA scales down to the highest recommendation of this window, so a "
        "short lull does not drop pods that compiled minutes ago.",
    )
