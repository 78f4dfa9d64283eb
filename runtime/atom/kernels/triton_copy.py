"""Small copies of a step done by kernels, not by the copy engines.

In an asynchronous decode step (bench/profile_step.py --kernels, the last step's timeline) each
switch between a copy engine and the SMs left the GPU idle for 2.5 to 8.6 us: the sampled ids'
copy back to the host, and the device-to-device copy of those ids into the next step's token
row, each sat between two such switches. A kernel doing the same work runs on the SMs in
stream order, like the kernels around it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


@triton.jit
def _take_rows_kernel(ids_ptr, tokens_ptr, rows_ptr, src_ptr, n, IN_ORDER: tl.constexpr,
                      BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if IN_ORDER:
        rows = offs
        src = offs
    else:
        rows = tl.load(rows_ptr + offs, mask=mask, other=0)
        src = tl.load(src_ptr + offs, mask=mask, other=0)
    tl.store(ids_ptr + rows, tl.load(tokens_ptr + src, mask=mask), mask=mask)


def copy_to_host(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[:] = src, src a contiguous CUDA tensor, dst pinned host memory of the same size and
    dtype (written by the SMs through the device's mapping of it)."""
    if not dst.is_pinned() or src.dtype != dst.dtype or src.numel() != dst.numel():
        raise ValueError("copy_to_host needs pinned host memory of the source's size and dtype")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_to_host copies contiguous tensors only")
    n = src.numel()
    if n:
        _copy_kernel[(triton.cdiv(n, BLOCK),)](src, dst, n, BLOCK=BLOCK)


def take_rows(ids: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor | None = None,
              src: torch.Tensor | None = None, n: int = 0) -> None:
    """ids[rows[i]] = tokens[src[i]] for i < n (rows and src on the device); without them,
    ids[i] = tokens[i] for i < n."""
    if n:
        in_order = rows is None
        _take_rows_kernel[(triton.cdiv(n, BLOCK),)](
            ids, tokens, ids if in_order else rows, ids if in_order else src, n,
            IN_ORDER=in_order, BLOCK=BLOCK)
