"""Runtime pods: pod template, Deployment and Services of a role, the flags ConfigMap."""

from __future__ import annotations

import copy
import math
from typing import Any

from atom_operator import naming, runtime_args
from atom_operator.builders.common import Owner, metadata
from atom_operator.builders.lora import lora_mounts, lora_volumes
from atom_operator.builders.model import model_mount, model_volume
from atom_operator.builders.secret import token_env
from atom_operator.crd_rules import CO_LOCATED_TRANSPORTS, GPU_RESOURCE
from atom_operator.spec import AtomDeploymentSpec

# Filled in where the spec leaves them out, so runtime pods are never BestEffort (first to be
# evicted, each restart repaying compile and capture). Memory request = limit: the kubelet
# does not pick such a pod first under memory pressure. Fixed, not derived from the model:
# the weights live on the GPU and their size is unknown here (a path on a volume); the host
# side is torch, the CUDA context, tokenizer, compiled code, staging buffers and /dev/shm.
DEFAULT_CPU = "2"
DEFAULT_MEMORY = "16Gi"
# device cpu: no GPU is ever requested, and a smaller default so a few pods fit one real node
# (the API-server and engine-core processes of a small model, with compile headroom).
CPU_DEVICE_CPU = "250m"
CPU_DEVICE_MEMORY = "3Gi"
HOSTNAME = "kubernetes.io/hostname"
CO_LOCATION_WEIGHT = 100  # the most a preferred term can weigh
RUNTIME_UID = 10001  # the image's `atom` user (Dockerfile ARG UID): its home and passwd entry
PROBE_PERIOD_S = 10
# SIGTERM handling (CONTRACTS.md): preStop sleep lets endpoints drop the pod first, then the
# runtime drains in-flight streams (--drain-seconds, 30 by default), then a margin.
PRESTOP_SLEEP_S = 5
DRAIN_SECONDS = 30
GRACE_MARGIN_S = 10
TERMINATION_GRACE_S = PRESTOP_SLEEP_S + DRAIN_SECONDS + GRACE_MARGIN_S


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUNTIME_UID,
        "runAsGroup": RUNTIME_UID,
        "fsGroup": RUNTIME_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def with_default_requests(resources: dict[str, Any], cpu: str, memory: str) -> dict[str, Any]:
    """`resources` with a CPU and memory request and a memory limit wherever it sets none
    (a limit alone implies the same request; a request alone becomes the limit too)."""
    requests = dict(resources.get("requests") or {})
    limits = dict(resources.get("limits") or {})
    if "cpu" not in requests and "cpu" not in limits:
        requests["cpu"] = cpu
    if "memory" not in requests and "memory" not in limits:
        requests["memory"] = memory
    limits.setdefault("memory", requests.get("memory", memory))
    return {**resources, "requests": requests, "limits": limits}


def role_resources(spec: AtomDeploymentSpec, role: str) -> dict[str, Any]:
    own = None
    if spec.disaggregation is not None and role in (naming.PREFILL, naming.DECODE):
        own = getattr(spec.disaggregation, role).resources
    if own is None:
        own = spec.resources if spec.resources is not None else {}
    if spec.device == "cpu":
        return with_default_requests(_without_gpu(own), CPU_DEVICE_CPU, CPU_DEVICE_MEMORY)
    gpus = with_gpus(own, runtime_args.tensor_size(spec, role))
    return with_default_requests(gpus, DEFAULT_CPU, DEFAULT_MEMORY)


def with_gpus(resources: dict[str, Any], count: int) -> dict[str, Any]:
    """`resources` with an nvidia.com/gpu limit of `count` (the tensor-parallel size) unless
    it names a GPU count itself (CEL keeps that equal to an explicit tensor size)."""
    limits = dict(resources.get("limits") or {})
    if GPU_RESOURCE in limits or GPU_RESOURCE in (resources.get("requests") or {}):
        return resources
    limits[GPU_RESOURCE] = count
    return {**resources, "limits": limits}


def _without_gpu(resources: dict[str, Any]) -> dict[str, Any]:
    return {
        kind: {k: v for k, v in amounts.items() if k != GPU_RESOURCE}
        for kind, amounts in resources.items()
        if isinstance(amounts, dict)
    }


def api_key_env(spec: AtomDeploymentSpec) -> list[dict[str, Any]]:
    ref = spec.api_key_secret_ref
    if ref is None:
        return []
    key_ref = {"name": ref.name, "key": ref.key}
    return [{"name": "ATOM_API_KEY", "valueFrom": {"secretKeyRef": key_ref}}]


def spread(spec: AtomDeploymentSpec, instance: str, role: str) -> list[dict[str, Any]]:
    """Soft spread of a role's pods over nodes (all revisions together), unless the spec
    says otherwise: two replicas on one GPU node share its failure."""
    if spec.topology_spread_constraints is not None:
        return spec.topology_spread_constraints
    return [
        {
            "maxSkew": 1,
            "topologyKey": HOSTNAME,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": naming.selector_labels(instance, role)},
        }
    ]


