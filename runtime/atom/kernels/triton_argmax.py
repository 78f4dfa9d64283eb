"""Row argmax over a vocabulary in one small launch.

torch's argmax over one row of 128256 logits is a single reduction of 35 us on the H200
(bench/profile_step.py --kernels: 4% of a batch-1 decode step): one block walks the row. Here
CHUNK-wide slices of every row go to their own programs (126 programs a row for that
vocabulary), each writing its slice's maximum and first index of it; the last program of a
row to finish (an arrival counter) picks the first slice holding the row's maximum. The
result is torch.argmax's: the first index of the maximum (the slices are read in order and
each keeps its first). Rows holding NaN are not defined here (torch would return a NaN's
index).

The picking program can also write the result into pinned host memory: the engine's copy of
the sampled ids to the host then needs no kernel of its own (atom.engine.sampled_copy).

On sm_90 and later the launch starts early (programmatic dependent launch): its programs are
placed while the kernel before it (the logits' projection, which releases its dependents)
still runs, and wait for it before reading anything; the step loses the launch's gap.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from atom.kernels.launch import ArrivalCounters, programmatic_launch

CHUNK = 1024  # elements a program reads

# One arrival counter per row, zero between launches.
ARRIVALS = ArrivalCounters(1 << 13)


@triton.jit
def _argmax_kernel(x_ptr, row_stride, n_cols, max_ptr, idx_ptr, count_ptr, out_ptr, host_ptr,
                   n_slices, CHUNK: tl.constexpr, SLICES: tl.constexpr, HOST: tl.constexpr,
                   PDL: tl.constexpr):
    if PDL:
        gdc_wait()  # launched early: the logits are complete only after this
    row = tl.program_id(0)
    part = tl.program_id(1)
    offs = part * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * row_stride + offs, mask=offs < n_cols, other=float("-inf"))
    best, at = tl.max(x.to(tl.float32), axis=0, return_indices=True,
                      return_indices_tie_break_left=True)
    tl.store(max_ptr + row * n_slices + part, best)
    tl.store(idx_ptr + row * n_slices + part, part * CHUNK + at)
    tl.debug_barrier()  # the slice's result is written before its arrival is counted
    arrived = tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == n_slices - 1:
        offs_s = tl.arange(0, SLICES)
        mask = offs_s < n_slices
        # other programs' results: read through L2
        maxima = tl.load(max_ptr + row * n_slices + offs_s, mask=mask, other=float("-inf"),
                         cache_modifier=".cg")
        _, first = tl.max(maxima, axis=0, return_indices=True,
                          return_indices_tie_break_left=True)
        token = tl.load(idx_ptr + row * n_slices + first, cache_modifier=".cg").to(tl.int64)
        tl.store(out_ptr + row, token)
        if HOST:
            tl.store(host_ptr + row, token)
        tl.store(count_ptr + row, 0)  # re-armed for the next launch


def argmax_rows(x: torch.Tensor, host: torch.Tensor | None = None) -> torch.Tensor:
    """x.argmax(dim=-1) of a 2-D CUDA tensor whose last dimension is contiguous: int64 [rows]
    on the device; also written into host (pinned int64 [rows]) when given."""
    rows, n_cols = x.shape
    out = torch.empty(rows, dtype=torch.long, device=x.device)
    if host is not None and (not host.is_pinned() or host.dtype != torch.long
                             or host.shape != (rows,)):
        raise ValueError(f"argmax_rows writes the host copy into pinned int64 [{rows}], "
                         f"got {host.dtype} {tuple(host.shape)}"
                         f"{'' if host.is_pinned() else ' (not pinned)'}")
    if rows == 0:
        return out
    if x.stride(1) != 1:
        raise ValueError("argmax_rows needs the last dimension contiguous")
    n_slices = triton.cdiv(n_cols, CHUNK)
    maxima = torch.empty(rows, n_slices, dtype=torch.float32, device=x.device)
    index = torch.empty(rows, n_slices, dtype=torch.int32, device=x.device)
    counters = ARRIVALS.get(x.device, rows)
    pdl = programmatic_launch(x.device)
    _argmax_kernel[(rows, n_slices)](
        x, x.stride(0), n_cols, maxima, index, counters, out, host if host is not None else out,
        n_slices, CHUNK=CHUNK, SLICES=triton.next_power_of_2(n_slices), HOST=host is not None,
        PDL=pdl, launch_pdl=pdl, num_warps=4)
    return out
