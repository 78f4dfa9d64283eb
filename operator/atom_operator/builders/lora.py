"""spec.lora rendered: one read-only volume per adapter, mounted at /lora/<name> (the flags:
LoRASpec.runtime_args)."""

from __future__ import annotations

from typing import Any

from atom_operator.lora_spec import LORA_MOUNT, LoRAAdapterSpec, LoRASpec


def _volume_name(adapter: LoRAAdapterSpec) -> str:
    return f"lora-{adapter.name}"


def lora_volumes(lora: LoRASpec | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for adapter in lora.adapters if lora is not None else []:
        if adapter.image is not None:
            image: dict[str, Any] = {"reference": adapter.image.reference}
            if adapter.image.pull_policy is not None:
                image["pullPolicy"] = adapter.image.pull_policy
            out.append({"name": _volume_name(adapter), "image": image})
        elif adapter.claim is not None:
            claim = {"claimName": adapter.claim.name, "readOnly": True}
            out.append({"name": _volume_name(adapter), "persistentVolumeClaim": claim})
    return out


def lora_mounts(lora: LoRASpec | None) -> list[dict[str, Any]]:
    return [{"name": _volume_name(a), "mountPath": f"{LORA_MOUNT}/{a.name}", "readOnly": True}
            for a in (lora.adapters if lora is not None else [])]

