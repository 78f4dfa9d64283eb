"""What a decode instance checks before it copies a single block: same model, same cache shape.

Pure Python (no torch): the router and the operator's tests may import it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import Any

# Bytes per element of the KV cache dtypes the runtime allocates.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}  # fp8: --kv-cache-dtype fp8


def model_identity(model: str, load_format: str, seed: int, hf_config: dict[str, Any]) -> str:
    """Digest of what decides the weights: checkpoint (or built-in shape), architecture, and the
    seed when the weights are random. Two instances agree on it iff their KV is interchangeable."""
    arch = {k: v for k, v in hf_config.items() if k not in ("name", "path")}
    effective = load_format
    if load_format == "auto":
        effective = "safetensors" if hf_config.get("path") else "dummy"
    factors: dict[str, Any] = {"model": model, "load_format": effective, "arch": arch}
    if effective == "dummy":
        factors["seed"] = int(seed)  # random weights differ by seed
    blob = json.dumps(factors, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class KVLayout:
    identity: str  # model_identity()
    model: str  # human-readable, for error messages
    dtype: str  # "bfloat16", "float16", "float32"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """One block on the wire: keys and values of every layer, [2, L, block, heads, dim]."""
        return (
            2
            * self.num_layers
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * self.element_bytes
        )

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> KVLayout:
        if not isinstance(data, dict):
            raise ValueError(f"layout must be an object, got {type(data).__name__}")
        kw: dict[str, Any] = {}
        for f in fields(cls):
            value = data.get(f.name)
            want = str if f.type == "str" else int
            if not isinstance(value, want) or isinstance(value, bool):
                raise ValueError(f"layout.{f.name} must be {want.__name__}, got {value!r}")
            kw[f.name] = value
        if kw["dtype"] not in DTYPE_BYTES:
            raise ValueError(f"layout.dtype {kw['dtype']!r} is not one of {sorted(DTYPE_BYTES)}")
        return cls(**kw)

    def identity_mismatch(
        self, identity: str, model: str, mine: str = "this instance", theirs: str = "peer"
    ) -> str:
        if identity == self.identity:
            return ""
        return (
            f"model identity differs: {theirs} serves {model!r} (identity {identity}), "
            f"{mine} serves {self.model!r} (identity {self.identity})"
        )

    def mismatch(self, other: KVLayout, mine: str = "this instance", theirs: str = "peer") -> str:
        """'' when blocks of `other` can be copied into this cache, else a message naming why."""
        why = self.identity_mismatch(other.identity, other.model, mine, theirs)
        if why:
            return why
        for name in ("dtype", "block_size", "num_layers", "num_kv_heads", "head_dim"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                return f"KV cache {name} differs: {theirs} has {b}, {mine} has {a}"
        return ""
