"""The Triton attention kernels' logic on the CPU, through Triton's interpreter (TRITON_INTERPRET=1).

Triton reads the interpreter switch when it is first imported (its own library kernels are
decorated then), so each case runs this file as a fresh subprocess with the switch on and
compares the kernels with the torch reference on a random paged layout.
"""

from __future__ import annotations

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
    # q and k handed over unrotated: the KV store and the attention kernels rotate them.
    "prefill-rope-gqa2-d16": ("prefill", 4, 2, 16),
    "decode-rope-split3-gqa2-d32": ("decode3", 4, 2, 32),
    # The decode kernel writes this step's keys and values itself (one launch per layer).
    "decode-store-gqa2-d16": ("decode", 4, 2, 16),
    "decode-store-rope-split3-gqa3-d32": ("decode3", 6, 2, 32),
    "decode-store-rope-split4-mha-d16": ("decode4", 4, 4, 16),
    # Two query rows per sequence (a drafter's bucket): the KV-store kernel writes both rows'
    # keys before the decode kernel reads them, however the caller hands them over.
    "decode-q2-store-rope-split3-gqa2-d16": ("decode3", 4, 2, 16),
    # Split-KV prefill (atom.kernels.triton_prefill_split): chunks of 1, 16 and 64 rows over
    # contexts of 16 to 4096 tokens in one batch, each row block's keys split N ways ("auto":
    # the count the launcher picks from the step's longest context).
    "split3-gqa4-d32": ("split3", 8, 2, 32),
    "split8-gqa3-d16": ("split8", 6, 2, 16),
    "split64-mha-d16": ("split64", 2, 2, 16),
    "split5-gqa8-d24": ("split5", 8, 1, 24),
    "split8-rope-gqa4-d32": ("split8", 8, 2, 32),
    "splitauto-gqa4-d64": ("splitauto", 8, 2, 64),
    # Random layouts (seeded by the case): 1, 16 or 64 rows over contexts of 16..4096.
    "split-random1-gqa4-d16": ("splitrandom", 8, 2, 16),
    "split-random2-rope-gqa2-d32": ("splitrandom", 4, 2, 32),
}
# Sequences of a split case: (query rows, context) each, a whole 16-token prompt among them.
SPLIT_LAYOUT = [(16, 4096), (1, 2049), (64, 1000), (16, 16), (64, 64), (1, 37)]


def _split_layout(name: str) -> list[tuple[int, int]]:
    if "random" not in name:
        return SPLIT_LAYOUT
    import random

    rng = random.Random(name)
    layout = []
    for _ in range(rng.randint(3, 6)):
        q = rng.choice([1, 16, 64])
        layout.append((q, rng.randint(max(q, 16), 4096)))
    return layout