def co_location(spec: AtomDeploymentSpec, instance: str, role: str) -> dict[str, Any] | None:
    """The podAffinity that puts a decode pod on a node running a prefill pod of the same
    AtomDeployment and revision (matchLabelKeys takes the pod's own revision label), so a
    pair can move KV blocks GPU to GPU: required for cuda-ipc and nccl, preferred for auto
    (pairs on different nodes fall back to TCP), none for tcp. Prefill pods carry no
    affinity: they keep the role's spread, and decode pods follow them. The role's spread
    still applies within the nodes the affinity allows."""
    if spec.disaggregation is None or role != naming.DECODE:
        return None
    transport = spec.disaggregation.kv_transport
    if transport == "tcp":
        return None
    term = {
        "labelSelector": {"matchLabels": naming.selector_labels(instance, naming.PREFILL)},
        "matchLabelKeys": [naming.LABEL_REVISION],
        "topologyKey": HOSTNAME,
    }
    if transport in CO_LOCATED_TRANSPORTS:
        return {"requiredDuringSchedulingIgnoredDuringExecution": [term]}
    return {
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": CO_LOCATION_WEIGHT, "podAffinityTerm": term}
        ]
    }


def pod_affinity(spec: AtomDeploymentSpec, instance: str, role: str) -> dict[str, Any] | None:
    """spec.affinity with the role's co-location terms appended to its podAffinity."""
    extra = co_location(spec, instance, role)
    if extra is None:
        return spec.affinity or None
    affinity = copy.deepcopy(spec.affinity or {})
    pod = affinity.setdefault("podAffinity", {})
    for key, terms in extra.items():
        pod[key] = [*pod.get(key, []), *terms]
    return affinity


def cache_dir(spec: AtomDeploymentSpec, key: str) -> str | None:
    return f"{naming.CACHE_MOUNT}/{key}" if spec.compile_cache.enabled else None


def claim_name(owner: Owner, spec: AtomDeploymentSpec) -> str | None:
    if not spec.compile_cache.enabled:
        return None
    return spec.compile_cache.existing_claim or naming.pvc_name(owner.name)


def runtime_container(
    owner_name: str,
    spec: AtomDeploymentSpec,
    role: str,
    image: str,
    key: str,
    *,
    command: str = "serve",
) -> dict[str, Any]:
    """The runtime container; `warmup` gets the same flags and no probes."""
    args = runtime_args.render_args(spec, role, cache_dir=cache_dir(spec, key), command=command)
    ports = [{"name": "http", "containerPort": naming.HTTP_PORT, "protocol": "TCP"}]
    if role in (naming.PREFILL, naming.DECODE):
        ports.append({"name": "kv", "containerPort": naming.KV_PORT, "protocol": "TCP"})
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if spec.compile_cache.enabled:
        mounts.append({"name": "compile-cache", "mountPath": naming.CACHE_MOUNT})
    model = model_mount(spec.model)
    if model is not None:
        mounts.append(model)
    if role == naming.UNIFIED:
        mounts += lora_mounts(spec.lora)
    env = [{"name": "HOME", "value": "/tmp"}, *api_key_env(spec)]  # arbitrary non-root uid
    if role in (naming.PREFILL, naming.DECODE):
        # The KV port binds to the pod IP (--kv-host $(POD_IP)), never 0.0.0.0; only the
        # router's token lets a request steer a KV transfer.
        pod_ip = {"fieldRef": {"fieldPath": "status.podIP"}}
        env += [{"name": "POD_IP", "valueFrom": pod_ip}, token_env(owner_name)]
    env += spec.env or []
    container: dict[str, Any] = {
        "name": "runtime",
        "image": image,
        "command": ["atom-runtime"],
        "args": args,
        "ports": ports,
        "env": env,
        "resources": role_resources(spec, role),
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
    }
    if command == "serve":
        budget = runtime_args.startup_budget_seconds(spec, role)
        # /health is 503 until compile + capture finish: the startup probe waits that long,
        # then readiness keeps traffic off a pod that stops serving.
        container["startupProbe"] = {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": math.ceil(budget / PROBE_PERIOD_S),
            "timeoutSeconds": 5,
        }
        container["readinessProbe"] = {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 3,
            "timeoutSeconds": 5,
        }
        # /livez fails when the engine loop is hung or its core died (not during a long
        # compile: liveness starts only once the startup probe passed).
        container["livenessProbe"] = {
            "httpGet": {"path": "/livez", "port": "http"},
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": 3,
            "timeoutSeconds": 5,
        }
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}}
    return container


def pod_volumes(owner: Owner, spec: AtomDeploymentSpec) -> list[dict[str, Any]]:
    dshm = {"medium": "Memory", "sizeLimit": spec.shm_size}
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": dshm}]
    claim = claim_name(owner, spec)
    if claim:
        volumes.append({"name": "compile-cache", "persistentVolumeClaim": {"claimName": claim}})
    model = model_volume(spec.model)
    if model is not None:
        volumes.append(model)
    return volumes + lora_volumes(spec.lora)


