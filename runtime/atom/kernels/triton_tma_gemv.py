"""One-row projections that stream their weight through the tensor memory accelerator (TMA).

At batch 1 a projection is a weight stream, and with one program per SM the pointer loads of
the tiled kernel (triton_norm_gemv) keep too few bytes in flight: such programs read 2.0 to
3.3 TB/s on the H200, while the same programs fetching tiles by TMA into a pipeline of shared
memory read 4.4 TB/s, above the device copy rate (bench/stream_rate.py, bench/RESULTS.md,
session 14). Each program takes ROWS weight rows (and as many up rows when gated) and walks
them in tiles of TILE_R rows x BLOCK_K columns; the norm's 1/rms comes from one pass over x
first, and the epilogue rounds where the tiled kernel rounds (SiLU(gate) * up, the residual
add).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from atom.kernels.launch import programmatic_launch, sm_resources

# Rows taken where it applies: one (decode at batch 1).
MAX_ROWS = 1
BLOCK_K = 256  # a TMA box is at most 256 elements a side
SMEM_BUDGET = 192 * 1024  # the pipeline's tiles (of an H200 SM's 227 KiB)
MAX_STAGES = 12
# False: every one-row projection stays on triton_norm_gemv's kernels.
ENABLED = True


class TmaPlan(NamedTuple):
    """Programs, weight rows a program (of each half when gated), rows a tile, stages."""

    programs: int
    rows: int
    tile_rows: int
    stages: int


def tma_plan(n: int, k: int, gated: bool, elem: int, sms: int) -> TmaPlan | None:
    """The launch for an n x k projection (n: a half when gated), or None where it does not
    apply: rows must split into at most one strip per SM of a power of two rows, and K into
    whole boxes."""
    if k % BLOCK_K or n % 8:
        return None
    rows = triton.next_power_of_2(triton.cdiv(n, sms))
    if n % rows:
        return None
    tile_rows = min(rows, 32)
    tile_bytes = tile_rows * BLOCK_K * elem * (2 if gated else 1)
    stages = min(MAX_STAGES, SMEM_BUDGET // tile_bytes)
    return TmaPlan(n // rows, rows, tile_rows, stages) if stages >= 3 else None


@triton.jit
def _tma_row_kernel(w_desc, x_ptr, nw_ptr, res_ptr, y_ptr, K, eps, up_offset,
                    ROWS: tl.constexpr, TILE_R: tl.constexpr, BLOCK_K: tl.constexpr,
                    NORM: tl.constexpr, GATED: tl.constexpr, HAS_RES: tl.constexpr,
                    RELEASE: tl.constexpr, WAIT: tl.constexpr, STAGES: tl.constexpr):
    """y[rows] = [RMSNorm](x) W[rows]^T [-> SiLU(gate) * up] [+ residual] for one row x, rows
    [pid * ROWS, +ROWS) (and their up rows up_offset further when GATED). RELEASE: a kernel
    launched early after this one may start once every program here has; WAIT: this launch
    is such a kernel, and reads x only after the kernel before it ends."""
    if RELEASE:
        gdc_launch_dependents()
    row0 = tl.program_id(0) * ROWS
    offs_k = tl.arange(0, BLOCK_K)
    kc = K // BLOCK_K
    if WAIT:
        gdc_wait()
    rstd = 1.0
    if NORM:
        squares = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xk = tl.load(x_ptr + k0 + offs_k).to(tl.float32)
            squares += xk * xk
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    acc = tl.zeros([TILE_R], tl.float32)
    acc_up = tl.zeros([TILE_R], tl.float32)
    out_ty = y_ptr.dtype.element_ty
    for i in tl.range(0, (ROWS // TILE_R) * kc, num_stages=STAGES):
        r = row0 + (i // kc) * TILE_R
        c = (i % kc) * BLOCK_K
        w = w_desc.load([r, c])
        xk = tl.load(x_ptr + c + offs_k)
        a = xk.to(tl.float32)
        if NORM:  # the normalised input rounded to x's dtype, as the unfused model rounds it
            a = (a * tl.load(nw_ptr + c + offs_k).to(tl.float32)).to(xk.dtype).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        if GATED:
            u = w_desc.load([up_offset + r, c])
            acc_up += tl.sum(u.to(tl.float32) * a[None, :], axis=1)
        if c + BLOCK_K == K:  # the tile's rows are complete
            rows = r + tl.arange(0, TILE_R)
            out = (acc * rstd).to(out_ty).to(tl.float32)
            if GATED:
                up = (acc_up * rstd).to(out_ty).to(tl.float32)
                out = (out * tl.sigmoid(out)).to(out_ty).to(tl.float32) * up
            if HAS_RES:
                out = out.to(out_ty).to(tl.float32) + tl.load(res_ptr + rows).to(tl.float32)
            tl.store(y_ptr + rows, out.to(out_ty))
            acc = tl.zeros([TILE_R], tl.float32)
            acc_up = tl.zeros([TILE_R], tl.float32)


def tma_gemv_plan(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  gated: bool, out: torch.Tensor | None) -> TmaPlan | None:
    """The TMA launch for gemv's arguments on this device, or None where it does not apply
    (more than MAX_ROWS rows, a bias, not sm_90, strides the descriptor cannot take)."""
    if not (ENABLED and x.is_cuda and x.shape[0] <= MAX_ROWS and bias is None
            and programmatic_launch(x.device) and x.dtype in (torch.bfloat16, torch.float16)):
        return None
    if not (weight.is_contiguous() and x.is_contiguous() and weight.dtype == x.dtype
            and weight.data_ptr() % 16 == 0):
        return None
    if out is not None and not out.is_contiguous():
        return None
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    return tma_plan(n, weight.shape[1], gated, x.element_size(), sm_resources(x.device)[0])


def tma_gemv(x: torch.Tensor, weight: torch.Tensor, plan: TmaPlan, *,
             norm_weight: torch.Tensor | None, eps: float, gated: bool,
             residual: torch.Tensor | None, out: torch.Tensor | None,
             overlap: bool) -> torch.Tensor:
    """gemv (triton_norm_gemv) for one row by the TMA kernel, with the plan tma_gemv_plan
    gave. overlap: launched early (programmatic dependent launch), reading x only after the
    kernel before it ends."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    k = weight.shape[1]
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    y = torch.empty(1, n, dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (1, n) and x.shape == (1, k)
    assert residual is None or (residual.shape == (1, n) and residual.is_contiguous())
    desc = TensorDescriptor.from_tensor(weight, [plan.tile_rows, BLOCK_K])
    _tma_row_kernel[(plan.programs,)](
        desc, x, norm_weight if norm_weight is not None else x,
        residual if residual is not None else y, y, k, eps, n,
        ROWS=plan.rows, TILE_R=plan.tile_rows, BLOCK_K=BLOCK_K, NORM=norm_weight is not None,
        GATED=gated, HAS_RES=residual is not None, RELEASE=True, WAIT=overlap,
        STAGES=plan.stages, launch_pdl=overlap, num_warps=4)
    return y