def _numpy2_scalar_fix() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and int()s them for loop
    bounds, which numpy >= 2.4 refuses; index the single element instead (test-only patch)."""
    import triton.runtime.interpreter as ti

    orig = ti._patch_lang_tensor

    def patched(tensor, scope) -> None:
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    ti._patch_lang_tensor = patched


def _check_cache(kc, vc, kc_ref, vc_ref, rope) -> None:
    import torch

    torch.testing.assert_close(kc, kc_ref, rtol=0, atol=1e-6 if rope else 0)
    torch.testing.assert_close(vc, vc_ref, rtol=0, atol=0)


def _run_split(b, kind: str, heads: int, kv_heads: int, kc, vc, out, rope) -> None:
    """The split-KV prefill through prefill_attention_triton, as the attention op calls it."""
    import atom.kernels.triton_attention as tk
    import atom.kernels.triton_prefill_split as split_kv

    max_k = int(b.context_lens.max())
    splits = {"splitauto": None, "splitrandom": 7}.get(kind) if kind[5:].isalpha() else int(kind[5:])
    if splits is None:  # the launcher's own choice for this step takes the split kernel
        chosen = split_kv.prefill_num_splits(b.num_seqs + 1, b.max_seqlen_q, max_k, heads,
                                             kv_heads, b.k_cache.shape[3], b.q.dtype)
        assert chosen > 1, chosen
    calls = []
    real = split_kv.prefill_split_attention_triton

    def spy(*args, **kwargs):
        calls.append(args[11])
        return real(*args, **kwargs)

    split_kv.prefill_split_attention_triton = spy
    out[b.num_rows:] = 0
    tk.prefill_attention_triton(b.q, kc, vc, out, b.cu_seqlens_q, b.context_lens, b.block_tables,
                                0.25, heads, b.num_seqs + 1, b.max_seqlen_q, rope=rope,
                                max_seqlen_k=max_k, num_splits=splits)
    assert len(calls) == 1 and calls[0] > 1, calls


def _run_case(name: str) -> None:
    import torch

    import atom.kernels.triton_attention as tk
    from atom.kernels.testing import paged_reference, random_paged_batch

    kind, heads, kv_heads, dim = CASES[name]
    if kind == "prefill":
        # A whole prompt, a chunk continuing a cached context, a single row, padding rows/seqs.
        b = random_paged_batch(q_lens=[19, 5, 1, 33], ctx_lens=[19, 40, 7, 33], num_heads=heads,
                               num_kv_heads=kv_heads, head_dim=dim, pad_rows=3, pad_seqs=1, seed=heads)
    elif kind.startswith("split"):
        layout = _split_layout(name)
        b = random_paged_batch(q_lens=[q for q, _ in layout], ctx_lens=[c for _, c in layout],
                               num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, pad_rows=3,
                               pad_seqs=1, num_blocks=sum(c // 16 + 1 for _, c in layout),
                               seed=dim)
    elif "-q2-" in name:
        b = random_paged_batch(q_lens=[2, 2, 2], ctx_lens=[2, 70, 250], num_heads=heads,
                               num_kv_heads=kv_heads, head_dim=dim, max_blocks=16, seed=dim)
    else:
        # Padded decode: 2 extra sequences of context 0 must come out as zeros.
        # A table of 4 key tiles of 64; rows of 1 to 4 tiles, dealt to the splits (3 splits:
        # the 4-tile row gives two to each of the first two).
        b = random_paged_batch(q_lens=[1, 1, 1, 1], ctx_lens=[1, 16, 130, 250], num_heads=heads,
                               num_kv_heads=kv_heads, head_dim=dim, pad_rows=2, pad_seqs=2,
                               max_blocks=16, seed=dim)
    positions = None
    if "rope" in name:
        # Each row's position in its sequence (padding rows: 0), and the model's tables.
        positions = torch.zeros(b.q.shape[0], dtype=torch.long)
        cu, ctx = b.cu_seqlens_q.tolist(), b.context_lens.tolist()
        for i in range(b.num_seqs):
            q_len = cu[i + 1] - cu[i]
            positions[cu[i]:cu[i + 1]] = torch.arange(ctx[i] - q_len, ctx[i])
    ref, kc_ref, vc_ref, rope = paged_reference(b, heads, 0.25, positions,
                                                max_positions=int(b.context_lens.max()))

    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    fused_store = "store" in name
    if not fused_store:
        tk.store_kv_triton(b.k, b.v, kc, vc, b.slot_mapping, rope)
        _check_cache(kc, vc, kc_ref, vc_ref, rope)
    out = torch.full_like(b.q, float("nan"))
    if kind == "prefill":
        out[b.num_rows:] = 0  # the op zeroes padding rows itself before the prefill kernel
        tk.prefill_attention_triton(b.q, kc, vc, out, b.cu_seqlens_q, b.context_lens, b.block_tables,
                                    0.25, heads, b.num_seqs + 1, b.max_seqlen_q, block_m=16,
                                    rope=rope)
    elif kind.startswith("split"):
        _run_split(b, kind, heads, kv_heads, kc, vc, out, rope)
    else:
        splits = int(kind[6:] or 1)
        new_kv = tk.StepKV(b.k, b.v, b.slot_mapping) if fused_store else None
        tk.decode_attention_triton(b.q, kc, vc, out, b.context_lens, b.block_tables, 0.25, heads,
                                   q_len=b.max_seqlen_q, num_splits=splits, rope=rope,
                                   new_kv=new_kv)
        assert (out[b.num_rows:] == 0).all(), "padded decode rows must be zero"
        if fused_store:
            _check_cache(kc, vc, kc_ref, vc_ref, rope)
        if splits > 1:  # every combining program re-armed its arrival counter
            cpu = torch.device("cpu")
            assert tk.ARRIVALS.held(cpu) and not tk.ARRIVALS.armed(cpu)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


# The fast tier keeps one interpreted case of plain prefill, of decode storing its keys and of
# split decode; the rest (10-95 s each under the interpreter, split prefill at 20-200 s) repeat
# those kernels and run in the full suite.
FAST_CASES = {"prefill-rope-gqa2-d16", "decode-store-gqa2-d16", "decode-split3-gqa2-d16"}


@pytest.mark.parametrize("name", [
    name if name in FAST_CASES else pytest.param(name, marks=pytest.mark.slow)
    for name in sorted(CASES)
])
def test_triton_kernel_in_interpreter(name: str) -> None:
    from atom.kernels.testing import run_interpreter_case

    run_interpreter_case(__file__, name)


def _aot_cases():
    """(kernel name, signature, constexprs) covering bf16/fp32, split/unsplit decode, the
    decode kernel with and without its own KV store, and the split-KV prefill's two kernels."""
    import torch

    import atom.kernels.triton_prefill_split as split_kv

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}
    cases = []
    for dt in ("bf16", "fp32"):
        cache = {n: f"*{dt}" for n in ("k_cache_ptr", "v_cache_ptr")}
        rope = {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
        use_rope = dt == "bf16"  # both sides of the rotary switch
        cases.append(("_store_kv_kernel",
                      {"k_ptr": f"*{dt}", "v_ptr": f"*{dt}", **cache, "slot_ptr": "*i64", **rope,
                       "stride_k": "i32", "stride_v": "i32", "ROW": "constexpr", "BLOCK": "constexpr",
                       "HEAD_DIM": "constexpr", "ROPE": "constexpr"},
                      {"ROW": 512, "BLOCK": 512, "HEAD_DIM": 64, "ROPE": use_rope}))
        cases.append(("_prefill_kernel",
                      {"q_ptr": f"*{dt}", **cache, "out_ptr": f"*{dt}", "cu_q_ptr": "*i32",
                       "ctx_ptr": "*i32", "bt_ptr": "*i32", **rope, "scale": "fp32",
                       "stride_q": "i32", "stride_o": "i32", "stride_bt": "i32",
                       "NUM_KV_HEADS": "constexpr", "GROUP": "constexpr", "HEAD_DIM": "constexpr",
                       "BLOCK_D": "constexpr", "BLOCK_M": "constexpr", "BLOCK_SIZE": "constexpr",
                       "PRECISION": "constexpr", "ROPE": "constexpr"},
                      {"NUM_KV_HEADS": 8, "GROUP": 4, "HEAD_DIM": 64, "BLOCK_D": 64, "BLOCK_M": 64,
                       "BLOCK_SIZE": 16, "PRECISION": "ieee" if dt == "fp32" else None,
                       "ROPE": use_rope}))
        split_consts = {"NUM_KV_HEADS": 8, "GROUP": 4, "GROUP_P2": 4, "HEAD_DIM": 64,
                        "BLOCK_D": 64, "BLOCK_Q": 16, "TILE_N": 64, "NUM_SPLITS": 16}
        cases.append(("_prefill_split_kernel",
                      {"q_ptr": f"*{dt}", **cache, "out_ptr": f"*{dt}", "part_o_ptr": "*fp32",
                       "part_ml_ptr": "*fp32", "cu_q_ptr": "*i32", "ctx_ptr": "*i32",
                       "bt_ptr": "*i32", **rope, "scale": "fp32", "stride_q": "i32",
                       "stride_o": "i32", "stride_bt": "i32", "num_mblocks": "i32",
                       **dict.fromkeys(split_consts, "constexpr"), "BLOCK_SIZE": "constexpr",
                       "PRECISION": "constexpr", "ROPE": "constexpr"},
                      {**split_consts, "BLOCK_Q": split_kv.block_q(16, 4, 64, torch_dtype[dt]),
                       "BLOCK_SIZE": 16,
                       "PRECISION": "ieee" if dt == "fp32" else None, "ROPE": use_rope}))
        cases.append(("_prefill_combine_kernel",
                      {"out_ptr": f"*{dt}", "part_o_ptr": "*fp32", "part_ml_ptr": "*fp32",
                       "cu_q_ptr": "*i32", "ctx_ptr": "*i32", "stride_o": "i32",
                       **dict.fromkeys(split_consts, "constexpr"), "CHUNK": "constexpr"},
                      {**split_consts, "CHUNK": 8}))
        for splits, store in ((1, False), (8, True), (8, False)):
            cases.append(("_decode_kernel",
                          {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}", **cache,
                           "out_ptr": f"*{dt}", "ctx_ptr": "*i32", "bt_ptr": "*i32",
                           "slot_ptr": "*i64", "part_o_ptr": "*fp32", "part_ml_ptr": "*fp32",
                           "count_ptr": "*i32", **rope, "scale": "fp32", "stride_q": "i32",
                           "stride_k": "i32", "stride_v": "i32", "stride_o": "i32",
                           "stride_bt": "i32", "NUM_KV_HEADS": "constexpr", "GROUP": "constexpr",
                           "BLOCK_H": "constexpr", "GROUP_P2": "constexpr", "HEAD_DIM": "constexpr",
                           "BLOCK_D": "constexpr", "BLOCK_SIZE": "constexpr", "TILE_N": "constexpr",
                           "Q_LEN": "constexpr", "NUM_SPLITS": "constexpr",
                           "COMBINE_CHUNK": "constexpr", "PRECISION": "constexpr",
                           "ROPE": "constexpr", "STORE": "constexpr", "PDL": "constexpr"},
                          {"NUM_KV_HEADS": 8, "GROUP": 4, "BLOCK_H": 16, "GROUP_P2": 4,
                           "HEAD_DIM": 64, "BLOCK_D": 64, "BLOCK_SIZE": 16, "TILE_N": 64,
                           "Q_LEN": 1, "NUM_SPLITS": splits, "COMBINE_CHUNK": 8,
                           "PRECISION": "ieee" if dt == "fp32" else None, "ROPE": use_rope,
                           "STORE": store, "PDL": store}))
    return cases


