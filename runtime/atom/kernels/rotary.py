"""Rotary position math (neox/rotate-half layout, as Hugging Face Llama), with scaling.

The ground floor of rotary embeddings: the frequency tables, the `Rope` the attention kernels
take, and the torch rotation they match. atom.layers.rotary wraps the tables in a module.
Supported rope_scaling types: default, linear, llama3 (Llama 3.1/3.2 frequency smoothing).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default" or scaling is None:
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


class Rope(NamedTuple):
    """Rotary embedding to apply to unrotated q and k: each row's position and the model's
    cos/sin tables [max_positions, head_dim / 2] (fp32)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                 sin_cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rotate every head of a flat [T, n * head_dim] tensor to its row's position (rotate-half
    layout): in fp32, rounded once to x's dtype. The Triton attention kernels do the same."""
    t = x.shape[0]
    x = x.reshape(t, -1, head_dim)
    cos, sin = cos_cache[positions].unsqueeze(1), sin_cache[positions].unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    xf1, xf2 = x1.float(), x2.float()
    o1 = xf1 * cos - xf2 * sin
    o2 = xf2 * cos + xf1 * sin
    return torch.cat((o1, o2), dim=-1).to(x.dtype).view(t, -1)


def rope_tables(head_dim: int, max_positions: int, theta: float,
                scaling: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, head_dim / 2] (fp32), indexed by position."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return freqs.cos(), freqs.sin()
