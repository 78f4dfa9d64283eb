"""LoRAConfig: the adapters served from the start and the slot budget (kept free of torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16


def parse_lora_module(text: str) -> tuple[str, str]:
    """`name=path` (--lora-modules) -> (name, path); a ValueError naming what is wrong."""
    name, sep, path = text.partition("=")
    name, path = name.strip(), path.strip()
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules expects name=path, got {text!r}")
    return name, path


@dataclass
class LoRAConfig:
    """modules: adapter name -> PEFT adapter directory, loaded at start; max_loras: adapters
    resident at once (the stacked buffers hold max_loras + 1 slots, slot 0 = none);
    max_lora_rank: the largest rank an adapter may have (smaller ranks are zero-padded)."""

    modules: dict[str, str] = field(default_factory=dict)
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if len(self.modules) > self.max_loras:
            raise ValueError(f"{len(self.modules)} --lora-modules exceed max_loras="
                             f"{self.max_loras}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoRAConfig:
        unknown = set(data) - {"modules", "max_loras", "max_lora_rank"}
        if unknown:
            raise ValueError(f"unknown lora_config fields: {sorted(unknown)}")
        return cls(**data)

    def hash_factors(self) -> dict[str, Any]:
        """What changes the compiled code and graphs: the buffers' shapes, not the adapters
        (their weights live in the buffers, so loading one recompiles nothing)."""
        return {"max_loras": self.max_loras, "max_lora_rank": self.max_lora_rank}
