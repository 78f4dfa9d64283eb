"""Can a Triton GEMV beat cuBLAS on the decode-sized projections? (issue 5; the answer on an
H200 was no, docs/performance.md; the engine's fused kernel, atom.kernels.triton_norm_gemv, came
later.)

The kernel: each program streams a strip of BLOCK_N weight rows across K once, with the rows of
x (padded to 16) as the other operand of a tensor-core dot. For each projection of the
Llama-3.2-1B shape and each row count, times every configuration in a CUDA graph of 20 back-to-back calls (launch cost as in a decode
graph) and F.linear (cuBLAS) the same way; checks each result against F.linear.

    python bench/gemv_sweep.py --out sweep.json [--rows 1 8 16]
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from common import MODEL, projection_shapes, time_graph


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gemv(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int, int],
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= 16, K] @ weight[N, K]^T (+ bias) -> [M, N]; config (BLOCK_N, BLOCK_K, warps,
    stages)."""
    m, k = x.shape
    n = weight.shape[0]
    block_n, block_k, warps, stages = config
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )
    return y


def main() -> None:
    from atom.models.registry import load_model_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    args = ap.parse_args()
    shapes = projection_shapes(load_model_config(MODEL))
    configs = list(itertools.product([16, 32, 64], [128, 256, 512], [4, 8], [2, 3, 4, 5]))
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "shapes": {}}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        per: dict[str, Any] = {}
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w)
            cublas = time_graph(lambda x=x, w=w: F.linear(x, w))
            timings = []
            for cfg in configs:
                try:
                    y = gemv(x, w, cfg)
                    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)
                    timings.append((time_graph(lambda c=cfg, x=x, w=w: gemv(x, w, c)), cfg))
                except Exception as exc:  # noqa: BLE001 - a config too big for the SM: skip
                    print(f"  {name} m={m} {cfg}: {type(exc).__name__}", flush=True)
            timings.sort()
            best_us, best_cfg = timings[0]
            per[str(m)] = {"cublas_us": round(cublas, 2), "best_us": round(best_us, 2),
                           "best": list(best_cfg),
                           "all": [[round(t, 2), list(cf)] for t, cf in timings]}
            gbps = n * k * 2 / (best_us * 1e-6) / 1e12
            print(f"{name:>8} [{n}x{k}] m={m:>2}: cuBLAS {cublas:7.2f} us, gemv best "
                  f"{best_us:7.2f} us ({gbps:.2f} TB/s) {best_cfg}", flush=True)
        # One configuration per shape: the least total time over the row counts.
        totals: dict[tuple, float] = {}
        for m in args.rows:
            for t, cf in per[str(m)]["all"]:
                totals[tuple(cf)] = totals.get(tuple(cf), 0.0) + t
        chosen = min(totals, key=totals.get)
        per["chosen"] = list(chosen)
        per["chosen_us"] = {str(m): dict((tuple(cf), t) for t, cf in per[str(m)]["all"])[chosen]
                            for m in args.rows}
        print(f"{name:>8}: chosen {chosen} -> {per['chosen_us']}", flush=True)
        result["shapes"][name] = {"n": n, "k": k, **per}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
