"""Draft-model drafter: k greedy one-row passes of a smaller model (the target's own allowed).

The draft model has its own ModelRunner and KV cache, with as many blocks as the target's and
addressed through the same block tables: position p of a sequence lives in the same slot of
both caches, so the scheduler's allocation, the rollback of rejected tokens and preemption
free the draft's blocks too. `Sequence.num_draft_computed` counts the sequence's tokens whose
keys/values the draft cache holds; a pass first catches up on the rest (prefill passes,
eager), then runs k decode passes of one row per sequence (recorded as DraftGraphs).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from atom.engine.batch import PENDING_TOKEN, SeqRows, StepBatch
from atom.engine.sampler import _argmax
from atom.models.registry import ModelConfig, load_model_config

if TYPE_CHECKING:
    from atom.config import Config
    from atom.engine.model_runner import ModelRunner
    from atom.engine.sequence import Sequence


def draft_config(config: Config) -> Config:
    """The target's Config with the draft model in place (same lengths, seed, graph mode)."""
    spec = config.speculative_config
    assert spec is not None and spec.model is not None
    cfg = copy.deepcopy(config)
    cfg.model = spec.model
    cfg.served_model_name = spec.model
    cfg.speculative_config = None
    return cfg


def check_draft_model(target: ModelConfig, draft_name: str) -> ModelConfig:
    draft = load_model_config(draft_name)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model {draft_name!r} has vocab_size={draft.vocab_size}, the "
            f"target has {target.vocab_size}: draft and target must share one vocabulary"
        )
    return draft


class DraftModelDrafter:
    def __init__(self, runner: ModelRunner, k: int) -> None:
        self.runner = runner
        self.k = k
        self.max_rows = int(runner.config.max_num_batched_tokens)

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Fill the draft cache up to each sequence's last token (excluded), in chunks."""
        todo = [s for s in seqs if s.num_draft_computed < s.num_tokens - 1]
        while todo:
            budget, rows = self.max_rows, []
            for seq in todo:
                if budget <= 0:
                    break
                start = seq.num_draft_computed
                n = min(seq.num_tokens - 1 - start, budget)
                rows.append(
                    (
                        seq,
                        SeqRows(
                            seq.request_id,
                            seq.token_ids[start : start + n],
                            start,
                            seq.block_table,
                            None,
                            False,
                        ),
                    )
                )
                budget -= n
            self.runner.execute_model(StepBatch([r for _, r in rows], is_prefill=True))
            for seq, r in rows:
                seq.num_draft_computed += r.num_scheduled_tokens
            todo = [s for s in todo if s.num_draft_computed < s.num_tokens - 1]

    def propose_batch(self, seqs: list[Sequence]) -> list[list[int]]:
        """k greedy draft tokens per sequence; the draft cache then holds num_tokens + k - 1.

        Passes after the first read their token on the device (PENDING_TOKEN from the previous
        pass's argmax, as an asynchronous decode step does): the host waits once, for all k."""
        self._catch_up(seqs)
        n = len(seqs)
        prev: torch.Tensor | None = None
        drafted: list[torch.Tensor] = []
        for j in range(self.k):
            rows = [
                SeqRows(
                    s.request_id, [s.token_ids[-1]], s.num_tokens - 1, s.block_table, None, True
                )
                if prev is None
                else SeqRows(
                    s.request_id, [PENDING_TOKEN], s.num_tokens - 1 + j, s.block_table, i, True
                )
                for i, s in enumerate(seqs)
            ]
            logits, _ = self.runner.execute_model(StepBatch(rows, is_prefill=False), prev)
            prev = _argmax(logits[:n])
            drafted.append(prev)
        for s in seqs:
            s.num_draft_computed = s.num_tokens + self.k - 1
        return torch.stack(drafted, dim=1).tolist()


def draft_kv_share(target_block_bytes: int, draft_block_bytes: int, num_blocks: int) -> int:
    """Blocks for each cache when one memory budget, sized for the target alone, holds both."""
    return max(1, int(num_blocks * target_block_bytes // (target_block_bytes + draft_block_bytes)))
