"""Which configurations tensor parallelism supports; torch-free, so the CLI can check early."""

from __future__ import annotations

from typing import Any


def check_tensor_parallel(config: Any, device_type: str | None = None,
                          visible_gpus: int | None = None) -> None:
    """Raise ValueError (one line, naming the flag) when N > 1 cannot run as configured.
    device_type/visible_gpus: where the engine runs and how many GPUs it sees (None: not
    known yet; the engine core checks again once torch is up)."""
    n = int(getattr(config, "tensor_parallel_size", 1) or 1)
    if n == 1:
        return
    role = getattr(config, "role", "unified")
    if role != "unified":
        # The P/D KV transfer reads and writes rank 0's cache only (a sharded cache has a
        # part on every rank).
        raise ValueError(f"--tensor-parallel-size {n} needs --role unified, got --role {role} "
                         "(P/D transfer of a sharded KV cache is not implemented)")
    if getattr(config, "speculative_config", None) is not None:
        raise ValueError(f"--tensor-parallel-size {n} does not support --speculative-config "
                         "yet (the drafter and verify steps run on rank 0 only)")
    if device_type == "cuda" and visible_gpus is not None and n > visible_gpus:
        raise ValueError(f"--tensor-parallel-size {n} needs {n} GPUs, {visible_gpus} visible "
                         "(one rank per GPU; see CUDA_VISIBLE_DEVICES)")
