"""Decode attention and the output projection in one launch.

At batch 1 the decode attention of a layer is a few microseconds of latency on a few dozen
SMs, and the o_proj launch after it is a small weight stream that is mostly ramp: launch,
first loads, epilogue (bench/RESULTS.md, sessions 4-5). Here the projection's programs share
the attention's launch: each loads its strip of o_proj weights (and the residual) into
registers while the attention programs run, waits until every kv head's output is in, then
needs one read of the attention output. The weight stream hides behind the attention instead
of following it.

Roles are dealt by ticket (an atomic counter taken as each program starts), attention first:
a projection program waits only for tickets handed out before its own, whose programs are
already running and never wait, so the launch cannot deadlock whatever order the hardware
starts programs in or however few fit at once. The last projection program re-arms the
counters for the next launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels import tuning
from atom.kernels.launch import ArrivalCounters
from atom.kernels.rotary import Rope
from atom.kernels.triton_attention import StepKV, decode_launch, decode_program
from atom.kernels.triton_norm_gemv import row_strip, row_strip_rows

# Rows, strip size, warps and the preload switch are in atom.kernels.tuning (FUSED_O_PROJ_*).

# The three counters sit a 128-byte line apart: the waiting programs' polls of one do not
# queue behind the tickets and arrivals of another.
_LINE = 32
# Tickets, outputs done and projections done (elements 0, _LINE, 2 * _LINE), zero between
# launches: one buffer of this fixed size per device, allocated at the first launch (before any
# capture) and kept, since recorded graphs hold its address. One set per device, as for the
# decode kernel's arrival counters: fused launches on one device run one at a time (the
# engine's stream orders them).
_SYNC_SIZE = 3 * _LINE
SYNC_COUNTERS = ArrivalCounters(_SYNC_SIZE)


@triton.jit
def _decode_o_proj_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr, ctx_ptr,
                          bt_ptr, slot_ptr, part_o_ptr, part_ml_ptr, count_ptr, pos_ptr,
                          cos_ptr, sin_ptr, scale, stride_q, stride_k, stride_v, stride_o,
                          stride_bt, w_ptr, b_ptr, res_ptr, y_ptr, sync_ptr, n_attn, M, N, K,
                          stride_w, stride_r, stride_y,
                          NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                          BLOCK_H: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                          Q_LEN: tl.constexpr, NUM_SPLITS: tl.constexpr,
                          COMBINE_CHUNK: tl.constexpr, PRECISION: tl.constexpr,
                          ROPE: tl.constexpr, STORE: tl.constexpr, HAS_BIAS: tl.constexpr,
                          HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          LINE: tl.constexpr, PRELOAD: tl.constexpr, PDL: tl.constexpr,
                          BLOCK_M: tl.constexpr):
    """Tickets [0, n_attn): the decode work items (row, kv head, split), split slowest (the
    first tickets are the splits that hold keys even for short contexts); the tickets after
    them: the projection strips. sync_ptr: tickets; + LINE: (row, kv head) outputs done;
    + 2 * LINE: strips done."""
    ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    done_ptr = sync_ptr + LINE
    pairs = n_attn // NUM_SPLITS
    if ticket < n_attn:
        pair = ticket % pairs
        decode_program(pair // NUM_KV_HEADS, pair % NUM_KV_HEADS, ticket // pairs, q_ptr,
                        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr, ctx_ptr, bt_ptr,
                        slot_ptr, part_o_ptr, part_ml_ptr, count_ptr, pos_ptr, cos_ptr, sin_ptr,
                        done_ptr, scale, stride_q, stride_k, stride_v, stride_o, stride_bt,
                        NUM_KV_HEADS, GROUP, BLOCK_H, GROUP_P2, HEAD_DIM, BLOCK_D, BLOCK_SIZE,
                        TILE_N, Q_LEN, NUM_SPLITS, COMBINE_CHUNK, PRECISION, ROPE, STORE, True,
                        PDL)
    else:
        # Every (row, kv head) output is counted once, by whichever program writes it.
        row_strip(ticket - n_attn, out_ptr, w_ptr, w_ptr, b_ptr, res_ptr, y_ptr, done_ptr, pairs,
                   M, N, K, 0.0, stride_o, stride_w, stride_r, stride_y, False, HAS_BIAS, HAS_RES,
                   BLOCK_M, BLOCK_N, BLOCK_K, PRELOAD, PDL, True)
        n_proj = tl.num_programs(0) - n_attn
        finished = tl.atomic_add(sync_ptr + 2 * LINE, 1, sem="acq_rel", scope="gpu")
        if finished == n_proj - 1:
            # Every ticket is taken and every wait is over: re-armed for the next launch.
            tl.store(sync_ptr, 0)
            tl.store(done_ptr, 0)
            tl.store(sync_ptr + 2 * LINE, 0)


def decode_attention_o_proj_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   out: torch.Tensor, context_lens: torch.Tensor,
                                   block_tables: torch.Tensor, scale: float, num_heads: int,
                                   o_weight: torch.Tensor, o_bias: torch.Tensor | None,
                                   residual: torch.Tensor | None, proj_out: torch.Tensor,
                                   num_splits: int | None = None, rope: Rope | None = None,
                                   new_kv: StepKV | None = None, overlap: bool = False) -> None:
    """decode_attention_triton for one sequence's row into out, then
    proj_out = out o_weight^T (+ o_bias) (+ residual), in one graph-recordable launch.
    overlap: as for decode_attention_triton (the projection programs read only o_weight before
    the wait). A verify step's rows of one request (atom.utils.forward_context.launch_rows) run
    here too: the projection applies its strip to each row in turn, as to the one row."""
    rows = q.shape[0]
    assert rows == tuning.FUSED_O_PROJ_ROWS or rows <= tuning.GEMV_MAX_ROWS, (
        f"{rows} rows: the fused o_proj launch takes {tuning.FUSED_O_PROJ_ROWS} "
        f"(a verify step's rows: at most {tuning.GEMV_MAX_ROWS})")
    n, k = o_weight.shape
    assert out.shape[1] == k and proj_out.shape == (rows, n)
    assert o_weight.stride(-1) == 1 and proj_out.stride(-1) == 1
    assert residual is None or (residual.shape == (rows, n) and residual.stride(-1) == 1)
    launch = decode_launch(q, k_cache, v_cache, out, context_lens, block_tables, scale,
                           num_heads, 1, num_splits, rope, new_kv, overlap)
    block_k = triton.next_power_of_2(k)
    block_n = max(1, row_strip_rows(k, o_weight.element_size(), tuning.FUSED_O_PROJ_STRIP_BYTES))
    n_attn = launch.grid[0] * launch.grid[1] * launch.grid[2]
    res = residual if residual is not None else proj_out
    sync = SYNC_COUNTERS.get(q.device, _SYNC_SIZE)
    _decode_o_proj_kernel[(n_attn + triton.cdiv(n, block_n),)](
        *launch.args, o_weight, o_bias if o_bias is not None else o_weight, res, proj_out,
        sync, n_attn, rows, n, k, o_weight.stride(0), res.stride(0),
        proj_out.stride(0), **launch.constants, HAS_BIAS=o_bias is not None,
        HAS_RES=residual is not None, BLOCK_N=block_n, BLOCK_K=block_k, LINE=_LINE,
        PRELOAD=tuning.FUSED_O_PROJ_PRELOAD, num_warps=tuning.FUSED_O_PROJ_WARPS,
        BLOCK_M=triton.next_power_of_2(rows))
