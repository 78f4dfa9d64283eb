"""Decode attention and o_proj in one launch (atom.kernels.triton_decode_o_proj), bf16 on CUDA,
against the two launches it replaces: the decode kernel, then the linear_add GEMV."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton kernels)"),
]

# (heads, kv heads, head dim, hidden): Llama-3.2-1B; a 128-wide head; Qwen2-0.5B (896: neither
# the projection's input nor its output a power of two).
SHAPES = [(32, 8, 64, 2048), (16, 8, 128, 3072), (14, 2, 64, 896)]


def _inputs(heads: int, kv_heads: int, dim: int, hidden: int, ctx: int, seed: int,
            bias: bool = False):
    """One decode row with ctx keys (0: the bucket's row is padding), o_proj weights and the
    residual stream."""
    from atom.kernels.testing import random_paged_batch

    b = random_paged_batch([1], [max(ctx, 1)], heads, kv_heads, dim, num_blocks=512,
                           max_blocks=256, dtype=torch.bfloat16, device="cuda", seed=seed)
    if ctx == 0:
        b.context_lens[0], b.slot_mapping[0] = 0, -1
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(hidden, heads * dim, generator=gen, device="cuda") / 16).to(torch.bfloat16)
    o_bias = torch.randn(hidden, generator=gen, device="cuda").to(torch.bfloat16) if bias else None
    res = torch.randn(1, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    return b, w, o_bias, res


def _unfused(b, w, o_bias, res, heads: int, scale: float, num_splits: int | None):
    from atom.kernels import triton_attention as tk
    from atom.kernels.triton_norm_gemv import gemv

    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    out = torch.empty_like(b.q)
    tk.decode_attention_triton(b.q, kc, vc, out, b.context_lens, b.block_tables, scale, heads,
                               num_splits=num_splits, new_kv=tk.StepKV(b.k, b.v, b.slot_mapping))
    return out, gemv(out, w, o_bias, residual=res), kc, vc


def _fused(b, w, o_bias, res, heads: int, scale: float, num_splits: int | None):
    from atom.kernels import triton_attention as tk
    from atom.kernels import triton_decode_o_proj as fused

    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    out = torch.full_like(b.q, float("nan"))
    proj = torch.full_like(res, float("nan"))
    fused.decode_attention_o_proj_triton(b.q, kc, vc, out, b.context_lens, b.block_tables, scale,
                                         heads, w, o_bias, res, proj, num_splits=num_splits,
                                         new_kv=tk.StepKV(b.k, b.v, b.slot_mapping))
    return out, proj, kc, vc


@pytest.mark.parametrize("num_splits", [None, 1, 128])  # 128: far more programs than fit
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("ctx", [0, 1, 300, 4096])
def test_fused_launch_matches_the_two_launches(shape: tuple[int, int, int, int], ctx: int,
                                               num_splits: int | None) -> None:
    from atom.kernels import triton_decode_o_proj as fused
    from atom.layers.norm_linear import reference_projection

    heads, kv_heads, dim, hidden = shape
    b, w, o_bias, res = _inputs(heads, kv_heads, dim, hidden, ctx, seed=ctx, bias=ctx % 2 == 0)
    scale = dim ** -0.5
    out_ref, proj_ref, kc_ref, vc_ref = _unfused(b, w, o_bias, res, heads, scale, num_splits)
    out, proj, kc, vc = _fused(b, w, o_bias, res, heads, scale, num_splits)
    torch.cuda.synchronize()
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    torch.testing.assert_close(out, out_ref, rtol=1e-2, atol=1e-2)
    if ctx == 0:
        assert (out == 0).all(), "a padding row attends to nothing"
    # Same rounding points as linear_add, a different summation order over K.
    torch.testing.assert_close(proj.float(), proj_ref.float(), rtol=2e-2, atol=3e-2)
    exact = reference_projection(out.float(), w.float(), None if o_bias is None else o_bias.float(),
                                 residual=res.float())
    torch.testing.assert_close(proj.float(), exact, rtol=2e-2, atol=3e-2)
    assert fused.SYNC_COUNTERS.held(out.device)
    assert not fused.SYNC_COUNTERS.armed(out.device), "counters left armed"


def test_fused_launch_is_graph_replayable() -> None:
    """Recorded once, replayed with new contexts, tables, keys and residuals in the same
    buffers: each replay matches the two-launch path, a second replay is bit-identical, and
    every counter is re-armed."""
    from atom.kernels import triton_attention as tk
    from atom.kernels import triton_decode_o_proj as fused

    heads, kv_heads, dim, hidden = SHAPES[0]
    b, w, _, res = _inputs(heads, kv_heads, dim, hidden, 10, seed=1)
    out = torch.zeros_like(b.q)
    proj = torch.zeros_like(res)

    def step() -> None:
        fused.decode_attention_o_proj_triton(b.q, b.k_cache, b.v_cache, out, b.context_lens,
                                             b.block_tables, 0.125, heads, w, None, res, proj,
                                             new_kv=tk.StepKV(b.k, b.v, b.slot_mapping))

    step()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for seed, ctx in enumerate([700, 1, 4000, 0, 65]):
        b2, _, _, res2 = _inputs(heads, kv_heads, dim, hidden, ctx, seed=10 + seed)
        for name in ("q", "k", "v", "slot_mapping", "context_lens", "block_tables", "k_cache",
                     "v_cache"):
            getattr(b, name).copy_(getattr(b2, name))
        res.copy_(res2)
        g.replay()
        first = proj.clone()
        g.replay()  # the cache now also holds this step's keys: same slots, same values
        torch.cuda.synchronize()
        assert torch.equal(proj, first)
        assert fused.SYNC_COUNTERS.held(out.device)
        assert not fused.SYNC_COUNTERS.armed(out.device), "counters left armed"
        out_ref, proj_ref, _, _ = _unfused(b2, w, None, res2, heads, 0.125, None)
        torch.testing.assert_close(out, out_ref, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(proj.float(), proj_ref.float(), rtol=2e-2, atol=3e-2)
