"""AtomDeployment spec models: the CRD's spec schema, and what the operator parses it into.

`crdgen` turns them into the OpenAPI v3 schema of `crds/atomdeployment.yaml`; the operator
parses the (API-server validated and defaulted) spec back into them. Cross-field CEL rules are
built in `crd_rules`; the status models are in `status_models`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StringConstraints

from atom_operator.autoscaling_spec import ScalingPolicy
from atom_operator.crd_rules import (
    DEFAULT_MAX_NUM_SEQS,
    GPU_RESOURCE,
    MAX_CAPTURE_SIZES,
    TENSOR_SIZES,
    spec_rules,
)
from atom_operator.lora_spec import LoRASpec

# The model's part lives in model_spec; its names stay importable from here (models.py).
from atom_operator.model_spec import Dtype as Dtype
from atom_operator.model_spec import LoadFormat as LoadFormat
from atom_operator.model_spec import ModelSource
from atom_operator.spec_base import OPAQUE, CamelModel, opaque_object

GROUP = "atom.dev"
VERSION = "v1alpha1"
KIND = "AtomDeployment"
PLURAL = "atomdeployments"
SINGULAR = "atomdeployment"
SHORT_NAMES = ["atomd"]

GraphMode = Literal["NONE", "TR_HYBRID", "FULL", "FULL_DECODE_ONLY", "FULL_AND_TR_HYBRID"]
GRAPH_MODES: tuple[str, ...] = GraphMode.__args__  # type: ignore[attr-defined]
Level = Literal[0, 1, 2, 3]
RoutingPolicy = Literal["prefix", "least-outstanding"]
Device = Literal["gpu", "cpu"]
AccessMode = Literal["ReadWriteOnce", "ReadWriteMany", "ReadOnlyMany", "ReadWriteOncePod"]
KVTransport = Literal["auto", "cuda-ipc", "nccl", "tcp"]
Quantization = Literal["none", "fp8"]
KVCacheDtype = Literal["auto", "fp8"]
KV_TRANSPORTS: tuple[str, ...] = KVTransport.__args__  # type: ignore[attr-defined]
QUANTITY = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
# Volume sources that reach the node itself (files, host binaries, git on the host).
HOST_VOLUME_TYPES = ("hostPath", "flexVolume", "gitRepo")


def _quantities(kind: str) -> dict[str, Any]:
    return {
        "type": "object",
        "description": f"Resource {kind} (any resource name; nvidia.com/gpu is checked against "
        "the tensor-parallel size).",
        "properties": {
            GPU_RESOURCE: {
                "x-kubernetes-int-or-string": True,
                "description": f"GPUs per pod ({kind}). Unset: the tensor-parallel size.",
            }
        },
        **OPAQUE,
    }


_RESOURCES: dict[str, Any] = {
    **OPAQUE,
    "properties": {"limits": _quantities("limits"), "requests": _quantities("requests")},
}


def _section(model: type, description: str) -> Any:
    """A sub-object that is always present: defaulted to {} by the API server, so its own
    field defaults apply too."""
    return Field(default_factory=model, description=description, json_schema_extra={"default": {}})


def _resources_field(description: str) -> Any:
    return Field(default=None, description=description, json_schema_extra=_RESOURCES)


class EngineSpec(CamelModel):
    """Engine shape: batch and context limits shared by every role."""

    max_num_seqs: int = Field(
        default=DEFAULT_MAX_NUM_SEQS,
        ge=1,
        le=65536,
        description="Maximum concurrent sequences per pod (--max-num-seqs); capture sizes may not exceed it.",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=1,
        le=1048576,
        description="Maximum context length in tokens (--max-model-len).",
    )
    enforce_eager: bool = Field(
        default=False,
        description="Never replay CUDA graphs (--enforce-eager); compilation still applies.",
    )


def _level_field(default: int | None) -> Any:
    return Field(
        default=default,
        description="torch.compile level: 0 none, 1 Dynamo as is, 2 Dynamo once (Inductor), "
        "3 piecewise (production default).",
    )


def _mode_field() -> Any:
    return Field(
        default=None,
        description="CUDA graph mode: NONE, TR_HYBRID (token graphs), FULL (request graphs), "
        "FULL_DECODE_ONLY, FULL_AND_TR_HYBRID. Independent of level. Unset: the runtime's default "
        "(TR_HYBRID at level 3); the decode role defaults to FULL_DECODE_ONLY.",
    )


class CompilationOverride(CamelModel):
    """Compilation settings of one role; fields left unset inherit spec.compilation."""

    level: Level | None = _level_field(None)
    cudagraph_mode: GraphMode | None = _mode_field()
    cudagraph_capture_sizes: list[int] | None = Field(
        default=None,
        max_length=MAX_CAPTURE_SIZES,
        description="Explicit batch sizes to capture (unique, 1..engine.maxNumSeqs); overrides "
        "cudaGraphSizes. Accepted and ignored when the mode is NONE.",
        json_schema_extra={
            "items": {"type": "integer", "minimum": 1},
            "x-kubernetes-list-type": "set",
        },
    )
    cuda_graph_sizes: list[int] | None = Field(
        default=None,
        max_length=MAX_CAPTURE_SIZES,
        description="One value N generates [1..8] + range(16, N+1, 16); several values are used as is.",
        json_schema_extra={"items": {"type": "integer", "minimum": 1}},
    )
    splitting_ops: list[str] | None = Field(
        default=None,
        max_length=64,
        description="Ops that split the graph for piecewise compilation (level 3).",
        json_schema_extra={"items": {"type": "string", "minLength": 1, "maxLength": 256}},
    )
    compile_sizes: list[int | str] | None = Field(
        default=None,
        max_length=MAX_CAPTURE_SIZES,
        description="Shapes compiled specially by Inductor; the string cudagraph_capture_sizes "
        "means every capture size.",
    )
    use_inductor: bool | None = Field(default=None, description="Compile pieces with Inductor.")
    inductor_compile_config: dict[str, Any] | None = opaque_object(
        "Extra Inductor options (for example max_autotune)."
    )


class Compilation(CompilationOverride):
    """Compilation and CUDA graph settings shared by every role."""

    level: Level = _level_field(3)
    use_inductor: bool = Field(default=True, description="Compile pieces with Inductor.")


def _shared_access() -> list[AccessMode]:
    return ["ReadWriteMany"]


class CompileCacheSpec(CamelModel):
    """The compile-cache volume: compiled artifacts reused across pods and restarts."""

    enabled: bool = Field(default=True, description="Mount a compile-cache volume.")
    size: str = Field(
        default="20Gi",
        pattern=QUANTITY,
        description="Requested size of the claim the operator creates.",
    )
    storage_class_name: str | None = Field(
        default=None, description="Storage class of the created claim."
    )
    access_modes: list[AccessMode] = Field(
        default_factory=_shared_access,
        min_length=1,
        description="Access modes of the created claim (several pods share one cache).",
        json_schema_extra={"default": ["ReadWriteMany"]},
    )
    existing_claim: str | None = Field(
        default=None, min_length=1, description="Use this existing claim instead of creating one."
    )
    retain_on_delete: bool = Field(
        default=True, description="Keep the created claim when the AtomDeployment is deleted."
    )
    warmup: bool = Field(
        default=False,
        description="Run a warm-up Job (atom-runtime warmup) that fills the cache before serving pods roll.",
    )


class Parallelism(CamelModel):
    """How one runtime pod splits the model over its devices."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.tensor) || self.tensor in "
                    f"[{', '.join(map(str, TENSOR_SIZES))}]",
                    "message": "parallelism.tensor must be a power of two at most 8 (1, 2, 4 or 8)",
                    "fieldPath": ".tensor",
                    "reason": "FieldValueInvalid",
                }
            ]
        }
    )

    tensor: int | None = Field(
        default=None,
        ge=1,
        le=max(TENSOR_SIZES),
        description="Tensor-parallel size: worker processes per pod, one per GPU, each holding "
        "1/N of the weights and KV heads (--tensor-parallel-size; 1, 2, 4 or 8, and it must "
        "divide the model's attention heads, KV heads and vocabulary). On device gpu the pod "
        "requests this many nvidia.com/gpu unless resources names a count, which must then be "
        "equal; on device cpu the ranks talk over gloo and no GPU is requested. Unset: 1. Part "
        "of the compile-cache key (each rank compiles into its own rank_<i> directory).",
    )


