"""The fused decode projections (norm before, SiLU gate or residual add after) on the CPU: their logic through Triton's
interpreter against the model's unfused torch math, and an sm_90 compile of every variant.

As in test_model_attention_triton.py, each interpreter case runs this file as a fresh
subprocess with TRITON_INTERPRET=1 (Triton reads the switch when it is first imported).
"""

from __future__ import annotations

import os
import sys

import pytest

from atom.kernels import tuning  # no triton import: the workers set the interpreter up first

# name: (rows, norm, gated, bias, residual); K=96 and N=40 are not multiples of the blocks.
CASES = {
    "1row-norm": (1, True, False, False, False),
    "5rows-norm-bias": (5, True, False, True, False),
    "2rows-norm-gated": (2, True, True, False, False),
    "16rows-norm-gated-bias": (16, True, True, True, False),
    "3rows-residual": (3, False, False, False, True),
    "9rows-residual-bias": (9, False, False, True, True),
    "40rows-norm-gated": (40, True, True, False, False),  # rows_path from here on
    "40rows-residual-bias": (40, False, False, True, True),
    # The preloading kernel (row_gemv), launched as an ordinary launch.
    "row-norm-bias": (1, True, False, True, False),
    "row-residual": (1, False, False, False, True),
    "row-3rows-norm": (3, True, False, False, False),
    "row-8rows-residual-bias": (8, False, False, True, True),
}
K, N = 96, 40
H200 = (132, 233472)  # SMs, shared memory per SM


def _run_case(name: str) -> None:
    import torch

    import atom.kernels.triton_norm_gemv as kernels
    from atom.layers.norm_linear import reference_projection

    sys.path.insert(0, os.path.dirname(__file__))
    from test_model_attention_triton import _numpy2_scalar_fix

    _numpy2_scalar_fix()
    rows, norm, gated, has_bias, has_res = CASES[name]
    gen = torch.Generator().manual_seed(rows)
    out_n = 2 * N if gated else N
    x = torch.randn(rows, K, generator=gen)
    fused = {
        "norm_weight": 1 + 0.1 * torch.randn(K, generator=gen) if norm else None,
        "eps": 1e-6,
        "gated": gated,
        "residual": torch.randn(rows, N, generator=gen) if has_res else None,
    }
    weight = torch.randn(out_n, K, generator=gen) / K ** 0.5
    bias = torch.randn(out_n, generator=gen) if has_bias else None
    ref = reference_projection(x, weight, bias, **fused)
    if name.startswith("row-"):
        out = kernels.row_gemv(x, weight, bias, torch.empty(rows, N), norm_weight=fused["norm_weight"],
                               eps=fused["eps"], residual=fused["residual"])
    else:
        run = kernels.gemv if rows <= tuning.GEMV_MAX_ROWS else kernels.rows_path
        out = run(x, weight, bias, **fused)
    assert out.shape == ref.shape == (rows, N)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(CASES))
def test_norm_gemv_in_interpreter(name: str) -> None:
    from atom.kernels.testing import run_interpreter_case

    run_interpreter_case(__file__, name)


