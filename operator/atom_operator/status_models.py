"""AtomDeployment status models: the CRD's status schema, and what `status.compute_status`
builds (dumped by alias), so the status the operator writes cannot drift from the CRD. Also the
whole object, spec and status together.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from atom_operator.spec import GROUP, KIND, VERSION, AtomDeploymentSpec, CamelModel, opaque_object

Phase = Literal["Pending", "Progressing", "Ready", "Degraded"]


class Condition(CamelModel):
    """A standard condition."""

    type: str = Field(
        description="Ready, Progressing, Degraded, CompileCacheReady, MonitoringReady, "
        "AutoscalingReady or InferencePoolReady."
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", description="CamelCase reason.")
    message: str = Field(default="", description="Human-readable detail.")
    last_transition_time: str | None = Field(default=None, description="When status last changed.")
    observed_generation: int | None = Field(
        default=None, description="Generation this condition describes."
    )


class RoleStatus(CamelModel):
    """Observed pods of one role."""

    replicas: int = Field(default=0, description="Desired pods.")
    ready_replicas: int = Field(default=0, description="Pods ready (passed /health).")
    tensor_parallel: int | None = Field(
        default=None, description="Tensor-parallel size of each pod (runtime roles)."
    )
    updated_replicas: int = Field(default=0, description="Pods at the current revision.")
    revision: str | None = Field(default=None, description="Revision these pods serve.")


class CompileCacheStatus(CamelModel):
    """Where compiled artifacts go."""

    key: str | None = Field(
        default=None, description="Compile-cache key (role:key pairs when roles differ)."
    )
    keys: dict[str, str] | None = Field(default=None, description="Compile-cache key per role.")
    claim_name: str | None = Field(
        default=None, description="PersistentVolumeClaim holding the cache."
    )


class AtomDeploymentStatus(CamelModel):
    """Observed state, written by the operator through the status subresource only."""

    observed_generation: int | None = Field(default=None, description="Generation last reconciled.")
    phase: Phase | None = Field(
        default=None, description="Summary: Pending, Progressing, Ready or Degraded."
    )
    conditions: list[Condition] | None = Field(
        default=None,
        description="Ready, Progressing, Degraded, CompileCacheReady.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    roles: dict[str, RoleStatus] | None = Field(
        default=None, description="Per role: unified, prefill, decode, router."
    )
    compile_cache: CompileCacheStatus | None = Field(
        default=None, description="Compile cache in use."
    )
    revision: str | None = Field(default=None, description="Revision of the current spec.")
    serving_revision: str | None = Field(
        default=None, description="Revision the endpoint routes to."
    )
    endpoint: str | None = Field(
        default=None, description="In-cluster URL of the OpenAI-compatible API."
    )
    graph_mode: str | None = Field(default=None, description="Effective graph mode per role.")
    tensor_parallel: str | None = Field(
        default=None,
        description="Tensor-parallel size per pod (role=size pairs when roles differ); printer "
        "column TP.",
    )
    kv_transport: str | None = Field(
        default=None, description="KV transport asked of prefill/decode pairs (disaggregated)."
    )
    ready: str | None = Field(default=None, description="Ready roles / roles.")
    replicas: int | None = Field(default=None, description="Unified pods (scale subresource).")
    current_replicas: str | None = Field(
        default=None,
        description="Pods at the current revision per runtime role (role=count pairs when "
        "roles differ); printer column Current.",
    )
    desired_replicas: str | None = Field(
        default=None,
        description="Pods each runtime role should run (the spec's, or what the HPA asked for "
        "on an autoscaled role); printer column Desired.",
    )
    selector: str | None = Field(
        default=None, description="Label selector of unified pods (scale subresource)."
    )
    kopf: dict[str, Any] | None = opaque_object("Operator framework bookkeeping.")


class AtomDeployment(CamelModel):
    """An ATOM model server: runtime pods compiled and captured as specified."""

    api_version: str = Field(default=f"{GROUP}/{VERSION}", description="atom.dev/v1alpha1")
    kind: str = Field(default=KIND, description="AtomDeployment")
    spec: AtomDeploymentSpec
    status: AtomDeploymentStatus | None = None
