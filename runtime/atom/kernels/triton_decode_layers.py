"""Every decoder layer of a one-row decode step in one launch (Llama family, no biases).

As one launch per projection, each kernel boundary leaves memory idle at batch 1: the next
launch's programs find an SM only once the last one's leave it, and start reading weights
only then (bench/RESULTS.md, sessions 8 to 14). Here one program per SM stays resident for
the whole forward and walks the layers' phases in order: qkv, the decode attention, o_proj
with the residual add, gate_up with the SiLU gate, down_proj with the residual add. A phase
whose input another program writes loads its first weights, then waits on that input's
arrival count (monotonic over the layers: layer l waits for (l + 1) x the phase's writers),
so the weight stream runs on while the slowest program of the phase before finishes.

Every activation is written once per launch (a buffer per layer), so no SM can hold a stale
line of it in L1; the attention's split partials, reused by every layer, are read through L2
(triton_attention._combine_splits). The launch needs all its programs resident at once (a
grid-wide wait): decode_layers_applies checks the SM count, and the launch is ordinary (not
started early beside another kernel).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from atom.kernels.launch import sm_resources
from atom.kernels.triton_attention import StepKV, _arrive, _decode_program, decode_launch
from atom.kernels.triton_norm_gemv import (
    _projection_strip,
    _row_strip,
    _split_weights,
    _strip_rows,
    _wait_for,
)
from atom.layers.rotary import Rope

PROGRAMS = 128
WARPS = 8
# Tiles of each projection's K loop (rows a program, K step, K slices, pipeline stages): the
# one-launch kernels' (triton_norm_gemv._config) for one program per SM.
QKV_K, QKV_SPLIT, QKV_STAGES = 256, 4, 4
GATE_UP_K, GATE_UP_STAGES = 64, 6
DOWN_K, DOWN_SPLIT, DOWN_STAGES = 1024, 4, 3

_LINE = 32  # counters a 128-byte line apart
_COUNTERS = 6  # qkv, attention outputs, o_proj, gate_up, down_proj, finished programs
_SYNC: dict[torch.device, torch.Tensor] = {}


def _sync_counters(device: torch.device) -> torch.Tensor:
    """The launch's arrival counters, zero between launches; allocated once per device (before
    any capture) and kept: recorded graphs hold its address."""
    if device not in _SYNC:
        _SYNC[device] = torch.zeros(_COUNTERS * _LINE, dtype=torch.int32, device=device)
    return _SYNC[device]


class DecodeLayerWeights(NamedTuple):
    """Every layer's weights, stacked: qkv [L, q + 2 kv, H], o [L, H, q], gate_up
    [L, 2 I, H] (gate rows, then up rows), down [L, H, I], the two norms [L, H]."""

    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    input_norm: torch.Tensor
    post_norm: torch.Tensor


@triton.jit
def _decode_layers_kernel(
        hs_ptr, qkv_ptr, attn_ptr, mid_ptr, act_ptr, wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr,
        n1_ptr, n2_ptr, k_cache_ptr, v_cache_ptr, ctx_ptr, bt_ptr, slot_ptr, part_o_ptr,
        part_ml_ptr, count_ptr, pos_ptr, cos_ptr, sin_ptr, sync_ptr, num_layers, n_items,
        kv_layer_stride, scale, eps, stride_bt,
        H: tl.constexpr, QKV_N: tl.constexpr, Q_SIZE: tl.constexpr, KV_SIZE: tl.constexpr,
        INTER: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_H: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr, COMBINE_CHUNK: tl.constexpr, PRECISION: tl.constexpr,
        GEMV_PRECISION: tl.constexpr, ROPE: tl.constexpr,
        QKV_STRIP: tl.constexpr, QKV_N_BLOCK: tl.constexpr, QKV_K: tl.constexpr,
        QKV_SPLIT: tl.constexpr, QKV_STAGES: tl.constexpr, O_ROWS: tl.constexpr,
        GU_ROWS: tl.constexpr, GU_K: tl.constexpr, GU_STAGES: tl.constexpr,
        DOWN_ROWS: tl.constexpr, DOWN_K: tl.constexpr, DOWN_SPLIT: tl.constexpr,
        DOWN_STAGES: tl.constexpr, LINE: tl.constexpr):
    """Program pid takes, in every layer: qkv rows [pid * QKV_STRIP, +QKV_STRIP), the decode
    items pid, pid + programs, ... (a (kv head, split) each, split slowest), o_proj rows
    [pid * O_ROWS, +O_ROWS), gate rows [pid * GU_ROWS, +GU_ROWS) with their up rows, down_proj
    rows [pid * DOWN_ROWS, +DOWN_ROWS), each by the one-launch kernels' own code
    (triton_norm_gemv, triton_attention). hs [layers + 1, H]: the residual stream into each
    layer and out of the last."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    qkv_done = sync_ptr
    attn_done = sync_ptr + LINE  # (kv head) outputs written
    o_done = sync_ptr + 2 * LINE
    gu_done = sync_ptr + 3 * LINE
    down_done = sync_ptr + 4 * LINE
    q_rows, q_mask = _strip_rows(pid, QKV_N, QKV_N_BLOCK, QKV_STRIP)
    g_rows, g_mask = _strip_rows(pid, INTER, GU_ROWS, GU_ROWS)
    d_rows, d_mask = _strip_rows(pid, H, DOWN_ROWS, DOWN_ROWS)
    for layer in range(num_layers):
        lay = layer.to(tl.int64)
        x_ptr = hs_ptr + lay * H
        # qkv = RMSNorm(x) Wqkv^T, its first weight tile loaded while the last layer ends.
        wq = wqkv_ptr + lay * QKV_N * H
        w0 = _split_weights(wq, q_rows, q_mask, 0, H, H, QKV_K, QKV_SPLIT)
        _wait_for(down_done, programs * layer)
        qkv_l = qkv_ptr + lay * QKV_N
        _projection_strip(q_rows, q_mask, x_ptr, n1_ptr + lay * H, wq, wq, wq, qkv_l, 1, H, eps,
                          H, H, 0, QKV_N, 0, w0, True, False, False, False, 16, QKV_N_BLOCK,
                          QKV_K, QKV_SPLIT, GEMV_PRECISION, True, QKV_STAGES)
        _arrive(qkv_done)
        # The decode items (rotary, this step's key and value stored, split combine), each
        # waiting for all of qkv.
        attn_l = attn_ptr + lay * Q_SIZE
        for item in range(pid, n_items, programs):
            _decode_program(pid * 0, item % NUM_KV_HEADS, item // NUM_KV_HEADS, qkv_l,
                            qkv_l + Q_SIZE, qkv_l + Q_SIZE + KV_SIZE,
                            k_cache_ptr + lay * kv_layer_stride,
                            v_cache_ptr + lay * kv_layer_stride, attn_l, ctx_ptr, bt_ptr,
                            slot_ptr, part_o_ptr, part_ml_ptr, count_ptr, pos_ptr, cos_ptr,
                            sin_ptr, attn_done, qkv_done, programs * (layer + 1), scale, QKV_N,
                            QKV_N, QKV_N, Q_SIZE, stride_bt, NUM_KV_HEADS, GROUP, BLOCK_H,
                            GROUP_P2, HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE_N, 1, NUM_SPLITS,
                            COMBINE_CHUNK, PRECISION, ROPE, True, True, False, True)
        # o_proj + residual: the strip in registers, then the wait for every kv head.
        mid_l = mid_ptr + lay * H
        _row_strip(pid, attn_l, attn_l, wo_ptr + lay * H * Q_SIZE, wo_ptr, x_ptr, mid_l,
                   attn_done, NUM_KV_HEADS * (layer + 1), 1, H, Q_SIZE, 0.0, 0, Q_SIZE, 0, 0,
                   False, False, True, 1, O_ROWS, Q_SIZE, True, False, True)
        _arrive(o_done)
        # SiLU(gate) * up of RMSNorm(mid) W_gate_up^T.
        wg = wgu_ptr + lay * 2 * INTER * H
        act_l = act_ptr + lay * INTER
        _wait_for(o_done, programs * (layer + 1))
        _projection_strip(g_rows, g_mask, mid_l, n2_ptr + lay * H, wg, wg, wg, act_l, 1, H, eps,
                          H, H, 0, INTER, INTER, 0.0, True, True, False, False, 16, GU_ROWS,
                          GU_K, 1, GEMV_PRECISION, False, GU_STAGES)
        _arrive(gu_done)
        # down_proj + residual into the next layer's input.
        wd = wd_ptr + lay * H * INTER
        w0 = _split_weights(wd, d_rows, d_mask, 0, INTER, INTER, DOWN_K, DOWN_SPLIT)
        _wait_for(gu_done, programs * (layer + 1))
        _projection_strip(d_rows, d_mask, act_l, act_l, wd, wd, mid_l, x_ptr + H, 1, INTER, 0.0,
                          INTER, INTER, H, H, 0, w0, False, False, False, True, 16, DOWN_ROWS,
                          DOWN_K, DOWN_SPLIT, GEMV_PRECISION, True, DOWN_STAGES)
        _arrive(down_done)
    finished = tl.atomic_add(sync_ptr + 5 * LINE, 1, sem="acq_rel", scope="gpu")
    if finished == programs - 1:  # every program is past its last wait: re-armed
        for c in tl.static_range(6):
            tl.store(sync_ptr + c * LINE, 0)