class RoleSpec(CamelModel):
    """One disaggregated role."""

    replicas: int = Field(
        default=1,
        ge=1,
        description="Pods of this role (at least 1: a disaggregated deployment without prefill "
        "or decode pods cannot serve a request; delete it to stop serving).",
    )
    compilation: CompilationOverride | None = Field(
        default=None, description="Overrides of spec.compilation for this role."
    )
    resources: dict[str, Any] | None = _resources_field(
        "Container resources of this role (default: spec.resources). nvidia.com/gpu unset: "
        "the role's tensor-parallel size."
    )
    parallelism: Parallelism | None = Field(
        default=None,
        description="Parallelism of this role's pods; an unset tensor inherits spec.parallelism.",
    )
    autoscaling: ScalingPolicy | None = Field(
        default=None,
        description="Scale this role with KEDA: a ScaledObject aimed at the role's Deployment "
        "of the current revision (the operator then leaves its replicas to the HPA; replicas "
        "above is only the count before the HPA acts). Needs KEDA's CRDs; the "
        "AutoscalingReady condition says when they are missing.",
    )


class RouterSpec(CamelModel):
    """The router that pairs prefill and decode pods of one revision."""

    replicas: int = Field(
        default=2,
        ge=1,
        description="Router pods (every disaggregated request passes a router: two by default, "
        "so a node drain or a router restart does not stop serving).",
    )
    resources: dict[str, Any] | None = opaque_object("Container resources of the router.")
    routing_policy: RoutingPolicy = Field(
        default="prefix",
        description="How the router picks a prefill pod (atom-router --routing-policy): prefix "
        "sends a request to the pod that most recently served the longest prefix of its prompt "
        "(its prefix cache holds those blocks), passing over a pod whose outstanding requests "
        "exceed 1.5x the mean + 2; least-outstanding ignores prompts. Decode pods are always "
        "balanced by outstanding requests. Not in the compile-cache key.",
    )


