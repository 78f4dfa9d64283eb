"""Paged KV block bookkeeping."""

from __future__ import annotations

import pytest

from atom.engine.block_manager import BlockManager
from atom.engine.params import SamplingParams
from atom.engine.sequence import Sequence


def _seq(n: int) -> Sequence:
    return Sequence("r", list(range(n)), SamplingParams())


def test_grow_allocates_whole_blocks_only_when_needed() -> None:
    bm = BlockManager(num_blocks=4, block_size=16)
    s = _seq(17)
    assert bm.extra_blocks(s, 17) == 2
    bm.grow(s, 17)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 2
    bm.grow(s, 32)  # still fits in two blocks
    assert len(s.block_table) == 2
    bm.grow(s, 33)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3


def test_out_of_blocks_and_free() -> None:
    bm = BlockManager(num_blocks=2, block_size=16)
    a, b = _seq(20), _seq(5)
    bm.grow(a, 20)
    assert not bm.can_grow(b, 5)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.grow(b, 5)
    used = list(a.block_table)
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 2 and bm.num_used_blocks == 0
    bm.grow(b, 5)
    assert b.block_table[0] in used


def test_needs_one_block() -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0)