class DecodeLayersPlan(NamedTuple):
    """Strip sizes of one launch: rows per program of qkv (and the power of two holding
    them), o_proj, gate (as many up rows) and down_proj."""

    qkv_rows: int
    qkv_block: int
    o_rows: int
    gate_rows: int
    down_rows: int


def decode_layers_plan(hidden: int, qkv_rows: int, q_size: int, inter: int,
                       programs: int = PROGRAMS) -> DecodeLayersPlan | None:
    """The strips for these shapes, or None where they do not divide evenly into powers of
    two (other than qkv's) or a strip would not fit the program's registers."""
    def even(n: int) -> int | None:
        return n // programs if n % programs == 0 and n // programs > 0 else None

    o_rows, gate_rows, down_rows, qkv_each = even(hidden), even(inter), even(hidden), even(qkv_rows)
    if None in (o_rows, gate_rows, down_rows, qkv_each):
        return None
    if any(r & (r - 1) for r in (o_rows, gate_rows, down_rows)) or q_size & (q_size - 1):
        return None
    # o_proj's whole strip is held in registers: 64 KB a program at most.
    if o_rows * q_size * 2 > 64 * 1024:
        return None
    return DecodeLayersPlan(qkv_each, triton.next_power_of_2(qkv_each), o_rows, gate_rows,
                            down_rows)


