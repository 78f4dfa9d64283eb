"""Decode-sized projections with their neighbours fused in: RMSNorm before, SiLU(gate) * up
or the residual add after.

At decode sizes (a few rows) a projection is a latency-bound stream of its weight, and the
small kernels around it (RMSNorm, residual add, SiLU x up) each cost a launch and a drain
(bench/profile_decode.py). Here one kernel does [norm ->] projection [-> SiLU(gate) * up]
[+ residual]: each program streams a strip of weight rows across K once and reads the few
activation rows (L2-resident) alongside.

- The norm's 1/rms is a per-row scalar, applied to the accumulator at the end, and the sum of
  squares is the diagonal of x x^T on the tensor cores: one pipelined pass over K, no
  cross-lane reduction in the loop. The rounding differs from norm-then-matmul by a few units
  in the last place; every compilation level and graph mode runs this same kernel.
- The residual add is the epilogue of the projection before it (o_proj, down_proj), so the
  residual stream is written once per projection and never read back by a separate kernel.

For more than tuning.GEMV_MAX_ROWS rows (prefill, larger decode batches) `rows_path` runs a row-wise norm
kernel, cuBLAS, a SiLU-gate kernel and the add instead.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from atom.kernels import tuning
from atom.kernels.launch import programmatic_launch, sm_resources

# The row limit and the launch switches are in atom.kernels.tuning.


@triton.jit
def _diagonal(gram, BLOCK_M: tl.constexpr):
    offs = tl.arange(0, BLOCK_M)
    return tl.sum(tl.where(offs[:, None] == offs[None, :], gram, 0.0), axis=1)


@triton.jit
def _strip_dot_2d(x_ptr, nw_ptr, w_ptr, rows_m, offs_n, m_mask, n_mask, K, stride_x, stride_w,
                  up_offset, HAS_NORM: tl.constexpr, GATED: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISION: tl.constexpr):
    """x [M, K] against the strip's weight rows: (x W^T, x W_up^T, per-row sums of squares)."""
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    gram = tl.zeros([BLOCK_M, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        x = tl.load(x_ptr + rows_m[:, None] * stride_x + kk[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if HAS_NORM:
            # Sums of squares: the diagonal of x x^T, on the tensor cores (a row reduction
            # here would shuffle across lanes every iteration).
            gram += tl.dot(x, tl.trans(x), input_precision=PRECISION)
            nw = tl.load(nw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
            a = (x.to(tl.float32) * nw[None, :]).to(x.dtype)
        else:
            a = x
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0)
        acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
        if GATED:
            wu = tl.load(w_rows + up_offset * stride_w + kk[None, :], mask=w_mask, other=0.0)
            acc_up += tl.dot(a, tl.trans(wu), input_precision=PRECISION)
    return acc, acc_up, _diagonal(gram, BLOCK_M)


@triton.jit
def _split_offsets(k0, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """[SPLIT, SUB] K offsets of the step at k0: slice s covers SUB consecutive elements."""
    SUB: tl.constexpr = BLOCK_K // SPLIT
    return k0 + tl.arange(0, SPLIT)[:, None] * SUB + tl.arange(0, SUB)[None, :]


@triton.jit
def _split_weights(w_ptr, offs_n, n_mask, k0, K, stride_w, BLOCK_K: tl.constexpr,
                   SPLIT: tl.constexpr):
    """The strip's weight tile of the K step at k0, in slices: [SPLIT, BLOCK_N, SUB]."""
    kk = _split_offsets(k0, BLOCK_K, SPLIT)
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :, None] * stride_w  # [1, N, 1]
    return tl.load(w_rows + kk[:, None, :], mask=n_mask[None, :, None] & (kk < K)[:, None, :],
                   other=0.0)


@triton.jit
def _split_step(x_ptr, nw_ptr, w_ptr, rows_m, offs_n, m_mask, n_mask, k0, K, stride_x,
                stride_w, up_offset, w, acc, acc_up, gram, HAS_NORM: tl.constexpr,
                GATED: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                PRECISION: tl.constexpr):
    """One K step of _strip_dot_split against the weight tile w (and the up half, loaded
    here when gated)."""
    kk = _split_offsets(k0, BLOCK_K, SPLIT)
    k_mask = kk < K
    x = tl.load(x_ptr + rows_m[None, :, None] * stride_x + kk[:, None, :],
                mask=m_mask[None, :, None] & k_mask[:, None, :], other=0.0)
    if HAS_NORM:
        gram += tl.dot(x, tl.permute(x, (0, 2, 1)), input_precision=PRECISION)
        nw = tl.load(nw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        a = (x.to(tl.float32) * nw[:, None, :]).to(x.dtype)
    else:
        a = x
    acc += tl.dot(a, tl.permute(w, (0, 2, 1)), input_precision=PRECISION)
    if GATED:
        wu = _split_weights(w_ptr + up_offset * stride_w, offs_n, n_mask, k0, K, stride_w,
                            BLOCK_K, SPLIT)
        acc_up += tl.dot(a, tl.permute(wu, (0, 2, 1)), input_precision=PRECISION)
    return acc, acc_up, gram


@triton.jit
def _strip_dot_split(x_ptr, nw_ptr, w_ptr, rows_m, offs_n, m_mask, n_mask, K, stride_x,
                     stride_w, up_offset, w0, HAS_NORM: tl.constexpr, GATED: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT: tl.constexpr, PRECISION: tl.constexpr, PRELOADED: tl.constexpr):
    """_strip_dot_2d with each K step cut into SPLIT slices accumulated separately.
    PRELOADED: w0 is the first K step's weight tile, already loaded (used first: the sums run
    in the same order)."""
    acc = tl.zeros([SPLIT, BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([SPLIT, BLOCK_M, BLOCK_N], tl.float32)
    gram = tl.zeros([SPLIT, BLOCK_M, BLOCK_M], tl.float32)
    start = 0
    if PRELOADED:
        acc, acc_up, gram = _split_step(x_ptr, nw_ptr, w_ptr, rows_m, offs_n, m_mask, n_mask,
                                        0, K, stride_x, stride_w, up_offset, w0, acc, acc_up,
                                        gram, HAS_NORM, GATED, BLOCK_K, SPLIT, PRECISION)
        start = BLOCK_K
    for k0 in range(start, K, BLOCK_K):
        w = _split_weights(w_ptr, offs_n, n_mask, k0, K, stride_w, BLOCK_K, SPLIT)
        acc, acc_up, gram = _split_step(x_ptr, nw_ptr, w_ptr, rows_m, offs_n, m_mask, n_mask,
                                        k0, K, stride_x, stride_w, up_offset, w, acc, acc_up,
                                        gram, HAS_NORM, GATED, BLOCK_K, SPLIT, PRECISION)
    return tl.sum(acc, axis=0), tl.sum(acc_up, axis=0), _diagonal(tl.sum(gram, axis=0), BLOCK_M)


@triton.jit
def _norm_gemv_kernel(x_ptr, nw_ptr, w_ptr, b_ptr, res_ptr, y_ptr,
                      M, N, K, eps, stride_x, stride_w, stride_r, stride_y, up_offset,
                      HAS_NORM: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                      HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                      RELEASE: tl.constexpr, WAIT: tl.constexpr, PRELOAD: tl.constexpr,
                      STRIP: tl.constexpr):
    """SPLIT > 1: each K step is SPLIT slices of BLOCK_K // SPLIT, the batches of a 3-D dot,
    one warp each, accumulated separately and summed after the loop. With one accumulator
    every tensor-core op over the strip's K (K / 16 of them) waits for the one before, and at
    long K that chain, not the weight stream, sets the time (bench/norm_gemv_sweep.py:
    down_proj 13.98 -> 11.59 us). The gated MLP input keeps the 2-D form (SPLIT 1), which
    measured faster there.

    RELEASE: a kernel launched after this one with programmatic dependent launch (the decode
    attention, the preloading kernel, a one-row projection) may start as soon as every program
    here has started; it waits for this kernel's results itself (griddepcontrol.wait).
    WAIT: this launch is such a kernel (tiled_plan's early): it waits for the kernel before
    it before reading anything but its weights (no kernel of a forward writes them): with
    PRELOAD (SPLIT > 1) the first K step's weight tile is loaded before the wait. (Releasing
    only after that wait measured slower.)

    STRIP: the weight rows a program takes (at most BLOCK_N; the tile's rows past it are
    masked, and masked rows are not read). Grid axis 1: blocks of BLOCK_M rows x, each
    computed as a launch of those rows alone would (a verify step's rows: gemv's plan_rows)."""
    if RELEASE:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    # This program's block of rows: moved into the base pointers (scalars), so the tile's
    # row offsets stay the constant 0 .. BLOCK_M - 1 of a one-block launch.
    row0 = tl.program_id(1) * BLOCK_M
    x_ptr += row0 * stride_x
    res_ptr += row0 * stride_r
    y_ptr += row0 * stride_y
    M -= row0
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * STRIP + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = (offs_n < N) & (tl.arange(0, BLOCK_N) < STRIP)
    rows_m = offs_m.to(tl.int64)
    w0 = 0.0
    if PRELOAD:
        w0 = _split_weights(w_ptr, offs_n, n_mask, 0, K, stride_w, BLOCK_K, SPLIT)
    if WAIT:
        gdc_wait()
    if SPLIT == 1:
        acc, acc_up, sq = _strip_dot_2d(x_ptr, nw_ptr, w_ptr, rows_m, offs_n, m_mask, n_mask,
                                        K, stride_x, stride_w, up_offset, HAS_NORM, GATED,
                                        BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    else:
        acc, acc_up, sq = _strip_dot_split(x_ptr, nw_ptr, w_ptr, rows_m, offs_n, m_mask,
                                           n_mask, K, stride_x, stride_w, up_offset, w0,
                                           HAS_NORM, GATED, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT,
                                           PRECISION, PRELOAD)
    if HAS_NORM:
        rstd = tl.rsqrt(sq / K + eps)
        acc = acc * rstd[:, None]
        acc_up = acc_up * rstd[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_ptr + up_offset + offs_n, mask=n_mask,
                              other=0.0).to(tl.float32)[None, :]
    out_ty = y_ptr.dtype.element_ty
    out_mask = m_mask[:, None] & n_mask[None, :]
    # Rounded where the unfused model rounds: each projection's output, SiLU(gate), the sum.
    out = acc.to(out_ty).to(tl.float32)
    if GATED:
        up = acc_up.to(out_ty).to(tl.float32)
        out = (out * tl.sigmoid(out)).to(out_ty).to(tl.float32) * up
    if HAS_RES:
        res = tl.load(res_ptr + rows_m[:, None] * stride_r + offs_n[None, :], mask=out_mask,
                      other=0.0)
        out = out.to(out_ty).to(tl.float32) + res.to(tl.float32)
    tl.store(y_ptr + rows_m[:, None] * stride_y + offs_n[None, :], out.to(out_ty), mask=out_mask)


@triton.jit
def _wait_for(count_ptr, target):
    """Until the count at count_ptr reaches target (acquire: what its arrivals published is
    visible after)."""
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def row_strip(strip, x_ptr, nw_ptr, w_ptr, b_ptr, res_ptr, y_ptr, done_ptr, target, M, N, K,
               eps, stride_x, stride_w, stride_r, stride_y, HAS_NORM: tl.constexpr,
               HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRELOAD: tl.constexpr,
               PDL: tl.constexpr, COUNTED: tl.constexpr):
    """y[:M, strip] = [RMSNorm](x) W[strip]^T (+ bias) (+ residual) for M <= BLOCK_M rows x,
    rounded where the tiled kernel rounds. The parameters (weights, norm weight, bias) are
    loaded first (with PRELOAD the whole strip, into registers); then, PDL: the wait for the
    kernel before; COUNTED: the wait for done_ptr's count to reach target (x is written in this
    launch). Only then x and the residual (before the count's wait: the launch does not write
    it). The strip is applied to one row at a time: it stays in registers across rows."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = strip * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_mask = offs_k < K
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w + offs_k[None, :]
    w_mask = n_mask[:, None] & k_mask[None, :]
    if PRELOAD:
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    if HAS_RES:
        res = tl.load(res_ptr + offs_m[:, None] * stride_r + offs_n[None, :],
                      mask=m_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
    if COUNTED:
        _wait_for(done_ptr, target)
    if not PRELOAD:
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    out_ty = y_ptr.dtype.element_ty
    for r in tl.static_range(BLOCK_M):
        if r < M:
            # Another kernel's or another SM's output: read through L2.
            x = tl.load(x_ptr + r * stride_x + offs_k, mask=k_mask, other=0.0,
                        cache_modifier=".cg")
            if HAS_NORM:
                xf = x.to(tl.float32)
                rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
                x = (xf * nw).to(x.dtype)
            acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
            if HAS_NORM:
                acc = acc * rstd
            if HAS_BIAS:
                acc += bias
            out = acc.to(out_ty).to(tl.float32)
            if HAS_RES:
                out += tl.sum(tl.where(offs_m[:, None] == r, res, 0.0), axis=0)
            tl.store(y_ptr + r * stride_y + offs_n, out.to(out_ty), mask=n_mask)


@triton.jit
def _row_gemv_kernel(x_ptr, nw_ptr, w_ptr, b_ptr, res_ptr, y_ptr, M, N, K, eps, stride_x,
                     stride_w, stride_r, stride_y, HAS_NORM: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One program per strip of BLOCK_N weight rows, for up to BLOCK_M rows x
    (tuning.ROW_GEMV_MAX_ROWS)."""
    if PDL:
        gdc_launch_dependents()  # the decode attention after it may start as well
    row_strip(tl.program_id(0), x_ptr, nw_ptr, w_ptr, b_ptr, res_ptr, y_ptr, y_ptr, 0, M, N, K,
               eps, stride_x, stride_w, stride_r, stride_y, HAS_NORM, HAS_BIAS, HAS_RES,
               BLOCK_M, BLOCK_N, BLOCK_K, True, PDL, False)


def row_strip_rows(k: int, elem: int, strip_bytes: int) -> int:
    """Weight rows of K elements a program holds in strip_bytes (at most 16; 0: none fit)."""
    return min(16, strip_bytes // (triton.next_power_of_2(k) * elem))


@triton.jit
def _rmsnorm_kernel(x_ptr, nw_ptr, y_ptr, K, eps, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    xf = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
    out_ty = y_ptr.dtype.element_ty
    normed = (xf * rstd).to(out_ty).to(tl.float32)
    nw = tl.load(nw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (normed * nw).to(out_ty), mask=mask)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of a CUDA tensor of any leading shape, one program a
    row, rounded where atom.layers.rmsnorm.rms_norm rounds (x and weight of one dtype)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rmsnorm_kernel[(rows.shape[0],)](rows, weight, y, k, eps, rows.stride(0), y.stride(0),
                                          BLOCK=triton.next_power_of_2(k))
    return y.view(x.shape)


@triton.jit
def _silu_mul_kernel(gu_ptr, y_ptr, N, stride_gu, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + N + offs, mask=mask, other=0.0).to(tl.float32)
    out_ty = y_ptr.dtype.element_ty
    silu = (gate * tl.sigmoid(gate)).to(out_ty).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (silu * up).to(out_ty), mask=mask)


SMEM_BUDGET = 200 * 1024  # of an H100/H200 SM's 227 KiB: the pipelined tiles, with room


class TiledPlan(NamedTuple):
    """How gemv launches the tiled kernel: programs of BLOCK_N weight rows, the K step, warps,
    pipeline stages, K slices, whether the launch starts early (waiting at its start),
    whether it loads its first weight tile before that wait (tuning.TILED_PRELOAD_MIN_K), and the
    weight rows a program takes (BLOCK_N, or fewer: tuning.EVEN_STRIPS)."""

    programs: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    split: int
    early: bool
    preload: bool
    strip: int


def _config(n: int, k: int, gated: bool, block_m: int, elem: int, min_smem: int = 0,
            wide: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages, SPLIT), from bench/norm_gemv_sweep.py on an H200:
    strips of 16-32 weight rows (twice that when gated; wide: 64) keep every SM streaming on
    the Llama-3.2-1B shapes; one K slice per warp except for the gated input; the pipeline
    depth is what fits the shared-memory budget, and at least min_smem bytes where that fits."""
    if gated:
        block_n, block_k, stages, split = (64, 64, 4, 1) if wide else (32, 64, 6, 1)
    elif n > 16384:  # the logits' projection: vocabulary rows (norm_gemv_sweep.py --lm-head)
        block_n, block_k, stages, split = 32, 512, 3, 4
    elif n <= 2048 and k >= 4096:  # down_proj: long K, 1 KB of each row per step
        block_n, block_k, stages, split = 16, 1024, 3, 4
    elif n <= 2048:
        block_n, block_k, stages, split = 16, 256, 6, 4
    else:
        block_n, block_k, stages, split = 32, 256, 4, 4
    stage_bytes = (block_m + block_n * (2 if gated else 1)) * block_k * elem
    if min_smem:  # one buffer more than the bytes: the pipeline holds stages - 1 in flight
        stages = max(stages, -(-min_smem // stage_bytes) + 1)
    return block_n, block_k, 4, max(1, min(stages, SMEM_BUDGET // stage_bytes)), split


def tiled_plan(m: int, n: int, k: int, gated: bool, elem: int, overlap: bool, sms: int,
               smem_per_sm: int) -> TiledPlan:
    """The tiled launch for m rows of an n x k projection (n: gate_up's half when gated) in
    elem-byte values. overlap: the launch may start early (the caller allows it and the device
    can); sms, smem_per_sm: the device's (launch.sm_resources)."""
    block_m = max(16, triton.next_power_of_2(m))
    one_wave_rows = tuning.TILED_PDL_MAX_ROWS < m <= tuning.ONE_WAVE_PDL_MAX_ROWS
    # gate_up in wide strips only where that makes it one wave (and so early).
    wide = (gated and overlap and one_wave_rows
            and triton.cdiv(n, _config(n, k, gated, block_m, elem, wide=True)[0]) <= sms)
    config = _config(n, k, gated, block_m, elem, wide=wide)
    programs = triton.cdiv(n, config[0])
    one_wave = programs <= sms
    early = overlap and (m <= tuning.TILED_PDL_MAX_ROWS or (one_wave_rows and one_wave))
    if early and one_wave:
        config = _config(n, k, gated, block_m, elem, smem_per_sm // 2 + 1, wide)
    preload = (early and one_wave_rows and not gated and config[4] > 1
               and k >= tuning.TILED_PRELOAD_MIN_K)
    strip = config[0]
    if tuning.EVEN_STRIPS and early and one_wave_rows and one_wave:
        strip = min(strip, -(-triton.cdiv(n, sms) // 8) * 8)
        programs = triton.cdiv(n, strip)
    return TiledPlan(programs, *config, early, preload, strip)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False,
         residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
         overlap: bool = False, plan_rows: int | None = None) -> torch.Tensor:
    """[residual +] [SiLU-gated] projection of [RMSNorm'd] x, for x.shape[0] <= tuning.GEMV_MAX_ROWS;
    written into out when given. overlap: the launch may start before the previous kernel on
    the stream ends and read the parameters meanwhile (tuning.ROW_GEMV_MAX_ROWS): allowed only when
    that kernel writes none of them (a model's forward). plan_rows (<= GEMV_MAX_ROWS, default
    x's rows): the launch is chosen for that many rows and every row of x computed as in it,
    in blocks of BLOCK_M rows (a verify step: atom.utils.forward_context.launch_rows)."""
    m, k = x.shape
    plan_m = m if plan_rows is None else plan_rows
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (m, n) and y.stride(-1) == 1
    if m == 0:
        return y
    assert x.stride(-1) == 1 and weight.stride(-1) == 1
    assert residual is None or residual.stride(-1) == 1
    pdl = programmatic_launch(x.device)
    # The preloading kernel applies its strip to each row in turn: any m rows as one would.
    if (overlap and pdl and plan_m <= tuning.ROW_GEMV_MAX_ROWS and m <= tuning.GEMV_MAX_ROWS
            and not gated and row_strip_rows(k, x.element_size(), tuning.ROW_STRIP_BYTES) == 16):
        return row_gemv(x, weight, bias, y, norm_weight=norm_weight, eps=eps,
                        residual=residual, pdl=True)
    res = residual if residual is not None else y
    sms, smem = sm_resources(x.device) if pdl else (0, 0)
    plan = tiled_plan(plan_m, n, k, gated, x.element_size(), overlap and pdl, sms, smem)
    block_m = max(16, triton.next_power_of_2(plan_m))
    _norm_gemv_kernel[(plan.programs, triton.cdiv(m, block_m))](
        x, norm_weight if norm_weight is not None else x, weight,
        bias if bias is not None else weight, res, y,
        m, n, k, eps, x.stride(0), weight.stride(0), res.stride(0), y.stride(0), n,
        HAS_NORM=norm_weight is not None, GATED=gated, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, BLOCK_M=block_m,
        BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, SPLIT=plan.split,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", RELEASE=pdl, WAIT=plan.early,
        PRELOAD=plan.preload, STRIP=plan.strip, launch_pdl=plan.early, num_warps=plan.warps,
        num_stages=plan.stages)
    return y


def row_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
             *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
             residual: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """The projection of up to tuning.GEMV_MAX_ROWS rows into y by the preloading kernel
    (tuning.ROW_GEMV_MAX_ROWS); pdl: launched early, the parameters read before the kernel before it
    ends (gemv's overlap)."""
    m, (n, k) = x.shape[0], weight.shape
    assert m <= tuning.GEMV_MAX_ROWS and x.stride(-1) == 1 and y.stride(-1) == 1
    rows = row_strip_rows(k, x.element_size(), tuning.ROW_STRIP_BYTES)
    assert rows > 0, f"a weight row of {k} elements does not fit {tuning.ROW_STRIP_BYTES} bytes"
    res = residual if residual is not None else y
    _row_gemv_kernel[(triton.cdiv(n, rows),)](
        x, norm_weight if norm_weight is not None else x, weight,
        bias if bias is not None else weight, res, y, m, n, k, eps, x.stride(0), weight.stride(0),
        res.stride(0), y.stride(0), HAS_NORM=norm_weight is not None, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=rows,
        BLOCK_K=triton.next_power_of_2(k), PDL=pdl, launch_pdl=pdl, num_warps=tuning.ROW_WARPS)
    return y


def rows_path(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
              norm_weight: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False,
              residual: torch.Tensor | None = None, out: torch.Tensor | None = None
              ) -> torch.Tensor:
    """The same result for any number of rows: norm kernel, cuBLAS, SiLU-gate kernel, add
    (into out when given)."""
    m = x.shape[0]
    if norm_weight is not None:
        x = rms_norm_rows(x, norm_weight, eps)
    y = F.linear(x, weight, bias)
    if gated:
        n = weight.shape[0] // 2
        gu, y = y, torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m:
            _silu_mul_kernel[(m, triton.cdiv(n, 1024))](gu, y, n, gu.stride(0), y.stride(0),
                                                         BLOCK=1024)
    if residual is not None:
        # in the model's dtype: an fp32 add rounded once
        return torch.add(y, residual, out=out) if out is not None else y.add_(residual)
    return y if out is None else out.copy_(y)
