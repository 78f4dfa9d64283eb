"""The Triton attention kernels on an FP8 KV cache (--kv-cache-dtype fp8): the KV store, the
tiled prefill, split decode storing its own keys, and the split-KV prefill, through Triton's
interpreter (TRITON_INTERPRET=1, a fresh process per case) against the torch path on the same
FP8 cache; and ahead-of-time sm_90 compiles of the bf16-query, FP8-cache kernels."""

from __future__ import annotations

import sys

import pytest

CASES = ("store-prefill", "decode-store-split3", "split-prefill")


def _run_case(name: str) -> None:
    import torch

    import atom.kernels.triton_attention as tk
    from atom.kernels.testing import paged_reference, random_paged_batch
    from atom.quantization.fp8 import FP8_DTYPE

    heads, kv_heads, dim = 4, 2, 16
    if name == "store-prefill":
        b = random_paged_batch(q_lens=[19, 5, 1, 33], ctx_lens=[19, 40, 7, 33], num_heads=heads,
                               num_kv_heads=kv_heads, head_dim=dim, pad_rows=3, pad_seqs=1,
                               seed=1)
    elif name == "split-prefill":
        b = random_paged_batch(q_lens=[16, 1, 64], ctx_lens=[600, 300, 64], num_heads=heads,
                               num_kv_heads=kv_heads, head_dim=dim, pad_rows=3, pad_seqs=1,
                               num_blocks=70, seed=2)
    else:
        b = random_paged_batch(q_lens=[1, 1, 1, 1], ctx_lens=[1, 16, 130, 250], num_heads=heads,
                               num_kv_heads=kv_heads, head_dim=dim, pad_rows=2, pad_seqs=2,
                               max_blocks=16, seed=3)
    # Keys and values FP8 holds exactly, of several magnitudes, some beyond FP8's range (they
    # clamp to +-448): the interpreter's own float-to-FP8 rounding drops the carry into the
    # exponent (1.96 -> 1.0, where hardware and torch give 2.0), so the inputs need none.
    b.k.copy_(b.k.to(FP8_DTYPE).float())
    b.v.copy_(b.v.to(FP8_DTYPE).float())
    b.k[:, :4] *= 2.0 ** 10
    b.v[::3] *= 2.0 ** -7
    b.k_cache, b.v_cache = b.k_cache.to(FP8_DTYPE), b.v_cache.to(FP8_DTYPE)
    ref, kc_ref, vc_ref, _ = paged_reference(b, heads, 0.25)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    out = torch.full_like(b.q, float("nan"))
    if name == "decode-store-split3":
        tk.decode_attention_triton(b.q, kc, vc, out, b.context_lens, b.block_tables, 0.25, heads,
                                   num_splits=3, new_kv=tk.StepKV(b.k, b.v, b.slot_mapping))
    else:
        tk.store_kv_triton(b.k, b.v, kc, vc, b.slot_mapping, None)
        out[b.num_rows:] = 0
        max_k = int(b.context_lens.max())
        tk.prefill_attention_triton(b.q, kc, vc, out, b.cu_seqlens_q, b.context_lens,
                                    b.block_tables, 0.25, heads, b.num_seqs + 1, b.max_seqlen_q,
                                    max_seqlen_k=max_k,
                                    num_splits=4 if name == "split-prefill" else 1)
    assert kc.dtype == FP8_DTYPE and torch.isfinite(kc.float()).all()
    # The interpreter flushes FP8 subnormals (|x| < 2^-6) to zero where torch rounds them:
    # the caches agree to the smallest subnormal step.
    torch.testing.assert_close(kc.float(), kc_ref.float(), rtol=0, atol=2.0 ** -9)
    torch.testing.assert_close(vc.float(), vc_ref.float(), rtol=0, atol=2.0 ** -9)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=5e-3)


@pytest.mark.parametrize("name", [
    name if name == "decode-store-split3" else pytest.param(name, marks=pytest.mark.slow)
    for name in CASES
])
def test_fp8_cache_kernels_in_interpreter(name: str) -> None:
    from atom.kernels.testing import run_interpreter_case

    run_interpreter_case(__file__, name)


@pytest.mark.slow  # ahead-of-time compiles, ~10 s each
def test_fp8_cache_kernels_compile_for_hopper_without_a_gpu() -> None:
    """bf16 queries over a float8_e4m3fn cache lower to sm_90 (the interpreter runs fp32)."""
    pytest.importorskip("triton")
    from test_model_attention_triton import _aot_cases

    import atom.kernels.triton_attention as tk
    import atom.kernels.triton_prefill_split as split_kv
    from atom.kernels.testing import compile_for_hopper

    for name, sig, consts in _aot_cases():
        if sig.get("q_ptr", sig.get("k_ptr")) != "*bf16" or "k_cache_ptr" not in sig:
            continue
        sig = {**sig, "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
        compile_for_hopper(getattr(tk if hasattr(tk, name) else split_kv, name), sig, consts)


if __name__ == "__main__":
    from test_model_attention_triton import _numpy2_scalar_fix

    _numpy2_scalar_fix()
    _run_case(sys.argv[1])
    print(f"ok {sys.argv[1]}")
