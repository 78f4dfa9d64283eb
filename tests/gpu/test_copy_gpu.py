"""The step's small copies done by kernels (atom.kernels.triton_copy): sampled ids into pinned
host memory, and into the next step's token rows, in order or through row/source indices."""

from __future__ import annotations

import pytest
import torch

from atom.kernels.triton_copy import copy_to_host, take_rows

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


def test_take_rows_in_order_and_by_index() -> None:
    tokens = torch.tensor([101, 102, 103, 104], device="cuda")
    ids = torch.full((8,), -1, dtype=torch.long, device="cuda")
    take_rows(ids, tokens, n=3)
    assert ids.tolist() == [101, 102, 103, -1, -1, -1, -1, -1]
    rows = torch.tensor([5, 0], device="cuda")
    src = torch.tensor([3, 1], device="cuda")
    take_rows(ids, tokens, rows, src, n=2)
    assert ids.tolist() == [102, 102, 103, -1, -1, 104, -1, -1]
    take_rows(ids, tokens, n=0)  # nothing to do
    assert ids.tolist() == [102, 102, 103, -1, -1, 104, -1, -1]
