"""The step's small copies done by kernels (atom.kernels.triton_copy): sampled ids into pinned
host memory, and the step's inputs from pinned host mirrors, with placeholders replaced by the
sampled ids."""

from __future__ import annotations

import pytest
import torch

from atom.kernels.triton_copy import BLOCK, MAX_SEGMENTS, copy_to_host, stage_to_device

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton kernels)"),
]


@pytest.mark.parametrize("dtype", [torch.long, torch.float32])
@pytest.mark.parametrize("n", [1, 8, 1500])
def test_copy_to_host_writes_pinned_memory(dtype: torch.dtype, n: int) -> None:
    src = torch.arange(n, device="cuda").to(dtype) * 3 - 7
    dst = torch.full((n,), -1, dtype=dtype, pin_memory=True)
    copy_to_host(src, dst)
    torch.cuda.synchronize()
    assert torch.equal(dst, src.cpu())


def test_copy_to_host_refuses_pageable_memory_or_another_size() -> None:
    src = torch.zeros(4, dtype=torch.long, device="cuda")
    with pytest.raises(ValueError, match="pinned"):
        copy_to_host(src, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="pinned"):
        copy_to_host(src, torch.zeros(5, dtype=torch.long, pin_memory=True))
    strided = torch.zeros(8, dtype=torch.long, device="cuda")[::2]
    with pytest.raises(ValueError, match="contiguous"):
        copy_to_host(strided, torch.zeros(4, dtype=torch.long, pin_memory=True))


def _pair(dtype: torch.dtype, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    host = (torch.arange(n) * 10).to(dtype).pin_memory()
    return host, torch.full((n,), -5, dtype=dtype, device="cuda")


def test_stage_to_device_copies_only_the_segments() -> None:
    longs, ints = _pair(torch.long, 3 * BLOCK), _pair(torch.int32, 64)
    # a run longer than a block, a short one, an empty one; in the int32 buffer a run and
    # the first 3 values of 2 rows of a 10-wide table
    segments = [(0, 0, BLOCK + 3, 1, 1), (0, 2 * BLOCK, 2, 1, 1), (0, 2 * BLOCK + 10, 0, 1, 1),
                (1, 4, 3, 1, 1), (1, 30, 2, 3, 10)]
    stage_to_device([longs, ints], segments)
    torch.cuda.synchronize()
    expect_l = torch.full((3 * BLOCK,), -5, dtype=torch.long)
    expect_l[:BLOCK + 3] = longs[0][:BLOCK + 3]
    expect_l[2 * BLOCK:2 * BLOCK + 2] = longs[0][2 * BLOCK:2 * BLOCK + 2]
    expect_i = torch.full((64,), -5, dtype=torch.int32)
    expect_i[4:7] = ints[0][4:7]
    for row_start in (30, 40):
        expect_i[row_start:row_start + 3] = ints[0][row_start:row_start + 3]
    assert torch.equal(longs[1].cpu(), expect_l) and torch.equal(ints[1].cpu(), expect_i)


def test_stage_to_device_fills_placeholders_in_the_gathered_segment_only() -> None:
    host = torch.tensor([-2, 5, -1, -3, -1, -1], dtype=torch.long).pin_memory()
    dev = torch.zeros(6, dtype=torch.long, device="cuda")
    tokens = torch.tensor([101, 102, 103], device="cuda")
    stage_to_device([(host, dev)], [(0, 0, 4, 1, 1), (0, 4, 2, 1, 1)], gather=(0, tokens))
    torch.cuda.synchronize()
    assert dev.tolist() == [102, 5, 101, 103, -1, -1]  # the second segment keeps its -1s
    # the gathered segment empty: nothing is filled, the rest is still copied
    dev.zero_()
    stage_to_device([(host, dev)], [(0, 0, 0, 1, 1), (0, 4, 2, 1, 1)], gather=(0, tokens))
    torch.cuda.synchronize()
    assert dev.tolist() == [0, 0, 0, 0, -1, -1]


def test_stage_to_device_refuses_what_it_cannot_read() -> None:
    dev = torch.zeros(4, dtype=torch.long, device="cuda")
    with pytest.raises(ValueError, match="pinned"):
        stage_to_device([(torch.zeros(4, dtype=torch.long), dev)], [(0, 0, 4, 1, 1)])
    host = torch.zeros(4, dtype=torch.long).pin_memory()
    with pytest.raises(ValueError, match="segments"):
        stage_to_device([(host, dev)], [(0, 0, 1, 1, 1)] * (MAX_SEGMENTS + 1))
    ints = _pair(torch.int32, 4)
    with pytest.raises(ValueError, match="first buffer"):
        stage_to_device([(host, dev), ints], [(1, 0, 1, 1, 1), (0, 0, 1, 1, 1)])
    with pytest.raises(ValueError, match="overlap"):
        stage_to_device([(host, dev)], [(0, 0, 2, 3, 2)])
