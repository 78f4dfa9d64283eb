"""Rank 0's commands to the workers (msgpack via msgspec), in the order rank 0 runs them.

Start-up: DetermineBlocks, AllocateKV, WarmupModel, CaptureGraphs (the same order on every
rank, so each compiles and records the same bucket ladder, and the collectives inside them
pair up); then one ExecuteStep per model step; Shutdown at the end. Workers answer nothing
but health (WorkerFailed, just before a worker exits on an error).
"""

from __future__ import annotations

import msgspec

from atom.engine.batch import StepBatch, StepRows

NO_PENDING = -1  # ExecuteStep.pending: the step reads no previous step's sampled ids


class ExecuteStep(msgspec.Struct, tag=True, array_like=True, gc=False):
    """A StepBatch by column (StepRows' fields), and the length of the previous step's sampled
    ids that rank 0 broadcasts right after (the rows whose token is PENDING_TOKEN read them).
    block_tables: None for a table unchanged since the previous step (TableDelta)."""

    is_prefill: bool
    logits_all: bool
    request_ids: list[str]
    token_ids: list[int]
    num_tokens: list[int]
    starts: list[int]
    block_tables: list[list[int] | None]
    pending_src: list[int | None]
    samples: list[bool]
    pending: int = NO_PENDING
    shared_kv: list[int] = []  # StepBatch.shared_kv

    @classmethod
    def of(cls, batch: StepBatch, pending: int, tables: TableDelta) -> ExecuteStep:
        r = batch.rows
        return cls(batch.is_prefill, batch.logits_all, r.request_ids, r.token_ids, r.num_tokens,
                   r.starts, tables.encode(r.request_ids, r.block_tables), r.pending_src,
                   r.samples, pending, list(batch.shared_kv))

    def batch(self, tables: TableDelta) -> StepBatch:
        rows = StepRows(self.request_ids, self.token_ids, self.num_tokens, self.starts,
                        tables.decode(self.request_ids, self.block_tables), self.pending_src,
                        self.samples)
        return StepBatch(None, self.is_prefill, self.logits_all, rows=rows,
                         shared_kv=tuple(self.shared_kv))


class TableDelta:
    """The block tables of the previous step, by request id, on both sides of the pipe: a
    decode step changes few (a table grows by a block every block_size tokens), so the others
    travel as None (at 256 requests of 64 blocks a step's message shrinks from ~35 kB)."""

    def __init__(self) -> None:
        self._prev: dict[str, list[int]] = {}

    def encode(self, ids: list[str], tables: list[list[int]]) -> list[list[int] | None]:
        prev, cur = self._prev, {}
        out: list[list[int] | None] = []
        for rid, table in zip(ids, tables, strict=True):
            held = prev.get(rid)
            if held is not None and held == table:
                out.append(None)
            else:
                held = list(table)  # a copy: the engine appends to its tables in place
                out.append(held)
            cur[rid] = held
        self._prev = cur
        return out

    def decode(self, ids: list[str], sent: list[list[int] | None]) -> list[list[int]]:
        prev, cur = self._prev, {}
        out = []
        for rid, table in zip(ids, sent, strict=True):
            if table is None:
                table = prev[rid]
            cur[rid] = table
            out.append(table)
        self._prev = cur
        return out


class DetermineBlocks(msgspec.Struct, tag=True, array_like=True):
    """Each rank sizes its KV cache (a profile run on CUDA); all take the smallest."""


class AllocateKV(msgspec.Struct, tag=True, array_like=True):
    num_blocks: int


class WarmupModel(msgspec.Struct, tag=True, array_like=True):
    pass


class CaptureGraphs(msgspec.Struct, tag=True, array_like=True):
    pass


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


Command = ExecuteStep | DetermineBlocks | AllocateKV | WarmupModel | CaptureGraphs | Shutdown


class WorkerFailed(msgspec.Struct, tag=True, array_like=True):
    """A worker's last word: why it is exiting (its log has the traceback)."""

    rank: int
    error: str


def command_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Command)


def health_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(WorkerFailed)
