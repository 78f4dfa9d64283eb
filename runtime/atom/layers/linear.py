"""Linear layers, with merged q/k/v and gate/up projections, and their tensor-parallel forms.

Merging saves kernel launches; each merged weight exposes per-shard views so the loader can
copy Hugging Face's separate tensors (q_proj, k_proj, ...) straight into it.

Tensor parallelism (tp_size > 1): a MergedLinear is column-parallel (each rank holds its
share of every merged part's output rows), a RowParallelLinear holds its share of the input
columns and produces a partial sum the caller all-reduces. At tp_size 1 both are the plain
layers, parameter for parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom.layers.sharding import Piece, Shard, WeightTarget, mark_sharded, split_evenly


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        """Checkpoint name -> target for this layer's tensors (prefix: 'model.x.o_proj')."""
        out = {f"{prefix}.weight": WeightTarget(self.weight.data, tuple(self.weight.shape))}
        if self.bias is not None:
            out[f"{prefix}.bias"] = WeightTarget(self.bias.data, tuple(self.bias.shape))
        return out


class MergedLinear(Linear):
    """Several output projections stacked along the output dimension; column-parallel at
    tp_size > 1 (each part's rows split evenly: shard_sizes are the full sizes)."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False,
                 tp_size: int = 1, tp_rank: int = 0) -> None:
        self.full_shard_sizes = dict(shard_sizes)
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.shard_ranges = {name: split_evenly(size, tp_size, tp_rank, f"{name} output size")
                             for name, size in shard_sizes.items()}
        super().__init__(in_features, sum(n for _, n in self.shard_ranges.values()), bias)
        self.shard_sizes = {name: n for name, (_, n) in self.shard_ranges.items()}
        if tp_size > 1:
            self._mark()

    def _mark(self) -> None:
        pieces, full_at = [], 0
        for name, (local_at, n) in self.shard_offsets().items():
            start, _ = self.shard_ranges[name]
            pieces.append(Piece(0, full_at + start, local_at, n))
            full_at += self.full_shard_sizes[name]
        mark_sharded(self.weight, (full_at, self.in_features), pieces)
        if self.bias is not None:
            mark_sharded(self.bias, (full_at,), pieces)

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

    def shard_targets(self, name: str) -> dict[str, WeightTarget]:
        """{"weight": target, "bias": target} of one part: its view here, the part's full
        checkpoint shape and (tp_size > 1) the rows this rank reads."""
        full = self.full_shard_sizes[name]
        start, n = self.shard_ranges[name]
        shard = Shard(0, start, n) if self.tp_size > 1 else None
        shapes = {"weight": (full, self.in_features), "bias": (full,)}
        return {kind: WeightTarget(view, shapes[kind], shard)
                for kind, view in self.shard_views(name).items()}


class ColumnParallelLinear(MergedLinear):
    """One projection whose output rows are split over the ranks (the vocab-parallel head)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_size: int = 1, tp_rank: int = 0, field: str = "output size") -> None:
        split_evenly(out_features, tp_size, tp_rank, field)  # the error names the field
        super().__init__(in_features, {"out": out_features}, bias, tp_size, tp_rank)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return {f"{prefix}.{kind}": t for kind, t in self.shard_targets("out").items()}


class RowParallelLinear(Linear):
    """A projection whose input columns are split over the ranks: each rank's output is a
    partial sum, all-reduced by the caller. The bias lives on rank 0 only (added once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_size: int = 1, tp_rank: int = 0, field: str = "input size") -> None:
        start, n = split_evenly(in_features, tp_size, tp_rank, field)
        super().__init__(n, out_features, bias and tp_rank == 0)
        self.full_in_features, self.in_start = in_features, start
        self.tp_size, self.tp_rank = tp_size, tp_rank
        if tp_size > 1:
            mark_sharded(self.weight, (out_features, in_features), [Piece(1, start, 0, n)])

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        shard = Shard(1, self.in_start, self.in_features) if self.tp_size > 1 else None
        out = {f"{prefix}.weight": WeightTarget(self.weight.data,
                                                (self.out_features, self.full_in_features), shard)}
        if self.bias is not None:
            out[f"{prefix}.bias"] = WeightTarget(self.bias.data, (self.out_features,))
        return out
