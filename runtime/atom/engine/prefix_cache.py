"""Keys of cached KV blocks and the prefix cache's counters (automatic prefix caching).

A full block is identified by a hash chained over its token ids and every block before it, so
equal keys mean equal KV: a block's keys and values depend on its own tokens, on every token
before it (attention) and on what produced them. The chain starts from a root that digests the
model identity (`atom.disagg.layout.model_identity`: checkpoint or built-in shape, architecture,
dummy-weight seed) and the cache dtype, so two models never share a key.

Per-block extra keys (`BlockKeyExtra`) hold what else changes a block's KV beyond the token ids:
today a per-request salt (empty by default); a LoRA adapter's id and the hashes of multimodal
inputs overlapping the block go there too when those land, without changing the chain.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType, Protocol

# sha256 digest of (parent hash, extra keys, token ids) of one full block.
BlockHash = NewType("BlockHash", bytes)

KEY_VERSION = b"atom-prefix-cache-v1"


def root_hash(model_identity: str, dtype: str) -> BlockHash:
    """The chain's start: what makes two instances' blocks interchangeable."""
    return BlockHash(
        hashlib.sha256(b"|".join([KEY_VERSION, model_identity.encode(), dtype.encode()])).digest()
    )


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Key of one full block after `parent` (the previous block's key, or the root)."""
    h = hashlib.sha256(parent)
    # Length-prefixed so (extra, tokens) never collide with another split of the same bytes.
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    h.update(array("q", token_ids).tobytes())
    return BlockHash(h.digest())


def hash_blocks(
    parent: BlockHash,
    token_ids: Sequence[int],
    block_size: int,
    extras: Sequence[bytes],
) -> list[BlockHash]:
    """hash_block over consecutive full blocks of token_ids (len(extras) of them, block i's
    extra key extras[i]), chained from `parent`: the same keys, with the ids converted to
    bytes once for all the blocks rather than a list slice and an array per block (a
    4,096-token prompt: 256 blocks, hashed at every request, cached or not)."""
    data = array("q", token_ids[: len(extras) * block_size]).tobytes()
    step = 8 * block_size
    sha256 = hashlib.sha256
    out: list[BlockHash] = []
    header, last_extra = b"", None
    for i, extra in enumerate(extras):
        if extra is not last_extra:  # one salt for every block, as a rule
            header, last_extra = len(extra).to_bytes(4, "little") + extra, extra
        # One call on the joined bytes (a few hundred): half the time of update() calls.
        parent = BlockHash(sha256(parent + header + data[i * step : (i + 1) * step]).digest())
        out.append(parent)
    return out


class BlockKeyExtra(Protocol):
    """What a sequence adds to its blocks' keys beyond the token ids (atom.engine.sequence)."""

    def block_extra_key(self, index: int) -> bytes:
        """Extra key bytes of the sequence's block `index` (b"" when only tokens matter)."""
        ...


@dataclass
class PrefixCacheStats:
    """Counted once per request, at its first admission (recomputes after preemption and
    pulled prompts are not lookups): prompt tokens looked up and prompt tokens found."""

    queries: int = 0  # prompt tokens of admitted requests
    hits: int = 0  # of those, tokens whose KV came from the cache
    requests: int = 0
    requests_hit: int = 0  # requests with at least one cached block
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