def pod_spec(
    owner: Owner,
    spec: AtomDeploymentSpec,
    role: str,
    image: str,
    key: str,
    *,
    command: str = "serve",
) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "securityContext": pod_security_context(),
        "containers": [runtime_container(owner.name, spec, role, image, key, command=command)],
        "volumes": pod_volumes(owner, spec),
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # the runtime never calls the API
    }
    if command == "serve":
        pod["topologySpreadConstraints"] = spread(spec, owner.name, role)
    if spec.priority_class_name:
        pod["priorityClassName"] = spec.priority_class_name
    if spec.runtime_class_name:
        pod["runtimeClassName"] = spec.runtime_class_name
    if spec.node_selector:
        pod["nodeSelector"] = spec.node_selector
    if spec.tolerations:
        pod["tolerations"] = spec.tolerations
    # Warm-up pods run before any prefill pod exists: no co-location for them.
    affinity = pod_affinity(spec, owner.name, role) if command == "serve" else spec.affinity
    if affinity:
        pod["affinity"] = affinity
    return pod


def pod_template(
    owner: Owner, spec: AtomDeploymentSpec, role: str, image: str, key: str
) -> dict[str, Any]:
    """The role's pod template without the revision label (the revision is its hash)."""
    annotations = {naming.ANNOTATION_CACHE_KEY: key}
    if spec.restart_id:
        annotations[naming.ANNOTATION_RESTART_ID] = spec.restart_id
    return {
        "metadata": {
            "labels": naming.labels(owner.name, "runtime", role),
            "annotations": annotations,
        },
        "spec": pod_spec(owner, spec, role, image, key),
    }


def with_revision(template: dict[str, Any], revision: str) -> dict[str, Any]:
    labels = {**template["metadata"]["labels"], naming.LABEL_REVISION: revision}
    return {**template, "metadata": {**template["metadata"], "labels": labels}}


def build_role_deployment(
    owner: Owner,
    spec: AtomDeploymentSpec,
    role: str,
    template: dict[str, Any],
    revision: str,
) -> dict[str, Any]:
    """Unified: one Deployment rolled in place. Prefill/decode: one Deployment per revision."""
    per_revision = role in (naming.PREFILL, naming.DECODE)
    selector = naming.selector_labels(owner.name, role, revision if per_revision else None)
    budget = runtime_args.startup_budget_seconds(spec, role)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(
            owner,
            naming.role_deployment_name(owner.name, role, revision),
            naming.labels(owner.name, "runtime", role, revision),
            annotations={
                naming.ANNOTATION_CACHE_KEY: template["metadata"]["annotations"][
                    naming.ANNOTATION_CACHE_KEY
                ]
            },
        ),
        "spec": {
            "replicas": runtime_args.role_replicas(spec, role),
            "selector": {"matchLabels": selector},
            # New pods must pass /health (compiled and captured) before an old one goes.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "progressDeadlineSeconds": budget + 300,
            "revisionHistoryLimit": 3,
            "template": with_revision(template, revision),
        },
    }


def build_role_service(owner: Owner, role: str, revision: str) -> dict[str, Any]:
    """Per-revision headless Service of a disaggregated role: its DNS name resolves to the
    revision's ready pods, which the router balances over (one revision, never a mix)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(
            owner,
            naming.role_service_name(owner.name, role, revision),
            naming.labels(owner.name, "runtime", role, revision),
        ),
        "spec": {
            "type": "ClusterIP",
            "clusterIP": "None",
            "selector": naming.selector_labels(owner.name, role, revision),
            "ports": [
                {"name": "http", "port": naming.HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                {"name": "kv", "port": naming.KV_PORT, "targetPort": "kv", "protocol": "TCP"},
            ],
        },
    }


def build_endpoint_service(owner: Owner, spec: AtomDeploymentSpec) -> dict[str, Any]:
    """The Service clients use: unified pods, or the router when disaggregated."""
    role = naming.ROUTER if spec.disaggregation else naming.UNIFIED
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, owner.name, naming.labels(owner.name, "endpoint", role)),
        "spec": {
            "type": "ClusterIP",
            "selector": naming.selector_labels(owner.name, role),
            "ports": [
                {"name": "http", "port": naming.HTTP_PORT, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def build_config_map(
    owner: Owner,
    spec: AtomDeploymentSpec,
    image: str,
    keys: dict[str, str],
    revision: str,
    router_args: list[str] | None,
) -> dict[str, Any]:
    """The rendered runtime flags per role, for people and tools to read (`kubectl get cm`)."""
    data = {"revision": revision, "image": image}
    for role, key in keys.items():
        data[f"{role}.args"] = runtime_args.command_line(
            runtime_args.render_args(spec, role, cache_dir=cache_dir(spec, key))
        )
        data[f"{role}.cache-key"] = key
    if router_args is not None:
        data["router.args"] = " ".join(["atom-router", *router_args])
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(
            owner, naming.config_map_name(owner.name), naming.labels(owner.name, "config")
        ),
        "data": data,
    }