class Disaggregation(CamelModel):
    """Prefill and decode roles behind a router (replaces spec.replicas)."""

    prefill: RoleSpec = Field(description="The prefill role.")
    decode: RoleSpec = Field(
        description="The decode role (graph mode defaults to FULL_DECODE_ONLY)."
    )
    router: RouterSpec = _section(RouterSpec, "The router.")
    kv_transport: KVTransport = Field(
        default="auto",
        description="How decode pods pull KV blocks from prefill pods (--kv-transport on both "
        "roles, negotiated in the pair's handshake). auto: the fastest path both sides "
        "support; decode pods prefer (weighted podAffinity) a node running a prefill pod of "
        "their revision, and pairs on different nodes use TCP. cuda-ipc (GPU to GPU on one "
        "node) and nccl: decode pods require (podAffinity on kubernetes.io/hostname) a node "
        "running a prefill pod of their revision; device gpu only. tcp: TCP through host "
        "memory, no placement. Not in the compile-cache key.",
    )


class SecretKeyRef(CamelModel):
    """A key of a Secret in the AtomDeployment's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Secret name.")
    key: str = Field(
        default="api-key", min_length=1, max_length=253, description="Key in the Secret."
    )


def _peers_field(description: str) -> Any:
    return Field(
        default=None,
        description=description,
        json_schema_extra={"items": {"type": "object", **OPAQUE}},
    )


class NetworkPolicySpec(CamelModel):
    """Ingress rules the operator renders as NetworkPolicies (docs/architecture.md)."""

    enabled: bool = Field(
        default=True,
        description="Render NetworkPolicies: the KV port only from this AtomDeployment's decode "
        "pods, prefill/decode HTTP only from its router, the endpoint from endpointFrom.",
    )
    endpoint_from: list[dict[str, Any]] | None = _peers_field(
        "NetworkPolicyPeers allowed to the endpoint's port (unified pods, or the router). "
        "Unset: every pod of every namespace."
    )
    metrics_from: list[dict[str, Any]] | None = _peers_field(
        "NetworkPolicyPeers (a Prometheus) also allowed to the HTTP port of prefill and decode "
        "pods, for /metrics. Unset: only the router."
    )


class MonitoringSpec(CamelModel):
    """A Prometheus Operator PodMonitor for the runtime and router pods' /metrics."""

    enabled: bool = Field(
        default=False,
        description="Render a PodMonitor (monitoring.coreos.com/v1); when that CRD is not "
        "installed the MonitoringReady condition says so.",
    )
    interval: str = Field(
        default="30s", pattern=r"^[0-9]+(ms|s|m|h)$", description="Scrape interval."
    )
    labels: dict[str, str] | None = Field(
        default=None,
        description="Extra labels on the PodMonitor (what a Prometheus' podMonitorSelector matches).",
    )


