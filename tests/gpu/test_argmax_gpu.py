"""The one-launch row argmax (atom.kernels.triton_argmax) against torch.argmax: the same
first index of the maximum, for vocabularies on and off the slice width, ties inside and
across slices, bf16 and fp32, and from a CUDA graph; the copy into pinned host memory, and
the arrival counters left at zero."""

from __future__ import annotations

import pytest
import torch

from atom.kernels import triton_argmax
from atom.kernels.triton_argmax import CHUNK, argmax_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton kernels)"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("vocab", [128256, 151936, CHUNK, CHUNK + 1, 7])
def test_matches_torch_argmax(dtype: torch.dtype, rows: int, vocab: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=gen, device="cuda").to(dtype)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert triton_argmax.ARRIVALS.held(x.device), "no arrival counters allocated"
    assert not triton_argmax.ARRIVALS.armed(x.device), "counters left armed"


def test_writes_the_host_copy() -> None:
    x = torch.randn(8, 128256, device="cuda").bfloat16()
    host = torch.full((8,), -1, dtype=torch.long, pin_memory=True)
    out = argmax_rows(x, host)
    torch.cuda.synchronize()
    assert torch.equal(host, out.cpu()) and torch.equal(out, x.argmax(dim=-1))
    with pytest.raises(ValueError, match="pinned"):
        argmax_rows(x, torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[8\]"):
        argmax_rows(x, torch.zeros(9, dtype=torch.long, pin_memory=True))


def test_ties_resolve_to_the_first_index() -> None:
    x = torch.zeros(4, 3 * CHUNK + 5, dtype=torch.bfloat16, device="cuda")
    x[0, [CHUNK + 3, 2 * CHUNK + 1]] = 5.0  # across slices
    x[1, [17, 18, 3 * CHUNK + 4]] = 5.0  # inside the first slice and in the last
    x[2, :] = -1.0  # the whole row ties
    x[3, -1] = 2.0  # in the short last slice
    assert argmax_rows(x).tolist() == [CHUNK + 3, 17, 0, 3 * CHUNK + 4]
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_rows_of_a_wider_buffer_and_a_graph_replay() -> None:
    """Logits are the first rows of a larger buffer: row stride is the buffer's."""
    buf = torch.randn(16, 50000, device="cuda").bfloat16()
    view = buf[:5]
    out = argmax_rows(view)
    assert torch.equal(out, view.argmax(dim=-1))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = argmax_rows(view)
    buf.copy_(torch.randn(16, 50000, device="cuda").bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, view.argmax(dim=-1))


def test_refuses_a_strided_last_dimension() -> None:
    x = torch.randn(64, 4, device="cuda").t()
    with pytest.raises(ValueError, match="contiguous"):
        argmax_rows(x)


def test_launched_early_after_the_logits_projection() -> None:
    """On sm_90 the argmax starts beside the projection that writes its logits (which releases
    its dependents as it starts): it must still read only the finished logits, step after
    step, with the buffer's old values different each time."""
    from atom.kernels.triton_norm_gemv import gemv

    gen = torch.Generator(device="cuda").manual_seed(3)
    weight = (torch.randn(128256, 2048, generator=gen, device="cuda") * 2048 ** -0.5).bfloat16()
    logits = torch.empty(8, 128256, dtype=torch.bfloat16, device="cuda")
    for rows in (1, 8, 1, 8):
        hidden = torch.randn(rows, 2048, generator=gen, device="cuda").bfloat16()
        logits.fill_(float("-inf"))
        logits[:rows, 0] = 1e4  # a stale read would pick token 0
        gemv(hidden, weight, None, out=logits[:rows])
        got = argmax_rows(logits[:rows])
        assert torch.equal(got, logits[:rows].argmax(dim=-1)), rows
