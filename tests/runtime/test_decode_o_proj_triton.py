"""The fused decode attention + o_proj launch on the CPU, through Triton's interpreter.

The interpreter runs a launch's programs one after another in start order, so every
projection program finds the attention outputs already counted; the tickets, the counting and
the re-arming are the same code the GPU runs. Each case runs this file as a subprocess with
TRITON_INTERPRET=1 (see test_model_attention_triton.py for why).
"""

from __future__ import annotations

import sys

import pytest

from atom.kernels import tuning  # no triton import: the workers set the interpreter up first

CASES = {
    # name: (context length (0: a padding row), splits, bias, residual, rotary)
    "split3-rope": (250, 3, False, True, True),
    "unsplit-bias": (130, 1, True, True, False),
    "split4-no-residual-rope": (16, 4, False, False, True),
    "one-key-split3-rope": (1, 3, False, True, True),
    "padding-row-split3-bias": (0, 3, True, True, True),
}
# bf16 runs on the GPU only (tests/gpu): Triton 3.6's interpreter gets bf16 tile dots wrong
# (the unfused decode kernel too: errors of 1e8 in the interpreter, none on the H200).


def _run_case(name: str) -> None:
    import torch

    import atom.kernels.triton_attention as tk
    import atom.kernels.triton_decode_o_proj as fused
    from atom.kernels.testing import paged_reference, random_paged_batch
    from atom.layers.norm_linear import reference_projection

    ctx, splits, has_bias, has_res, use_rope = CASES[name]
    heads, kv_heads, dim, hidden = 4, 2, 16, 40  # hidden not a multiple of the strip
    b = random_paged_batch(q_lens=[1], ctx_lens=[max(ctx, 1)], num_heads=heads,
                           num_kv_heads=kv_heads, head_dim=dim, max_blocks=16, seed=ctx + splits)
    if ctx == 0:  # the bucket's one row is padding: no keys, no slot
        b.context_lens[0], b.slot_mapping[0] = 0, -1
    gen = torch.Generator().manual_seed(splits)
    weight = torch.randn(hidden, heads * dim, generator=gen) / 8
    bias = torch.randn(hidden, generator=gen) if has_bias else None
    residual = torch.randn(1, hidden, generator=gen) if has_res else None
    positions = torch.tensor([max(ctx - 1, 0)]) if use_rope else None
    attn_ref, kc_ref, vc_ref, rope = paged_reference(b, heads, 0.25, positions)
    proj_ref = reference_projection(attn_ref, weight, bias, residual=residual)
    out = torch.full_like(b.q, float("nan"))
    proj = torch.full((1, hidden), float("nan"))
    for launch in range(2):  # the second launch finds the counters re-armed
        kc, vc = b.k_cache.clone(), b.v_cache.clone()
        fused.decode_attention_o_proj_triton(
            b.q, kc, vc, out, b.context_lens, b.block_tables, 0.25, heads, weight, bias,
            residual, proj, num_splits=splits, rope=rope,
            new_kv=tk.StepKV(b.k, b.v, b.slot_mapping))
        cpu = torch.device("cpu")
        assert fused.SYNC_COUNTERS.held(cpu), f"launch {launch}"
        assert not fused.SYNC_COUNTERS.armed(cpu), f"launch {launch}"
        assert not tk.ARRIVALS.armed(cpu)
    torch.testing.assert_close(kc, kc_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(vc, vc_ref, rtol=0, atol=0)
    torch.testing.assert_close(out, attn_ref, rtol=1e-4, atol=1e-4)
    if ctx == 0:
        assert (out == 0).all(), "a padding row attends to nothing"
    torch.testing.assert_close(proj, proj_ref, rtol=1e-4, atol=1e-4)


# The fast tier keeps one split case with rotary and a residual; the others take 8-11 s each.
@pytest.mark.parametrize("name", [
    name if name == "split3-rope" else pytest.param(name, marks=pytest.mark.slow)
    for name in sorted(CASES)
])
def test_fused_decode_o_proj_in_interpreter(name: str) -> None:
    from atom.kernels.testing import run_interpreter_case

    run_interpreter_case(__file__, name)


def test_fused_kernel_compiles_for_hopper_without_a_gpu() -> None:
    """sm_90 PTX and SASS for the Llama-3.2-1B shapes (bf16, rotary, own KV store, 24 splits):
    the launch must fit an SM without spilling registers."""
    pytest.importorskip("triton")
    import atom.kernels.triton_decode_o_proj as fused
    from atom.kernels.testing import compile_for_hopper, hopper_registers

    sig = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr",
                                "out_ptr")}
    sig |= {"ctx_ptr": "*i32", "bt_ptr": "*i32", "slot_ptr": "*i64", "part_o_ptr": "*fp32",
            "part_ml_ptr": "*fp32", "count_ptr": "*i32", "pos_ptr": "*i64", "cos_ptr": "*fp32",
            "sin_ptr": "*fp32", "scale": "fp32"}
    sig |= {n: "i32" for n in ("stride_q", "stride_k", "stride_v", "stride_o", "stride_bt")}
    sig |= {"w_ptr": "*bf16", "b_ptr": "*bf16", "res_ptr": "*bf16", "y_ptr": "*bf16",
            "sync_ptr": "*i32"}
    sig |= {n: "i32" for n in ("n_attn", "M", "N", "K", "stride_w", "stride_r", "stride_y")}
    consts = {"NUM_KV_HEADS": 8, "GROUP": 4, "BLOCK_H": 16, "GROUP_P2": 4, "HEAD_DIM": 64,
              "BLOCK_D": 64, "BLOCK_SIZE": 16, "TILE_N": 64, "Q_LEN": 1, "NUM_SPLITS": 24,
              "COMBINE_CHUNK": 8, "PRECISION": None, "ROPE": True, "STORE": True,
              "HAS_BIAS": False, "HAS_RES": True,
              "BLOCK_N": tuning.FUSED_O_PROJ_STRIP_BYTES // (2048 * 2), "BLOCK_K": 2048, "LINE": fused._LINE,
              "PRELOAD": True, "PDL": True, "BLOCK_M": 1}
    sig |= {n: "constexpr" for n in consts}
    for block_m in (1, 4):  # one row; a self-draft k = 3 verify of one request (launch_rows)
        compiled = compile_for_hopper(fused._decode_o_proj_kernel, sig,
                                      consts | {"BLOCK_M": block_m},
                                      num_warps=tuning.FUSED_O_PROJ_WARPS)
        regs, spilled = hopper_registers(compiled)
        assert spilled == 0 and regs * 32 * tuning.FUSED_O_PROJ_WARPS <= 65536, (regs, spilled)


if __name__ == "__main__":
    from test_model_attention_triton import _numpy2_scalar_fix

    _numpy2_scalar_fix()
    _run_case(sys.argv[1])
    print(f"ok {sys.argv[1]}")
