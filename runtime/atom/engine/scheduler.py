"""Continuous batching: every step mixes running sequences (decode or the next prefill chunk)
with newly admitted prompts under a token budget, a sequence cap and the KV blocks left.

When a running sequence cannot get a block, the latest-arrived running sequence is
preempted by recompute: its blocks are freed and it goes back to the front of the waiting
queue with its tokens (prompt + outputs so far), to be prefilled again later. No request
is dropped; greedy output is unchanged because the recomputed cache is the same.

Prefix caching (BlockManager.match_prefix): a sequence with nothing computed starts with the
cached blocks of its leading full blocks and prefills only the rest (at least its last token;
a prompt found whole computes only that token, a decode row that stores nothing).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from atom.engine.block_manager import BlockManager
from atom.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)  # each with num_scheduled_tokens set
    preempted: list[Sequence] = field(default_factory=list)
    # Indices in seqs of prompts found whole in the cache: their one row stores no KV
    # (StepBatch.shared_kv).
    shared_kv: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.seqs)

    @property
    def is_prefill(self) -> bool:
        """A pure decode step has one new row per sequence; anything else is prefill/mixed."""
        return [s.num_scheduled_tokens for s in self.seqs].count(1) != len(self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.cache_blocks(seq)  # with prefix caching the recompute may find them again
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.num_draft_computed = 0
        seq.num_scheduled_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for seq in self.running:
            seq.num_scheduled_tokens = 0

        # Running sequences first, in arrival order: decodes and unfinished prefill chunks.
        running, scheduled, block_size = self.running, out.seqs, self.bm.block_size
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = len(seq.token_ids) - seq.num_computed_tokens
            if n > budget:
                n = budget
            if n <= 0:
                i += 1
                continue
            target = seq.num_computed_tokens + n
            # Most steps need no new block: then there is nothing to grow or preempt for.
            if target > len(seq.block_table) * block_size:
                while not self.bm.can_grow(seq, target):
                    victim = running[-1]
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is seq:
                        break
                if seq.status != SequenceStatus.RUNNING:
                    break  # seq preempted itself: everything after it is gone too
                self.bm.grow(seq, target)
            seq.num_scheduled_tokens = n
            scheduled.append(seq)
            budget -= n
            i += 1

        # Then new (or preempted) prompts, while budget, sequence slots and blocks last.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            # A sequence with nothing computed (new or preempted) starts from its cached
            # prefix; a pulled one (kv_payload) already has its prompt computed elsewhere.
            fresh = seq.num_computed_tokens == 0 and not seq.block_table
            hit = self.bm.match_prefix(seq) if fresh else []
            start = self.bm.computed_prefix(seq, hit) if fresh else seq.num_computed_tokens
            remaining = seq.num_tokens - start
            n = min(remaining, budget)
            if n < remaining and not self.enable_chunked_prefill:
                break
            if fresh:
                if not self.bm.can_admit(seq, hit, start + n):
                    break
                self.waiting.popleft()
                self.bm.admit(seq, hit, start + n)
                if seq.num_cached_tokens is None:  # the request's first admission
                    self.bm.record_lookup(seq, start)
            else:
                if not self.bm.can_grow(seq, start + n):
                    break
                self.waiting.popleft()
                self.bm.grow(seq, start + n)
            seq.status = SequenceStatus.RUNNING
            seq.num_scheduled_tokens = n
            if start < len(hit) * self.bm.block_size:  # its last token's KV is in the hit
                out.shared_kv.append(len(out.seqs))
            self.running.append(seq)
            out.seqs.append(seq)
            budget -= n
        return out

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.num_scheduled_tokens = 0
        try:
            self.running.remove(seq)
        except ValueError:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.bm.cache_blocks(seq)  # e.g. a block filled by its last decode steps
        self.bm.free(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                return seq
        return None
