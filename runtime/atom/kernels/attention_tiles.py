"""The @triton.jit tile helpers the attention kernels share: rotary rotation as rows load, a
prefill step's sequence rows, key/value tiles gathered through the block table, one
online-softmax step, and the in-order combine of split-KV partials.

The decode and tiled prefill kernels (atom.kernels.triton_attention) and the split-KV prefill
(atom.kernels.triton_prefill_split) build on these; neither imports the other's privates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.rotary import Rope

# Splits' partials a combine reads per step (combine_splits' CHUNK), for the decode kernel's
# in-launch combine and the split prefill's combine launch alike.
COMBINE_CHUNK = 8


@triton.jit
def rope_cos_sin(pos, d, cos_ptr, sin_ptr, mask, HALF: tl.constexpr):
    """(cos, sin) of element d of a head at pos."""
    j = d % HALF
    c = tl.load(cos_ptr + pos * HALF + j, mask=mask, other=0.0)
    s = tl.load(sin_ptr + pos * HALF + j, mask=mask, other=0.0)
    return c, s


@triton.jit
def rotate(x, partner, c, s, d, HALF: tl.constexpr):
    """x (element d of a head) rotated by (c, s), rotate-half layout: partner is element
    d + HALF (first half) or d - HALF (second half). In fp32, rounded once to x's dtype, as
    atom.kernels.rotary.apply_rotary does."""
    xf, pf = x.to(tl.float32), partner.to(tl.float32)
    return tl.where(d < HALF, xf * c - pf * s, xf * c + pf * s).to(x.dtype)


@triton.jit
def rotate_at(x, partner, pos, d, cos_ptr, sin_ptr, mask, HALF: tl.constexpr):
    """x (element d of a head) rotated to pos: rotate by the table's row."""
    c, s = rope_cos_sin(pos, d, cos_ptr, sin_ptr, mask, HALF)
    return rotate(x, partner, c, s, d, HALF)


def rope_pointers(rope: Rope | None, fallback: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernels' (pos_ptr, cos_ptr, sin_ptr): unused pointers without rotation."""
    return (rope.positions, rope.cos, rope.sin) if rope is not None else (fallback,) * 3


@triton.jit
def seq_rows(cu_q_ptr, ctx_ptr, seq):
    """(first query row, query rows, context length) of a prefill step's sequence seq."""
    q_start = tl.load(cu_q_ptr + seq)
    return q_start, tl.load(cu_q_ptr + seq + 1) - q_start, tl.load(ctx_ptr + seq)


@triton.jit
def load_q_rows(q_ptr, rows, head_off, stride_q, r_mask, pos_ptr, cos_ptr, sin_ptr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROPE: tl.constexpr):
    """Query rows [R, BLOCK_D] of prefill (rows: int64 [R]; head_off: the head's offset in a
    row, one for all or [R, 1]), rotated to their positions with ROPE; masked rows are 0."""
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = r_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_row = q_ptr + rows[:, None] * stride_q + head_off
    q = tl.load(q_row + offs_d[None, :], mask=q_mask, other=0.0)
    if ROPE:
        partner = tl.load(q_row + ((offs_d + HEAD_DIM // 2) % HEAD_DIM)[None, :], mask=q_mask,
                          other=0.0)
        pos = tl.load(pos_ptr + rows, mask=r_mask, other=0).to(tl.int64)
        q = rotate_at(q, partner, pos[:, None], offs_d[None, :], cos_ptr, sin_ptr, q_mask,
                  HEAD_DIM // 2)
    return q


@triton.jit
def kv_tile(t, t_end, seq, kv_head, k_cache_ptr, v_cache_ptr, bt_ptr, stride_bt, kv_row, d_mask,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
             TILE_N: tl.constexpr):
    """Keys and values [TILE_N, BLOCK_D] of the tile at token t (tokens from t_end on masked),
    gathered across cache blocks through the block table; and the tile's token mask."""
    tok = t + tl.arange(0, TILE_N)
    t_mask = tok < t_end
    phys = tl.load(bt_ptr + seq * stride_bt + tok // BLOCK_SIZE, mask=t_mask, other=0)
    slot = phys.to(tl.int64) * BLOCK_SIZE + tok % BLOCK_SIZE
    kv_off = slot[:, None] * kv_row + kv_head * HEAD_DIM + tl.arange(0, BLOCK_D)[None, :]
    kv_mask = t_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    return k, v, t_mask


@triton.jit
def attend_tile(q, k, v, valid, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
    """One online-softmax step of q's rows over a key tile, keys masked where valid
    (broadcast to [rows, keys]) is false: the new (max, sum, output)."""
    # An FP8 cache's tiles widen to q's dtype (a no-op for a cache in the model's dtype).
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def combine_splits(out_ptr, part_o_ptr, part_ml_ptr, row64, kv_head, pair, active, stride_o,
                    NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr):
    """The row's outputs for the GROUP heads of kv_head from the active splits' partials, read
    in split order CHUNK (COMBINE_CHUNK) at a time (through L2: other SMs wrote them)."""
    offs_c = tl.arange(0, CHUNK)
    offs_g = tl.arange(0, GROUP_P2)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    m_run = tl.full([GROUP_P2], float("-inf"), tl.float32)
    l_run = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, BLOCK_D], tl.float32)
    for s0 in range(0, active, CHUNK):
        s = s0 + offs_c
        mask = (s < active)[:, None] & g_mask[None, :]
        part = (pair * NUM_SPLITS + s)[:, None] * GROUP_P2 + offs_g[None, :]  # [CHUNK, G]
        m = tl.load(part_ml_ptr + part * 2, mask=mask, other=float("-inf"), cache_modifier=".cg")
        lsum = tl.load(part_ml_ptr + part * 2 + 1, mask=mask, other=0.0, cache_modifier=".cg")
        o = tl.load(part_o_ptr + part[:, :, None] * BLOCK_D + offs_d[None, None, :],
                    mask=mask[:, :, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = lsum * tl.exp(m - m_safe[None, :])  # a split that saw no key has l = 0: weight 0
        alpha = tl.exp(m_run - m_safe)
        l_run = l_run * alpha + tl.sum(w, 0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 0)
        m_run = m_new
    res = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]
    heads = kv_head * GROUP + offs_g
    tl.store(out_ptr + row64 * stride_o + heads[:, None] * HEAD_DIM + offs_d[None, :],
             res.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & (offs_d < HEAD_DIM)[None, :])


def dot_precision(dtype: torch.dtype) -> str | None:
    # fp32 checkpoints must match the reference closely: no tf32 on the fp32 path.
    return "ieee" if dtype == torch.float32 else None
