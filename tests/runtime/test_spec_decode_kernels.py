"""The decode kernels on a verify step's rows (atom.spec_decode.decoder), on the CPU through
Triton's interpreter: a request's k + 1 one-token rows share its block table, their keys are
stored first, then the decode kernel (alone or with the fused o_proj) attends with the split
count of the request count; each row's output equals the reference's and, bit for bit, that
of the row launched alone. The projections take a verify's rows in blocks of 16, each block
computed as a launch of those rows alone.

Each case runs this file as a fresh subprocess with TRITON_INTERPRET=1 (see
test_model_attention_triton.py for why)."""

from __future__ import annotations

import os
import sys

import pytest

CASES = {
    # name: (kind, request bases (cached keys before the verify), rows per request, splits)
    "decode-1x4-split3": ("decode", [37], 4, 3),
    "decode-2x3-split2": ("decode", [5, 70], 3, 2),
    "fused-1x4-split3": ("fused", [37], 4, 3),
    "fused-1x2-unsplit": ("fused", [16], 2, 1),
    # (kind, rows, plan rows, norm, gated, residual)
    "gemv-40-plan8-norm-gated": ("gemv", 40, 8, True, True, False),
    "gemv-24-plan1-residual": ("gemv", 24, 1, False, False, True),
}
HEADS, KV_HEADS, DIM, HIDDEN, BLOCK = 4, 2, 16, 40, 16


