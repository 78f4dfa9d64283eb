"""Automatic prefix caching in the block manager: chained block keys and their memo, reference
counts, LRU eviction only under pressure, pending tokens never keyed, and exact hit counters on a
scripted sequence. test_prefix_caching.py runs engines with caching on and off."""

from __future__ import annotations

from tiny import tiny_tokens

from atom.engine import SamplingParams
from atom.engine.block_manager import BlockManager
from atom.engine.prefix_cache import (
    SEGMENT_BLOCKS,
    SegmentMemo,
    hash_block,
    hash_blocks,
    root_hash,
)
from atom.engine.scheduler import Scheduler
from atom.engine.sequence import PENDING_TOKEN, Sequence

BS = 16


def _seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams())


# ---- block manager -------------------------------------------------------------------------------
def test_keys_chain_over_every_block_before_and_the_model() -> None:
    root = root_hash("model-a", "bfloat16")
    a = hash_block(root, tiny_tokens(BS))
    assert a == hash_block(root, tiny_tokens(BS))
    assert a != hash_block(root_hash("model-b", "bfloat16"), tiny_tokens(BS))  # another model
    assert a != hash_block(root_hash("model-a", "float16"), tiny_tokens(BS))  # another cache dtype
    assert a != hash_block(root, tiny_tokens(BS), b"lora:1")  # extra keys (LoRA, multimodal, salt)
    # the same tokens after another first block get another key
    b1 = hash_block(a, tiny_tokens(BS, 1))
    assert b1 != hash_block(hash_block(root, tiny_tokens(BS, 2)), tiny_tokens(BS, 1))


def test_hash_blocks_are_the_chained_keys_of_hash_block() -> None:
    """The batched keys (one bytes conversion per prompt) equal the block-by-block chain, with
    a shared extra key, per-block extra keys, and tokens past the last full block ignored."""
    root = root_hash("model-a", "bfloat16")
    tokens = tiny_tokens(5 * BS + 3)
    salt = b"tenant-7"
    for extras in ([b""] * 5, [salt] * 5, [b"", b"a", b"a", b"bc", b""]):
        want, parent = [], root
        for i, extra in enumerate(extras):
            parent = hash_block(parent, tokens[i * BS : (i + 1) * BS], extra)
            want.append(parent)
        assert hash_blocks(root, tokens, BS, extras) == want
    # from a parent inside the chain: the blocks after it
    assert hash_blocks(want[1], tokens[2 * BS :], BS, extras[2:]) == want[2:]


def test_segment_memo_gives_the_chained_keys_and_is_used() -> None:
    """With the memo, a prefix hashed before is found a segment at a time (hits counted), and
    the keys equal the block-by-block chain whatever the start index, salt or length; another
    parent, salt or token in a segment misses; the memo keeps at most its capacity."""
    root = root_hash("model-a", "bfloat16")
    n = 3 * SEGMENT_BLOCKS + 5
    tokens = tiny_tokens(n * BS)
    memo = SegmentMemo()
    plain = hash_blocks(root, tokens, BS, [b""] * n)
    assert hash_blocks(root, tokens, BS, [b""] * n, memo=memo) == plain
    assert (memo.hits, memo.misses, len(memo)) == (0, 3, 3)  # the 5-block tail is not a segment
    assert hash_blocks(root, tokens, BS, [b""] * n, memo=memo) == plain
    assert memo.hits == 3
    # Started mid-chain (a sequence extended block by block, then by a lookup): same keys,
    # segments counted from the sequence's first block.
    k = SEGMENT_BLOCKS + 3
    rest = hash_blocks(plain[k - 1], tokens[k * BS :], BS, [b""] * (n - k), first=k, memo=memo)
    assert rest == plain[k:]
    assert memo.hits == 4  # the third segment only: the second starts before block k
    # A salt, another parent or one token changed in a segment: its own keys, no false hit.
    salted = hash_blocks(root, tokens, BS, [b"tenant"] * n, memo=memo)
    assert salted == hash_blocks(root, tokens, BS, [b"tenant"] * n) and salted[0] != plain[0]
    other = hash_blocks(plain[0], tokens, BS, [b""] * n, memo=memo)
    assert other == hash_blocks(plain[0], tokens, BS, [b""] * n) and other[0] != plain[0]
    changed = list(tokens)
    changed[SEGMENT_BLOCKS * BS + 1] += 1  # second segment
    got = hash_blocks(root, changed, BS, [b""] * n, memo=memo)
    assert got[:SEGMENT_BLOCKS] == plain[:SEGMENT_BLOCKS]
    assert got == hash_blocks(root, changed, BS, [b""] * n)
    assert all(a != b for a, b in zip(got[SEGMENT_BLOCKS:], plain[SEGMENT_BLOCKS:], strict=True))
    small = SegmentMemo(capacity=2)
    hash_blocks(root, tokens, BS, [b""] * n, memo=small)
    assert len(small) == 2
    hash_blocks(root, tokens, BS, [b""] * n, memo=small)
    assert small.hits == 0  # the first segment was dropped, so the chain missed from there


