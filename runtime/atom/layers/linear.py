"""Linear layers, with merged q/k/v and gate/up projections.

Merging saves kernel launches; each merged weight exposes per-shard views so the loader can
copy Hugging Face's separate tensors (q_proj, k_proj, ...) straight into it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several output projections stacked along the output dimension."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_sizes = dict(shard_sizes)

    def shard_offsets(self) -> dict[str, tuple[int, int]]:
        out, start = {}, 0
        for name, size in self.shard_sizes.items():
            out[name] = (start, size)
            start += size
        return out

    def shard_views(self, name: str) -> dict[str, torch.Tensor]:
        """{"weight": view, "bias": view} of one shard inside the merged parameters."""
        start, size = self.shard_offsets()[name]
        views = {"weight": self.weight.data.narrow(0, start, size)}
        if self.bias is not None:
            views["bias"] = self.bias.data.narrow(0, start, size)
        return views
