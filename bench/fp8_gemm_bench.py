"""The 8B shape's projection GEMMs in bf16 and in FP8, per row count (issue 47).

For each decoder projection of the model (qkv, o, gate_up, down) and each row count: the bf16
product (F.linear, cuBLAS) and the FP8 path --quantization fp8 runs (per-token activation
quantization plus torch._scaled_mm row-wise, atom.quantization.fp8.fp8_linear), and the GEMM
alone (activations quantized beforehand), each timed as CALLS back-to-back calls in one CUDA
graph (common.time_graph: launch costs as in a recorded step). Prints microseconds and TFLOP/s,
the FP8 speed-up, and the layer's total at each row count.

    PYTHONPATH=runtime:operator python3 bench/fp8_gemm_bench.py --out bench/results/fp8/gemm.json
"""

from __future__ import annotations

import argparse
import json
import platform
from typing import Any

import torch

from common import git_commit, projection_shapes, time_graph

ROWS = [1, 16, 64, 256, 1024, 2048, 4096, 8192]


def tflops(rows: int, n: int, k: int, us: float) -> float:
    return 2.0 * rows * n * k / (us * 1e-6) / 1e12


def bench_shape(rows: int, n: int, k: int) -> dict[str, float]:
    from atom.quantization.fp8 import fp8_linear, quantize_rows, quantize_weight

    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
    wq, ws = quantize_weight(w)
    xq, xs = quantize_rows(x)
    scale_b = ws.reshape(1, -1)
    # About 0.2 s a measurement at ~500 TFLOP/s: 5 runs x iters replays x CALLS calls.
    iters = max(1, min(50, int(0.2 / (100 * 2.0 * rows * n * k / 5e14))))
    bf16 = time_graph(lambda: torch.nn.functional.linear(x, w), iters)
    fp8 = time_graph(lambda: fp8_linear(x, wq, ws, None), iters)
    gemm = time_graph(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=scale_b,
                                               out_dtype=torch.bfloat16), iters)
    return {"bf16_us": round(bf16, 2), "fp8_us": round(fp8, 2), "fp8_gemm_us": round(gemm, 2),
            "bf16_tflops": round(tflops(rows, n, k, bf16), 1),
            "fp8_gemm_tflops": round(tflops(rows, n, k, gemm), 1),
            "fp8_speedup": round(bf16 / fp8, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from atom.models.registry import load_model_config

    shapes = projection_shapes(load_model_config(args.model))
    report: dict[str, Any] = {"model": args.model, "card": torch.cuda.get_device_name(),
                              "torch": torch.__version__, "commit": git_commit(short=True),
                              "host": platform.node(), "rows": {}}
    print(f"{'rows':>6} {'proj':>8} {'bf16 us':>9} {'fp8 us':>9} {'gemm us':>9} "
          f"{'bf16 TF/s':>10} {'fp8 TF/s':>9} {'speed-up':>8}")
    for rows in args.rows:
        per = {name: bench_shape(rows, n, k) for name, (n, k) in shapes.items()}
        layer = {key: round(sum(p[key] for p in per.values()), 2)
                 for key in ("bf16_us", "fp8_us", "fp8_gemm_us")}
        report["rows"][rows] = {"projections": per, "layer": layer}
        for name, p in per.items():
            print(f"{rows:>6} {name:>8} {p['bf16_us']:>9.1f} {p['fp8_us']:>9.1f} "
                  f"{p['fp8_gemm_us']:>9.1f} {p['bf16_tflops']:>10.1f} "
                  f"{p['fp8_gemm_tflops']:>9.1f} {p['fp8_speedup']:>8.2f}")
        print(f"{rows:>6} {'layer':>8} {layer['bf16_us']:>9.1f} {layer['fp8_us']:>9.1f} "
              f"{layer['fp8_gemm_us']:>9.1f}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
