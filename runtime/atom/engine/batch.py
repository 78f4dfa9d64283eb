"""The batch the scheduler hands the model runner: plain typed rows, no Sequence.

The model runner sits below the scheduler: it reads what a step computes (tokens, positions,
block tables) from a `StepBatch` and never imports `atom.engine.sequence`. The engine builds
the batch from its scheduled sequences with `StepBatch.of`, which reads them through the
`ScheduledSequence` protocol.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

# Stands in token_ids for a token sampled by a step whose result the host has not read yet
# (asynchronous scheduling): the next step reads the real id on the device (`pending_src`).
PENDING_TOKEN = -1


class ScheduledSequence(Protocol):
    """What the batch reads from a scheduled sequence (atom.engine.sequence.Sequence)."""

    request_id: str
    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    pending_src: int | None


@dataclass(frozen=True)
class SeqRows:
    """One sequence's rows of a step: the tokens it computes, from position `start` on."""

    request_id: str
    token_ids: list[int]  # the scheduled tokens only
    start: int  # tokens already in the KV cache: the first row's position
    block_table: list[int]
    pending_src: int | None  # row of the previous step's sampled ids its PENDING_TOKEN takes
    samples: bool  # the step computes the sequence's last token: its last row gives logits

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class StepBatch:
    """One scheduled step: its sequences' rows, in order, and its phase."""

    seqs: list[SeqRows]
    is_prefill: bool

    @classmethod
    def of(cls, seqs: Iterable[ScheduledSequence], is_prefill: bool) -> StepBatch:
        rows = []
        for seq in seqs:
            start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
            rows.append(
                SeqRows(
                    seq.request_id,
                    seq.token_ids[start : start + n],
                    start,
                    seq.block_table,
                    seq.pending_src,
                    start + n == len(seq.token_ids),
                )
            )
        return cls(rows, is_prefill)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    def sampled(self) -> list[int]:
        """Indices of the sequences whose last row is sampled after this step."""
        return [i for i, s in enumerate(self.seqs) if s.samples]
