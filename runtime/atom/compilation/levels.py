"""Compilation levels and CUDA-graph modes: the two enums the guide documents in atom.config.

Leaf module (no torch): atom.config re-exports both, and anything that only needs to name a
level or a mode imports them from here without pulling in the engine's configuration.
"""

from __future__ import annotations

import enum
from typing import Any


class CompilationLevel(enum.IntEnum):
    NO_COMPILATION = 0
    DYNAMO_AS_IS = 1
    DYNAMO_ONCE = 2
    PIECEWISE = 3

    @classmethod
    def parse(cls, value: Any, field_name: str = "compilation_config.level") -> CompilationLevel:
        allowed = ", ".join(f"{m.value} ({m.name})" for m in cls)
        if isinstance(value, str):
            text = value.strip()
            if text.upper() in cls.__members__:
                return cls[text.upper()]
            try:
                value = int(text)
            except ValueError:
                raise ValueError(f"{field_name} must be one of {allowed}, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int) or value not in {m.value for m in cls}:
            raise ValueError(f"{field_name} must be one of {allowed}, got {value!r}")
        return cls(value)


class CUDAGraphMode(enum.Enum):
    """How CUDA graphs are captured; tuple modes give (decode mode, mixed-batch mode)."""

    NONE = 0
    TR_HYBRID = 1
    FULL = 2
    # Inside the class body FULL/NONE/TR_HYBRID are still the plain values.
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_TR_HYBRID = (FULL, TR_HYBRID)

    def separate_routine(self) -> bool:
        return isinstance(self.value, tuple)

    def decode_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def max_cudagraph_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(max(self.value)) if self.separate_routine() else self

    def has_full_cudagraphs(self) -> bool:
        return self.max_cudagraph_mode() == CUDAGraphMode.FULL

    def uses_tr_hybrid(self) -> bool:
        return CUDAGraphMode.TR_HYBRID in (self.decode_mode(), self.mixed_mode())

    def has_mode(self, mode: CUDAGraphMode) -> bool:
        return mode in (self.decode_mode(), self.mixed_mode())

    @classmethod
    def parse(cls, value: Any, field_name: str = "compilation_config.cudagraph_mode") -> CUDAGraphMode:
        """From a member, its name (any case, '-' or '_'), its int value or its tuple value."""
        if isinstance(value, cls):
            return value
        allowed = ", ".join(cls.__members__)
        if isinstance(value, str):
            key = value.strip().upper().replace("-", "_")
            if key in cls.__members__:
                return cls[key]
            if key.isdigit():
                value = int(key)
            else:
                raise ValueError(f"{field_name} must be one of {allowed}, got {value!r}")
        if isinstance(value, list):
            value = tuple(value)
        try:
            if isinstance(value, bool):
                raise ValueError
            return cls(value)
        except (ValueError, TypeError):
            raise ValueError(f"{field_name} must be one of {allowed}, got {value!r}") from None

    def __str__(self) -> str:
        return self.name


def default_capture_sizes(n: int) -> list[int]:
    """The guide's pattern for one cuda_graph_sizes value N: [1..8] + [16, 32, ..., N]."""
    return list(range(1, 9)) + list(range(16, n + 1, 16))
