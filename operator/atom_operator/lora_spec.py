"""spec.lora: LoRA adapters the runtime serves next to the base model (--lora-modules).

Each adapter is a PEFT directory (adapter_config.json + adapter_model.safetensors) delivered
like the model's weights: an OCI image mounted read-only as an image volume, or an existing
claim mounted read-only. Clients pick one by sending its name as the model.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field

from atom_operator.model_spec import ModelClaim, ModelImage
from atom_operator.spec_base import CamelModel

LORA_MOUNT = "/lora"  # adapter <name> is mounted at /lora/<name>
ADAPTER_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # a DNS label: also its volume's name


class LoRAAdapterSpec(CamelModel):
    """One adapter: its name (the model name clients send) and exactly one source."""

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": [{
            "rule": "has(self.image) != has(self.claim)",
            "message": "a LoRA adapter needs exactly one of image or claim",
        }]}
    )

    name: str = Field(min_length=1, max_length=50, pattern=ADAPTER_NAME,
                      description="The adapter's model name (a DNS label).")
    image: ModelImage | None = Field(
        default=None, description="The adapter as an OCI image, mounted read-only.")
    claim: ModelClaim | None = Field(
        default=None, description="The adapter on an existing claim, mounted read-only.")

    def subpath(self) -> str | None:
        source = self.image if self.image is not None else self.claim
        return source.path if source is not None else None


class LoRASpec(CamelModel):
    """Multi-LoRA serving (--lora-modules, --max-loras, --max-lora-rank)."""

    adapters: list[LoRAAdapterSpec] = Field(
        default_factory=list, max_length=64,
        description="Adapters loaded at start (names unique), each served as a model.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    max_loras: int | None = Field(
        default=None, ge=1, description="Adapters resident at once (default: the number of "
        "adapters, at least 1). Part of the compile-cache key.")
    max_lora_rank: int | None = Field(
        default=None, ge=1, le=512,
        description="Largest adapter rank (default 16). Part of the compile-cache key.")

    def runtime_args(self) -> list[str]:
        """--lora-modules name=/lora/<name>[/path] (or --enable-lora with none), and the
        slot budget when set."""
        args: list[str] = []
        if self.adapters:
            modules = []
            for a in self.adapters:
                sub = (a.subpath() or "").strip("/")
                modules.append(f"{a.name}={LORA_MOUNT}/{a.name}" + (f"/{sub}" if sub else ""))
            args += ["--lora-modules", *modules]
        else:
            args.append("--enable-lora")
        if self.max_loras is not None:
            args += ["--max-loras", str(self.max_loras)]
        if self.max_lora_rank is not None:
            args += ["--max-lora-rank", str(self.max_lora_rank)]
        return args
