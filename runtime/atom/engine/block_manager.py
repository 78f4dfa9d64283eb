"""Paged KV-cache bookkeeping: fixed-size blocks, reference-counted, with automatic prefix caching.

Every block is free (no owner, no key), in use (reference count > 0: sequences, P/D holds) or
cached (no owner, but its key is known, so a later prompt with the same prefix can take it
back instead of recomputing it). With prefix caching on, a full block whose tokens are all
known is registered under its chained key (atom.engine.prefix_cache) once the step that
computes it is launched; a later step reads it only after that step in stream order. A freed
block that has a key stays cached; blocks are handed out from the free list first and only then
by evicting the least recently freed cached block. Shared blocks are always full and never
written again (a sequence writes only at positions >= its computed count, past its hit).
"""

from __future__ import annotations

from collections import OrderedDict, deque

from atom.engine.batch import PENDING_TOKEN
from atom.engine.prefix_cache import (
    BlockHash,
    PrefixCacheStats,
    SegmentMemo,
    hash_blocks,
    root_hash,
)
from atom.engine.sequence import Sequence


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        enable_prefix_caching: bool = False,
        root: BlockHash | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root = root if root is not None else root_hash("", "")
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}  # key -> block, in use or not
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unowned cached, LRU first
        self.stats = PrefixCacheStats()
        self.memo = SegmentMemo()  # prefixes hashed before: a digest a segment (hash_blocks)

    # ---- counts ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can get now: free ones and cached ones nobody uses."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a key (in use or kept for reuse)."""
        return len(self.cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def extra_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks seq must gain so the cache holds its first num_tokens tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks(seq, num_tokens) <= self.num_free_blocks

    # ---- allocation --------------------------------------------------------------------------
    def _allocate(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)  # least recently freed
            del self.cached[self.block_hash[block]]  # type: ignore[arg-type]
            self.block_hash[block] = None
            self.stats.evicted_blocks += 1
        self.ref_counts[block] = 1
        return block

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.extra_blocks(seq, num_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {need}, free {self.num_free_blocks}")
        for _ in range(need):
            seq.block_table.append(self._allocate())

    def acquire(self, blocks: list[int]) -> None:
        """One more reference to blocks in use (a P/D hold sharing a sequence's blocks)."""
        for block in blocks:
            assert self.ref_counts[block] > 0, f"block {block} is not in use"
            self.ref_counts[block] += 1

    def free(self, seq: Sequence) -> None:
        self.release(seq.block_table)
        seq.block_table.clear()
        seq.num_registered_blocks = 0

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block. The last block goes first: a cached tail is evicted
        before the head it extends, and free blocks are reused most recent first (warm)."""
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} released twice"
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is not None:
                    self.evictable[block] = None
                else:
                    self.free_blocks.appendleft(block)

    # ---- prefix caching ----------------------------------------------------------------------
    def _hash_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Extend seq.block_hashes over its full blocks in the first num_tokens tokens, up to
        the first block holding a token still on the device (PENDING_TOKEN). Pending tokens
        are always the last ones (a step's token is appended as a placeholder and read in
        place), so they are looked for from the end: a scan of a 4,096-token prompt for them
        cost more than its segment digests."""
        bs = self.block_size
        hashes = seq.block_hashes
        first, end = len(hashes), num_tokens // bs
        if first >= end:
            return
        tokens = seq.token_ids
        known = len(tokens)
        while known and tokens[known - 1] == PENDING_TOKEN:
            known -= 1
        end = min(end, known // bs)  # the blocks before the first one holding a pending token
        if first < end:
            extras = seq.block_extra_keys(first, end)
            parent = hashes[-1] if hashes else self.root
            hashes += hash_blocks(
                parent, tokens[first * bs : end * bs], bs, extras, first=first, memo=self.memo
            )

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding seq's leading full blocks. The last token is always computed
        (its logits are needed): a hit ends before the block holding it, unless that block is
        the prompt's last full block, which may be taken too. The last token then computes
        its logits from the cached block, storing nothing (computed_prefix; shared blocks are
        never written), so a prompt found whole costs one decode row, not a block's prefill."""
        if not self.enable_prefix_caching:
            return []
        limit = seq.num_tokens // self.block_size
        self._hash_blocks(seq, limit * self.block_size)
        hit: list[int] = []
        for key in seq.block_hashes[:limit]:
            block = self.cached.get(key)
            if block is None:
                break
            hit.append(block)
        return hit

    def can_admit(self, seq: Sequence, hit: list[int], num_tokens: int) -> bool:
        """Whether seq, starting with the cached blocks `hit`, can hold num_tokens tokens:
        the hit's unowned blocks leave the pool of blocks it can grow from."""
        idle = sum(1 for b in hit if self.ref_counts[b] == 0)
        need = self.blocks_needed(num_tokens) - len(hit)
        return need <= self.num_free_blocks - idle

    def admit(self, seq: Sequence, hit: list[int], num_tokens: int) -> None:
        """Give an empty seq the cached blocks `hit` (its first computed tokens), then the rest
        of num_tokens' blocks."""
        assert not seq.block_table, "a sequence takes cached blocks only when it has none"
        for block in hit:
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
        seq.block_table.extend(hit)
        seq.num_registered_blocks = len(hit)
        seq.num_computed_tokens = self.computed_prefix(seq, hit)
        self.grow(seq, num_tokens)

    def computed_prefix(self, seq: Sequence, hit: list[int]) -> int:
        """Tokens of seq a hit leaves computed: all its blocks' tokens, less the last token
        when the hit holds it (match_prefix), which is computed again for its logits."""
        return min(len(hit) * self.block_size, seq.num_tokens - 1)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody uses, and the counters (after a synthetic warm-up).
        Blocks in use keep their keys: their sequences still hold them."""
        for block in self.evictable:
            del self.cached[self.block_hash[block]]  # type: ignore[arg-type]
            self.block_hash[block] = None
            self.free_blocks.append(block)
        self.evictable.clear()
        self.stats = PrefixCacheStats()

    def record_lookup(self, seq: Sequence, cached_tokens: int) -> None:
        """Count a request's first admission (queries and hits in prompt tokens)."""
        seq.num_cached_tokens = cached_tokens
        if not self.enable_prefix_caching:
            return  # nothing was looked up
        self.stats.requests += 1
        self.stats.queries += seq.num_prompt_tokens
        self.stats.hits += cached_tokens
        if cached_tokens:
            self.stats.requests_hit += 1

    def cache_blocks_of(self, seqs: list[Sequence]) -> None:
        """cache_blocks for each of seqs that has a full computed block of known tokens not
        registered yet (a decode step's few). A last token still on the device (PENDING_TOKEN,
        asynchronous scheduling) keeps its block out until a later call."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for seq in seqs:
            tokens = seq.token_ids
            known = len(tokens) - 1 if tokens and tokens[-1] == PENDING_TOKEN else len(tokens)
            if min(seq.num_computed_tokens, known) // bs > seq.num_registered_blocks:
                self.cache_blocks(seq)

    def cache_blocks(self, seq: Sequence) -> None:
        """Register seq's full computed blocks whose tokens are known (call after the step
        that computes them was launched). A block whose key another block already holds
        stays unkeyed: it is freed as usual, the first copy serves later prompts."""
        if (
            not self.enable_prefix_caching
            or seq.num_computed_tokens // self.block_size <= seq.num_registered_blocks
        ):
            return  # the common decode step: no block filled since the last call
        computed = min(
            seq.num_computed_tokens, seq.num_tokens, len(seq.block_table) * self.block_size
        )
        self._hash_blocks(seq, computed)
        # Hashes past the computed blocks may exist (a lookup hashes the whole prompt).
        full = min(len(seq.block_hashes), computed // self.block_size)
        for i in range(seq.num_registered_blocks, full):
            block, key = seq.block_table[i], seq.block_hashes[i]
            if self.block_hash[block] is None and key not in self.cached:
                self.block_hash[block] = key
                self.cached[key] = block
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)
