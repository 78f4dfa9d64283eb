"""Triton kernels over the paged KV cache: KV store, variable-length prefill, paged decode.

Graph safety (CUDA graphs record launches, not host values): the store and decode kernels'
grids depend only on the (padded) row count and head counts; each program reads its
sequence's context length and block table on the device and loops over that many blocks.
Padding rows (slot -1) store nothing; padded sequences (context length 0) write zeros.
The prefill kernel sizes its grid from max_seqlen_q (host) and is never graph-recorded
(prefill runs eagerly, or as an eager region between token-graph segments).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_k, stride_v, ROW: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(k_ptr + row * stride_k + offs, mask=mask)
        v = tl.load(v_ptr + row * stride_v + offs, mask=mask)
        tl.store(k_cache_ptr + slot * ROW + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    rows = slot_mapping.shape[0]
    if rows == 0:
        return
    row = k_cache.shape[2] * k_cache.shape[3]
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.is_contiguous()
    _store_kv_kernel[(rows,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                              ROW=row, BLOCK=triton.next_power_of_2(row))


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, cu_q_ptr, ctx_ptr, bt_ptr,
                    scale, stride_q, stride_o, stride_bt,
                    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    mblk = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    ctx = tl.load(ctx_ptr + seq)
    if mblk * BLOCK_M < q_len:
        kv_head = head // GROUP
        offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_SIZE)
        m_mask = offs_m < q_len
        d_mask = offs_d < HEAD_DIM
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_q + head * HEAD_DIM + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        q_pos = ctx - q_len + offs_m
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Causal: this tile of queries sees keys up to its last row's position.
        kv_end = ctx - q_len + (mblk + 1) * BLOCK_M
        kv_end = tl.where(kv_end < ctx, kv_end, ctx)
        num_blocks = (kv_end + BLOCK_SIZE - 1) // BLOCK_SIZE
        kv_row = NUM_KV_HEADS * HEAD_DIM
        for b in range(0, num_blocks):
            phys = tl.load(bt_ptr + seq * stride_bt + b).to(tl.int64)
            base = phys * BLOCK_SIZE * kv_row + kv_head * HEAD_DIM
            kv_off = base + offs_n[:, None] * kv_row + offs_d[None, :]
            k = tl.load(k_cache_ptr + kv_off, mask=d_mask[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            k_pos = b * BLOCK_SIZE + offs_n
            valid = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < ctx)
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + kv_off, mask=d_mask[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + rows[:, None] * stride_o + head * HEAD_DIM + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, ctx_ptr, bt_ptr,
                   part_o_ptr, part_ml_ptr,
                   scale, stride_q, stride_o, stride_bt,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   TILE_N: tl.constexpr, Q_LEN: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   PRECISION: tl.constexpr):
    """One program per (row, kv head, split): the split's tiles of TILE_N keys of the row.

    The GROUP query heads sharing a kv head are the rows of one tensor-core dot (padded to
    BLOCK_H >= 16), so each key tile is read once per kv head; a tile gathers TILE_N keys across
    several cache blocks, keeping many bytes in flight per loop step.
    NUM_SPLITS == 1 writes the output; otherwise partial (normalised output, max, sum) go to
    a workspace and _decode_reduce_kernel combines them (flash-decoding).
    """
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = row // Q_LEN
    ctx = tl.load(ctx_ptr + seq)
    # Row j of a sequence's Q_LEN rows sits at position ctx - Q_LEN + j; ctx 0 (padding) gives
    # kv_len <= 0, hence no tiles and a zero output.
    kv_len = ctx - Q_LEN + (row % Q_LEN) + 1
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, TILE_N)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    row64 = row.to(tl.int64)
    q = tl.load(q_ptr + row64 * stride_q + heads[:, None] * HEAD_DIM + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    kv_row = NUM_KV_HEADS * HEAD_DIM
    # The row's own key tiles, dealt evenly to the splits: a short context keeps every split
    # busy however wide the block table (the launch is sized from the table, not the row).
    tiles_per_split = tl.cdiv(tl.maximum(tl.cdiv(kv_len, TILE_N), 0), NUM_SPLITS)
    t_start = split * tiles_per_split * TILE_N
    t_end = tl.minimum(t_start + tiles_per_split * TILE_N, kv_len)
    for t in range(t_start, t_end, TILE_N):
        tok = t + offs_n
        t_mask = tok < kv_len
        phys = tl.load(bt_ptr + seq * stride_bt + tok // BLOCK_SIZE, mask=t_mask, other=0)
        slot = phys.to(tl.int64) * BLOCK_SIZE + tok % BLOCK_SIZE
        kv_off = slot[:, None] * kv_row + kv_head * HEAD_DIM + offs_d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + row64 * stride_o + heads[:, None] * HEAD_DIM + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    else:
        num_heads = NUM_KV_HEADS * GROUP
        part = (row64 * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(part_o_ptr + part[:, None] * BLOCK_D + offs_d[None, :], o,
                 mask=h_mask[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=h_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=h_mask)


@triton.jit
def _decode_reduce_kernel(out_ptr, part_o_ptr, part_ml_ptr, stride_o,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    part = (row * NUM_HEADS + head) * NUM_SPLITS + offs_s
    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=float("-inf"))
    lsum = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    o = tl.load(part_o_ptr + part[:, None] * BLOCK_D + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = lsum * tl.exp(m - m_safe)  # a split that saw no key has l = 0: weight 0
    total = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * stride_o + head * HEAD_DIM + offs_d, res.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


# Enough programs to fill a large GPU; below that, a row's key tiles are split across programs.
# The split count may not depend on the step's context lengths (graph capture), so it is sized
# from the block-table width; the kernel deals each row's own tiles evenly to the splits, so
# a short context in a wide table still uses them all, and the sequential loop of each program
# stays short (batch 1 on a 1B model: 8 kv heads would otherwise leave 8 programs walking the
# whole context).
_TARGET_PROGRAMS = 512  # bench/decode_attention_sweep.py: more splits cost more than they hide
_MAX_SPLITS = 128
_DECODE_TILE_N = 64  # keys per loop step: 4 cache blocks of 16


def _precision(dtype: torch.dtype) -> str | None:
    # fp32 checkpoints must match the reference closely: no tf32 on the fp32 path.
    return "ieee" if dtype == torch.float32 else None


def prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             out: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                             block_tables: torch.Tensor, scale: float, num_heads: int,
                             num_seqs: int, max_seqlen_q: int, block_m: int = 64) -> None:
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    if num_seqs == 0 or max_seqlen_q == 0:
        return
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.is_contiguous()
    block_m = max(16, min(block_m, triton.next_power_of_2(max_seqlen_q)))
    grid = (num_seqs, num_heads, triton.cdiv(max_seqlen_q, block_m))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables,
        scale, q.stride(0), out.stride(0), block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m, BLOCK_SIZE=block_size,
        PRECISION=_precision(q.dtype),
    )


def decode_num_splits(rows: int, num_kv_heads: int, table_tiles: int) -> int:
    """Splits per row: from static sizes only (padded rows, heads, key tiles of the table)."""
    programs = rows * num_kv_heads
    if programs >= _TARGET_PROGRAMS:
        return 1
    return max(1, min(_MAX_SPLITS, table_tiles, triton.cdiv(_TARGET_PROGRAMS, programs)))


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            out: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                            scale: float, num_heads: int, q_len: int = 1,
                            num_splits: int | None = None) -> None:
    """Programs per (query row, kv head[, split]); rows are q_len per sequence, padded rows
    included. The launch depends only on static shapes, so it can be graph-recorded."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    rows = q.shape[0]
    if rows == 0:
        return
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.is_contiguous()
    group = num_heads // num_kv_heads
    tiles = triton.cdiv(block_tables.shape[1] * block_size, _DECODE_TILE_N)
    splits = min(num_splits or decode_num_splits(rows, num_kv_heads, tiles), tiles)
    block_d = max(16, triton.next_power_of_2(head_dim))
    if splits > 1:
        part_o = torch.empty(rows * num_heads * splits * block_d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(rows * num_heads * splits * 2, dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out  # unused
    _decode_kernel[(rows, num_kv_heads, splits)](
        q, k_cache, v_cache, out, context_lens, block_tables, part_o, part_ml,
        scale, q.stride(0), out.stride(0), block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, TILE_N=_DECODE_TILE_N,
        Q_LEN=q_len, NUM_SPLITS=splits, PRECISION=_precision(q.dtype),
    )
    if splits > 1:
        _decode_reduce_kernel[(rows, num_heads)](
            out, part_o, part_ml, out.stride(0),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits,
            SPLITS_P2=triton.next_power_of_2(splits),
        )
