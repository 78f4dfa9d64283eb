"""Real CUDA recordings of a closed-form toy (no model needed): breakable recording with live
metadata, breaks at the start/middle/end, interleaved buckets in the shared pool, nesting."""

from __future__ import annotations

import pytest
import torch
from torch.library import Library

from atom.compilation.custom_ops import direct_register_custom_op
from atom.cudagraph import region_graph as rg
from atom.utils.forward_context import AttentionMetaData, forward_context, get_forward_context

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

_lib = Library("atomcudagraphtest", "FRAGMENT")
_calls = {"n": 0}


@rg.eager_region
def _shift(h: torch.Tensor, out: torch.Tensor, layer_id: int) -> None:
    """out = h + live per-row value + layer_id; the host reads the live metadata object."""
    _calls["n"] += 1
    md = get_forward_context().attn_metadata
    n = md.num_rows  # a host value that changes per step: must not be baked in
    out[:n].copy_(h[:n] + md.slot_mapping[:n].to(h.dtype)[:, None] + layer_id)
    out[n:].zero_()


def _shift_fake(h: torch.Tensor, out: torch.Tensor, layer_id: int) -> None:
    return None


direct_register_custom_op("shift", _shift, mutates_args=["out"], fake_impl=_shift_fake,
                          target_lib=_lib, dispatch_key="CUDA")


def toy(x: torch.Tensor, layers: int, break_first: bool = False) -> torch.Tensor:
    if break_first:  # a break before any kernel: an empty first segment
        out0 = torch.empty_like(x)
        torch.ops.atomcudagraphtest.shift(x, out0, 100)
        x = out0
    for i in range(layers):
        h = x * 2
        out = torch.empty_like(h)
        torch.ops.atomcudagraphtest.shift(h, out, i)
        x = out
    return x * 3 + 19


def _md(slots: torch.Tensor, n: int) -> AttentionMetaData:
    return AttentionMetaData(slot_mapping=slots, num_rows=n)


@pytest.mark.parametrize("break_first", [False, True])
def test_breakable_recording_matches_eager_with_live_metadata(break_first: bool) -> None:
    dev = "cuda"
    layers = 4
    static_x = torch.zeros(8, 16, device=dev)
    static_out = torch.zeros(8, 16, device=dev)
    slots = torch.zeros(8, device=dev, dtype=torch.int64)
    with forward_context(attn_metadata=_md(slots, 8)):
        toy(static_x, layers, break_first)  # warm-up
        rec = rg.record(lambda x: toy(x, layers, break_first), (static_x,), breakable=True,
                        static_output=static_out)
    regions = layers + int(break_first)
    assert len(rec.segments) == regions + 1 and len(rec.regions) == regions
    for draw in range(5):
        n = (8, 3, 1, 6, 8)[draw]  # real rows change between replays
        x = torch.randn(8, 16, device=dev)
        live = torch.randint(0, 100, (8,), device=dev)
        _calls["n"] = 0
        with forward_context(attn_metadata=_md(live, n)):
            static_x.copy_(x)
            got = rec.replay().clone()
            want = toy(x, layers, break_first)
        assert _calls["n"] == 2 * regions  # once per region per replay (+ the eager ref)
        torch.testing.assert_close(got, want)


def test_interleaved_buckets_share_one_pool() -> None:
    dev = "cuda"
    layers = 3
    recs, inputs = {}, {}
    for n in (64, 8, 1):  # largest first: the smaller ones reuse its pool blocks
        inputs[n] = torch.zeros(n, 32, device=dev)
        slots = torch.zeros(n, device=dev, dtype=torch.int64)
        with forward_context(attn_metadata=_md(slots, n)):
            toy(inputs[n], layers)
            recs[n] = rg.record(lambda x: toy(x, layers), (inputs[n],), breakable=True)
    for step in range(12):
        n = (64, 1, 8, 1, 64, 8)[step % 6]
        x = torch.randn(n, 32, device=dev)
        live = torch.randint(-5, 50, (n,), device=dev)
        with forward_context(attn_metadata=_md(live, n)):
            inputs[n].copy_(x)
            got = recs[n].replay().clone()
            want = toy(x, layers)
        torch.testing.assert_close(got, want)


def test_req_graph_records_regions_inline() -> None:
    dev = "cuda"
    static_x = torch.zeros(4, 8, device=dev)
    slots = torch.zeros(4, device=dev, dtype=torch.int64)
    reqs = rg.ReqGraph()
    with forward_context(attn_metadata=_md(slots, 4)):
        toy(static_x, 2)
        reqs.record((4, 0), lambda x: toy(x, 2), (static_x,))
    assert len(reqs.graphs[(4, 0)].segments) == 1 and not reqs.graphs[(4, 0)].regions
    live = torch.tensor([3, 1, 4, 1], device=dev)
    x = torch.randn(4, 8, device=dev)
    _calls["n"] = 0
    with forward_context(attn_metadata=_md(live, 4)):
        got = reqs.replay((4, 0), (x,)).clone()  # live slots copied into the recorded ones
        assert _calls["n"] == 0  # captured inline: the Python region does not run
        want = toy(x, 2)
    torch.testing.assert_close(got, want)


def test_nested_capture_refused() -> None:
    g = torch.cuda.CUDAGraph()
    x = torch.zeros(4, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g.capture_begin(capture_error_mode="thread_local")
        try:
            with pytest.raises(RuntimeError, match="nested"):
                rg.record(lambda y: y * 2, (x,), breakable=True)
        finally:
            g.capture_end()
    torch.cuda.current_stream().wait_stream(s)


def test_pool_does_not_grow_per_bucket() -> None:
    """Smaller recordings reuse the largest one's blocks: region inputs are not held alive."""
    dev = "cuda"
    layers, width = 4, 256
    sizes = (4096, 2048, 1024)
    inputs = {n: torch.zeros(n, width, device=dev) for n in sizes}
    outputs = torch.zeros(sizes[0], width, device=dev)  # the runner's static outputs buffer
    mds = {n: _md(torch.zeros(n, device=dev, dtype=torch.int64), n) for n in sizes}
    for n in sizes:  # warm-up allocations stay in the general pool
        with forward_context(attn_metadata=mds[n]):
            toy(inputs[n], layers)
    torch.cuda.synchronize()
    r0 = torch.cuda.memory_reserved()
    recs = []
    for i, n in enumerate(sizes):
        with forward_context(attn_metadata=mds[n]):
            recs.append(rg.record(lambda x: toy(x, layers), (inputs[n],), breakable=True,
                                  static_output=outputs))
        if i == 0:
            r1 = torch.cuda.memory_reserved()
    r2 = torch.cuda.memory_reserved()
    largest = r1 - r0
    assert largest > 0
    assert r2 - r1 <= 0.25 * largest + (4 << 20), (r0, r1, r2)
    # and every recording still replays correctly from the shared blocks
    for n, rec in zip(sizes, recs, strict=True):
        x = torch.randn(n, width, device=dev)
        with forward_context(attn_metadata=mds[n]):
            inputs[n].copy_(x)
            got = rec.replay().clone()
            want = toy(x, layers)
        torch.testing.assert_close(got, want)
