"""The Triton attention kernels' logic on the CPU, through Triton's interpreter (TRITON_INTERPRET=1).

Triton reads the interpreter switch when it is first imported (its own library kernels are
decorated then), so each case runs this file as a fresh subprocess with the switch on and
compares the kernels with the torch reference on a random paged layout.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CASES = {
    # name: (kind, heads, kv_heads, head_dim)
    "prefill-gqa2-d16": ("prefill", 4, 2, 16),
    "prefill-mha-d32": ("prefill", 4, 4, 32),
    "prefill-gqa8-d24": ("prefill", 8, 1, 24),
    "decode-gqa2-d16": ("decode", 4, 2, 16),
    "decode-gqa3-d32": ("decode", 6, 2, 32),
    "decode-mha-d16": ("decode", 8, 8, 16),
    "decode-split3-gqa2-d16": ("decode3", 4, 2, 16),  # flash-decoding: blocks split 3 ways
    "decode-split4-gqa3-d32": ("decode4", 6, 2, 32),
}


def _numpy2_scalar_fix() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and int()s them for loop
    bounds, which numpy >= 2.4 refuses; index the single element instead (test-only patch)."""
    import triton.runtime.interpreter as ti

    orig = ti._patch_lang_tensor

    def patched(tensor, scope) -> None:
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    ti._patch_lang_tensor = patched


def _run_case(name: str) -> None:
    import torch

    import atom.kernels.triton_attention as tk
    from atom.kernels.paged_attention_torch import paged_attention_torch, write_kv_torch
    from atom.kernels.testing import random_paged_batch

    kind, heads, kv_heads, dim = CASES[name]
    if kind == "prefill":
        # A whole prompt, a chunk continuing a cached context, a single row, padding rows/seqs.
        b = random_paged_batch(q_lens=[19, 5, 1, 33], ctx_lens=[19, 40, 7, 33], num_heads=heads,
                               num_kv_heads=kv_heads, head_dim=dim, pad_rows=3, pad_seqs=1, seed=heads)
    else:
        # Padded decode: 2 extra sequences of context 0 must come out as zeros.
        # A table of 4 key tiles of 64; rows of 1 to 4 tiles, dealt to the splits (3 splits:
        # the 4-tile row gives two to each of the first two).
        b = random_paged_batch(q_lens=[1, 1, 1, 1], ctx_lens=[1, 16, 130, 250], num_heads=heads,
                               num_kv_heads=kv_heads, head_dim=dim, pad_rows=2, pad_seqs=2,
                               max_blocks=16, seed=dim)
    kc_ref, vc_ref = b.k_cache.clone(), b.v_cache.clone()
    write_kv_torch(b.k, b.v, kc_ref, vc_ref, b.slot_mapping)
    ref = torch.full_like(b.q, float("nan"))
    paged_attention_torch(b.q, kc_ref, vc_ref, ref, b.cu_seqlens_q, b.context_lens, b.block_tables,
                          0.25, heads)

    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    tk.store_kv_triton(b.k, b.v, kc, vc, b.slot_mapping)
    torch.testing.assert_close(kc, kc_ref, rtol=0, atol=0)
    torch.testing.assert_close(vc, vc_ref, rtol=0, atol=0)
    out = torch.full_like(b.q, float("nan"))
    if kind == "prefill":
        out[b.num_rows:] = 0  # the op zeroes padding rows itself before the prefill kernel
        tk.prefill_attention_triton(b.q, kc, vc, out, b.cu_seqlens_q, b.context_lens, b.block_tables,
                                    0.25, heads, b.num_seqs + 1, b.max_seqlen_q, block_m=16)
    else:
        splits = int(kind[6:] or 1)
        tk.decode_attention_triton(b.q, kc, vc, out, b.context_lens, b.block_tables, 0.25, heads,
                                   num_splits=splits)
        assert (out[b.num_rows:] == 0).all(), "padded decode rows must be zero"
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_kernel_in_interpreter(name: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, name], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"ok {name}" in proc.stdout


