"""Draft-model drafter: k greedy one-row passes of a smaller model (the target's own allowed).

The draft model has its own ModelRunner and KV cache, with as many blocks as the target's and
addressed through the same block tables: position p of a sequence lives in the same slot of
both caches, so the scheduler's allocation, the rollback of rejected tokens and preemption
free the draft's blocks too. `Sequence.num_draft_computed` counts the sequence's tokens whose
keys/values the draft cache holds; a pass first catches up on the rest, then runs k decode
passes of one row per sequence (recorded as DraftGraphs, replayed in either graph mode).

Catching up: after a step that accepted all k drafts the cache lacks only the last draft's
keys (no pass ran on it), which one decode pass of one row per such sequence fills (a
DraftGraph replay); longer gaps (a new or preempted sequence: its prompt) run as prefill
chunks. The k passes share one preparation: pass j + 1's inputs are pass j's, one position
on, rewritten on the device (token ids from pass j's argmax, positions, context lengths,
slots from the block table), so the host neither stages nor waits between passes and reads
the k drafts once.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from atom.engine.batch import SeqRows, StepBatch
from atom.engine.sampler import argmax
from atom.models.model_config import ModelConfig
from atom.models.registry import load_model_config
from atom.utils.forward_context import AttentionMetaData

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
        self.max_rows = int(runner.config.model_limits().max_num_batched_tokens)

    def has_drafts(self, seqs: list[Sequence]) -> bool:
        """A draft model always proposes."""
        return True

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Fill the draft cache up to each sequence's last token (excluded): one decode row
        per sequence one token behind, prefill chunks for longer gaps."""
        behind = [s for s in seqs if s.num_draft_computed == s.num_tokens - 2]
        if behind:
            # samples=False: the pass is for the keys, its logits are not computed.
            rows = [
                SeqRows(
                    s.request_id, [s.token_ids[-2]], s.num_tokens - 2, s.block_table, None, False
                )
                for s in behind
            ]
            self.runner.execute_model(StepBatch(rows, is_prefill=False))
            for s in behind:
                s.num_draft_computed += 1
        todo = [s for s in seqs if s.num_draft_computed < s.num_tokens - 1]
        while todo:
            budget = self.max_rows
            chunks: list[tuple[Sequence, SeqRows]] = []
            for seq in todo:
                if budget <= 0:
                    break
                start = seq.num_draft_computed
                n = min(seq.num_tokens - 1 - start, budget)
                chunks.append(
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
            self.runner.execute_model(StepBatch([r for _, r in chunks], is_prefill=True))
            for seq, r in chunks:
                seq.num_draft_computed += r.num_scheduled_tokens
            todo = [s for s in todo if s.num_draft_computed < s.num_tokens - 1]

    @torch.inference_mode()
    def propose_batch(self, seqs: list[Sequence]) -> list[list[int]]:
        """k greedy draft tokens per sequence; the draft cache then holds num_tokens + k - 1.
        The host waits once, for all k (module docstring: one preparation, k passes)."""
        self._catch_up(seqs)
        runner, n = self.runner, len(seqs)
        rows = [
            SeqRows(s.request_id, [s.token_ids[-1]], s.num_tokens - 1, s.block_table, None, True)
            for s in seqs
        ]
        step = runner.prepare_step(StepBatch(rows, is_prefill=False))
        ids, positions, meta = step.input_ids, step.positions, step.meta
        drafted: list[torch.Tensor] = []
        with runner.prepared_context(step):  # the k passes share one plan, as their inputs
            for j in range(self.k):
                if j:
                    advance_decode_rows(
                        ids[:n], positions[:n], meta, drafted[-1], runner.block_size
                    )
                logits, _ = runner.run_model(ids, n)
                drafted.append(argmax(logits[:n]))
        for s in seqs:
            s.num_draft_computed = s.num_tokens + self.k - 1
        return torch.stack(drafted, dim=1).tolist()


def advance_decode_rows(
    ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetaData,
    tokens: torch.Tensor,
    block_size: int,
) -> None:
    """A prepared decode step's first len(tokens) rows (one per sequence) moved one position
    on, in place on the device: each row's token is tokens[i], and its position, context
    length and slot follow (the block table already covers the new position); padding rows
    keep context 0 and slot -1."""
    lens, cu, tables, slots = (meta.context_lens, meta.cu_seqlens_k, meta.block_tables,
                               meta.slot_mapping)
    assert lens is not None and cu is not None and tables is not None and slots is not None
    n = tokens.shape[0]
    ids.copy_(tokens)
    positions.add_(1)
    lens[:n].add_(1)
    # cu: entry i sums the first i contexts, min(i, n) of which grew.
    cu.add_(torch.arange(cu.shape[0], device=cu.device, dtype=cu.dtype).clamp_(max=n))
    blocks = tables[:n].gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
    slots[:n] = blocks.to(torch.long) * block_size + positions % block_size
    meta.max_seqlen_k += 1


def draft_kv_share(target_block_bytes: int, draft_block_bytes: int, num_blocks: int) -> int:
    """Blocks for each cache when one memory budget, sized for the target alone, holds both."""
    return max(1, int(num_blocks * target_block_bytes // (target_block_bytes + draft_block_bytes)))