def test_block_manager_lookup_uses_the_memo() -> None:
    """A repeated prompt's lookup in the block manager finds its segments in the memo."""
    bm = BlockManager(64, BS, enable_prefix_caching=True)
    tokens = tiny_tokens(2 * SEGMENT_BLOCKS * BS + 4)
    _registered(bm, "a", tokens)
    assert bm.memo.hits == 0
    again = _seq("b", tokens)
    assert len(bm.match_prefix(again)) == 2 * SEGMENT_BLOCKS
    assert bm.memo.hits == 2


def _registered(bm: BlockManager, rid: str, tokens: list[int]) -> Sequence:
    """A sequence whose prompt was scheduled, computed and registered, then finished."""
    s = _seq(rid, tokens)
    hit = bm.match_prefix(s)
    bm.admit(s, hit, len(tokens))
    bm.record_lookup(s, len(hit) * BS)
    s.num_computed_tokens = len(tokens)
    bm.cache_blocks(s)
    return s


def test_hit_leaves_the_last_token_to_compute_and_is_refcounted() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    prompt = tiny_tokens(3 * BS)
    a = _registered(bm, "a", prompt)
    assert bm.num_cached_blocks == 3 and bm.num_used_blocks == 3
    # the same 48 tokens: all three blocks are shared and only the last token is computed
    # again (for its logits; its key and value stay in the shared block)
    b = _seq("b", prompt)
    hit = bm.match_prefix(b)
    assert hit == a.block_table
    bm.admit(b, hit, len(prompt))
    assert b.num_computed_tokens == 47 and b.block_table == a.block_table
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 2]
    # 47 of the tokens: the hit stops before the block holding the last token
    c = _seq("c", prompt[:-1])
    hit = bm.match_prefix(c)
    assert hit == a.block_table[:2]
    bm.admit(c, hit, len(prompt) - 1)
    assert c.num_computed_tokens == 32 and c.block_table[2] != a.block_table[2]
    bm.free(a)
    bm.free(c)
    assert bm.num_used_blocks == 3 and not bm.evictable  # b holds a's; c's own was unkeyed
    bm.free(b)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 8 and bm.num_cached_blocks == 3
    # 49 tokens: three blocks hit; one block + 1 token: one; the first block alone: that one
    assert len(bm.match_prefix(_seq("d", prompt + [5]))) == 3
    assert len(bm.match_prefix(_seq("e", prompt[:BS]))) == 1
    assert len(bm.match_prefix(_seq("f", prompt[:BS] + [9]))) == 1
    assert len(bm.match_prefix(_seq("g", [9] + prompt[1:]))) == 0  # first token differs


