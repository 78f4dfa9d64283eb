"""Paged KV-cache bookkeeping: fixed-size blocks handed out from a free list."""

from __future__ import annotations

from collections import deque

from atom.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def extra_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks seq must gain so the cache holds its first num_tokens tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks(seq, num_tokens) <= len(self.free_blocks)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.extra_blocks(seq, num_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError(f"out of KV blocks: need {need}, free {len(self.free_blocks)}")
        for _ in range(need):
            seq.block_table.append(self.free_blocks.popleft())

    def free(self, seq: Sequence) -> None:
        self.release(seq.block_table)
        seq.block_table.clear()

    def release(self, blocks: list[int]) -> None:
        # Returned to the front: recently used blocks are reused first (warm in cache).
        for block in reversed(blocks):
            self.free_blocks.appendleft(block)