def _verify_layout(bases: list[int], q: int, seed: int):
    """A PagedBatch of len(bases) requests x q one-token rows at positions base .. base + q - 1,
    each request's rows sharing its (shuffled) block table."""
    import random

    import torch

    from atom.kernels.testing import PagedBatch

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    physical = list(range(64))
    rng.shuffle(physical)
    width = 8
    tables, slots, ctx, pos = [], [], [], []
    for base in bases:
        table = [physical.pop() for _ in range(-(-(base + q) // BLOCK))]
        for i in range(q):
            p = base + i
            tables.append(table + [0] * (width - len(table)))
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
            ctx.append(p + 1)
            pos.append(p)
    rows = len(slots)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    b = PagedBatch(
        q=rand(rows, HEADS * DIM),
        k=rand(rows, KV_HEADS * DIM),
        v=rand(rows, KV_HEADS * DIM),
        k_cache=rand(64, BLOCK, KV_HEADS, DIM),
        v_cache=rand(64, BLOCK, KV_HEADS, DIM),
        slot_mapping=torch.tensor(slots),
        cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        num_seqs=rows,
        num_rows=rows,
        max_seqlen_q=1,
    )
    return b, torch.tensor(pos)


def _attend(b, rope, splits: int, fused_proj, rows: slice):
    """The verify path of atom.layers.attention._attend on rows of b: store every row's key,
    then the decode launch (with its own store) over them; (output, projection or None)."""
    import torch

    import atom.kernels.triton_attention as tk
    import atom.kernels.triton_decode_o_proj as fused
    from atom.kernels.rotary import Rope

    q, k, v, slots = b.q[rows], b.k[rows], b.v[rows], b.slot_mapping[rows]
    r = Rope(rope.positions[rows], rope.cos, rope.sin)
    tk.store_kv_triton(k, v, b.k_cache, b.v_cache, slots, r)
    out = torch.full_like(q, float("nan"))
    new_kv = tk.StepKV(k, v, slots)
    args = (q, b.k_cache, b.v_cache, out, b.context_lens[rows], b.block_tables[rows], 0.25, HEADS)
    if fused_proj is None:
        tk.decode_attention_triton(*args, num_splits=splits, rope=r, new_kv=new_kv)
        return out, None
    weight, residual = fused_proj
    proj = torch.full((q.shape[0], HIDDEN), float("nan"))
    fused.decode_attention_o_proj_triton(
        *args, weight, None, residual[rows], proj, num_splits=splits, rope=r, new_kv=new_kv
    )
    return out, proj


def _run_attention(name: str) -> None:
    import torch

    from atom.kernels.testing import paged_reference
    from atom.layers.norm_linear import reference_projection

    kind, bases, q, splits = CASES[name]
    b, positions = _verify_layout(bases, q, seed=len(name))
    ref, kc_ref, vc_ref, rope = paged_reference(b, HEADS, 0.25, positions, max_positions=128)
    gen = torch.Generator().manual_seed(3)
    proj_args = None
    if kind == "fused":
        proj_args = (
            torch.randn(HIDDEN, HEADS * DIM, generator=gen) / 8,
            torch.randn(b.num_rows, HIDDEN, generator=gen),
        )
    k0, v0 = b.k_cache.clone(), b.v_cache.clone()
    out, proj = _attend(b, rope, splits, proj_args, slice(None))
    torch.testing.assert_close(b.k_cache, kc_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(b.v_cache, vc_ref, rtol=0, atol=0)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    if proj is not None:
        want = reference_projection(ref, proj_args[0], None, residual=proj_args[1])
        torch.testing.assert_close(proj, want, rtol=1e-4, atol=1e-4)
    # Row j launched alone, once the rows before it stored their keys: the same bits.
    for j in range(b.num_rows):
        b.k_cache.copy_(k0)
        b.v_cache.copy_(v0)
        first = j - j % q  # the request's first row
        if j > first:
            import atom.kernels.triton_attention as tk
            from atom.kernels.rotary import Rope

            tk.store_kv_triton(
                b.k[first:j],
                b.v[first:j],
                b.k_cache,
                b.v_cache,
                b.slot_mapping[first:j],
                Rope(rope.positions[first:j], rope.cos, rope.sin),
            )
        one, one_proj = _attend(b, rope, splits, proj_args, slice(j, j + 1))
        assert torch.equal(one[0], out[j]), (name, j)
        if proj is not None:
            assert torch.equal(one_proj[0], proj[j]), (name, j)


def _run_gemv(name: str) -> None:
    import torch

    import atom.kernels.triton_norm_gemv as kernels
    from atom.layers.norm_linear import reference_projection

    _, rows, plan, norm, gated, has_res = CASES[name]
    k, n = 96, 40
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen)
    weight = torch.randn(2 * n if gated else n, k, generator=gen) / k**0.5
    fused = dict(eps=1e-6, gated=gated, norm_weight=None, residual=None)
    if norm:
        fused["norm_weight"] = 1 + 0.1 * torch.randn(k, generator=gen)
    if has_res:
        fused["residual"] = torch.randn(rows, n, generator=gen)
    out = kernels.gemv(x, weight, None, plan_rows=plan, **fused)
    torch.testing.assert_close(
        out, reference_projection(x, weight, None, **fused), rtol=1e-4, atol=1e-4
    )
    for start in range(0, rows, 16):  # each block of 16 rows as a launch of its rows alone
        part = {**fused, "residual": None if not has_res else fused["residual"][start : start + 16]}
        alone = kernels.gemv(x[start : start + 16], weight, None, plan_rows=plan, **part)
        assert torch.equal(alone, out[start : start + 16]), (name, start)


@pytest.mark.parametrize("name", sorted(CASES))
def test_verify_rows_in_interpreter(name: str) -> None:
    from atom.kernels.testing import run_interpreter_case

    run_interpreter_case(__file__, name)


def test_launch_rows_and_verify_splits() -> None:
    """In a verify step the kernels launch for its requests: launch_rows and the decode split
    count are those of a plain decode step of that many rows."""
    import torch

    from atom.kernels.triton_attention import decode_num_splits
    from atom.layers.attention import Attention, _verify_splits
    from atom.utils.forward_context import AttentionMetaData, forward_context, launch_rows

    with forward_context(no_compile_layers={}):
        layer = Attention(32, 64, 8, 0.125, 0)
    layer.k_cache = torch.empty(5, 16, 8, 64)
    for q, rows in ((4, 4), (4, 32), (6, 48), (1, 8)):
        md = AttentionMetaData(
            max_seqlen_q=1,
            verify_rows=q,
            slot_mapping=torch.zeros(rows),
            block_tables=torch.zeros(rows, 256, dtype=torch.int32),
        )
        with forward_context(attn_metadata=md):
            assert launch_rows(rows) == rows // q
            assert launch_rows(rows - q) == rows // q - 1  # the real rows' logits
            want = decode_num_splits(rows // q, 8, 256 * 16 // 64) if q > 1 else None
            assert _verify_splits(layer, md) == want
    assert decode_num_splits(1, 8, 64) != decode_num_splits(4, 8, 64)  # rows set the splits


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    from test_model_attention_triton import _numpy2_scalar_fix

    _numpy2_scalar_fix()
    case = sys.argv[1]
    (_run_gemv if CASES[case][0] == "gemv" else _run_attention)(case)
    print(f"ok {case}")
