"""`ModelExecutor`: what the engine calls on its runner, the calls every rank makes in lock-step.

One rank: a plain ModelRunner is the executor. N ranks: `MultiprocExecutor`
(atom.executor.executor). Its own module, torch and the batch type only, so the engine can
name the seam without importing the tensor-parallel machinery.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from atom.engine.batch import StepBatch


@runtime_checkable
class ModelExecutor(Protocol):
    """The engine's runner calls that every rank runs (ModelRunner is the one-rank one)."""

    @property
    def device(self) -> torch.device: ...

    def determine_num_blocks(self) -> int: ...

    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    def warmup_model(self) -> float: ...

    def capture_cudagraph(self) -> tuple[float, list[int]]: ...

    def execute_model(self, batch: StepBatch, pending_tokens: torch.Tensor | None = None,
                      spec: Any = None) -> tuple[torch.Tensor, list[int]]: ...
