"""The batch the scheduler hands the model runner: plain typed rows, no Sequence.

The model runner sits below the scheduler: it reads what a step computes (tokens, positions,
block tables) from a `StepBatch` and never imports `atom.engine.sequence`. The engine builds
the batch from its scheduled sequences with `StepBatch.of`, which reads them through the
`ScheduledSequence` protocol straight into columns (`StepRows`: one list per field, no object
per sequence; at 256 sequences a step's host time is what bounds serving, issue 26); batches
built from `SeqRows` (speculative decoding's) give the same columns.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import chain
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
    lora_slot: int  # its LoRA adapter's slot (0: none, atom.lora)


@dataclass(frozen=True)
class SeqRows:
    """One sequence's rows of a step: the tokens it computes, from position `start` on."""

    request_id: str
    token_ids: list[int]  # the scheduled tokens only
    start: int  # tokens already in the KV cache: the first row's position
    block_table: list[int]
    pending_src: int | None  # row of the previous step's sampled ids its PENDING_TOKEN takes
    samples: bool  # the step computes the sequence's last token: its last row gives logits
    lora_slot: int = 0  # its LoRA adapter's slot (0: none)

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class StepRows:
    """A step's rows by column, one entry per sequence in order (what the runner reads: no
    object per sequence to build each step)."""

    request_ids: list[str]
    token_ids: list[int]  # every sequence's scheduled tokens, one sequence after the other
    num_tokens: list[int]  # scheduled tokens (rows) per sequence
    starts: list[int]
    block_tables: list[list[int]]
    pending_src: list[int | None]
    samples: list[bool]
    # each sequence's LoRA slot (0: none); empty: none has one (a worker's step: LoRA runs
    # at one rank only)
    lora_slots: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, seqs: list[SeqRows]) -> StepRows:
        return cls(
            [s.request_id for s in seqs],
            list(chain.from_iterable(s.token_ids for s in seqs)),
            [len(s.token_ids) for s in seqs],
            [s.start for s in seqs],
            [s.block_table for s in seqs],
            [s.pending_src for s in seqs],
            [s.samples for s in seqs],
            # one spelling of "no adapter": empty, as a worker's step carries it
            [s.lora_slot for s in seqs] if any(s.lora_slot for s in seqs) else [],
        )

    def seq_rows(self) -> list[SeqRows]:
        out, row = [], 0
        for i, n in enumerate(self.num_tokens):
            out.append(
                SeqRows(
                    self.request_ids[i],
                    self.token_ids[row : row + n],
                    self.starts[i],
                    self.block_tables[i],
                    self.pending_src[i],
                    self.samples[i],
                    self.lora_slots[i] if self.lora_slots else 0,
                )
            )
            row += n
        return out


class StepBatch:
    """One scheduled step: its sequences' rows, in order, and its phase. Built from SeqRows
    (`seqs`) or, by `of`, from the scheduled sequences straight into columns (`rows`); each
    view is made from the other when first asked for."""

    def __init__(
        self,
        seqs: list[SeqRows] | None,
        is_prefill: bool,
        logits_all: bool = False,  # a verify step: logits of every row (k + 1 per request)
        *,
        rows: StepRows | None = None,
        shared_kv: tuple[int, ...] = (),
    ) -> None:
        if seqs is None and rows is None:
            raise ValueError("a StepBatch needs its sequences' rows")
        self._seqs = seqs
        self._rows = rows
        self.is_prefill = is_prefill
        self.logits_all = logits_all
        # Sequences (indices) whose one scheduled row already has its key and value in a
        # shared cached block (a prompt found whole in the prefix cache): the row is computed
        # for its logits but stores nothing, since a shared block is never written again.
        self.shared_kv = shared_kv

    @classmethod
    def of(cls, seqs: Iterable[ScheduledSequence], is_prefill: bool,
           shared_kv: tuple[int, ...] = ()) -> StepBatch:
        seqs = seqs if isinstance(seqs, list) else list(seqs)
        starts = [s.num_computed_tokens for s in seqs]
        counts = [s.num_scheduled_tokens for s in seqs]
        samples = [p + n == len(s.token_ids) for s, p, n in zip(seqs, starts, counts, strict=True)]
        if counts.count(1) == len(counts) and all(samples):
            ids = [s.token_ids[p] for s, p in zip(seqs, starts, strict=True)]  # a decode step
        else:
            chunks = [s.token_ids[p : p + n] for s, p, n in zip(seqs, starts, counts, strict=True)]
            ids = list(chain.from_iterable(chunks))
            counts = [len(chunk) for chunk in chunks]
        rows = StepRows(
            [s.request_id for s in seqs],
            ids,
            counts,
            starts,
            [s.block_table for s in seqs],
            [s.pending_src for s in seqs],
            samples,
            [s.lora_slot for s in seqs],
        )
        return cls(None, is_prefill, rows=rows, shared_kv=shared_kv)

    @property
    def seqs(self) -> list[SeqRows]:
        if self._seqs is None:
            self._seqs = self.rows.seq_rows()
        return self._seqs

    @property
    def rows(self) -> StepRows:
        if self._rows is None:
            self._rows = StepRows.of(self._seqs or [])
        return self._rows

    @property
    def num_seqs(self) -> int:
        return len(self.rows.starts)

    @property
    def num_tokens(self) -> int:
        return len(self.rows.token_ids)

    def sampled(self) -> list[int]:
        """Indices of the sequences whose last row is sampled after this step."""
        samples = self.rows.samples
        if all(samples):
            return list(range(len(samples)))
        return [i for i, s in enumerate(samples) if s]
