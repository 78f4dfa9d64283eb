"""A step's token bitmask: filled on the host, copied to the logits' device, applied in place.

Rows are the sampled rows of the step (a verify step: k + 1 per request); only the rows of
constrained requests are applied (xgrammar's `indices`), so free rows in the same batch cost
nothing. Two pinned host buffers serve in turn on CUDA: the copy of one step's mask may still
be queued while the next step's is filled, and an event says when a buffer is free again.
"""

from __future__ import annotations

import torch
import xgrammar as xgr

CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # xgrammar's CPU kernel's


class StepMask:
    """One step's filled mask: host rows and which of them to apply."""

    def __init__(self, host: torch.Tensor, rows: list[int], vocab_size: int,
                 slot: MaskBuffers | None = None, turn: int = 0) -> None:
        self.host = host  # int32 [n, ceil(vocab / 32)]
        self.rows = rows
        self.vocab_size = vocab_size
        self._slot = slot
        self._turn = turn

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Set the disallowed tokens of the constrained rows of logits [n, vocab] to -inf, in
        place; returns logits."""
        if logits.device.type == "cpu":
            if logits.dtype in CPU_KERNEL_DTYPES:
                xgr.apply_token_bitmask_inplace(logits, self.host, vocab_size=self.vocab_size,
                                                indices=self.rows)
            else:
                _apply_torch(logits, self.host, self.rows, self.vocab_size)
            return logits
        from xgrammar.kernels.apply_token_bitmask_inplace_triton import (
            apply_token_bitmask_inplace_triton,
        )

        mask = self.host.to(logits.device, non_blocking=True)
        if self._slot is not None:
            self._slot.copied(self._turn)
        # Every row, or the rows from pinned memory: xgrammar would copy a list from pageable
        # memory, which waits for the stream (and the step launched ahead).
        rows = None if len(self.rows) == logits.shape[0] else torch.tensor(
            self.rows, dtype=torch.int32, pin_memory=True).to(logits.device, non_blocking=True)
        apply_token_bitmask_inplace_triton(logits, mask, self.vocab_size, rows)
        return logits


def _apply_torch(logits: torch.Tensor, mask: torch.Tensor, rows: list[int],
                 vocab_size: int) -> None:
    bits = torch.arange(32, dtype=torch.int32)
    idx = torch.tensor(rows, dtype=torch.long)
    allowed = ((mask[idx, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab_size]
    sub = logits[idx, :vocab_size].masked_fill(~allowed, float("-inf"))
    logits[idx, :vocab_size] = sub


class MaskBuffers:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self._cuda = device.type == "cuda"
        shape = xgr.get_bitmask_shape(max_rows, vocab_size)
        self._host = [torch.empty(shape, dtype=torch.int32, pin_memory=self._cuda)
                      for _ in range(2 if self._cuda else 1)]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    @property
    def max_rows(self) -> int:
        return int(self._host[0].shape[0])

    def take(self, n: int) -> tuple[torch.Tensor, int]:
        """A host buffer [n, words] free to fill, and its turn (for StepMask)."""
        if n > self.max_rows:  # a bigger verify than planned: a one-off buffer
            return torch.empty(xgr.get_bitmask_shape(n, self.vocab_size), dtype=torch.int32), -1
        turn = self._turn
        self._turn = (turn + 1) % len(self._host)
        event = self._events[turn]
        if event is not None:
            event.synchronize()  # that buffer's last copy has run
            self._events[turn] = None
        return self._host[turn][:n], turn

    def copied(self, turn: int) -> None:
        if self._cuda and turn >= 0:
            event = torch.cuda.Event()
            event.record()
            self._events[turn] = event

    def mask(self, host: torch.Tensor, turn: int, rows: list[int]) -> StepMask:
        return StepMask(host, rows, self.vocab_size, self, turn)