@pytest.mark.slow  # 40 s of ahead-of-time compiles; the interpreted cases stay fast
def test_kernels_compile_for_hopper_without_a_gpu() -> None:
    """Ahead-of-time compile to sm_90 PTX and SASS (Triton's bundled ptxas): catches typing
    and lowering errors that the interpreter does not see, and shared memory an SM lacks."""
    pytest.importorskip("triton")
    import atom.kernels.triton_attention as tk
    import atom.kernels.triton_prefill_split as split_kv
    from atom.kernels.testing import compile_for_hopper

    for name, sig, consts in _aot_cases():
        compile_for_hopper(getattr(tk if hasattr(tk, name) else split_kv, name), sig, consts)


def test_split_prefill_kernel_keeps_its_registers() -> None:
    """The split-KV prefill kernel's row blocks fit sm_90's registers in bf16 and fp32 (the
    exact fp32 dot, no tensor cores, takes a quarter of the rows: at 64 it spilled 14 KB)."""
    pytest.importorskip("triton")
    import atom.kernels.triton_prefill_split as split_kv
    from atom.kernels.testing import compile_for_hopper, hopper_registers

    for name, sig, consts in _aot_cases():
        if name == "_prefill_split_kernel":
            regs, spilled = hopper_registers(compile_for_hopper(split_kv._prefill_split_kernel,
                                                                sig, consts))
            assert spilled == 0 and regs <= 168, (consts, regs, spilled)


if __name__ == "__main__":
    _numpy2_scalar_fix()
    _run_case(sys.argv[1])
    print(f"ok {sys.argv[1]}")