@pytest.mark.slow  # 50 s of ahead-of-time compiles; the interpreted cases stay fast
def test_norm_gemv_kernels_compile_for_hopper_without_a_gpu() -> None:
    """Every constexpr variant the launchers use, in bf16 and fp32, to sm_90 PTX and SASS."""
    pytest.importorskip("triton")
    import atom.kernels.triton_norm_gemv as kernels
    from atom.kernels.testing import compile_for_hopper, hopper_registers

    for dt in ("bf16", "fp32"):
        ptrs = {p: f"*{dt}" for p in ("x_ptr", "nw_ptr", "w_ptr", "b_ptr", "res_ptr", "y_ptr")}
        ints = {p: "i32" for p in ("M", "N", "K")}
        ints_after = {p: "i32" for p in ("stride_x", "stride_w", "stride_r", "stride_y",
                                         "up_offset")}
        flags = ("HAS_NORM", "GATED", "HAS_BIAS", "HAS_RES", "BLOCK_M", "BLOCK_N", "BLOCK_K",
                 "SPLIT", "PRECISION", "RELEASE", "WAIT", "PRELOAD", "STRIP")
        elem = 4 if dt == "fp32" else 2
        sig = {**ptrs, **ints, "eps": "fp32", **ints_after, **{f: "constexpr" for f in flags}}
        # (n, k, norm, gated, bias, residual): the model's four projections, and more; every
        # plan gemv makes for them on an H200 at 1 and 8 rows, early or not.
        for n, k, norm, gated, bias, res in [
                (3072, 2048, True, False, False, False), (3072, 2048, True, False, True, False),
                (2048, 2048, False, False, False, True), (8192, 2048, True, True, False, False),
                (8192, 2048, True, True, True, False), (2048, 8192, False, False, True, True)]:
            for rows, overlap in ((1, False), (1, True), (8, True)):
                plan = kernels.tiled_plan(rows, n, k, gated, elem, overlap, *H200)
                compiled = compile_for_hopper(kernels._norm_gemv_kernel, sig, {
                    "HAS_NORM": norm, "GATED": gated, "HAS_BIAS": bias, "HAS_RES": res,
                    "BLOCK_M": 16, "BLOCK_N": plan.block_n, "BLOCK_K": plan.block_k,
                    "SPLIT": plan.split, "PRECISION": "ieee" if dt == "fp32" else "tf32",
                    "RELEASE": dt == "bf16", "WAIT": plan.early, "PRELOAD": plan.preload,
                    "STRIP": plan.strip},
                    plan.stages, ("N", "K", "up_offset"), plan.warps)
                if plan.early and plan.programs <= H200[0]:  # spread: one program per SM
                    assert compiled.metadata.shared > H200[1] // 2, (n, k, rows, plan)
                # down_proj early in one wave: its first weight tile held across the wait
                assert plan.preload == (plan.early and k == 8192 and rows > 1), (n, k, rows,
                                                                                  plan)
                if plan.preload and dt == "bf16":
                    regs, spilled = hopper_registers(compiled)
                    assert spilled == 0, (n, k, rows, plan, regs)
        row_sig = {**ptrs, **ints, "eps": "fp32", "stride_x": "i32", "stride_w": "i32",
                   "stride_r": "i32", "stride_y": "i32"}
        for norm, bias, res, rows in ((True, False, False, 1), (True, True, False, 1),
                                      (False, False, True, 1), (True, False, False, 8),
                                      (False, False, True, 8)):
            row_consts = {"HAS_NORM": norm, "HAS_BIAS": bias, "HAS_RES": res, "BLOCK_M": rows,
                          "BLOCK_N": 16, "BLOCK_K": 2048 // elem * 2, "PDL": dt == "bf16"}
            compiled = compile_for_hopper(
                kernels._row_gemv_kernel, row_sig | {c: "constexpr" for c in row_consts},
                row_consts, num_warps=tuning.ROW_WARPS)
            if dt == "bf16":  # Llama-3.2-1B's qkv and o: the strip in registers, no spills
                regs, spilled = hopper_registers(compiled)
                assert spilled == 0 and regs * 32 * tuning.ROW_WARPS <= 65536, (regs, spilled)
        compile_for_hopper(kernels._rmsnorm_kernel,
              {"x_ptr": f"*{dt}", "nw_ptr": f"*{dt}", "y_ptr": f"*{dt}", "K": "i32",
               "eps": "fp32", "stride_x": "i32", "stride_y": "i32", "BLOCK": "constexpr"},
              {"BLOCK": 2048})
        compile_for_hopper(kernels._silu_mul_kernel,
              {"gu_ptr": f"*{dt}", "y_ptr": f"*{dt}", "N": "i32", "stride_gu": "i32",
               "stride_y": "i32", "BLOCK": "constexpr"}, {"BLOCK": 1024})


def test_tiled_plan_launches_early_as_measured_on_the_h200() -> None:
    """One row: every projection early (gate_up in 256 strips of 32, about two per SM). Eight
    and sixteen rows: only single-wave launches (gate_up in 128 strips of 64), each over half
    an SM's shared memory. No overlap: ordinary launches in the default strips."""
    pytest.importorskip("triton")
    from atom.kernels.triton_norm_gemv import tiled_plan
    from atom.kernels.tuning import GEMV_MAX_ROWS as MAX_ROWS
    from atom.kernels.tuning import ONE_WAVE_PDL_MAX_ROWS

    assert ONE_WAVE_PDL_MAX_ROWS == MAX_ROWS == 16
    shapes = {"qkv": (3072, 2048, False), "o": (2048, 2048, False),
              "gate_up": (8192, 2048, True), "down": (2048, 8192, False)}

    def plans(rows: int, overlap: bool = True, sms: int = H200[0]) -> dict[str, object]:
        return {name: tiled_plan(rows, n, k, gated, 2, overlap, sms, H200[1])
                for name, (n, k, gated) in shapes.items()}

    one = plans(1)
    assert all(p.early for p in one.values())
    assert (one["gate_up"].programs, one["gate_up"].block_n) == (256, 32)
    assert all(p.strip == p.block_n and not p.preload for p in one.values())
    for rows in (2, 8, 16):
        many = plans(rows)
        assert all(p.early for p in many.values()), rows
        assert (many["gate_up"].programs, many["gate_up"].block_n) == (128, 64)
        # qkv's 3072 rows: 128 strips of 24 (tiles of 32) cover more SMs than 96 of 32
        assert (many["qkv"].programs, many["qkv"].strip, many["qkv"].block_n) == (128, 24, 32)
        assert all(p.strip == p.block_n for name, p in many.items() if name != "qkv")
        assert [name for name, p in many.items() if p.preload] == ["down"]
        for name, plan in many.items():
            n, k, gated = shapes[name]
            stage = (16 + plan.block_n * (2 if gated else 1)) * plan.block_k * 2
            assert (plan.stages - 1) * stage > H200[1] // 2, (name, rows)
    ordinary = plans(8, overlap=False)
    assert not any(p.early or p.preload for p in ordinary.values())
    assert all(p.strip == p.block_n for p in ordinary.values())
    assert ordinary["gate_up"].block_n == 32 and ordinary["o"].stages == 6
    # A device of 64 SMs: o_proj's 128 programs are two waves, so it is not launched early,
    # nor is gate_up, which keeps its default strips.
    small = plans(8, sms=64)
    assert not small["o"].early and plans(1, sms=64)["o"].early
    assert not small["gate_up"].early and small["gate_up"].block_n == 32


if __name__ == "__main__":
    _run_case(sys.argv[1])
    print(f"ok {sys.argv[1]}")
