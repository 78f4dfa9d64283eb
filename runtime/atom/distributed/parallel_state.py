"""The tensor-parallel process group of this process: set up once, read everywhere.

World size 1 needs no group at all: every query answers for a single rank, so the
single-GPU path never touches torch.distributed.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0  # a collective stuck longer than this ends the server, never a hang
# Until warm-up ends: one rank may compile cold while another loads its cache, and their first
# collective inside the compiled forward must not time out over that difference.
STARTUP_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class TPState:
    rank: int
    world_size: int
    backend: str  # "nccl" on CUDA, "gloo" on the CPU


_STATE = TPState(rank=0, world_size=1, backend="none")


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def init_tensor_parallel(rank: int, world_size: int, init_method: str, device: str,
                         timeout_s: float = DEFAULT_TIMEOUT_S) -> TPState:
    """Joins the group (every rank calls it with the same init_method, e.g. tcp://127.0.0.1:P)."""
    global _STATE
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {world_size}")
    check_visible_devices(world_size, device)
    if world_size > 1:
        backend = backend_for(device)
        if device.startswith("cuda"):
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    else:
        backend = "none"
    _STATE = TPState(rank=rank, world_size=world_size, backend=backend)
    return _STATE


def check_visible_devices(world_size: int, device: str) -> None:
    """On CUDA one GPU per rank: a group larger than the visible GPUs is refused up front."""
    if world_size > 1 and device.startswith("cuda"):
        visible = torch.cuda.device_count()
        if world_size > visible:
            raise ValueError(f"tensor_parallel_size={world_size} exceeds the {visible} visible "
                             "CUDA device(s) (CUDA_VISIBLE_DEVICES)")


def set_collective_timeout(timeout_s: float) -> None:
    """Every later collective of the group fails after timeout_s (no-op for one rank)."""
    if _STATE.world_size > 1:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(datetime.timedelta(seconds=timeout_s))


def destroy_tensor_parallel() -> None:
    global _STATE
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _STATE = TPState(rank=0, world_size=1, backend="none")


def tp_state() -> TPState:
    return _STATE


def tp_rank() -> int:
    return _STATE.rank


def tp_size() -> int:
    return _STATE.world_size
