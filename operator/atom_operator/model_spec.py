"""spec.model: which model the runtime serves and where its weights come from.

One source of weights, at most: an OCI image mounted read-only as an image volume, an existing
claim mounted read-only, or a model built into the runtime image. The fields from before the
sources (name, path, volume) keep their meaning, so stored objects stay valid; `crd_rules`
refuses the contradictions between the two. `runtime_args` renders --model from this, and
`builders.model` the volume and its mount.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from atom_operator.crd_rules import model_rules, source_path_rule
from atom_operator.spec_base import CamelModel, opaque_object

LoadFormat = Literal["auto", "safetensors", "dummy"]
Dtype = Literal["bfloat16", "float16", "float32", "auto"]
PullPolicy = Literal["Always", "IfNotPresent", "Never"]
SourceKind = Literal["image", "claim", "builtin"]
MAX_PATH = 4096  # bounds the CEL cost of the path rules


def _source_path(where: str) -> Any:
    return Field(
        default=None,
        min_length=1,
        max_length=MAX_PATH,
        description=f"The weights inside the {where}, relative to its root: a GGUF file, or a "
        "directory holding one GGUF or config.json with safetensors. Unset: the root itself "
        "(which then holds one GGUF file, or config.json).",
    )


class ModelImage(CamelModel):
    """Weights delivered as an OCI image (a "model car"): mounted read-only at /models as a
    Kubernetes image volume, pulled by the kubelet like any image. The image needs no shell or
    OS: FROM scratch plus the weights is enough."""

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": [{**source_path_rule("image")}]}
    )

    reference: str = Field(
        min_length=1,
        max_length=MAX_PATH,
        description="Image reference, for example registry.example.com/models/smollm2:1 or "
        "...@sha256:<digest>. A digest pins the weights and is what enters the compile-cache "
        "key; without one the reference itself does.",
    )
    path: str | None = _source_path("image")
    pull_policy: PullPolicy | None = Field(
        default=None,
        description="Always, IfNotPresent or Never. Unset: Kubernetes' default (Always for "
        ":latest or no tag, else IfNotPresent). A failed pull is reported as Degraded with "
        "reason ImagePullFailed.",
    )


class ModelClaim(CamelModel):
    """Weights on an existing PersistentVolumeClaim of the AtomDeployment's namespace,
    mounted read-only at /models."""

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": [{**source_path_rule("claim")}]}
    )

    name: str = Field(
        min_length=1, max_length=253, description="Name of the PersistentVolumeClaim."
    )
    path: str | None = _source_path("claim")


class ModelSource(CamelModel):
    """Which model the runtime serves and where its weights come from: one of image, claim or
    builtin (or, as before them, name alone for a built-in random-weight shape, or path with
    any volume)."""

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": [{**rule} for rule in model_rules()]}
    )

    name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        description="The name clients send as the model (--served-model-name) when image, "
        "claim, builtin or path is set. Alone: a built-in shape with random weights (for "
        "example llama-3.2-1b, with loadFormat dummy).",
    )
    image: ModelImage | None = Field(
        default=None,
        description="Source of weights: an OCI image mounted read-only as an image volume.",
    )
    claim: ModelClaim | None = Field(
        default=None,
        description="Source of weights: an existing PersistentVolumeClaim mounted read-only.",
    )
    builtin: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="Source of weights: a model packaged in the runtime image itself, by name "
        "(smollm2-135m-instruct: SmolLM2-135M-Instruct, a Q4_1 GGUF). No volume is mounted.",
    )
    path: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_PATH,
        description="Directory inside the container with config.json and safetensors weights, "
        "or a GGUF file (typically under /models, where volume is mounted). Passed as --model. "
        "Not with image, claim or builtin (use their own path).",
    )
    load_format: LoadFormat = Field(
        default="auto",
        description="Weight format: auto (GGUF or safetensors, from the files), safetensors, "
        "or dummy (random weights, no files; not with image, claim or builtin).",
    )
    dtype: Dtype = Field(default="bfloat16", description="Model dtype (--dtype).")
    volume: dict[str, Any] | None = opaque_object(
        "Any PodSpec volume source (for example persistentVolumeClaim or hostPath) holding the "
        "weights; mounted read-only at /models. Not with image, claim or builtin."
    )

    @property
    def source(self) -> SourceKind | None:
        """The source of weights set (CEL allows at most one), None for the fields before them."""
        if self.image is not None:
            return "image"
        if self.claim is not None:
            return "claim"
        if self.builtin is not None:
            return "builtin"
        return None