SpecMethodName = Literal["ngram", "draft_model"]
DraftModelRef = Annotated[str, StringConstraints(min_length=1, max_length=4096)]
SpecTokens = Annotated[int, Field(ge=1, le=15)]


class NgramSpec(CamelModel):
    """The n-gram (prompt lookup) drafter's window."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.promptLookupMin) || !has(self.promptLookupMax) || "
                    "self.promptLookupMin <= self.promptLookupMax",
                    "message": "ngram.promptLookupMin must be at most ngram.promptLookupMax",
                    "fieldPath": ".promptLookupMin",
                    "reason": "FieldValueInvalid",
                }
            ]
        }
    )

    prompt_lookup_min: int = Field(default=1, ge=1, le=64, description="Shortest suffix matched.")
    prompt_lookup_max: int = Field(
        default=3, ge=1, le=64, description="Longest suffix tried first."
    )


class SpeculativeSpec(CamelModel):
    """Speculative decoding (--speculative-config) of the unified and decode roles (a prefill
    role never decodes, so it gets none)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.method != 'draft_model' || has(self.draftModel)",
                    "message": "speculative.draftModel is required for method draft_model",
                    "fieldPath": ".draftModel",
                    "reason": "FieldValueRequired",
                },
                {
                    "rule": "self.method == 'draft_model' || !has(self.draftModel)",
                    "message": "speculative.draftModel is only allowed with method draft_model",
                    "fieldPath": ".draftModel",
                    "reason": "FieldValueForbidden",
                },
                {
                    "rule": "self.method == 'ngram' || !has(self.ngram)",
                    "message": "speculative.ngram is only allowed with method ngram",
                    "fieldPath": ".ngram",
                    "reason": "FieldValueForbidden",
                },
            ]
        }
    )

    method: SpecMethodName = Field(description="ngram (prompt lookup) or draft_model.")
    # k + 1 query rows must fit one KV block (16 tokens).
    num_speculative_tokens: SpecTokens = Field(description="Draft tokens k per request per step.")
    draft_model: DraftModelRef | None = Field(
        default=None,
        description="draft_model: a built-in shape or a model directory in the container with "
        "the target's vocabulary; the target's own name self-drafts.",
    )
    ngram: NgramSpec | None = Field(default=None, description="ngram: the lookup window.")

    def runtime_json(self) -> dict[str, Any]:
        """The runtime's --speculative-config object (atom.config.SpeculativeConfig)."""
        out: dict[str, Any] = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
        }
        if self.method == "draft_model":
            out["model"] = self.draft_model
        else:
            window = self.ngram or NgramSpec()
            out["prompt_lookup_min"] = window.prompt_lookup_min
            out["prompt_lookup_max"] = window.prompt_lookup_max
        return out


