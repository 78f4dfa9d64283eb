"""The few collectives the executor itself runs (the model's own live in atom.distributed),
called by every rank at the same point of the same command."""

from __future__ import annotations

import torch
import torch.distributed as dist


def broadcast_from_rank0(t: torch.Tensor) -> None:
    """Rank 0's tensor into every rank's (same shape and dtype, contiguous)."""
    dist.broadcast(t, src=0)


def min_across_ranks(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def same_across_ranks(values: list[int], device: torch.device) -> bool:
    """Whether every rank holds the same list (a hash of it, compared by min and max; ints
    hash alike in every process)."""
    h = hash(tuple(values)) % (2**61)
    t = torch.tensor([h, -h], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t[0].item()) == h and int(t[1].item()) == -h


def logits_agree(logits: torch.Tensor | None, device: torch.device) -> bool:
    """Whether every rank that holds logits holds the same ones (by their float64 sum; a rank
    whose model gathered them elsewhere passes None and cannot judge). A debugging check (tests):
    one all-reduce a step."""
    if logits is None:
        t = torch.full((2,), float("-inf"), dtype=torch.float64, device=device)
    else:
        c = logits.double().sum()
        t = torch.stack([c, -c])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return logits is None or bool(t[0] == -t[1])  # max == min over the ranks holding logits
