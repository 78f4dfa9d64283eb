"""HostStaging: a step's inputs written through persistent host mirrors into packed device
buffers, two copies a step."""

from __future__ import annotations

import pytest
import torch

from atom.model_engine.host_staging import HostStaging


def _staging(device: str) -> HostStaging:
    return HostStaging({"ids": (torch.long, (8,), 0), "slots": (torch.long, (8,), -1),
                        "lens": (torch.int32, (4,), 0), "table": (torch.int32, (4, 6), 0)},
                       torch.device(device))


def _write(staging: HostStaging, ids: list[int], rows: list[list[int]]) -> torch.Tensor:
    staging.begin()
    out = staging.put("ids", ids)
    staging.put("slots", [-1] * len(ids))
    staging.put("lens", [len(r) for r in rows])
    staging.put_rows("table", rows)
    staging.flush()
    return out


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA (pinned mirrors, async copies)")]),
])
def test_put_writes_the_front_and_the_rest_keeps_earlier_values(device: str) -> None:
    staging = _staging(device)
    bufs = staging.buffers
    ptrs = {k: v.data_ptr() for k, v in bufs.items()}
    assert bufs["slots"].tolist() == [-1] * 8 and bufs["table"].shape == (4, 6)
    out = _write(staging, [5, 6, 7], [[1, 2, 3, 4], [9]])
    assert out.data_ptr() == bufs["ids"].data_ptr() and out.shape == (3,)
    assert out.tolist() == [5, 6, 7] and bufs["lens"].tolist() == [4, 1, 0, 0]
    # A later, shorter step: the front changes, the tail of each field keeps what it held.
    out = _write(staging, [8], [[7, 7]])
    assert out.tolist() == [8]
    assert bufs["ids"][:3].tolist() == [8, 6, 7] and bufs["lens"].tolist() == [2, 1, 0, 0]
    assert bufs["table"][:2].tolist() == [[7, 7, 3, 4, 0, 0], [9, 0, 0, 0, 0, 0]]
    empty = _write(staging, [], [])
    assert empty.shape == (0,)
    assert {k: v.data_ptr() for k, v in bufs.items()} == ptrs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (async copies)")
def test_a_mirror_is_not_rewritten_before_its_copy_ran() -> None:
    """The first copy waits behind a long kernel; the second step's begin() must wait for it
    before overwriting the host mirror, or the device would receive the second step's values
    in the first step's place."""
    staging = _staging("cuda")
    bufs = staging.buffers
    assert all(h.is_pinned() for h in staging._host.values())
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time ahead of the copy
    first = _write(staging, [1, 2, 3], [[4]])
    seen = first.clone()  # runs after the copy, on the same stream
    _write(staging, [7, 8, 9], [[5]])
    torch.cuda.synchronize()
    assert seen.tolist() == [1, 2, 3]
    assert bufs["ids"][:3].tolist() == [7, 8, 9] and bufs["table"][0, 0].item() == 5
