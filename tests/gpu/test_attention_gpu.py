"""Triton attention on CUDA against the torch reference, on random paged layouts (bf16, GQA)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton kernels)"),
]

LAYOUTS = [
    # (q_lens, ctx_lens): whole prompts, chunked prefill over cached context, long contexts
    ([7], [7]),
    ([128, 1, 33, 250], [128, 300, 97, 250]),
    ([16, 17], [1000, 17]),
]
HEADS = [(32, 8, 64), (16, 8, 128), (8, 8, 64), (14, 2, 64)]


def _ref(b, heads: int, scale: float):
    from atom.kernels.paged_attention_torch import paged_attention_torch, write_kv_torch

    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    write_kv_torch(b.k, b.v, kc, vc, b.slot_mapping)
    out = torch.empty_like(b.q)
    paged_attention_torch(b.q, kc, vc, out, b.cu_seqlens_q, b.context_lens, b.block_tables, scale, heads)
    return out, kc, vc


@pytest.mark.parametrize("heads,kv_heads,dim", HEADS)
@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
def test_prefill_bf16(heads: int, kv_heads: int, dim: int, layout: int) -> None:
    from atom.kernels import triton_attention as tk
    from atom.kernels.testing import random_paged_batch

    q_lens, ctx_lens = LAYOUTS[layout]
    b = random_paged_batch(q_lens, ctx_lens, heads, kv_heads, dim, num_blocks=256, pad_rows=5,
                           pad_seqs=2, dtype=torch.bfloat16, device="cuda", seed=layout)
    scale = dim ** -0.5
    ref, kc_ref, vc_ref = _ref(b, heads, scale)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    tk.store_kv_triton(b.k, b.v, kc, vc, b.slot_mapping)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    out = torch.full_like(b.q, float("nan"))
    out[b.num_rows:] = 0
    tk.prefill_attention_triton(b.q, kc, vc, out, b.cu_seqlens_q, b.context_lens, b.block_tables,
                                scale, heads, b.num_seqs + 2, b.max_seqlen_q)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fused_store", [False, True], ids=["store-first", "fused-store"])
@pytest.mark.parametrize("num_splits", [None, 1, 48])  # None: split-K chosen from the sizes
@pytest.mark.parametrize("heads,kv_heads,dim", HEADS)
@pytest.mark.parametrize("ctx_lens", [[1], [5, 16, 17, 300], [4096, 33, 1, 2048, 65]])
def test_decode_bf16_with_padding(heads: int, kv_heads: int, dim: int, ctx_lens: list[int],
                                  num_splits: int | None, fused_store: bool) -> None:
    """48 splits of a 4096-token row: the in-kernel combine reads its partials in 6 chunks."""
    from atom.kernels import triton_attention as tk
    from atom.kernels.testing import random_paged_batch

    b = random_paged_batch([1] * len(ctx_lens), ctx_lens, heads, kv_heads, dim, num_blocks=512,
                           max_blocks=256, pad_rows=3, pad_seqs=3, dtype=torch.bfloat16,
                           device="cuda", seed=len(ctx_lens))
    scale = dim ** -0.5
    ref, kc_ref, vc_ref = _ref(b, heads, scale)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    if not fused_store:
        tk.store_kv_triton(b.k, b.v, kc, vc, b.slot_mapping)
    out = torch.full_like(b.q, float("nan"))
    tk.decode_attention_triton(b.q, kc, vc, out, b.context_lens, b.block_tables, scale, heads,
                               num_splits=num_splits,
                               new_kv=tk.StepKV(b.k, b.v, b.slot_mapping) if fused_store else None)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    assert torch.isfinite(out).all()
    assert (out[b.num_rows:] == 0).all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_decode_kernel_is_graph_replayable() -> None:
    """Captured once (with its own KV store and the in-kernel split combine), replayed with new
    context lengths, block tables and keys in the same buffers: each replay matches the
    reference, a second replay of the same inputs is bit-identical whatever order the splits
    arrived in, and the arrival counters are re-armed after every launch."""
    from atom.kernels import triton_attention as tk
    from atom.kernels.paged_attention_torch import paged_attention_torch, write_kv_torch
    from atom.kernels.testing import random_paged_batch

    heads, kv_heads, dim = 32, 8, 64

    def batch(ctx_lens: list[int], seed: int):
        return random_paged_batch([1] * 4, ctx_lens, heads, kv_heads, dim, num_blocks=256,
                                  max_blocks=64, dtype=torch.bfloat16, device="cuda", seed=seed)

    b = batch([10, 20, 30, 40], 3)
    out = torch.zeros_like(b.q)

    def step() -> None:
        tk.decode_attention_triton(b.q, b.k_cache, b.v_cache, out, b.context_lens, b.block_tables,
                                   0.125, heads, new_kv=tk.StepKV(b.k, b.v, b.slot_mapping))

    step()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for seed, ctx_lens in enumerate([[700, 3, 129, 1000], [1, 1, 64, 65], [1024, 1000, 999, 17]]):
        b2 = batch(ctx_lens, 10 + seed)
        for name in ("q", "k", "v", "slot_mapping", "context_lens", "block_tables", "k_cache",
                     "v_cache"):
            getattr(b, name).copy_(getattr(b2, name))
        g.replay()
        first = out.clone()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first), "the split combine must not depend on arrival order"
        assert not any(c.any() for c in tk._COUNTERS[out.device]), "counters left armed"
        kc, vc = b2.k_cache.clone(), b2.v_cache.clone()
        write_kv_torch(b2.k, b2.v, kc, vc, b2.slot_mapping)
        assert torch.equal(b.k_cache, kc) and torch.equal(b.v_cache, vc)
        ref = torch.empty_like(out)
        paged_attention_torch(b2.q, kc, vc, ref, b2.cu_seqlens_q, b2.context_lens,
                              b2.block_tables, 0.125, heads)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
