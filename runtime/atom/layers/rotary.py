"""Rotary position embeddings as a module: the model's cos/sin tables as buffers.

The math (tables, `Rope`, `apply_rotary`) lives in atom.kernels.rotary, which the kernels
use; it is re-exported here for the layers and existing callers.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from atom.kernels.rotary import Rope, apply_rotary, rope_inv_freq, rope_tables

__all__ = ["Rope", "RotaryEmbedding", "apply_rotary", "rope_inv_freq", "rope_tables"]


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables [max_positions, head_dim / 2] (fp32), indexed by position.
    The model hands them to the attention op, which rotates q and k (atom.layers.attention)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        cos, sin = rope_tables(head_dim, max_positions, theta, scaling)
        # Not persistent: rebuilt from the config, never loaded from a checkpoint.
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
