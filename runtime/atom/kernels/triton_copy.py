"""Small copies of a step done by kernels, not by the copy engines.

In an asynchronous decode step (bench/profile_step.py --kernels, the last step's timeline) each
switch between a copy engine and the SMs left the GPU idle for 2.5 to 8.6 us: the step's input
copies up from the host mirrors, the sampled ids' copy back to the host, and the copy of those
ids into the next step's token rows, each sat between two such switches. A kernel doing the
same work runs on the SMs in stream order, like the kernels around it, and reads or writes
pinned host memory through the device's mapping of it.
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


# The staging kernel's segments: up to MAX_SEGMENTS of them, each (start, elements, columns,
# row stride) passed as scalars (reading a descriptor from host memory first would add a
# round trip over the bus).
MAX_SEGMENTS = 8
_SEGMENT_ARGS = [f"{kind}{i}" for i in range(MAX_SEGMENTS) for kind in ("start", "n", "cols",
                                                                          "stride")]


@triton.jit
def _nth(i, v0, v1, v2, v3, v4, v5, v6, v7):
    """The i-th of eight scalars (kernel arguments cannot be indexed)."""
    return tl.where(i == 0, v0, tl.where(i == 1, v1, tl.where(i == 2, v2, tl.where(
        i == 3, v3, tl.where(i == 4, v4, tl.where(i == 5, v5, tl.where(i == 6, v6, v7)))))))


@triton.jit(do_not_specialize=["n_first", "gather_seg", *_SEGMENT_ARGS])
def _stage_kernel(host_a, dev_a, host_b, dev_b, tokens_ptr, n_first, gather_seg,
                  start0, n0, cols0, stride0, start1, n1, cols1, stride1,
                  start2, n2, cols2, stride2, start3, n3, cols3, stride3,
                  start4, n4, cols4, stride4, start5, n5, cols5, stride5,
                  start6, n6, cols6, stride6, start7, n7, cols7, stride7,
                  GATHER: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, s) copies block i of segment s's n elements: cols a row, rows stride apart
    from start. Segments before n_first are in buffer a, the rest in buffer b. In segment
    gather_seg a negative value -(j + 1) becomes tokens[j]."""
    seg = tl.program_id(1)
    start = _nth(seg, start0, start1, start2, start3, start4, start5, start6, start7)
    n = _nth(seg, n0, n1, n2, n3, n4, n5, n6, n7)
    cols = _nth(seg, cols0, cols1, cols2, cols3, cols4, cols5, cols6, cols7)
    stride = _nth(seg, stride0, stride1, stride2, stride3, stride4, stride5, stride6, stride7)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    idx = start + (offs // cols) * stride + offs % cols
    if seg < n_first:
        v = tl.load(host_a + idx, mask=mask)
        if GATHER:
            pending = mask & (v < 0) & (seg == gather_seg)
            v = tl.where(pending, tl.load(tokens_ptr + (-v - 1), mask=pending), v)
        tl.store(dev_a + idx, v, mask=mask)
    else:
        tl.store(dev_b + idx, tl.load(host_b + idx, mask=mask), mask=mask)


# (buffer, first element, rows, columns a row, row stride): rows x columns elements, row r
# from first + r * stride. A 1-D run of n elements: (buffer, first, n, 1, 1).
Segment = tuple[int, int, int, int, int]


def stage_to_device(buffers: list[tuple[torch.Tensor, torch.Tensor]], segments: list[Segment],
                    gather: tuple[int, torch.Tensor] | None = None) -> None:
    """For each segment, the device side of buffers[b] = (host, device) takes the host side's
    values there; host is pinned and read by the SMs over the bus. At most two buffers and
    MAX_SEGMENTS segments, those of buffer 0 first. gather (segment index, tokens on the
    device): in that segment (of buffer 0) a value -(j + 1) is replaced by tokens[j]."""
    if not 1 <= len(buffers) <= 2 or len(segments) > MAX_SEGMENTS:
        raise ValueError(f"stage_to_device takes 1-2 buffers and up to {MAX_SEGMENTS} segments, "
                         f"got {len(buffers)} and {len(segments)}")
    for host, dev in buffers:
        if not host.is_pinned() or host.dtype != dev.dtype or not dev.is_cuda:
            raise ValueError("stage_to_device copies pinned host memory to a CUDA tensor of "
                             "its dtype")
    if [seg[0] for seg in segments] != sorted(seg[0] for seg in segments):
        raise ValueError("stage_to_device: the first buffer's segments come first")
    if any(cols > stride for _, _, rows, cols, stride in segments if rows > 1):
        raise ValueError("stage_to_device: a segment's rows overlap (columns over the stride)")
    live = [seg for seg in segments if seg[2] * seg[3] > 0]
    if not live:
        return
    n_first = sum(1 for seg in live if seg[0] == 0)
    seg_index = -1
    tokens = buffers[0][1]
    if gather is not None:
        index, tokens = gather
        if segments[index][0] != 0:
            raise ValueError("stage_to_device gathers into the first buffer only")
        # the gathered segment's place among the non-empty ones (-1: it is empty)
        if segments[index] in live:
            seg_index = live.index(segments[index])
    flat: list[int] = []
    for _, start, rows, cols, stride in live:
        flat += [start, rows * cols, cols, stride]
    flat += [0, 0, 1, 1] * (MAX_SEGMENTS - len(live))
    host_a, dev_a = buffers[0]
    host_b, dev_b = buffers[-1]
    longest = max(rows * cols for _, _, rows, cols, _ in live)
    _stage_kernel[(triton.cdiv(longest, BLOCK), len(live))](
        host_a, dev_a, host_b, dev_b, tokens, n_first, seg_index, *flat,
        GATHER=seg_index >= 0, BLOCK=BLOCK)
