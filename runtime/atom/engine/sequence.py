"""One request's token state as the scheduler and model runner see it."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch

from atom.engine.batch import PENDING_TOKEN
from atom.engine.params import SamplingParams
from atom.engine.prefix_cache import BlockHash

if TYPE_CHECKING:
    from atom.structured.matcher import GrammarState

__all__ = ["PENDING_TOKEN", "Sequence", "SequenceStatus"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt + generated tokens; `num_computed_tokens` of them have keys/values in the cache.

    A step computes `num_scheduled_tokens` more. When all tokens are computed the step's last
    row yields logits and a new token is sampled. Preemption resets the computed count and
    frees the blocks: the sequence is recomputed from its tokens (prompt + outputs so far).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival: int = 0) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.arrival = arrival
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_scheduled_tokens = 0
        self.output_logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None  # per-request seeded sampling
        # Disaggregation: a prefill sequence keeps its prompt's blocks when it finishes; a
        # pulled one carries its prompt's blocks (host tensor) until the scheduler places it.
        self.hold_kv = False
        self.kv_payload: torch.Tensor | None = None
        # Row of the launched step's sampled tokens that holds this sequence's PENDING_TOKEN.
        self.pending_src: int | None = None
        # Prefix caching (atom.engine.block_manager): keys of the leading full blocks whose
        # tokens are known, how many of block_table's blocks were registered, and the prompt
        # tokens found cached at the first admission (None until then).
        self.block_hashes: list[BlockHash] = []
        self.num_registered_blocks = 0
        self.num_cached_tokens: int | None = None
        # Extra key bytes of every block (prefix_cache.BlockKeyExtra): a LoRA adapter's id or a
        # tenant's cache salt; multimodal inputs would add their hashes per block.
        self.cache_salt = b""
        self.lora_slot = 0  # its LoRA adapter's slot in the runner's buffers (0: none)
        self.lora_name: str | None = None  # the adapter it was asked for (metrics)

        # Speculative decoding: tokens whose KV the draft model's cache holds (reset with the
        # blocks on preemption), and the host generator of a seeded request's acceptance draws.
        self.num_draft_computed = 0
        self.spec_generator: torch.Generator | None = None
        # Structured output (atom.structured): its grammar matcher, when the request has one.
        self.grammar: GrammarState | None = None

    def block_extra_keys(self, start: int, end: int) -> list[bytes]:
        return [self.cache_salt] * (end - start)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