def test_cached_blocks_are_evicted_lru_only_when_the_pool_needs_them() -> None:
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    old = _registered(bm, "old", tiny_tokens(2 * BS, 1))
    old_blocks = list(old.block_table)
    bm.free(old)
    new = _registered(bm, "new", tiny_tokens(2 * BS, 2))
    bm.free(new)
    assert bm.num_free_blocks == 4 and len(bm.free_blocks) == 0 and bm.num_cached_blocks == 4
    # one block needed: the least recently freed cached block goes (old's tail before its head)
    s = _seq("s", tiny_tokens(BS, 3))
    bm.grow(s, BS)
    assert s.block_table == [old_blocks[1]] and bm.stats.evicted_blocks == 1
    assert len(bm.match_prefix(_seq("o", tiny_tokens(2 * BS, 1) + [1]))) == 1  # old's head is still there
    assert len(bm.match_prefix(_seq("n", tiny_tokens(2 * BS, 2) + [1]))) == 2


def test_held_blocks_are_never_evicted() -> None:
    bm = BlockManager(3, BS, enable_prefix_caching=True)
    a = _registered(bm, "a", tiny_tokens(2 * BS))
    held = list(a.block_table)
    bm.acquire(held)  # a P/D hold's reference
    bm.free(a)
    assert bm.num_free_blocks == 1
    s = _seq("s", tiny_tokens(3 * BS, 5))
    assert not bm.can_grow(s, 2 * BS)
    bm.grow(s, BS)
    assert s.block_table[0] not in held
    bm.release(held)  # the hold ended
    assert bm.num_free_blocks == 2 and bm.num_cached_blocks == 2


def test_blocks_with_a_pending_token_are_not_keyed() -> None:
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    # A step launched while the one before is unread: two placeholders, the last tokens.
    s = _seq("s", tiny_tokens(BS - 1) + [PENDING_TOKEN, PENDING_TOKEN])
    bm.grow(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.cache_blocks(s)
    assert bm.num_cached_blocks == 0 and s.block_hashes == []
    s.token_ids[BS - 1] = 77  # the host read the first
    bm.cache_blocks(s)
    assert bm.num_cached_blocks == 1


def test_disabled_manager_never_keys_or_hits() -> None:
    bm = BlockManager(4, BS)
    a = _registered(bm, "a", tiny_tokens(3 * BS))
    bm.free(a)
    assert bm.num_cached_blocks == 0 and bm.match_prefix(_seq("b", tiny_tokens(3 * BS))) == []
    assert len(bm.free_blocks) == 4


def test_hit_counters_are_exact_on_a_scripted_sequence() -> None:
    """Queries count each request's prompt tokens once; hits its cached prompt tokens."""
    bm = BlockManager(32, BS, enable_prefix_caching=True)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256)
    system = tiny_tokens(40, 9)  # two full blocks and 8 tokens

    def run(rid: str, tokens: list[int]) -> Sequence:
        seq = Sequence(rid, tokens, SamplingParams())
        s.add(seq)
        out = s.schedule()
        assert out.seqs == [seq]
        assert out.shared_kv == ([0] if rid == "exact-block" else [])
        seq.num_computed_tokens += seq.num_scheduled_tokens
        bm.cache_blocks(seq)
        s.finish(seq, "stop")
        return seq

    script = [
        ("cold", system + tiny_tokens(10, 1), 0),  # nothing cached yet
        ("same-system", system + tiny_tokens(30, 2), 32),  # the system prompt's two full blocks
        ("repeat", system + tiny_tokens(30, 2), 64),  # 70 tokens: (70 - 1) // 16 = 4 blocks
        # 32 tokens, both blocks cached: only the last token is computed (it stores no KV)
        ("exact-block", system[:32], 31),
        ("other", tiny_tokens(50, 3), 0),
    ]
    for rid, tokens, cached in script:
        seq = run(rid, tokens)
        assert seq.num_cached_tokens == cached, rid
        assert seq.num_scheduled_tokens == 0 and seq.num_computed_tokens == len(tokens)
    assert bm.stats.queries == sum(len(t) for _, t, _ in script)
    assert bm.stats.hits == 32 + 64 + 31
    assert (bm.stats.requests, bm.stats.requests_hit) == (5, 3)
    assert bm.num_used_blocks == 0