def _aot_cases():
    """(kernel name, signature, constexprs) covering bf16/fp32 and split/unsplit decode."""
    cases = []
    for dt in ("bf16", "fp32"):
        cache = {n: f"*{dt}" for n in ("k_cache_ptr", "v_cache_ptr")}
        cases.append(("_store_kv_kernel",
                      {"k_ptr": f"*{dt}", "v_ptr": f"*{dt}", **cache, "slot_ptr": "*i64",
                       "stride_k": "i32", "stride_v": "i32", "ROW": "constexpr", "BLOCK": "constexpr"},
                      {"ROW": 512, "BLOCK": 512}))
        cases.append(("_prefill_kernel",
                      {"q_ptr": f"*{dt}", **cache, "out_ptr": f"*{dt}", "cu_q_ptr": "*i32",
                       "ctx_ptr": "*i32", "bt_ptr": "*i32", "scale": "fp32", "stride_q": "i32",
                       "stride_o": "i32", "stride_bt": "i32", "NUM_KV_HEADS": "constexpr",
                       "GROUP": "constexpr", "HEAD_DIM": "constexpr", "BLOCK_D": "constexpr",
                       "BLOCK_M": "constexpr", "BLOCK_SIZE": "constexpr", "PRECISION": "constexpr"},
                      {"NUM_KV_HEADS": 8, "GROUP": 4, "HEAD_DIM": 64, "BLOCK_D": 64, "BLOCK_M": 64,
                       "BLOCK_SIZE": 16, "PRECISION": "ieee" if dt == "fp32" else None}))
        for splits in (1, 8):
            cases.append(("_decode_kernel",
                          {"q_ptr": f"*{dt}", **cache, "out_ptr": f"*{dt}", "ctx_ptr": "*i32",
                           "bt_ptr": "*i32", "part_o_ptr": "*fp32", "part_ml_ptr": "*fp32",
                           "scale": "fp32", "stride_q": "i32", "stride_o": "i32", "stride_bt": "i32",
                           "NUM_KV_HEADS": "constexpr", "GROUP": "constexpr",
                           "BLOCK_H": "constexpr", "HEAD_DIM": "constexpr", "BLOCK_D": "constexpr",
                           "BLOCK_SIZE": "constexpr", "TILE_N": "constexpr", "Q_LEN": "constexpr",
                           "NUM_SPLITS": "constexpr", "PRECISION": "constexpr"},
                          {"NUM_KV_HEADS": 8, "GROUP": 4, "BLOCK_H": 16, "HEAD_DIM": 64, "BLOCK_D": 64,
                           "BLOCK_SIZE": 16, "TILE_N": 64, "Q_LEN": 1, "NUM_SPLITS": splits,
                           "PRECISION": "ieee" if dt == "fp32" else None}))
        cases.append(("_decode_reduce_kernel",
                      {"out_ptr": f"*{dt}", "part_o_ptr": "*fp32", "part_ml_ptr": "*fp32",
                       "stride_o": "i32", "NUM_HEADS": "constexpr", "HEAD_DIM": "constexpr",
                       "BLOCK_D": "constexpr", "NUM_SPLITS": "constexpr", "SPLITS_P2": "constexpr"},
                      {"NUM_HEADS": 32, "HEAD_DIM": 64, "BLOCK_D": 64, "NUM_SPLITS": 8, "SPLITS_P2": 8}))
    return cases


def test_kernels_compile_for_hopper_without_a_gpu() -> None:
    """Ahead-of-time compile to sm_90 PTX and SASS (Triton's bundled ptxas): catches typing
    and lowering errors that the interpreter does not see, and shared memory an SM lacks."""
    pytest.importorskip("triton")
    import atom.kernels.triton_attention as tk
    from atom.kernels.testing import compile_for_hopper

    for name, sig, consts in _aot_cases():
        compile_for_hopper(getattr(tk, name), sig, consts)


if __name__ == "__main__":
    _numpy2_scalar_fix()
    _run_case(sys.argv[1])
    print(f"ok {sys.argv[1]}")
