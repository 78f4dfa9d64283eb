"""How a rank's parameter is cut from the full (TP = 1) tensor.

A parameter that is a shard carries `tp_pieces`: the slices of the full tensor it is made
of, so the loader reads only those slices from the checkpoint and dummy weights are cut
from the same full tensor a single rank would draw (TP ranks hold exactly TP = 1's values).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Shard(NamedTuple):
    """The slice [start, start + length) of a full tensor along dim."""

    dim: int
    start: int
    length: int


class WeightTarget(NamedTuple):
    """Where one checkpoint tensor goes: the destination (a parameter or a view of one), the
    tensor's full shape in the checkpoint, and the slice of it this rank reads (None: all)."""

    tensor: torch.Tensor
    full_shape: tuple[int, ...]
    shard: Shard | None = None


class Piece(NamedTuple):
    """A parameter's rows (or columns) [local, local + length) along dim are the full
    tensor's [full, full + length)."""

    dim: int
    full: int
    local: int
    length: int


def split_evenly(total: int, tp_size: int, tp_rank: int, field: str) -> tuple[int, int]:
    """(start, length) of rank tp_rank's equal share of total; a ValueError naming the
    field when tp_size does not divide it."""
    if total % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} does not divide {field}={total}")
    length = total // tp_size
    return tp_rank * length, length


def mark_sharded(param: torch.Tensor, full_shape: tuple[int, ...], pieces: list[Piece]) -> None:
    """Record that param is cut from a full tensor of full_shape (dummy init, debugging)."""
    param.tp_full_shape = tuple(full_shape)  # type: ignore[attr-defined]
    param.tp_pieces = list(pieces)  # type: ignore[attr-defined]


def cut(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The parameter like's values taken out of the full tensor (its tp_pieces)."""
    out = torch.empty_like(like)
    for p in like.tp_pieces:  # type: ignore[attr-defined]
        out.narrow(p.dim, p.local, p.length).copy_(full.narrow(p.dim, p.full, p.length))
    return out
