"""Row argmax over a vocabulary in two small launches.

torch's argmax over one row of 128256 logits is a single reduction of 35 us on the H200
(bench/profile_step.py --kernels: 4% of a batch-1 decode step): one block walks the row. Here
CHUNK-wide slices of every row go to their own programs (126 programs a row for that
vocabulary), each writing its slice's maximum and first index of it; then one program a row
picks the first slice holding the row's maximum. The result is torch.argmax's: the first index
of the maximum (the slices are in order and each keeps its first). Rows holding NaN are not
defined here (torch would return a NaN's index).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 1024  # elements a first-stage program reads


@triton.jit
def _slice_max_kernel(x_ptr, row_stride, n_cols, max_ptr, idx_ptr, n_slices,
                      CHUNK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    offs = part * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * row_stride + offs, mask=offs < n_cols, other=float("-inf"))
    best, at = tl.max(x.to(tl.float32), axis=0, return_indices=True,
                      return_indices_tie_break_left=True)
    tl.store(max_ptr + row * n_slices + part, best)
    tl.store(idx_ptr + row * n_slices + part, part * CHUNK + at)


@triton.jit
def _pick_slice_kernel(max_ptr, idx_ptr, n_slices, out_ptr, SLICES: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, SLICES)
    mask = offs < n_slices
    best = tl.load(max_ptr + row * n_slices + offs, mask=mask, other=float("-inf"))
    _, part = tl.max(best, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * n_slices + part).to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a 2-D CUDA tensor whose last dimension is contiguous: int64 [rows]."""
    rows, n_cols = x.shape
    out = torch.empty(rows, dtype=torch.long, device=x.device)
    if rows == 0:
        return out
    if x.stride(1) != 1:
        raise ValueError("argmax_rows needs the last dimension contiguous")
    n_slices = triton.cdiv(n_cols, CHUNK)
    maxima = torch.empty(rows, n_slices, dtype=torch.float32, device=x.device)
    index = torch.empty(rows, n_slices, dtype=torch.int32, device=x.device)
    _slice_max_kernel[(rows, n_slices)](x, x.stride(0), n_cols, maxima, index, n_slices,
                                        CHUNK=CHUNK, num_warps=4)
    _pick_slice_kernel[(rows,)](maxima, index, n_slices, out,
                                SLICES=triton.next_power_of_2(n_slices), num_warps=4)
    return out
