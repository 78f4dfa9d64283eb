"""Triton kernels over the paged KV cache: KV store, variable-length prefill, paged decode.

Graph safety (CUDA graphs record launches, not host values): the store and decode kernels'
grids depend only on the (padded) row count and head counts; each program reads its
sequence's context length and block table on the device and loops over that many blocks.
Padding rows (slot -1) store nothing; padded sequences (context length 0) write zeros.
The prefill kernel sizes its grid from max_seqlen_q (host) and is never graph-recorded
(prefill runs eagerly, or as an eager region between token-graph segments); so is the split-KV
prefill of a few rows over a long context (atom.kernels.triton_prefill_split), which also
reads the step's longest context from the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from atom.kernels import triton_prefill_split as split_kv
from atom.kernels import tuning
from atom.kernels.attention_tiles import (
    COMBINE_CHUNK,
    attend_tile,
    combine_splits,
    dot_precision,
    kv_tile,
    load_q_rows,
    rope_cos_sin,
    rope_pointers,
    rotate,
    rotate_at,
    seq_rows,
)
from atom.kernels.launch import ArrivalCounters, programmatic_launch
from atom.kernels.rotary import Rope


@triton.jit
def cache_value(x, cache_ptr):
    """x in the cache's element type. An FP8 cache (--kv-cache-dtype fp8, per-tensor scale 1:
    atom.quantization.kv_cache) clamps first: float8_e4m3fn has no infinity, an overflow
    would be NaN."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, pos_ptr, cos_ptr, sin_ptr,
                     stride_k, stride_v, ROW: tl.constexpr, BLOCK: tl.constexpr,
                     HEAD_DIM: tl.constexpr, ROPE: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if ROPE:
        pos = tl.load(pos_ptr + row).to(tl.int64)  # beside the slot: neither waits for the other
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(k_ptr + row * stride_k + offs, mask=mask)
        if ROPE:  # the cache holds rotated keys
            d = offs % HEAD_DIM
            partner = tl.load(k_ptr + row * stride_k + offs - d + (d + HEAD_DIM // 2) % HEAD_DIM,
                              mask=mask)
            k = rotate_at(k, partner, pos, d, cos_ptr, sin_ptr, mask, HEAD_DIM // 2)
        v = tl.load(v_ptr + row * stride_v + offs, mask=mask)
        tl.store(k_cache_ptr + slot * ROW + offs, cache_value(k, k_cache_ptr), mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, cache_value(v, v_cache_ptr), mask=mask)


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, rope: Rope | None = None) -> None:
    """Write this step's keys (rotated first when rope is given) and values into the cache."""
    rows = slot_mapping.shape[0]
    if rows == 0:
        return
    row = k_cache.shape[2] * k_cache.shape[3]
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.is_contiguous()
    _store_kv_kernel[(rows,)](k, v, k_cache, v_cache, slot_mapping, *rope_pointers(rope, k),
                              k.stride(0), v.stride(0), ROW=row, BLOCK=triton.next_power_of_2(row),
                              HEAD_DIM=k_cache.shape[3], ROPE=rope is not None)


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, cu_q_ptr, ctx_ptr, bt_ptr,
                    pos_ptr, cos_ptr, sin_ptr, scale, stride_q, stride_o, stride_bt,
                    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    PRECISION: tl.constexpr, ROPE: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    mblk = tl.program_id(2)
    q_start, q_len, ctx = seq_rows(cu_q_ptr, ctx_ptr, seq)
    if mblk * BLOCK_M < q_len:
        kv_head = head // GROUP
        offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_SIZE)
        m_mask = offs_m < q_len
        d_mask = offs_d < HEAD_DIM
        rows = (q_start + offs_m).to(tl.int64)
        q = load_q_rows(q_ptr, rows, head * HEAD_DIM, stride_q, m_mask, pos_ptr, cos_ptr,
                         sin_ptr, HEAD_DIM, BLOCK_D, ROPE)
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
            k = tl.load(k_cache_ptr + kv_off, mask=d_mask[None, :], other=0.0).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            k_pos = b * BLOCK_SIZE + offs_n
            valid = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < ctx)
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + kv_off, mask=d_mask[None, :], other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + rows[:, None] * stride_o + head * HEAD_DIM + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr, ctx_ptr, bt_ptr,
                   slot_ptr, part_o_ptr, part_ml_ptr, count_ptr, pos_ptr, cos_ptr, sin_ptr,
                   scale, stride_q, stride_k, stride_v, stride_o, stride_bt,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                   GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, Q_LEN: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, COMBINE_CHUNK: tl.constexpr,
                   PRECISION: tl.constexpr, ROPE: tl.constexpr, STORE: tl.constexpr,
                   PDL: tl.constexpr):
    """One program per (row, kv head, split): see decode_program."""
    if PDL:
        gdc_launch_dependents()  # an o_proj launched early may start as well
    decode_program(tl.program_id(0), tl.program_id(1), tl.program_id(2), q_ptr, k_ptr, v_ptr,
                    k_cache_ptr, v_cache_ptr, out_ptr, ctx_ptr, bt_ptr, slot_ptr, part_o_ptr,
                    part_ml_ptr, count_ptr, pos_ptr, cos_ptr, sin_ptr, count_ptr, scale, stride_q,
                    stride_k, stride_v, stride_o, stride_bt, NUM_KV_HEADS, GROUP, BLOCK_H,
                    GROUP_P2, HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE_N, Q_LEN, NUM_SPLITS,
                    COMBINE_CHUNK, PRECISION, ROPE, STORE, False, PDL)