class AtomDeploymentSpec(CamelModel):
    """Desired state of an ATOM model server."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {**rule} for rule in spec_rules()
            ]
        }
    )

    image: str | None = Field(
        default=None,
        min_length=1,
        description="Runtime image (default: the operator's ATOM_OPERATOR_DEFAULT_IMAGE).",
    )
    model: ModelSource = Field(description="The model to serve.")
    device: Device = Field(
        default="gpu",
        description="Where the runtime runs: gpu (parallelism.tensor nvidia.com/gpu per pod, "
        "one by default) or cpu (no GPU requested, --device cpu, graph mode NONE: an unset "
        "mode, and the decode role's "
        "FULL_DECODE_ONLY default, resolve to NONE; any other mode set on cpu is refused). "
        "Part of the compile-cache key.",
    )
    engine: EngineSpec = _section(EngineSpec, "Engine limits.")
    prefix_caching: bool = Field(
        default=True,
        description="Automatic prefix caching in every runtime pod: the KV blocks of prompt "
        "prefixes seen before are reused instead of recomputed (false renders "
        "--no-enable-prefix-caching). Not in the compile-cache key: it changes no compiled code "
        "or captured graph, only which blocks the scheduler hands out.",
    )
    quantization: Quantization = Field(
        default="none",
        description="Weight quantization (--quantization): fp8 quantizes the decoder's "
        "projection weights to float8_e4m3fn at load (per-channel scales, per-token activation "
        "scales; Hopper or newer). Part of the compile-cache key.",
    )
    kv_cache_dtype: KVCacheDtype = Field(
        default="auto",
        description="KV cache element type (--kv-cache-dtype): auto (the model's dtype) or fp8 "
        "(float8_e4m3fn, per-tensor scales: twice the tokens in the same memory). Part of the "
        "compile-cache key.",
    )
    compilation: Compilation = _section(Compilation, "Compilation level and CUDA graph settings.")
    compile_cache: CompileCacheSpec = _section(CompileCacheSpec, "Compile-cache volume.")
    replicas: int | None = Field(
        default=None,
        ge=0,
        description="Pods of the unified role (default 1). Not allowed together with disaggregation.",
    )
    disaggregation: Disaggregation | None = Field(
        default=None,
        description="Run prefill and decode roles behind a router instead of one unified role.",
    )
    resources: dict[str, Any] | None = _resources_field(
        "Container resources of runtime pods. nvidia.com/gpu unset (in limits and requests): "
        "the tensor-parallel size (one GPU by default) on device gpu; never requested on cpu."
    )
    parallelism: Parallelism = _section(
        Parallelism,
        "Parallelism of runtime pods (disaggregation.<role>.parallelism overrides it per role).",
    )
    node_selector: dict[str, str] | None = Field(
        default=None, description="Node selector of runtime pods (and of the router's)."
    )
    tolerations: list[dict[str, Any]] | None = Field(
        default=None,
        description="Tolerations of runtime pods (and of the router's).",
        json_schema_extra={"items": {"type": "object", **OPAQUE}},
    )
    affinity: dict[str, Any] | None = opaque_object(
        "Affinity of runtime pods (and of the router's)."
    )
    env: list[dict[str, Any]] | None = Field(
        default=None,
        description="Extra environment variables (EnvVar objects) of runtime pods.",
        json_schema_extra={"items": {"type": "object", **OPAQUE}},
    )
    restart_id: str | None = Field(
        default=None,
        max_length=253,
        description="Change to roll every pod (a Git-friendly rollout restart).",
    )
    shm_size: str = Field(
        default="2Gi",
        pattern=QUANTITY,
        description="Size limit of /dev/shm (a memory-backed emptyDir; it counts against the "
        "pod's memory).",
    )
    priority_class_name: str | None = Field(
        default=None, min_length=1, max_length=253, description="PriorityClass of every pod."
    )
    runtime_class_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        description="RuntimeClass of runtime pods (for example nvidia).",
    )
    topology_spread_constraints: list[dict[str, Any]] | None = Field(
        default=None,
        description="Topology spread of runtime and router pods. Unset: a soft spread over "
        "nodes (kubernetes.io/hostname, ScheduleAnyway) per role; [] for none.",
        json_schema_extra={"items": {"type": "object", **OPAQUE}},
    )
    api_key_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding the API key: env ATOM_API_KEY of runtime and router "
        "pods; /v1 endpoints then require Authorization: Bearer <key>.",
    )
    network_policy: NetworkPolicySpec = _section(
        NetworkPolicySpec, "NetworkPolicies of the children."
    )
    monitoring: MonitoringSpec = _section(MonitoringSpec, "Prometheus scraping (opt-in).")
    speculative: SpeculativeSpec | None = Field(
        default=None,
        description="Speculative decoding (n-gram or draft model) of the unified and decode roles.",
    )
    autoscaling: ScalingPolicy | None = Field(
        default=None,
        description="Scale the unified role with KEDA: a ScaledObject aimed at this "
        "AtomDeployment's scale subresource, so the HPA writes spec.replicas (tell Argo CD or "
        "Flux to ignore it: docs/autoscaling.md). Disaggregated roles scale with "
        "disaggregation.<role>.autoscaling. Needs KEDA's CRDs; the AutoscalingReady condition "
        "says when they are missing.",
    )
    lora: LoRASpec | None = Field(
        default=None,
        description="LoRA adapters served beside the base model (unified role only), each "
        "from an image or a claim mounted read-only at /lora/<name>; clients pick one by name.",
    )
    inference_pool: bool = Field(
        default=False,
        description="Render a Gateway API Inference Extension InferencePool "
        "(inference.networking.k8s.io/v1) selecting the serving pods (unified pods, or the "
        "router when disaggregated) on the HTTP port, for a GIE gateway and its endpoint picker.",
    )

    @property
    def disaggregated(self) -> bool:
        return self.disaggregation is not None

    def host_volume_types(self) -> list[str]:
        """Host-reaching volume sources in model.volume (refused unless the operator allows)."""
        return [t for t in HOST_VOLUME_TYPES if t in (self.model.volume or {})]
