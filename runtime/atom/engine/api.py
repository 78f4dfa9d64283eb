"""`EngineAPI`: what the engine core (atom.entrypoints.core.engine_core) calls on its engine.

LLMEngine implements it; tests stand a scripted engine in for it. Every method is always
present, so the core calls them directly instead of probing. `EngineFacts` is what the engine
tells the core once built (for /status and the API server's checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from atom.engine.params import RequestOutput, SamplingParams, TopLogprobs

if TYPE_CHECKING:  # type names only: the core imports this module without torch
    import torch

    from atom.config import Config
    from atom.disagg.holds import KVHoldRegistry
    from atom.engine.block_manager import BlockManager
    from atom.executor.protocol import ModelExecutor
    from atom.lora.service import LoRAService


@dataclass
class EngineFacts:
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]  # the engine stops at these unless ignore_eos (atom.engine.eos)
    config: Config | None = None  # None: no Config to report (a scripted engine)
    graphs: dict[str, Any] = field(default_factory=lambda: {"effective_mode": "NONE"})
    tp_pids: list[int] = field(default_factory=list)  # every rank's pid, rank 0 first


class EngineAPI(Protocol):
    @property
    def kv_holds(self) -> KVHoldRegistry | None:
        """Prompt blocks kept for a pull (atom.disagg); None: this engine keeps none."""
        ...

    @property
    def lora(self) -> LoRAService | None:
        """Multi-LoRA adapters (atom.lora); None: this engine serves none."""
        ...

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams | None = None, *, hold_kv: bool = False,
                    lora_name: str | None = None) -> None: ...

    def add_prefilled_request(self, request_id: str, prompt_token_ids: list[int],
                              first_token: int, params: SamplingParams | None,
                              kv_blocks: torch.Tensor | None, first_logprob: float | None = None,
                              *, cached_tokens: int = 0,
                              first_top: TopLogprobs | None = None) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def warmup(self) -> dict[str, Any]: ...

    def stats(self) -> dict[str, Any]: ...

    def facts(self) -> EngineFacts: ...

    def reclaim_kv(self) -> int:
        """Free the blocks of holds that were pulled, released or timed out; how many."""
        ...

    def shutdown(self) -> None:
        """Stop what the engine started (the tensor-parallel workers)."""
        ...

    def rank_failure(self, timeout: float) -> str | None:
        """Why a tensor-parallel rank died, if one did (waits up to timeout for the verdict)."""
        ...


class WarmupTarget(Protocol):
    """What the warm-up (atom.engine.warmup, atom.engine.eager_warmup) drives: the engine's
    runners, its block manager, and its request API."""

    @property
    def config(self) -> Config: ...

    @property
    def runner(self) -> ModelExecutor: ...

    @property
    def draft_runner(self) -> ModelExecutor | None: ...

    @property
    def block_manager(self) -> BlockManager: ...

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams | None = None, *, hold_kv: bool = False) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...