@triton.jit
def _arrive(count_ptr):
    """Count this program's finished writes at count_ptr: every thread's stores are issued
    (barrier) before the release that publishes them at GPU scope."""
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")


@triton.jit
def decode_program(row, kv_head, split, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
                    ctx_ptr, bt_ptr, slot_ptr, part_o_ptr, part_ml_ptr, count_ptr, pos_ptr,
                    cos_ptr, sin_ptr, done_ptr, scale, stride_q, stride_k, stride_v, stride_o,
                    stride_bt, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_H: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                    Q_LEN: tl.constexpr, NUM_SPLITS: tl.constexpr, COMBINE_CHUNK: tl.constexpr,
                    PRECISION: tl.constexpr, ROPE: tl.constexpr, STORE: tl.constexpr,
                    SIGNAL: tl.constexpr, PDL: tl.constexpr):
    """The split's tiles of TILE_N keys of one (row, kv head).

    The GROUP query heads sharing a kv head are the rows of one tensor-core dot (padded to
    BLOCK_H >= 16), so each key tile is read once per kv head; a tile gathers TILE_N keys across
    several cache blocks, keeping many bytes in flight per loop step.

    One launch does the whole decode attention of a layer (at batch 1 a step is ~16 such
    launches, each a few microseconds of latency, so every launch saved counts):
    - ROPE: q (and with STORE, the new key) are rotated to the row's position as they load;
    - STORE (Q_LEN == 1): this step's key and value are folded in from registers by the
      split holding the row's last key, which also writes them into the cache (no program
      reads that slot in this launch);
    - a row whose keys span several splits: each split writes its partial (normalised output,
      max, sum), and the last split to finish (a per-(row, kv head) arrival counter) combines
      them in split order, so the result does not depend on arrival order, and re-arms the
      counter for the next launch (flash-decoding without a second kernel);
    - SIGNAL: whichever program writes a (row, kv head)'s final output then counts it at
      done_ptr (atom.kernels.triton_decode_o_proj waits on that count in the same launch).
    """
    # With several rows per sequence, a row reads the keys of the rows before it, which
    # another program would be storing in this same launch: the caller stores them first.
    tl.static_assert(not STORE or Q_LEN == 1, "STORE needs one query row per sequence")
    seq = row // Q_LEN
    ctx = tl.load(ctx_ptr + seq)
    row64 = row.to(tl.int64)
    if ROPE:
        pos = tl.load(pos_ptr + row64).to(tl.int64)
    # Row j of a sequence's Q_LEN rows sits at position ctx - Q_LEN + j; ctx 0 (padding) gives
    # kv_len <= 0, hence no tiles and a zero output.
    kv_len = ctx - Q_LEN + (row % Q_LEN) + 1
    # The row's own key tiles, dealt in runs to the splits: a short context keeps many splits
    # busy however wide the block table (the launch is sized from the table, not the row).
    # Splits past the last run have nothing to do; split 0 of a row without keys writes zeros.
    n_tiles = tl.cdiv(tl.maximum(kv_len, 0), TILE_N)
    per_split = tl.maximum(tl.cdiv(n_tiles, NUM_SPLITS), 1)
    active = tl.cdiv(n_tiles, per_split)
    if split < tl.maximum(active, 1):
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        h_mask = offs_h < GROUP
        d_mask = offs_d < HEAD_DIM
        heads = kv_head * GROUP + offs_h
        q_mask = h_mask[:, None] & d_mask[None, :]
        kv_row = NUM_KV_HEADS * HEAD_DIM
        head_off = kv_head * HEAD_DIM
        cache_len = kv_len
        if STORE:
            # This step's key and value belong to the split holding the row's last key: it
            # folds them in from registers after its loop (the loop reads only keys already
            # cached, so its loads stay pipelined) and writes them into the cache.
            cache_len = kv_len - 1
            owner = (split == active - 1) & (kv_len > 0)
            new_mask = d_mask & owner
            slot_new = tl.load(slot_ptr + row64, mask=owner, other=-1).to(tl.int64)
        t_start = split * per_split * TILE_N
        t_end = tl.minimum(t_start + per_split * TILE_N, cache_len)
        if ROPE:  # padding rows (no keys) skip the table: their output is zero anyway
            q_cos, q_sin = rope_cos_sin(pos, offs_d[None, :], cos_ptr, sin_ptr,
                                     q_mask & (kv_len > 0), HEAD_DIM // 2)
            if STORE:
                k_cos, k_sin = rope_cos_sin(pos, offs_d, cos_ptr, sin_ptr, new_mask, HEAD_DIM // 2)
        # The first key tile is loaded before q: with PDL the launch starts while the kernel
        # before it (the qkv projection) still runs, and everything up to here comes from
        # earlier launches; q, k and v only after the wait for that kernel.
        k0, v0, t0_mask = kv_tile(t_start, t_end, seq, kv_head, k_cache_ptr, v_cache_ptr,
                                   bt_ptr, stride_bt, kv_row, d_mask, HEAD_DIM, BLOCK_D,
                                   BLOCK_SIZE, TILE_N)
        if PDL:
            gdc_wait()
        q_row = q_ptr + row64 * stride_q + heads[:, None] * HEAD_DIM
        q = tl.load(q_row + offs_d[None, :], mask=q_mask, other=0.0)
        if ROPE:
            partner = tl.load(q_row + ((offs_d + HEAD_DIM // 2) % HEAD_DIM)[None, :],
                              mask=q_mask, other=0.0)
            q = rotate(q, partner, q_cos, q_sin, offs_d[None, :], HEAD_DIM // 2)
        if STORE:
            k_new = tl.load(k_ptr + row64 * stride_k + head_off + offs_d, mask=new_mask, other=0.0)
            v_new = tl.load(v_ptr + row64 * stride_v + head_off + offs_d, mask=new_mask, other=0.0)
            if ROPE:
                k_pair = tl.load(k_ptr + row64 * stride_k + head_off
                                 + (offs_d + HEAD_DIM // 2) % HEAD_DIM, mask=new_mask, other=0.0)
                k_new = rotate(k_new, k_pair, k_cos, k_sin, offs_d, HEAD_DIM // 2)
            k_new = cache_value(k_new, k_cache_ptr)
            v_new = cache_value(v_new, v_cache_ptr)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        m_i, l_i, acc = attend_tile(q, k0, v0, t0_mask[None, :], m_i, l_i, acc, scale,
                                     PRECISION)
        for t in range(t_start + TILE_N, t_end, TILE_N):
            k, v, t_mask = kv_tile(t, t_end, seq, kv_head, k_cache_ptr, v_cache_ptr, bt_ptr,
                                    stride_bt, kv_row, d_mask, HEAD_DIM, BLOCK_D, BLOCK_SIZE,
                                    TILE_N)
            m_i, l_i, acc = attend_tile(q, k, v, t_mask[None, :], m_i, l_i, acc, scale,
                                         PRECISION)
        if STORE:
            s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale
            s_new = tl.where(owner, s_new, float("-inf"))
            m_new = tl.maximum(m_i, s_new)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p_new = tl.exp(s_new - m_safe)
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + p_new
            acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
            m_i = m_new
            new_off = slot_new * kv_row + head_off + offs_d
            tl.store(k_cache_ptr + new_off, k_new, mask=new_mask & (slot_new >= 0))
            tl.store(v_cache_ptr + new_off, v_new, mask=new_mask & (slot_new >= 0))
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        out_row = out_ptr + row64 * stride_o + heads[:, None] * HEAD_DIM + offs_d[None, :]
        if active <= 1:
            tl.store(out_row, o.to(out_ptr.dtype.element_ty), mask=q_mask)
            if SIGNAL:
                _arrive(done_ptr)
        else:
            # Partials of (row, kv head): [split, GROUP_P2 heads] (max, sum) and outputs.
            pair = row64 * NUM_KV_HEADS + kv_head
            part = (pair * NUM_SPLITS + split) * GROUP_P2 + offs_h
            tl.store(part_o_ptr + part[:, None] * BLOCK_D + offs_d[None, :], o, mask=q_mask)
            tl.store(part_ml_ptr + part * 2, m_i, mask=h_mask)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=h_mask)
            tl.debug_barrier()  # every thread's partial is written before the arrival is
            arrived = tl.atomic_add(count_ptr + pair, 1, sem="acq_rel", scope="gpu")
            if arrived == active - 1:
                combine_splits(out_ptr, part_o_ptr, part_ml_ptr, row64, kv_head, pair, active,
                                stride_o, NUM_SPLITS, GROUP, GROUP_P2, HEAD_DIM, BLOCK_D,
                                COMBINE_CHUNK)
                tl.store(count_ptr + pair, 0)  # re-armed: the next launch starts from zero
                if SIGNAL:
                    _arrive(done_ptr)


def prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             out: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                             block_tables: torch.Tensor, scale: float, num_heads: int,
                             num_seqs: int, max_seqlen_q: int, block_m: int = 64,
                             rope: Rope | None = None, max_seqlen_k: int = 0,
                             num_splits: int | None = None) -> None:
    """Causal attention of each sequence's query rows (the last positions of its context) over
    its cached keys, this step's included. A chunk of few rows over a long context
    (max_seqlen_k: the step's longest, from the host) takes the split-KV kernel
    (atom.kernels.triton_prefill_split); num_splits forces its split count (1: this kernel)."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    if num_seqs == 0 or max_seqlen_q == 0:
        return
    if num_splits is None:
        num_splits = split_kv.prefill_num_splits(num_seqs, max_seqlen_q, max_seqlen_k,
                                                 num_heads, num_kv_heads, head_dim, q.dtype)
    if num_splits > 1:
        split_kv.prefill_split_attention_triton(q, k_cache, v_cache, out, cu_seqlens_q,
                                                context_lens, block_tables, scale, num_heads,
                                                num_seqs, max_seqlen_q, num_splits, rope)
        return
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.is_contiguous()
    block_m = max(16, min(block_m, triton.next_power_of_2(max_seqlen_q)))
    grid = (num_seqs, num_heads, triton.cdiv(max_seqlen_q, block_m))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables, *rope_pointers(rope, q),
        scale, q.stride(0), out.stride(0), block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m, BLOCK_SIZE=block_size,
        PRECISION=dot_precision(q.dtype), ROPE=rope is not None,
    )


# Enough programs to fill a large GPU; below that, a row's key tiles are split across programs.
# The split count may not depend on the step's context lengths (graph capture), so it is sized
# from the block-table width; the kernel deals each row's own tiles evenly to the splits, so
# a short context in a wide table still uses them all, and the sequential loop of each program
# stays short (batch 1 on a 1B model: 8 kv heads would otherwise leave 8 programs walking the
# whole context).
# (The split targets, the key tile and DECODE_PDL are in atom.kernels.tuning.)


def decode_num_splits(rows: int, num_kv_heads: int, table_tiles: int) -> int:
    """Splits per row: from static sizes only (padded rows, heads, key tiles of the table)."""
    programs = rows * num_kv_heads
    if programs >= tuning.DECODE_TARGET_PROGRAMS:
        return 1
    return max(1, min(tuning.DECODE_MAX_SPLITS, table_tiles, triton.cdiv(tuning.DECODE_TARGET_PROGRAMS, programs)))


class StepKV(NamedTuple):
    """This step's keys and values [rows, kv_heads * head_dim] (strided views allowed) and the
    cache slot of each row (-1: padding, stores nothing)."""

    k: torch.Tensor
    v: torch.Tensor
    slot_mapping: torch.Tensor


# Arrival counters of the in-kernel split combine, one per (row, kv head); at least 8192
# decode rows of 8 kv heads.
ARRIVALS = ArrivalCounters(1 << 16)


class DecodeLaunch(NamedTuple):
    """A decode launch's grid (rows, kv heads, splits), its arguments in _decode_kernel's order
    (pointers, then scalars) and its compile-time constants."""

    grid: tuple[int, int, int]
    args: tuple[object, ...]
    constants: dict[str, object]


def decode_launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  out: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                  scale: float, num_heads: int, q_len: int = 1, num_splits: int | None = None,
                  rope: Rope | None = None, new_kv: StepKV | None = None,
                  overlap: bool = False) -> DecodeLaunch:
    """What decode_attention_triton launches; new_kv only with q_len 1 (the kernel's own
    store). overlap: see decode_attention_triton."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    rows = q.shape[0]
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.is_contiguous()
    assert new_kv is None or q_len == 1
    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    tiles = triton.cdiv(block_tables.shape[1] * block_size, tuning.DECODE_TILE_N)
    splits = min(num_splits or decode_num_splits(rows, num_kv_heads, tiles), tiles)
    block_d = max(16, triton.next_power_of_2(head_dim))
    if splits > 1:
        parts = rows * num_kv_heads * splits * group_p2
        part_o = torch.empty(parts * block_d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(parts * 2, dtype=torch.float32, device=q.device)
        counters = ARRIVALS.get(q.device, rows * num_kv_heads)
    else:
        part_o = part_ml = counters = out  # unused
    if new_kv is not None:
        assert new_kv.k.stride(-1) == 1 and new_kv.v.stride(-1) == 1
        assert new_kv.slot_mapping.shape[0] == rows
        k_new, v_new, slots = new_kv
    else:
        k_new = v_new = slots = q  # unused
    args = (q, k_new, v_new, k_cache, v_cache, out, context_lens, block_tables, slots,
            part_o, part_ml, counters, *rope_pointers(rope, q),
            scale, q.stride(0), k_new.stride(0), v_new.stride(0), out.stride(0),
            block_tables.stride(0))
    pdl = overlap and tuning.DECODE_PDL and rows <= tuning.GEMV_MAX_ROWS and programmatic_launch(q.device)
    constants = dict(
        NUM_KV_HEADS=num_kv_heads, GROUP=group, BLOCK_H=max(16, group_p2), GROUP_P2=group_p2,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, TILE_N=tuning.DECODE_TILE_N,
        Q_LEN=q_len, NUM_SPLITS=splits, COMBINE_CHUNK=COMBINE_CHUNK,
        PRECISION=dot_precision(q.dtype), ROPE=rope is not None, STORE=new_kv is not None,
        PDL=pdl, launch_pdl=pdl)
    return DecodeLaunch((rows, num_kv_heads, splits), args, constants)


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            out: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                            scale: float, num_heads: int, q_len: int = 1,
                            num_splits: int | None = None, rope: Rope | None = None,
                            new_kv: StepKV | None = None, overlap: bool = False) -> None:
    """One launch per (query row, kv head, split); rows are q_len per sequence, padded rows
    included. The launch depends only on static shapes, so it can be graph-recorded.

    rope: q (and new_kv's keys) are unrotated; the kernel rotates them. new_kv: this step's keys
    and values, written into the cache first (by the decode kernel itself when q_len is 1, by
    the KV-store kernel before it otherwise: later rows of a sequence read earlier rows' keys).
    overlap: the launch may start before the previous kernel on the stream ends (tuning.DECODE_PDL);
    allowed only when that kernel writes none of the cache, the metadata or the rotary tables
    (the engine's forward: it produced q, k and v).
    """
    if new_kv is not None and q_len > 1:
        store_kv_triton(new_kv.k, new_kv.v, k_cache, v_cache, new_kv.slot_mapping, rope)
        new_kv = None
        overlap = False  # the store just written is what the launch reads first
    if q.shape[0] == 0:
        return
    launch = decode_launch(q, k_cache, v_cache, out, context_lens, block_tables, scale,
                           num_heads, q_len, num_splits, rope, new_kv, overlap)
    _decode_kernel[launch.grid](*launch.args, **launch.constants)
