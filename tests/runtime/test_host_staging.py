"""HostStaging: a step's inputs written through persistent host mirrors into packed device
buffers, by one kernel reading the mirrors (or one copy per dtype), with token placeholders
filled in on the device."""

from __future__ import annotations

import pytest
import torch

from atom.engine import host_staging
from atom.engine.host_staging import HostStaging, fill_placeholders

CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs CUDA (pinned mirrors, staging kernel)")


def _staging(device: str) -> HostStaging:
    return HostStaging({"ids": (torch.long, (8,), 0), "slots": (torch.long, (8,), -1),
                        "lens": (torch.int32, (4,), 0), "table": (torch.int32, (4, 6), 0)},
                       torch.device(device))


def _write(staging: HostStaging, ids: list[int], rows: list[list[int]],
           tokens: torch.Tensor | None = None) -> torch.Tensor:
    staging.begin()
    out = staging.put("ids", ids)
    staging.put("slots", [-1] * len(ids))
    staging.put("lens", [len(r) for r in rows])
    staging.put_rows("table", rows)
    staging.flush(gather=("ids", tokens) if tokens is not None else None)
    return out


# (device, whether the staging kernel reads the mirrors; False: copy-engine copies)
PATHS = [
    pytest.param("cpu", False, id="cpu"),
    pytest.param("cuda", True, id="cuda-kernel", marks=[pytest.mark.gpu, CUDA]),
    pytest.param("cuda", False, id="cuda-copies", marks=[pytest.mark.gpu, CUDA]),
]


@pytest.mark.parametrize(("device", "kernel"), PATHS)
def test_put_writes_the_front_and_the_rest_keeps_earlier_values(
        device: str, kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_staging, "DEVICE_READS_MIRRORS", kernel)
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


@pytest.mark.parametrize(("device", "kernel"), PATHS)
def test_placeholders_take_the_sampled_tokens_on_the_device(
        device: str, kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """-(j + 1) in the token field becomes tokens[j], in any row order; other fields' negative
    values (padding slots) and the field's tail are left alone."""
    monkeypatch.setattr(host_staging, "DEVICE_READS_MIRRORS", kernel)
    staging = _staging(device)
    tokens = torch.tensor([101, 102, 103], device=device)
    _write(staging, [9, 9, 9, 9, 9], [[1]])
    out = _write(staging, [-3, 7, -1], [[2]], tokens)
    assert out.tolist() == [103, 7, 101]
    assert staging.buffers["ids"].tolist()[3:5] == [9, 9]
    assert staging.buffers["slots"][:3].tolist() == [-1, -1, -1]
    # the host mirror keeps the placeholders: only the device holds the tokens
    assert staging._arrays["ids"][:3].tolist() == ([103, 7, 101] if device == "cpu"
                                                   else [-3, 7, -1])
    out = _write(staging, [-2, -2], [], tokens)  # rows may share a source
    assert out.tolist() == [102, 102]


@pytest.mark.parametrize(("device", "kernel"), PATHS)
def test_a_table_row_moves_only_its_written_front_through_the_kernel(
        device: str, kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel reads each written row's front (as many values as the longest row written):
    a value past it in the mirror does not reach the device. The copy engine moves whole
    rows; on the CPU the mirror is the buffer."""
    monkeypatch.setattr(host_staging, "DEVICE_READS_MIRRORS", kernel)
    staging = _staging(device)
    _write(staging, [1], [[1, 2, 3, 4, 5, 6], [8, 9]])
    staging._arrays["table"][0, 4] = 99  # past the next step's front, not put
    _write(staging, [1], [[7], [6, 5]])
    table = staging.buffers["table"][:2].tolist()
    assert table[0][:4] == [7, 2, 3, 4] and table[1][:2] == [6, 5]
    assert table[0][4] == (5 if kernel else 99)


@pytest.mark.parametrize(("device", "kernel"), PATHS)
def test_keyed_rows_follow_their_keys_whatever_row_they_land_in(
        device: str, kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """put_rows with keys (a step's request ids) converts a key's row only when it changed,
    then gathers every row: rows that move up, grow, come back with other values, repeat a
    key, or outlive the store's room all land as given."""
    monkeypatch.setattr(host_staging, "DEVICE_READS_MIRRORS", kernel)
    staging = _staging(device)
    table = staging.buffers["table"]

    def put(rows: list[list[int]], keys: list[str]) -> list[list[int]]:
        staging.begin()
        staging.put_rows("table", rows, keys=keys)
        staging.flush()
        return [table[i, : len(r)].tolist() for i, r in enumerate(rows)]

    assert put([[1, 2], [3], [4, 5, 6]], ["a", "b", "c"]) == [[1, 2], [3], [4, 5, 6]]
    assert put([[3, 7], [4, 5, 6]], ["b", "c"]) == [[3, 7], [4, 5, 6]]  # "a" ended: all move up
    assert put([[9], [3, 7]], ["a", "b"]) == [[9], [3, 7]]  # "a" again, with other blocks
    assert put([[5], [6, 6]], ["x", "x"]) == [[5], [6, 6]]  # a repeated key: written row by row
    for step in range(6):  # more keys than the store holds (twice the field's 4 rows)
        rows = [[step * 10 + i] * (i + 1) for i in range(4)]
        assert put(rows, [f"k{step}-{i}" for i in range(4)]) == rows


def test_fill_placeholders_leaves_ids_without_any() -> None:
    ids = torch.tensor([4, 0, 5])
    fill_placeholders(ids, torch.tensor([7]))
    assert ids.tolist() == [4, 0, 5]
    fill_placeholders(ids, torch.empty(0, dtype=torch.long))  # nothing sampled: nothing to fill
    assert ids.tolist() == [4, 0, 5]


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("kernel", [True, False])
def test_a_mirror_is_not_rewritten_before_its_copy_ran(
        kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step's staging waits behind a long kernel; the second step's begin() must
    wait for it before overwriting the host mirror, or the device would receive the second
    step's values in the first step's place."""
    monkeypatch.setattr(host_staging, "DEVICE_READS_MIRRORS", kernel)
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