def decode_layers_applies(hs: torch.Tensor, weights: DecodeLayerWeights) -> bool:
    """Whether decode_layers takes this step on this device: one row, bf16 or fp16, the shapes
    decode_layers_plan takes, and one program per SM for PROGRAMS programs."""
    if not hs.is_cuda or hs.dtype not in (torch.bfloat16, torch.float16):
        return False
    hidden, q_size = weights.o.shape[1], weights.o.shape[2]
    plan = decode_layers_plan(hidden, weights.qkv.shape[1], q_size, weights.down.shape[2])
    return plan is not None and sm_resources(hs.device)[0] >= PROGRAMS


def decode_layers(hs: torch.Tensor, weights: DecodeLayerWeights, k_caches: torch.Tensor,
                  v_caches: torch.Tensor, context_lens: torch.Tensor,
                  block_tables: torch.Tensor, slot_mapping: torch.Tensor, rope: Rope | None,
                  scale: float, eps: float, num_heads: int) -> torch.Tensor:
    """Run every layer on hs[0] (one row [H]) and return hs[layers], the residual stream out of
    the last layer; hs [layers + 1, H] also receives each layer's input. k_caches / v_caches:
    every layer's paged cache [layers, blocks, block_size, kv_heads, head_dim] in one tensor.
    The step's key and value are written into the cache (rotated, with rope)."""
    layers, qkv_n, hidden = weights.qkv.shape
    q_size, inter = weights.o.shape[2], weights.down.shape[2]
    kv_size = (qkv_n - q_size) // 2
    plan = decode_layers_plan(hidden, qkv_n, q_size, inter)
    assert plan is not None and hs.shape == (layers + 1, hidden) and hs.is_contiguous()
    assert all(w.is_contiguous() for w in weights)
    assert k_caches.is_contiguous() and v_caches.is_contiguous()
    assert k_caches.shape[0] == layers and k_caches.stride() == v_caches.stride()
    qkv = torch.empty(layers, qkv_n, dtype=hs.dtype, device=hs.device)
    attn = torch.empty(layers, q_size, dtype=hs.dtype, device=hs.device)
    mid = torch.empty(layers, hidden, dtype=hs.dtype, device=hs.device)
    act = torch.empty(layers, inter, dtype=hs.dtype, device=hs.device)
    # The decode items as the attention launch deals them for layer 0's views.
    step_kv = StepKV(qkv[0, q_size:q_size + kv_size].view(1, -1),
                     qkv[0, q_size + kv_size:].view(1, -1), slot_mapping)
    launch = decode_launch(qkv[0, :q_size].view(1, -1), k_caches[0], v_caches[0],
                           attn[0].view(1, -1), context_lens, block_tables, scale, num_heads,
                           1, None, rope, step_kv, False)
    (_, _, _, _, _, _, ctx, bt, slots, part_o, part_ml, counters, pos, cos, sin, *_) = launch.args
    c = launch.constants
    n_items = launch.grid[1] * launch.grid[2]
    _decode_layers_kernel[(PROGRAMS,)](
        hs, qkv, attn, mid, act, weights.qkv, weights.o, weights.gate_up, weights.down,
        weights.input_norm, weights.post_norm, k_caches, v_caches, ctx, bt, slots, part_o,
        part_ml, counters, pos, cos, sin, _sync_counters(hs.device), layers, n_items,
        k_caches.stride(0), scale, eps, block_tables.stride(0),
        H=hidden, QKV_N=qkv_n, Q_SIZE=q_size, KV_SIZE=kv_size, INTER=inter,
        NUM_KV_HEADS=c["NUM_KV_HEADS"], GROUP=c["GROUP"], BLOCK_H=c["BLOCK_H"],
        GROUP_P2=c["GROUP_P2"], HEAD_DIM=c["HEAD_DIM"], BLOCK_D=c["BLOCK_D"],
        BLOCK_SIZE=c["BLOCK_SIZE"], TILE_N=c["TILE_N"], NUM_SPLITS=c["NUM_SPLITS"],
        COMBINE_CHUNK=c["COMBINE_CHUNK"], PRECISION=c["PRECISION"], GEMV_PRECISION="tf32",
        ROPE=c["ROPE"], QKV_STRIP=plan.qkv_rows, QKV_N_BLOCK=plan.qkv_block, QKV_K=QKV_K,
        QKV_SPLIT=QKV_SPLIT, QKV_STAGES=QKV_STAGES, O_ROWS=plan.o_rows,
        GU_ROWS=plan.gate_rows, GU_K=GATE_UP_K, GU_STAGES=GATE_UP_STAGES,
        DOWN_ROWS=plan.down_rows, DOWN_K=DOWN_K, DOWN_SPLIT=DOWN_SPLIT,
        DOWN_STAGES=DOWN_STAGES, LINE=_LINE, num_warps=WARPS)
    return hs[layers]
