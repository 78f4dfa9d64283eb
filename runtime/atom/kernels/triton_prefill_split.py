"""Split-KV prefill attention (flash-decoding for prefill): few query rows over a long context.

A prefill chunk of 16 rows over 4,080 cached tokens (the tail of a prompt whose prefix the
cache served) gives the tiled prefill kernel (triton_attention._prefill_kernel) one program per
(sequence, query head, 64 rows): 32 programs at Llama-3.2-1B's 32 heads, each walking all 256
cache blocks in turn, in every layer; latency-bound (4.2-6.5 ms a step on an H200).

Here a program takes one row block of a sequence's query rows times the GROUP query heads that
share a kv head (the rows of one tensor-core dot, as the decode kernel packs heads, so each key
tile is read once per kv head) and one of NUM_SPLITS slices of the block's key tiles. A slice
writes its partial (normalised output, max, sum) in the decode kernel's layout, and a second
launch combines each row's partials in split order (attention_tiles.combine_splits, the
decode kernel's combine); a row block whose keys fit one slice writes its output directly.

Causal semantics are the tiled kernel's: query row i of a sequence with q_len rows and context
ctx sits at position ctx - q_len + i and sees the keys at positions <= its own. Prefill runs
eagerly (never graph-recorded), so the split count is chosen on the host from the step's
longest context (AttentionMetaData.max_seqlen_k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.attention_tiles import (
    COMBINE_CHUNK,
    attend_tile,
    combine_splits,
    dot_precision,
    kv_tile,
    load_q_rows,
    rope_pointers,
    seq_rows,
)
from atom.kernels.rotary import Rope

# Read at launch time (module attributes). Not yet set by a measurement: the H200 figures of
# bench/prefill_split_bench.py (split counts swept per chunk and context) are to set them.
# The split path takes chunks of at most this many query rows per sequence; longer ones fill
# the GPU with the tiled kernel's own row blocks.
SPLIT_MAX_Q = 64
# ... over a context of at least this many tokens (shorter walks are short anyway).
SPLIT_MIN_CONTEXT = 512
# Programs the split launch aims for (H200: 132 SMs, two programs each), and the most slices
# of a row block.
SPLIT_TARGET_PROGRAMS = 256
SPLIT_MAX_SPLITS = 64
# Keys per loop step (4 cache blocks of 16, as the decode kernel); packed dot rows per program
# (query rows x GROUP_P2 heads) at head_dim 64, half at 128: 64 in bf16 (132 registers on
# sm_90), 16 in fp32, whose exact ("ieee") dot is no tensor-core op (64 rows spilled 14 KB a
# thread, 16 rows take 93 registers). The combine reads attention_tiles.COMBINE_CHUNK splits'
# partials a step, as the decode kernel's does.
TILE_N = 64
PACKED_ROWS = 64
FP32_PACKED_ROWS = 16


@triton.jit
def _split_range(ctx, q_len, mblk, split, NUM_SPLITS: tl.constexpr, BLOCK_Q: tl.constexpr,
                 TILE_N: tl.constexpr):
    """(first key, end key, active splits) of row block mblk's slice split: the block sees the
    keys up to its last row's position, its key tiles dealt in even runs to the splits (a
    short context uses fewer splits: those past `active` have nothing to do)."""
    kv_end = tl.minimum(ctx - q_len + (mblk + 1) * BLOCK_Q, ctx)
    tiles = tl.cdiv(tl.maximum(kv_end, 0), TILE_N)
    per_split = tl.maximum(tl.cdiv(tiles, NUM_SPLITS), 1)
    active = tl.cdiv(tiles, per_split)
    t_start = split * per_split * TILE_N
    t_end = tl.minimum(t_start + per_split * TILE_N, kv_end)
    return t_start, t_end, active


@triton.jit
def _prefill_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_ml_ptr,
                          cu_q_ptr, ctx_ptr, bt_ptr, pos_ptr, cos_ptr, sin_ptr, scale, stride_q,
                          stride_o, stride_bt, num_mblocks, NUM_KV_HEADS: tl.constexpr,
                          GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                          PRECISION: tl.constexpr, ROPE: tl.constexpr):
    """One program per (sequence x row block, kv head, split)."""
    seq = tl.program_id(0) // num_mblocks
    mblk = tl.program_id(0) % num_mblocks
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start, q_len, ctx = seq_rows(cu_q_ptr, ctx_ptr, seq)
    t_start, t_end, active = _split_range(ctx, q_len, mblk, split, NUM_SPLITS, BLOCK_Q, TILE_N)
    if (mblk * BLOCK_Q < q_len) & (split < active):
        # Packed row r: query row r // GROUP_P2 of the block, head r % GROUP_P2 of the group.
        offs_r = tl.arange(0, BLOCK_Q * GROUP_P2)
        qi = mblk * BLOCK_Q + offs_r // GROUP_P2
        g = offs_r % GROUP_P2
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        r_mask = (qi < q_len) & (g < GROUP)
        heads = kv_head * GROUP + g
        rows = (q_start + qi).to(tl.int64)
        q = load_q_rows(q_ptr, rows, heads[:, None] * HEAD_DIM, stride_q, r_mask, pos_ptr,
                         cos_ptr, sin_ptr, HEAD_DIM, BLOCK_D, ROPE)
        q_pos = ctx - q_len + qi
        m_i = tl.full([BLOCK_Q * GROUP_P2], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_P2], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_P2, BLOCK_D], tl.float32)
        kv_row = NUM_KV_HEADS * HEAD_DIM
        for t in range(t_start, t_end, TILE_N):
            k, v, t_mask = kv_tile(t, t_end, seq, kv_head, k_cache_ptr, v_cache_ptr, bt_ptr,
                                    stride_bt, kv_row, d_mask, HEAD_DIM, BLOCK_D, BLOCK_SIZE,
                                    TILE_N)
            tok = t + tl.arange(0, TILE_N)
            valid = t_mask[None, :] & (tok[None, :] <= q_pos[:, None])
            m_i, l_i, acc = attend_tile(q, k, v, valid, m_i, l_i, acc, scale, PRECISION)
        # A row whose keys all lie past this slice saw none: l = 0, output 0, combine weight 0.
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if active <= 1:
            tl.store(out_ptr + rows[:, None] * stride_o + heads[:, None] * HEAD_DIM
                     + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=r_mask[:, None] & d_mask[None, :])
        else:
            # The decode kernel's layout: [(row, kv head), split, GROUP_P2 heads].
            part = ((rows * NUM_KV_HEADS + kv_head) * NUM_SPLITS + split) * GROUP_P2 + g
            tl.store(part_o_ptr + part[:, None] * BLOCK_D + offs_d[None, :], o,
                     mask=r_mask[:, None])
            tl.store(part_ml_ptr + part * 2, m_i, mask=r_mask)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=r_mask)


@triton.jit
def _prefill_combine_kernel(out_ptr, part_o_ptr, part_ml_ptr, cu_q_ptr, ctx_ptr, stride_o,
                            NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                            GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
                            NUM_SPLITS: tl.constexpr, CHUNK: tl.constexpr):
    """One program per (sequence, query row, kv head): the row's GROUP heads from the
    partials of its row block's active splits (none to combine when it had one)."""
    seq = tl.program_id(0)
    i = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start, q_len, ctx = seq_rows(cu_q_ptr, ctx_ptr, seq)
    _, _, active = _split_range(ctx, q_len, i // BLOCK_Q, 0, NUM_SPLITS, BLOCK_Q, TILE_N)
    if (i < q_len) & (active > 1):
        row64 = (q_start + i).to(tl.int64)
        combine_splits(out_ptr, part_o_ptr, part_ml_ptr, row64, kv_head,
                        row64 * NUM_KV_HEADS + kv_head, active, stride_o, NUM_SPLITS, GROUP,
                        GROUP_P2, HEAD_DIM, BLOCK_D, CHUNK)


def block_q(max_seqlen_q: int, group: int, head_dim: int, dtype: torch.dtype) -> int:
    """Query rows of a row block: the packed dot rows for the dtype and head size, with the
    group's heads, at least 16 dot rows."""
    group_p2 = triton.next_power_of_2(group)
    packed = FP32_PACKED_ROWS if dtype == torch.float32 else PACKED_ROWS
    packed = packed * 64 // max(64, triton.next_power_of_2(head_dim))
    rows = min(triton.next_power_of_2(max(max_seqlen_q, 1)), max(1, packed // group_p2))
    return max(rows, triton.cdiv(16, group_p2))


def prefill_num_splits(num_seqs: int, max_seqlen_q: int, max_seqlen_k: int, num_heads: int,
                       num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Splits of each row block's keys for a prefill step; 1: the tiled kernel serves it. A
    power of two: the count is a compile-time constant, so serving meets few variants."""
    if max_seqlen_q > SPLIT_MAX_Q or max_seqlen_k < SPLIT_MIN_CONTEXT:
        return 1
    rows = block_q(max_seqlen_q, num_heads // num_kv_heads, head_dim, dtype)
    mblocks = triton.cdiv(max_seqlen_q, rows)
    programs = num_seqs * mblocks * num_kv_heads
    tiles = triton.cdiv(max_seqlen_k, TILE_N)
    splits = min(SPLIT_MAX_SPLITS, tiles, triton.cdiv(SPLIT_TARGET_PROGRAMS, programs))
    return 1 << (max(splits, 1).bit_length() - 1)


def prefill_split_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   out: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                   context_lens: torch.Tensor, block_tables: torch.Tensor,
                                   scale: float, num_heads: int, num_seqs: int,
                                   max_seqlen_q: int, num_splits: int,
                                   rope: Rope | None = None) -> None:
    """Prefill attention (triton_attention.prefill_attention_triton's contract: this step's
    keys are in the cache already; rows of no sequence are left alone) with each row block's
    keys split num_splits ways."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    if num_seqs == 0 or max_seqlen_q == 0:
        return
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.is_contiguous()
    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    bq = block_q(max_seqlen_q, group, head_dim, q.dtype)
    mblocks = triton.cdiv(max_seqlen_q, bq)
    block_d = max(16, triton.next_power_of_2(head_dim))
    splits = max(1, num_splits)
    if splits > 1:  # one allocation a layer (prefill is eager: its host time counts)
        parts = q.shape[0] * num_kv_heads * splits * group_p2
        scratch = torch.empty(parts * (block_d + 2), dtype=torch.float32, device=q.device)
        part_o, part_ml = scratch[:parts * block_d], scratch[parts * block_d:]
    else:
        part_o = part_ml = out  # unused: every row block writes its output itself
    consts = dict(NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_P2=group_p2, HEAD_DIM=head_dim,
                  BLOCK_D=block_d, BLOCK_Q=bq, TILE_N=TILE_N, NUM_SPLITS=splits)
    _prefill_split_kernel[(num_seqs * mblocks, num_kv_heads, splits)](
        q, k_cache, v_cache, out, part_o, part_ml, cu_seqlens_q, context_lens, block_tables,
        *rope_pointers(rope, q), scale, q.stride(0), out.stride(0), block_tables.stride(0), mblocks,
        BLOCK_SIZE=block_size, PRECISION=dot_precision(q.dtype), ROPE=rope is not None, **consts)
    if splits > 1:
        _prefill_combine_kernel[(num_seqs, max_seqlen_q, num_kv_heads)](
            out, part_o, part_ml, cu_seqlens_q, context_lens, out.stride(0),
            CHUNK=COMBINE_CHUNK, **consts)
