"""Prefill token buckets above the decode sizes (issue 47).

TR_HYBRID records a prefill (mixed) step's token graph at each decode capture size (up to
max_num_seqs, 512 by default); a larger step ran eagerly, launch-bound (docs/performance.md).
These buckets extend the prefill phase's ladder up to the scheduler's token budget
(max_num_batched_tokens) in steps of about 1.4x (1k, 1.5k, 2k, 3k, ... 8k), so a step pads by
at most half a bucket's rows.

A recording's dummy batch lays the rows out as sequences of up to a block's tokens in the
reserved block (the runner's per-sequence buffers hold max_num_seqs sequences, not one per
row), so a bucket must be a multiple of its rows per sequence.
"""

from __future__ import annotations

from typing import NamedTuple

DEFAULT_PREFILL_TOKEN_SIZES = (768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


class DummyLayout(NamedTuple):
    """A dummy prefill batch: num_seqs sequences of q_len rows each."""

    num_seqs: int
    q_len: int


def dummy_layout(rows: int, max_num_seqs: int, block_size: int) -> DummyLayout | None:
    """rows as sequences of one row (rows <= max_num_seqs, as the decode ladder records them)
    or of the fewest rows per sequence (<= block_size) that fit max_num_seqs and divide rows;
    None when no layout fits."""
    if rows <= max_num_seqs:
        return DummyLayout(rows, 1)
    for q_len in range(-(-rows // max_num_seqs), block_size + 1):
        if rows % q_len == 0:
            return DummyLayout(rows // q_len, q_len)
    return None


def prefill_token_sizes(decode_sizes: list[int], extra: list[int] | None,
                        max_num_batched_tokens: int, max_num_seqs: int,
                        block_size: int) -> list[int]:
    """The prefill phase's token buckets, ascending: the decode capture sizes plus the extra
    buckets (None: DEFAULT_PREFILL_TOKEN_SIZES) above the largest of them, up to the token
    budget, each one a dummy batch can lay out."""
    extra_sizes = DEFAULT_PREFILL_TOKEN_SIZES if extra is None else tuple(extra)
    top = max(decode_sizes, default=0)
    above = [s for s in extra_sizes
             if top < s <= max_num_batched_tokens
             and dummy_layout(s, max_num_seqs, block_size) is not None]
    return sorted(set(decode_sizes) | set(above))
