"""The tensor-parallel collectives as registered torch ops (namespace "atom").

Dynamo traces a custom op as one node (its fake gives the shape), so a collective never
breaks the graph, and piecewise compilation (which splits only at attention) keeps it
inside a compiled, captured piece. Called only when tp_size() > 1: TP = 1 runs none.

On NCCL an eager call's work handle goes to the watchdog drain (nccl_watchdog); under
capture the collective is recorded into the graph and there is nothing to track.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from atom.distributed import nccl_watchdog
from atom.distributed.parallel_state import tp_size, tp_state


def _tracked(work: dist.Work | None) -> None:
    """Track the work of an eager NCCL collective (launched with async_op=True)."""
    if work is None:
        return
    work.wait()  # NCCL: the current stream waits for the collective; the host does not
    nccl_watchdog.track(work)


def _async() -> bool:
    """An eager NCCL call (backend first: the CUDA query is not made on the CPU)."""
    return tp_state().backend == "nccl" and not torch.cuda.is_current_stream_capturing()


@torch.library.custom_op("atom::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the TP group (a new tensor: custom ops must not alias inputs)."""
    out = x.contiguous().clone()
    if _async():
        _tracked(dist.all_reduce(out, async_op=True))
    else:
        dist.all_reduce(out)
    return out


@all_reduce.register_fake
def _all_reduce_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("atom::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The ranks' x concatenated along dim, rank order (vocab-parallel logits: dim -1)."""
    n = tp_size()
    dim = dim % x.dim()
    x = x.contiguous()
    if tp_state().backend == "nccl":
        # One buffer, ranks stacked on a new leading dim, then moved to dim.
        stacked = x.new_empty((n, *x.shape))
        if _async():
            _tracked(dist.all_gather_into_tensor(stacked, x, async_op=True))
        else:
            dist.all_gather_into_tensor(stacked, x)
        parts = list(stacked.unbind(0))
    else:
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)


@all_gather.register_fake
def _all_gather_fake(x: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim % x.dim()] *= tp_size()
    return x.new_empty(shape)


def tensor_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """x summed over the group; x itself at TP = 1 (no op, no copy)."""
    return torch.ops.atom.all_reduce(x) if tp_size() > 1 else x


def tensor_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' shards of x joined along dim; x itself at TP = 1."""
    return torch.ops.atom.all_gather(x, dim) if tp_size() > 1 else x


def all_reduce_min(value: int, device: torch.device) -> int:
    """The smallest of the ranks' values (KV blocks: every rank must allocate the same)."""
    if tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
